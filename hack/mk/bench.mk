# The operator's benchmark and reliability suite on the real local control plane
# (hack/epd_dev/bench/bench_operator.py, chaos.py; results in docs/performance.md).
# Included from the main Makefile, which defines PY and the `cluster` target.
# Pass options through BENCH_ARGS / CHAOS_ARGS, e.g. BENCH_ARGS="--profile .bench-profile".

BENCH_ARGS ?=
CHAOS_ARGS ?=

.PHONY: bench chaos

## bench: reconcile latency against kube-controller-manager, then 1,000 EPDDeployments (about 10 min)
bench: cluster
	$(PY) -m epd_dev.bench.bench_operator $(BENCH_ARGS)

## chaos: 20 kill -9s of the operator and a kube-apiserver kill during a 500-object churn (about 3 min)
chaos: cluster
	$(PY) -m epd_dev.bench.chaos $(CHAOS_ARGS)
