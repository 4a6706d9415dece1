//go:build tools

// Package tools pins the Prometheus server the alerting tests run: Debian's 2.42 is built without
// Kubernetes service discovery, which the chart's ServiceMonitor/PodMonitor need.
package tools

import _ "github.com/prometheus/prometheus/cmd/prometheus"
