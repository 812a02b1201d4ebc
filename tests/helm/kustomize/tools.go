//go:build tools

// Package tools pins the kustomize command that `make helm` builds for the
// post-renderer (go build sigs.k8s.io/kustomize/kustomize/v5); nothing here is
// compiled.
package tools

import (
	_ "sigs.k8s.io/kustomize/kustomize/v5"
)
