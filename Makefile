# EPD operator: `make demo` runs it on the embedded local control plane, `make test` tests it.
# Dev tooling lives in hack/ (the epd_dev package, its Go modules and these targets' includes);
# big builds and venvs are cached in $EPD_CACHE (default ~/.cache/epd-operator).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: help venv crds lint test test-fast demo demo-down

## help: this list (each target's `## target: text` comment, as kubebuilder's Makefile does)
help:
	@awk 'FNR == 1 { sub(/.*\//, "", FILENAME) } /^## [a-z][a-z-]*:/ { sub(/^## /, ""); split($$0, part, ": "); \
		printf "  make %-16s %s\n", part[1], substr($$0, length(part[1]) + 3) }' $(MAKEFILE_LIST)

# The product (editable, with its test extras) and the dev tools (hack/, never shipped).
$(PY): pyproject.toml hack/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,lint]' -e ./hack
	@touch $(PY)

## venv: the dev venv (.venv): the product editable with its test and lint extras, and hack/'s dev tools
venv: $(PY)

## crds: regenerate crds/ (and the chart's copy) and docs/api.md from the pydantic models
crds: $(PY)
	$(PY) -m epd_operator.cli crds > crds/epddeployments.epd.vime.dev.yaml
	mkdir -p charts/epd-operator/crds
	cp crds/epddeployments.epd.vime.dev.yaml charts/epd-operator/crds/
	$(PY) -c 'from epd_operator.crd import write_api_reference; write_api_reference("docs/api.md")'

# An existing cluster for the operator part (its pods are then not run here): DEMO_KUBECONFIG=<file>,
# or KUBECONFIG=<file> on make's command line. Only there: a KUBECONFIG exported in the shell
# must not send the demo to a real cluster.
DEMO_KUBECONFIG ?= $(if $(filter command line,$(origin KUBECONFIG)),$(KUBECONFIG))

# Not `cluster`: the demo checks first that the cache can be written, then builds what is missing.
## demo: the operator on the local control plane, then a real multimodal request through its pod
demo: venv
	$(PY) -m epd_dev.demo up $(if $(DEMO_KUBECONFIG),--kubeconfig $(DEMO_KUBECONFIG))

## demo-down: remove everything the demo started (the release, the namespace, the real node, the control plane)
demo-down: venv
	$(PY) -m epd_dev.demo down

## lint: ruff (lint and import order), ruff format --check, mypy and the import-linter contracts
lint: $(PY)
	$(VENV)/bin/ruff check operator hack tests
	$(VENV)/bin/ruff format --check operator hack tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

## test-fast: the tests that need neither the cluster nor vLLM
test-fast: $(PY)
	$(PY) -m pytest -q -m "not cluster and not vllm"

## test: lint, then every test (installs what it needs, cached outside the clone)
# The Go builds (CPU: the cluster's, and KEDA's and Prometheus' for the autoscaling tests) and the
# images that need none of them (mostly disk) build side by side.
test: $(PY) lint
	$(MAKE) --no-print-directory -j3 cluster images-vllm autoscaling-binaries
	$(MAKE) --no-print-directory images
	@start=$$(date +%s); \
	$(PY) -m pytest -q --durations=15; rc=$$?; \
	echo "make test: pytest took $$(( $$(date +%s) - start ))s"; exit $$rc

include hack/mk/*.mk
