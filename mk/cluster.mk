# Local Kubernetes control plane built from upstream Go modules
# (docs/local-cluster.md). Included from the main Makefile, which defines
# PY (the venv's python) and the `venv` target.

CLUSTER_DIR ?= .cluster
CLUSTER_NODES ?= 4
CLUSTER_PY = PYTHONPATH=operator $(PY)

.PHONY: cluster cluster-up cluster-down cluster-status

## cluster: build etcd, kube-apiserver/-controller-manager/-scheduler, kubectl, kwok, helm once (cached in ~/.cache/epd-operator)
cluster: venv
	$(CLUSTER_PY) -m epd_localcluster.build

## cluster-up: start the local control plane with fake GPU nodes in $(CLUSTER_DIR)
cluster-up: cluster
	$(CLUSTER_PY) -m epd_localcluster up --dir $(CLUSTER_DIR) --nodes $(CLUSTER_NODES)

## cluster-down: stop the local control plane in $(CLUSTER_DIR)
cluster-down: venv
	$(CLUSTER_PY) -m epd_localcluster down --dir $(CLUSTER_DIR)

## cluster-status: show what runs in $(CLUSTER_DIR)
cluster-status: venv
	$(CLUSTER_PY) -m epd_localcluster status --dir $(CLUSTER_DIR)
