"""torch's own ``torch.compile``, whatever the name ``torch.compile`` is bound to when we compile.

MindSpeed (Ascend's Megatron adaptor) replaces ``torch.compile`` with ``dummy_compile``
(``mindspeed/core/megatron_basic/requirements_basic.py``: a wrapper that calls the function uncompiled),
through its patch manager (``mindspeed/patch_utils.py``: ``MindSpeedPatchesManager.register_patch(
'torch.compile', dummy_compile)``; ``apply_patches()`` sets ``torch.compile`` and every module attribute named
``compile`` that held the original, and records the original as ``patches_info['torch.compile'].orig_func``).
verl imports ``mindspeed.megatron_adaptor`` from its engine package wherever MindSpeed is installed, so a
``torch.compile`` looked up at call time (``nn.Module.compile`` does) compiles nothing there.

:func:`torch_compile` (and :func:`original_torch_compile`) finds torch's own function instead, first that
applies:

1. ``torch.compile`` itself, when it is torch's (the function ``torch/__init__.py`` defines: its code is
   named ``compile``, comes from torch's ``__init__.py`` and runs in the ``torch`` module's globals);
2. the function a wrapper of it wraps (``__wrapped__``, set by ``functools.wraps``);
3. the original a patch manager recorded: any class with a ``patches_info`` dict in an imported
   ``mindspeed`` module (``MindSpeedPatchesManager``; older MindSpeed: ``PatchesManager``) whose
   ``'torch.compile'`` entry has an ``orig_func``;
4. the function ``torch.compile`` was bound to when this module was imported, if it was torch's;
5. the definition re-run from ``torch/__init__.py``'s source (the last ``def compile`` of the module, not an
   ``@overload``), in the ``torch`` module's globals: the same function torch defined (torch 2.7.1 to 2.13).

When ``torch.compile`` is not torch's, one INFO line per replacement names what replaced it and where the
original came from. This module imports nothing of the project (the worker, the verl hook and ``check``
import it).
"""

from __future__ import annotations

import ast
import logging
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("qwen_npu_compile")

_TORCH_GLOBALS = vars(torch)
_TORCH_INIT = Path(torch.__file__)


def _same_file(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).name == b.name and Path(a).parent.name == b.parent.name


def is_torch_compile(function: object) -> bool:
    """Whether ``function`` is torch's own ``torch.compile`` (not a replacement, not a wrapper of it).

    True for the function ``torch/__init__.py`` defines (or that definition re-run by this module): a plain
    function whose code is named ``compile``, comes from torch's ``__init__.py`` and runs in the ``torch``
    module's globals.
    """
    if not isinstance(function, types.FunctionType):
        return False
    code = function.__code__
    return (code.co_name == "compile" and function.__globals__ is _TORCH_GLOBALS
            and _same_file(code.co_filename, _TORCH_INIT))


def describe(function: object) -> str:
    """``module.qualname`` of ``function`` (its type's name for other callables), for log lines and errors."""
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
    if name is None:
        return f"a {type(function).__module__}.{type(function).__qualname__} object"
    described = f"{module}.{name}" if module else str(name)
    code = getattr(function, "__code__", None)
    if hasattr(function, "__wrapped__") and code is not None:  # functools.wraps copied the wrapped one's name
        described += f" (a wrapper defined at {code.co_filename}:{code.co_firstlineno})"
    return described


#: torch.compile as bound when this module was imported, if torch's own (not named ``compile``: MindSpeed's
#: apply_patch replaces every module attribute *named* ``compile`` that holds the original).
_AT_IMPORT: Callable | None = torch.compile if is_torch_compile(torch.compile) else None
_REDEFINED: Callable | None = None
_ANNOUNCED: set[int] = set()


def replaced_by() -> str | None:
    """What ``torch.compile`` is bound to when it is not torch's own (``module.qualname``), else None."""
    current = getattr(torch, "compile", None)
    return None if is_torch_compile(current) else describe(current)


def _from_wrapped(current) -> Callable | None:
    seen = 0
    function = getattr(current, "__wrapped__", None)
    while function is not None and seen < 20:
        if is_torch_compile(function):
            return function
        function, seen = getattr(function, "__wrapped__", None), seen + 1
    return None


def _from_patch_manager() -> tuple[Callable, str] | None:
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "mindspeed" or module_name.startswith("mindspeed.")):
            continue
        for attribute in list(vars(module).values()):
            patches = getattr(attribute, "patches_info", None) if isinstance(attribute, type) else None
            if not isinstance(patches, dict):
                continue
            original = getattr(patches.get("torch.compile"), "orig_func", None)
            if is_torch_compile(original):
                return original, f"{attribute.__module__}.{attribute.__qualname__}.patches_info['torch.compile'].orig_func"
    return None


def _redefine() -> Callable | None:
    """Re-run ``def compile`` from torch's ``__init__.py`` in torch's globals (None when its source is absent)."""
    global _REDEFINED
    if _REDEFINED is not None:
        return _REDEFINED
    try:
        source = _TORCH_INIT.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(_TORCH_INIT))
    except (OSError, SyntaxError, ValueError):
        return None

    def overload(node: ast.FunctionDef) -> bool:
        names = [d.id if isinstance(d, ast.Name) else getattr(d, "attr", None) for d in node.decorator_list]
        return any(name in ("_overload", "overload") for name in names)

    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "compile"
             and not overload(node)]
    if not found:
        return None
    namespace: dict[str, object] = {}
    try:
        code = compile(ast.Module(body=[found[-1]], type_ignores=[]), str(_TORCH_INIT), "exec")
        exec(code, _TORCH_GLOBALS, namespace)  # noqa: S102 - torch's own source, torch's own globals
    except Exception:  # a name its signature needs is gone: no definition to offer
        return None
    function = namespace.get("compile")
    if is_torch_compile(function):
        _REDEFINED = function
    return _REDEFINED


def _resolve() -> tuple[Callable, str | None]:
    current = getattr(torch, "compile", None)
    if is_torch_compile(current):
        return current, None
    wrapped = _from_wrapped(current)
    if wrapped is not None:
        return wrapped, "the function it wraps (__wrapped__)"
    recorded = _from_patch_manager()
    if recorded is not None:
        return recorded[0], f"the original recorded by {recorded[1]}"
    if _AT_IMPORT is not None:
        return _AT_IMPORT, "torch.compile as bound when qwen_npu_compile was imported"
    redefined = _redefine()
    if redefined is not None:
        return redefined, f"the definition in {_TORCH_INIT} re-run"
    raise RuntimeError(
        f"qwen_npu: torch.compile is {describe(current)}, not torch's own, and torch's own cannot be found (no "
        f"MindSpeed patch record, no __wrapped__, and no readable `def compile` in {_TORCH_INIT}); put it back before "
        "compiling (MindSpeed: MindSpeedPatchesManager.patches_info['torch.compile'].remove_patch(); verl: "
        "verl.utils.torch_functional.use_original_torch_compile())"
    )


def original_torch_compile() -> Callable:
    """torch's own ``torch.compile`` function, whatever ``torch.compile`` is bound to now.

    Found as the module docstring lists (``torch.compile`` itself, ``__wrapped__``, MindSpeed's patch
    record, the binding seen at import, the definition re-run from torch's source). When ``torch.compile``
    is not torch's, logs once per replacement, at INFO on the ``qwen_npu_compile`` logger, what replaced it
    (``module.qualname``, e.g. ``mindspeed.core.megatron_basic.requirements_basic.dummy_compile``) and where
    the original came from.

    Returns:
        The function ``torch/__init__.py`` defines (same signature as ``torch.compile``).

    Raises:
        RuntimeError: ``torch.compile`` is replaced and torch's own cannot be found; the message names the
            replacement and how to put the original back.
    """
    function, source = _resolve()
    if source is not None:
        current = getattr(torch, "compile", None)
        if id(current) not in _ANNOUNCED:
            _ANNOUNCED.add(id(current))
            by_mindspeed = describe(current).startswith("mindspeed") or "mindspeed" in source
            log.info("qwen_npu: torch.compile is %s, not torch's own%s; qwen_npu compiles with torch's own "
                     "torch.compile (%s)", describe(current),
                     " (MindSpeed's patch: it runs functions uncompiled)" if by_mindspeed else "", source)
    return function


def torch_compile(model=None, **kwargs):
    """``torch.compile(model, **kwargs)`` with torch's own compiler, even where ``torch.compile`` is replaced.

    Where MindSpeed is imported (``import mindspeed.megatron_adaptor``; verl imports it wherever it is
    installed) ``torch.compile(model, backend="qwen_npu")`` returns ``model`` uncompiled and never reaches
    the backend; ``qwen_npu_compile.torch_compile(model, backend="qwen_npu")`` compiles it.

    Args:
        model: a module or function, as for ``torch.compile`` (None: returns a decorator).
        **kwargs: ``torch.compile``'s keyword arguments (``backend``, ``options``, ``dynamic``, ...).

    Returns:
        What ``torch.compile`` returns (an ``OptimizedModule`` for a module, a compiled function otherwise).

    Raises:
        RuntimeError: as :func:`original_torch_compile`; anything ``torch.compile`` raises for bad arguments.
    """
    return original_torch_compile()(model, **kwargs)


def compile_disabled() -> str | None:
    """Why Dynamo will run compiled code eagerly (no graph for any backend), or None when nothing disables it.

    Checked: ``TORCHDYNAMO_DISABLE=1`` (``torch._dynamo.optimize`` returns the function itself),
    ``torch._dynamo.config.disable`` (``TORCH_COMPILE_DISABLE=1`` sets it; Dynamo then skips every frame),
    ``torch.compiler.set_stance("force_eager")``.
    """
    if os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        return "TORCHDYNAMO_DISABLE=1 is set in the environment"
    config = sys.modules.get("torch._dynamo.config")
    if config is not None and getattr(config, "disable", False):
        by_env = " (TORCH_COMPILE_DISABLE=1 sets it)" if os.environ.get("TORCH_COMPILE_DISABLE") == "1" else ""
        return f"torch._dynamo.config.disable is True{by_env}"
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    stance = getattr(getattr(eval_frame, "_stance", None), "stance", "default")
    if stance == "force_eager":
        return "torch.compiler.set_stance('force_eager') is in effect"
    return None


def is_dynamo_compiled(function: object) -> bool:
    """Whether ``function`` is a callable Dynamo returned for compilation (``torch.compile``'s result)."""
    return getattr(function, "_torchdynamo_orig_callable", None) is not None or \
        type(function).__name__ == "OptimizedModule"
