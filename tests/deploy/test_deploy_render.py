"""The Kubernetes manifests of ``deploy/`` render with ``kubectl kustomize`` in every variant
(overlay, or overlay + components), hold the expected objects, and every object passes
``kubernetes-validate --strict`` for the pinned Kubernetes version; the custom resources of the
components (KEDA's ScaledObject, the Prometheus Operator's PodMonitor) pass their strict schemas
(tests/support/deploy_crds.py)."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.support import deploy_crds as dc
from tests.support import deploy_manifests as dm
from tests.support.deploy_daemons import base_name

EXPECTED_OBJECTS = {
    ("ServiceAccount", "kpool-pd"), ("ConfigMap", "kpool-pd-config"), ("Service", "kpool-pd-prefill"),
    ("Service", "kpool-pd-decode"), ("Service", "kpool-pd-decode-headless"), ("Deployment", "kpool-pd-prefill"),
    ("Deployment", "kpool-pd-decode"), ("PodDisruptionBudget", "kpool-pd-prefill"),
    ("PodDisruptionBudget", "kpool-pd-decode"),
}
COMPONENT_OBJECTS = {
    "monitoring": {("PodMonitor", "kpool-pd")},
    "autoscaling": {("ScaledObject", "kpool-pd-prefill"), ("ScaledObject", "kpool-pd-decode")},
}
# The same-node overlay: the prefill workers live in the decode pods, which share a DRA claim of two GPUs.
SAME_NODE_OBJECTS = (EXPECTED_OBJECTS - {("Service", "kpool-pd-prefill"), ("Deployment", "kpool-pd-prefill"),
                                         ("PodDisruptionBudget", "kpool-pd-prefill")}
                     | {("ResourceClaimTemplate", "kpool-pd-gpu-pair")})
ALL_VARIANTS = pytest.mark.parametrize("variant", [*dm.VARIANTS, dm.SAME_NODE], ids=lambda v: v.id)


def _expected(variant: dm.Variant) -> set[tuple[str, str]]:
    if variant == dm.SAME_NODE:
        return SAME_NODE_OBJECTS
    return EXPECTED_OBJECTS.union(*(COMPONENT_OBJECTS.get(name, set()) for name in variant.components))


@ALL_VARIANTS
def test_renders_the_expected_objects(variant):
    objects = dm.render(variant)
    assert {(o["kind"], base_name(o)) for o in objects} == _expected(variant)
    assert len(objects) == len(_expected(variant))


def _strict_validation(path) -> str:
    proc = subprocess.run([dm.kubernetes_validate(), "--strict", "-k", dm.KUBERNETES_VERSION, str(path)],
                          capture_output=True, text=True, timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    return report


@ALL_VARIANTS
def test_every_object_passes_strict_schema_validation(variant, tmp_path):
    objects = dm.render(variant)
    rendered = tmp_path / f"{variant.id}.yaml"
    rendered.write_text(dm.render_text(variant))
    report = _strict_validation(rendered)
    passed = re.findall(r"passed for resource (\S+) against version", report)
    custom = [o for o in objects if o["kind"] in dm.CUSTOM_KINDS]
    assert len(passed) == len(objects) - len(custom), report
    for obj in custom:  # what Kubernetes' schemas do not hold, against the custom resources' own
        dc.validate(obj)


def test_strict_schema_validation_refuses_an_unknown_field(tmp_path):
    objects = dm.render(dm.Variant("cpu"))
    deployment = dm.find(objects, "Deployment", "kpool-pd-prefill")
    deployment["spec"]["template"]["spec"]["containers"][0]["port"] = 50051  # a typo of "ports"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(deployment))
    proc = subprocess.run([dm.kubernetes_validate(), "--strict", "-k", dm.KUBERNETES_VERSION, str(broken)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "port" in proc.stdout + proc.stderr


@pytest.mark.parametrize("breakage", ["typo-in-the-hpa-behaviour", "trigger-without-query", "threshold-not-a-number",
                                      "typo-in-a-scrape-endpoint", "no-endpoint"])
def test_the_custom_resource_schemas_refuse_what_their_crds_refuse(breakage):
    objects = dm.render(dm.Variant("cpu", ("monitoring", "autoscaling")))
    scaled = copy.deepcopy(dm.find(objects, "ScaledObject", "kpool-pd-decode"))
    monitor = copy.deepcopy(dm.find(objects, "PodMonitor", "kpool-pd"))
    trigger = scaled["spec"]["triggers"][0]["metadata"]
    if breakage == "typo-in-the-hpa-behaviour":
        scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilisationWindow"] = 1
    elif breakage == "trigger-without-query":
        del trigger["query"]
    elif breakage == "threshold-not-a-number":
        trigger["threshold"] = "twelve"
    elif breakage == "typo-in-a-scrape-endpoint":
        monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    else:
        monitor["spec"]["podMetricsEndpoints"] = []
    broken = monitor if "endpoint" in breakage else scaled
    with pytest.raises(jsonschema.ValidationError):
        dc.validate(broken)


def test_autoscaling_scales_each_role_slowly_down_and_owns_the_replicas():
    objects = dm.render(dm.Variant("cpu", ("monitoring", "autoscaling")))
    targets = []
    for scaled in dm.of_kind(objects, "ScaledObject"):
        spec = scaled["spec"]
        target = dm.find(objects, spec["scaleTargetRef"]["kind"], spec["scaleTargetRef"]["name"])
        targets.append(dm.component_of(target))
        assert "replicas" not in target["spec"], "the HPA owns the replicas; applying again must not reset them"
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 300  # each removed pod drains: scale down slowly
        assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
        # The series it reads come from the pods of the role it scales (tests/deploy/test_deploy_launch.py
        # checks that those pods export them).
        assert set(re.findall(r'container="(\w+)"', trigger["metadata"]["query"])) == {dm.component_of(target)}
    assert sorted(targets) == ["decode", "prefill"]
    (monitor,) = dm.of_kind(objects, "PodMonitor")
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for workload in dm.workloads(objects):
        assert dm.selects(monitor["spec"]["selector"]["matchLabels"], workload["spec"]["template"]["metadata"]["labels"])
        assert any(p["name"] in ports for c in dm.containers(workload) for p in c["ports"]), workload["metadata"]["name"]


def _patch_documents(kustomization: Path) -> dict[str, list[dict]]:
    """Each patch a kustomization names (a file, or inline): its YAML documents."""
    spec = yaml.safe_load(kustomization.read_text()) or {}
    found = {}
    for index, patch in enumerate(spec.get("patches", [])):
        if "path" in patch:
            name, text = patch["path"], (kustomization.parent / patch["path"]).read_text()
        else:
            name, text = f"patches[{index}]", patch.get("patch", "")
        found[f"{kustomization.parent.relative_to(dm.DEPLOY)}: {name}"] = [d for d in yaml.safe_load_all(text) if d]
    return found


def test_every_delete_patch_stands_alone_so_kustomize_5_5_renders_it():
    """kustomize up to v5.5 (kubectl 1.32) panics on a patch holding several ``$patch: delete``
    documents (kubernetes-sigs/kustomize#5552); one per patch renders on every version."""
    patches = {name: docs for k in sorted(dm.DEPLOY.rglob("kustomization.yaml")) for name, docs in
               _patch_documents(k).items()}
    deleting = {name: docs for name, docs in patches.items()
                if any(isinstance(d, dict) and d.get("$patch") == "delete" for d in docs)}
    assert deleting, "the same-node overlay deletes the prefill objects: no delete patch found?"
    crowded = {name: len(docs) for name, docs in deleting.items() if len(docs) > 1}
    assert not crowded, f"patches with a $patch: delete among several documents: {crowded}"
