"""The attention masks of the ``attention`` family: proving, converting and sharing them (``patterns/attention/``:
imports nothing of the family; :mod:`.dense` and :mod:`.packed` import it).

``npu_fusion_attention`` takes one kind of mask, ``atten_mask``: bool, **True = masked out**, shapes
BNSS/B1SS/11SS/SS (torch_npu 2.13.0 ``npu_fusion_attention`` docs; the shape limit lives in
:func:`~qwen_npu_compile.ops.torch_npu.fusion_attention.fusion_attention_violation`). transformers hands the
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
- :func:`causal_mask_reason` proves that a mask is the plain causal mask (``tril``, Sq == Skv): the
  attention then takes ``sparse_mode=2`` with the compressed 2048x2048 mask instead, and the
  ``[B, 1, S, S]`` mask and its subgraph become dead code (transformers 5.x builds one in every compiled
  forward without padding: 1 GiB at S=32768);
- :func:`eager_fully_masked_rows` gives the rows HF's eager chain computes where the mask hides every
  key (left padding), which the kernel computes as 0.
"""

from __future__ import annotations

import logging
import math
import operator
import time
import weakref

import torch
import torch.fx

from qwen_npu_compile.fusion.family import meta_val, region_operands, view_key
from qwen_npu_compile.graph.utils import ancestors, node_source, share_first
from qwen_npu_compile.ops.scalars import constant_tensor_value

aten = torch.ops.aten
#: The logger keeps the name of the module this one was (``patterns/attention/masks.py``).
log = logging.getLogger(__name__)

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
    (:func:`~qwen_npu_compile.fusion.family.region_operands`). A mask that is a graph input of the whole graph
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


#: What :func:`~qwen_npu_compile.ops.attention_contract.compressed_causal_mask` leaves in the graph for
#: every causal attention: ``triu(ones(2048, 2048, bool), 1)``.
COMPRESSED_MASK_OPS = (aten.ones.default, aten.triu.default)


def _only_feeds_attention(node: torch.fx.Node) -> bool:
    """Whether every use of ``node`` is a fused attention, directly or through shared mask nodes."""
    fused = torch.ops.npu.npu_fusion_attention.default
    return bool(node.users) and all(
        user.target is fused
        or (user.target in MASK_CONVERSIONS + COMPRESSED_MASK_OPS and _only_feeds_attention(user))
        for user in node.users
    )


def share_mask_conversions(graph: torch.fx.Graph) -> int:
    """Compute each mask conversion once per graph: every layer's ``logical_not(mask)`` of the one shared
    mask (or ``mask != 0``) feeding ``npu_fusion_attention`` is replaced by the first one, and so is every
    layer's compressed causal mask (``triu(ones(2048, 2048, bool), 1)``, 4 MiB written twice per layer).

    Each replacement converts its own mask (the pattern replaces one attention at a time), so a model
    whose layers share one ``[B, 1, S, S]`` mask would convert it once per layer (``B·S²`` bytes read
    and written each time: 32 MiB per layer at S=4096) and save one copy per layer for the backward.
    Identical (op, input) pairs compute identical tensors, so sharing them is exact; inputs that are
    identical views of one tensor count as identical (:func:`~qwen_npu_compile.fusion.family.view_key`:
    transformers 4.5x slices the shared mask in every layer). Nodes are visited in graph order, so the
    first of a kind precedes every use of the later ones.

    Returns:
        How many conversions were removed.
    """
    conversions = (
        node for node in list(graph.nodes)
        if node.op == "call_function" and node.target in MASK_CONVERSIONS + COMPRESSED_MASK_OPS
        and _only_feeds_attention(node)
    )
    return share_first(
        graph, ((node, (node.target, view_key(node.args), view_key(tuple(sorted(node.kwargs.items())))))
                for node in conversions)
    )


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


# --------------------------------------------------------------------------------------------------
# Proving a mask is the plain causal mask (sparse_mode=2 instead of the explicit S×S mask).
# --------------------------------------------------------------------------------------------------

#: The largest tensor (elements) the causal proof computes at once: 16 Mi elements (16 MiB as bool).
#: Larger tensors of the mask's subgraph are computed in blocks of query rows of about this size.
EVAL_BLOCK_ELEMENTS = 1 << 24

#: The largest mask (elements) the causal proof evaluates: 4 Gi elements (B·S² with B=4 at S=32768), about
#: 5 s of compile time on 2 idle cores; larger masks keep the explicit mask without trying.
EVAL_MAX_ELEMENTS = 1 << 32

#: Ops that fill memory without initialising it: their value is not a function of the graph.
_UNINITIALISED = (
    aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default,
    aten.new_empty_strided.default,
)  # fmt: skip
#: Ops that may produce floating-point values in a mask subgraph: constants, selection and casts, which
#: are exact on every device (no float arithmetic whose rounding could differ on the NPU).
_FLOAT_EXACT = (
    *_WHERE_OPS, *_ZERO_FACTORIES, *_FULL_FACTORIES, aten.ones.default, aten.ones_like.default,
    aten.new_ones.default, aten.lift_fresh_copy.default, aten.detach.default, aten._to_copy.default,
    aten.to.dtype, aten.clone.default, aten.contiguous.default, aten.expand.default,
)  # fmt: skip
#: Row-preserving ops that are not tagged pointwise: evaluated block by block like pointwise ops.
_ROWWISE = (
    aten.__and__.Tensor, aten.__or__.Tensor, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
    aten._to_copy.default, aten.to.dtype,
)  # fmt: skip
#: Ops that keep a tensor's last two dims and only regroup (or copy) the leading ones.
_REGROUP = (
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.alias.default, aten.clone.default, aten.contiguous.default,
)  # fmt: skip

#: Per graph object (weakly: a freed graph drops its entry): ``{repr(view_key(mask)): reason}``, so a mask
#: shared by every layer (or every layer's identical view of it) is evaluated once per graph. The keys are
#: strings (node names are unique in a graph), so nothing here keeps a graph alive; a copy of the graph
#: (``deepcopy``, ``graph_copy``) is a new object and is proven afresh.
_PROOFS: weakref.WeakKeyDictionary[torch.fx.Graph, dict[str, str | None]] = weakref.WeakKeyDictionary()


def causal_mask_reason(mask: torch.fx.Node) -> str | None:
    """Why the attention mask ``mask`` is not provably the plain causal mask, or None when it is.

    The plain causal mask lets query row i attend to keys ``j <= i``: ``tril(ones(S, S))`` (True =
    attend; an additive mask: 0 there), broadcast over the leading dims, with Sq == Skv. That is
    ``npu_fusion_attention``'s ``sparse_mode=2`` (left-up causal) with the compressed 2048x2048 mask, so
    no ``[B, 1, S, S]`` tensor is needed. transformers 5.x builds such a mask in every compiled forward
    without padding (``masking_utils.find_packed_sequence_indices`` cannot skip under tracing, so
    ``create_causal_mask`` ANDs the causal function with the packed-sequence one), and 4.57 builds one
    for every compiled forward; from the default position ids (``arange``) it is exactly causal.

    The proof is exact: the mask's producing subgraph (every ancestor node) must read no graph input
    (a padding mask or user-passed position ids make it data-dependent), hold only static shapes,
    deterministic ops (no random or uninitialised memory), no floating-point arithmetic (constants,
    ``where`` and casts only, exact on every device) and nothing outside it may mutate its tensors.
    Then the subgraph is a constant of the graph, and it is evaluated once at compile time on the CPU
    with real tensors (``get_attr`` constants read from the module) and compared with the causal mask.
    Tensors larger than :data:`EVAL_BLOCK_ELEMENTS` elements are computed in blocks of query rows, which
    needs them to be ``[..., Sq, Skv]`` tensors made by pointwise ops, ``expand`` and leading-dim views
    (how transformers builds masks); otherwise the proof gives up. Memory stays bounded (S=32768: 64
    blocks of 512 rows); the time grows with B·S² (README: 1.3 s at B=1, S=32768 on 2 idle cores), so
    masks above :data:`EVAL_MAX_ELEMENTS` are not evaluated.

    Args:
        mask: the attention's mask node: SDPA's bool mask (True = attend) or an additive float mask that
            :func:`check_additive_mask` accepted (0 = attend).

    Returns:
        None when the mask equals the plain causal mask, else a one-line reason (the explicit mask is kept).
    """
    proofs = _PROOFS.setdefault(mask.graph, {})
    key = repr(view_key(mask))
    if key not in proofs:
        start = time.perf_counter()
        proofs[key] = _causal_mask_reason(mask)
        log.debug(
            "qwen_npu: attention mask %s (%s) %s (%.3fs)", mask.name, node_source(mask),
            "is the plain causal mask: sparse_mode=2 with the compressed 2048x2048 mask" if proofs[key] is None
            else f"kept as an explicit mask: {proofs[key]}", time.perf_counter() - start,
        )  # fmt: skip
    return proofs[key]


def _ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and every node it depends on, in graph (topological) order."""
    seen = ancestors(node)
    return [n for n in node.graph.nodes if n in seen]


def _mutated_from_outside(nodes: set) -> torch.fx.Node | None:
    """A node outside ``nodes`` that calls a mutating op on one of them or on a view of one, else None."""
    stack = list(nodes)
    seen = set(stack)
    while stack:
        for user in stack.pop().users:
            if user in nodes or not isinstance(user.target, torch._ops.OpOverload):
                continue
            if user.target._schema.is_mutable:
                return user
            if user.target.is_view and user not in seen:
                seen.add(user)
                stack.append(user)
    return None


def _static_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(size, int) for size in value.shape)


def _node_reason(node: torch.fx.Node) -> str | None:
    """Why ``node`` cannot be part of a mask subgraph evaluated at compile time, or None."""
    if node.op == "placeholder":
        return (
            f"it reads graph input {node.name} (a padding mask, user-passed position ids, or a mask computed "
            "outside the graph): data-dependent"
        )
    if node.op == "get_attr":
        return None
    if node.op != "call_function":
        return f"its subgraph holds {node.op} {node.name}"
    target = node.target
    if target is operator.getitem:
        return None
    if not isinstance(target, torch._ops.OpOverload):
        return f"its subgraph calls {target} ({node.name}), not an ATen op"
    if torch.Tag.nondeterministic_seeded in target.tags or target in _UNINITIALISED:
        return f"its subgraph calls {target} ({node.name}), which is random or uninitialised"
    value = meta_val(node)
    if not all(_static_tensor(t) for t in (value if isinstance(value, (tuple, list)) else (value,))):
        return f"{node.name} ({target}) has a symbolic shape or is not a tensor (dynamic sequence length)"
    if any(t.is_floating_point() for t in (value if isinstance(value, (tuple, list)) else (value,))) and (
        target not in _FLOAT_EXACT and not target.is_view
    ):
        return f"{node.name} ({target}) computes in floating point, which may round differently on the NPU"
    return None


def _numel(value) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 0


def _on_cpu(value):
    """``value`` with every device argument moved to the CPU (the proof evaluates there)."""
    if isinstance(value, torch.device):
        return torch.device("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: torch.device("cpu") if k == "device" and v is not None else _on_cpu(v) for k, v in value.items()}
    return value


def _causal_mask_reason(mask: torch.fx.Node) -> str | None:
    source = mask
    while source.op == "call_function" and source.target is aten.alias.default:
        source = source.args[0]  # transformers 4.57 slices the mask to the key length: a full slice, an alias
    if source.op == "placeholder" and (operands := region_operands(source)):
        # an input of an activation-checkpointed region's body: proven when what every caller passes is
        for operand in operands:
            if not isinstance(operand, torch.fx.Node):
                return f"mask {mask.name} is bound to {operand!r}, not a graph node"
            reason = causal_mask_reason(operand)
            if reason is not None:
                return reason
        return None
    shape = getattr(meta_val(mask), "shape", None)
    if shape is None or not _static_tensor(meta_val(mask)):
        return f"mask {mask.name} has a symbolic shape (dynamic sequence length): its values are not a constant"
    if len(shape) < 2 or shape[-2] != shape[-1]:
        return f"mask {mask.name} of shape {tuple(shape)} is not square (Sq != Skv, e.g. a KV cache)"
    if meta_val(mask).numel() > EVAL_MAX_ELEMENTS:
        return (
            f"mask {mask.name} of shape {tuple(shape)} has more than {EVAL_MAX_ELEMENTS} elements: too costly to "
            "evaluate at compile time"
        )
    nodes = _ancestors(mask)
    for node in nodes:
        reason = _node_reason(node)
        if reason is not None:
            return f"mask {mask.name} is not a graph constant: {reason}"
    mutator = _mutated_from_outside(set(nodes))
    if mutator is not None:
        return f"mask {mask.name}'s subgraph is mutated by {mutator.name} ({mutator.target})"
    try:
        evaluator = _RowBlocks(nodes, rows=shape[-2], cols=shape[-1])
    except _NotRowSeparable as exc:
        return f"mask {mask.name} is too large to evaluate at once and {exc}"
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
        try:
            evaluator.evaluate_small()
        except _NotConstant as exc:
            return f"mask {mask.name} is not a graph constant: {exc}"
        cols = torch.arange(shape[-1])
        for start, stop in evaluator.blocks():
            block = evaluator.rows_of(mask, start, stop)
            attend = block if block.dtype == torch.bool else block == 0
            causal = torch.arange(start, stop)[:, None] >= cols[None, :]
            differs = attend != causal.expand(attend.shape)
            if differs.any():
                rows = differs.reshape(-1, *differs.shape[-2:]).any(dim=0).any(dim=-1).nonzero().flatten() + start
                return (
                    f"mask {mask.name} is not the plain causal mask ({len(rows)} query row(s) differ, "
                    f"first {int(rows[0])}, last {int(rows[-1])})"
                )
    return None


class _NotRowSeparable(Exception):
    """A large tensor of the mask subgraph cannot be computed in blocks of query rows."""


class _NotConstant(Exception):
    """A value of the mask subgraph is not available as a real tensor at compile time."""


class _RowBlocks:
    """Evaluates a mask subgraph (``nodes``, topological) with tensors of at most about
    :data:`EVAL_BLOCK_ELEMENTS` elements: small nodes whole, large ``[..., rows, cols]`` ones per block of
    query rows (pointwise ops broadcast, so row r of the output reads row r, or the one broadcast row, of
    each input)."""

    def __init__(self, nodes: list[torch.fx.Node], *, rows: int, cols: int) -> None:
        self.nodes, self.rows, self.cols = nodes, rows, cols
        self.large = {n for n in nodes if n.op == "call_function" and _numel(meta_val(n)) > EVAL_BLOCK_ELEMENTS}
        self.values: dict[torch.fx.Node, object] = {}
        for node in self.large:
            reason = self._separable_reason(node)
            if reason is not None:
                raise _NotRowSeparable(reason)
        width = max((_numel(meta_val(n)) // rows for n in self.large), default=1)
        self.block_rows = rows if not self.large else max(1, EVAL_BLOCK_ELEMENTS // width)

    def _separable_reason(self, node: torch.fx.Node) -> str | None:
        value = meta_val(node)
        if tuple(value.shape[-2:]) != (self.rows, self.cols):
            return f"{node.name} ({node.target}) of shape {tuple(value.shape)} is not a [..., Sq, Skv] tensor"
        for user in node.users:
            if user in self.nodes and user not in self.large:
                return f"{user.name} ({user.target}) reduces the large {node.name}"
        target = node.target
        if torch.Tag.pointwise in target.tags and not target._schema.is_mutable or target in _ROWWISE:
            return None
        if target is aten.expand.default:
            return None
        if target in _REGROUP and tuple(meta_val(node.args[0]).shape[-2:]) == (self.rows, self.cols):
            return None
        return f"{node.name} ({node.target}) is not a pointwise, expand or leading-dim view op"

    def evaluate_small(self) -> None:
        for node in self.nodes:
            if node in self.large:
                continue
            if node.op == "get_attr":
                value = node.graph.owning_module
                for atom in str(node.target).split("."):
                    value = getattr(value, atom)
                if isinstance(value, torch._subclasses.FakeTensor):
                    raise _NotConstant(f"constant {node.name} is a fake tensor")
                self.values[node] = value.cpu() if isinstance(value, torch.Tensor) else value
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self.values.__getitem__)
            self.values[node] = node.target(*_on_cpu(args), **_on_cpu(kwargs))

    def blocks(self):
        for start in range(0, self.rows, self.block_rows):
            self._block = {}
            yield start, min(start + self.block_rows, self.rows)
        self._block = {}

    def rows_of(self, node: torch.fx.Node, start: int, stop: int) -> torch.Tensor:
        """Query rows ``start:stop`` of ``node``'s value (all of it when it is small and broadcast)."""
        if node not in self.large:
            value = self.values[node]
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-2] == self.rows > 1:
                return value[..., start:stop, :]
            return value
        if node in self._block:
            return self._block[node]
        rows = lambda arg: self.rows_of(arg, start, stop)  # noqa: E731
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), rows)
        shape = list(meta_val(node).shape)
        shape[-2] = stop - start
        if node.target is aten.expand.default:
            value = args[0].expand(shape)
        elif node.target in _REGROUP:
            value = args[0].reshape(shape)
        else:
            value = node.target(*_on_cpu(args), **_on_cpu(kwargs))
        self._block[node] = value
        return value
