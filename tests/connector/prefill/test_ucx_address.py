"""The sanity check of UCP worker addresses (connector.prefill.ucx_address): real addresses of several UCX
configurations pass, and every truncation, random bytes, a bad version nibble, trailing bytes and
sizes out of bounds are refused with a reason, without calling UCX. One case asks this machine's
UCX for a fresh address, so that a change of UCX's format shows here first."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from kpool_pd.connector.shared.ucx import ucx_available
from kpool_pd.connector.prefill.ucx_address import (MAX_ADDRESS_BYTES, AddressVersion, WorkerAddressError, WorkerAddressInfo,
                                   check_worker_address)
from tests.support.paths import REPO


# Worker addresses made by UCX 1.21 (ucxx 0.52) on a 2-core CPU machine with lo and eth0.
REAL = {
    "v1-tcp-self": "205a1aebc227e646ff0000637577cc2b320040975000000000004f030088b78bc0fbfc5891f701060002c0000202cf1917"
                   "b751389763344bd7e037370013230082e0a301120102390c9381934560fff9ffffef00000000cf1917b75138539e3e4bd7e0"
                   "37370113230082ed158580",
    "v2-tcp-self": "5102cc8cc9cd1902456f000063754426000080001b0088831cf59b88c28a1b01060002c0000202cf190c015a0080008b0082"
                   "c71b01920102390c9381934560fff9ffffef00000000cf190c015a0180008b0082ac6f",
    "v1-debug-info": "300ca64880e81d4f4d07766d3a373334380000637577cc2b320040975000000000004f030088be5f6791c64acda001060002"
                     "c0000202cf1917b751389763344bd7e0373700132300828dc701120102390c9381934560fff9ffffef00000000cf1917b7"
                     "5138539e3e4bd7e037370113230082df078580",
    "v1-shared-memory": "20612bee1548fe474f0000637577cc2b320040975000000000004f0300884c58c2d8bd38a6ab01060002c0000202cf19"
                        "17b751389763344bd7e037370013230082cb1701120102390c9381934560fff9ffffef00000000cf1917b75138539e"
                        "3e4bd7e037370113230082ec110208390c93819345607f8d5377cc2b320000705077ccab33004f2300881900100000"
                        "0000000308390c93819345607fa7d377cc2b320000705077ccab33004f230088bb1c0000040000c00408390c938193"
                        "45607f478bbd37063600242e5077ccab330092210084bb1c00008580",
}


@pytest.mark.parametrize("name", list(REAL))
def test_real_addresses_pass(name):
    address = bytes.fromhex(REAL[name])
    info = check_worker_address(address)
    assert isinstance(info, WorkerAddressInfo) and info.nbytes == len(address)
    assert info.version is (AddressVersion.V2 if name.startswith("v2") else AddressVersion.V1)
    assert info.interfaces >= 2  # self and tcp at least


@pytest.mark.parametrize("name", list(REAL))
def test_every_truncation_is_refused(name):
    address = bytes.fromhex(REAL[name])
    for n in range(len(address)):
        with pytest.raises(WorkerAddressError):
            check_worker_address(address[:n])


@pytest.mark.parametrize("name", list(REAL))
def test_trailing_bytes_are_refused(name):
    with pytest.raises(WorkerAddressError, match="left over"):
        check_worker_address(bytes.fromhex(REAL[name]) + b"\x00")


def test_random_addresses_are_refused():
    rng = random.Random(10)
    for size in [2, 3, 17, 110, 1024, 1024, 1024, 4096] * 50:
        with pytest.raises(WorkerAddressError):
            check_worker_address(bytes(rng.randrange(256) for _ in range(size)))


@pytest.mark.parametrize("version", [2, 3, 4, 7, 15])
def test_a_version_ucx_aborts_on_is_refused_naming_it(version):
    address = bytearray.fromhex(REAL["v1-tcp-self"])
    address[0] = (address[0] & 0xF0) | version
    with pytest.raises(WorkerAddressError, match=f"header version {version}"):
        check_worker_address(bytes(address))


@pytest.mark.parametrize("address,needle", [
    (b"", "0 bytes"),
    (b"\x20", "1 bytes"),
    (b"\x20" * (MAX_ADDRESS_BYTES + 1), f"{MAX_ADDRESS_BYTES + 1} bytes"),
    (b"\x20" + bytes(8) + b"\xff", "no transport"),
    (b"\x01\xf2" + bytes(8), "unknown header flags"),
], ids=["empty", "one-byte", "too-large", "no-transport", "unknown-v2-flags"])
def test_edges_are_refused_with_a_reason(address, needle):
    with pytest.raises(WorkerAddressError, match=needle):
        check_worker_address(address)


def test_not_bytes_is_a_type_error():
    with pytest.raises(TypeError):
        check_worker_address("20ab")  # type: ignore[arg-type]


def test_unified_mode_checks_the_header_only():
    address = bytes.fromhex(REAL["v1-tcp-self"])[:20]
    assert check_worker_address(address, unified_mode=True).devices == 0
    with pytest.raises(WorkerAddressError):
        check_worker_address(address)


@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
@pytest.mark.parametrize("env", [{}, {"UCX_ADDRESS_VERSION": "v2"}, {"UCX_TLS": "all"}],
                         ids=["default", "v2", "all-transports"])
def test_this_machines_ucx_makes_addresses_that_pass(env):
    code = ("import os, ucxx; ucxx.init(options={'TLS': '^posix,sysv,cma,xpmem,knem'}, env_takes_precedence=True); "
            "print('ADDRESS', bytes(ucxx.get_worker_address()).hex(), flush=True); os._exit(0)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, "UCX_MEMTYPE_CACHE": "n", **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ADDRESS ")]
    assert lines, proc.stdout + proc.stderr
    address = bytes.fromhex(lines[-1].split()[1])
    info = check_worker_address(address)
    assert info.nbytes == len(address) and info.interfaces >= 1
