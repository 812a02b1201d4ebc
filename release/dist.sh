#!/usr/bin/env bash
# `make dist`: every release artifact into dist/, from the files git tracks (and new ones
# it does not ignore), with every timestamp the commit's (SOURCE_DATE_EPOCH):
#   flink_canaryd-V-py3-none-any.whl, flink_canaryd-V.tar.gz   PyPI's (canaryd there is
#       another project; the command and the import package are canaryd)
#   canaryd-V.tgz          the chart (helm package; version and appVersion: V)
#   canaryd-V.oci.tar      the image, an OCI archive of an index of one image per platform
#       (PLATFORMS, default this machine's), named ghcr.io/ORG/canaryd:V, with the
#       org.opencontainers.image.* labels: the Dockerfile built with buildah on a Debian
#       bookworm base made with debootstrap (the Dockerfile's ARG PYTHON_IMAGE)
#   canaryd-V.cdx.json     CycloneDX SBOM of the image's Python environment (cyclonedx-py,
#       run in a container of the image, off the image)
#   SHA256SUMS             of all of the above
# V is canaryd.__version__, the one place it is written. ORG (default ORG, the docs'
# placeholder) names the registry and the repository in the labels and the chart.
# Needs root (buildah and debootstrap, installed with apt-get when missing), Helm of make helm.
# What varies with the day it is built: Debian's packages in the base and the versions of
# canaryd's dependencies that pip resolves, which the SBOM lists.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"
org=${ORG:-ORG}
platforms=${PLATFORMS:-linux/$(dpkg --print-architecture 2>/dev/null || echo amd64)}
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' canaryd/__init__.py)
revision=$(git rev-parse HEAD)
[ -z "$(git status --porcelain --untracked-files=no)" ] || revision+=-dirty
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
image=ghcr.io/${org,,}/canaryd  # the registry takes lowercase names only
repository=https://github.com/$org/canaryd
helm=$root/.cache/helm/$(sed -n 's/^require helm.sh\/helm\/v3 \(v[0-9.]*\)$/\1/p' tests/helm/go.mod)/bin/helm
cache=${CANARYD_IMAGE_CACHE:-$root/.cache/image}
buildah=(buildah --storage-driver vfs --root "$cache/containers/storage" --runroot "$cache/containers/run")
tools=$cache/tools
t() { echo "== $(date +%T) $*"; }
# pip in the builds reaches PyPI as this machine's pip does; nothing of these stays.
mounts=()
for f in /etc/pip.conf /etc/ssl/certs/ca-certificates.crt; do
	[ -f "$f" ] && mounts+=(--volume "$f:$f:ro")
done

# Nothing to do when dist/ is what these inputs gave last time (make e2e-node after make dist).
key=$({ echo "$org $platforms $SOURCE_DATE_EPOCH $revision"; git ls-files -z -co --exclude-standard \
	| LC_ALL=C sort -z | xargs -0 sha256sum 2>/dev/null || true; } | sha256sum | cut -c1-16)
if [ "$(cat "$cache/dist.key" 2>/dev/null)" = "$key" ] && (cd dist 2>/dev/null && sha256sum --quiet -c SHA256SUMS); then
	t "dist/ is up to date ($key)"
	exit 0
fi
bash tests/node/packages.sh buildah debootstrap debian-archive-keyring
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -z -co --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -x -C "$src"
find "$src" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
rm -rf dist && mkdir dist

t "wheel and sdist of flink-canaryd $version"
# Run as python -m: a venv's scripts name the path it was made at (a moved checkout).
"$tools/bin/python" -c 'import build' 2>/dev/null \
	|| { rm -rf "$tools" && python3 -m venv "$tools" && "$tools/bin/python" -m pip install -q build==1.3.0; }
"$tools/bin/python" -m build --outdir dist "$src" >/dev/null
# sdist: tar's order and gzip's header made independent of the machine.
sdist=dist/flink_canaryd-$version.tar.gz
mkdir "$src/sdist" && tar -xzmf "$sdist" -C "$src/sdist"
tar -C "$src/sdist" --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
	-cf - "flink_canaryd-$version" | gzip -9n > "$sdist"

t "chart canaryd $version"
chart=$src/charts/canaryd
bash "$here/stamp-chart.sh" "$chart" "$org" "$version" "$image"
"$helm" package "$chart" --version "$version" --app-version "$version" -d "$src/chart" >/dev/null
# helm package dates its files now: repacked as the sdist is.
mkdir "$src/chart/x" && tar -xzmf "$src/chart/canaryd-$version.tgz" -C "$src/chart/x"
tar -C "$src/chart/x" --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
	-cf - canaryd | gzip -9n > "dist/canaryd-$version.tgz"

"${buildah[@]}" manifest rm "$image:$version" >/dev/null 2>&1 || true
"${buildah[@]}" manifest create "$image:$version" >/dev/null
suite=bookworm
packages=python3,python3-venv,python-is-python3
for platform in $platforms; do
	arch=${platform#linux/}
	recipe='FROM scratch\nADD rootfs.tar /\nCMD ["/usr/bin/python3"]\n'
	key=$(echo "$suite $packages $arch $recipe timestamp 0" | sha256sum | cut -c1-12)
	base=localhost/canaryd-base/$suite-python:$key
	if ! "${buildah[@]}" inspect --type image "$base" >/dev/null 2>&1; then
		t "debootstrap $suite $arch with $packages (a few minutes)"
		rootfs=$cache/rootfs-$key
		rm -rf "$rootfs"
		# This machine's Debian mirror if it is Debian (CI's Ubuntu: Debian's own, its keyring).
		mirror=http://deb.debian.org/debian
		if grep -qx ID=debian /etc/os-release; then
			mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
		fi
		keyring=/usr/share/keyrings/debian-archive-keyring.gpg
		debootstrap --arch="$arch" --variant=minbase --include="$packages" --keyring="$keyring" \
			"$suite" "$rootfs" "${mirror:-http://deb.debian.org/debian}" >"$cache/debootstrap.log" 2>&1 \
			|| { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
		rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
		mkdir "$src/base-$arch"
		tar --numeric-owner -C "$rootfs" -cf "$src/base-$arch/rootfs.tar" .
		printf '%b' "$recipe" > "$src/base-$arch/Dockerfile"
		# Its dates (files, history) are 1970's: only its Debian packages change from day to day.
		"${buildah[@]}" bud -q --isolation chroot --platform "$platform" --identity-label=false \
			--timestamp 0 -t "$base" "$src/base-$arch" >/dev/null
		rm -rf "$rootfs"
	fi
	t "image $image:$version for $platform"
	"${buildah[@]}" bud -q --isolation chroot --platform "$platform" "${mounts[@]}" --identity-label=false \
		-t "$image:$version-$arch" --timestamp "$SOURCE_DATE_EPOCH" --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH" \
		--build-arg "PYTHON_IMAGE=$base" --manifest "$image:$version" \
		--label "org.opencontainers.image.title=canaryd" \
		--label "org.opencontainers.image.description=Canary health checks for the Apache Flink Kubernetes Operator; Debian $suite's python3" \
		--label "org.opencontainers.image.version=$version" \
		--label "org.opencontainers.image.revision=$revision" \
		--label "org.opencontainers.image.created=$created" \
		--label "org.opencontainers.image.source=$repository" \
		--label "org.opencontainers.image.url=$repository" \
		--label "org.opencontainers.image.licenses=Apache-2.0" \
		"$src" >/dev/null
done
# An OCI layout, tarred as the packages are (buildah's oci-archive dates its entries now).
"${buildah[@]}" manifest push -q --all "$image:$version" "oci:$src/oci:$image:$version"
tar -C "$src/oci" --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
	-cf "dist/canaryd-$version.oci.tar" oci-layout index.json blobs
"${buildah[@]}" rmi --prune >/dev/null 2>&1 || true  # the images these replaced

t "SBOM of the image's Python environment (cyclonedx-py)"
first=$(echo $platforms | cut -d' ' -f1)
box=$("${buildah[@]}" from -q --pull=never "$image:$version-${first#linux/}")
trap '"${buildah[@]}" rm "$box" >/dev/null; rm -rf "$src"' EXIT
"${buildah[@]}" run --isolation chroot "${mounts[@]}" "$box" -- sh -c \
	'python3 -m venv /tmp/sbom && /tmp/sbom/bin/pip install -q --disable-pip-version-check cyclonedx-bom==7.5.0' >/dev/null
"${buildah[@]}" run --isolation chroot "$box" -- /tmp/sbom/bin/cyclonedx-py environment \
	--output-reproducible --of JSON /opt/canaryd/bin/python > "dist/canaryd-$version.cdx.json"

(cd dist && sha256sum -- * > SHA256SUMS)
mkdir -p "$cache" && echo "$key" > "$cache/dist.key"
t "dist/ (revision $revision, SOURCE_DATE_EPOCH $SOURCE_DATE_EPOCH):"
(cd dist && cat SHA256SUMS)
