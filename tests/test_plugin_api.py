"""The house rules, read from the source: a backend imports xbridge only through the plugin API (xbridge.plugin,
xbridge.contract, xbridge.ir, xbridge.torch, xbridge.errors and the user's names of ``xbridge.__all__``), no module
is imported by a string, and the packages of xbridge import each other without a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import xbridge
from helpers import ROOT

API = ("xbridge.plugin", "xbridge.contract", "xbridge.ir", "xbridge.torch", "xbridge.errors")
PLUGINS = [ROOT / "backends", ROOT / "tests" / "fixtures" / "third_party"]


def _package(path: Path) -> str:
    """The package a file's relative imports start from (backends/ is installed as xbridge.backends)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "backends":
        parts.insert(0, "xbridge")
    return ".".join(parts[:-1])


def imports(path: Path, in_functions: bool = True, package: str | None = None) -> Iterator[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of each import in a file; ``in_functions=False``: those a module runs when it
    is imported (not in a function, not under ``if TYPE_CHECKING``). ``package``: the file's, if not in the tree."""
    package = package or _package(path)

    def visit(body: list[ast.stmt]) -> Iterator[tuple[int, str, list[str]]]:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not in_functions:
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield node.lineno, alias.name, []
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, node.module] if node.module else base) if node.level else node.module
                yield node.lineno, module or "", [alias.name for alias in node.names]
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from visit([child])
                elif isinstance(child, ast.ExceptHandler):
                    yield from visit(child.body)

    return visit(ast.parse(path.read_text()).body)


def _outside_the_api(module: str, names: list[str], own: str) -> list[str]:
    """What of xbridge an import of a plugin whose package is ``own`` reaches outside the API and its own package."""
    if not module.startswith("xbridge") or module.startswith(API) or (module + ".").startswith(own + "."):
        return []
    if module == "xbridge":     # the user's names, and the errors module
        return [f"xbridge.{name}" for name in names if name not in xbridge.__all__ and name != "errors"]
    return [module]


def test_backends_import_xbridge_only_through_the_plugin_api():
    found = [f"{path.relative_to(ROOT)}:{line}: {bad}"
             for folder in PLUGINS for path in sorted(folder.rglob("*.py"))
             for line, module, names in imports(path)
             for bad in _outside_the_api(module, names, ".".join(_package(path).split(".")[:3]))]
    assert found == [], "\n".join(found)


def test_the_check_sees_what_a_plugin_must_not_import(tmp_path):
    plugin = tmp_path / "executable.py"
    plugin.write_text("from xbridge.planner import ShardingPlan\nfrom xbridge import Program, errors, processes\n"
                      "from ...contract import Executable\nfrom . import ops\nfrom ..jaxjit import lowering\n"
                      "def f():\n    from ...run import loop\n    from xbridge.plugin import cache_dir\n")
    found = [bad for _, module, names in imports(plugin, package="xbridge.backends.mine")
             for bad in _outside_the_api(module, names, "xbridge.backends.mine")]
    assert found == ["xbridge.planner", "xbridge.processes", "xbridge.backends.jaxjit", "xbridge.run"], found


def test_every_name_of_the_plugin_api_exists_and_it_imports_no_ml_framework():
    import xbridge.plugin

    assert all(hasattr(xbridge.plugin, name) for name in xbridge.plugin.__all__)
    loaded = subprocess.run([sys.executable, "-c", "import sys, xbridge.plugin; print(sorted(m for m in "
                             "('torch', 'jax', 'torch_xla', 'torchax') if m in sys.modules))"],
                            capture_output=True, text=True, cwd=ROOT, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr


def _string_imports(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and ast.unparse(node.func).endswith(("import_module",
                                                                                         "__import__")):
            first = node.args[0]
            text = first.value if isinstance(first, ast.Constant) else (
                first.values[0].value if isinstance(first, ast.JoinedStr) and first.values
                and isinstance(first.values[0], ast.Constant) else "")
            if isinstance(text, str) and text.startswith("xbridge"):
                yield f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"


def test_no_module_of_xbridge_is_imported_by_a_string():
    found = [hit for folder in (ROOT / "xbridge", ROOT / "backends") for path in sorted(folder.rglob("*.py"))
             for hit in _string_imports(path)]
    assert found == [], found


def _node(module: str) -> str | None:
    """The package a module counts toward: xbridge.run.loop -> run; xbridge.backends.jaxjit.ops -> backends.jaxjit."""
    parts = module.split(".")
    if parts[0] != "xbridge" or len(parts) < 2:
        return None
    return ".".join(parts[1:3]) if parts[1] == "backends" and len(parts) > 2 else parts[1]


def package_graph(in_functions: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for folder in (ROOT / "xbridge", ROOT / "backends"):
        for path in folder.rglob("*.py"):
            source = _node(_package(path) + "." + path.stem)
            for _, module, names in imports(path, in_functions):
                submodules = [f"xbridge.{name}" for name in names if module == "xbridge" and (
                    (ROOT / "xbridge" / name).is_dir() or (ROOT / "xbridge" / f"{name}.py").exists())]
                for target in map(_node, [module, *submodules]):
                    if source and target and target != source:
                        graph.setdefault(source, set()).add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            connect(node)
    return found


@pytest.mark.parametrize("in_functions", [False, True], ids=["when-imported", "in-functions-too"])
def test_no_package_cycles(in_functions):
    assert cycles(package_graph(in_functions)) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _classes() -> dict[str, tuple[str, list[str], int]]:
    """Every top-level class of xbridge/ and backends/: (file, base names, methods it defines)."""
    found = {}
    for folder in (ROOT / "xbridge", ROOT / "backends"):
        for path in folder.rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    methods = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
                    found[node.name] = (str(path.relative_to(ROOT)), [ast.unparse(base).rpartition(".")[2]
                                                                     for base in node.bases], methods)
    return found


def test_no_executable_or_capability_class_has_over_15_methods():
    """An executable is built once, complete; what is not the contract lives in small collaborators (its
    diagnostics, probes, profiler: ``Executable.parts``)."""
    classes = _classes()
    roots = {"Executable", "Diagnostics", "Probes", "Profiling", "ShardedCheckpoint", "MultiProcess"}

    def belongs(name: str, seen: frozenset[str] = frozenset()) -> bool:
        return name in roots or (name in classes and name not in seen
                                 and any(belongs(base, seen | {name}) for base in classes[name][1]))

    counted = {name: methods for name, (_, _, methods) in classes.items() if belongs(name)}
    assert {"XlaExecutable", "JaxExecutable", "DistributedExecutable", "TorchExecutable", "RankEngine"} <= set(counted)
    assert {name: n for name, n in counted.items() if n > 15} == {}
