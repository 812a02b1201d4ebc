//go:build tools

// Package tools pins the Helm command that `make helm` builds
// (go build helm.sh/helm/v3/cmd/helm); nothing here is compiled.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
