#!/usr/bin/env bash
# `make controlplane`: builds kube-apiserver, kube-controller-manager, kubectl (for the
# tests of config/systemd/kubeconfig.sh) (k8s.io/kubernetes, pinned in kube/go.mod) and
# etcd (go.etcd.io/etcd/server/v3, pinned in etcd/go.mod) from Go modules into
# .cache/controlplane/<kube>-<etcd>/bin. Does nothing when that pinned build is there.
# Test infrastructure only: canaryd itself is pure Python.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
kube=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$here/kube/go.mod")
etcd=$(sed -n 's/^require go.etcd.io\/etcd\/server\/v3 \(v[0-9.]*\)$/\1/p' "$here/etcd/go.mod")
out=${CANARYD_CONTROLPLANE_DIR:-$root/.cache/controlplane/$kube-$etcd}
if [ -x "$out/bin/kube-apiserver" ] && [ -x "$out/bin/kube-controller-manager" ] \
	&& [ -x "$out/bin/kubectl" ] \
	&& [ -x "$out/bin/etcd" ] && [ -f "$out/built" ]; then
	echo "control plane $kube + etcd $etcd: already built in $out"
	exit 0
fi
command -v go >/dev/null || { echo "make controlplane needs Go (go.dev/doc/install)" >&2; exit 2; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly
started=$(date +%s)
mkdir -p "$out/bin"
minor=${kube#v1.}; minor=${minor%%.*}
# Upstream stamps the version (hack/lib/version.sh); without it /version says v0.0.0-master.
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$kube"
ldflags+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
echo "building kube-apiserver, kube-controller-manager and kubectl $kube (a cold build takes minutes)"
(cd "$here/kube" && go build -trimpath -ldflags "$ldflags" -o "$out/bin/" \
	k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
	k8s.io/kubernetes/cmd/kubectl)
echo "building etcd $etcd"
(cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$out/bin/etcd" .)
echo "$kube $etcd" > "$out/built"
echo "control plane built in $out in $(( $(date +%s) - started )) s"
