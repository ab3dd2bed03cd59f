"""The import contract: the package's folders are the pipeline's stages, and a stage imports only the stages below it.

Every module of ``qwen_npu_compile`` (the families of the top-level ``patterns/`` folder included, installed as
``qwen_npu_compile.patterns``) belongs to exactly one layer of :data:`LAYERS`; a module may import modules of its own
layer or of a layer below, never above. Imports inside functions (lazy ones) count: a lazy import that goes upward
only hides the dependency. Imports under ``if TYPE_CHECKING:`` never run and do not count. Within a layer, import
circles are forbidden too. The package's own ``__init__`` (its public names, loaded lazily) sits above everything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import qwen_npu_compile
import qwen_npu_compile.patterns

PACKAGE = Path(qwen_npu_compile.__file__).parent
PATTERNS = Path(qwen_npu_compile.patterns.__file__).parent  # installed as qwen_npu_compile.patterns
ROOT = PACKAGE.parent

#: The layers, lowest first: ``(name, module prefixes)``. A prefix names a module and its submodules.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("settings", ("config",)),
    ("versions", ("compat", "layers")),
    ("ops", ("ops",)),
    ("stage 0: substitutions", ("substitutions",)),
    ("stage 1 and 3: graph", ("graph",)),
    ("stage 2: fusion and its families", ("fusion", "patterns")),
    ("reports", ("report", "dump")),
    ("torchair", ("torchair",)),
    ("stage 4: hand-off", ("handoff",)),
    ("backend", ("backend",)),
    ("integrations", ("integrations", "worker", "verl", "hf_trainer")),
    ("command line", ("cli", "__main__")),
)


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for root, prefix in ((PACKAGE, ("qwen_npu_compile",)), (PATTERNS, ("qwen_npu_compile", "patterns"))):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join((*prefix, *parts)).removesuffix(".__init__")] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never run, so no edge of the graph)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """Project modules ``name`` imports, at module level or inside functions, each with its first line.

    ``from package import module`` depends on that module only (the package is being imported already);
    ``from package import name`` on the package's ``__init__``.
    """
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                found.setdefault(target, node.lineno)
    return found


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (a dotted name under ``qwen_npu_compile``); None for the package
    itself."""
    if module == "qwen_npu_compile":
        return None
    relative = module.removeprefix("qwen_npu_compile.")
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(relative == prefix or relative.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise LookupError(f"{module} belongs to no layer of tests/test_layers.py LAYERS: add it where it belongs")


def upward_imports(found: dict[str, Path]) -> list[str]:
    """Every import of a module by a module of a lower layer, as ``file:line importer (layer) -> imported (layer)``."""
    known = set(found)
    bad = []
    for name, path in found.items():
        own = layer_of(name)
        if own is None:
            continue
        for target, line in sorted(imports(name, path, known).items()):
            other = layer_of(target)
            if other is not None and other > own:
                bad.append(f"{path.relative_to(ROOT)}:{line} {name} ({LAYERS[own][0]}) imports {target} "
                           f"({LAYERS[other][0]})")
    return bad


def import_circles(found: dict[str, Path]) -> list[list[str]]:
    """The import circles among ``found`` (name -> file): the strongly connected components of more than one module
    of the import graph, each sorted, in order. The package's ``__init__`` is left out (it imports its public
    names, and every submodule import passes through it by design)."""
    known = set(found)
    graph = {name: sorted(set(imports(name, path, known)) - {"qwen_npu_compile"}) for name, path in found.items()}
    graph["qwen_npu_compile"] = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(name: str) -> None:  # Tarjan's algorithm
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for dep in graph[name]:
            if dep not in index:
                visit(dep)
                low[name] = min(low[name], low[dep])
            elif dep in on_stack:
                low[name] = min(low[name], index[dep])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(circles)


def test_every_module_has_a_layer():
    unplaced = []
    for name in modules():
        try:
            layer_of(name)
        except LookupError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "\n".join(unplaced)


def test_stages_import_only_downward():
    bad = upward_imports(modules())
    assert not bad, f"{len(bad)} upward import(s):\n" + "\n".join(bad)


def test_no_import_circle():
    circles = import_circles(modules())
    assert not circles, f"{len(circles)} import circle(s): " + "; ".join(" <-> ".join(c) for c in circles)


def _fake_package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    found = {}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        found[("qwen_npu_compile." + name.removesuffix(".py").replace("/", ".")).removesuffix(".__init__")] = path
    return found


def test_the_contract_sees_lazy_upward_imports_and_circles(tmp_path, monkeypatch):
    """The checks can fail: an upward import inside a function is found, one under ``if TYPE_CHECKING:`` is not, and
    a lazy import that closes a circle is a circle."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = _fake_package(tmp_path, {
        "config.py": "def f():\n    from qwen_npu_compile.ops import define\n",  # settings -> ops, lazily: upward
        "ops/__init__.py": "",
        "ops/define.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from qwen_npu_compile import backend\n",
        "backend.py": "from qwen_npu_compile.ops import define\n",
        "graph/a.py": "from qwen_npu_compile.graph import b\n",
        "graph/b.py": "def g():\n    from qwen_npu_compile.graph.a import x\n",  # lazy: a <-> b
    })
    assert upward_imports(found) == ["config.py:2 qwen_npu_compile.config (settings) imports qwen_npu_compile.ops.define "
                                     "(ops)"]
    assert import_circles(found) == [["qwen_npu_compile.graph.a", "qwen_npu_compile.graph.b"]]
    with pytest.raises(LookupError, match="belongs to no layer"):
        layer_of("qwen_npu_compile.somewhere_new")


def test_pyproject_lists_every_package():
    """The wheel gets every package: pyproject's explicit list equals the folders that hold an ``__init__.py``."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert listed == folders, {"missing from pyproject": sorted(folders - listed), "no such package": sorted(listed - folders)}


@pytest.mark.parametrize("module", ["qwen_npu_compile.config", "qwen_npu_compile.cli.report", "qwen_npu_compile.patterns",
                                    "qwen_npu_compile.fusion.manager", "qwen_npu_compile.backend"])
def test_module_imports_first_in_a_fresh_interpreter(module):
    """Each imports on its own, and the command line's modules without torch (``--help`` and ``report`` start in a
    fraction of a second)."""
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    if module in ("qwen_npu_compile.config", "qwen_npu_compile.cli.report"):
        assert done.stdout.strip() == "False", f"{module} imported torch"
