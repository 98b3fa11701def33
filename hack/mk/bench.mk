# The operator's benchmark and reliability suite on the real local control plane
# (hack/epd_dev/bench/bench_operator.py, chaos.py; results in docs/performance.md).
# Included from the main Makefile, which defines PY and the `cluster` target.
# Pass options through BENCH_ARGS / CHAOS_ARGS, e.g. BENCH_ARGS="--profile .bench-profile".

BENCH_ARGS ?=
CHAOS_ARGS ?=
AFFINITY_ARGS ?=

.PHONY: bench bench-affinity chaos

## bench: reconcile latency against kube-controller-manager, then 1,000 EPDDeployments (about 10 min); then bench-affinity
bench: cluster
	$(PY) -m epd_dev.bench.bench_operator $(BENCH_ARGS)
	$(PY) -m epd_dev.bench.bench_affinity $(AFFINITY_ARGS)

## bench-affinity: 1,000 four-turn conversations and GRPO groups over 8 units (stand-ins behind real proxies), through the gateway and at random (about 2 min)
bench-affinity: venv
	$(PY) -m epd_dev.bench.bench_affinity $(AFFINITY_ARGS)

## chaos: 20 kill -9s of the operator and a kube-apiserver kill during a 500-object churn (about 3 min)
chaos: cluster
	$(PY) -m epd_dev.bench.chaos $(CHAOS_ARGS)
