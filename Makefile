# EPD operator: `make demo` runs it on the embedded local control plane, `make test` tests it.
# Dev tooling lives in hack/ (the epd_dev package, its Go modules and these targets' includes);
# big builds and venvs are cached in $EPD_CACHE (default ~/.cache/epd-operator).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: help venv crds test test-fast demo demo-down

help:
	@echo "make demo        the operator on the local control plane, then a real multimodal request through its pod"
	@echo "make demo-down   stop everything the demo started (engines, operator, control plane)"
	@echo "make test        install everything needed (cached) and run every test"
	@echo "make test-fast   the tests that need neither the cluster nor vLLM"
	@echo "make crds        regenerate crds/ and the chart's CRD from the pydantic models"
	@echo "make cluster     build the control plane binaries (cached in \$$EPD_CACHE)"
	@echo "make vllm-envs   install the vLLM venvs and vllm-router (cached in \$$EPD_CACHE)"
	@echo "make engine-args regenerate each vLLM version's engine argument names from its real parser"
	@echo "make bench       benchmarks; make bench-client; make bench-proxy; make chaos"

# The product (editable, with its test extras) and the dev tools (hack/, never shipped).
$(PY): pyproject.toml hack/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' -e ./hack
	@touch $(PY)

venv: $(PY)

crds: $(PY)
	$(PY) -m epd_operator.cli crds > crds/epddeployments.epd.vime.dev.yaml
	mkdir -p charts/epd-operator/crds
	cp crds/epddeployments.epd.vime.dev.yaml charts/epd-operator/crds/
	$(PY) -c 'from epd_operator.crd import write_api_reference; write_api_reference("docs/api.md")'

# An existing cluster for the operator part (its pods are then not run here): DEMO_KUBECONFIG=<file>,
# or KUBECONFIG=<file> on make's command line. Only there: a KUBECONFIG exported in the shell
# must not send the demo to a real cluster.
DEMO_KUBECONFIG ?= $(if $(filter command line,$(origin KUBECONFIG)),$(KUBECONFIG))
# The unit's router, encoder, prefill and decode listen on DEMO_PORT..+3, the reference on +11.
DEMO_PORT ?= 28000

# Not `cluster`: the demo checks first that the cache can be written, then builds what is missing.
demo: venv
	$(PY) -m epd_dev.demo up --port-base $(DEMO_PORT) $(if $(DEMO_KUBECONFIG),--kubeconfig $(DEMO_KUBECONFIG))

demo-down: venv
	$(PY) -m epd_dev.demo down

test-fast: $(PY)
	$(PY) -m pytest -q -m "not cluster and not vllm"

test: $(PY) cluster vllm-envs
	@start=$$(date +%s); \
	$(PY) -m pytest -q --durations=15; rc=$$?; \
	echo "make test: pytest took $$(( $$(date +%s) - start ))s"; exit $$rc

include hack/mk/*.mk
