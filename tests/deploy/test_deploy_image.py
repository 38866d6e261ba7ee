"""The container image recipes (``deploy/Dockerfile`` for CPU nodes, ``deploy/Dockerfile.cuda`` for
the GPU overlays) against the manifests and the package: the user the pods run as, the packages
installed and copied, the ports exposed, which recipe builds the image each overlay runs, and every
input pinned (base images, Python distributions, the UCX source)."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.support import deploy_image as di
from tests.support import deploy_launch as dl
from tests.support import deploy_manifests as dm

RECIPES = {"cpu": dm.DEPLOY / "Dockerfile", "cuda": dm.DEPLOY / "Dockerfile.cuda"}
recipes = pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
PYPROJECT = tomllib.loads((dm.REPO / "pyproject.toml").read_text())
PINNED_BY_CUDA_TORCH = {"triton"}


@recipes
def test_the_image_runs_the_manifests_user_and_holds_the_package(recipe):
    path = RECIPES[recipe]
    text = path.read_text()
    final = di.stage(path, None)
    users = final.all("USER")
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    uid, _, gid = users[-1].partition(":")
    for workload in dm.workloads(dm.render(dm.Variant("cpu"))):
        context = workload["spec"]["template"]["spec"]["securityContext"]
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == (uid, gid)
    assert f"--from=build {dl.IMAGE_VENV} {dl.IMAGE_VENV}" in final.all("COPY")
    assert re.search(r'pip install -c /src/constraints.txt "/src', text), "the image must install the package"
    env = dl.image_env(path)
    assert env["PATH"].startswith(f"{dl.IMAGE_VENV}/bin:")
    exposed = {int(p) for line in final.all("EXPOSE") for p in line.split()}
    declared = {p["containerPort"] for w in dm.workloads(dm.render(dm.Variant("cpu"))) for c in dm.containers(w)
                for p in c["ports"]}
    assert exposed == declared


@functools.cache
def _daemon_packages() -> frozenset[str]:
    """The project's top-level packages that ``kpool-pd``, ``kpool-pd prefill`` and ``kpool-pd
    decode`` import, found by importing them in a fresh interpreter."""
    probe = ("import sys, pathlib, kpool_pd.cli, kpool_pd.prefill_worker.daemon, kpool_pd.decode_worker.daemon; "
             "root = pathlib.Path(sys.argv[1]); "
             "print(' '.join(sorted({n.split('.')[0] for n, m in list(sys.modules.items()) "
             "if getattr(m, '__file__', None) and pathlib.Path(m.__file__).resolve().parent.parts[:len(root.parts) + 1]"
             " == (*root.parts, n.split('.')[0])})))")
    proc = subprocess.run([sys.executable, "-c", probe, str(dm.REPO)], capture_output=True, text=True, timeout=300,
                          cwd=dm.REPO)
    assert proc.returncode == 0, proc.stderr
    return frozenset(proc.stdout.split())


@recipes
def test_the_image_copies_every_package_the_daemons_import_and_the_files_it_builds_with(recipe):
    path = RECIPES[recipe]
    text = path.read_text()
    copied = set(re.findall(r"^COPY\s+(\w+)\s+/src/\1\s*$", text, flags=re.M))
    ignore = path.with_name(path.name + ".dockerignore").read_text()
    let_in = set(re.findall(r"^!(\S+?)/?\s*$", ignore, flags=re.M))
    packages = _daemon_packages()
    assert packages == {"kpool_pd"}, packages  # the product is one package
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"
    assert packages <= let_in, f"left out of the build context: {sorted(packages - let_in)}"
    # Every other file the recipe copies from the build context is let in and exists.
    sources = [words.split()[0] for stage in di.stages(path) for words in stage.all("COPY")
               if not words.startswith("--from")]
    for source in sources:
        assert (dm.REPO / source).exists(), source
        assert any(source == entry or source.startswith(entry.rstrip("/") + "/") for entry in let_in), \
            f"{source} is left out of the build context ({path.name}.dockerignore)"


def _readme_commands(marker: str) -> str:
    text = (dm.REPO / "README.md").read_text()
    return re.search(rf"<!-- {marker} -->\s*```sh\n(.+?)\n```", text, flags=re.S).group(1)


def test_the_extras_of_the_readme_commands_exist_one_per_cuda_major():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for marker in ("main-command", "test-command"):
        for group in re.findall(r"-e '\.\[([\w,-]+)\]'", _readme_commands(marker)):
            assert set(group.split(",")) <= set(extras), f"{marker}: .[{group}] names an extra pyproject.toml lacks"
    ucxx = {name: [di.requirement_name(r) for r in extras[name]] for name in ("ucx", "ucx-cu12", "ucx-cu13")}
    assert ucxx == {"ucx": ["ucxx-cu12"], "ucx-cu12": ["ucxx-cu12"], "ucx-cu13": ["ucxx-cu13"]}


def _cuda_major_of_index(url: str) -> int:
    match = re.search(r"/whl/cu(\d+)$", url)
    assert match, f"{url} is not a CUDA wheel index of PyTorch"
    return int(match.group(1)) // 10


def test_one_cuda_major_throughout_the_cuda_image():
    path = RECIPES["cuda"]
    final = di.stage(path, None)
    major = int(re.search(r":(\d+)\.\d+\.\d+-", final.base).group(1))
    build = di.stage(path, "build")
    assert re.search(rf":{major}\.\d+\.\d+-", build.base) and re.search(rf":{major}\.\d+\.\d+-",
                                                                          di.stage(path, "ucx").base)
    assert _cuda_major_of_index(build.args["TORCH_INDEX_URL"]) == major
    extra = build.args["EXTRAS"]
    assert extra == f"ucx-cu{major}" and extra in PYPROJECT["project"]["optional-dependencies"]
    pins = di.constraints(dm.REPO / _copied_constraints(path))
    cuda_suffixed = {name for name in pins if re.search(r"-cu\d+$", name)}
    assert cuda_suffixed and all(name.endswith(f"-cu{major}") for name in cuda_suffixed), cuda_suffixed
    # The overlays that run it ask for nodes whose driver runs that CUDA major.
    for overlay in ("gpu", "rdma"):
        for workload in dm.workloads(dm.render(dm.Variant(overlay))):
            assert all(c["image"].endswith(f"-cuda{major}") for c in dm.containers(workload))


def _copied_constraints(path) -> str:
    """The constraints file a recipe copies to /src/constraints.txt (the same in every stage)."""
    found = {words.split()[0] for stage in di.stages(path) for words in stage.all("COPY")
             if words.split()[-1] == "/src/constraints.txt"}
    assert len(found) == 1, found
    return found.pop()


@recipes
def test_every_input_of_the_image_is_pinned(recipe):
    path = RECIPES[recipe]
    for stage in di.stages(path):
        image, _, digest = stage.base.partition("@")
        assert re.search(r":\d+\.\d+\.\d+(-[\w.-]+)?$", image), f"{stage.base}: a base image needs an exact version"
        assert not digest or re.fullmatch(r"sha256:[0-9a-f]{64}", digest), stage.base
        for command in map(stage.expand, stage.all("RUN")):
            for pip in re.findall(r"pip install ([^&|;]+)", command):
                assert "-c /src/constraints.txt" in pip, f"{path.name}: pip install without the constraints: {pip}"
    pins = di.constraints(dm.REPO / _copied_constraints(path))
    extra = di.stage(path, "build").args["EXTRAS"]
    # A CUDA torch wheel pins its triton exactly; a second pin could only contradict it.
    by_torch = PINNED_BY_CUDA_TORCH if recipe == "cuda" else set()
    assert not by_torch & set(pins), f"{sorted(by_torch & set(pins))}: the CUDA torch wheel pins them"
    requirements = [Requirement(r) for r in (*PYPROJECT["project"]["dependencies"],
                                             *PYPROJECT["project"]["optional-dependencies"][extra])
                    if di.requirement_name(r) not in by_torch]
    wanted = {di.normalize(r.name) for r in requirements}
    assert wanted <= set(pins), f"not pinned in {_copied_constraints(path)}: {sorted(wanted - set(pins))}"
    # Each pin satisfies what the package asks for (a pin outside it would make pip fail the build).
    for requirement in requirements:
        pinned = pins[di.normalize(requirement.name)]
        assert requirement.specifier.contains(pinned, prereleases=True), f"{requirement} excludes the pin {pinned}"


def test_the_ucx_source_is_pinned_and_matches_the_ucx_ucxx_was_built_against():
    path = RECIPES["cuda"]
    ucx = di.stage(path, "ucx")
    version, digest = ucx.args["UCX_VERSION"], ucx.args["UCX_SHA256"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version) and re.fullmatch(r"[0-9a-f]{64}", digest)
    commands = " && ".join(map(ucx.expand, ucx.all("RUN")))
    fetched = re.search(r'curl -fsSL -o (\S+) "(\S+)"', commands)
    assert fetched and fetched.group(2).endswith(f"/v{version}/ucx-{version}.tar.gz")
    assert f'echo "{digest}  {fetched.group(1)}" | sha256sum -c -' in commands
    pins = di.constraints(dm.REPO / _copied_constraints(path))
    (libucx,) = [v for name, v in pins.items() if name.startswith("libucx-cu")]
    assert libucx.split(".")[:2] == version.split(".")[:2], (libucx, version)
