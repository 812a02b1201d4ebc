#!/usr/bin/env bash
# A least-privilege kubeconfig for canaryd outside the cluster (systemd, a bastion host).
#
#   config/systemd/kubeconfig.sh [--rbac DIR] [--namespace NS] [--name-suffix SUFFIX]
#                                [--duration DURATION] [--context CONTEXT] OUTPUT
#
# With your kubectl credentials (KUBECONFIG, else ~/.kube/config; --context), usually an
# admin's, used once:
#  1. kubectl apply --server-side: config/rbac (the ServiceAccount canaryd and the
#     ClusterRole that grants exactly what canaryd uses), or --rbac config/rbac/namespaced
#     (then set WATCH_NAMESPACES=NS in canaryd.env); the ServiceAccount in --namespace
#     (default canaryd), --name-suffix after every name (one ServiceAccount per host);
#  2. kubectl create token: a token of that ServiceAccount, valid --duration (default
#     8760h, a year; at least 10m; the API server may shorten it);
#  3. kubectl config: OUTPUT (mode 0600) holds your current context's server, its CA
#     (embedded: the file stands alone) and that token, nothing of your credentials;
#  4. kubectl auth can-i, with OUTPUT: canaryd's first list is allowed (a new binding
#     takes a moment to reach every API server) and listing secrets is not.
# It prints the ServiceAccount and the token's expiry, never the token: renew it before
# then (run this again, then `systemctl restart canaryd`). Bad input exits 2, naming it;
# a failed kubectl its own status. OUTPUT is replaced only when everything succeeded.
set -euo pipefail

usage() {
	echo "usage: $0 [--rbac DIR] [--namespace NS] [--name-suffix SUFFIX]" \
		"[--duration DURATION] [--context CONTEXT] OUTPUT" >&2
	exit 2
}
fail() {
	echo "kubeconfig.sh: $*" >&2
	exit 2
}

rbac=$(dirname "$0")/../rbac namespace=canaryd suffix='' duration=8760h context='' output=''
while [ $# -gt 0 ]; do
	case $1 in
	--rbac | --namespace | --name-suffix | --duration | --context)
		[ $# -ge 2 ] || usage
		case $1 in
		--rbac) rbac=$2 ;;
		--namespace) namespace=$2 ;;
		--name-suffix) suffix=$2 ;;
		--duration) duration=$2 ;;
		--context) context=$2 ;;
		esac
		shift 2
		;;
	-*) usage ;;
	*)
		[ -z "$output" ] || usage
		output=$1
		shift
		;;
	esac
done
[ -n "$output" ] || usage
[ -f "$rbac/kustomization.yaml" ] || fail "no kustomization.yaml in $rbac: pass --rbac config/rbac"
[[ $namespace =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || fail "--namespace $namespace is not a namespace name"
[[ $suffix =~ ^[-a-z0-9]*$ ]] || fail "--name-suffix $suffix: lower-case letters, digits and '-' only"
# kubectl's durations (Go's) in whole hours, minutes and seconds: 8760h, 90m, 1h30m.
[[ -n $duration && $duration =~ ^(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?$ ]] ||
	fail "--duration $duration: give hours, minutes or seconds, e.g. 8760h"
seconds=$((10#${BASH_REMATCH[2]:-0} * 3600 + 10#${BASH_REMATCH[4]:-0} * 60 + 10#${BASH_REMATCH[6]:-0}))
[ "$seconds" -ge 600 ] || fail "--duration $duration is below the API's 10 minute minimum"
command -v kubectl >/dev/null || fail "kubectl is not on PATH"

account=canaryd$suffix
mkdir -p "$(dirname "$output")"
umask 077
# Beside OUTPUT, so that the last step is a rename: the file is whole or absent.
scratch=$(mktemp -d "$(dirname "$output")/.kubeconfig.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
admin() { kubectl ${context:+--context "$context"} "$@"; }
new() { kubectl --kubeconfig "$scratch/kubeconfig" "$@" >/dev/null; }

# The manifests as kustomize's namespace and nameSuffix make them; a ClusterRoleBinding's
# subject names its namespace, so it is patched.
mkdir "$scratch/rbac" && cp -R "$rbac/." "$scratch/rbac/base"
cat >"$scratch/rbac/kustomization.yaml" <<END
namespace: $namespace
nameSuffix: "$suffix"
resources: [base]
patches:
  - target: {kind: ClusterRoleBinding}
    patch: |-
      - {op: replace, path: /subjects/0/namespace, value: $namespace}
      - {op: replace, path: /subjects/0/name, value: $account}
END
kubectl kustomize "$scratch/rbac" >"$scratch/rbac.yaml" || fail "cannot build $rbac with kustomize"
admin get namespace "$namespace" >/dev/null 2>&1 || admin create namespace "$namespace"
admin apply --server-side --force-conflicts --field-manager=canaryd-kubeconfig -f "$scratch/rbac.yaml"
answer=$(admin create token "$account" --namespace "$namespace" --duration "$duration" \
	-o jsonpath='{.status.expirationTimestamp} {.status.token}')
read -r expires token <<<"$answer"

# Your current context's cluster: its server, its CA, and whatever else reaches it.
for field in server certificate-authority-data insecure-skip-tls-verify tls-server-name proxy-url; do
	value=$(admin config view --minify --flatten -o "jsonpath={.clusters[0].cluster.$field}")
	[ -z "$value" ] || new config set "clusters.canaryd.$field" "$value"
done
new config set-context canaryd --cluster canaryd --user canaryd
new config use-context canaryd
# Not `config set-credentials --token`: a command line is readable by every local user.
# The shell writes the user entry; kubectl merges it in.
printf 'apiVersion: v1\nkind: Config\nusers:\n- name: canaryd\n  user:\n    token: %s\n' \
	"$token" >"$scratch/user"
KUBECONFIG=$scratch/kubeconfig:$scratch/user kubectl config view --flatten >"$scratch/canaryd"

can() { kubectl --kubeconfig "$scratch/canaryd" auth can-i "$@" >/dev/null 2>&1; }
where=(--all-namespaces) # a Role grants the list in its own namespace only
! grep -q '^kind: Role$' "$scratch/rbac.yaml" || where=(--namespace "$namespace")
for _ in $(seq 60); do
	! can list flinkdeployments.flink.apache.org "${where[@]}" || break
	sleep 0.5
done
can list flinkdeployments.flink.apache.org "${where[@]}" ||
	fail "after 30 s the new token still may not list flinkdeployments (${where[*]})"
! can list secrets --all-namespaces ||
	fail "$namespace/$account may list secrets, more than $rbac grants" \
		"(another binding gives it more): no kubeconfig written"

mv "$scratch/canaryd" "$output"
echo "wrote $output (mode 0600): ServiceAccount $namespace/$account, token valid until" \
	"$expires (renew it before then and restart canaryd)"
