# The Helm chart (charts/epd-operator, docs/helm.md) and the operator image (Dockerfile).
# Included from the main Makefile, which defines PY (the venv's python) and `venv`; the
# `cluster` target (mk/cluster.mk) builds the helm binary these use.

HELM = $$($(PY) -m epd_dev.localcluster.build --print-bin-dir)/helm
IMAGE ?= epd-operator:$(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}/\1/p' charts/epd-operator/Chart.yaml)

.PHONY: chart-lint chart-golden test-chart image

## chart-lint: helm lint --strict the chart
chart-lint: cluster
	$(HELM) lint --strict charts/epd-operator

## chart-golden: regenerate tests/helm/golden/*.yaml from `helm template` (then review the diff)
chart-golden: cluster
	UPDATE_GOLDEN=1 $(PY) -m pytest -q tests/helm/test_chart.py -k golden

## test-chart: the chart's and the image's tests (lint, golden, install/upgrade/uninstall, RBAC)
test-chart: cluster
	$(PY) -m pytest -q tests/helm

## image: build the operator image (needs Docker; IMAGE=name:tag to override)
image:
	docker build -t $(IMAGE) .
