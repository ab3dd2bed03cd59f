"""Packed sequences: an attention mask proven to be the packed causal mask of the graph's position ids
(:mod:`.packed`) -> ``qwen_npu.varlen_attention`` (TND, per-sequence offsets as a tensor, no T x T tensor).
Imports :mod:`.spellings`, :mod:`.dense` (each variant runs its row's check first) and :mod:`.packed`.

FX before (transformers 5.24, sdpa, GQA; per layer, the shared mask ``expand_1`` ``b8[1, 1, T, T]``)::

    sdpa = aten.scaled_dot_product_attention.default(q, repeat_kv(k), repeat_kv(v), expand_1, scale=s)

FX after (the seq ends once per graph, right after the placeholders; q/k/v are BNSD views of BSND
memory, so their TND views are free; GQA native: K/V not repeated)::

    seq_ends = qwen_npu.seq_ends_from_positions.default(position_ids, 'restart')   # int64 CPU [B]
    ...
    t = aten.transpose.int(q, 1, 2);  q_tnd = aten.squeeze.dim(t, 0)                # [T, Nq, D]
    (the same for k, v: [T, Nkv, D])
    varlen = qwen_npu.varlen_attention.default(q_tnd, k_tnd, v_tnd, seq_ends, Nq, s, 3)
    out = aten.transpose.int(aten.unsqueeze.default(varlen[0], 0), 1, 2)           # [1, Nq, T, Dv]

and the ``[1, 1, T, T]`` mask subgraph is dead code. (Each replacement first computes its ends from a
``[1, T]`` stand-in read off the mask's sub-diagonal, exact on its own; :func:`share_seq_ends` then
points it at the proven position ids and keeps one per graph.)

Variants (:func:`varlen_variants`): one per attention row of :data:`.spellings.SPELLINGS` that a packed
graph can show, named ``varlen_<row>`` (:data:`VARLEN_ROWS`): SDPA with a mask and no dropout
(repeat_kv, repeat_kv_symbolic, mha) and every eager row. Each matches what its row matches (its mask
input is called ``packed_mask``, so Inductor keeps it apart from the row's own pattern) and is tried
before the rows; its check runs the row's check first (so a refusal records the row's reason), then
refuses a plain causal mask (the row's ``sparse_mode=2`` needs no offsets), an unproven mask, B != 1,
dropout (the varlen op has no ``keep_prob``) and anything :func:`~qwen_npu_compile.ops.qwen_npu.varlen_attention.varlen_violation`
refuses (T <= 1M, Nq <= 256, D <= 768, GE dtypes for torchair); the row then fuses the explicit mask.

Limits: the segment count (<= 2048 per call, :data:`~qwen_npu_compile.ops.qwen_npu.varlen_attention.MAX_SEGMENTS`)
is data and unknown at compile time; a packing above it raises the op's error at run time (only
possible with T > 2048). SDPA with ``enable_gqa`` and a mask (``TRANSFORMERS_SDPA_FORCE_GQA=1``) and an
activation-checkpointed layer (its region body receives the mask, not the position ids) keep the
explicit mask.
"""

from __future__ import annotations

import types

import torch
import torch.fx

from qwen_npu_compile.fusion.family import PatternVariant, current_target, meta_val, view_key, with_parameters
from qwen_npu_compile.graph.utils import share_first
from qwen_npu_compile.ops.qwen_npu import varlen_attention as varlen_ops

from . import dense
from .packed import _PROOFS, RULE, PackedMask, _equal, packed_mask, packed_mask_reason
from .spellings import SPELLINGS, Spelling, _search_fn, row_variant

#: ``varlen_attention``'s sparse_mode: right-down causal per sequence (Sq == Skv: the same as left-up).
SPARSE_MODE = 3
#: The name a varlen variant gives its mask input (the row's is ``attn_mask``).
PACKED_MASK = "packed_mask"


# --------------------------------------------------------------------------------------------------
# The replacement: varlen attention on TND views.
# --------------------------------------------------------------------------------------------------


def _positions_stand_in(packed_mask_value: torch.Tensor) -> torch.Tensor:
    """``[1, T]`` int64 positions whose ``"restart"`` sequences are the proven mask's blocks, read off its
    sub-diagonal (a sequence starts at i where query i may not see key i - 1); exact by itself, and
    replaced by the graph's position ids in :func:`share_seq_ends` (it then reads nothing)."""
    diagonal = packed_mask_value[0, 0].diagonal(-1)  # [T - 1]
    starts = torch.logical_not(diagonal) if diagonal.dtype == torch.bool else diagonal != 0
    steps = torch.cat([starts.new_zeros(1), starts]).to(torch.int64).cumsum(0)
    return (torch.arange(packed_mask_value.shape[-1], device=packed_mask_value.device) + 2 * steps).unsqueeze(0)


def _tnd(t: torch.Tensor) -> torch.Tensor:
    """``[1, N, T, D]`` -> ``[T, N, D]``: a view when ``t`` is dense BSND in memory, else a copy."""
    bsnd = t.transpose(1, 2)
    return (bsnd if dense._dense_bsnd(t) else bsnd.contiguous()).squeeze(0)


def varlen_packed_attention(query, key, value, mask, *, scale: float | None) -> torch.Tensor:
    """SDPA semantics over a proven packed causal ``mask`` on ``qwen_npu.varlen_attention``.

    Args:
        query: ``[1, Nq, T, D]`` (BNSD shape; a BSND-dense view costs no copy).
        key: ``[1, Nkv, T, D]``, un-repeated (Nq % Nkv == 0: native GQA).
        value: ``[1, Nkv, T, Dv]``.
        mask: the packed causal mask ``[1, 1, T, T]`` (bool or additive) that :func:`packed_mask` proved.
        scale: the softmax scale; None is SDPA's 1/sqrt(D).

    Returns:
        ``[1, Nq, T, Dv]`` in q's dtype (a BNSD view of TND memory, as SDPA's output is used).
    """
    heads, head_dim = query.shape[1], query.shape[3]
    if scale is None:
        scale = head_dim**-0.5
    seq_ends = varlen_ops.SEQ_ENDS_OP(_positions_stand_in(mask), RULE)
    out = varlen_ops.OP(_tnd(query), _tnd(key), _tnd(value), seq_ends, heads, scale, SPARSE_MODE)[0]
    return out.unsqueeze(0).transpose(1, 2)


def _stand_in_mask(node: torch.fx.Node, proofs: dict) -> PackedMask | None:
    """The proof of the mask a :func:`_positions_stand_in` chain ending at ``node`` was read from."""
    seen, frontier = {node}, [node]
    for _ in range(16):
        following = []
        for current in frontier:
            result = proofs.get(repr(view_key(current)))
            if isinstance(result, PackedMask):
                return result
            for arg in current.all_input_nodes:
                if arg not in seen:
                    seen.add(arg)
                    following.append(arg)
        frontier = following
    return None


def share_seq_ends(graph: torch.fx.Graph) -> int:
    """Compute the varlen offsets once per graph, from the proven position ids.

    Each varlen replacement computes ``seq_ends_from_positions(stand_in(mask), "restart")``; here the
    first one (in graph order) reads the position ids the mask was proven from instead and moves right
    after the placeholders, and every other layer's uses it (they compute the same offsets). The mask
    subgraph and the stand-ins are then dead code (removed by the fuse stage's DCE).

    Returns:
        How many offset computations were removed.
    """
    proofs = _PROOFS.get(graph, {})
    placeholders = graph.find_nodes(op="placeholder")

    def keyed():  # (offsets node, the position ids it reads): one offsets computation per position ids
        for node in list(graph.find_nodes(op="call_function", target=varlen_ops.SEQ_ENDS_OP)):
            if node.args[1] != RULE or not any(user.target is varlen_ops.OP for user in node.users):
                continue
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and source.op == "placeholder":
                yield node, source
                continue
            proof = _stand_in_mask(source, proofs)
            if proof is not None:  # else not ours: exact as it is
                yield node, proof.positions

    def read_positions(node: torch.fx.Node, positions: torch.fx.Node) -> None:
        node.update_arg(0, positions)
        if placeholders:
            placeholders[-1].append(node)

    return share_first(graph, keyed(), on_first=read_positions)


# --------------------------------------------------------------------------------------------------
# The variants.
# --------------------------------------------------------------------------------------------------


def _takes_packed_mask(row: Spelling) -> bool:
    """Rows a packed whole-model graph shows: SDPA with a mask and no dropout (K/V repeated or MHA) and
    every eager row (the varlen op has no dropout; ``enable_gqa`` with a mask needs an env override)."""
    if row.impl == "sdpa":
        return row.mask == "mask" and not row.dropout and row.kv != "gqa"
    return True


#: The attention rows that get a varlen variant (:func:`varlen_variants`), in the table's order.
VARLEN_ROWS: tuple[Spelling, ...] = tuple(row for row in SPELLINGS if _takes_packed_mask(row))


def variant_name(row: Spelling) -> str:
    return f"varlen_{row.name}"


def _parameters(row: Spelling) -> tuple[str, ...]:
    return tuple(PACKED_MASK if name == "attn_mask" else name for name in row.parameters)


def _check_fn(row: Spelling):
    row_check = dense._check_fn(row)

    def check(match) -> str | None:
        kwargs = dict(match.kwargs)
        mask_node = kwargs.pop(PACKED_MASK)
        # the row's own check first (its refusal is the one recorded when nothing fuses)
        reason = row_check(types.SimpleNamespace(kwargs={**kwargs, "attn_mask": mask_node}, nodes=match.nodes))
        if reason is not None:
            return reason
        if dense.CAUSAL_MASK.get():
            return "the mask is the plain causal mask: the row fuses it with sparse_mode=2, no offsets needed"
        if not isinstance(mask_node, torch.fx.Node):
            return "no mask node"
        proof = packed_mask(mask_node)
        if not isinstance(proof, PackedMask):
            return f"explicit mask kept: {proof}"
        q, k, v = (meta_val(kwargs[name]) for name in ("query", "key", "value"))
        cast = dense.AUTOCAST_DTYPE.get()
        if cast is not None:
            q, k, v = (t.to(cast) for t in (q, k, v))
        if not all(_equal(t.shape[0], 1) and _equal(t.shape[2], proof.tokens) for t in (q, k, v)):
            return (f"query/key/value {[list(t.shape) for t in (q, k, v)]} are not [1, N, T, D] over the T = "
                    f"{proof.tokens} packed tokens")
        dropout = meta_val(kwargs.get("dropout_p", 0.0)) if row.impl == "sdpa" or row.dropout else 0.0
        if dropout != 0:
            return f"attention dropout p={dropout}: varlen_attention has no dropout (keep_prob); explicit mask kept"
        target = current_target()
        reason = varlen_ops.varlen_violation(
            *(t.transpose(1, 2)[0] for t in (q, k, v)), None, q.shape[1],
            downstream=target.downstream if target is not None else None,
        )
        if reason is not None:
            return f"varlen attention refused, explicit mask kept: {reason}"
        return None

    return check


def _replace_fn(row: Spelling):
    def replace(query, key, value, packed_mask, scale, dropout_p=0.0):
        query, key, value = dense._autocast_cast(query, key, value)
        return varlen_packed_attention(query, key, value, packed_mask, scale=dense._scale_for(scale))

    return with_parameters(replace, _parameters(row))


def _variant(row: Spelling) -> PatternVariant:
    """The varlen variant of ``row``: the row's search (its mask input renamed), check, varlen replacement."""
    row_search = _search_fn(row)
    names = _parameters(row)
    search_fn = with_parameters(lambda **inputs: row_search(*inputs.values()), names)
    search_fn.__name__ = search_fn.__qualname__ = f"varlen_{row.name}_search"
    return row_variant(
        row, name=variant_name(row), parameters=names, search_fn=search_fn, replace_fn=_replace_fn(row),
        check=_check_fn(row), decides=dense.DECISIONS,
        why=f"{row.why}, packed sequences (position_ids restarting, no attention_mask): varlen attention",
    )


def varlen_variants() -> list[PatternVariant]:
    """One varlen variant per row of :data:`VARLEN_ROWS`; the attention family yields them before its rows."""
    return [_variant(row) for row in VARLEN_ROWS]



__all__ = [
    "PACKED_MASK", "RULE", "SPARSE_MODE", "VARLEN_ROWS", "PackedMask", "packed_mask", "packed_mask_reason",
    "share_seq_ends", "variant_name", "varlen_packed_attention", "varlen_variants",
]
