"""Starting the daemons exactly as the rendered manifests describe them, on loopback.

For one container of a rendered workload, ``LocalPod`` does what the kubelet would, on this
machine: the image's environment (the final stage's ``ENV`` of ``deploy/Dockerfile``) under the
container's ``env``/``envFrom`` (ConfigMap and Secret references resolved from the objects given,
field references from the pod's name), ``$(VAR)`` expansion in args, each volume mount as a
local folder (ConfigMap and Secret volumes written out), and the container's ``command`` +
``args`` run as a subprocess. What cannot be the same on one machine is mapped, consistently in
every argument and environment value: bind addresses to 127.0.0.1, every container port to a
free local port, a Service's DNS name and port to 127.0.0.1 and the local port of the container
port it targets, and each mount path to its local folder. The startup, readiness and liveness
probes are then asked the way the kubelet asks them (grpc.health.v1 on the probe's port).
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import deploy_manifests as dm
from tests.support.ports import free_port

NAMESPACE = "default"
LOOPBACK = "127.0.0.1"
BIND_ANY = ("0.0.0.0", "::", "[::]")
# Where deploy/Dockerfile puts the package's virtual environment in the image; here it is the
# environment running the tests.
IMAGE_VENV = "/opt/kpool-pd"
# Mount paths that stay what they are here (the kernel's shared memory).
UNMAPPED_MOUNTS = ("/dev/shm",)
_HOST_PORT = re.compile(r"(?<![\w.-])([a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9-]+)*):(\d{1,5})(?!\d)")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class LaunchError(RuntimeError):
    pass


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ``ENV`` of the Dockerfile's final stage, as written."""
    lines, current = [], ""
    for raw in dockerfile.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        current += stripped.removesuffix("\\") + " "
        if not stripped.endswith("\\"):
            lines.append(current.strip())
            current = ""
    final = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    env: dict[str, str] = {}
    for line in lines[final + 1:]:
        if not line.upper().startswith("ENV "):
            continue
        for pair in shlex.split(line[4:]):
            name, sep, value = pair.partition("=")
            if not sep:
                raise LaunchError(f"{dockerfile}: ENV {pair!r} is not NAME=value")
            env[name] = value
    return env


def _localize_image_value(value: str) -> str:
    """An image ENV value with the image's virtual environment mapped to this one and
    ``$PATH`` taken from this process."""
    path = os.environ.get("PATH", "")
    return value.replace(IMAGE_VENV, sys.prefix).replace("${PATH}", path).replace("$PATH", path)


@dataclass
class PortMap:
    """Container ports of every workload -> free local ports, and Services resolved through them."""

    objects: list[dict]
    local: dict[tuple[str, int], int] = field(default_factory=dict)  # (workload name, containerPort) -> port

    def __post_init__(self) -> None:
        for workload in dm.workloads(self.objects):
            for container in dm.containers(workload):
                for port in container.get("ports", []):
                    self.local[(workload["metadata"]["name"], port["containerPort"])] = free_port()

    def of(self, workload: dict, container_port: int) -> int:
        return self.local[(workload["metadata"]["name"], container_port)]

    def service(self, host: str, port: int) -> int | None:
        """The local port behind ``host:port`` when host is a Service's DNS name, else None."""
        name, _, domain = host.partition(".")
        if domain not in ("", NAMESPACE, f"{NAMESPACE}.svc", f"{NAMESPACE}.svc.cluster.local"):
            return None
        services = [s for s in dm.of_kind(self.objects, "Service") if s["metadata"]["name"] == name]
        if not services:
            return None
        service = services[0]
        ports = [p for p in service["spec"]["ports"] if p["port"] == port]
        if not ports:
            raise LaunchError(f"Service {name} has no port {port}")
        target = ports[0].get("targetPort", port)
        for workload in dm.service_backends(self.objects, service):
            for container in dm.containers(workload):
                found = dm.container_port(container, target)
                if found is not None:
                    return self.of(workload, found["containerPort"])
        raise LaunchError(f"Service {name} port {port} (targetPort {target}) reaches no container port")


class LocalPod:
    """One container of a rendered workload, run here. ``start()``, ``wait_started()``,
    ``probe(kind)``, ``stop()`` (idempotent; SIGTERM, then SIGKILL after the grace period)."""

    def __init__(self, objects: list[dict], workload: dict, ports: PortMap | None, root: Path, *,
                 container: str | None = None, dockerfile: Path = dm.DEPLOY / "Dockerfile",
                 extra_objects: list[dict] = ()) -> None:
        """``ports`` None: no address or port is mapped (the container as it runs in the
        cluster; only its files are local), for reading what the daemon would be given.
        ``container`` names the pod's container to run (None: the pod must have exactly one)."""
        self.objects = [*objects, *extra_objects]
        self.workload = workload
        self.ports = ports
        kind, name = workload["kind"], workload["metadata"]["name"]
        self.pod_name = f"{name}-0" if kind == "StatefulSet" else f"{name}-local"
        spec = workload["spec"]["template"]["spec"]
        if spec.get("initContainers"):
            raise LaunchError(f"{kind}/{name}: init containers are not run here")
        chosen = [c for c in spec["containers"] if container is None or c["name"] == container]
        if len(chosen) != 1:
            raise LaunchError(f"{kind}/{name}: expected one container{f' named {container}' if container else ''}, "
                              f"found {[c['name'] for c in spec['containers']]}")
        self.pod_spec = spec
        self.container = chosen[0]
        self.root = root / self.pod_name / self.container["name"]
        self.mounts = self._make_volumes()
        self.env = self._environment(image_env(dockerfile))
        self.argv = self._argv()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root / "container.log"

    # -- what the kubelet resolves ---------------------------------------------------------

    def _object(self, kind: str, name: str) -> dict | None:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        return found[0] if found else None

    def _data(self, kind: str, name: str) -> dict[str, str] | None:
        obj = self._object(kind, name)
        if obj is None:
            return None
        data = dict(obj.get("data") or {})
        if kind == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data.update(obj.get("stringData") or {})
        return data

    def _key_ref(self, kind: str, ref: dict) -> str | None:
        data = self._data(kind, ref["name"])
        if data is None or ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise LaunchError(f"{self.pod_name}: {kind} {ref['name']} key {ref['key']} does not exist "
                              f"(the kubelet would not start the container)")
        return data[ref["key"]]

    def _field(self, path: str) -> str:
        fields = {"metadata.name": self.pod_name, "metadata.namespace": NAMESPACE, "status.podIP": LOOPBACK,
                  "status.hostIP": LOOPBACK, "spec.nodeName": socket.gethostname()}
        if path not in fields:
            raise LaunchError(f"{self.pod_name}: field reference {path} is not known here")
        return fields[path]

    def _make_volumes(self) -> dict[str, Path]:
        """mount path -> local folder, with ConfigMap and Secret volumes written out."""
        volumes = {v["name"]: v for v in self.pod_spec.get("volumes", [])}
        mounts: dict[str, Path] = {}
        for mount in self.container.get("volumeMounts", []):
            if mount["mountPath"] in UNMAPPED_MOUNTS:
                continue
            volume = volumes[mount["name"]]
            local = self.root / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
                if key not in volume:
                    continue
                source = volume[key]
                name = source.get("name") or source.get("secretName")
                data = self._data(kind, name)
                if data is None:
                    if source.get("optional"):
                        continue
                    raise LaunchError(f"{self.pod_name}: volume {mount['name']} needs {kind} {name}, which is missing")
                items = source.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    if item["key"] not in data:
                        raise LaunchError(f"{self.pod_name}: {kind} {name} has no key {item['key']}")
                    target = local / item["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(data[item["key"]])
            mounts[mount["mountPath"].rstrip("/")] = local
        return mounts

    def _environment(self, base: dict[str, str]) -> dict[str, str]:
        env = {k: _localize_image_value(self._map_path(v)) for k, v in base.items()}
        for source in self.container.get("envFrom", []):
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in source:
                    data = self._data(kind, source[key]["name"])
                    if data is None and not source[key].get("optional"):
                        raise LaunchError(f"{self.pod_name}: envFrom {kind} {source[key]['name']} is missing")
                    env.update({source.get("prefix", "") + k: v for k, v in (data or {}).items()})
        for var in self.container.get("env", []):
            if "value" in var:
                value = _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), var["value"])
            elif "valueFrom" in var:
                ref = var["valueFrom"]
                if "configMapKeyRef" in ref:
                    value = self._key_ref("ConfigMap", ref["configMapKeyRef"])
                elif "secretKeyRef" in ref:
                    value = self._key_ref("Secret", ref["secretKeyRef"])
                elif "fieldRef" in ref:
                    value = self._field(ref["fieldRef"]["fieldPath"])
                else:
                    raise LaunchError(f"{self.pod_name}: env {var['name']}: unsupported valueFrom {sorted(ref)}")
                if value is None:
                    continue
            else:
                value = ""
            env[var["name"]] = self._map_value(value, port_flag=var["name"].endswith("_PORT"))
        return env

    def _argv(self) -> list[str]:
        command = [_VAR_REF.sub(lambda m: self.env.get(m.group(1), m.group(0)), a)
                   for a in [*self.container.get("command", []), *self.container.get("args", [])]]
        if not command:
            raise LaunchError(f"{self.pod_name}: the container sets no command "
                              "(the image's entrypoint is not run here)")
        argv, port_next = [], False
        for arg in command:
            flag, sep, value = arg.partition("=")
            if arg.startswith("--") and sep:
                argv.append(f"{flag}={self._map_value(value, port_flag=flag.endswith('port'))}")
            else:
                argv.append(self._map_value(arg, port_flag=port_next))
            port_next = arg.startswith("--") and not sep and arg.endswith("port")
        executable = shutil.which(argv[0], path=self.env.get("PATH"))
        if executable is None:
            raise LaunchError(f"{self.pod_name}: {argv[0]} is not on the container's PATH {self.env.get('PATH')}")
        return [executable, *argv[1:]]

    # -- mapping onto this machine ------------------------------------------------------------

    def _map_path(self, value: str) -> str:
        for mount_path, local in sorted(self.mounts.items(), key=lambda kv: -len(kv[0])):
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(local) + value[len(mount_path):]
        return value

    def _map_value(self, value: str, *, port_flag: bool) -> str:
        if self.ports is None:
            return self._map_path(value)
        if value in BIND_ANY:
            return LOOPBACK
        if port_flag and value.isdigit():
            declared = {p["containerPort"] for p in self.container.get("ports", [])}
            if int(value) not in declared:
                raise LaunchError(f"{self.pod_name}: listens on port {value}, which no containerPort declares")
            return str(self.ports.of(self.workload, int(value)))

        def service(match: re.Match) -> str:
            local = self.ports.service(match.group(1), int(match.group(2)))
            return match.group(0) if local is None else f"{LOOPBACK}:{local}"

        return self._map_path(_HOST_PORT.sub(service, value))

    def local_port(self, container_port: int) -> int:
        return self.ports.of(self.workload, container_port)

    # -- the process ------------------------------------------------------------------------

    def start(self) -> None:
        workdir = Path(self._map_path(self.container.get("workingDir", "/tmp")))
        workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def probe(self, kind: str) -> str:
        """Ask the container's ``kind`` probe (startupProbe, readinessProbe, livenessProbe) once;
        returns the health status name, or the gRPC error code name."""
        spec = self.container[kind]
        if "grpc" not in spec:
            raise LaunchError(f"{self.pod_name}: {kind} has no grpc handler: {sorted(spec)}")
        port = self.local_port(spec["grpc"]["port"])
        with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")),
                    timeout=spec.get("timeoutSeconds", 1))
            except grpc.RpcError as exc:
                return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_started(self, timeout_s: float) -> float:
        """Poll the startup probe until SERVING (no longer than the probe itself would allow);
        returns the seconds it took."""
        spec = self.container["startupProbe"]
        allowed = min(timeout_s, spec.get("initialDelaySeconds", 0)
                      + spec.get("periodSeconds", 10) * spec.get("failureThreshold", 3))
        return self.wait_serving("startupProbe", allowed)

    def wait_serving(self, kind: str, timeout_s: float) -> float:
        """Poll the container's ``kind`` probe until SERVING, as the kubelet keeps asking it (a decode pod is
        ready only once it reaches a prefill pod, which a loaded machine can hold up after its start); returns
        the seconds it took. LaunchError naming the last status and the log's tail after ``timeout_s``."""
        started = time.monotonic()
        status = "not asked"
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise LaunchError(f"{self.pod_name} exited with status {self.proc.returncode} while its {kind} "
                                  f"said {status}:\n{self.log_tail()}")
            status = self.probe(kind)
            if status == "SERVING":
                return time.monotonic() - started
            time.sleep(0.2)
        raise LaunchError(f"{self.pod_name}: {kind} still {status} after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL once terminationGracePeriodSeconds have passed; the exit status
        (negative: killed by that signal)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.pod_spec.get("terminationGracePeriodSeconds", 30))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
