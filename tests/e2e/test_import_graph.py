"""The package's modules import one another one way: no import circle, counting the imports inside functions
(lazy ones) too, since a lazy import that closes a circle only hides it (config imports the family registry, so
nothing the registry imports may import config); and every module imports on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import qwen_npu_compile
import qwen_npu_compile.patterns

PACKAGE = Path(qwen_npu_compile.__file__).parent
PATTERNS = Path(qwen_npu_compile.patterns.__file__).parent  # installed as qwen_npu_compile.patterns


def _modules() -> dict[str, Path]:
    modules = {}
    for root, prefix in ((PACKAGE, ("qwen_npu_compile",)), (PATTERNS, ("qwen_npu_compile", "patterns"))):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join((*prefix, *parts)).removesuffix(".__init__")] = path
    return modules


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never run, so no edge of the graph)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``name`` imports, at module level or inside functions (lazily).

    ``from package import module`` depends on that module only (the package is being imported already);
    ``from package import name`` on the package's ``__init__``.
    """
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    found = set()
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
        found.update(target for target in targets if target in known and target != name)
    return found


def import_circles(modules: dict[str, Path]) -> list[list[str]]:
    """The import circles among ``modules`` (name -> file): the strongly connected components of more than one
    module of the import graph, each sorted, in order. The package's own ``__init__`` imports its public names
    and every submodule import passes through it by design: its edges are left out."""
    known = set(modules)
    graph = {name: sorted(_imports(name, path, known) - {"qwen_npu_compile"}) for name, path in modules.items()}
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


def test_no_import_circle_among_modules():
    circles = import_circles(_modules())
    assert not circles, f"{len(circles)} import circle(s): " + "; ".join(" <-> ".join(c) for c in circles)


def test_import_circles_count_lazy_imports(tmp_path):
    """The detector sees a circle closed by an import inside a function (as the four of issue 28 were), and not
    one through ``if TYPE_CHECKING:`` or through a package whose submodule is imported by name."""
    files = {
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .a import g\n",  # lazy: a <-> b
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n",
        "d.py": "from . import c\n",  # c -> d only under TYPE_CHECKING: no circle
        "__init__.py": "from .e import h\n",
        "e.py": "from . import a\n",  # from the package, a submodule by name: no edge to __init__
    }
    modules = {}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        modules[f"pkg.{name.removesuffix('.py')}".removesuffix(".__init__")] = tmp_path / name
    assert import_circles(modules) == [["pkg.a", "pkg.b"]]


def test_config_and_registry_import_first():
    modules = ("qwen_npu_compile.config", "qwen_npu_compile.patterns", "qwen_npu_compile.fusion.family", "qwen_npu_compile.fusion.manager")
    # one fresh interpreter per module (each must import first), run side by side: each spends ~3 s importing torch
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], stderr=subprocess.PIPE, text=True) for m in modules}
    for module, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (module, err[-2000:])
