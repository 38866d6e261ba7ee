"""``kpool-pd bench vllm`` (kpool_pd/bench/vllm_pd.py): its flags; its output (a new temporary folder unless --out,
named first; each engine's output in its log there, the terminal left to the bench's progress and table; a
failed engine's log tail; MooncakeConnector's rows skipped with the reason when its engine does not import;
concurrent rows), run with engines that print like vLLM but compute nothing (no vLLM); the table's ratios;
the redirection of a child process's output; and one short run of a KpoolPdConnector pair, a single request
and two at once, whose rows say the consumer pulled every prompt token and gave one engine's tokens."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import pytest

from kpool_pd.bench import vllm_bench_engines, vllm_engines, vllm_one_engine, vllm_pd
from tests.support.memory_share import memory_share
from tests.support.paths import REPO

CHATTER = "CHATTER"  # in every line a chatty engine prints
CHATTER_LINES = 500  # about what vLLM prints for two engines
REPO_RESULTS = REPO / "bench" / "results"


def chatty_serve(model: str, transfer: dict | None, jobs, results, max_model_len: int = 2048,
                 env: dict[str, str] | None = None, log: Path | None = None, fail: bool = False) -> None:
    """``vllm_engines.serve``'s part without vLLM: its output redirected to ``log`` as ``serve`` does, then
    chatter every way a vLLM engine prints (print, logging, a warning, a write to fd 2, a child process);
    ready, or failed with a traceback (``fail``); then each job answered with the prompt as its tokens, a
    producer's answer carrying kv_transfer_params, a consumer's counting the prompt as pulled when given
    them."""
    vllm_engines.redirect_output(log)
    for i in range(CHATTER_LINES):
        print(f"{CHATTER} stdout {i}")
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("vllm").warning("%s logging", CHATTER)
    warnings.warn(f"{CHATTER} warning", stacklevel=1)
    os.write(2, f"{CHATTER} fd 2\n".encode())
    subprocess.run([sys.executable, "-c", f"import sys; print('{CHATTER} child'); print('{CHATTER} child 2', "
                    "file=sys.stderr)"], check=True, timeout=60)
    if fail:
        try:
            raise RuntimeError("no room for the KV cache")
        except RuntimeError:
            sys.stderr.write(traceback.format_exc())
            sys.stderr.flush()
            results.put(("error", traceback.format_exc()))
            return
    results.put(("ready", None))
    producer = transfer["kv_role"] == "kv_producer"
    while (job := jobs.get()) is not None:
        prompts, _, params = job
        pulled = params is not None and not producer
        results.put(vllm_engines.Job(
            outputs=[(prompt[-1:], "length", {"do_remote_prefill": True} if producer else None) for prompt in prompts],
            prompt_tokens={"external_kv_transfer": sum(map(len, prompts))} if pulled else {}))


class ChattyEngineProcess(vllm_engines.EngineProcess):
    """vllm_engines.EngineProcess (its waits, jobs and stop) running ``chatty_serve``; the engine whose role is
    ``fail_role`` fails."""

    fail_role: str | None = None

    def __init__(self, context, model: str, transfer: dict | None, *, max_model_len: int = 2048,
                 env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.jobs, self.results, self.log = context.Queue(), context.Queue(), log
        fail = transfer["kv_role"] == f"kv_{self.fail_role}"
        self.process = context.Process(target=chatty_serve, args=(model, transfer, self.jobs, self.results),
                                       kwargs={"max_model_len": max_model_len, "env": env, "log": log, "fail": fail})
        self.process.start()


@pytest.fixture
def chatty_engines(monkeypatch, tmp_path):
    """bench vllm with ChattyEngineProcess for vLLM's engines, no model written, temporary folders under
    ``tmp_path``."""
    monkeypatch.setattr(vllm_pd.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(vllm_pd.vllm_engines, "EngineProcess", ChattyEngineProcess)
    monkeypatch.setattr(vllm_pd.vllm_engines, "write_model", lambda folder, max_positions: folder)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ChattyEngineProcess, "fail_role", None)
    return ChattyEngineProcess


def results_in_repo() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in REPO_RESULTS.glob("*")} if REPO_RESULTS.exists() else {}


@pytest.mark.parametrize("argv, message", [
    (["--connectors", "kpool-grpc,lmcache"], "--connectors: expected names among"),
    (["--concurrent", "8,0"], "must be >= 1, got 0"),
    (["--tokens", "0"], "must be >= 1, got 0"),
    (["--reps", "x"], "expected an integer >= 1, got 'x'"),
])
def test_bad_flags_exit_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        vllm_pd.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_package_is_named_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(vllm_pd.importlib.util, "find_spec", lambda name: None)
    assert vllm_pd.main(["--connectors", "kpool-grpc,nixl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs vllm (pip install -e '.[vllm]'" in err and "nixl (pip install nixl" in err


def test_the_table_gives_each_ttft_beside_nixls():
    rows = [vllm_pd.Row(connector=name, tokens=1024, reps=3, prefill_ms=10.0, decode_first_token_ms=first,
                        ttft_ms=10.0 + first, same_tokens=True, pulled_tokens=3072)
            for name, first in (("nixl", 30.0), ("kpool-grpc", 10.0))]
    lines = vllm_pd.table(rows).splitlines()
    kpool = next(line for line in lines if line.startswith("kpool-grpc"))
    assert "20.0" in kpool and "0.50x" in kpool  # (10 + 10) / (10 + 30)


def test_out_defaults_to_a_new_temporary_folder_named_on_the_first_line(chatty_engines, tmp_path, capfd):
    before = results_in_repo()
    assert vllm_pd.main(["--tokens", "8,16", "--reps", "2", "--concurrent", "none",
                         "--connectors", "kpool-grpc,kpool-ucx"]) == 0
    out, err = capfd.readouterr()
    first = err.splitlines()[0]
    assert first.startswith("kpool-pd bench vllm: writing to ")
    folder = Path(first.removeprefix("kpool-pd bench vllm: writing to "))
    assert folder.parent == tmp_path and folder.name.startswith(vllm_pd.OUT_PREFIX)
    assert sorted(p.name for p in folder.iterdir()) == ["kpool-grpc-consumer.log", "kpool-grpc-producer.log",
                                                        "kpool-ucx-consumer.log", "kpool-ucx-producer.log",
                                                        "vllm_pd.json"]
    rows = json.loads((folder / "vllm_pd.json").read_text())
    assert [(r["connector"], r["tokens"], r["pulled_tokens"]) for r in rows] == [
        ("kpool-grpc", 8, 16), ("kpool-grpc", 16, 32), ("kpool-ucx", 8, 16), ("kpool-ucx", 16, 32)]
    assert results_in_repo() == before  # nothing written into the repository's bench/results
    assert err.splitlines()[-1] == f"results: {folder / 'vllm_pd.json'}"
    assert out.splitlines()[0].startswith("connector") and len(out.splitlines()) == 5  # the table


def test_the_terminal_shows_a_line_a_phase_and_the_engines_output_goes_to_their_logs(chatty_engines, tmp_path,
                                                                                      capfd):
    assert vllm_pd.main(["--tokens", "8", "--reps", "1", "--concurrent", "none", "--connectors", "kpool-grpc",
                         "--out", str(tmp_path / "mine" / "made")]) == 0
    out, err = capfd.readouterr()
    assert CHATTER not in out + err
    assert err.splitlines() == [
        f"kpool-pd bench vllm: writing to {tmp_path / 'mine' / 'made'}",
        "vLLM's output goes to a log per engine there: <connector>-producer.log and <connector>-consumer.log",
        "writing the model (a 2-layer Llama, seeded weights)",
        "kpool-grpc: starting a producer and a consumer engine (logs kpool-grpc-producer.log, "
        "kpool-grpc-consumer.log)",
        err.splitlines()[4],  # engines ready in N s
        err.splitlines()[5],  # TTFT
        f"results: {tmp_path / 'mine' / 'made' / 'vllm_pd.json'}"]
    assert err.splitlines()[4].startswith("kpool-grpc: engines ready in ")
    assert err.splitlines()[5].startswith("kpool-grpc, 8 tokens: consumer phase ")
    for role in ("producer", "consumer"):
        log = (tmp_path / "mine" / "made" / f"kpool-grpc-{role}.log").read_text()
        for said in [f"{CHATTER} stdout 0", f"{CHATTER} stdout {CHATTER_LINES - 1}", f"{CHATTER} logging",
                     f"{CHATTER} warning", f"{CHATTER} fd 2", f"{CHATTER} child", f"{CHATTER} child 2"]:
            assert said in log, (role, said)


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_failed_engine_shows_the_tail_of_its_log_and_its_path(chatty_engines, tmp_path, capfd, role):
    chatty_engines.fail_role = role
    assert vllm_pd.main(["--tokens", "8", "--reps", "1", "--concurrent", "none", "--connectors", "kpool-ucx",
                         "--out", str(tmp_path)]) == 1
    out, err = capfd.readouterr()
    log = tmp_path / f"kpool-ucx-{role}.log"
    assert (f"error: the kpool-ucx {role} engine failed: RuntimeError: no room for the KV cache; the last "
            f"{vllm_bench_engines.LOG_TAIL_LINES} lines of its log, {log}:") in err.splitlines()
    shown = [line.removeprefix("  ") for line in err[err.index(str(log)):].splitlines()[1:1 + vllm_bench_engines.LOG_TAIL_LINES]]
    logged = log.read_text().splitlines()  # may have grown since: the engine's children write on as it stops
    assert len(shown) == vllm_bench_engines.LOG_TAIL_LINES and any(
        logged[i:i + len(shown)] == shown for i in range(len(logged) - len(shown) + 1)), (shown, logged[-50:])
    assert "Traceback (most recent call last):" in err
    assert f"{CHATTER} stdout 0" not in err  # the tail only
    assert out == "" and json.loads((tmp_path / "vllm_pd.json").read_text()) == []


def test_mooncake_rows_are_skipped_with_the_reason_and_concurrent_rows_appear(chatty_engines, tmp_path, monkeypatch,
                                                                             capfd):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # its import fails, as without the wheel
    assert vllm_pd.main(["--tokens", "8", "--reps", "1", "--concurrent", "3", "--new-tokens", "2",
                         "--connectors", "kpool-grpc,mooncake", "--out", str(tmp_path)]) == 0
    out, err = capfd.readouterr()
    skipped = "mooncake: skipped: the Mooncake Transfer Engine cannot be imported (ModuleNotFoundError"
    assert any(line.startswith(skipped) for line in err.splitlines())
    assert out.splitlines()[-1].startswith(skipped) and "apt-get install -y libibverbs1" in out.splitlines()[-1]
    rows = json.loads((tmp_path / "vllm_pd.json").read_text())
    lengths = vllm_pd.mixed_lengths(3)
    assert [(r["connector"], r["requests"], r["tokens"], r["new_tokens"], r["pulled_tokens"]) for r in rows] == [
        ("kpool-grpc", 1, 8, 1, 8), ("kpool-grpc", 3, sum(lengths), 2, sum(lengths))]
    assert min(lengths) == vllm_pd.MIXED_SHORTEST and max(lengths) == vllm_pd.MIXED_LONGEST
    assert not list(tmp_path.glob("mooncake-*.log"))


def test_the_ratio_is_to_the_fastest_of_vllms_connectors_and_the_floor_has_no_prefill():
    def row(name: str, consumer: float, prefill: float | None = 10.0) -> vllm_pd.Row:
        return vllm_pd.Row(connector=name, tokens=100, reps=3, prefill_ms=prefill, decode_first_token_ms=consumer,
                           ttft_ms=None if prefill is None else prefill + consumer, same_tokens=True,
                           pulled_tokens=300, requests=8, new_tokens=12)
    lines = vllm_pd.table([row("nixl", 40.0), row("mooncake", 20.0), row("kpool-ucx", 10.0),
                           row("floor", 5.0, prefill=None)]).splitlines()
    by_name = {line.split()[0]: line.split() for line in lines[1:]}
    assert by_name["kpool-ucx"][7:9] == ["0.50x", "0.67x"]  # 10 / 20, (10 + 10) / (10 + 20)
    assert by_name["mooncake"][7] == "0.50x" and by_name["nixl"][7] == "2.00x"  # each against the other
    assert by_name["floor"][4:9] == ["-", "5.0", "-", "0.25x", "-"]
    named = vllm_pd.table([row("kpool-ucx-prefetch-idle", 10.0), row("nixl", 40.0)]).splitlines()
    ends = {line.index(" 8 ") + 2 for line in named[1:]} | {named[0].index("requests") + len("requests")}
    assert len(ends) == 1, "the columns do not line up under a long connector name:\n" + "\n".join(named)


def test_each_row_says_what_its_transfer_added_over_the_no_transfer_engine():
    def row(name: str, consumer: float, requests: int, same: bool | None = True) -> vllm_pd.Row:
        prefill = None if name == "no-transfer" else 10.0
        return vllm_pd.Row(connector=name, tokens=100 * requests, reps=3, prefill_ms=prefill,
                           decode_first_token_ms=consumer, ttft_ms=None if prefill is None else prefill + consumer,
                           same_tokens=same, pulled_tokens=300, requests=requests, new_tokens=12)
    lines = vllm_pd.table([row("mooncake", 20.0, 8), row("kpool-ucx", 17.5, 8), row("no-transfer", 15.0, 8, None),
                           row("kpool-ucx", 40.0, 64)]).splitlines()
    assert lines[0].split()[-5:] == ["over", "no-transfer", "pulled", "same", "tokens"]
    by_name = {(line.split()[0], line.split()[1]): line.split() for line in lines[1:]}
    assert by_name["kpool-ucx", "8"][9] == "+2.5" and by_name["mooncake", "8"][9] == "+5.0"
    assert by_name["no-transfer", "8"][7] == "0.75x"  # 15 / 20: below it no connector's phase can go
    assert by_name["no-transfer", "8"][9] == "-" and lines[-2].endswith("- (KV not the prompt's)")
    assert by_name["kpool-ucx", "64"][9] == "-"  # no no-transfer row for 64 requests


def test_a_row_of_reps_whose_tokens_are_not_compared_says_so_and_does_not_fail_the_run():
    scenario = vllm_pd.Scenario(lengths=(10, 10), new_tokens=3)
    reps = [vllm_pd.Rep(prefill_s=None, consumer_s=0.02, same_tokens=None, pulled_tokens=18) for _ in range(2)]
    row = vllm_pd.row_of(vllm_pd.Connector.NO_TRANSFER, scenario, reps)
    assert row.same_tokens is None and row.pulled_tokens == 36 and row.prefill_ms is None
    mixed = vllm_pd.row_of(vllm_pd.Connector.KPOOL_UCX, scenario, [reps[0], vllm_pd.Rep(
        prefill_s=0.01, consumer_s=0.02, same_tokens=False, pulled_tokens=20)])
    assert mixed.same_tokens is None  # a rep that was not compared makes the row not compared


def test_the_no_transfer_rows_are_skipped_with_the_reason_where_vllm_has_no_decode_bench_connector(
        chatty_engines, tmp_path, monkeypatch, capfd):
    vllm_root = tmp_path / "vllm"
    vllm_root.mkdir()
    monkeypatch.setattr(vllm_pd.importlib.util, "find_spec",
                        lambda name: type("Spec", (), {"submodule_search_locations": [str(vllm_root)]})())
    assert vllm_pd.main(["--tokens", "8", "--reps", "1", "--concurrent", "none", "--connectors",
                         "kpool-grpc,no-transfer", "--out", str(tmp_path)]) == 0
    out, _ = capfd.readouterr()
    assert out.splitlines()[-1] == (f"no-transfer: skipped: this vLLM has no DecodeBenchConnector "
                                    f"({vllm_root / vllm_one_engine.DECODE_BENCH_MODULE} is missing)")
    assert [r["connector"] for r in json.loads((tmp_path / "vllm_pd.json").read_text())] == ["kpool-grpc"]


def test_a_token_mismatch_says_how_many_requests_and_from_which_token():
    from kpool_pd.bench.vllm_rows import Rep, token_mismatch
    want = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert token_mismatch(want, want) == (0, -1)
    assert token_mismatch([[1, 2, 3], [4, 0, 6], [7, 8, 0]], want) == (2, 1)
    assert token_mismatch([[1, 2], [4, 5, 6], [7, 8, 9]], want) == (1, 2)  # shorter: differs where it ends
    with pytest.raises(ValueError, match="got tokens of 2 requests, want 3"):
        token_mismatch(want[:2], want)
    scenario = vllm_pd.Scenario(lengths=(10, 10, 10), new_tokens=3)
    reps = [Rep(prefill_s=0.01, consumer_s=0.02, same_tokens=False, pulled_tokens=30, differing_requests=2,
                first_difference=4),
            Rep(prefill_s=0.01, consumer_s=0.02, same_tokens=False, pulled_tokens=30, differing_requests=1,
                first_difference=1),
            Rep(prefill_s=0.01, consumer_s=0.02, same_tokens=True, pulled_tokens=30)]
    row = vllm_pd.row_of(vllm_pd.Connector.KPOOL_UCX, scenario, reps)
    assert (row.same_tokens, row.differing_requests, row.first_difference) == (False, 2, 1)
    assert vllm_pd.table([row]).splitlines()[1].endswith("NO (2 of 3, from token 1)")
    same = vllm_pd.row_of(vllm_pd.Connector.KPOOL_UCX, scenario, reps[2:])
    assert vllm_pd.table([same]).splitlines()[1].endswith(" yes")


def test_a_child_process_output_goes_to_its_log_and_not_the_terminal(tmp_path, capfd):
    log = tmp_path / "engine.log"
    context = multiprocessing.get_context("spawn")
    jobs, results = context.Queue(), context.Queue()
    child = context.Process(target=chatty_serve, args=("m", {"kv_role": "kv_producer"}, jobs, results),
                            kwargs={"log": log})
    child.start()
    try:
        assert results.get(timeout=120) == ("ready", None)
        jobs.put(None)
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
            child.join(60)
    assert child.exitcode == 0
    out, err = capfd.readouterr()
    assert CHATTER not in out + err
    text = log.read_text()
    assert text.count(f"{CHATTER} stdout") == CHATTER_LINES and f"{CHATTER} child 2" in text


@pytest.mark.vllm
def test_a_vllm_engine_that_fails_to_start_leaves_its_output_and_traceback_in_its_log(tmp_path, capfd):
    """vLLM itself (no engine starts: the model's architecture is unknown), its output in the log."""
    if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(vllm_engines.TINY_LLAMA | {"architectures": ["NoSuchForCausalLM"]}))
    log = tmp_path / "engine.log"
    with memory_share(1, "an engine that fails to start"):  # one process that imports vLLM
        engine = vllm_engines.EngineProcess(multiprocessing.get_context("spawn"), str(model), None,
                                            env={"HF_HUB_OFFLINE": "1"}, log=log)
        try:
            with pytest.raises(AssertionError, match="NoSuchForCausalLM"):
                engine.wait_ready(timeout_s=300)
        finally:
            engine.stop()
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    text = log.read_text()
    assert "Traceback (most recent call last):" in text and "NoSuchForCausalLM" in text
    assert re.search(r"\bINFO\b", text), text  # vLLM's logging


@pytest.mark.vllm
def test_a_short_run_pulls_every_prompt_token_and_matches_one_engine(tmp_path):
    if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")
    with memory_share(2, "bench vllm's engines"):  # a producer and a consumer: 2.9 GiB with this process (2026-12-07)
        assert vllm_pd.main(["--tokens", "40", "--reps", "2", "--concurrent", "2", "--new-tokens", "2",
                             "--connectors", "kpool-grpc", "--out", str(tmp_path)]) == 0
    row, concurrent = json.loads((tmp_path / "vllm_pd.json").read_text())
    assert row["connector"] == "kpool-grpc" and row["tokens"] == 40 and row["same_tokens"] is True
    assert row["pulled_tokens"] == 2 * 40  # both reps' prompts came over the connector
    assert 0 < row["prefill_ms"] < row["ttft_ms"]
    mixed = sum(vllm_pd.mixed_lengths(2))  # 7 and 2,000 tokens at once
    assert (concurrent["requests"], concurrent["tokens"], concurrent["new_tokens"]) == (2, mixed, 2)
    assert concurrent["same_tokens"] is True and concurrent["pulled_tokens"] == 2 * mixed


@pytest.mark.vllm
def test_the_no_transfer_engine_claims_all_but_each_prompts_last_token_and_compares_no_tokens(tmp_path, capfd):
    """vLLM's DecodeBenchConnector in the bench's one-engine row: every prompt token but the last counted as
    loaded by the connector, the row's tokens not compared, the run passing."""
    if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")
    with memory_share(1, "bench vllm's no-transfer engine"):
        assert vllm_pd.main(["--tokens", "40", "--reps", "2", "--concurrent", "2", "--new-tokens", "2",
                             "--connectors", "no-transfer", "--out", str(tmp_path)]) == 0
    single, concurrent = json.loads((tmp_path / "vllm_pd.json").read_text())
    assert single["connector"] == concurrent["connector"] == "no-transfer"
    assert single["same_tokens"] is None and single["prefill_ms"] is None and single["decode_first_token_ms"] > 0
    assert single["pulled_tokens"] == 2 * (40 - 1)
    mixed = vllm_pd.mixed_lengths(2)
    assert concurrent["pulled_tokens"] == 2 * sum(n - 1 for n in mixed)
    assert "no-transfer: starting one engine with vLLM's DecodeBenchConnector" in capfd.readouterr().err


@pytest.mark.parametrize("connector, announce", [(vllm_pd.Connector.KPOOL_UCX_PREFETCH, "computed"),
                                                 (vllm_pd.Connector.KPOOL_UCX_PREFETCH_IDLE, "idle")])
def test_the_prefetch_rows_name_the_consumer_and_set_when_the_producer_announces(connector, announce):
    """Both prefetch rows run KpoolPdConnector over UCX with the consumer's engine_id named to the producer (the
    proxy's prefetch_by); they differ only in the producer's ``announce``. The pull row names nobody."""
    ports = [5001, 5002]
    producer, consumer, _, _ = vllm_pd.transfer_configs(connector, ports)
    assert producer["kv_connector_extra_config"]["announce"] == announce
    assert consumer["kv_connector_extra_config"]["transport"] == "ucx"
    assert consumer["engine_id"] == vllm_pd.consumer_engine_id(ports)
    assert connector in vllm_pd.PREFETCHING and vllm_pd.Connector.KPOOL_UCX not in vllm_pd.PREFETCHING
