//go:build tools

// Package tools pins KWOK, which plays the kubelet for fake nodes.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
