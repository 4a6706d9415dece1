//go:build tools

// Package tools pins the one Kubernetes command this module builds: the floor API server.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
)
