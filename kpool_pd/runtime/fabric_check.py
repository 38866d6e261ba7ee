"""The data plane's fabric, checked once at start-up: which UCX transports and devices this process
uses, and whether they are what the deployment's profile (``--fabric``) needs.

``--fabric`` (``KPOOLPD_FABRIC``, YAML ``fabric``) names the profile:

- ``any`` (the default): the transports and devices are logged, nothing is required.
- ``gpu``: with ``--device cuda``, UCX must have ``cuda_copy`` (without it UCX cannot move GPU
  memory at all: the node is not ready); a missing ``cuda_ipc`` is a warning (GPU-to-GPU transfers
  on one node then go through host memory).
- ``rdma``: UCX must be offered and have an RDMA transport (``rc``, ``dc`` or ``ud``, as verbs or
  mlx5), and the soft locked-memory limit (``RLIMIT_MEMLOCK``) must be unlimited or at least
  ``MIN_RDMA_MEMLOCK``, since RDMA pins what it registers; plus the ``gpu`` checks.

A failed requirement is logged as an error and holds the node's health NOT_SERVING for good
(``HealthGate.hold``): the pod never turns ready, and its log says why. Its
liveness stays SERVING, since a restart cannot give it a fabric it lacks.

``check_fabric`` is the rule on plain values; ``fabric_report`` gathers the values from this
process (UCX's context, once the node's connector has made it, and the rlimit).
"""

from __future__ import annotations

import enum
import logging
import re
import resource
from dataclasses import dataclass
from pathlib import Path

from kpool_pd.connector import ucx_context_info
from kpool_pd.runtime.options import Option, one_of

logger = logging.getLogger(__name__)

MIN_RDMA_MEMLOCK = 1 << 30  # bytes: UCX's registered buffers and queues, and a host cache pool's registration
RDMA_FAMILIES = ("rc", "dc", "ud")  # rc_verbs, rc_mlx5, dc_mlx5, ud_verbs, ud_mlx5
# "#      resource 1  :  md 1  dev 1  flags -- tcp/eth0" in ucp_context_print_info
_RESOURCE = re.compile(r"^#\s*resource\s+\d+\s*:.*\s(?P<transport>[\w-]+)/(?P<device>\S+)\s*$", re.M)


class Fabric(enum.StrEnum):
    """The deployment profile whose data plane a daemon checks at start-up."""

    ANY = "any"
    GPU = "gpu"
    RDMA = "rdma"


FABRIC_OPTIONS: tuple[Option, ...] = (
    Option("fabric", one_of(Fabric), Fabric.ANY,
           "what the data plane must have at start-up, else the node is never ready: any (log only), gpu "
           "(UCX's cuda_copy with a CUDA device), rdma (also an RDMA transport and enough locked memory)",
           choices=tuple(f.value for f in Fabric)),
)


@dataclass(frozen=True)
class Resource:
    """One UCX transport on one device, as UCX lists it: ``rc_mlx5`` on ``mlx5_0:1``."""

    transport: str
    device: str

    def __str__(self) -> str:
        return f"{self.transport}/{self.device}"

    @property
    def rdma(self) -> bool:
        return self.transport.split("_")[0] in RDMA_FAMILIES


def parse_resources(context_info: str) -> tuple[Resource, ...]:
    """The transport/device pairs of UCX's context description (``ucp_context_print_info``), in order."""
    return tuple(Resource(m["transport"], m["device"]) for m in _RESOURCE.finditer(context_info))


def memlock_limit() -> int | None:
    """This process's soft ``RLIMIT_MEMLOCK`` in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def loaded_library(name: str, maps: Path = Path("/proc/self/maps")) -> str | None:
    """The path of the first mapped file whose name starts with ``name`` (``libucp.so``): which UCX
    this process loaded, the image's or the wheel's; None when not mapped or not readable."""
    try:
        text = maps.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and Path(fields[5]).name.startswith(name):
            return fields[5]
    return None


@dataclass(frozen=True, kw_only=True)
class FabricReport:
    """What the start-up check found: ``problems`` each keep the node from ever turning ready."""

    fabric: Fabric
    ucx: bool  # UCX is among the transports the node offers
    resources: tuple[Resource, ...]
    memlock: int | None  # bytes; None: unlimited
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    ucx_library: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def log_fields(self) -> dict[str, object]:
        """Fields of the start-up log line (and of the ready line)."""
        return {"fabric": self.fabric.value, "ucx_transports": sorted({r.transport for r in self.resources}),
                "ucx_devices": sorted({r.device for r in self.resources}), "ucx_library": self.ucx_library,
                "memlock": "unlimited" if self.memlock is None else self.memlock}


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / (1 << 20):.1f} MiB)"


def check_fabric(fabric: Fabric, *, ucx: bool, resources: tuple[Resource, ...], device_type: str,
                 memlock: int | None, min_memlock: int = MIN_RDMA_MEMLOCK, ucx_library: str | None = None,
                 ) -> FabricReport:
    """The rule of the module docstring on plain values. ``device_type`` is the torch device type
    (``cpu``, ``cuda``). ``ValueError`` for a fabric or a limit that is not one."""
    fabric = Fabric(fabric)
    if memlock is not None and (not isinstance(memlock, int) or memlock < 0):
        raise ValueError(f"memlock must be None (unlimited) or bytes >= 0, got {memlock!r}")
    transports = {r.transport for r in resources}
    listed = ", ".join(map(str, resources)) or "none"
    problems: list[str] = []
    warnings: list[str] = []
    if fabric is Fabric.RDMA:
        if not ucx:
            problems.append("fabric rdma needs the UCX transport, which this node does not offer "
                            "(--transports); the gRPC stream cannot use RDMA")
        elif not any(r.rdma for r in resources):
            problems.append(f"fabric rdma: UCX has no RDMA transport (rc, dc or ud); its resources are {listed}. "
                            "Either the UCX loaded was built without verbs (the image's UCX must be loaded: "
                            "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true; loaded: "
                            f"{ucx_library or 'unknown'}), or no RDMA device is in the pod (rdma/ib), or "
                            "UCX_TLS / UCX_NET_DEVICES leave them out")
        if memlock is not None and memlock < min_memlock:
            problems.append(f"fabric rdma: the locked-memory limit (RLIMIT_MEMLOCK) is {_bytes(memlock)}; RDMA "
                            f"pins what it registers and needs unlimited or at least {_bytes(min_memlock)}: raise "
                            "the container runtime's memlock limit (ulimit -l) on RDMA nodes")
    if fabric in (Fabric.GPU, Fabric.RDMA):
        if device_type != "cuda":
            warnings.append(f"fabric {fabric.value} with device {device_type}: the CUDA transports are not checked")
        elif not ucx:
            warnings.append(f"fabric {fabric.value}: UCX is not offered, so GPU memory moves through the gRPC "
                            "stream (host copies)")
        else:
            if "cuda_copy" not in transports:
                problems.append(f"fabric {fabric.value}: UCX has no cuda_copy transport, so it cannot move GPU "
                                f"memory (the UCX loaded is built without CUDA?); its resources are {listed}")
            if "cuda_ipc" not in transports:
                warnings.append(f"fabric {fabric.value}: UCX has no cuda_ipc transport: transfers between GPUs of "
                                "one node go through host memory, not NVLink")
    return FabricReport(fabric=fabric, ucx=ucx, resources=tuple(resources), memlock=memlock,
                        problems=tuple(problems), warnings=tuple(warnings), ucx_library=ucx_library)


def ucx_resources() -> tuple[Resource, ...]:
    """The transports and devices of this process's UCX context. Call it only once the node's
    connector has made its UCX worker: ucxx would otherwise make a context with default options."""
    return parse_resources(ucx_context_info())


def fabric_report(fabric: Fabric, *, ucx: bool, device_type: str) -> FabricReport:
    """``check_fabric`` on this process: UCX's context (when ``ucx``), the memlock limit, the UCX library loaded."""
    resources = ucx_resources() if ucx else ()
    return check_fabric(fabric, ucx=ucx, resources=resources, device_type=device_type, memlock=memlock_limit(),
                        ucx_library=loaded_library("libucp.so") if ucx else None)


def log_report(report: FabricReport) -> None:
    """One info line with what the data plane has, and a warning per warning (the problems are
    logged by ``HealthGate.hold``, as errors)."""
    logger.info("data plane: UCX %s", ", ".join(map(str, report.resources)) if report.ucx else "not offered",
                extra=report.log_fields())
    for warning in report.warnings:
        logger.warning("%s", warning)
