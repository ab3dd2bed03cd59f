"""Stand-in for ``npu_rotary_mul`` / ``npu_rotary_mul_backward`` (torch_npu 2.13.0).

Semantics (torch_npu 2.13.0 ``_op_plugin_docs.py``; ``shared/reference/npu-op-contracts.md``), mode
``'half'``: ``x1, x2 = chunk(x, 2, -1)``; ``out = x * r1 + cat(-x2, x1) * r2``, which is exactly HF
``q * cos + rotate_half(q) * sin``. Computed in fp32 and rounded once to x's dtype (HF rounds after each
multiply, so expect about 1-ulp differences in bf16/fp16). x is 3-D or 4-D, fp16/bf16/fp32; r1 and r2
have x's dtype and one shape, broadcast to x along every dim but the last (x BNSD takes r
11SD/B1SD/BNSD; BSND takes 1S1D/BS1D/BSND; SBND takes S11D/SB1D/SBND). D is even and below
:data:`MAX_HEAD_DIM`. Only ``rotary_mode='half'`` and ``rotate=None`` are simulated; anything else raises.

Backward: ``dx = grad * r1 + rotate_half^T(grad * r2)`` with ``rotate_half^T(y) = cat(y2, -y1)``;
``dr1 = grad * x`` and ``dr2 = grad * rotate_half(x)``, summed over the dims r1/r2 broadcast along.
dx in x's dtype, dr1/dr2 in r's dtype (which the check makes equal to x's, as torch_npu's Meta kernel
assumes).

The layout-dependent kernel limits (B, N < 1000; B·N ≤ 1024 when r1/r2 need grad; B·N ≤ 8·S for BNSD
with a 32-byte aligned D) cannot be checked from shapes alone, since the layout is ambiguous (S = 1,
N = 1); a rewrite that knows its layout calls :func:`rotary_mul_limit_violation` before emitting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ROTARY_MUL_SCHEMA = (
    "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor"
)
ROTARY_MUL_BACKWARD_SCHEMA = (
    "npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') "
    "-> (Tensor, Tensor, Tensor)"
)

#: x dtypes the kernel supports (r1/r2 must have the same dtype).
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
#: The only rotary mode simulated here (the one HF ``rotate_half`` computes).
SUPPORTED_MODES = ("half",)
#: D (the last dim) must be even and strictly below this (A2/A3).
MAX_HEAD_DIM = 896
#: B and N must each be strictly below this (A2/A3).
MAX_BATCH_OR_HEADS = 1000
#: B·N may not exceed this when r1/r2 need grad (A2/A3).
MAX_BN_WITH_R_GRAD = 1024
#: For BNSD with D·element_size a multiple of this many bytes, the kernel needs B·N ≤ 8·S (error 561002).
BNSD_ALIGN_BYTES = 32
#: The x layouts the kernel tells apart (by r1/r2's broadcast pattern).
LAYOUTS = ("BNSD", "BSND", "SBND")


def rotary_mul_limit_violation(
    x_shape: Sequence[int],
    dtype: torch.dtype,
    layout: str,
    r_requires_grad: bool = False,
) -> str | None:
    """Says why ``npu_rotary_mul`` on A2/A3 would refuse x of this shape in this layout, if it would.

    The documented limits (torch_npu 2.13.0; ``npu-op-contracts.md``): fp16/bf16/fp32; D even and
    < :data:`MAX_HEAD_DIM`; B, N < :data:`MAX_BATCH_OR_HEADS`; B·N ≤ :data:`MAX_BN_WITH_R_GRAD` when
    r1/r2 need grad; for BNSD with ``D * element_size`` a multiple of :data:`BNSD_ALIGN_BYTES` (D=128 in
    bf16), B·N ≤ 8·S (ms-swift #9329: HF's head-first layout fails at decode).

    Args:
        x_shape: the 4-D shape of x (a 3-D shape is read as the 4-D one without its leading B = 1).
        dtype: x's dtype.
        layout: one of :data:`LAYOUTS`.
        r_requires_grad: whether r1/r2 (cos/sin) need grad.

    Returns:
        None when supported, else a one-line reason.

    Raises:
        ValueError: an unknown layout or a shape that is neither 3-D nor 4-D.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    shape = [int(s) for s in x_shape]
    if len(shape) == 3:
        # 3-D x: the layout's leading dim is absent; treat it as 1.
        shape = [1, *shape] if layout != "SBND" else [shape[0], 1, *shape[1:]]
    if len(shape) != 4:
        raise ValueError(f"x must be 3-D or 4-D, got shape {tuple(x_shape)}")
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} not in fp16/bf16/fp32"
    dims = dict(zip(layout, shape))
    b, n, s, d = dims["B"], dims["N"], dims["S"], dims["D"]
    if d % 2 != 0 or d >= MAX_HEAD_DIM:
        return f"head dim D={d} must be even and < {MAX_HEAD_DIM}"
    if b >= MAX_BATCH_OR_HEADS or n >= MAX_BATCH_OR_HEADS:
        return f"B={b} and N={n} must both be < {MAX_BATCH_OR_HEADS}"
    if r_requires_grad and b * n > MAX_BN_WITH_R_GRAD:
        return f"B*N={b * n} > {MAX_BN_WITH_R_GRAD} while r1/r2 need grad"
    if layout == "BNSD" and (d * dtype.itemsize) % BNSD_ALIGN_BYTES == 0 and b * n > 8 * s:
        return f"BNSD with aligned D={d} needs B*N <= 8*S, got B*N={b * n}, S={s} (error 561002; use BSND)"
    return None


def _check_mode(op: str, rotary_mode: str) -> None:
    if rotary_mode not in SUPPORTED_MODES:
        raise RuntimeError(
            f"{op}: rotary_mode {rotary_mode!r} is not simulated (only {SUPPORTED_MODES}); "
            "torch_npu also has 'interleave', 'quarter', 'interleave-half' on some chips"
        )


def _check(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate=None) -> None:
    _check_mode("npu_rotary_mul", rotary_mode)
    if rotate is not None:
        raise RuntimeError("npu_rotary_mul: the 'rotate' matrix argument is not simulated (pass rotate=None)")
    if x.dim() not in (3, 4):
        raise RuntimeError(f"npu_rotary_mul: x must be 3-D or 4-D, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(f"npu_rotary_mul: unsupported dtype {x.dtype} (fp16/bf16/fp32 only)")
    if r1.dtype != x.dtype or r2.dtype != x.dtype:
        raise RuntimeError(
            f"npu_rotary_mul: r1/r2 dtypes ({r1.dtype}, {r2.dtype}) must equal x's dtype {x.dtype}"
        )
    if tuple(r1.shape) != tuple(r2.shape):
        raise RuntimeError(f"npu_rotary_mul: r1 shape {tuple(r1.shape)} != r2 shape {tuple(r2.shape)}")
    if r1.dim() != x.dim():
        raise RuntimeError(f"npu_rotary_mul: r1/r2 must have x's rank {x.dim()}, got shape {tuple(r1.shape)}")
    if r1.shape[-1] != x.shape[-1]:
        raise RuntimeError(f"npu_rotary_mul: last dim of r1/r2 {r1.shape[-1]} != x's {x.shape[-1]}")
    for i, (rs, xs) in enumerate(zip(r1.shape, x.shape)):
        if rs != xs and rs != 1:
            raise RuntimeError(
                f"npu_rotary_mul: r1/r2 shape {tuple(r1.shape)} does not broadcast to x {tuple(x.shape)} "
                f"(dim {i})"
            )
    d = x.shape[-1]
    if d % 2 != 0 or d >= MAX_HEAD_DIM:
        raise RuntimeError(f"npu_rotary_mul: head dim D={d} must be even and < {MAX_HEAD_DIM}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def _rotate_half_transpose(y: torch.Tensor) -> torch.Tensor:
    # <rotate_half(x), y> = <x1, y2> + <x2, -y1>, so the adjoint is cat(y2, -y1).
    y1, y2 = y.chunk(2, -1)
    return torch.cat([y2, -y1], -1)


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` in ``ref``'s dtype and in the layout of ``torch.empty_like(ref)``, as the fake kernels say.

    (Elementwise math follows its inputs' strides: with a transposed ``grad`` the result would be
    non-contiguous while the fake, like the NPU kernel, allocates ``empty_like(x)``.)
    """
    return torch.empty_like(ref).copy_(t)


def _reduce_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    dims = [i for i, (ts, s) in enumerate(zip(t.shape, shape)) if s == 1 and ts != 1]
    return t.sum(dims, keepdim=True) if dims else t


def reference_rotary_mul(
    x: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU reference of ``npu_rotary_mul`` (mode ``'half'``).

    Args:
        x: 3-D or 4-D, e.g. ``[B, S, N, D]`` or ``[B, N, S, D]``; fp16/bf16/fp32; D even, < 896.
        r1: cos, x's rank and dtype, each dim equal to x's or 1, last dim D.
        r2: sin, r1's shape and dtype.
        rotary_mode: ``'half'`` only.
        rotate: must be None.

    Returns:
        ``x * r1 + rotate_half(x) * r2`` computed in fp32, in x's shape and dtype.

    Raises:
        RuntimeError: another mode, a ``rotate`` tensor, a bad rank/dtype/shape, or an odd or too large D.
    """
    _check(x, r1, r2, rotary_mode, rotate)
    xf = x.float()
    out = xf * r1.float() + _rotate_half(xf) * r2.float()
    return _like(out, x)


def reference_rotary_mul_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
):
    """CPU reference of ``npu_rotary_mul_backward`` (mode ``'half'``).

    Args:
        grad: the gradient of the output, x's shape.
        x: the forward input.
        r1: the forward cos.
        r2: the forward sin.
        rotary_mode: ``'half'`` only.

    Returns:
        ``(dx, dr1, dr2)``: dx in x's shape and dtype; dr1/dr2 summed over the broadcast dims to r1/r2's
        shape, in their dtype. Computed in fp32.

    Raises:
        RuntimeError: another mode, or inputs the forward would refuse.
    """
    _check_mode("npu_rotary_mul_backward", rotary_mode)
    _check(x, r1, r2, rotary_mode)
    g = grad.float()
    xf = x.float()
    dx = g * r1.float() + _rotate_half_transpose(g * r2.float())
    dr1 = _reduce_to(g * xf, r1.shape)
    dr2 = _reduce_to(g * _rotate_half(xf), r2.shape)
    return _like(dx, x), _like(dr1, r1), _like(dr2, r2)


def _fake_rotary_mul(x, r1, r2, rotary_mode="half", rotate=None):
    _check(x, r1, r2, rotary_mode, rotate)
    return torch.empty_like(x)


def _fake_rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    _check_mode("npu_rotary_mul_backward", rotary_mode)
    _check(x, r1, r2, rotary_mode)
    return torch.empty_like(x), torch.empty_like(r1), torch.empty_like(r2)


def _setup_context(ctx, inputs, output):
    x, r1, r2, rotary_mode, _ = inputs
    ctx.save_for_backward(x, r1, r2)
    ctx.rotary_mode = rotary_mode


def _backward(ctx, grad):
    x, r1, r2 = ctx.saved_tensors
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward.default(grad, x, r1, r2, ctx.rotary_mode)
    return dx, dr1, dr2, None, None


def register(lib: torch.library.Library) -> None:
    """Define both ops in ``lib`` (the ``npu`` namespace) with kernels, fakes and autograd."""
    lib.define(ROTARY_MUL_SCHEMA)
    lib.define(ROTARY_MUL_BACKWARD_SCHEMA)
    lib.impl("npu_rotary_mul", reference_rotary_mul, "CompositeExplicitAutograd")
    lib.impl("npu_rotary_mul_backward", reference_rotary_mul_backward, "CompositeExplicitAutograd")
    torch.library.register_fake("npu::npu_rotary_mul", _fake_rotary_mul, lib=lib)
    torch.library.register_fake("npu::npu_rotary_mul_backward", _fake_rotary_mul_backward, lib=lib)
    torch.library.register_autograd("npu::npu_rotary_mul", _backward, setup_context=_setup_context, lib=lib)
