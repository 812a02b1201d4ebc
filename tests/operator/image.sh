#!/usr/bin/env bash
# The upstream operator's image for `make e2e-operator` on the real node: the jars
# `make operator` built, in the layout of the operator's own Dockerfile (release-1.15.0:
# /flink-kubernetes-operator/<jars>, /opt/flink/plugins, /opt/flink/log/log4j,
# /docker-entrypoint.sh, user flink 9999), on a Debian bookworm JRE base made here with
# debootstrap (minbase + openjdk-17-jre-headless; upstream's base is
# eclipse-temurin:17-jre-jammy, which no registry here serves). Built with Debian's
# buildah (vfs, chroot isolation) into .cache/node/images/flink-kubernetes-operator.tar
# as localhost/flink-kubernetes-operator:<version>, which the test imports into
# containerd (imagePullPolicy Never). A no-op once built for the same jars.
# Test infrastructure only: nothing of the operator is kept in this repository.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
ref=${FLINK_OPERATOR_REF:-release-1.15.0}
flink=${FLINK_VERSION:-1.20.0}
build=${CANARYD_OPERATOR_DIR:-$root/.cache/operator/$ref-flink$flink}
cache=${CANARYD_NODE_CACHE:-$root/.cache/node}
out=$cache/images
command -v buildah >/dev/null || { echo "needs buildah: run make node" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "needs debootstrap: run make node" >&2; exit 2; }
mkdir -p "$out"
buildah=(buildah --storage-driver vfs --root "$cache/containers/storage" --runroot "$cache/containers/run")
t() { echo "== $(date +%T) $*"; }

suite=bookworm
# bash and coreutils' timeout are in minbase (the sidecar's exec probe needs both);
# libjemalloc-dev as upstream's image installs it (its entrypoint preloads it).
packages=openjdk-17-jre-headless,libjemalloc-dev
base_key=$(echo "$suite $packages" | sha256sum | cut -c1-12)
base=localhost/canaryd-node/$suite-jre:$base_key
if [ ! -f "$out/base-$base_key.built" ]; then
	t "debootstrap $suite with $packages (a few minutes)"
	rootfs=$cache/rootfs-$base_key
	rm -rf "$rootfs"
	mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
	debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "${mirror:-http://deb.debian.org/debian}" >"$cache/debootstrap-jre.log" 2>&1 \
		|| { tail -20 "$cache/debootstrap-jre.log" >&2; exit 1; }
	rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
	ctx=$(mktemp -d)
	tar --numeric-owner -C "$rootfs" -cf "$ctx/rootfs.tar" .
	printf 'FROM scratch\nADD rootfs.tar /\nCMD ["/bin/bash"]\n' > "$ctx/Dockerfile"
	"${buildah[@]}" bud -q --isolation chroot -t "$base" "$ctx" >/dev/null
	rm -rf "$ctx" "$rootfs"
	touch "$out/base-$base_key.built"
fi

[ -f "$build/built" ] || { echo "no operator build in $build: run make operator" >&2; exit 2; }
version=$(sed -n 's/.*<version>\([0-9.]*\)<\/version>.*/\1/p' "$build/src/pom.xml" | sed -n 2p)
[ -n "$version" ] || version=${ref#release-}
image=localhost/flink-kubernetes-operator:$version
inputs=$({ cat "$build/built" "$0"; echo "$base"; } | sha256sum | cut -c1-12)
if [ ! -f "$out/flink-kubernetes-operator-$inputs.tar" ]; then
	t "the operator's image ($image) on $base"
	ctx=$(mktemp -d)
	cp "$build/lib/operator.jar" "$ctx/flink-kubernetes-operator-$version-shaded.jar"
	cp "$build/lib/standalone.jar" "$ctx/flink-kubernetes-standalone-$version.jar"
	cp -r "$build/plugins" "$ctx/plugins"
	cp -r "$build/log4j" "$ctx/log4j"
	cp "$build/src/docker-entrypoint.sh" "$ctx/docker-entrypoint.sh"
	cat > "$ctx/Dockerfile" <<EOF
FROM $base
ENV FLINK_HOME=/opt/flink
ENV FLINK_PLUGINS_DIR=\$FLINK_HOME/plugins
ENV OPERATOR_VERSION=$version
ENV OPERATOR_JAR=flink-kubernetes-operator-\$OPERATOR_VERSION-shaded.jar
ENV KUBERNETES_STANDALONE_JAR=flink-kubernetes-standalone-\$OPERATOR_VERSION.jar
ENV OPERATOR_LIB=\$FLINK_HOME/operator-lib
ENV OPERATOR_LOG=\$FLINK_HOME/log
RUN mkdir -p \$OPERATOR_LIB \$OPERATOR_LOG/log4j \$OPERATOR_LOG/logback /flink-kubernetes-operator
WORKDIR /flink-kubernetes-operator
RUN groupadd --system --gid=9999 flink && useradd --system --home-dir \$FLINK_HOME --uid=9999 --gid=flink flink
COPY flink-kubernetes-operator-$version-shaded.jar flink-kubernetes-standalone-$version.jar ./
COPY plugins \$FLINK_HOME/plugins
COPY log4j \$FLINK_HOME/log/log4j
COPY docker-entrypoint.sh /
RUN chmod 0755 /docker-entrypoint.sh && chown -R flink:flink \$FLINK_HOME /flink-kubernetes-operator
USER flink
ENTRYPOINT ["/docker-entrypoint.sh"]
CMD ["help"]
EOF
	"${buildah[@]}" bud -q --isolation chroot -t "$image" "$ctx" >/dev/null
	rm -f "$out"/flink-kubernetes-operator-*.tar
	"${buildah[@]}" push -q "$image" "docker-archive:$out/flink-kubernetes-operator-$inputs.tar:$image"
	rm -rf "$ctx"
fi
ln -sfn "flink-kubernetes-operator-$inputs.tar" "$out/flink-kubernetes-operator.tar"
echo "$image" > "$out/flink-kubernetes-operator.image"
t "image in $out: flink-kubernetes-operator.tar ($image)"
