#!/usr/bin/env bash
# `make node`'s images, with Debian's buildah (vfs storage, chroot isolation: no
# daemon) into .cache/node/images as docker archives that tests/node/cluster.py imports
# into containerd:
#   - a base: Debian bookworm with python3 (debootstrap, minbase), the image the
#     Dockerfile's ARG PYTHON_IMAGE names instead of python:3.12-slim-bookworm (no
#     registry here). Cached by its suite and package list.
#   - canaryd: the repository's own Dockerfile on that base, as shipped. Rebuilt when
#     the Dockerfile, pyproject.toml or canaryd/ changed.
#   - pause: the pod sandbox (tests/node/pause, built by tests/node/build.sh).
# pip inside the build reaches PyPI as this machine's pip does: its pip.conf and CA
# bundle are mounted into the build's RUN steps, nothing of them stays in the image.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
kube=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$root/tests/controlplane/kube/go.mod")
cache=${CANARYD_NODE_CACHE:-$root/.cache/node}
out=$cache/images
mkdir -p "$out"
buildah=(buildah --storage-driver vfs --root "$cache/containers/storage" --runroot "$cache/containers/run")
t() { echo "== $(date +%T) $*"; }

suite=bookworm
packages=python3,python3-venv,python-is-python3
base_key=$(echo "$suite $packages" | sha256sum | cut -c1-12)
base=localhost/canaryd-node/$suite-python:$base_key
if [ ! -f "$out/base-$base_key.built" ]; then
	t "debootstrap $suite with $packages (a few minutes)"
	rootfs=$cache/rootfs-$base_key
	rm -rf "$rootfs"
	mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
	debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "${mirror:-http://deb.debian.org/debian}" >"$cache/debootstrap.log" 2>&1 \
		|| { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
	rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
	ctx=$(mktemp -d)
	tar --numeric-owner -C "$rootfs" -cf "$ctx/rootfs.tar" .
	printf 'FROM scratch\nADD rootfs.tar /\nCMD ["/usr/bin/python3"]\n' > "$ctx/Dockerfile"
	"${buildah[@]}" bud -q --isolation chroot -t "$base" "$ctx" >/dev/null
	rm -rf "$ctx" "$rootfs"
	touch "$out/base-$base_key.built"
fi

inputs=$(cd "$root" && { cat Dockerfile pyproject.toml README.md .dockerignore; find canaryd -name '*.py' -o -name py.typed | LC_ALL=C sort | xargs cat; } | sha256sum | cut -c1-12)
if [ ! -f "$out/canaryd-$inputs.tar" ]; then
	t "canaryd's image from the Dockerfile on $base"
	mounts=()
	for f in /etc/pip.conf /etc/ssl/certs/ca-certificates.crt; do
		[ -f "$f" ] && mounts+=(--volume "$f:$f:ro")
	done
	"${buildah[@]}" bud -q --isolation chroot "${mounts[@]}" --build-arg "PYTHON_IMAGE=$base" \
		-t localhost/canaryd:e2e -f "$root/Dockerfile" "$root" >/dev/null
	rm -f "$out"/canaryd-*.tar
	"${buildah[@]}" push -q localhost/canaryd:e2e "docker-archive:$out/canaryd-$inputs.tar:localhost/canaryd:e2e"
fi
ln -sfn "canaryd-$inputs.tar" "$out/canaryd.tar"

if [ ! -f "$out/pause-$kube.tar" ]; then
	t "pause image"
	ctx=$(mktemp -d)
	cp "$cache/$kube/bin/pause" "$ctx/pause"
	printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' > "$ctx/Dockerfile"
	"${buildah[@]}" bud -q --isolation chroot -t localhost/pause:canaryd-node "$ctx" >/dev/null
	"${buildah[@]}" push -q localhost/pause:canaryd-node "docker-archive:$out/pause-$kube.tar:localhost/pause:canaryd-node"
	rm -rf "$ctx"
fi
ln -sfn "pause-$kube.tar" "$out/pause.tar"
t "images in $out: canaryd.tar (localhost/canaryd:e2e), pause.tar (localhost/pause:canaryd-node)"
