//go:build tools

// Package tools pins the real node's NetworkPolicy engine, built by
// epd_dev.localcluster.binaries like the node's kubelet and kube-proxy.
package tools

import (
	_ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
)
