"""Settings that crash a daemon or can never work are refused at start, before anything is built or
warmed up: the real daemon process exits with status 2 and prints one line naming the option and where
its value came from (flag, environment variable or YAML file), never a traceback.

Each case runs the prefill or the decode daemon's ``main`` with the bad value: two as the command itself
(``python -m kpool_pd.prefill_worker``, ``python -m kpool_pd.decode_worker``), the others in a forked child; the
listeners are off or on any free port, so that a case that is (wrongly) accepted fails on its status
instead of colliding with another test's ports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import astuple, dataclass

import pytest

from kpool_pd.connector import MAX_DCP_RANKS, MAX_ID_CHARS
from tests.support.daemon_main import run_daemon_main
from tests.support.deadlines import patient

START_S = 30  # a refused daemon exits long before; one that is accepted is stopped here (stretched for the load)

DEEP = "a: " + "[" * 5000 + "]" * 5000 + "\n"


@dataclass(frozen=True)
class Case:
    daemon: str  # "kpool_pd.prefill_worker" or "kpool_pd.decode_worker"
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    yaml: bytes | None = None  # the --config file's bytes
    needle: str = ""  # the option and its source, as the line names them ({config}: the file's path)
    free_port: bool = True  # pass --port 0 (a flag wins over the YAML file, so a YAML port case leaves it out)


CASES = {
    # item 4: a flag that segfaulted torch
    "torch-threads-100000": Case("kpool_pd.decode_worker", ("--torch-threads", "100000"),
                                 needle="torch-threads from flag --torch-threads"),
    # item 5: YAML lists, bytes and depth that ended in tracebacks
    "yaml-layers-list": Case("kpool_pd.prefill_worker", yaml=b"layers: [2]\n", needle="layers from config file {config}"),
    "yaml-lease-list": Case("kpool_pd.decode_worker", yaml=b"lease-s: [1]\n", needle="lease-s from config file {config}"),
    "yaml-port-list": Case("kpool_pd.prefill_worker", yaml=b"port: [1, 2]\n", needle="port from config file {config}",
                           free_port=False),
    "yaml-not-utf8": Case("kpool_pd.decode_worker", yaml=b"layers: \xff\xfe2\n", needle="config file {config}: not UTF-8"),
    "yaml-nested-5000": Case("kpool_pd.prefill_worker", yaml=DEEP.encode(), needle="config file {config}: nested too deeply"),
    "ready-file-missing-folder": Case("kpool_pd.prefill_worker", ("--ready-file", "/nonexistent-kpoolpd/ready.json"),
                                      needle="ready-file /nonexistent-kpoolpd/ready.json (flag --ready-file)"),
    "num-blocks-1e9": Case("kpool_pd.prefill_worker", ("--num-blocks", "1000000000"),
                           needle="num-blocks 1000000000 (flag --num-blocks)"),
    "decode-num-blocks-env": Case("kpool_pd.decode_worker", env=(("KPOOLPD_NUM_BLOCKS", "1000000000"),),
                                  needle="num-blocks 1000000000 (KPOOLPD_NUM_BLOCKS)"),
    # item 6: values that were accepted and could never work
    "rpc-timeout-inf": Case("kpool_pd.decode_worker", ("--rpc-timeout-s", "inf"), needle="rpc-timeout-s from flag --rpc-timeout-s"),
    "engine-id-too-long": Case("kpool_pd.decode_worker", env=(("KPOOLPD_ENGINE_ID", "e" * (MAX_ID_CHARS + 1)),),
                               needle="engine-id from KPOOLPD_ENGINE_ID"),
    "dcp-beyond-prefill-limit": Case("kpool_pd.decode_worker", ("--dcp", str(MAX_DCP_RANKS + 1)), needle="dcp from flag --dcp"),
    "yaml-num-blocks-float": Case("kpool_pd.prefill_worker", yaml=b"num-blocks: 1.7\n", needle="num-blocks from config file {config}"),
    "yaml-layers-bool": Case("kpool_pd.decode_worker", yaml=b"layers: true\n", needle="layers from config file {config}"),
    "lease-inf": Case("kpool_pd.prefill_worker", ("--lease-s", "inf"), needle="lease-s from flag --lease-s"),
    "drain-nan-env": Case("kpool_pd.prefill_worker", env=(("KPOOLPD_DRAIN_S", "nan"),), needle="drain-s from KPOOLPD_DRAIN_S"),
    # the serving geometry (runtime.geometry): a block of a multiple of 128 tokens, kernel pages of exactly 32 or 64 states
    "block-size-64": Case("kpool_pd.prefill_worker", ("--block-size", "64"),
                          needle="block-size from flag --block-size: a block of 64 tokens is refused: the attention "
                                 "block is a multiple of 128 tokens"),
    "yaml-block-size-192": Case("kpool_pd.decode_worker", yaml=b"block-size: 192\n",
                                needle="block-size from config file {config}: a block of 192 tokens"),
    "kpool-16-pages-of-16": Case("kpool_pd.decode_worker", env=(("KPOOLPD_KPOOL", "16"),),
                                 needle="kpool from KPOOLPD_KPOOL and block-size from the default: kpool 16 in "
                                        "256-token blocks makes kernel pages of 16 states"),
    "kpool-8-in-128-pages-of-16": Case("kpool_pd.prefill_worker", ("--kpool", "8", "--block-size", "128"),
                                       needle="kpool from flag --kpool and block-size from flag --block-size: kpool 8 "
                                              "in 128-token blocks makes kernel pages of 16 states: the paged-MQA "
                                              "indexer kernel takes pages of 32 or 64 states"),
    "kpool-8-in-384-pages-of-48": Case("kpool_pd.decode_worker", ("--kpool", "8", "--block-size", "384"),
                                       needle="kpool from flag --kpool and block-size from flag --block-size: kpool 8 "
                                              "in 384-token blocks makes kernel pages of 48 states: the paged-MQA "
                                              "indexer kernel takes pages of 32 or 64 states and no other"),
}


# Cases run as the real command (a fresh ``python -m``, one a daemon); the others run the daemon's main in a
# child forked with torch imported (tests.support.daemon_main): the same settings path, without the imports.
AS_COMMANDS = ("torch-threads-100000", "block-size-64")


@pytest.mark.parametrize("name", list(CASES))
def test_a_setting_that_cannot_work_exits_2_with_one_line_naming_it(tmp_path, name):
    case = CASES[name]
    flags = [*(("--port", "0") if case.free_port else ()), "--metrics-port", "-1", "--log-format", "text", *case.flags]
    config = tmp_path / "kpool.yaml"
    if case.yaml is not None:
        config.write_bytes(case.yaml)
        flags += ["--config", str(config)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPOOLPD_")}
    env.update(case.env)
    if name in AS_COMMANDS:
        proc = subprocess.run([sys.executable, "-m", case.daemon, *flags], env=env, capture_output=True,
                              timeout=patient(START_S))
        status, out, err = proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    else:
        status, out, err = astuple(run_daemon_main(case.daemon, flags, env, tmp_path, START_S))
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, f"status {status}\nstdout: {out[-2000:]}\nstderr: {err[-4000:]}"
    assert "Traceback" not in err + out, err
    assert len(lines) == 1 and not out.strip(), f"expected one line, got:\n{err}{out}"
    role = "prefill" if case.daemon == "kpool_pd.prefill_worker" else "decode"
    assert lines[0].startswith(f"kpool-pd {role}: error: "), lines[0]
    assert case.needle.format(config=config) in lines[0], lines[0]
    assert "warmed up" not in err
