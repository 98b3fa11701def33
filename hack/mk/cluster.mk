# Local Kubernetes control plane built from upstream Go modules
# (docs/local-cluster.md). Included from the main Makefile, which defines
# PY (the venv's python) and the `venv` target.

CLUSTER_DIR ?= .cluster
CLUSTER_NODES ?= 4
CLUSTER_PY = $(PY)

.PHONY: cluster cluster-up cluster-down cluster-status

## cluster: build etcd, kube-apiserver/-controller-manager/-scheduler, kubectl, kwok, helm once (cached in $EPD_CACHE)
cluster: venv
	$(CLUSTER_PY) -m epd_dev.localcluster.build

## cluster-up: start the local control plane with fake GPU nodes in .cluster/ (CLUSTER_DIR=)
cluster-up: cluster
	$(CLUSTER_PY) -m epd_dev.localcluster up --dir $(CLUSTER_DIR) --nodes $(CLUSTER_NODES)

## cluster-down: stop the local control plane in .cluster/ (CLUSTER_DIR=)
cluster-down: venv
	$(CLUSTER_PY) -m epd_dev.localcluster down --dir $(CLUSTER_DIR)

## cluster-status: show what runs in .cluster/ (CLUSTER_DIR=)
cluster-status: venv
	$(CLUSTER_PY) -m epd_dev.localcluster status --dir $(CLUSTER_DIR)
