"""What ``kpool-pd up`` and ``kpool-pd generate`` print: a table per request and a summary, or
one JSON object per request and then ``{"summary": ...}``."""

from __future__ import annotations

import json
import statistics

from kpool_pd.decode_worker.client import RequestFailed
from kpool_pd.decode_stats import DecodeSteps
from kpool_pd.model.colocated import RequestResult


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def plural(count: int, noun: str) -> str:
    """``1 request``, ``2 requests``, ``0 requests`` (nouns that take an s)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def table(results: list[RequestResult | RequestFailed]) -> str:
    header = (f"{'request':<12} {'prompt':>6} {'tokens':>6} {'transfer':>11} {'prefill ms':>10} {'xfer ms':>8} "
              f"{'exposed':>8} {'ttft ms':>8} "
              f"{'drafts':>7}  {'output digest':<13} {'state digest':<13} first tokens")
    lines = [header, "-" * len(header)]
    for r in results:
        if isinstance(r, RequestFailed):
            lines.append(f"{r.request_id:<12} FAILED {r.code.name}: {r.message}")
            continue
        shown = ", ".join(str(t) for t in r.tokens[:6]) + (", ..." if len(r.tokens) > 6 else "")
        lines.append(
            f"{r.request_id:<12} {r.prompt_len:>6} {len(r.tokens):>6} {_mib(r.transfer_bytes):>11} "
            f"{r.prefill_ms:>10.2f} {r.transfer_ms:>8.2f} {r.exposed_transfer_ms:>8.2f} {r.ttft_ms:>8.1f} {f'{r.drafts_accepted}/{r.drafts_proposed}':>7}  "
            f"{r.output_digest[:12]:<13} {r.state_digest[:12]:<13} [{shown}]")
    return "\n".join(lines)


def summary(results: list[RequestResult | RequestFailed], *, mode: str, wall_s: float, model: dict,
            transport: str, tls: bool = False, reference: list[RequestResult] | None = None,
            data_plane_encrypted: bool | None = None, devices: tuple[str, str] | None = None, dcp: int = 1,
            decode_steps: DecodeSteps | None = None) -> dict:
    """The run's summary. ``tls``: the connections were TLS; ``data_plane_encrypted``: the cache
    bytes between the daemons were too (only over the gRPC stream with TLS: UCX has no encryption;
    None when there was no data plane or it is not known); ``devices``: (prefill, decode) devices;
    ``dcp``: the decode instance's DCP ranks; ``decode_steps``: the decode daemon's steps during the run."""
    ok = [r for r in results if isinstance(r, RequestResult)]
    tokens = sum(len(r.tokens) for r in ok)
    out = {
        "mode": mode, "transport": transport, "tls": tls, "data_plane_encrypted": data_plane_encrypted,
        "model": model, "requests": len(results), "ok": len(ok),
        "failed": len(results) - len(ok), "tokens": tokens, "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        "transfer_bytes": sum(r.transfer_bytes for r in ok),
        "transfer_ms_mean": round(statistics.fmean([r.transfer_ms for r in ok]), 3) if ok else 0.0,
        "prefill_ms_mean": round(statistics.fmean([r.prefill_ms for r in ok]), 3) if ok else 0.0,
        "exposed_transfer_ms_mean": round(statistics.fmean([r.exposed_transfer_ms for r in ok]), 3) if ok else 0.0,
        "ttft_ms_p50": round(_percentile([r.ttft_ms for r in ok], 0.5), 3),
        "ttft_ms_p90": round(_percentile([r.ttft_ms for r in ok], 0.9), 3),
        "drafts_proposed": sum(r.drafts_proposed for r in ok),
        "drafts_accepted": sum(r.drafts_accepted for r in ok),
    }
    if devices is not None:
        out["prefill_device"], out["decode_device"] = devices
    if dcp > 1:
        out["dcp"] = dcp
    if decode_steps is not None:
        out["decode_steps"] = {"steps": decode_steps.steps, "seconds": round(decode_steps.seconds, 3),
                               "requests": decode_steps.requests}
    if reference is not None:
        by_id = {r.request_id: r for r in reference}
        out["colocated_match"] = sum(
            1 for r in ok if r.request_id in by_id
            and (r.output_digest, r.state_digest) == (by_id[r.request_id].output_digest, by_id[r.request_id].state_digest))
    return out


def summary_text(s: dict) -> str:
    m = s["model"]
    group = f"kpool {m['kpool']}" if m["family"] == "kpool" else f"ratio {m['compress_ratio']}"
    drafts = (f"; drafts accepted {s['drafts_accepted']}/{s['drafts_proposed']} "
              f"({100 * s['drafts_accepted'] / s['drafts_proposed']:.0f}%)" if s["drafts_proposed"] else "")
    dcp_text = f", {s['dcp']} DCP ranks" if s.get("dcp") else ""
    lines = [
        f"summary: {s['ok']}/{s['requests']} requests ok ({s['mode']}, "
        f"transport {s['transport'] or 'none (no request reached the decode node)'}"
        f"{' over mTLS' if s.get('tls') else ''}"
        f"{' (cache bytes over UCX NOT encrypted)' if s.get('tls') and s.get('data_plane_encrypted') is False else ''}"
        f"; {m['family']} "
        f"family, {group}, {m['num_spec']} drafts, {m['layers']} layers, block {m['block_size']}"
        f"{dcp_text})",
        f"  {s['tokens']} tokens in {s['wall_s']:.2f} s ({s['tokens_per_s']:.0f} tokens/s); ttft p50 "
        f"{s['ttft_ms_p50']:.1f} ms, p90 {s['ttft_ms_p90']:.1f} ms{drafts}",
    ]
    if s["mode"] == "pd":
        where = (f" (prefill on {s['prefill_device']}, decode on {s['decode_device']})"
                 if s.get("prefill_device", "cpu") != "cpu" or s.get("decode_device", "cpu") != "cpu" else "")
        # The exposed time is not a part of the transfer time: it runs from the end of the prompt's compute to
        # the last byte landed, waiting for a send included, while the transfer time counts only the moving.
        lines.append(f"  moved {_mib(s['transfer_bytes'])}, mean transfer {s['transfer_ms_mean']:.2f} ms a request "
                     f"(moving its bytes); the first token waited {s['exposed_transfer_ms_mean']:.2f} ms after the "
                     f"prefill for the last byte (exposed); mean prefill {s['prefill_ms_mean']:.2f} ms{where}")
    if "decode_steps" in s:
        lines.append("  " + DecodeSteps(**s["decode_steps"]).describe(s["wall_s"]))
    if "colocated_match" in s:
        lines.append(f"  colocated reference: {s['colocated_match']}/{s['ok']} requests match byte for byte "
                     f"(output and state digests)")
    return "\n".join(lines)


def json_lines(results: list[RequestResult | RequestFailed], s: dict) -> str:
    rows = []
    for r in results:
        if isinstance(r, RequestFailed):
            rows.append(json.dumps({"request_id": r.request_id, "error": r.code.name, "message": r.message}))
        else:
            rows.append(json.dumps(r.as_json()))
    rows.append(json.dumps({"summary": s}))
    return "\n".join(rows)
