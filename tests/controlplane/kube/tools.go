//go:build tools

// Package tools pins the Kubernetes commands the tests build from this module
// (go build k8s.io/kubernetes/cmd/...): kube-apiserver, kube-controller-manager and
// kubectl for `make controlplane`, the kubelet for `make node` (tests/node/build.sh, one
// module so that the builds share Go's build cache); nothing here is compiled.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
