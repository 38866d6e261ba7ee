"""Imports point one way (DESIGN section 1), read from the source of every production module with
``ast``. The product is one package, ``kpool_pd``; its layers are its subpackages: kvcache <- kernels,
model <- connector <- runtime <- prefill_worker, decode_worker <- bench <- the command line, the vLLM
connector and the router (the modules of ``kpool_pd`` itself, named ``kpool_pd`` below); the workers
never import each other; kvcache, kernels and model import no server machinery; outside the
connector, only the names of its facade (``kpool_pd.connector.__all__``) are imported, and
generated code only by its own package."""

from __future__ import annotations

import ast
from dataclasses import dataclass

import pytest

from tests.support.paths import REPO

PRODUCT = "kpool_pd"
LEVEL = {  # a package may import its own and those of a lower level
    "kvcache": 0,
    "kernels": 1, "model": 1,
    "connector": 2,
    "runtime": 3,
    "prefill_worker": 4, "decode_worker": 4,
    "bench": 5,
    "kpool_pd": 6,
}
SIBLINGS_APART = {frozenset({"prefill_worker", "decode_worker"})}  # same level, never importing each other
SERVER_MACHINERY = {"grpc", "grpc_health", "grpc_reflection", "prometheus_client", "yaml"}
NO_SERVER_MACHINERY = {"kvcache", "kernels", "model"}
FACADE = "connector"
FACADE_MODULE = f"{PRODUCT}.{FACADE}"
# Instrumentation that wraps internals by design and that no module imports: vLLM loads it by its module path.
# It may reach into the connector and the vLLM connector; nothing may import it (checked below).
INSTRUMENTATION = {"kpool_pd/bench/vllm_trace.py": "the vLLM connector with time stamps, for kpool_pd.bench.vllm_profile"}


@dataclass(frozen=True)
class Import:
    path: str     # the importing file, relative to the repository root
    line: int
    module: str   # the imported module, absolute ("kpool_pd.connector.shared.plan")
    names: tuple[str, ...] = ()  # for ``from module import names``

    @property
    def top(self) -> str:
        """The layer imported: a subpackage of the product, ``kpool_pd`` for its own modules, or a library."""
        return _layer_of(self.module.split("."))

    def __str__(self) -> str:
        what = f"from {self.module} import {', '.join(self.names)}" if self.names else f"import {self.module}"
        return f"{self.path}:{self.line}: {what}"


def _layer_of(parts: list[str] | tuple[str, ...]) -> str:
    if parts[0] != PRODUCT:
        return parts[0]
    return parts[1] if len(parts) > 1 and parts[1] in LEVEL else PRODUCT


def _package_of(path: Path) -> str:
    return _layer_of(path.relative_to(REPO).parts)


def _imports_in(source: str, rel: str) -> list[Import]:
    """Every import statement of one module's source (``rel``: its path from the repository root)."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Import):
            found += [Import(rel, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against the module's own package
                base = rel.removesuffix(".py").split("/")[:-node.level]
                module = ".".join(base + ([module] if module else []))
            if module == PRODUCT:  # ``from kpool_pd import kernels`` imports the subpackage itself
                found += [Import(rel, node.lineno, f"{PRODUCT}.{alias.name}") for alias in node.names]
            else:
                found.append(Import(rel, node.lineno, module, tuple(alias.name for alias in node.names)))
    return found


def _imports(path: Path) -> list[Import]:
    return _imports_in(path.read_text(), path.relative_to(REPO).as_posix())


def _modules() -> list[Path]:
    return sorted(p for p in (REPO / PRODUCT).rglob("*.py") if "__pycache__" not in p.parts)


EVERY = [(path, imp) for path in _modules() for imp in _imports(path)]
ALL = [(path, imp) for path, imp in EVERY if path.relative_to(REPO).as_posix() not in INSTRUMENTATION]


def _facade_names() -> set[str]:
    tree = ast.parse((REPO / PRODUCT / FACADE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("kpool_pd/connector/__init__.py defines no __all__")


def _report(violations: list[Import]) -> str:
    return "\n".join(str(v) for v in violations)


def test_every_production_package_is_read():
    packages = {_package_of(path) for path in _modules()}
    assert packages == set(LEVEL), f"missing packages: {set(LEVEL) - packages}"
    assert len(ALL) > 200  # every module's imports, not a vacuous pass


def test_outside_the_connector_only_its_facade_names_are_imported():
    facade = _facade_names()
    bad = [imp for path, imp in ALL if _package_of(path) != FACADE and imp.top == FACADE
           and (imp.module != FACADE_MODULE or not imp.names or not set(imp.names) <= facade)]
    assert not bad, "import these names from the connector's facade (kpool_pd.connector.__all__):\n" + _report(bad)


def test_generated_code_is_imported_by_its_own_package_only():
    bad = [imp for path, imp in ALL if "._generated" in f".{imp.module}"
           and _package_of(path) != imp.top]
    assert not bad, "generated code is its package's own (use connector.prefill_api or decode_worker.api):\n" + _report(bad)


def test_the_lower_packages_import_no_server_machinery():
    bad = [imp for path, imp in ALL if _package_of(path) in NO_SERVER_MACHINERY and imp.top in SERVER_MACHINERY]
    assert not bad, "kvcache, kernels and model stay free of grpc, prometheus and yaml:\n" + _report(bad)


def test_imports_point_downward():
    bad = [imp for path, imp in ALL if imp.top in LEVEL and LEVEL[imp.top] > LEVEL[_package_of(path)]]
    assert not bad, "a package imports one above it:\n" + _report(bad)


def test_the_workers_never_import_each_other():
    bad = [imp for path, imp in ALL if frozenset({_package_of(path), imp.top}) in SIBLINGS_APART]
    assert not bad, "what the workers share lives lower (runtime, connector, model):\n" + _report(bad)


def test_the_facade_exports_what_it_names():
    from kpool_pd import connector
    missing = [name for name in connector.__all__ if not hasattr(connector, name)]
    assert not missing and set(connector.__all__) == _facade_names()


@pytest.mark.parametrize("source,expected", [
    ("from kpool_pd.connector.shared.plan import plan_transfer", "kpool_pd.connector.shared.plan"),
    ("import kpool_pd.connector.decode.connector as d", "kpool_pd.connector.decode.connector"),
    ("from kpool_pd.connector import StatusError", "kpool_pd.connector"),
    ("def f():\n    from kpool_pd.connector._generated.kpoolpd.v1 import prefill_pb2", "kpool_pd.connector._generated.kpoolpd.v1"),
    ("from .scheduler import DecodeScheduler", "kpool_pd.decode_worker.scheduler"),
    ("from kpool_pd import kernels", "kpool_pd.kernels"),
], ids=["from-submodule", "import-submodule", "from-facade", "inside-a-function", "relative", "from-the-product"])
def test_the_reader_sees_each_import_form(source, expected):
    assert [imp.module for imp in _imports_in(source, "kpool_pd/decode_worker/probe.py")] == [expected]


def test_instrumentation_is_imported_by_nothing():
    """The modules exempt from the rules above are loaded by module path only (a string), never imported."""
    names = {path.removesuffix(".py").replace("/", ".") for path in INSTRUMENTATION}
    assert all((REPO / path).exists() for path in INSTRUMENTATION), INSTRUMENTATION
    bad = [imp for _, imp in EVERY if imp.module in names or any(f"{imp.module}.{n}" in names for n in imp.names)]
    assert not bad, "instrumentation is loaded by its module path, not imported:\n" + _report(bad)
