"""Stand-in for ``npu_rotary_mul`` / ``npu_rotary_mul_backward`` (torch_npu 2.13.0).

Semantics (torch_npu 2.13.0 ``_op_plugin_docs.py``; ``docs/npu-op-contracts.md``), mode
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

Every limit of the op (the kernel's and torchair's GE converters') lives in :func:`rotary_mul_violation`.
The layout-dependent kernel limits (B, N < 1000; B·N ≤ 1024 when r1/r2 need grad; B·N ≤ 8·S for BNSD
with a 32-byte aligned D) cannot be checked by the stand-in, since the layout is ambiguous (S = 1,
N = 1); a rewrite that knows its layout passes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.ops.define import define_op

#: Ops of this module that ``recompute="cheap"`` may recompute in the backward instead of saving
#: (:mod:`qwen_npu_compile.handoff.recompute`): one elementwise pass over q or k with cos/sin broadcast.
RECOMPUTE_CHEAP: tuple[str, ...] = ("npu::npu_rotary_mul",)
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
#: The r1/r2 shapes the kernel accepts for each x layout (``1`` = a broadcast dim).
ACCEPTED_R_SHAPES = {"BSND": ("1S1D", "BS1D", "BSND"), "BNSD": ("11SD", "B1SD", "BNSD"), "SBND": ("S11D", "SB1D", "SBND")}
#: torchair's GE converter of ``npu_rotary_mul_backward`` (A2/A3, RotaryMulGrad) needs D % this == 0.
GE_BACKWARD_HEAD_DIM_MULTIPLE = 64
#: ... and the product of x's dims that r1/r2 broadcast along to be at most this.
GE_BACKWARD_MAX_BROADCAST = 1024
#: Where the converter limits come from (named in every refusal they cause).
GE_BACKWARD_CONVERTER = (
    "torchair GE converter of npu_rotary_mul_backward (torch_npu 2.13.0/2.9.0 "
    "ge_converter/custom/npu_rotary_mul_backward.py, RotaryMulGrad on A2/A3)"
)


def _hint(size):
    """A size for messages: the int itself, or a symbolic size's value in this graph (no guard)."""
    if is_concrete_int(size):
        return int(size)
    return size.node.hint if size.node.has_hint() else size


def _holds(condition) -> bool:
    """A size condition, for symbolic sizes too: decided on this graph's sizes *with a guard*, so that
    Dynamo recompiles (and the check is asked again) when a later size breaks it; never specialises."""
    return guard_or_false(condition)


def rotary_mul_violation(
    x,
    r1,
    r2,
    *,
    layout: str | None = None,
    r_requires_grad: bool | None = None,
    backward: bool = False,
    downstream: str | None = None,
) -> str | None:
    """Why ``npu_rotary_mul(x, r1, r2, 'half')`` (and its backward) would fail, or None: the one home of
    this op's limits, used by the stand-in's validation, ``patterns/rotary.py`` and the GE conversion check.

    Kernel limits (torch_npu 2.13.0 ``_op_plugin_docs.py`` ``npu_rotary_mul``; ``docs/npu-op-contracts.md``):
    x 3-D or 4-D in fp16/bf16/fp32; r1/r2 in x's dtype, of one shape, x's rank, each dim x's or 1, last
    dim D; D even and < :data:`MAX_HEAD_DIM`. With a known ``layout`` (the stand-in cannot tell: S = 1 or
    N = 1 makes it ambiguous) also: r1/r2 of a shape in :data:`ACCEPTED_R_SHAPES`; B, N <
    :data:`MAX_BATCH_OR_HEADS`; B·N ≤ :data:`MAX_BN_WITH_R_GRAD` when r1/r2 need grad; for BNSD with
    ``D * element_size`` a multiple of :data:`BNSD_ALIGN_BYTES` (D=128 in bf16), B·N ≤ 8·S (error
    561002, ms-swift #9329).

    Converter limits, with ``backward=True`` and ``downstream="torchair"`` (:data:`GE_BACKWARD_CONVERTER`):
    x, r1, r2 4-D, every size static, D % :data:`GE_BACKWARD_HEAD_DIM_MULTIPLE` == 0 and the dims r1/r2
    broadcast along multiplying to ≤ :data:`GE_BACKWARD_MAX_BROADCAST`; otherwise the converter raises.
    The forward converter (``custom/npu_rotary_mul.py``, RotaryMul) has no limits of its own. Ascend 950
    (arch35) converts the backward to RotaryPositionEmbeddingGrad without them, but the chip is not known
    at compile time, so they always apply.

    Args:
        x: the kernel's x (a tensor, FakeTensor or meta tensor; sizes may be symbolic).
        r1: cos as the kernel receives it.
        r2: sin, like r1.
        layout: x's layout (one of :data:`LAYOUTS`) when known, else None.
        r_requires_grad: whether r1/r2 need grad; None reads ``r1/r2.requires_grad``.
        backward: whether ``npu_rotary_mul_backward`` will run too (x or r1/r2 need grad).
        downstream: the backend the graph is handed to; ``"torchair"`` adds the GE converter's limits.

    Returns:
        None when supported, else a one-line reason. Size limits on symbolic sizes are decided for this
        graph's sizes with a guard (:func:`_holds`); the converter's "static shapes" is decided without
        one (``is_concrete_int``).

    Raises:
        ValueError: an unknown layout.
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if x.dim() not in (3, 4):
        return f"x must be 3-D or 4-D, got shape {tuple(x.shape)}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {x.dtype}; npu_rotary_mul takes fp16, bf16, fp32"
    if r1.dtype != x.dtype or r2.dtype != x.dtype:
        return (
            f"dtype mismatch: x {x.dtype}, cos {r1.dtype}, sin {r2.dtype}; npu_rotary_mul needs r1/r2 (cos/sin) "
            "in x's dtype (HF promotes the mixed product, the kernel returns x's dtype)"
        )
    if r1.dim() != x.dim() or r2.dim() != x.dim():
        return f"r1/r2 must have x's rank {x.dim()}, got shapes {tuple(r1.shape)}, {tuple(r2.shape)}"
    if not all(_holds(a == b) for a, b in zip(r1.shape, r2.shape)):
        return f"r1 shape {tuple(r1.shape)} != r2 shape {tuple(r2.shape)}"
    d = x.shape[-1]
    if not _holds(r1.shape[-1] == d):
        return f"last dim of r1/r2 {r1.shape[-1]} != x's {d}"
    for i, (rs, xs) in enumerate(zip(r1.shape, x.shape)):
        if not (_holds(rs == xs) or _holds(rs == 1)):
            return f"r1/r2 shape {tuple(r1.shape)} does not broadcast to x {tuple(x.shape)} (dim {i})"
    if not (_holds(d % 2 == 0) and _holds(d < MAX_HEAD_DIM)):
        return f"head dim D={_hint(d)} must be even and < {MAX_HEAD_DIM}"
    if r_requires_grad is None:
        r_requires_grad = bool(r1.requires_grad or r2.requires_grad)
    if layout is not None:
        reason = _layout_violation(x, r1, r2, layout, r_requires_grad)
        if reason is not None:
            return reason
    if backward and downstream == "torchair":
        return _ge_backward_violation(x, r1, r2)
    return None


def _r_shape_ok(x, r, layout: str) -> bool:
    """Whether r's shape is one the kernel accepts for x in ``layout`` (:data:`ACCEPTED_R_SHAPES`)."""
    return any(
        all(_holds(r.shape[dim] == (1 if label == "1" else x.shape[dim])) for dim, label in enumerate(accepted))
        for accepted in ACCEPTED_R_SHAPES[layout]
    )


def _layout_violation(x, r1, r2, layout: str, r_requires_grad: bool) -> str | None:
    if x.dim() != 4:
        return f"x, cos and sin must be 4-D for a {layout} rewrite, got x {tuple(x.shape)}"
    if not (_r_shape_ok(x, r1, layout) and _r_shape_ok(x, r2, layout)):
        return (
            f"cos {tuple(r1.shape)} / sin {tuple(r2.shape)} is not a shape npu_rotary_mul accepts for {layout} "
            f"x {tuple(x.shape)} ({'/'.join(ACCEPTED_R_SHAPES[layout])})"
        )
    dims = dict(zip(layout, x.shape))
    if not is_concrete_int(dims["D"]):
        return f"symbolic head dim D={dims['D']}; the layout limits need a static D"
    b, n, s, d = dims["B"], dims["N"], dims["S"], int(dims["D"])
    shown = {key: _hint(value) for key, value in dims.items()}
    if not (_holds(b < MAX_BATCH_OR_HEADS) and _holds(n < MAX_BATCH_OR_HEADS)):
        return f"B={shown['B']} and N={shown['N']} must both be < {MAX_BATCH_OR_HEADS}"
    if r_requires_grad and not _holds(b * n <= MAX_BN_WITH_R_GRAD):
        return f"B*N={shown['B'] * shown['N']} > {MAX_BN_WITH_R_GRAD} while r1/r2 need grad"
    aligned = (d * x.dtype.itemsize) % BNSD_ALIGN_BYTES == 0
    if layout == "BNSD" and aligned and not _holds(b * n <= 8 * s):
        return (
            f"BNSD with aligned D={d} needs B*N <= 8*S, got B*N={shown['B'] * shown['N']}, "
            f"S={shown['S']} (error 561002; use BSND)"
        )
    return None


def _ge_backward_violation(x, r1, r2) -> str | None:
    if x.dim() != 4:
        return f"{GE_BACKWARD_CONVERTER} needs 4-D x, cos and sin, got x {tuple(x.shape)}"
    if not all(is_concrete_int(size) for t in (x, r1, r2) for size in t.shape):
        return (
            f"{GE_BACKWARD_CONVERTER} needs static shapes, got x {tuple(x.shape)}, cos {tuple(r1.shape)} "
            "(dynamic sizes, e.g. a varying sequence length under dynamic=True)"
        )
    d = int(x.shape[-1])
    if d % GE_BACKWARD_HEAD_DIM_MULTIPLE != 0:
        return f"{GE_BACKWARD_CONVERTER} needs head dim D % {GE_BACKWARD_HEAD_DIM_MULTIPLE} == 0, got D={d}"
    broadcast = 1
    for xs, rs in zip(x.shape, r1.shape):
        if int(xs) != int(rs):
            broadcast *= int(xs)
    if broadcast > GE_BACKWARD_MAX_BROADCAST:
        return (
            f"{GE_BACKWARD_CONVERTER} needs the dims cos/sin broadcast along to multiply to "
            f"<= {GE_BACKWARD_MAX_BROADCAST}, got {broadcast}"
        )
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
    reason = rotary_mul_violation(x, r1, r2, r_requires_grad=False)
    if reason is not None:
        raise RuntimeError(f"npu_rotary_mul: {reason}")


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
    define_op(lib, ROTARY_MUL_SCHEMA, reference_rotary_mul, _fake_rotary_mul, _backward, _setup_context)
    define_op(lib, ROTARY_MUL_BACKWARD_SCHEMA, reference_rotary_mul_backward, _fake_rotary_mul_backward)
