# EPD operator: `make demo` runs it on the embedded local control plane, `make test` tests it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export EPD_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/epd-operator

.PHONY: help venv crds test test-fast lint demo demo-down bench chaos

help:
	@echo "make demo        run the operator on the local control plane (kwok-simulated GPU nodes)"
	@echo "make demo-down   stop the demo"
	@echo "make test        install everything needed (cached) and run every test"
	@echo "make test-fast   the tests that need neither the cluster nor vLLM"
	@echo "make crds        regenerate crds/ and the chart's CRD from the pydantic models"
	@echo "make cluster     build the control plane binaries (cached in $(EPD_CACHE))"
	@echo "make vllm-envs   install the vLLM venvs and vllm-router (cached in $(EPD_CACHE))"
	@echo "make engine-args regenerate each vLLM version's engine argument names from its real parser"
	@echo "make bench       benchmarks; make bench-client; make chaos"

$(PY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(PY)

venv: $(PY)

crds: $(PY)
	$(PY) -m epd_operator.cli crds > crds/epddeployments.epd.vime.dev.yaml
	mkdir -p charts/epd-operator/crds
	cp crds/epddeployments.epd.vime.dev.yaml charts/epd-operator/crds/
	$(PY) -c 'from epd_operator.crd import write_api_reference; write_api_reference("docs/api.md")'

demo: cluster
	$(PY) -m epd_localcluster.demo up

demo-down: venv
	$(PY) -m epd_localcluster.demo down

test-fast: $(PY)
	$(PY) -m pytest -q -m "not cluster and not vllm"

test: $(PY) cluster vllm-envs
	@start=$$(date +%s); \
	$(PY) -m pytest -q --durations=15; rc=$$?; \
	echo "make test: pytest took $$(( $$(date +%s) - start ))s"; exit $$rc

include mk/*.mk
