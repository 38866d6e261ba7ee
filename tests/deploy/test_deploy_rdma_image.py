"""The RDMA data plane of the image the gpu, rdma and same-node overlays run (deploy/Dockerfile.cuda),
checked on a CPU machine so that it cannot silently regress:

- the recipe builds UCX from source with verbs, rdmacm, the rc/dc/ud transports and CUDA, installs
  it where the final stage takes it from, and checks its build configuration (``ucx_info -b``) with
  deploy/ucx/check-ucx-build.sh, which refuses this machine's PyPI UCX (built without verbs) and
  passes only a configuration with every IB and CUDA transport;
- the final stage holds the user-space RDMA libraries and the environment under which ucxx's loader
  takes that UCX instead of its wheel's, and the recipe's own loader check passes with that
  environment and fails without it (run here against a stand-in UCX directory);
- every overlay that needs RDMA or CUDA transports runs that image, and sets the loader's variable.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import deploy_image as di
from tests.support import deploy_manifests as dm

RECIPE = dm.DEPLOY / "Dockerfile.cuda"
CHECK = dm.DEPLOY / "ucx" / "check-ucx-build.sh"
# configure flags without which UCX has no IB (rc, dc, ud over verbs and mlx5, rdmacm) or CUDA transport
REQUIRED_FLAGS = ("--with-verbs", "--with-rdmacm", "--with-mlx5", "--with-rc", "--with-dc", "--with-ud", "--with-cuda")
DISABLING = re.compile(r"--(without|disable)-(verbs|rdmacm|mlx5|rc|dc|ud|cuda|ib)\b")
try:
    import libucx

    WHEEL_UCX = Path(libucx.__file__).parent
except ImportError:  # the ucx extra is not installed here
    WHEEL_UCX = None


def _configure(stage: di.Stage) -> tuple[list[str], str]:
    """The flags of the stage's configure command, and the rest of its RUN line."""
    for command in map(stage.expand, stage.all("RUN")):
        match = re.search(r"(\S*configure\S*)((?:\s+--\S+)+)", command)
        if match:
            return shlex.split(match.group(2)), command
    raise AssertionError(f"{RECIPE.name}: stage {stage.name} runs no configure")


def test_the_recipe_builds_ucx_with_the_ib_and_cuda_transports_and_checks_the_build():
    stages = di.stages(RECIPE)
    final = stages[-1]
    # The final stage takes the install prefix, as it is, from the stage that configures UCX.
    (build,) = [s for s in stages if any("configure" in r for r in s.all("RUN"))]
    flags, command = _configure(build)
    (source,) = [f.split("=", 1)[1] for f in flags if f.startswith("--prefix=")]
    assert f"--from={build.name} {source} {source}" in final.all("COPY"), final.all("COPY")
    for flag in REQUIRED_FLAGS:
        assert any(f == flag or f.startswith(flag + "=") for f in flags), f"UCX is configured without {flag}: {flags}"
    assert not [f for f in flags if DISABLING.match(f)], flags
    assert "make install" in command
    runs = [build.expand(r) for r in build.all("RUN")]
    checked = [i for i, r in enumerate(runs) if r.startswith(f"check-ucx-build.sh {source}/bin/ucx_info")]
    installed = [i for i, r in enumerate(runs) if "make install" in r]
    assert checked and installed and checked[-1] > installed[-1], "the build's ucx_info must be checked after install"
    assert f"{CHECK.relative_to(dm.REPO)} /usr/local/bin/check-ucx-build.sh" in build.all("COPY")
    # verbs and rdmacm headers to build against; their libraries in the final stage to run with
    assert re.search(r"apt-get install [^&]*libibverbs-dev[^&]*librdmacm-dev", " ".join(runs))
    final_runs = " ".join(final.expand(r) for r in final.all("RUN"))
    assert re.search(r"apt-get install [^&]*ibverbs-providers[^&]*rdmacm-utils", final_runs), \
        "libibverbs with its mlx5 provider and librdmacm must be in the final image"
    env = final.env()
    assert env["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] == "true"
    assert f"{source}/lib" in env["LD_LIBRARY_PATH"].split(":")
    assert f"check-ucx-build.sh {source}/bin/ucx_info" in final_runs


def _fake_ucx_info(tmp_path: Path, config: str, status: int = 0) -> Path:
    script = tmp_path / "ucx_info"
    (tmp_path / "config.txt").write_text(config)
    script.write_text(f"#!/bin/sh\n[ \"$1\" = -b ] || exit 9\ncat '{tmp_path / 'config.txt'}'\nexit {status}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


FULL_BUILD = """#define HAVE_CUDA                 1
#define HAVE_IB                   1
#define HAVE_TL_DC                1
#define HAVE_TL_RC                1
#define HAVE_TL_UD                1
#define UCX_CONFIGURE_FLAGS       "--prefix=/opt/ucx --with-verbs --with-rdmacm --with-mlx5 --with-cuda=/usr/local/cuda"
#define uct_MODULES               ":cma:cuda:ib:rdmacm"
#define uct_ib_MODULES            ":mlx5"
"""


def _check(ucx_info: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(CHECK), str(ucx_info)], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("missing", [None, "HAVE_IB", "HAVE_TL_RC", "HAVE_TL_DC", "HAVE_TL_UD", "ib", "rdmacm", "cuda"],
                         ids=lambda m: f"without-{m}" if m else "complete")
def test_the_build_check_passes_only_a_ucx_with_every_ib_and_cuda_transport(missing, tmp_path):
    config = FULL_BUILD
    if missing and missing.startswith("HAVE_"):
        config = re.sub(rf"^#define {missing} .*\n", "", config, flags=re.M)
    elif missing:
        config = config.replace(f":{missing}", "")
    proc = _check(_fake_ucx_info(tmp_path, config))
    if missing is None:
        assert proc.returncode == 0, proc.stderr
        assert "verbs (rc, dc, ud), rdmacm and CUDA" in proc.stdout
    else:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        named = missing if missing.startswith("HAVE_") else f"uct_MODULES:{missing}"
        assert "lacks" in proc.stderr and named in proc.stderr.split("(")[0], proc.stderr


def test_the_build_check_says_when_ucx_info_cannot_run(tmp_path):
    proc = _check(_fake_ucx_info(tmp_path, "ucx_info: error while loading shared libraries\n", status=127))
    assert proc.returncode == 2 and "-b failed" in proc.stderr


@pytest.mark.skipif(WHEEL_UCX is None, reason="the ucx extra (libucx) is not installed here")
def test_the_build_check_refuses_the_pypi_ucx_of_this_machine():
    """The UCX of the `ucx` extra's wheel, as the image would get it without its own build: no verbs."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(WHEEL_UCX / "lib")}
    proc = _check(WHEEL_UCX / "bin" / "ucx_info", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for missing in ("HAVE_IB", "HAVE_TL_RC", "HAVE_TL_DC", "HAVE_TL_UD", "uct_MODULES:ib", "uct_MODULES:rdmacm"):
        assert missing in proc.stderr, proc.stderr
    assert "--without-verbs" in proc.stderr  # the wheel's configure flags, named in the message


def _stand_in_ucx(root: Path) -> Path:
    """``root``/opt/ucx/lib holding the wheel's UCX libraries under their own names (hard links, or
    copies across file systems): where the image's UCX would be."""
    lib = root / "opt" / "ucx" / "lib"
    lib.mkdir(parents=True)
    for name in ("libucm", "libucs", "libucs_signal", "libuct", "libucp"):
        for suffix in (".so", ".so.0"):
            source = WHEEL_UCX / "lib" / (name + suffix)
            try:
                os.link(source, lib / source.name)
            except OSError:
                (lib / source.name).write_bytes(source.read_bytes())
    return root / "opt" / "ucx"


def _recipe_loader_check() -> str:
    """The python program of the final stage's RUN that checks which UCX ucxx's loader takes."""
    final = di.stage(RECIPE, None)
    for command in map(final.expand, final.all("RUN")):
        match = re.search(r'python3 -c "(.+?)"\s*$', command)
        if match:
            return match.group(1)
    raise AssertionError(f"{RECIPE.name}: the final stage does not check which UCX ucxx loads")


@pytest.mark.skipif(WHEEL_UCX is None, reason="the ucx extra (libucx) is not installed here")
@pytest.mark.parametrize("environment", ["the-image", "without-the-loader-variable", "without-the-library-path"])
def test_ucxx_loads_the_image_ucx_only_with_the_image_environment(environment, tmp_path):
    prefix = _stand_in_ucx(tmp_path)
    program = _recipe_loader_check().replace("/opt/ucx/", f"{prefix}/")
    image_env = {k: v.replace("/opt/ucx", str(prefix)) for k, v in di.stage(RECIPE, None).env().items()
                 if k in ("LD_LIBRARY_PATH", "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY")}
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY")}
    if environment == "without-the-loader-variable":
        del image_env["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"]
    elif environment == "without-the-library-path":
        del image_env["LD_LIBRARY_PATH"]
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env={**env, **image_env}, cwd=dm.REPO)
    if environment == "the-image":
        assert proc.returncode == 0, proc.stderr
    else:  # the loader falls back to the wheel's UCX without a word: the recipe's check refuses it
        assert proc.returncode != 0 and "ucxx loads" in proc.stderr and "libucx/lib/libucp.so" in proc.stderr, \
            proc.stderr


# overlays whose pods need the IB or CUDA transports of the image's UCX
CUDA_VARIANTS = (dm.Variant("gpu"), dm.Variant("rdma"), dm.Variant("rdma", ("host-network",)), dm.SAME_NODE)


@pytest.mark.parametrize("variant", CUDA_VARIANTS, ids=lambda v: v.id)
def test_the_overlays_that_need_those_transports_run_that_image_with_the_loader_variable(variant):
    for workload in dm.workloads(dm.render(variant)):
        for container in dm.containers(workload):
            assert di.dockerfile_for(container["image"]) == RECIPE, container["name"]
            env = {v["name"]: v.get("value") for v in container.get("env", [])}
            assert env.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY") == "true", container["name"]
    assert di.dockerfile_for(dm.find(dm.render(dm.Variant("cpu")), "Deployment", "kpool-pd-decode")["spec"][
        "template"]["spec"]["containers"][0]["image"]) == dm.DEPLOY / "Dockerfile"
