"""The Kubernetes manifests of ``deploy/`` render with ``kubectl kustomize`` in every variant
(overlay, or overlay + component), hold the expected objects, and every object passes
``kubernetes-validate --strict`` for the pinned Kubernetes version."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests import deploy_manifests as dm
from tests.deploy_daemons import base_name, variants

EXPECTED_OBJECTS = {
    ("ServiceAccount", "kpool-pd"), ("ConfigMap", "kpool-pd-config"), ("Service", "kpool-pd-prefill"),
    ("Service", "kpool-pd-decode"), ("StatefulSet", "kpool-pd-prefill"), ("Deployment", "kpool-pd-decode"),
    ("PodDisruptionBudget", "kpool-pd-prefill"), ("PodDisruptionBudget", "kpool-pd-decode"),
}


@variants
def test_renders_the_expected_objects(variant):
    objects = dm.render(variant)
    assert {(o["kind"], base_name(o)) for o in objects} == EXPECTED_OBJECTS
    assert len(objects) == len(EXPECTED_OBJECTS)


@variants
def test_every_object_passes_strict_schema_validation(variant, tmp_path):
    rendered = tmp_path / f"{variant.id}.yaml"
    rendered.write_text(dm.render_text(variant))
    proc = subprocess.run([dm.kubernetes_validate(), "--strict", "-k", dm.KUBERNETES_VERSION, str(rendered)],
                          capture_output=True, text=True, timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    passed = re.findall(r"passed for resource (\S+) against version", report)
    assert len(passed) == len(dm.render(variant)), report


def test_strict_schema_validation_refuses_an_unknown_field(tmp_path):
    objects = dm.render(dm.Variant("cpu"))
    statefulset = dm.find(objects, "StatefulSet", "kpool-pd-prefill")
    statefulset["spec"]["template"]["spec"]["containers"][0]["port"] = 50051  # a typo of "ports"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(statefulset))
    proc = subprocess.run([dm.kubernetes_validate(), "--strict", "-k", dm.KUBERNETES_VERSION, str(broken)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "port" in proc.stdout + proc.stderr
