"""The container image recipe (``deploy/Dockerfile``) against the manifests: the user the pods
run as, the packages installed, the ports exposed."""

from __future__ import annotations

import re
import subprocess
import sys

from tests import deploy_launch as dl
from tests import deploy_manifests as dm


def test_the_image_runs_the_manifests_user_and_holds_the_package():
    text = (dm.DEPLOY / "Dockerfile").read_text()
    final_stage = text[text.rindex("\nFROM "):]
    users = re.findall(r"^USER\s+(\S+)", final_stage, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    uid, _, gid = users[-1].partition(":")
    for workload in dm.workloads(dm.render(dm.Variant("cpu"))):
        context = workload["spec"]["template"]["spec"]["securityContext"]
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == (uid, gid)
    assert f"COPY --from=build {dl.IMAGE_VENV} {dl.IMAGE_VENV}" in final_stage
    assert re.search(r'pip install "/src', text), "the image must install the package"
    env = dl.image_env(dm.DEPLOY / "Dockerfile")
    assert env["PATH"].startswith(f"{dl.IMAGE_VENV}/bin:")
    exposed = {int(p) for line in re.findall(r"^EXPOSE\s+(.+)$", final_stage, flags=re.M) for p in line.split()}
    declared = {p["containerPort"] for w in dm.workloads(dm.render(dm.Variant("cpu"))) for c in dm.containers(w)
                for p in c["ports"]}
    assert exposed == declared


def _daemon_packages() -> set[str]:
    """The project's top-level packages that ``kpool-pd``, ``kpool-pd prefill`` and ``kpool-pd
    decode`` import, found by importing them in a fresh interpreter."""
    probe = ("import sys, pathlib, kpool_pd.cli, prefill_worker.daemon, decode_worker.daemon; "
             "root = pathlib.Path(sys.argv[1]); "
             "print(' '.join(sorted({n.split('.')[0] for n, m in list(sys.modules.items()) "
             "if getattr(m, '__file__', None) and pathlib.Path(m.__file__).resolve().parent.parts[:len(root.parts) + 1]"
             " == (*root.parts, n.split('.')[0])})))")
    proc = subprocess.run([sys.executable, "-c", probe, str(dm.REPO)], capture_output=True, text=True, timeout=300,
                          cwd=dm.REPO)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def test_the_image_copies_every_package_the_daemons_import():
    text = (dm.DEPLOY / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY\s+(\w+)\s+/src/\1\s*$", text, flags=re.M))
    ignore = (dm.DEPLOY / "Dockerfile.dockerignore").read_text()
    let_in = set(re.findall(r"^!(\w+)/\s*$", ignore, flags=re.M))
    packages = _daemon_packages()
    assert {"kpool_pd", "prefill_worker", "decode_worker", "runtime", "model"} <= packages, packages
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"
    assert packages <= let_in, f"left out of the build context: {sorted(packages - let_in)}"
