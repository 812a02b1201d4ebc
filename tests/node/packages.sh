#!/usr/bin/env bash
# Installs the Debian packages named on the command line with apt-get when they are
# missing (as root), for `make node` (tests/node/setup.sh) and `make dist` (buildah and
# debootstrap: release/dist.sh); a no-op when they are all installed.
set -euo pipefail
missing=()
for p in "$@"; do
	dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	[ "$(id -u)" = 0 ] || { echo "install ${missing[*]} (apt-get, as root)" >&2; exit 2; }
	echo "installing ${missing[*]}"
	apt-get update -q >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
