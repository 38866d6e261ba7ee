"""What the rendered manifests give each daemon, read by the daemons' own settings loader: its
role (from the container's command), its settings (args, env and the mounted config file), and
the Secrets the README has users create (made by the same kubectl commands)."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import yaml

from kpool_pd.decode_worker.daemon import SPEC as DECODE_SPEC
from kpool_pd.certs import issue, make_ca
from kpool_pd.prefill_worker.daemon import SPEC as PREFILL_SPEC
from kpool_pd.runtime import load_settings
from kpool_pd.runtime.daemon import daemon_options
from tests.support import deploy_image as di
from tests.support import deploy_launch as dl
from tests.support import deploy_manifests as dm

# What each daemon parses when run_daemon starts it: its table and the runtime's start-up checks.
DAEMON_OPTIONS = {"prefill": daemon_options(PREFILL_SPEC), "decode": daemon_options(DECODE_SPEC)}
TLS_SECRET = "kpool-pd-tls"
TLS_MOUNT = "/etc/kpool-pd/tls"
EXTENDED_RESOURCES = {"gpu": {"nvidia.com/gpu"}, "rdma": {"nvidia.com/gpu", "rdma/ib"}, "dcp": {"nvidia.com/gpu"}}
TOKEN_SECRET = "kpool-pd-auth"

variants = pytest.mark.parametrize("variant", dm.VARIANTS, ids=lambda v: v.id)


def base_name(obj: dict) -> str:
    """A generated ConfigMap's name without kustomize's content-hash suffix."""
    name = obj["metadata"]["name"]
    return re.sub(r"-[a-z0-9]{10}$", "", name) if obj["kind"] == "ConfigMap" else name


def token_secret(token: str, peer_token: str) -> dict:
    """The Secret the README has users create (the client token and the peer token), made by the
    same kubectl command (client side)."""
    text = dm.run_tool([dm.kubectl(), "create", "secret", "generic", TOKEN_SECRET, f"--from-literal=token={token}",
                        f"--from-literal=peer-token={peer_token}", "--dry-run=client", "-o", "yaml"])
    return yaml.safe_load(text)


def tls_secret(directory: Path) -> tuple[dict, dict[str, Path]]:
    """The TLS Secret the README has users create (a throwaway CA here), made by the same kubectl
    command; and the files: the CA, and a client certificate it signed."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory)
    pod = issue(directory, ca, "pod", hosts=("kpool-pd-prefill", "kpool-pd-decode"))
    client = issue(directory, ca, "client")
    text = dm.run_tool([dm.kubectl(), "create", "secret", "generic", TLS_SECRET, "--type=kubernetes.io/tls",
                        f"--from-file=tls.crt={pod.cert}", f"--from-file=tls.key={pod.key}",
                        f"--from-file=ca.crt={ca.cert}", "--dry-run=client", "-o", "yaml"])
    return yaml.safe_load(text), {"ca": ca.cert, "cert": client.cert, "key": client.key}


def role_of(pod: dl.LocalPod) -> str:
    """``kpool-pd prefill ...`` -> prefill."""
    role = pod.argv[1] if len(pod.argv) > 1 else ""
    assert Path(pod.argv[0]).name == "kpool-pd" and role in DAEMON_OPTIONS, \
        f"{pod.pod_name}: command {pod.argv[:2]} is not a kpool-pd daemon"
    return role


def local_pod(objects: list[dict], workload: dict, root: Path, *, container: str | None = None,
              ports: dl.PortMap | None = None, extra_objects: list[dict] = ()) -> dl.LocalPod:
    """``LocalPod`` of one container, with the image environment of the recipe that the README
    builds the container's image with."""
    chosen = [c for c in workload["spec"]["template"]["spec"]["containers"]
              if container is None or c["name"] == container]
    dockerfile = di.dockerfile_for(chosen[0]["image"]) if len(chosen) == 1 else dm.DEPLOY / "Dockerfile"
    return dl.LocalPod(objects, workload, ports, root, container=container, dockerfile=dockerfile,
                       extra_objects=list(extra_objects))


def daemon_settings(objects: list[dict], workload: dict, root: Path, container: str | None = None
                    ) -> tuple[str, dict]:
    """What the daemon in ``workload`` (its ``container``; None: its only one) is given in the
    cluster: its role and its settings, parsed by the daemon's own loader from the container's
    args, env and mounted config file."""
    pod = local_pod(objects, workload, root, container=container, extra_objects=[token_secret("t" * 32, "p" * 32)])
    role = role_of(pod)
    return role, load_settings(role, DAEMON_OPTIONS[role], pod.argv[2:], description=role, env=pod.env)


def all_settings(variant: dm.Variant, root: Path) -> dict[str, tuple[dict, dict, dict]]:
    """role -> (workload, container, settings)."""
    objects = dm.render(variant)
    out = {}
    for workload in dm.workloads(objects):
        role, settings = daemon_settings(objects, workload, root)
        assert role not in out, f"two workloads run the {role} daemon"
        out[role] = (workload, workload["spec"]["template"]["spec"]["containers"][0], settings)
    assert set(out) == set(DAEMON_OPTIONS), f"workloads run {sorted(out)}, expected both daemons"
    return out


def secret_bytes(secret: dict, key: str) -> bytes:
    return base64.b64decode(secret["data"][key])
