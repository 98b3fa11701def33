//go:build tools

// Package tools pins promtool so `make cluster` builds it from a committed go.sum: the tests
// check and unit-test the chart's alerting rules with it.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
