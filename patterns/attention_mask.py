"""The attention masks of the ``attention`` family: proving, converting and sharing them.

``npu_fusion_attention`` takes one kind of mask, ``atten_mask``: bool, **True = masked out**, shapes
BNSS/B1SS/11SS/SS (torch_npu 2.13.0 ``npu_fusion_attention`` docs; the shape limit lives in
:func:`~qwen_npu_compile.npu_ops.fusion_attention.fusion_attention_violation`). transformers hands the
attention one of two masks, both built once per forward and shared by every layer
(``masking_utils.sdpa_mask`` / ``eager_mask``, transformers 4.53+ and 5.x)::

    sdpa:   mask                                   # bool [B, 1, Sq, Skv], True = attend
    eager:  where(mask, 0, finfo(dtype).min)       # float [B, 1, Sq, Skv], added to the scores

This module holds what the rewrite needs to know about them:

- :func:`check_additive_mask` proves from the graph that an additive float mask holds only 0 and
  values that mask completely (``-inf`` or a ``finfo.min``), the only case where ``mask != 0`` is an
  exact boolean mask;
- :func:`masked_out` converts either mask into ``atten_mask``;
- :func:`share_mask_conversions` computes that conversion once per graph instead of once per layer;
- :func:`eager_fully_masked_rows` gives the rows HF's eager chain computes where the mask hides every
  key (left padding), which the kernel computes as 0.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from qwen_npu_compile.fusion import meta_val, region_operands, view_key
from qwen_npu_compile.npu_ops.scalars import constant_tensor_value

aten = torch.ops.aten

#: Ops that keep the set of values of an additive mask (views, copies, casts) between it and its where.
_VALUE_PRESERVING = (
    aten.alias.default, aten.clone.default, aten.contiguous.default, aten.expand.default, aten.reshape.default,
    aten.slice.Tensor, aten.to.dtype, aten.unsqueeze.default, aten.view.default, aten._to_copy.default,
)  # fmt: skip
_WHERE_OPS = (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
_ZERO_FACTORIES = (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
#: Constant-filled tensor factories -> the position of their fill value.
_FULL_FACTORIES = {
    aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2, aten.scalar_tensor.default: 0,
}  # fmt: skip
#: The conversions :func:`masked_out` emits (``logical_not(bool)``, ``mask != 0``), as they appear in the graph.
MASK_CONVERSIONS = (aten.logical_not.default, aten.ne.Scalar)


def _constant(arg) -> float | None:
    """The value of a where() branch that is a literal or a constant-filled tensor, else None."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if not isinstance(arg, torch.fx.Node):
        return None
    # transformers 4.5x eager_mask: where(mask, torch.tensor(0.0), min); make_fx keeps the real scalar
    # as a get_attr constant behind lift_fresh_copy / detach_.
    constant = constant_tensor_value(arg)
    if constant is not None:
        return constant
    if arg.op != "call_function":
        return None
    if arg.target in _ZERO_FACTORIES:
        return 0.0
    if arg.target in _FULL_FACTORIES:
        index = _FULL_FACTORIES[arg.target]
        value = arg.args[index] if len(arg.args) > index else arg.kwargs.get("fill_value", arg.kwargs.get("s"))
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return None


def _masks_exactly(value: float) -> bool:
    """-inf or a dtype's finfo.min: exp(value + score - row max) is exactly 0 in the fp32 softmax."""
    finfo_mins = {torch.finfo(dtype).min for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
    return value == -math.inf or value in finfo_mins


def check_additive_mask(mask: torch.fx.Node) -> str | None:
    """Refusal reason for converting the float mask ``mask`` to ``mask != 0`` (True = masked out), or None.

    Exact only when every value is 0 or masks completely: the mask must come (through views, copies and
    casts) from ``where(bool, 0, m)`` or ``where(bool, m, 0)`` with m = -inf or a finfo.min, which is how
    transformers' ``eager_mask`` builds it. Inside an activation-checkpointed region the mask is an input
    of the region's body: the proof continues in the calling graph, from every operand bound to it
    (:func:`~qwen_npu_compile.fusion.region_operands`). A mask that is a graph input of the whole graph
    (per-layer compile), or holds a bias (ALiBi, T5), cannot be proven so and is refused.

    Args:
        mask: the graph node of the additive mask (its value ``[B|1, 1|N, Sq, Skv]``, floating point).
    """
    node = mask
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VALUE_PRESERVING:
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "placeholder" and (operands := region_operands(node)):
        reasons = [check_additive_mask(operand) for operand in operands]
        return next((reason for reason in reasons if reason is not None), None)
    if not isinstance(node, torch.fx.Node):
        return f"additive mask is the constant {node!r}"
    if node.op != "call_function" or node.target not in _WHERE_OPS:
        producer = "a graph input" if node.op == "placeholder" else str(node.target)
        return (
            f"additive float mask comes from {producer} ({node.name}), not where(bool, 0, finfo.min): its "
            "values cannot be proven to be 0 or fully masking, so no exact boolean mask exists"
        )
    condition = meta_val(node.args[0])
    branches = sorted((_constant(node.args[1]), _constant(node.args[2])), key=lambda v: (v is None, v != 0))
    if not isinstance(condition, torch.Tensor) or condition.dtype != torch.bool:
        return f"additive mask {node.name}: where() condition is not a bool tensor"
    zero, other = branches
    if zero != 0 or other is None or not _masks_exactly(other):
        return (
            f"additive mask {node.name} = where(cond, {node.args[1]}, {node.args[2]}) holds values other than "
            "0 and -inf/finfo.min; mask != 0 would not be exact"
        )
    return None


def masked_out(attn_mask: torch.Tensor) -> torch.Tensor:
    """``npu_fusion_attention``'s ``atten_mask`` (bool, True = masked out, contiguous) for an attention mask.

    Args:
        attn_mask: SDPA's bool mask (True = attend) -> ``logical_not``; or an additive float mask that
            :func:`check_additive_mask` accepted (0 = attend) -> ``mask != 0``. Any shape; the op's
            shape limits are checked before (``fusion_attention_violation``).

    Returns:
        A bool tensor of ``attn_mask``'s shape.
    """
    converted = torch.logical_not(attn_mask) if attn_mask.dtype == torch.bool else attn_mask != 0
    return converted.contiguous()


def share_mask_conversions(graph: torch.fx.Graph) -> int:
    """Compute each mask conversion once per graph: every layer's ``logical_not(mask)`` of the one shared
    mask (or ``mask != 0``) feeding ``npu_fusion_attention`` is replaced by the first one.

    Each replacement converts its own mask (the pattern replaces one attention at a time), so a model
    whose layers share one ``[B, 1, S, S]`` mask would convert it once per layer (``B·S²`` bytes read
    and written each time: 32 MiB per layer at S=4096) and save one copy per layer for the backward.
    Identical (op, input) pairs compute identical tensors, so sharing them is exact; inputs that are
    identical views of one tensor count as identical (:func:`~qwen_npu_compile.fusion.view_key`:
    transformers 4.5x slices the shared mask in every layer).

    Returns:
        How many conversions were removed.
    """
    first: dict[tuple, torch.fx.Node] = {}
    removed = 0
    fused = torch.ops.npu.npu_fusion_attention.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in MASK_CONVERSIONS:
            continue
        if not node.users or not all(user.target is fused for user in node.users):
            continue
        key = (node.target, view_key(node.args), view_key(tuple(sorted(node.kwargs.items()))))
        if key not in first:
            first[key] = node
            continue
        node.replace_all_uses_with(first[key])
        graph.erase_node(node)
        removed += 1
    return removed


def eager_fully_masked_rows(query, key, value, attn_mask, scale, out):
    """``out`` with every fully masked query row replaced by what HF's eager chain computes there.

    On a row where every key is masked (left padding), ``scores + finfo.min`` is ``finfo.min`` for every
    key (the scores are absorbed), so eager's fp32 softmax is exactly uniform and the row is the mean of
    V, where ``npu_fusion_attention`` (like SDPA) gives 0. The gradient of that row in eager is the
    softmax Jacobian at the uniform point, ``dS_j = (g·v_j - mean_k g·v_k) / S``, which still reaches q
    and k (``+ mask`` passes the gradient through). With ``e(x) = x - x.detach()`` (value exactly 0), the
    row equals ``mean(V) + scale/S · (q(KᵀV) - q̂(K̂ᵀV) - e(q·mean(K))·ΣV)`` in value and first
    derivative: the linearised softmax, summed with ``KᵀV`` first, so it costs two ``[D, Dv]`` products
    per query row instead of a second ``S×S`` attention. GQA: query head h reads KV head ``h // n_rep``.

    Args:
        query: ``[B, Nq, Sq, D]``; key ``[B, Nkv, Skv, D]``; value ``[B, Nkv, Skv, Dv]`` (un-repeated).
        attn_mask: eager's additive mask (0 = attend), ``[B|1, 1|Nq, Sq, Skv]``.
        scale: the scores' scale.
        out: the fused attention, ``[B, Nq, Sq, Dv]``.

    Returns:
        ``[B, Nq, Sq, Dv]`` in ``out``'s dtype (computed in fp32).
    """
    batch, heads = query.shape[:2]
    kv_heads = key.shape[1]
    # Written for torchair: only ops it converts (aten.all.dim and amax have stub GE converters in
    # torch_npu 2.13.0), no Python arithmetic on the symbolic key length, and no view that mixes the
    # sequence length with another dim (torchair's optimize_view compares view dims, which pinned a
    # dynamic S to 64 when S happened to equal D). The additive mask is 0 or finfo.min, so a row is
    # fully masked when its maximum is not 0; 1/S comes from a tensor count; GQA repeats the small
    # [D, Dv] / [1, D] / [1, Dv] summaries per query head, never q.
    fully_masked = torch.max(attn_mask, dim=-1, keepdim=True).values != 0  # [B|1, 1|Nq, Sq, 1]
    k, v = key.float(), value.float()

    def per_query_head(t):  # [B, Nkv, a, b] -> [B, Nq, a, b], query head h reads KV head h // n_rep
        return t[:, :, None].expand(batch, kv_heads, heads // kv_heads, *t.shape[2:]).reshape(batch, heads, *t.shape[2:])

    q = query.float()
    kv_len = per_query_head(torch.ones_like(v[..., :1]).sum(dim=-2, keepdim=True))  # [B, Nq, 1, 1]: S
    k_t_v = per_query_head(k.transpose(-2, -1) @ v)  # [B, Nq, D, Dv]
    k_t_v_detached = per_query_head(k.detach().transpose(-2, -1) @ v)
    linear = q @ k_t_v - q.detach() @ k_t_v_detached
    q_k_mean = (q * per_query_head(k.mean(dim=-2, keepdim=True))).sum(dim=-1, keepdim=True)  # [B, Nq, Sq, 1]
    v_sum = per_query_head(v.sum(dim=-2, keepdim=True))  # [B, Nq, 1, Dv]
    rows = ((v_sum + scale * (linear - (q_k_mean - q_k_mean.detach()) * v_sum)) / kv_len).to(out.dtype)
    return torch.where(fully_masked, rows, out)
