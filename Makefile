# canaryd developer commands. `make test` and `make test-slow` are what CI runs (.ci/run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-slow lint format demo soak bench controlplane e2e node e2e-node operator helm e2e-operator kubeconfig dist clean

install: $(STAMP)

# Re-install only when the dependency list changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check canaryd tests bench
	$(BIN)/ruff format --check canaryd tests bench
	$(BIN)/mypy canaryd
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format canaryd tests bench
	$(BIN)/ruff check --fix canaryd tests bench

# Builds Helm and kustomize first when they are missing (`make helm`: tests/test_chart.py
# lints and renders charts/canaryd with them; a cold build takes about 2 minutes).
test: lint helm
	$(BIN)/python -m pytest -m "not slow"

# The tests marked slow, which take real time: the soak, the kubelet simulation at the
# shipped timings, the wheel installed in a fresh venv, leader hand-overs at the shipped
# lease timings, the 10,000 slow connections. CI runs them after `make test` (.ci/run).
test-slow: $(STAMP) helm
	$(BIN)/python -m pytest -m slow

# canaryd against a local fake cluster with sample canaries; Ctrl-C stops it.
# `make demo CONTROLPLANE=1` plays it on the real control plane of `make e2e`.
demo: $(STAMP) $(if $(CONTROLPLANE),controlplane)
	$(BIN)/python -m $(if $(CONTROLPLANE),tests.controlplane.demo,canaryd.testing.demo)

# The reliability soak at 1,000 cycles (about 4 minutes); figures on stdout and in
# soak-report.json. `make test-slow` runs the same soak at 100 cycles.
soak: $(STAMP)
	CANARYD_SOAK_CYCLES=1000 CANARYD_SOAK_REPORT=soak-report.json \
		$(BIN)/python -m pytest -p no:cacheprovider -s -q tests/test_soak.py

# Benchmarks (not part of `make test`): canaryd and the fake API server as separate
# processes, 1,000 and 10,000 canaries; then canaryd beside a kopf-based prober at 2,000
# (kopf and py-spy installed into .cache/bench-peer-venv, not .venv) and a py-spy profile
# of canaryd; about 8 minutes. Writes docs/PERFORMANCE.md.
bench: $(STAMP)
	$(BIN)/python bench/bench.py --profile --output docs/PERFORMANCE.md

# A real control plane (etcd, kube-apiserver, kube-controller-manager) built from Go
# modules into .cache/controlplane; a no-op once that pinned build is there. Needs Go.
controlplane:
	bash tests/controlplane/build.sh

# canaryd against the real control plane: tests/test_e2e.py (the bug report's reproductions
# and Kubernetes' own behaviour) and tests/test_conformance.py (the fake vs the real
# server). CI runs it after `make test` and `make test-slow`.
e2e: $(STAMP) controlplane helm
	CANARYD_E2E=controlplane $(BIN)/python -m pytest -p no:cacheprovider -rs \
		tests/test_e2e.py tests/test_conformance.py

# A real single-node cluster on this machine (tests/node, as root): the control plane
# above, the kubelet built from the same Go module (k8s.io/kubernetes v1.35.4), Debian's
# containerd, runc and CNI plugins (installed with apt-get when missing), and a pause
# image built with buildah. A no-op once built; cold: about 10 minutes.
node: controlplane
	bash tests/node/setup.sh

# canaryd in real pods under that kubelet (tests/test_e2e_node.py): the image and the
# chart as released (make dist's dist/canaryd-V.oci.tar and dist/canaryd-V.tgz),
# config/standalone applied with kubectl and authenticating in-cluster, the shipped probes
# (canaryd wedged; a stuck delivery path and a write outage through the fault proxy in
# front of the API server), the sidecar's operator liveness (canaryd absent 5 minutes: the
# operator restarted 0 times; an unhealthy verdict: once), and that chart installed
# with `helm install` (Helm of `make helm`): its pod Ready, non-root and read-only, bumping;
# `helm test` passing, and failing without patch; its admission policy refusing the
# operator's stale copy; upgraded to high availability, one replica of two bumping;
# `helm uninstall` leaving only the Lease and the test pod. Restart counts are checked
# against tests/fixtures/node-restarts.json, which `make test-slow` checks the simulation
# against too (docs/NODE.md). About 16 minutes; leaves the host as it found it (sysctls,
# cgroups, mounts, the bridge, fixed paths).
e2e-node: $(STAMP) node helm dist
	CANARYD_E2E=node $(BIN)/python -m pytest -p no:cacheprovider -rs -s tests/test_e2e_node.py

# The upstream Flink Kubernetes Operator (release-1.15.0, Flink 1.20.0) built with Maven
# from its source into .cache/operator/; a no-op once built. Needs Java 17 and Maven.
# FLINK_OPERATOR_SRC: a git URL or a local git directory (default: the upstream
# repository on GitHub); FLINK_OPERATOR_REF: another tag or commit.
operator:
	bash tests/operator/build.sh

# Helm and kustomize built from their Go modules (tests/helm, pinned in go.mod there) into
# .cache/helm and .cache/kustomize, for the tests of charts/canaryd (make test) and of the
# post-renderer (make e2e-operator); a no-op once built. Needs Go 1.26 or later.
helm:
	bash tests/helm/build.sh

# The real operator in the loop: tests/test_operator.py (the bug report's reproductions on
# the operator's own probe and on canaryd, its metric names, real wedges - a half-open API
# connection, SIGSTOP - under the sidecar's probe settings), tests/test_helm.py (the
# operator's own chart through config/helm/post-render and through the GitOps kustomization
# of docs/OPERATIONS.md, server-side dry runs) and tests/test_e2e_operator_node.py (that
# chart installed with `helm install` on the real node of `make node`, the operator's image
# built from the jars on a Debian JRE base by tests/operator/image.sh: the bug report with
# and without canaryd and its policy, restarts from pod status). Builds what it needs
# first (the control plane, the operator: FLINK_OPERATOR_SRC as for `operator`, Helm, the
# node, the image); about 22 minutes, as root. Not in CI: it needs Java, Maven and a copy
# of the operator's source.
e2e-operator: $(STAMP) controlplane operator helm node dist
	bash tests/operator/image.sh
	CANARYD_E2E=operator $(BIN)/python -m pytest -p no:cacheprovider -rs -s \
		tests/test_helm.py tests/test_operator.py tests/test_e2e_operator_node.py

# Every release artifact into dist/ (release/dist.sh): the wheel and sdist (flink-canaryd
# on PyPI), the chart (canaryd-V.tgz), the image as an OCI archive with its
# org.opencontainers.image.* labels (buildah on a debootstrap base, as root), a CycloneDX
# SBOM of the image's Python packages, SHA256SUMS; every timestamp the commit's. The
# release workflow (.github/workflows/release.yaml) runs it on a v* tag with
# PLATFORMS="linux/amd64 linux/arm64" and ORG, the GitHub owner whose registry
# (ghcr.io/ORG) it pushes to. Then tests/test_release.py checks what it built. A no-op
# when nothing changed since; cold: about 8 minutes (the base); warm: about 3.
ORG ?= ORG
PLATFORMS ?=
dist: $(STAMP) helm
	ORG='$(ORG)' PLATFORMS='$(PLATFORMS)' bash release/dist.sh
	CANARYD_DIST=1 ORG='$(ORG)' $(BIN)/python -m pytest -p no:cacheprovider -q tests/test_release.py

# A least-privilege kubeconfig for canaryd outside the cluster (systemd):
# config/systemd/kubeconfig.sh applies config/rbac's ServiceAccount and roles with your
# kubectl credentials (an admin's), and writes a kubeconfig with a token of it (mode 0600).
# make kubeconfig [ADMIN_KUBECONFIG=~/.kube/config] [OUTPUT=canaryd.kubeconfig]
#                 [RBAC=config/rbac/namespaced NAMESPACE=team-a] [DURATION=8760h]
ADMIN_KUBECONFIG ?=
OUTPUT ?= canaryd.kubeconfig
RBAC ?= config/rbac
NAMESPACE ?= canaryd
DURATION ?= 8760h
kubeconfig:
	$(if $(ADMIN_KUBECONFIG),KUBECONFIG='$(ADMIN_KUBECONFIG)') config/systemd/kubeconfig.sh \
		--rbac '$(RBAC)' --namespace '$(NAMESPACE)' --duration '$(DURATION)' '$(OUTPUT)'

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
