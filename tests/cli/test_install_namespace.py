"""The product installs one import name, ``kpool_pd``: the wheel adds nothing else at the top of
site-packages, and the daemons start from a folder that holds packages named as the product's layers
(``model/``, as Hugging Face model folders often are, ``runtime/``, ``kernels/``, ``connector/``): empty
packages, in which anything of ours that reached for them would find none of its names."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.support.paths import REPO
from tests.support.user_folders import LAYERS, shadowed, shadowing_folder

BUILD_S = 600  # a wheel build on a loaded 2-core machine


def test_the_wheel_adds_only_kpool_pd_to_site_packages(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=BUILD_S)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("kpool_pd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"kpool_pd", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, sorted(top)
    for layer in LAYERS:  # every layer travels inside the one package
        assert f"kpool_pd/{layer}/__init__.py" in names, layer


@pytest.mark.parametrize("argv", [
    ["-m", "kpool_pd", "--help"],
    ["-m", "kpool_pd.prefill_worker", "--help"],
    ["-m", "kpool_pd.decode_worker", "--help"],
    ["-c", "import kpool_pd.cli, kpool_pd.prefill_worker.daemon, kpool_pd.decode_worker.daemon, kpool_pd.bench.transfer"],
], ids=["cli", "prefill", "decode", "imports"])
def test_the_product_starts_from_a_folder_holding_packages_named_as_its_layers(tmp_path, argv):
    folder = shadowing_folder(tmp_path)
    proc = subprocess.run([sys.executable, *argv], cwd=folder, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not shadowed(proc.stderr)
