# The EPD proxy and gateway (operator/epd_dataplane, docs/proxy.md, docs/gateway-api.md). Included from the main Makefile,
# which defines PY (the venv's python) and the `venv` target.
# Pass options through PROXY_BENCH_ARGS, e.g. PROXY_BENCH_ARGS="--profile proxy.svg".

PROXY_BENCH_ARGS ?=
EPP_BENCH_ARGS ?=

.PHONY: bench-proxy bench-epp test-proxy

## bench-proxy: the proxy's added latency, throughput and RSS in front of vllm-router, against the router alone, with stand-in engines and a real one (about 8 min)
bench-proxy: venv
	$(PY) -m epd_dev.vllm.envs install serve router
	$(PY) -m epd_dev.bench.bench_proxy $(PROXY_BENCH_ARGS)

## test-proxy: the proxy's tests against stand-ins (no cluster, no vLLM)
test-proxy: venv
	$(PY) -m pytest -q tests/proxy

## bench-epp: the endpoint picker behind a real Envoy against the EPD gateway's own port (stand-in units; about 2 min)
bench-epp: venv
	$(PY) -m epd_dev.vllm.envs install envoy
	$(PY) -m epd_dev.bench.bench_epp $(EPP_BENCH_ARGS)
