//go:build tools

// Package tools pins Helm, used to install and test the chart.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
