//go:build tools

// Package tools pins the control-plane commands that `make controlplane`
// builds (go build k8s.io/kubernetes/cmd/...); nothing here is compiled.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
)
