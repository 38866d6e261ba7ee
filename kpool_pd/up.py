"""``kpool-pd up``: one prefill and one decode daemon on loopback, the requests, the report.

With ``--colocated`` the same requests run in this process with no transfer (the reference).
A PD run also runs the colocated reference afterwards and says how many requests match it.

However a PD run ends it leaves nothing behind: SIGTERM, SIGINT or SIGHUP stops both daemons (they
drain, at most ``INTERRUPT_GRACE_S``) and removes the run's temporary folder (logs, ready files,
the throwaway CA and its key) before ``up`` exits with status 128 + the signal's number; and the
daemons drain by themselves if ``up`` is killed outright (``kpool_pd.runtime.launch``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from kpool_pd.connector import ucx_available
from kpool_pd.certs import CertificateError, issue, make_ca
from kpool_pd.decode_worker.client import RequestFailed, generate_all
from kpool_pd.decode_stats import DecodeSteps, read_decode_steps
from kpool_pd.runtime.launch import Daemon, DaemonError, start_decode, start_prefill
from kpool_pd.report import json_lines, plural, summary, summary_text, table
from kpool_pd.kvcache import DcpConfig
from kpool_pd.model.colocated import make_prompts, run_colocated
from kpool_pd.runtime import SettingsError, client_tls, model_config, model_flags
from kpool_pd.runtime.options import MAX_SECONDS
from kpool_pd.runtime.geometry import check_kernel_page_on, check_serving_geometry

READY_TIMEOUT_S = 120.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
INTERRUPT_GRACE_S = 10.0  # how long each daemon may drain once `up` is told to stop
UP_MODEL_DEFAULTS = {"num_spec": 3}  # where `up` differs from the daemons' defaults


def default_transport() -> str:
    return "ucx" if ucx_available() else "grpc"


def placement(device: str, dcp: int = 1) -> tuple[str, str]:
    """(prefill device, decode device) for ``up --device``: cpu for both; with cuda the prefill on
    cuda:0 and the decode on cuda:1 when there are two GPUs, else both on cuda:0. With ``dcp`` ranks
    the decode device is the first of the ranks' GPUs, one each: from cuda:1 when the machine has
    ``dcp + 1`` GPUs, else from cuda:0. ValueError when ``device`` is cuda and this machine has no
    CUDA device, or fewer than ``dcp``."""
    if device == "cpu":
        return "cpu", "cpu"
    if device != "cuda":
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if dcp > count:
        raise ValueError(f"--dcp {dcp} --device cuda: one GPU per decode rank, and this machine has {count}")
    return "cuda:0", ("cuda:1" if count >= dcp + 1 else "cuda:0")


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _decode_steps(metrics_url: str) -> DecodeSteps | None:
    """The decode daemon's step totals now; None, with a warning saying why, where its metrics cannot be read."""
    try:
        return read_decode_steps(metrics_url)
    except (OSError, ValueError) as exc:
        _progress(f"warning: the decode daemon's step metrics are not readable ({exc}): no decode step line")
        return None


class Teardown:
    """What a PD run must undo however it ends: its daemons and its temporary folder.

    Inside ``with``, SIGTERM, SIGINT and SIGHUP stop every daemon it ``start``ed (SIGTERM to all, so
    they drain together, then SIGKILL after ``INTERRUPT_GRACE_S``), remove ``workdir`` and exit
    the process at once with status 128 + the signal (whatever the main thread was doing: waiting
    for a daemon, running the requests); a second signal meanwhile is ignored. On a normal exit the
    caller's context managers stop the daemons and remove the folder, and the handlers are put back.
    """

    def __init__(self) -> None:
        self.workdir: Path | None = None
        self.daemons: list[Daemon] = []
        self._previous: dict[int, object] = {}
        self._starting = False
        self._deferred: int | None = None  # a stop signal that came while a daemon was starting

    def __enter__(self) -> "Teardown":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def start(self, launch: Callable[[], Daemon]) -> Daemon:
        """Start a daemon (``launch()``) and stop it too if a signal comes; returns it. A signal that comes
        while it starts (its process may exist before ``launch`` returns it) is acted on once it is tracked."""
        self._starting = True
        try:
            daemon = launch()
            self.daemons.append(daemon)
            return daemon
        finally:
            self._starting = False
            if self._deferred is not None:
                self._stop_everything(self._deferred)

    def _on_signal(self, signum: int, _frame) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if self._starting:  # a daemon is starting: ``start`` stops everything once it holds that daemon
            self._deferred = signum
            return
        self._stop_everything(signum)

    def _stop_everything(self, signum: int) -> None:
        _progress(f"{signal.Signals(signum).name}: stopping the daemons"
                  f"{f' and removing {self.workdir}' if self.workdir else ''} ...")
        for daemon in self.daemons:
            daemon.signal(signal.SIGTERM)
        for daemon in reversed(self.daemons):
            try:
                daemon.stop(INTERRUPT_GRACE_S)
            except subprocess.SubprocessError:  # the main thread was inside this daemon's own wait
                daemon.kill()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        os._exit(128 + signum)


def block_sizes(args) -> tuple[int, int]:
    """The prefill and decode daemons' block sizes: ``--prefill-block-size`` and
    ``--decode-block-size``, each defaulting to ``--block-size`` (0: the model's default)."""
    return (args.prefill_block_size or args.block_size, args.decode_block_size or args.block_size)


def _counts_refused(args, names: tuple[str, ...]) -> bool:
    """Say so (and True) when one of these count flags is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            _progress(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
            return True
    return False


def run_up(args) -> int:
    if _counts_refused(args, ("requests", "prompt_len", "max_tokens", "max_batch_tokens", "max_running")):
        return 2
    for name in ("prefill_block_size", "decode_block_size"):
        if getattr(args, name) < 0:
            _progress(f"error: --{name.replace('_', '-')} must be >= 0 (0: --block-size), got {getattr(args, name)}")
            return 2
    try:  # a bad combination fails here, before any daemon starts
        prefill_config, config = (model_config({**vars(args), "block_size": size}) for size in block_sizes(args))
    except ValueError as exc:
        _progress(f"error: {exc}")
        return 2
    try:
        if args.dcp > 1 and prefill_config.cache.block_size != config.cache.block_size:
            raise ValueError(f"--dcp {args.dcp} needs one block size for prefill and decode, got "
                             f"{prefill_config.cache.block_size} and {config.cache.block_size}")
        for checked in (prefill_config, config):  # the geometry the daemons refuse, refused here too
            check_serving_geometry(checked.cache)
        DcpConfig.for_cache(config.cache, size=args.dcp, interleave=args.dcp_interleave or None)
        prefill_device, decode_device = placement(args.device, args.dcp)
        check_kernel_page_on(prefill_config.cache, torch.device(prefill_device))
        check_kernel_page_on(config.cache, torch.device(decode_device))
    except ValueError as exc:
        _progress(f"error: {exc}")
        return 2
    reference_device = torch.device(prefill_device)
    torch.set_num_threads(1)  # the colocated runs: small ops are faster on one thread
    requests = make_prompts(args.requests, args.prompt_len, seed=args.seed, vocab_size=config.vocab_size,
                            max_tokens=args.max_tokens)
    done = [0]

    def on_done(result) -> None:
        done[0] += 1
        what = (f"failed: {result.code.name}" if isinstance(result, RequestFailed)
                else f"{len(result.tokens)} tokens, ttft {result.ttft_ms:.0f} ms")
        _progress(f"[{done[0]}/{len(requests)}] {result.request_id}: {what}")

    if args.colocated:
        _progress(f"running {plural(len(requests), 'request')} colocated (one process, no transfer, on {reference_device}) ...")
        started = time.perf_counter()
        results = run_colocated(config, requests, on_result=on_done, device=reference_device)
        wall = time.perf_counter() - started
        report = summary(results, mode="colocated", wall_s=wall, model=config.describe(), transport="none")
        _print(args, results, report)
        return 0

    prefill_model, model = (model_flags({**vars(args), "block_size": c.cache.block_size})
                            for c in (prefill_config, config))
    limits = ["--max-prompt-tokens", str(args.prompt_len), "--max-new-tokens", str(args.max_tokens)]
    with Teardown() as teardown, tempfile.TemporaryDirectory(prefix="kpool-pd-up-") as tmp:
        workdir = teardown.workdir = Path(tmp)
        tls_flags, tls = [], None
        if args.tls:
            try:
                ca = make_ca(workdir)
                server, client = issue(workdir, ca, "daemon"), issue(workdir, ca, "client")
            except CertificateError as exc:
                _progress(f"error: {exc}")
                return 2
            tls_flags = ["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-ca", str(ca.cert),
                         "--tls-require-client-auth", "true"]
            tls = client_tls(ca=str(ca.cert), cert=str(client.cert), key=str(client.key))
            _progress(f"made a throwaway CA and certificates in {workdir}: every connection uses mTLS")
            if args.transport == "ucx":
                _progress("warning: UCX has no encryption: the cache bytes between the daemons travel unencrypted "
                          "(--transport grpc keeps them inside TLS)")
        # Two credentials, never one: the client token for the Generate API, the peer token between
        # the daemons; through the environment, since any user can read a command line.
        client_token, peer_token = secrets.token_hex(16), secrets.token_hex(16)
        peer_env = {"KPOOLPD_PEER_TOKEN": peer_token}
        _progress(f"starting the prefill daemon on {prefill_device} (transport {args.transport}, "
                  f"{prefill_config.cache.block_size}-token blocks; logs in {workdir}) ...")
        t0 = time.perf_counter()
        with teardown.start(lambda: start_prefill(workdir, prefill_model, transports=args.transport, env=peer_env,
                                          extra=["--max-prompt-tokens", str(args.prompt_len), "--device", prefill_device,
                                                 "--max-batch-tokens", str(args.max_batch_tokens),
                                                 *tls_flags])) as prefill:
            try:
                prefill.wait_ready(READY_TIMEOUT_S)
                _progress(f"  prefill ready on 127.0.0.1:{prefill.port} (metrics :{prefill.metrics_port}) "
                          f"after {time.perf_counter() - t0:.1f} s")
                t0 = time.perf_counter()
                _progress(f"starting the decode daemon on {decode_device} ({config.cache.block_size}-token blocks"
                          f"{f', {args.dcp} DCP ranks' if args.dcp > 1 else ''}) ...")
                with teardown.start(lambda: start_decode(workdir, model, [f"127.0.0.1:{prefill.port}"],
                                                 transport=args.transport,
                                                 env={**peer_env, "KPOOLPD_TOKEN": client_token},
                                                 extra=[*limits, "--max-running", str(min(args.requests, args.max_running)),
                                                        "--device", decode_device, "--dcp", str(args.dcp),
                                                        "--dcp-interleave", str(args.dcp_interleave),
                                                        *tls_flags])) as decode:
                    decode.wait_ready(READY_TIMEOUT_S)
                    _progress(f"  decode ready on 127.0.0.1:{decode.port} (metrics :{decode.metrics_port}) "
                              f"after {time.perf_counter() - t0:.1f} s")
                    _progress(f"sending {plural(len(requests), 'request')} of {args.prompt_len} prompt tokens, "
                              f"{args.max_tokens} output tokens each ...")
                    metrics_url = f"http://127.0.0.1:{decode.metrics_port}/metrics"
                    steps_before = _decode_steps(metrics_url)
                    started = time.perf_counter()
                    results = asyncio.run(generate_all(f"127.0.0.1:{decode.port}", requests, token=client_token,
                                                       tls=tls, on_done=on_done))
                    wall = time.perf_counter() - started
                    steps_after = _decode_steps(metrics_url)
                    steps = steps_after.since(steps_before) if steps_before and steps_after else None
                    _progress("stopping the daemons ...")
            except DaemonError as exc:
                _progress(f"error: {exc}")
                return 2
    _progress(f"running the colocated reference on {reference_device} ...")
    reference = run_colocated(config, requests, device=reference_device)
    described = config.describe() | {"prefill_block_size": prefill_config.cache.block_size}
    report = summary(results, mode="pd", wall_s=wall, model=described, devices=(prefill_device, decode_device),
                     transport=args.transport, tls=args.tls, reference=reference,
                     data_plane_encrypted=bool(args.tls) and args.transport == "grpc", dcp=args.dcp,
                     decode_steps=steps)
    _print(args, results, report)
    return 0 if report["failed"] == 0 and report["colocated_match"] == report["ok"] else 1


def _print(args, results, report) -> None:
    if args.json:
        print(json_lines(results, report))
    else:
        print(table(results))
        print()
        print(summary_text(report))


def run_generate(args) -> int:
    from kpool_pd.decode_worker.client import model_info

    if _counts_refused(args, ("requests", "prompt_len", "max_tokens")):
        return 2
    if not 0 < args.timeout_s <= MAX_SECONDS:
        _progress(f"error: --timeout-s must be in (0, {MAX_SECONDS:.0f}] seconds, got {args.timeout_s}")
        return 2
    try:
        tls = client_tls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, server_name=args.tls_server_name)
    except SettingsError as exc:
        _progress(f"error: {exc}")
        return 2
    try:
        info = asyncio.run(model_info(args.decode, token=args.token or None, tls=tls))
    except grpc.aio.AioRpcError as exc:  # unreachable, refused (token, TLS), or not a decode daemon
        _progress(f"error: the decode daemon at {args.decode} did not answer ModelInfo: "
                  f"{exc.code().name}: {exc.details()}")
        return 1
    for name, limit in (("prompt_len", info["max_prompt_tokens"]), ("max_tokens", info["max_new_tokens"])):
        if limit and getattr(args, name) > limit:
            _progress(f"error: --{name.replace('_', '-')} {getattr(args, name)} is above the decode daemon's "
                      f"limit of {limit}")
            return 2
    requests = make_prompts(args.requests, args.prompt_len, seed=args.seed, vocab_size=info["vocab_size"],
                            max_tokens=args.max_tokens)
    _progress(f"sending {plural(len(requests), 'request')} to {args.decode} ({info['model']['family']} model, "
              f"layout {info['layout_hash'][:12]}) ...")
    started = time.perf_counter()
    results = asyncio.run(generate_all(args.decode, requests, token=args.token or None, tls=tls,
                                       timeout_s=args.timeout_s))
    used = {r.transport for r in results if not isinstance(r, RequestFailed)}
    report = summary(results, mode="pd", wall_s=time.perf_counter() - started, model=info["model"],
                     transport=",".join(sorted(used)), tls=tls is not None,
                     data_plane_encrypted=False if "ucx" in used else None)
    _print(args, results, report)
    return 0 if report["failed"] == 0 else 1
