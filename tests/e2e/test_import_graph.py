"""The package's module-level imports form no cycle (config imports the family registry, so nothing the
registry imports may import config), and every module imports on its own in a fresh interpreter."""

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
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        modules[".".join(("qwen_npu_compile", *parts)).removesuffix(".__init__")] = path
    for path in sorted(PATTERNS.glob("*.py")):
        modules[f"qwen_npu_compile.patterns.{path.stem}".removesuffix(".__init__")] = path
    return modules


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``name`` imports at module level (function-level, lazy imports excluded)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def test_no_import_cycle_among_modules():
    modules = _modules()
    known = set(modules)
    # the package __init__ imports its public names; every submodule import passes through it by design
    graph = {name: _module_level_imports(name, path, known) - {"qwen_npu_compile"} for name, path in modules.items()}
    graph["qwen_npu_compile"] = set()
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = "open"
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_config_and_registry_import_first():
    modules = ("qwen_npu_compile.config", "qwen_npu_compile.patterns", "qwen_npu_compile.fusion", "qwen_npu_compile.fuse")
    # one fresh interpreter per module (each must import first), run side by side: each spends ~3 s importing torch
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], stderr=subprocess.PIPE, text=True) for m in modules}
    for module, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (module, err[-2000:])
