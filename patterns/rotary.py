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

**Partial rotary** (variant ``rotary_partial_bsnd``): transformers 5.x ``models/qwen3_5``, ``qwen3_5_moe``,
``qwen3_next`` (and 4.57's ``qwen3_next``), ``partial_rotary_factor`` 0.25 (rotated width ``head_dim / 4``:
64 of 256 in Qwen3.5 / Qwen3-Next; ``cos.shape[-1]`` in the graph)::

    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)

FX before (q = ``q_norm(...).transpose(1, 2)``, D = 64, rotated width 16)::

    transpose = aten.transpose.int(q_bsnd, 1, 2)                    # BNSD view of BSND memory
    slice_1 = aten.slice.Tensor(transpose, 3, 0, 16)                # q_rot
    slice_2 = aten.slice.Tensor(transpose, 3, 16, 9223372036854775807)   # q_pass
    mul = aten.mul.Tensor(slice_1, unsqueeze)                       # ... rotate_half(q_rot) ... add
    cat = aten.cat.default([add, slice_2], -1)                      # contiguous BNSD

FX after (verl npu_patch's form: slice to ``cos.shape[-1]``, ``npu_rotary_mul``, cat with the rest; the
rotated slice is strided, so it is made dense first: a copy of a quarter of q, the kernel reads dense inputs)::

    slice_3 = aten.slice.Tensor(q_bsnd, 3, 0, 16)
    contiguous = aten.contiguous.default(slice_3)                   # [B, S, N, 16]
    npu_rotary_mul = npu.npu_rotary_mul.default(contiguous, unsqueeze_2, unsqueeze_3, 'half')   # BS1D cos/sin
    slice_4 = aten.slice.Tensor(q_bsnd, 3, 16, 9223372036854775807)    # the pass-through part, untouched
    cat = aten.cat.default([npu_rotary_mul, slice_4], -1)           # [B, S, N, 64], BSND
    transpose = aten.transpose.int(cat, 1, 2)                       # BNSD view of BSND, as the full variant gives

**Full-width partial rotary** (``partial_rotary_factor`` 1.0, e.g. a Qwen3.5 configured so): the same code with
``rotary_dim == head_dim`` traces ``q[..., :D]`` as ``aten.alias`` and ``q[..., D:]`` as an empty slice::

    alias = aten.alias.default(transpose)                           # q_rot, the whole head
    slice_1 = aten.slice.Tensor(transpose, 3, 64, 9223372036854775807)   # q_pass, [B, N, S, 0]
    ... the rotary on alias ...
    cat = aten.cat.default([add, slice_1], -1)

:class:`RotaryPass` first rewrites that into the full rotary (:func:`drop_full_width_slice`: the alias's users
read ``transpose``, the cat becomes the contiguous copy it made, ``aten.clone(add)``), which ``rotary_bsnd``
then fuses (forward and backward): exactly the numbers, one copy as before.

The cat in BSND (HF's is a contiguous BNSD tensor) lets the attention rewrite take BSH views of q and k
with no copy (V is a BSND view already). Every limit below applies to the rotated part ``[B, S, N,
rotary_dim]`` (its D is the rotated width): the kernel's D < 896 and even, and for torchair training the
backward converter's D % 64 == 0 (met by Qwen3.5's 64; a 16-wide tiny model takes the orthogonal or ATen
backward form, or is refused when cos/sin need grad). ``torch_npu.npu_rotary_mul``'s ``rotate`` matrix could
rotate a part of the head in one call, but has no backward (torch_npu 2.13.0 docs), so it is not used.

Constraints (torch_npu 2.13.0 ``npu_rotary_mul`` docs, ``docs/npu-op-contracts.md``,
:mod:`qwen_npu_compile.ops.torch_npu.rotary_mul`): mode ``'half'`` computes exactly HF's
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

torchair downstream, training: the GE converter of ``npu_rotary_mul_backward`` raises unless shapes are
static, D % 64 == 0 and the broadcast dims multiply to <= 1024 (all limits:
:func:`~qwen_npu_compile.ops.torch_npu.rotary_mul.rotary_mul_violation`). When cos/sin need no grad and the
graph shows sin built from ``cat((freqs, freqs), -1)`` (:func:`has_equal_halves`, true for HF's
``Qwen2RotaryEmbedding``), the rewrite emits ``qwen_npu.rotary_mul_orthogonal`` instead, whose backward
is ``npu_rotary_mul(grad, cos, -sin)`` (RotaryMul, none of those limits). Otherwise it emits
``npu_rotary_mul`` if the backward converter's limits hold; if they do not and cos/sin need no grad (a
per-layer graph under ``maybe_compile``, where cos/sin are graph inputs and verl's token count is
dynamic), it emits ``qwen_npu.rotary_mul_aten_backward`` (the fused forward, HF's backward in ATen ops,
which GE converts); cos/sin that need grad are refused with the converter's reason.
Other downstreams and inference graphs always get ``npu_rotary_mul``.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.fusion.family import (
    CheckDecision,
    FamilyPass,
    FusionFamily,
    PatternVariant,
    current_target,
    graph_needs_autograd,
    meta_val,
    region_operands,
)
from qwen_npu_compile.graph.utils import ancestors
from qwen_npu_compile.ops.qwen_npu import rotary_mul_aten_backward, rotary_mul_orthogonal
from qwen_npu_compile.ops.torch_npu.rotary_mul import rotary_mul_violation

aten = torch.ops.aten

#: The op the replacement emits: ``npu_rotary_mul``, or the form a torchair training graph needs
#: (:mod:`~qwen_npu_compile.ops.qwen_npu.rotary_mul_orthogonal`,
#: :mod:`~qwen_npu_compile.ops.qwen_npu.rotary_mul_aten_backward`). Set by a variant's check when it accepts a
#: match, read by its replacement, which Inductor traces right after the check accepts
#: (``register_replacement``'s ``check_fn``).
EMIT: CheckDecision[str] = CheckDecision("rotary_emit", default="npu_rotary_mul")
#: What each :data:`EMIT` value calls, ``(x, r1, r2) -> out``.
_EMITTERS = {
    "npu_rotary_mul": lambda x, r1, r2: torch.ops.npu.npu_rotary_mul.default(x, r1, r2, "half"),
    "orthogonal": lambda x, r1, r2: rotary_mul_orthogonal.OP(x, r1, r2),
    "aten_backward": lambda x, r1, r2: rotary_mul_aten_backward.OP(x, r1, r2),
}

#: Ops between HF's ``cat((freqs, freqs), -1)`` and the sin the rotary reads that keep "both halves of the
#: last dim are equal" (elementwise maps, casts, copies); views are handled in :func:`has_equal_halves`.
_ELEMENTWISE = (
    aten.sin.default, aten.cos.default, aten.neg.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten._to_copy.default, aten.clone.default, aten.alias.default, aten.contiguous.default, aten.detach.default,
)  # fmt: skip
#: Set by a variant's check when x, cos and sin have different dtypes (fp32 cos/sin with bf16 q/k under
#: ``torch.autocast``: the linear is autocast to bf16, the rotary embedding is not): the dtype HF's mixed
#: product promotes to, which the replacement casts all three to (exactly HF's math: ``q * cos`` upcasts q).
CAST_DTYPE: CheckDecision[torch.dtype | None] = CheckDecision("rotary_cast_dtype", default=None)
_SCALED = (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar)
_MAX_WALK = 32


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


def _rotary(x, r1, r2):
    """The fused call: ``npu_rotary_mul``, or the torchair training form the check chose (:data:`EMIT`)."""
    return _EMITTERS[EMIT.get()](x, r1, r2)


def _promoted(*tensors):
    """The tensors in the dtype the check chose (:data:`CAST_DTYPE`), else unchanged."""
    dtype = CAST_DTYPE.get()
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)


def _replace_bsnd(x_bsnd, cos, sin):
    x_bsnd, cos, sin = _promoted(x_bsnd, cos, sin)
    return _rotary(x_bsnd, _bsnd_r(cos), _bsnd_r(sin)).transpose(1, 2)


def _search_partial(x_bsnd, cos, sin):
    # transformers 5.x qwen3_5 / qwen3_5_moe / qwen3_next (and 4.57 qwen3_next) apply_rotary_pos_emb:
    # rotary on the first cos.shape[-1] dims, the rest passed through and concatenated back.
    x = x_bsnd.transpose(1, 2)
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


def _replace_partial(x_bsnd, cos, sin):
    # verl's npu_patch: slice to cos.shape[-1], npu_rotary_mul on it, cat with the rest. The rotated
    # slice is strided (every D-th row of rotary_dim): made dense first (the kernel reads dense inputs),
    # a copy of rotary_dim/D of x. The cat is done in BSND, so the result is again the BNSD view of BSND
    # memory that HF's full rotary gives (the attention rewrite then takes BSH views of it, no copy).
    rotary_dim = cos.shape[-1]
    x_bsnd, cos, sin = _promoted(x_bsnd, cos, sin)
    rotated = _rotary(x_bsnd[..., :rotary_dim].contiguous(), _bsnd_r(cos), _bsnd_r(sin))
    return torch.cat([rotated, x_bsnd[..., rotary_dim:]], dim=-1).transpose(1, 2)


def check_rotary(x, r1, r2, layout: str, r_requires_grad: bool | None = None) -> str | None:
    """Refusal reason for ``npu_rotary_mul(x, r1, r2, 'half')`` (FakeTensors), or None to fuse.

    The op's limits are :func:`~qwen_npu_compile.ops.torch_npu.rotary_mul.rotary_mul_violation`'s; this adds
    what the rewrite itself needs: tensors, 4-D, not empty, dense (CANN ops read non-contiguous inputs
    wrongly: vllm-ascend #2388, #11834).

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
    if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        return f"x, cos and sin must be 4-D, got x {tuple(x.shape)}, cos {tuple(r1.shape)}, sin {tuple(r2.shape)}"
    reason = rotary_mul_violation(x, r1, r2, layout=layout, r_requires_grad=r_requires_grad)
    if reason is not None:
        return reason
    if guard_or_false(x.numel() == 0):
        return "empty input"
    for label, t in (("x", x), ("cos", r1), ("sin", r2)):
        if not t.is_contiguous():
            return (
                f"{label} is not contiguous (shape {tuple(t.shape)}, stride {tuple(t.stride())}); npu_rotary_mul "
                "reads its inputs as dense"
            )
    return None


def has_equal_halves(node) -> bool:
    """Whether the graph proves that both halves of ``node``'s last dim are equal, for any input values.

    True when ``node`` comes from ``cat([a, a], -1)`` (the same node twice: HF's ``cat((freqs, freqs),
    dim=-1)`` in ``Qwen2RotaryEmbedding.forward``) through elementwise maps and casts, products with
    scalars or with tensors that themselves have equal halves or broadcast along the last dim
    (``* attention_scaling``), and views that keep the last dim (unsqueeze/squeeze/expand/reshape/
    transpose/slice on other dims). An input of an activation-checkpointed region's body is followed to
    what the calling graph passes (:func:`~qwen_npu_compile.fusion.family.region_operands`). Anything else (a
    graph input, an op not listed) is not proven.
    """
    return _equal_halves(node, _MAX_WALK)


def _last_dim_kept(node: torch.fx.Node) -> bool:
    """A view/copy whose output rows along the last dim are its input's rows (last size unchanged, last dim untouched)."""
    source, out = meta_val(node.args[0]), meta_val(node)
    if not (isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor)) or source.dim() == 0 or out.dim() == 0:
        return False
    if not statically_known_true(source.shape[-1] == out.shape[-1]):
        return False
    target = node.target
    if target in (aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.select.int):
        dim = node.args[1] if len(node.args) > 1 else 0
        rank = out.dim() if target is aten.unsqueeze.default else source.dim()
        return dim % rank != rank - 1
    if target is aten.transpose.int:
        return all(d % source.dim() != source.dim() - 1 for d in node.args[1:3])
    return target in (aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                      aten.squeeze.default)


def _equal_halves(node, budget: int) -> bool:
    if isinstance(node, torch.fx.Node) and node.op == "placeholder" and (operands := region_operands(node)):
        # an input of a checkpointed region's body: proven when what every caller passes is
        return all(_equal_halves(operand, budget - 1) for operand in operands)
    if budget <= 0 or not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    if target is aten.cat.default:
        parts = node.args[0]
        val = meta_val(node)
        dim = node.args[1] if len(node.args) > 1 else 0
        return (
            isinstance(val, torch.Tensor) and len(parts) == 2 and parts[0] is parts[1]
            and dim % val.dim() == val.dim() - 1
        )
    if target in _ELEMENTWISE:
        return _equal_halves(node.args[0], budget - 1)
    if target in _SCALED:
        out = meta_val(node)
        for arg in node.args[:2]:
            val = meta_val(arg)
            if isinstance(val, torch.Tensor) and val.dim() > 0 and not (
                statically_known_true(val.shape[-1] == 1)
                and val.dim() <= out.dim()
            ) and not _equal_halves(arg, budget - 1):
                return False
        return any(isinstance(meta_val(arg), torch.Tensor) and meta_val(arg).dim() > 0 for arg in node.args[:2])
    if _last_dim_kept(node):
        return _equal_halves(node.args[0], budget - 1)
    return False


def _requires_grad(node) -> bool:
    """Whether a graph node's tensor needs grad: ``meta["tensor_meta"]`` records it, ``meta["val"]`` does not."""
    tensor_meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return bool(getattr(tensor_meta, "requires_grad", False))


def _check_fused(x, r1, r2, layout: str, x_node, cos_node, sin_node) -> str | None:
    """The check of both variants: the op's limits for the kernel, plus, when a backward will run and
    the downstream is torchair, the form GE converts: the orthogonal form (sin with equal halves, cos/sin
    without grad: :mod:`~qwen_npu_compile.ops.qwen_npu.rotary_mul_orthogonal`), else ``npu_rotary_mul`` when its
    backward converter's limits hold, else (cos/sin without grad) the ATen backward
    (:mod:`~qwen_npu_compile.ops.qwen_npu.rotary_mul_aten_backward`); cos/sin that need grad and break the
    converter's limits are refused with its reason. Sets :data:`EMIT` for the replacement when it accepts."""
    r_grad = _requires_grad(cos_node) or _requires_grad(sin_node)
    reason = check_rotary(x, r1, r2, layout, r_grad)
    if reason is not None:
        return reason
    target = current_target()
    downstream = target.downstream if target is not None else None
    # x's own tensor_meta is not enough: an earlier family's replacement (Qwen3's q_norm/k_norm fused into
    # npu_rms_norm) records requires_grad=False; any graph that may be differentiated counts as training
    backward = r_grad or _requires_grad(x_node) or graph_needs_autograd(x_node.graph)
    emit = "npu_rotary_mul"
    if backward and downstream == "torchair":
        if not r_grad and has_equal_halves(sin_node):
            emit = "orthogonal"
        else:
            reason = rotary_mul_violation(x, r1, r2, layout=layout, r_requires_grad=r_grad, backward=True,
                                          downstream=downstream)
            if reason is not None and r_grad:
                return (f"{reason}; neither the orthogonal backward (npu_rotary_mul with -sin) nor the ATen "
                        "backward applies: cos/sin need grad")
            if reason is not None:
                emit = "aten_backward"
    EMIT.decide(emit)
    return None


def _promote_mixed(x, cos, sin):
    """``(x, cos, sin)`` cast to their promoted dtype when they differ (HF's mixed product computes in it),
    with :data:`CAST_DTYPE` set for the replacement; unchanged (and the flag cleared) when they agree."""
    dtypes = {x.dtype, cos.dtype, sin.dtype}
    if len(dtypes) == 1 or not all(d.is_floating_point for d in dtypes):
        CAST_DTYPE.decide(None)
        return x, cos, sin
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    CAST_DTYPE.decide(dtype)
    return x.to(dtype), cos.to(dtype), sin.to(dtype)


def _check_bsnd(match) -> str | None:
    x = meta_val(match.kwargs["x_bsnd"])
    cos, sin = meta_val(match.kwargs["cos"]), meta_val(match.kwargs["sin"])
    if not all(isinstance(t, torch.Tensor) for t in (x, cos, sin)):
        return "x, cos or sin is not a tensor"
    x, cos, sin = _promote_mixed(x, cos, sin)
    if not all(r.dim() == 4 and guard_or_false(r.shape[1] == 1) for r in (cos, sin)):
        return f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} is not unsqueezed at dim 1 ([B|1, 1, S, D])"
    return _check_fused(x, _bsnd_r(cos), _bsnd_r(sin), "BSND", match.kwargs["x_bsnd"], match.kwargs["cos"],
                        match.kwargs["sin"])


def _check_partial(match) -> str | None:
    """The partial variant's check: the rotated part ``x[..., :rotary_dim]`` made dense, as the kernel
    receives it, must pass every limit the full variant enforces (:func:`_check_fused`: the kernel's
    layout/D/B/N limits, and for torchair training the backward converter's D % 64, or the orthogonal /
    ATen-backward forms); ``rotary_dim`` (cos's last dim) must be at most x's head dim."""
    x = meta_val(match.kwargs["x_bsnd"])
    cos, sin = meta_val(match.kwargs["cos"]), meta_val(match.kwargs["sin"])
    if not all(isinstance(t, torch.Tensor) for t in (x, cos, sin)):
        return "x, cos or sin is not a tensor"
    x, cos, sin = _promote_mixed(x, cos, sin)
    if x.dim() != 4 or not all(r.dim() == 4 and guard_or_false(r.shape[1] == 1) for r in (cos, sin)):
        return f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} is not unsqueezed at dim 1 ([B|1, 1, S, D])"
    rotary_dim, head_dim = cos.shape[-1], x.shape[-1]
    if not guard_or_false(rotary_dim <= head_dim):
        return f"rotated width {rotary_dim} (cos's last dim) > head dim {head_dim}"
    rotated = x.new_empty((*x.shape[:-1], rotary_dim))  # dense, what the replacement passes the kernel
    reason = _check_fused(rotated, _bsnd_r(cos), _bsnd_r(sin), "BSND", match.kwargs["x_bsnd"], match.kwargs["cos"],
                          match.kwargs["sin"])
    return None if reason is None else f"rotated part [..., :{rotary_dim}] of head dim {head_dim}: {reason}"


def _examples_bsnd():
    return [torch.empty(2, 4, 3, 16), torch.empty(1, 1, 4, 16), torch.empty(1, 1, 4, 16)]


def _examples_partial():
    return [torch.empty(2, 4, 3, 32), torch.empty(1, 1, 4, 16), torch.empty(1, 1, 4, 16)]


def drop_full_width_slice(graph: torch.fx.Graph) -> int:
    """Rewrite each full-width partial rotary (``partial_rotary_factor`` 1.0: ``alias(x)`` rotated, an empty
    ``x[..., D:]`` concatenated back) into the full rotary on ``x``; see the module docstring.

    A ``cat([rotated, x[..., s:]], -1)`` is rewritten only when the slice is statically empty, an
    ``aten.alias`` of ``x`` feeds ``rotated``, and the cat's result has ``rotated``'s shape and dtype (so the
    result is ``rotated``, copied contiguous as the cat did). Exact: no value changes.

    Returns:
        The number of cats rewritten.
    """
    count = 0
    for cat in list(graph.find_nodes(op="call_function", target=aten.cat.default)):
        operands = cat.args[0]
        if len(operands) != 2 or operands[1].target is not aten.slice.Tensor:
            continue
        rotated, rest = operands
        x = rest.args[0]
        out, rotated_val, rest_val = meta_val(cat), meta_val(rotated), meta_val(rest)
        if not all(isinstance(t, torch.Tensor) for t in (out, rotated_val, rest_val)):
            continue
        dim = cat.args[1] if len(cat.args) > 1 else 0
        if dim % out.dim() != out.dim() - 1 or not statically_known_true(rest_val.shape[-1] == 0):
            continue
        if rotated_val.dtype != out.dtype or rotated_val.dim() != out.dim() or not all(
                statically_known_true(a == b) for a, b in zip(rotated_val.shape, out.shape)):
            continue
        upstream = ancestors(rotated)
        aliases = [user for user in x.users if user.target is aten.alias.default and user in upstream]
        if not aliases:
            continue
        for alias in aliases:
            alias.replace_all_uses_with(x)
            graph.erase_node(alias)
        with graph.inserting_before(cat):
            copy = graph.call_function(aten.clone.default, (rotated,), {"memory_format": torch.contiguous_format})
        copy.meta.update(cat.meta)
        cat.replace_all_uses_with(copy)
        graph.erase_node(cat)
        if not rest.users:
            graph.erase_node(rest)
        count += 1
    return count


class RotaryPass(FamilyPass):
    """The full-width partial rotary made the full rotary (:func:`drop_full_width_slice`), then the variants."""

    def apply(self, gm: torch.fx.GraphModule, recorder) -> int:
        if drop_full_width_slice(gm.graph):
            gm.recompile()
        return super().apply(gm, recorder)


class RotaryFamily(FusionFamily):
    """``x*cos + rotate_half(x)*sin`` -> ``npu_rotary_mul``; 2 per layer (q and k)."""

    name = "rotary"
    pass_class = RotaryPass
    anchor_ops = (aten.neg.default,)
    fused_op_names = ("npu_rotary_mul",)
    backward_op_name = "npu_rotary_mul_backward"
    per_layer = 2  # q and k

    @classmethod
    def expected_per_layer(cls, model_config, layer_type: str | None = None) -> int:
        """2 (q and k) per decoder layer; 0 in a hybrid model's linear-attention (Gated DeltaNet) layers
        (Qwen3.5, Qwen3.5-MoE, Qwen3-Next ``layer_types``), which have no rotary."""
        return 0 if layer_type == "linear_attention" else cls.per_layer

    def iter_variants(self):
        # No casts in the subgraph, so one trace covers every dtype (mixed dtypes: the check picks the
        # promoted one, the replacement casts to it).
        # (A contiguous-BNSD variant existed; no transformers model computes rotary on one, so it went:
        # tests/patterns/test_every_variant.py requires every variant to match a realistic graph.)
        yield PatternVariant(
            "rotary_bsnd", _search_bsnd, _replace_bsnd, _examples_bsnd, _check_bsnd, decides=(EMIT, CAST_DTYPE),
            why="HF's q/k = view(B,S,N,D).transpose(1,2): run on the contiguous BSND tensor, where HF's "
                "BNSD fails at decode (B*N > 8*S, error 561002)",
        )
        yield PatternVariant(
            "rotary_partial_bsnd", _search_partial, _replace_partial, _examples_partial, _check_partial,
            decides=(EMIT, CAST_DTYPE),
            why="Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (partial_rotary_factor 0.25): rotary on q/k[..., :cos.shape[-1]] "
                "of HF's BNSD view of BSND memory, the rest passed through (slice, rotate, cat); verl npu_patch's form",
        )
