"""What the decode daemon's steps took over a run, from its Prometheus metrics (``kpoolpd_decode_step_seconds``,
``kpoolpd_decode_step_requests``): read once before a run and once after, the difference tells whether the run's
decode phase was bound by its steps (the step loop busy most of the run) or by what happens between them."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

STEP_SECONDS = "kpoolpd_decode_step_seconds"
STEP_REQUESTS = "kpoolpd_decode_step_requests"


@dataclass(frozen=True)
class DecodeSteps:
    """Decode steps so far: how many, the seconds they took, and the requests they held, summed."""

    steps: int
    seconds: float
    requests: float

    def since(self, before: "DecodeSteps") -> "DecodeSteps":
        return DecodeSteps(steps=self.steps - before.steps, seconds=self.seconds - before.seconds,
                           requests=self.requests - before.requests)

    def describe(self, wall_s: float) -> str:
        """One line: the steps, their mean time and batch, and the share of ``wall_s`` spent stepping."""
        if not self.steps:
            return "decode: no step"
        return (f"decode: {self.steps} steps of {self.requests / self.steps:.1f} requests on average, "
                f"{1000 * self.seconds / self.steps:.2f} ms a step; stepping {self.seconds:.2f} s of the "
                f"{wall_s:.2f} s run ({100 * self.seconds / wall_s:.0f}%)")


def read_decode_steps(metrics_url: str, timeout_s: float = 10.0) -> DecodeSteps:
    """The decode daemon's step totals from its metrics endpoint (OSError when it cannot be read, ValueError when
    it does not serve the decode step metrics)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (f"{STEP_SECONDS}_sum", f"{STEP_SECONDS}_count", f"{STEP_REQUESTS}_sum"):
                totals[sample.name] = sample.value
    if len(totals) != 3:
        raise ValueError(f"{metrics_url} serves no decode step metrics ({STEP_SECONDS}, {STEP_REQUESTS})")
    return DecodeSteps(steps=int(totals[f"{STEP_SECONDS}_count"]), seconds=totals[f"{STEP_SECONDS}_sum"],
                       requests=totals[f"{STEP_REQUESTS}_sum"])
