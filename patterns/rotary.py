"""Rotary position embedding (RoPE) -> ``npu_rotary_mul``.

Mirrors transformers ``models/qwen2/modeling_qwen2.py`` (identical per layer in 4.57.6 and 5.24.0;
only the once-per-forward cos/sin computation upstream differs: v4 matmul under no_grad/autocast-off,
v5 broadcast mul, both ending in ``.to(x.dtype)``)::

    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed

    # Qwen2Attention.forward
    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)   # BNSD view of BSND memory

FX before (pre-dispatch ATen; q, D = 64; ``unsqueeze`` / ``unsqueeze_1`` are shared by q and k)::

    linear = aten.linear.default(x, w_q, b_q)
    view = aten.view.default(linear, [B, S, -1, 64])                # x_bsnd, contiguous
    transpose = aten.transpose.int(view, 1, 2)                      # q, BNSD, non-contiguous
    unsqueeze = aten.unsqueeze.default(cos, 1)                      # [B|1, 1, S, 64]
    unsqueeze_1 = aten.unsqueeze.default(sin, 1)
    mul = aten.mul.Tensor(transpose, unsqueeze)
    slice_1 = aten.slice.Tensor(transpose, 3, 0, 32)
    slice_2 = aten.slice.Tensor(transpose, 3, 32, 9223372036854775807)
    neg = aten.neg.default(slice_2)
    cat = aten.cat.default([neg, slice_1], -1)
    mul_1 = aten.mul.Tensor(cat, unsqueeze_1)
    add = aten.add.Tensor(mul, mul_1)

FX after (variant ``rotary_bsnd``)::

    squeeze = aten.squeeze.dim(unsqueeze, 1)
    unsqueeze_2 = aten.unsqueeze.default(squeeze, 2)                # [B|1, S, 1, 64]: 1S1D / BS1D
    squeeze_1 = aten.squeeze.dim(unsqueeze_1, 1)
    unsqueeze_3 = aten.unsqueeze.default(squeeze_1, 2)
    npu_rotary_mul = npu.npu_rotary_mul.default(view, unsqueeze_2, unsqueeze_3, 'half')
    add = aten.transpose.int(npu_rotary_mul, 1, 2)                  # BNSD view again, same strides as before

Constraints (torch_npu 2.13.0 ``npu_rotary_mul`` docs, ``shared/reference/npu-op-contracts.md``,
:mod:`qwen_npu_compile.npu_ops.rotary_mul`): mode ``'half'`` computes exactly HF's
``x*cos + rotate_half(x)*sin``; x 4-D, fp16/bf16/fp32, r1/r2 in x's dtype (the stand-in and the Meta
kernel assume it: HF's fp32-cos-with-bf16-q promotes, the kernel would not); the layout is inferred
from r1/r2's shape (x BSND takes 1S1D/BS1D/BSND, x BNSD takes 11SD/B1SD/BNSD); D even and < 896;
B, N < 1000; B·N ≤ 1024 when r1/r2 need grad (read from the nodes' ``meta["tensor_meta"]``: make_fx's
``meta["val"]`` is a detached snapshot); **BNSD with a 32-byte aligned D needs B·N ≤ 8·S**, so
HF's head-first layout fails at decode (error 561002, ms-swift #9329): hence the ``rotary_bsnd``
variant, which runs the kernel on the contiguous pre-transpose tensor. Non-contiguous inputs are refused
(CANN ops read them wrongly: vllm-ascend #2388, #11834). Under ``dynamic=True`` the size limits are
decided for the graph's sizes and guarded, so Dynamo recompiles (and this check refuses) when a later
size breaks them (``2 <= B <= 999`` for Qwen2). The anchor is ``aten.neg``, which in Qwen2 graphs
(train and infer, sdpa and eager, with or without mask or cache) appears only in ``rotate_half``.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, is_concrete_int

from qwen_npu_compile.fusion import FusionFamily, PatternVariant, meta_val
from qwen_npu_compile.npu_ops.rotary_mul import (
    BNSD_ALIGN_BYTES,
    MAX_BATCH_OR_HEADS,
    MAX_BN_WITH_R_GRAD,
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    rotary_mul_limit_violation,
)

aten = torch.ops.aten

#: x layouts a variant emits, and the r1/r2 shapes the kernel accepts for each (1 = broadcast dim).
ACCEPTED_R_SHAPES = {"BSND": ("1S1D", "BS1D", "BSND"), "BNSD": ("11SD", "B1SD", "BNSD")}


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _search_bsnd(x_bsnd, cos, sin):
    # cos/sin are HF's cos.unsqueeze(1) / sin.unsqueeze(1): pattern inputs, because those nodes are
    # shared by the q and the k subgraph (two users; the matcher requires an intermediate's users to
    # equal the pattern's). The transpose is single-use (its three users are all inside the pattern).
    x = x_bsnd.transpose(1, 2)
    return x * cos + _rotate_half(x) * sin


def _bsnd_r(r_b1sd):
    """``[B|1, 1, S, D]`` (HF's unsqueeze at dim 1) -> ``[B|1, S, 1, D]`` with contiguous strides."""
    return r_b1sd.squeeze(1).unsqueeze(2)


def _replace_bsnd(x_bsnd, cos, sin):
    out = torch.ops.npu.npu_rotary_mul.default(x_bsnd, _bsnd_r(cos), _bsnd_r(sin), "half")
    return out.transpose(1, 2)


def _search_bnsd(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


def _replace_bnsd(x, cos, sin):
    return torch.ops.npu.npu_rotary_mul.default(x, cos, sin, "half")


def _hint(size):
    """A size for messages: the int itself, or a symbolic size's value in this graph (no guard)."""
    if is_concrete_int(size):
        return int(size)
    return size.node.hint if size.node.has_hint() else size


def _limit_violation(shape, dtype: torch.dtype, layout: str, r_requires_grad: bool) -> str | None:
    """:func:`rotary_mul_limit_violation`, also for symbolic sizes (``dynamic=True``).

    Concrete shapes go to the stand-in's function as they are. For symbolic sizes, ``int()`` would
    specialise them (a recompile per size); instead each limit is decided with ``guard_or_false``: for
    this graph's sizes, with a guard so that Dynamo recompiles when a later size breaks it.
    """
    if all(is_concrete_int(size) for size in shape):
        return rotary_mul_limit_violation([int(size) for size in shape], dtype, layout, r_requires_grad)
    if len(shape) != 4:
        return f"x must be 4-D, got {len(shape)}-D"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} not in fp16/bf16/fp32"
    dims = dict(zip(layout, shape))
    b, n, s, d = dims["B"], dims["N"], dims["S"], dims["D"]
    shown = {key: _hint(value) for key, value in dims.items()}
    if not is_concrete_int(d):
        return f"symbolic head dim D={d}; the limits need a static D"
    d = int(d)
    if d % 2 != 0 or d >= MAX_HEAD_DIM:
        return f"head dim D={d} must be even and < {MAX_HEAD_DIM}"
    if not (guard_or_false(b < MAX_BATCH_OR_HEADS) and guard_or_false(n < MAX_BATCH_OR_HEADS)):
        return f"B={shown['B']} and N={shown['N']} must both be < {MAX_BATCH_OR_HEADS}"
    if r_requires_grad and not guard_or_false(b * n <= MAX_BN_WITH_R_GRAD):
        return f"B*N={shown['B'] * shown['N']} > {MAX_BN_WITH_R_GRAD} while r1/r2 need grad"
    aligned = (d * dtype.itemsize) % BNSD_ALIGN_BYTES == 0
    if layout == "BNSD" and aligned and not guard_or_false(b * n <= 8 * s):
        return (
            f"BNSD with aligned D={d} needs B*N <= 8*S, got B*N={shown['B'] * shown['N']}, "
            f"S={shown['S']} (error 561002; use BSND)"
        )
    return None


def _r_shape_ok(x, r, layout: str) -> bool:
    """Whether r's shape is one the kernel accepts for x in ``layout`` (:data:`ACCEPTED_R_SHAPES`)."""
    for accepted in ACCEPTED_R_SHAPES[layout]:
        ok = True
        for dim, r_label in enumerate(accepted):
            want = 1 if r_label == "1" else x.shape[dim]
            if not guard_or_false(r.shape[dim] == want):
                ok = False
                break
        if ok:
            return True
    return False


def check_rotary(x, r1, r2, layout: str, r_requires_grad: bool | None = None) -> str | None:
    """Refusal reason for ``npu_rotary_mul(x, r1, r2, 'half')`` (FakeTensors), or None to fuse.

    Args:
        x: the tensor the kernel receives, ``[B, S, N, D]`` for ``layout="BSND"`` or ``[B, N, S, D]``
            for ``"BNSD"``.
        r1: cos as the kernel receives it (BSND: 1S1D/BS1D/BSND; BNSD: 11SD/B1SD/BNSD).
        r2: sin, like r1.
        layout: ``"BSND"`` or ``"BNSD"``; decides which documented limits apply.
        r_requires_grad: whether cos/sin need grad; None reads ``r1/r2.requires_grad``. (Graph
            checks pass it: a make_fx node's ``meta["val"]`` is a detached snapshot, always False.)
    """
    if not all(isinstance(t, torch.Tensor) for t in (x, r1, r2)):
        return "x, cos or sin is not a tensor"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {x.dtype}; npu_rotary_mul takes fp16, bf16, fp32"
    if r1.dtype != x.dtype or r2.dtype != x.dtype:
        return (
            f"dtype mismatch: x {x.dtype}, cos {r1.dtype}, sin {r2.dtype}; npu_rotary_mul needs cos/sin in "
            "x's dtype (HF promotes the mixed product, the kernel returns x's dtype)"
        )
    if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        return f"x, cos and sin must be 4-D, got x {tuple(x.shape)}, cos {tuple(r1.shape)}, sin {tuple(r2.shape)}"
    if not all(_r_shape_ok(x, r, layout) for r in (r1, r2)):
        return (
            f"cos {tuple(r1.shape)} / sin {tuple(r2.shape)} is not a shape npu_rotary_mul accepts for {layout} "
            f"x {tuple(x.shape)} ({'/'.join(ACCEPTED_R_SHAPES[layout])})"
        )
    if guard_or_false(x.numel() == 0):
        return "empty input"
    for label, t in (("x", x), ("cos", r1), ("sin", r2)):
        if not t.is_contiguous():
            return (
                f"{label} is not contiguous (shape {tuple(t.shape)}, stride {tuple(t.stride())}); npu_rotary_mul "
                "reads its inputs as dense"
            )
    if r_requires_grad is None:
        r_requires_grad = r1.requires_grad or r2.requires_grad
    return _limit_violation(x.shape, x.dtype, layout, r_requires_grad)


def _requires_grad(node) -> bool:
    """Whether a graph node's tensor needs grad: ``meta["tensor_meta"]`` records it, ``meta["val"]`` does not."""
    tensor_meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return bool(getattr(tensor_meta, "requires_grad", False))


def _check_bsnd(match) -> str | None:
    x = meta_val(match.kwargs["x_bsnd"])
    cos, sin = meta_val(match.kwargs["cos"]), meta_val(match.kwargs["sin"])
    if not all(isinstance(t, torch.Tensor) for t in (x, cos, sin)):
        return "x, cos or sin is not a tensor"
    if not all(r.dim() == 4 and guard_or_false(r.shape[1] == 1) for r in (cos, sin)):
        return f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} is not unsqueezed at dim 1 ([B|1, 1, S, D])"
    r_grad = _requires_grad(match.kwargs["cos"]) or _requires_grad(match.kwargs["sin"])
    return check_rotary(x, _bsnd_r(cos), _bsnd_r(sin), "BSND", r_grad)


def _check_bnsd(match) -> str | None:
    cos, sin = match.kwargs["cos"], match.kwargs["sin"]
    r_grad = _requires_grad(cos) or _requires_grad(sin)
    return check_rotary(meta_val(match.kwargs["x"]), meta_val(cos), meta_val(sin), "BNSD", r_grad)


def _examples_bsnd():
    return [torch.empty(2, 4, 3, 16), torch.empty(1, 1, 4, 16), torch.empty(1, 1, 4, 16)]


def _examples_bnsd():
    return [torch.empty(2, 3, 4, 16), torch.empty(1, 1, 4, 16), torch.empty(1, 1, 4, 16)]


class RotaryFamily(FusionFamily):
    """``x*cos + rotate_half(x)*sin`` -> ``npu_rotary_mul``; 2 per layer (q and k)."""

    name = "rotary"
    anchor_ops = (aten.neg.default,)
    fused_op_names = ("npu_rotary_mul",)

    def iter_variants(self):
        # No casts in the subgraph, so one trace covers every dtype (the check refuses mixed dtypes).
        # Order matters: both variants match HF's subgraph (x = the transpose), the BSND one is tried first.
        yield PatternVariant(
            "rotary_bsnd", _search_bsnd, _replace_bsnd, _examples_bsnd, _check_bsnd,
            why="HF's q/k = view(B,S,N,D).transpose(1,2): run on the contiguous BSND tensor, where HF's "
                "BNSD fails at decode (B*N > 8*S, error 561002)",
        )
        yield PatternVariant(
            "rotary_bnsd", _search_bnsd, _replace_bnsd, _examples_bnsd, _check_bnsd,
            why="x already contiguous BNSD (not a transposed view): run as is, guarded by the BNSD limits",
        )
