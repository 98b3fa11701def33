//go:build tools

// Package tools pins the helm CLI so `make cluster` builds it from a
// committed go.sum.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
