#!/usr/bin/env bash
# `make node`'s Go builds: the kubelet (k8s.io/kubernetes, pinned in
# ../controlplane/kube/go.mod, the module `make controlplane` builds from, so the two
# share Go's build cache) and the pod sandbox's pause process (pause/, no dependency)
# into .cache/node/<kube>/bin. Does nothing when that pinned build is already there.
# A cold kubelet build takes minutes and about 3 GB of Go's build cache. Test
# infrastructure only: canaryd itself is pure Python.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
kubemod=$root/tests/controlplane/kube
kube=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$kubemod/go.mod")
out=${CANARYD_NODE_DIR:-$root/.cache/node/$kube}
if [ -x "$out/bin/kubelet" ] && [ -x "$out/bin/pause" ] && [ -f "$out/built" ]; then
	echo "kubelet $kube and pause: already built in $out"
	exit 0
fi
command -v go >/dev/null || { echo "make node needs Go (go.dev/doc/install)" >&2; exit 2; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly
started=$(date +%s)
mkdir -p "$out/bin"
minor=${kube#v1.}; minor=${minor%%.*}
# Stamped as tests/controlplane/build.sh stamps the control plane (hack/lib/version.sh).
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$kube"
ldflags+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
# providerless: no in-tree cloud providers, as upstream's own node images build it.
echo "building kubelet $kube (a cold build takes minutes)"
(cd "$kubemod" && go build -trimpath -tags providerless -ldflags "$ldflags" \
	-o "$out/bin/kubelet" k8s.io/kubernetes/cmd/kubelet)
echo "building pause"
(cd "$here/pause" && go build -trimpath -ldflags "-s -w" -o "$out/bin/pause" .)
echo "$kube" > "$out/built"
echo "kubelet and pause built in $out in $(( $(date +%s) - started )) s"
