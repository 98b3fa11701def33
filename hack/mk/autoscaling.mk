# The autoscaling stack on the local cluster (docs/local-cluster.md, "Autoscaling stack"): KEDA
# and the Prometheus its scaler queries, built from their Go modules and installed on demand
# only. Included from the main Makefile, which defines PY (the venv's python) and `venv`.

.PHONY: autoscaling autoscaling-up autoscaling-down autoscaling-binaries demo-autoscale bench-autoscale

## autoscaling: build KEDA (operator, metrics API server, webhooks) and Prometheus from their Go modules, and their images (cached in $EPD_CACHE)
autoscaling: venv
	$(PY) -m epd_dev.localcluster.build --autoscaling
	$(PY) -m epd_dev.images build keda keda-metrics-apiserver keda-admission-webhooks prometheus

## autoscaling-up: install KEDA (its own manifests) and Prometheus on the running real node of .cluster/ (CLUSTER_DIR=)
autoscaling-up: autoscaling
	$(PY) -m epd_dev.localcluster.autoscaling up --dir $(CLUSTER_DIR)

## autoscaling-down: remove KEDA and Prometheus from .cluster/ (CLUSTER_DIR=)
autoscaling-down: venv
	$(PY) -m epd_dev.localcluster.autoscaling down --dir $(CLUSTER_DIR)

## autoscaling-binaries: build KEDA and Prometheus from their Go modules only (make test builds them beside the cluster's)
autoscaling-binaries: venv
	$(PY) -m epd_dev.localcluster.build --autoscaling

## demo-autoscale: encoders sized by demand on the real node (KEDA, Prometheus, the HPA controller; stand-in engines): a step of pictures grows the encoder pool 1 -> 3 -> 1 (make demo-down stops it)
demo-autoscale: venv
	$(PY) -m epd_dev.demo_autoscale up

## bench-autoscale: the demo-autoscale scenario measured once: the step to the new encoder serving, the prime p90 before, during and after, the pool's size over time (bench-autoscale.png, bench-autoscale.json); everything stopped at the end
bench-autoscale: venv
	$(PY) -m epd_dev.demo_autoscale up --plot bench-autoscale.png --json bench-autoscale.json --down
