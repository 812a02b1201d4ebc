#!/usr/bin/env bash
# `make operator`: builds the upstream Apache Flink Kubernetes Operator (the shaded
# operator jar and flink-kubernetes-standalone) from its source with Maven into
# .cache/operator/<ref>. A no-op once that build is there. Test infrastructure only:
# nothing of the operator's source is kept in this repository.
#
#   FLINK_OPERATOR_SRC  a git URL or a local git directory (default: the upstream
#                       repository on GitHub, what a user with internet access gets)
#   FLINK_OPERATOR_REF  the tag or commit to build (default release-1.15.0: the head
#                       pins versions that Maven Central does not serve to every mirror)
#   FLINK_VERSION       the Flink version it is built against (default 1.20.0)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
src=${FLINK_OPERATOR_SRC:-https://github.com/apache/flink-kubernetes-operator.git}
ref=${FLINK_OPERATOR_REF:-release-1.15.0}
flink=${FLINK_VERSION:-1.20.0}
out=${CANARYD_OPERATOR_DIR:-$root/.cache/operator/$ref-flink$flink}
if [ -f "$out/built" ]; then
	echo "flink-kubernetes-operator $ref (Flink $flink): already built in $out"
	exit 0
fi
command -v mvn >/dev/null || { echo "make operator needs Maven and Java 17" >&2; exit 2; }
command -v git >/dev/null || { echo "make operator needs git" >&2; exit 2; }
started=$(date +%s)
rm -rf "$out"
mkdir -p "$out"
echo "checking out $ref from $src"
git clone --quiet --no-checkout "$src" "$out/src"
git -C "$out/src" -c advice.detachedHead=false checkout --quiet "$ref"
echo "building the operator with Maven (a cold build takes 5-15 minutes)"
(cd "$out/src" && mvn -B -ntp -q -pl flink-kubernetes-operator,flink-kubernetes-standalone -am package \
	-Dflink.version="$flink" -DskipTests -Dcheckstyle.skip -Dspotless.skip -Drat.skip \
	-Dmaven.antrun.skip=true -Dmaven.javadoc.skip=true)
op=$out/src/flink-kubernetes-operator/target
mkdir -p "$out/lib"
cp "$op"/flink-kubernetes-operator-*-shaded.jar "$out/lib/operator.jar"
cp "$out"/src/flink-kubernetes-standalone/target/flink-kubernetes-standalone-*[0-9T].jar "$out/lib/standalone.jar"
cp -r "$op/plugins" "$out/plugins"
# The image puts log4j's jars in operator-lib; without them SLF4J is a no-op logger.
if [ -d "$op/log4j" ]; then cp -r "$op/log4j" "$out/log4j"; fi
cp -r "$out/src/helm" "$out/helm"
echo "$ref $flink $(git -C "$out/src" rev-parse HEAD)" > "$out/built"
echo "operator built in $out in $(( $(date +%s) - started )) s"
