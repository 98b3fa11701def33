# Local Kubernetes control plane built from upstream Go modules
# (docs/local-cluster.md). Included from the main Makefile, which defines
# PY (the venv's python) and the `venv` target.

CLUSTER_DIR ?= .cluster
CLUSTER_NODES ?= 4
# The real node epd-real-0 (containerd, kubelet, kube-proxy here; needs root): 0 skips it.
CLUSTER_REAL_NODES ?= 1
CLUSTER_PY = $(PY)

.PHONY: cluster cluster-up cluster-down cluster-status images images-vllm images-status test-node

## cluster: build etcd, kube-apiserver/-controller-manager/-scheduler, kubectl, kwok, helm once, the real node's kubelet, kube-proxy and kube-router, and promtool (cached in $EPD_CACHE)
cluster: venv
	$(CLUSTER_PY) -m epd_dev.localcluster.build --real-nodes $(CLUSTER_REAL_NODES) --promtool

## cluster-up: start the local control plane with fake GPU nodes and the real node in .cluster/ (CLUSTER_DIR=)
cluster-up: cluster
	$(CLUSTER_PY) -m epd_dev.localcluster up --dir $(CLUSTER_DIR) --nodes $(CLUSTER_NODES) --real-nodes $(CLUSTER_REAL_NODES)

## images: build the real node's images (pause, vllm-cpu, vllm-router, epd-operator, envoy, vllm-standin, and KEDA's and Prometheus' once make autoscaling built them; cached in $EPD_CACHE) and import them into the running node of .cluster/ (CLUSTER_DIR=)
images: vllm-envs cluster
	$(CLUSTER_PY) -m epd_dev.images build --import-into $(CLUSTER_DIR)

## images-vllm: build the images that need no Go build (base, vllm-cpu, vllm-router, epd-operator, envoy, vllm-standin): make test builds them beside the control plane
images-vllm: vllm-envs
	$(CLUSTER_PY) -m epd_dev.images build --without-go

## images-status: each image's ref, content key and whether it is cached
images-status: venv
	$(CLUSTER_PY) -m epd_dev.images status

## test-node: the operator's pods with real vLLM on the real node (tests/node: the demo's unit, faults, the janitor, Pools)
test-node: images
	$(CLUSTER_PY) -m pytest -q -m node tests/node

## cluster-down: stop the local control plane in .cluster/ (CLUSTER_DIR=)
cluster-down: venv
	$(CLUSTER_PY) -m epd_dev.localcluster down --dir $(CLUSTER_DIR)

## cluster-status: show what runs in .cluster/ (CLUSTER_DIR=)
cluster-status: venv
	$(CLUSTER_PY) -m epd_dev.localcluster status --dir $(CLUSTER_DIR)
