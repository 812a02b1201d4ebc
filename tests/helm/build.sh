#!/usr/bin/env bash
# `make helm`: builds Helm (helm.sh/helm/v3, pinned in go.mod here), kustomize
# (sigs.k8s.io/kustomize/kustomize/v5, pinned in kustomize/go.mod) and actionlint
# (github.com/rhysd/actionlint, pinned in actionlint/go.mod) from their Go modules into
# .cache/{helm,kustomize,actionlint}/<version>/bin, for the tests of charts/canaryd (make
# test), the Helm post-renderer (config/helm), `make dist`'s chart package and the release
# workflow's lint (tests/test_release.py). Does nothing when those pinned builds are there.
# Test and release infrastructure only: users bring their own helm, and kustomize or kubectl.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
helm=$(sed -n 's/^require helm.sh\/helm\/v3 \(v[0-9.]*\)$/\1/p' "$here/go.mod")
kustomize=$(sed -n 's/^require sigs.k8s.io\/kustomize\/kustomize\/v5 \(v[0-9.]*\)$/\1/p' \
	"$here/kustomize/go.mod")
actionlint=$(sed -n 's/^require github.com\/rhysd\/actionlint \(v[0-9.]*\)$/\1/p' "$here/actionlint/go.mod")
helm_out=${CANARYD_HELM_DIR:-$root/.cache/helm/$helm}
kustomize_out=${CANARYD_KUSTOMIZE_DIR:-$root/.cache/kustomize/$kustomize}
actionlint_out=$root/.cache/actionlint/$actionlint
built() { [ -x "$1/bin/$2" ] && [ -f "$1/built" ]; }
if built "$helm_out" helm && built "$kustomize_out" kustomize && built "$actionlint_out" actionlint; then
	echo "helm $helm, kustomize $kustomize and actionlint $actionlint: already built in .cache"
	exit 0
fi
command -v go >/dev/null || { echo "make helm needs Go (go.dev/doc/install)" >&2; exit 2; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly
if ! built "$helm_out" helm; then
	started=$(date +%s)
	mkdir -p "$helm_out/bin"
	# As Helm's own Makefile stamps it: its version, and the Kubernetes version it
	# renders for by default (one minor above its client-go's v0.X: 1.X).
	client_go=$(cd "$here" && go list -f '{{.Version}}' -m k8s.io/client-go)
	minor=$(echo "$client_go" | cut -d. -f2)
	ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm"
	ldflags+=" -X helm.sh/helm/v3/internal/version.metadata="
	ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
	ldflags+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1"
	ldflags+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor"
	ldflags+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1"
	ldflags+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor"
	echo "building helm $helm (a cold build takes a few minutes)"
	(cd "$here" && go build -trimpath -ldflags "$ldflags" -o "$helm_out/bin/helm" helm.sh/helm/v3/cmd/helm)
	echo "$helm" > "$helm_out/built"
	echo "helm built in $helm_out in $(( $(date +%s) - started )) s"
fi
if ! built "$kustomize_out" kustomize; then
	started=$(date +%s)
	mkdir -p "$kustomize_out/bin"
	echo "building kustomize $kustomize"
	(cd "$here/kustomize" && go build -trimpath -ldflags "-s -w" -o "$kustomize_out/bin/kustomize" \
		sigs.k8s.io/kustomize/kustomize/v5)
	echo "$kustomize" > "$kustomize_out/built"
	echo "kustomize built in $kustomize_out in $(( $(date +%s) - started )) s"
fi
if ! built "$actionlint_out" actionlint; then
	mkdir -p "$actionlint_out/bin"
	echo "building actionlint $actionlint"
	(cd "$here/actionlint" && go build -trimpath -ldflags "-s -w" \
		-o "$actionlint_out/bin/actionlint" github.com/rhysd/actionlint/cmd/actionlint)
	echo "$actionlint" > "$actionlint_out/built"
	echo "actionlint built in $actionlint_out"
fi
