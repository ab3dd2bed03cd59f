"""Stand-in for ``npu_swiglu`` / ``npu_swiglu_backward`` (torch_npu 2.13.0).

Semantics (torch_npu 2.13.0 ``_op_plugin_docs.py``): split ``self`` along ``dim`` into halves A (first)
and B (second); ``out = silu(A) * B``, computed in fp32 and rounded once. The size along ``dim`` must be
even and **non-contiguous input is not supported** (the stand-in raises, so that a rewrite that feeds
one is caught on a CPU too).
"""

from __future__ import annotations

import torch

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.ops.define import define_op

#: Ops of this module that ``recompute="cheap"`` may recompute in the backward instead of saving
#: (:mod:`qwen_npu_compile.handoff.recompute`): one elementwise pass over the gate/up buffer.
RECOMPUTE_CHEAP: tuple[str, ...] = ("npu::npu_swiglu",)
SWIGLU_SCHEMA = "npu_swiglu(Tensor self, int dim=-1) -> Tensor"
SWIGLU_BACKWARD_SCHEMA = "npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor"


#: Input dtypes the kernel takes (torch_npu 2.13.0 docs; GE SwiGlu's "T").
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def swiglu_violation(x, dim: int = -1, *, downstream: str | None = None) -> str | None:
    """Why ``npu_swiglu(x, dim)`` (and its backward) would fail, or None: the one home of this op's limits,
    used by the stand-in's validation, ``patterns/swiglu.py`` and the GE conversion check.

    Kernel limits (torch_npu 2.13.0 ``_op_plugin_docs.py`` ``npu_swiglu``): fp16/bf16/fp32; an even size
    along ``dim``; contiguous input. torchair's converters (``ge_converter/custom/npu_swiglu.py`` ->
    SwiGlu, ``npu_swiglu_backward.py`` -> SwiGluGrad, torch_npu 2.13.0 and 2.9.0) pass their arguments
    through unchecked, so ``downstream`` adds nothing.

    Args:
        x: the op's input (tensor or FakeTensor; sizes may be symbolic).
        dim: the split dimension.
        downstream: the backend the graph is handed to (no extra limits today).

    Returns:
        None when supported, else a one-line reason.
    """
    del downstream  # the GE converters add no limits (see above)
    if x.dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {x.dtype}; npu_swiglu takes fp16, bf16, fp32"
    if not guard_or_false(x.shape[dim] % 2 == 0):
        return f"size {x.shape[dim]} along dim {dim} must be even"
    if not x.is_contiguous():
        return "non-contiguous input is not supported (torch_npu 2.13.0 docs)"
    return None


def _check(x: torch.Tensor, dim: int) -> None:
    reason = swiglu_violation(x, dim)
    if reason is not None:
        raise RuntimeError(f"npu_swiglu: {reason}")


def reference_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """CPU reference of ``npu_swiglu``.

    Args:
        x: any shape, even size along ``dim``, contiguous; fp16/bf16/fp32.
        dim: the split dimension.

    Returns:
        ``silu(A) * B`` with A, B = ``x.chunk(2, dim)``, in x's dtype, half the size along ``dim``.

    Raises:
        RuntimeError: odd size along ``dim`` or non-contiguous ``x``.
    """
    _check(x, dim)
    a, b = x.float().chunk(2, dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def reference_swiglu_backward(grad_output: torch.Tensor, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """CPU reference of ``npu_swiglu_backward``: the gradient w.r.t. ``x`` (x's shape and dtype)."""
    a, b = x.float().chunk(2, dim)
    g = grad_output.float()
    sig = torch.sigmoid(a)
    da = g * b * sig * (1 + a * (1 - sig))
    db = g * a * sig
    return torch.cat([da, db], dim).to(x.dtype)


def _fake_swiglu(x, dim=-1):
    _check(x, dim)
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)


def _fake_swiglu_backward(grad_output, x, dim=-1):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, dim = inputs
    ctx.save_for_backward(x)
    ctx.dim = dim


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.npu.npu_swiglu_backward.default(grad, x, ctx.dim), None


def register(lib: torch.library.Library) -> None:
    """Define both ops in ``lib`` (the ``npu`` namespace) with kernels, fakes and autograd."""
    define_op(lib, SWIGLU_SCHEMA, reference_swiglu, _fake_swiglu, _backward, _setup_context)
    define_op(lib, SWIGLU_BACKWARD_SCHEMA, reference_swiglu_backward, _fake_swiglu_backward)
