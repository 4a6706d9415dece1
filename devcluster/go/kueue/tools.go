//go:build tools

// Package tools pins Kueue (issue 16): its controller manager, run by `devcluster.py kueue-up` with its
// CRDs and webhooks read from the same module version.
package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"
