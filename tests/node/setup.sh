#!/usr/bin/env bash
# `make node`: what tests/node/cluster.py needs to run a single-node cluster here.
#   - Debian's containerd, runc, containernetworking-plugins (the CNI bridge), buildah
#     and debootstrap (the images), iptables (iptables-save: the host is compared
#     before and after): installed with apt-get when missing (root; tests/node/packages.sh);
#   - the kubelet and the pause process (tests/node/build.sh), beside the control plane
#     of `make controlplane` (built first by make);
#   - the pause image (tests/node/images.sh); canaryd's is make dist's (dist/).
# Each step is a no-op when its pinned or cached result is there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/packages.sh" containerd runc containernetworking-plugins buildah debootstrap iptables
bash "$here/build.sh"
bash "$here/images.sh"
