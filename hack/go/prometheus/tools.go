//go:build tools

// Package tools pins promtool so `make cluster` builds it from a committed go.sum: the tests
// check and unit-test the chart's alerting rules with it. The Prometheus server beside it is the
// autoscaling stack's (`make autoscaling`): KEDA's Prometheus scaler queries it. The Prometheus
// Operator's module is pinned for its CustomResourceDefinitions (PodMonitor, ServiceMonitor,
// PrometheusRule), which the build copies out so the tests validate the chart's monitoring
// objects against them.
package tools

import (
	_ "github.com/prometheus-operator/prometheus-operator/cmd/po-rule-migration"
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
