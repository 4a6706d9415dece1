"""The Go commands the control plane is built from: each one's wrapper module under devcluster/go/,
package, link flags and build tags, and the groups `build` takes. A change to any of these changes that
binary's build key (gobuild.py), so it rebuilds: change them only for a new pin.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import node

from devcluster.config import GO_DIR, KUBERNETES_VERSION, ClusterError


@dataclass(frozen=True)
class Binary:
    """One Go command built from a wrapper module under devcluster/go/."""

    name: str
    module_dir: str
    package: str
    ldflags: str = ""
    tags: str = ""  # go build -tags


def _k8s_ldflags(version: str = KUBERNETES_VERSION) -> str:
    minor = version.split(".")[1]
    pkg = "k8s.io/component-base/version"
    return " ".join(
        [
            "-s -w",
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor=1",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
        ]
    )


def _helm_ldflags() -> str:
    """Helm's own release flags: its version, and the Kubernetes version `helm template` assumes without
    --kube-version (unset, Helm says 1.20 and the chart's kubeVersion refuses it). We say the cluster's."""
    minor = KUBERNETES_VERSION.split(".")[1]
    return " ".join(
        [
            "-s -w",
            "-X helm.sh/helm/v3/internal/version.version=v3.22.0",
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
            *(f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMajor=1" for pkg in ("lint/rules", "chartutil")),
            *(f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMinor={minor}" for pkg in ("lint/rules", "chartutil")),
        ]
    )


def go_mod_version(module_dir: str, module: str) -> str:
    """The version that a wrapper module's go.mod pins for `module`: the one place a pin is written."""
    for line in (GO_DIR / module_dir / "go.mod").read_text().splitlines():
        words = line.split()
        if words[:1] == ["require"]:
            words = words[1:]
        if len(words) >= 2 and words[0] == module:
            return words[1]
    raise RuntimeError(f"{GO_DIR / module_dir / 'go.mod'} does not require {module}")


KUEUE_MODULE = "sigs.k8s.io/kueue"


def _kueue_ldflags() -> str:
    pkg = f"{KUEUE_MODULE}/pkg/version"
    version = go_mod_version("kueue", KUEUE_MODULE)
    return (
        f"-s -w -X {pkg}.GitVersion={version} -X {pkg}.GitCommit=module-proxy"
        f" -X {pkg}.BuildDate=1970-01-01T00:00:00Z"
    )


BINARIES = [
    Binary("etcd", "etcd", ".", "-s -w"),
    Binary("kube-apiserver", "kubernetes", "k8s.io/kubernetes/cmd/kube-apiserver", _k8s_ldflags()),
    Binary(
        "kube-controller-manager",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        _k8s_ldflags(),
    ),
    Binary("kube-scheduler", "kubernetes", "k8s.io/kubernetes/cmd/kube-scheduler", _k8s_ldflags()),
    Binary("kubectl", "kubernetes", "k8s.io/kubernetes/cmd/kubectl", _k8s_ldflags()),
    # The real node (issue 14): a kubelet over Debian's containerd, kube-proxy, and cluster DNS.
    Binary("kubelet", "kubernetes", "k8s.io/kubernetes/cmd/kubelet", _k8s_ldflags()),
    Binary("kube-proxy", "kubernetes", "k8s.io/kubernetes/cmd/kube-proxy", _k8s_ldflags()),
    Binary("coredns", "coredns", ".", "-s -w"),
    Binary("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok", "-s -w"),
    Binary("ray-operator", "kuberay", "github.com/ray-project/kuberay/ray-operator", "-s -w"),
    Binary("helm", "helm", "helm.sh/helm/v3/cmd/helm", _helm_ldflags()),
    # The alerting tests' Prometheus: Debian's 2.42 has no Kubernetes service discovery (docs/monitoring.md).
    Binary(
        "prometheus",
        "prometheus",
        "github.com/prometheus/prometheus/cmd/prometheus",
        "-s -w -X github.com/prometheus/common/version.Version=3.16.0"
        " -X github.com/prometheus/common/version.Revision=v0.316.0"
        " -X github.com/prometheus/common/version.Branch=module-proxy",
        # Only the service discovery the tests use (Prometheus' own build tags): minutes less to build.
        tags="remove_all_sd,enable_kubernetes_sd",
    ),
    # The lowest Kubernetes the chart claims (kubeVersion >=1.30): tests/e2e/cluster/test_kubernetes_floor.py
    # runs the RLHFJob CRD against it. Its own module, so the main binaries keep their build key; Go 1.26
    # builds the 1.30 tree as it is (no -checklinkname=0 needed).
    Binary(
        "kube-apiserver-floor",
        "kubernetes-floor",
        "k8s.io/kubernetes/cmd/kube-apiserver",
        _k8s_ldflags("v1.30.14"),
    ),
    # Kueue (issue 16): quota and admission for RayClusters, started on demand by `kueue-up`.
    Binary("kueue", "kueue", f"{KUEUE_MODULE}/cmd/kueue", _kueue_ldflags()),
]


# Each binary's cold build on this 2-core machine, in seconds: what `build --plan` adds up for the ones
# the cache lacks, so a caller can say how long is left. The ones `up` runs as `make demo` built them on a
# fresh machine, one after the other beside the image builds (2026-12-07, before GOGC=400 and no DWARF
# cut their CPU by about a fifth; the Kubernetes ones after kube-apiserver reuse its packages); the
# test-only ones alone (docs/development.md's table).
COLD_BUILD_S = {
    "etcd": 66,
    "kube-apiserver": 347,
    "kube-controller-manager": 84,
    "kube-scheduler": 6,
    "kubectl": 33,
    "kubelet": 24,
    "kube-proxy": 10,
    "coredns": 85,
    "kwok": 106,
    "ray-operator": 131,
    "helm": 67,
    "prometheus": 353,
    "kube-apiserver-floor": 758,
    "kueue": 459,
}


CONTROL_PLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "ray-operator",
    "helm",
)


# Built for tests only, not run by `up`: Prometheus (the alerting stage), the floor API server and Kueue
# (`kueue-up`, the kueue fixture).
TEST_BINARIES = ("prometheus", "kube-apiserver-floor", "kueue")
# Started on demand into a running control plane (`kueue-up`), stopped by `kueue-down` or `down`; a dead
# one is dropped by `up` instead of restarting the control plane.
OPTIONAL_COMPONENTS = ("kueue",)
NODE_BINARIES = ("kubelet", "kube-proxy", "coredns")


def up_binaries(real_node: bool) -> list[str]:
    """What `up` runs, plus kubectl and helm: not the test-only binaries."""
    return [*CONTROL_PLANE_BINARIES, *(NODE_BINARIES if real_node else ())]


def binary_names(groups: Iterable[str]) -> list[str] | None:
    """`build`'s arguments: binary names or the groups `up` (what `up` runs) and `test` (TEST_BINARIES);
    none means every binary."""
    names: list[str] = []
    for g in groups:
        if g == "up":
            names += up_binaries(node.enabled())
        elif g == "test":
            names += TEST_BINARIES
        elif any(b.name == g for b in BINARIES):
            names.append(g)
        else:
            raise ClusterError(
                f"build: unknown binary or group {g!r} (groups: up, test; binaries: "
                + ", ".join(b.name for b in BINARIES)
                + ")"
            )
    return names or None
