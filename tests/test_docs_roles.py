"""Every Sphinx-style cross-reference role in the package's docstrings and comments names something real.

Scanned: every ``.py`` under ``qwen_npu_compile/`` and ``patterns/`` (parsed with :mod:`ast`, never run
except by importing it): module, class and function docstrings, every other bare string statement
(attribute docstrings), and every ``#`` comment (``#:`` attribute comments included); plus ``README.md``,
``docs/*.md`` and ``patterns/README.md``. Roles: ``:func:``, ``:mod:``, ``:class:``, ``:data:``,
``:meth:``, ``:attr:``, ``:exc:``, ``:obj:`` (also spelled ``:py:func:`` ...), target in backquotes.

How a target resolves (the first rule that finds it wins):

1. Spelling: ``title <target>`` takes the target in angle brackets; a leading ``~`` or ``!`` and a
   trailing ``()`` are dropped. A target with whitespace in it, or an empty one, is dangling.
2. Module of a file: ``qwen_npu_compile/a/b.py`` is ``qwen_npu_compile.a.b`` (a package's
   ``__init__.py`` is the package); ``patterns/x.py`` is ``qwen_npu_compile.patterns.x``, the name it
   installs under (so a target spelled ``patterns.x`` is dangling: nothing installs as plain ``patterns``).
   ``__main__.py`` is never imported (it runs the command): its targets resolve by rules 5 and 6 only.
   Markdown files have no module: rules 5 and 6 only.
3. Leading dot (``.name``, ``.sub.name``, any number of dots): relative to the file's module: looked up
   in the module itself, then in its package, then in each enclosing package up to ``qwen_npu_compile``
   (so ``.attention_contract.tnd_violation`` written in ``ops/torch_npu/fusion_attention_tnd.py`` finds
   ``qwen_npu_compile.ops.attention_contract``). Rules 4-6 are not tried for a leading-dot target.
4. No leading dot, in context: inside a class (its docstring, a method's or attribute's docstring, a
   comment in its body), first relative to that class and each enclosing class; then relative to the
   module's namespace, imported names included (``Refusal`` in a module that imports it is that class).
5. Absolute: the longest prefix that imports as a module (``importlib.import_module``), then
   ``getattr`` for the rest. ``qwen_npu_compile.x.y.Name``, ``torch.fx.GraphModule`` and so on.
6. Builtins: ``ValueError``, ``dict.get``.

``getattr`` also accepts, on a class, a name it declares without a class attribute: an annotation
anywhere in its MRO (dataclass fields without a default), a ``__slots__`` entry, or an instance attribute
that one of its methods assigns (``self.name = ...``); on a module, a name in its ``__annotations__`` and
a submodule that imports. A ``:mod:`` target must resolve to a module whose real name ends with the
target as written: an import alias (``near_miss as foreign_anchors``) does not make ``.foreign_anchors`` a
module name.

Third-party targets are resolved like ours (torch is always importable here). A target whose top-level
package cannot be imported here is skipped only when that package is listed in
:data:`NOT_IMPORTABLE_HERE` with the reason; any other unresolvable target is dangling. A module of ours
that fails to import fails the test (its roles cannot be checked).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import importlib.util
import inspect
import re
import textwrap
import tokenize
import types
import warnings
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Source folders scanned, with the module name their files install under.
SOURCE_ROOTS = {"qwen_npu_compile": "qwen_npu_compile", "patterns": "qwen_npu_compile.patterns"}
#: Relative-lookup stops at this package (rule 3).
TOP_PACKAGE = "qwen_npu_compile"
ROLE = re.compile(r":(?:py:)?(func|mod|class|data|meth|attr|exc|obj):`([^`]*)`")

#: Top-level packages whose targets are skipped when the package does not import here, and why.
NOT_IMPORTABLE_HERE = {
    "torch_npu": "the real torch_npu imports only on a host with Ascend's CANN libraries (libhccl.so)",
    "torchair": "ships inside the torch_npu wheel (torch_npu/dynamo/torchair) and imports only with it",
    "verl": "optional: installed by tools/verl_env_check.sh, not part of the test environment",
    "fla": "flash-linear-attention (fla-core) is optional; its triton kernels are not installed here",
    "mindspeed": "Ascend's MindSpeed is optional and only exists on Ascend hosts",
}


@dataclasses.dataclass(frozen=True)
class Ref:
    path: str  # relative to the repository root
    line: int
    role: str
    target: str
    module: str | None  # the file's module (None: no module context)
    classes: tuple[str, ...] = ()  # enclosing class qualnames, innermost first

    def __str__(self) -> str:
        return f"{self.path}:{self.line} :{self.role}:`{self.target}`"


# ------------------------------------------------------------------------------------------------ collect


def module_name(path: Path) -> str | None:
    rel = path.relative_to(ROOT)
    prefix = SOURCE_ROOTS[rel.parts[0]]
    parts = list(rel.with_suffix("").parts[1:])
    if parts and parts[-1] == "__main__":
        return None
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


def _class_spans(tree: ast.AST) -> list[tuple[int, int, str]]:
    spans = []

    def visit(node, qual):  # qual None: inside a function, where a class has no importable path
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = None if qual is None else f"{qual}.{child.name}" if qual else child.name
                if name is not None:
                    spans.append((child.lineno, child.end_lineno, name))
                visit(child, name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, None)
            else:
                visit(child, qual)

    visit(tree, "")
    return spans


def _classes_at(spans, line: int) -> tuple[str, ...]:
    inside = [(start, name) for start, end, name in spans if start <= line <= end]
    return tuple(name for _, name in sorted(inside, reverse=True))


def _roles_in(text: str, first_line: int):
    for match in ROLE.finditer(text):
        yield first_line + text.count("\n", 0, match.start()), match.group(1), match.group(2)


def collect_python(source: str, rel: str, module: str | None) -> list[Ref]:
    """The roles of one Python file's docstrings, bare string statements and comments."""
    with warnings.catch_warnings():  # a docstring's invalid escape is not this test's business
        warnings.simplefilter("ignore")
        tree = ast.parse(source)
    spans = _class_spans(tree)
    refs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            segment = ast.get_source_segment(source, node.value) or ""
            for line, role, target in _roles_in(segment, node.value.lineno):
                refs.append(Ref(rel, line, role, target, module, _classes_at(spans, node.value.lineno)))
    for token in tokenize.generate_tokens(iter(source.splitlines(keepends=True)).__next__):
        if token.type == tokenize.COMMENT:
            for line, role, target in _roles_in(token.string, token.start[0]):
                refs.append(Ref(rel, line, role, target, module, _classes_at(spans, line)))
    return refs


def python_files() -> list[Path]:
    return sorted(p for root in SOURCE_ROOTS for p in (ROOT / root).rglob("*.py") if "__pycache__" not in p.parts)


def markdown_files() -> list[Path]:
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "patterns" / "README.md"]
            if p.exists()]


def collect_all() -> list[Ref]:
    refs = []
    for path in python_files():
        refs += collect_python(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)), module_name(path))
    for path in markdown_files():
        for line, role, target in _roles_in(path.read_text(encoding="utf-8"), 1):
            refs.append(Ref(str(path.relative_to(ROOT)), line, role, target, None))
    return refs


# ------------------------------------------------------------------------------------------------ resolve

_MISSING = object()


class ImportFailure(Exception):
    pass


@cache
def _import(name: str):
    """The module ``name``, or None when no module has that name; ImportFailure when it exists but fails."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and (name == error.name or name.startswith(error.name + ".")):
            return None
        raise ImportFailure(f"importing {name}: {error!r}") from error
    except Exception as error:  # noqa: BLE001 - any import-time failure is reported
        raise ImportFailure(f"importing {name}: {error!r}") from error


@cache
def _assigned_on_self(cls: type) -> frozenset[str]:
    """Instance attributes the class's own methods assign (``self.x = ...``, ``self.x: T = ...``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return frozenset(names)


def _declared(cls: type, name: str) -> bool:
    for klass in inspect.getmro(cls):
        if name in vars(klass).get("__annotations__", {}) or name in (getattr(klass, "__slots__", ()) or ()):
            return True
        if name in _assigned_on_self(klass):
            return True
    return False


def _walk(obj, parts: list[str]):
    """``getattr`` along ``parts`` with the fallbacks of the module docstring; _MISSING if it fails."""
    for index, name in enumerate(parts):
        last = index == len(parts) - 1
        try:
            obj = getattr(obj, name)
            continue
        except Exception:  # noqa: BLE001 - a failing property or __getattr__ counts as missing
            pass
        if isinstance(obj, types.ModuleType):
            submodule = _import(f"{obj.__name__}.{name}")
            if submodule is not None:
                obj = submodule
                continue
            if last and name in getattr(obj, "__annotations__", {}):
                return True
        if inspect.isclass(obj) and last and _declared(obj, name):
            return True
        return _MISSING
    return obj


def _absolute(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _import(".".join(parts[:cut]))
        if module is not None:
            return _walk(module, parts[cut:])
    return _MISSING


def _ancestors(module: str) -> list[str]:
    """``module``, its package, each enclosing package up to :data:`TOP_PACKAGE`."""
    parts = module.split(".")
    names = [".".join(parts[:cut]) for cut in range(len(parts), 0, -1)]
    return [name for name in names if name == TOP_PACKAGE or name.startswith(TOP_PACKAGE + ".")]


def clean_target(target: str) -> str:
    titled = re.fullmatch(r".*<([^<>]+)>", target, flags=re.S)
    if titled:
        target = titled.group(1)
    target = target.strip().lstrip("~!")
    return target[:-2] if target.endswith("()") else target


def resolve(ref: Ref) -> tuple[str, str]:
    """``("ok", what)``, ``("skip", why)`` or ``("dangling", why)`` for one role."""
    target = clean_target(ref.target)
    if not target or re.search(r"\s", target) or not re.fullmatch(r"\.*[\w.]*\w", target):
        return "dangling", "malformed target"
    module = _import(ref.module) if ref.module else None
    if ref.module and module is None:
        return "dangling", f"the file's module {ref.module} does not exist"
    found = _MISSING
    if target.startswith("."):
        if module is None:
            return "dangling", "a relative target where there is no module"
        parts = target.lstrip(".").split(".")
        for base in _ancestors(ref.module):
            found = _walk(_import(base), parts)
            if found is not _MISSING:
                break
    else:
        parts = target.split(".")
        if module is not None:
            for qualname in ref.classes:
                cls = _walk(module, qualname.split("."))
                if cls is not _MISSING:
                    found = _walk(cls, parts)
                    if found is not _MISSING:
                        break
            if found is _MISSING:
                found = _walk(module, parts)
        if found is _MISSING and parts[0] != "patterns":
            found = _absolute(target)
        if found is _MISSING and hasattr(builtins, parts[0]):
            found = _walk(builtins, parts)
        if found is _MISSING:
            top = parts[0]
            if top in NOT_IMPORTABLE_HERE and importlib.util.find_spec(top) is None:
                return "skip", f"{top}: {NOT_IMPORTABLE_HERE[top]}"
    if found is _MISSING:
        return "dangling", "names nothing (see the resolution rules in tests/test_docs_roles.py)"
    if ref.role == "mod" and not isinstance(found, types.ModuleType):
        return "dangling", f"a :mod: role naming {type(found).__name__}, not a module"
    if ref.role == "mod" and not (found.__name__ + ".").endswith("." + target.lstrip(".") + ".") \
            and found.__name__ != target:
        return "dangling", f"names {found.__name__} by an import alias"
    return "ok", ""


# ------------------------------------------------------------------------------------------------ tests


def test_every_role_resolves():
    refs = collect_all()
    assert len(refs) > 500, f"only {len(refs)} roles found: is the scan broken?"
    results = []
    for ref in refs:
        try:
            results.append((ref, *resolve(ref)))
        except ImportFailure as error:
            results.append((ref, "dangling", str(error)))
    skipped = sorted({why for _, status, why in results if status == "skip"})
    print(f"{len(refs)} roles checked, {sum(s == 'skip' for _, s, _ in results)} skipped:", *skipped, sep="\n  ")
    bad = [f"{ref} -- {why}" for ref, status, why in results if status == "dangling"]
    assert not bad, f"{len(bad)} dangling role(s):\n" + "\n".join(bad)


def test_a_dangling_role_fails():
    """The checker itself: a stale module path, a name the module lacks, a relative path that is not there
    and a missing method are dangling; the roles naming real things (module-, class-, package-relative,
    absolute, builtin, a dataclass field without a default) resolve."""
    source = '''"""Uses :func:`qwen_npu_compile.fuse.fuse`, :func:`run_report`, :mod:`.attention_contract`,
:func:`~qwen_npu_compile.fusion.manager.fuse`, :class:`Refusal`, :mod:`.graph.emit`, :exc:`KeyError`."""
from qwen_npu_compile.fusion.family import Refusal


class GraphReport:
    """:meth:`as_dict`, :attr:`downstream`, :func:`get_reports`, :mod:`qwen_npu_compile.report.get_reports`."""

    def as_dict(self):
        pass  # :meth:`no_such_method`
'''
    refs = collect_python(source, "qwen_npu_compile/report.py", "qwen_npu_compile.report")
    status = {(ref.target, ref.line): resolve(ref)[0] for ref in refs}
    assert status == {
        ("qwen_npu_compile.fuse.fuse", 1): "dangling",  # the module before the re-layout
        ("run_report", 1): "dangling",
        (".attention_contract", 1): "dangling",  # ops.attention_contract is not above report
        ("~qwen_npu_compile.fusion.manager.fuse", 2): "ok",
        ("Refusal", 2): "ok",  # imported into the module
        (".graph.emit", 2): "ok",  # found in the enclosing package
        ("KeyError", 2): "ok",
        ("as_dict", 7): "ok",
        ("downstream", 7): "ok",
        ("get_reports", 7): "ok",
        ("qwen_npu_compile.report.get_reports", 7): "dangling",  # :mod: naming a function
        ("no_such_method", 10): "dangling",
    }, status
