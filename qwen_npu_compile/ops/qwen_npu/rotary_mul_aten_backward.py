"""``qwen_npu::rotary_mul_aten_backward``: ``npu_rotary_mul`` whose backward is plain ATen.

The forward is exactly ``npu_rotary_mul(x, r1, r2, 'half')`` (``out = x·r1 + rotate_half(x)·r2``,
``rotate_half(x) = cat(-x2, x1)`` over the halves of the last dim). The input gradient is written in ATen
ops (two broadcast ``mul``, two ``slice``, a ``neg``, a ``cat`` and an ``add``)::

    dx = g·r1 + rotate_halfᵀ(g·r2),   rotate_halfᵀ(y) = cat(y2, -y1)

which is the transpose of HF's ``rotate_half`` (``transformers`` ``apply_rotary_pos_emb``), exact for any
r1/r2, with no assumption on sin's halves (compare
:mod:`~qwen_npu_compile.ops.qwen_npu.rotary_mul_orthogonal`, which needs ``sin = cat(f, f)``).

Why: torchair's GE converter of ``npu_rotary_mul_backward`` raises unless every size is static,
D % 64 == 0 and the broadcast dims multiply to ≤ 1024
(:func:`~qwen_npu_compile.ops.torch_npu.rotary_mul.rotary_mul_violation`), while the forward converter
(RotaryMul) has no such limits and torchair converts every ATen op of this backward. A per-layer graph
(``maybe_compile``, verl's path) receives cos/sin as graph inputs, so their equal halves cannot be proven
there, and verl's micro-batches have a dynamic token count: ``patterns/rotary.py`` emits this op for
torchair training graphs in exactly that case, so that the forward still runs the fused kernel. The
backward costs what HF's unfused backward costs (a few elementwise kernels), no more.

Registered with ``torch.library.custom_op`` in this project's own ``qwen_npu`` namespace, on every
host: its kernel (any device) and its fake kernel call ``torch.ops.npu.npu_rotary_mul`` (real torch_npu,
or the stand-in), so every forward limit is that op's; its torchair converter is
:mod:`qwen_npu_compile.torchair.converters`.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops import ge
from qwen_npu_compile.ops.qwen_npu import rotary_mul_orthogonal

#: The op's qualified name.
NAME = "qwen_npu::rotary_mul_aten_backward"
#: Ops of this module that ``recompute="cheap"`` may recompute in the backward instead of saving
#: (:mod:`qwen_npu_compile.handoff.recompute`): npu_rotary_mul's elementwise forward.
RECOMPUTE_CHEAP: tuple[str, ...] = (NAME,)


@torch.library.custom_op(NAME, mutates_args=())
def rotary_mul_aten_backward(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """``npu_rotary_mul(x, r1, r2, 'half')`` with the ATen input gradient (module docstring). Shapes, dtypes and
    errors: :func:`~qwen_npu_compile.ops.qwen_npu.rotary_mul_orthogonal.rotary_mul_orthogonal`'s, without its condition
    on sin's halves."""
    return rotary_mul_orthogonal.npu_rotary_mul_half(x, r1, r2)


rotary_mul_aten_backward.register_fake(rotary_mul_orthogonal.npu_rotary_mul_half)


def rotate_half_transposed(y: torch.Tensor) -> torch.Tensor:
    """``rotate_halfᵀ(y) = cat(y2, -y1)`` over the halves of the last dim (the adjoint of HF's
    ``rotate_half(x) = cat(-x2, x1)``); any shape with an even last dim, any dtype."""
    half = y.shape[-1] // 2
    return torch.cat((y[..., half:], -y[..., :half]), dim=-1)


def _backward(ctx, grad):
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError(f"{NAME}: r1/r2 (cos/sin) need grad, which this op does not produce; use npu_rotary_mul")
    r1, r2 = ctx.saved_tensors
    return grad * r1 + rotate_half_transposed(grad * r2), None, None


rotary_mul_aten_backward.register_autograd(_backward, setup_context=rotary_mul_orthogonal.save_cos_sin)

#: The op overload graphs hold.
OP = torch.ops.qwen_npu.rotary_mul_aten_backward.default

#: GE converters of this module's op, by ``"namespace.op"`` (registered by
#: :func:`qwen_npu_compile.torchair.converters.register_converters`): torchair's own ``npu_rotary_mul`` converter.
GE_CONVERTERS = {"qwen_npu.rotary_mul_aten_backward": lambda: ge.register_rotary_form(OP)}
