#!/usr/bin/env bash
# `make node`'s pause image (the pod sandbox: tests/node/pause, built by
# tests/node/build.sh), with Debian's buildah (vfs storage, chroot isolation: no daemon)
# into .cache/node/images as a docker archive that tests/node/cluster.py imports into
# containerd. canaryd's image is not built here: the node runs the one `make dist` built
# (dist/canaryd-V.oci.tar, release/dist.sh), the image as released.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
kube=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$root/tests/controlplane/kube/go.mod")
cache=${CANARYD_NODE_CACHE:-$root/.cache/node}
out=$cache/images
mkdir -p "$out"
buildah=(buildah --storage-driver vfs --root "$cache/containers/storage" --runroot "$cache/containers/run")
t() { echo "== $(date +%T) $*"; }

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
t "images in $out: pause.tar (localhost/pause:canaryd-node)"
