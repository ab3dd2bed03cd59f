"""``qwen_npu::rotary_mul_orthogonal``: ``npu_rotary_mul`` whose backward is ``npu_rotary_mul`` again.

The forward is exactly ``npu_rotary_mul(x, r1, r2, 'half')`` (``out = x·r1 + rotate_half(x)·r2``). When
r1/r2 (cos/sin) need no gradient and **r2's two halves are equal** (HF builds ``sin`` from
``cat(freqs, freqs)``), the input gradient is the same op with ``-r2``::

    dx = g·r1 + rotate_halfᵀ(g·r2),   rotate_halfᵀ(y) = cat(y2, -y1)
    with r2 = cat(s, s):  rotate_halfᵀ(g·r2) = cat(g2·s, -g1·s) = rotate_half(g)·(-r2)
    so  dx = npu_rotary_mul(g, r1, -r2)

(r1's halves need not be equal: ``g·r1`` is elementwise.) This op avoids ``npu_rotary_mul_backward``,
whose torchair GE converter raises unless shapes are static, D % 64 == 0 and the broadcast dims multiply
to ≤ 1024 (see :func:`qwen_npu_compile.ops.torch_npu.rotary_mul.rotary_mul_violation`); the forward converter
(RotaryMul) has no such limits, so training graphs convert under dynamic sequence lengths and for any
head dim the kernel takes. ``patterns/rotary.py`` emits it only where both conditions are proven from
the graph; its torchair converter is :mod:`qwen_npu_compile.torchair.converters`.

Registered with ``torch.library.custom_op`` in this project's own ``qwen_npu`` namespace, on every
host: its kernel (any device) and its fake kernel call ``torch.ops.npu.npu_rotary_mul`` (real torch_npu,
or the stand-in), so every limit is that op's.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops import ge

#: The op's qualified name.
#: Ops of this module that ``recompute="cheap"`` may recompute in the backward instead of saving
#: (:mod:`qwen_npu_compile.handoff.recompute`): npu_rotary_mul with an orthogonality-based backward: the same elementwise forward.
RECOMPUTE_CHEAP: tuple[str, ...] = ("qwen_npu::rotary_mul_orthogonal",)
NAME = "qwen_npu::rotary_mul_orthogonal"


@torch.library.custom_op(NAME, mutates_args=())
def rotary_mul_orthogonal(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """``npu_rotary_mul(x, r1, r2, 'half')`` with the orthogonal backward (module docstring).

    Args:
        x: ``[B, S, N, D]`` or ``[B, N, S, D]`` (any layout ``npu_rotary_mul`` takes); fp16/bf16/fp32.
        r1: cos, x's dtype and rank, broadcast to x.
        r2: sin, r1's shape; its two halves along the last dim must be equal, and r1/r2 must need no
            grad (the caller proves both; not checked here, it would cost a device sync).

    Returns:
        x's shape and dtype.

    Raises:
        RuntimeError: whatever ``npu_rotary_mul`` raises; in backward, r1/r2 needing grad.
    """
    return npu_rotary_mul_half(x, r1, r2)


def npu_rotary_mul_half(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """The forward and fake kernel of this op and of ``qwen_npu::rotary_mul_aten_backward``:
    ``npu_rotary_mul(x, r1, r2, 'half')`` (real torch_npu or the stand-in; on fake tensors its meta kernel)."""
    return torch.ops.npu.npu_rotary_mul.default(x, r1, r2, "half")


rotary_mul_orthogonal.register_fake(npu_rotary_mul_half)


def save_cos_sin(ctx, inputs, output) -> None:
    """``setup_context`` of both rotary ops: saves r1/r2 (cos/sin) for the backward."""
    _, r1, r2 = inputs
    ctx.save_for_backward(r1, r2)


def _backward(ctx, grad):
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError(
            f"{NAME}: r1/r2 (cos/sin) need grad, which this op does not produce; use npu_rotary_mul"
        )
    r1, r2 = ctx.saved_tensors
    return rotary_mul_orthogonal(grad, r1, torch.neg(r2)), None, None


rotary_mul_orthogonal.register_autograd(_backward, setup_context=save_cos_sin)

#: The op overload graphs hold.
OP = torch.ops.qwen_npu.rotary_mul_orthogonal.default

#: GE converters of this module's op, by ``"namespace.op"`` (registered by
#: :func:`qwen_npu_compile.torchair.converters.register_converters`): torchair's own ``npu_rotary_mul`` converter.
GE_CONVERTERS = {"qwen_npu.rotary_mul_orthogonal": lambda: ge.register_rotary_form(OP)}
