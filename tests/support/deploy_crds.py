"""Strict schemas of the custom resources that ``deploy/components`` render, which Kubernetes' own
schemas (kubernetes-validate) do not hold: KEDA's ScaledObject (keda.sh/v1alpha1) and the
Prometheus Operator's PodMonitor (monitoring.coreos.com/v1). Each lists the fields those projects
document for the parts used here, and nothing else (``additionalProperties: false``), so that a
misspelt or misplaced field fails as it would against the installed CRD. The HPA behaviour inside
a ScaledObject is checked against Kubernetes' own autoscaling/v2 schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
from referencing import Registry, Resource

from tests.support import deploy_manifests as dm


def _k8s_definitions() -> dict:
    """Kubernetes' strict schema definitions for the pinned version (kubernetes-validate's)."""
    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    return json.loads((folder / f"v{dm.KUBERNETES_VERSION}-local-strict" / "_definitions.json").read_text())


_DEFINITIONS = _k8s_definitions()
_REGISTRY = Resource.from_contents(_DEFINITIONS) @ Registry()


def _k8s(definition: str) -> dict:
    """A reference to one of Kubernetes' definitions (``io.k8s.api.autoscaling.v2....``)."""
    if definition not in _DEFINITIONS["$defs"]:
        raise KeyError(f"Kubernetes {dm.KUBERNETES_VERSION} defines no {definition}")
    return {"$ref": f"{_DEFINITIONS['$id']}#/$defs/{definition}"}


def _object(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STRING = {"type": "string"}
_INT = {"type": "integer"}
_METADATA = _object({"name": _STRING, "namespace": _STRING, "labels": {"type": "object"},
                     "annotations": {"type": "object"}}, ("name",))
_LABEL_SELECTOR = _object({"matchLabels": {"type": "object", "additionalProperties": _STRING},
                           "matchExpressions": {"type": "array"}})

SCALED_OBJECT = _object({
    "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": _METADATA,
    "spec": _object({
        "scaleTargetRef": _object({"apiVersion": _STRING, "kind": _STRING, "name": _STRING,
                                   "envSourceContainerName": _STRING}, ("name",)),
        "pollingInterval": _INT, "cooldownPeriod": _INT, "initialCooldownPeriod": _INT, "idleReplicaCount": _INT,
        "minReplicaCount": _INT, "maxReplicaCount": _INT,
        "fallback": _object({"failureThreshold": _INT, "replicas": _INT}, ("failureThreshold", "replicas")),
        "advanced": _object({
            "restoreToOriginalReplicaCount": {"type": "boolean"},
            "horizontalPodAutoscalerConfig": _object({
                "name": _STRING, "behavior": _k8s("io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior")}),
        }),
        "triggers": {"type": "array", "minItems": 1, "items": _object({
            "type": _STRING, "name": _STRING, "useCachedMetrics": {"type": "boolean"},
            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
            "authenticationRef": _object({"name": _STRING, "kind": _STRING}, ("name",)),
            "metadata": {"type": "object", "additionalProperties": _STRING},
        }, ("type", "metadata"))},
    }, ("scaleTargetRef", "triggers")),
}, ("apiVersion", "kind", "metadata", "spec"))

# The metadata a prometheus trigger takes (all strings).
PROMETHEUS_TRIGGER = _object({
    "serverAddress": _STRING, "query": _STRING, "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
    "activationThreshold": _STRING, "namespace": _STRING, "customHeaders": _STRING, "ignoreNullValues": _STRING,
    "unsafeSsl": _STRING, "queryParameters": _STRING,
}, ("serverAddress", "query", "threshold"))

_DURATION = {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h))+)$"}
POD_MONITOR = _object({
    "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"}, "metadata": _METADATA,
    "spec": _object({
        "selector": _LABEL_SELECTOR, "jobLabel": _STRING,
        "namespaceSelector": _object({"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STRING}}),
        "podTargetLabels": {"type": "array", "items": _STRING},
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _object({
            "port": _STRING, "portNumber": _INT, "path": _STRING,
            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
            "interval": _DURATION, "scrapeTimeout": _DURATION, "honorLabels": {"type": "boolean"},
            "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
        })},
    }, ("selector", "podMetricsEndpoints")),
}, ("apiVersion", "kind", "metadata", "spec"))

SCHEMAS = {"ScaledObject": SCALED_OBJECT, "PodMonitor": POD_MONITOR}


def validate(obj: dict) -> None:
    """jsonschema.ValidationError when ``obj`` (a custom resource of ``SCHEMAS``) does not fit."""
    if obj["kind"] not in SCHEMAS:
        raise KeyError(f"no schema for {obj['kind']}; known: {sorted(SCHEMAS)}")
    jsonschema.Draft202012Validator(SCHEMAS[obj["kind"]], registry=_REGISTRY).validate(obj)
    if obj["kind"] == "ScaledObject":
        for trigger in obj["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                jsonschema.validate(trigger["metadata"], PROMETHEUS_TRIGGER)
