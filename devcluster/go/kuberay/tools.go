//go:build tools

// Package tools pins the KubeRay operator, which turns RayClusters into pods.
package tools

import _ "github.com/ray-project/kuberay/ray-operator"
