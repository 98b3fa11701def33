# The client library (operator/epd_client, docs/client.md). Included from the main
# Makefile, which defines PY (the venv's python) and the `venv` target.

.PHONY: bench-client test-client

## bench-client: prime_encoder vs raw httpx vs a Vime-style loop against a stand-in server
bench-client: venv
	$(PY) -m epd_dev.bench.bench_client

## test-client: the client library's tests (no cluster, no vLLM)
test-client: venv
	$(PY) -m pytest -q tests/client
