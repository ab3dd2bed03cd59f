"""Check the simulated npu ops against the torch_npu wheel: op schemas and meta (shape/dtype) kernels.

- Schemas: ``torch.ops.npu.<op>.default._schema`` against the op's ``func:`` line in the wheel's
  ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (both parsed with
  ``torch._C.parse_schema`` and compared as printed, so default spellings such as ``1e-06`` and
  ``9.9999999999999995e-07`` compare equal).
- Meta kernels: the wheel's ``torch_npu/op_plugin/meta/_meta_registrations.py`` imports torch_npu
  (which needs CANN), so it is not imported. Its top-level statements are run one by one in a private
  namespace, with its ``torch_npu`` imports bound to a stand-in and ``@impl(m, "<op>")`` collecting the
  functions instead of registering them with the dispatcher; statements that still need torch_npu are
  skipped. The collected functions then run on meta tensors and their outputs (shape, dtype) are
  compared with the stand-ins' fake kernels on the same inputs.
"""

from __future__ import annotations

import ast
import dataclasses
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def wheel_schemas(schemas_yaml: Path, ops: Sequence[str]) -> dict[str, str]:
    """``{op: schema text}`` for each of ``ops`` found in the wheel's ``npu_native_functions_by_codegen.yaml``."""
    import yaml

    wanted = set(ops)
    found: dict[str, str] = {}

    def visit(node) -> None:
        if isinstance(node, dict):
            func = node.get("func")
            if isinstance(func, str):
                name = func.split("(", 1)[0].strip()
                if name in wanted:
                    found[name] = func.strip()
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(yaml.safe_load(schemas_yaml.read_text()))
    return found


def schema_mismatches(schemas_yaml: Path, ops: Sequence[str]) -> dict[str, str]:
    """``{op: what differs}`` between ``torch.ops.npu.<op>.default`` and the wheel's schema; empty when all agree.

    An op missing from the wheel or from ``torch.ops.npu`` is a mismatch too.
    """
    wheel = wheel_schemas(schemas_yaml, ops)
    problems: dict[str, str] = {}
    for op in ops:
        if op not in wheel:
            problems[op] = f"not in {schemas_yaml.name}"
            continue
        if not hasattr(torch.ops.npu, op):
            problems[op] = "not registered in torch.ops.npu"
            continue
        ours = str(getattr(torch.ops.npu, op).default._schema)
        theirs = str(torch._C.parse_schema(f"npu::{wheel[op]}"))
        if ours != theirs:
            problems[op] = f"ours:  {ours}\nwheel: {theirs}"
    return problems


class _TorchNpuStandIn(types.ModuleType):
    """``torch_npu`` as the meta file sees it: dtype-like attributes are opaque markers."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Opaque(f"torch_npu.{name}")


class _Opaque:
    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Opaque(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._path}() needs torch_npu")

    def __repr__(self) -> str:
        return f"<{self._path}>"


@dataclasses.dataclass
class MetaKernels:
    """Meta functions collected from the wheel's ``_meta_registrations.py``.

    Attributes:
        functions: ``{op name: meta function}`` for every ``@impl(m, "<op>")`` whose definition ran.
        skipped: top-level statements that could not run off-NPU (line number and error).
    """

    functions: dict[str, Callable]
    skipped: list[str]


def load_meta_kernels(meta_registrations: Path) -> MetaKernels:
    """Collect the wheel's npu meta functions without importing torch_npu (see the module docstring)."""
    source = meta_registrations.read_text()
    tree = ast.parse(source, filename=str(meta_registrations))
    functions: dict[str, Callable] = {}

    def impl(_library, name, *args, **kwargs):
        def collect(fn):
            functions[name] = fn
            return fn

        return collect

    namespace: dict[str, object] = {
        "__name__": "torch_npu_meta_registrations_offline",
        "__builtins__": __builtins__,
        "torch_npu": _TorchNpuStandIn("torch_npu"),
        "Library": lambda *args, **kwargs: None,
        "impl": impl,
        "has_side_effect": lambda *args, **kwargs: None,
        "get_cann_version": lambda: "",
        "get_soc_version": lambda: 0,
        "ErrCode": _Opaque("ErrCode"),
        "ops_error": lambda *args, **kwargs: "",
    }
    provided = {"torch_npu", "Library", "impl", "has_side_effect", "get_cann_version", "get_soc_version",
                "ErrCode", "ops_error"}
    skipped: list[str] = []
    for statement in tree.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            names = {alias.asname or alias.name.split(".")[0] for alias in statement.names}
            module = getattr(statement, "module", None) or ""
            if names <= provided or module.startswith("torch_npu"):
                continue
        code = compile(ast.Module(body=[statement], type_ignores=[]), str(meta_registrations), "exec")
        try:
            exec(code, namespace)  # noqa: S102 - the wheel's own (verified) source, in a private namespace
        except Exception as exc:  # a statement that needs torch_npu or CANN
            skipped.append(f"line {statement.lineno}: {type(exc).__name__}: {exc}")
    return MetaKernels(functions, skipped)


def describe(value) -> object:
    """Shape/dtype summary of a kernel output, for comparison: a tensor → ``"torch.bfloat16[2, 16, 64]"``,
    a tuple → a tuple of summaries, anything else (ints, None) as it is."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{[int(size) for size in value.shape]}"
    if isinstance(value, (tuple, list)):
        return tuple(describe(item) for item in value)
    return value


def output_differences(op: str, meta_fn: Callable, args: Sequence[object], kwargs: dict) -> dict[int, tuple]:
    """Outputs where ``torch.ops.npu.<op>`` (under fake tensors) and the wheel's ``meta_fn`` (on meta
    tensors) disagree, on the same inputs.

    Returns:
        ``{output index: (ours, wheel's)}`` as :func:`describe` summaries; a single-output op has index 0.
        A different number of outputs is reported at index -1.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    def to_meta(value):
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    theirs = describe(meta_fn(*[to_meta(a) for a in args], **{k: to_meta(v) for k, v in kwargs.items()}))
    with FakeTensorMode() as mode:
        def to_fake(value):
            return mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

        ours = describe(getattr(torch.ops.npu, op).default(*map(to_fake, args), **{k: to_fake(v) for k, v in kwargs.items()}))
    ours, theirs = (ours if isinstance(ours, tuple) else (ours,)), (theirs if isinstance(theirs, tuple) else (theirs,))
    if len(ours) != len(theirs):
        return {-1: (ours, theirs)}
    return {index: (mine, wheel) for index, (mine, wheel) in enumerate(zip(ours, theirs)) if mine != wheel}
