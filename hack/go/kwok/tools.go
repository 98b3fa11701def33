//go:build tools

// Package tools pins kwok (fake kubelets for the local control plane) so
// `make cluster` builds it from a committed go.sum.
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
)
