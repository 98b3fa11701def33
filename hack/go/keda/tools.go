//go:build tools

// Package tools pins KEDA's three programs so `make autoscaling` builds them from a committed
// go.sum: the operator (keda-operator), the metrics API server serving external.metrics.k8s.io
// (keda-operator-metrics-apiserver) and the admission webhooks (keda-admission-webhooks).
package tools

import (
	_ "github.com/kedacore/keda/v2/cmd/adapter"
	_ "github.com/kedacore/keda/v2/cmd/operator"
	_ "github.com/kedacore/keda/v2/cmd/webhooks"
)
