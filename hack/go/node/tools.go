//go:build tools

// Package tools pins the real node's commands (kubelet, kube-proxy), built by
// epd_dev.localcluster.binaries like the control plane's.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
