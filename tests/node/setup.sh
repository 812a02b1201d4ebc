#!/usr/bin/env bash
# `make node`: what tests/node/cluster.py needs to run a single-node cluster here.
#   - Debian's containerd, runc, containernetworking-plugins (the CNI bridge), buildah
#     and debootstrap (the images), iptables (iptables-save: the host is compared
#     before and after): installed with apt-get when missing (root);
#   - the kubelet and the pause process (tests/node/build.sh), beside the control plane
#     of `make controlplane` (built first by make);
#   - the images (tests/node/images.sh): a Debian bookworm base with python3, canaryd
#     from the repository's Dockerfile on it, the pause image.
# Each step is a no-op when its pinned or cached result is there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
packages=(containerd runc containernetworking-plugins buildah debootstrap iptables)
missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	[ "$(id -u)" = 0 ] || { echo "make node: install ${missing[*]} (apt-get, as root)" >&2; exit 2; }
	echo "installing ${missing[*]}"
	apt-get update -q >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
bash "$here/build.sh"
bash "$here/images.sh"
