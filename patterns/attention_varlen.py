"""Packed sequences: an attention mask proven to be the packed causal mask of the graph's position ids
-> ``qwen_npu.varlen_attention`` (TND, per-sequence offsets as a tensor, no T x T tensor).

verl's ``use_remove_padding`` packs a micro-batch into one row: ``input_ids [1, T]``, ``position_ids
[1, T]`` restarting for each sequence, ``attention_mask=None``. For a whole-model compile transformers
then builds a block-diagonal causal mask inside the graph (``masking_utils.py``, 5.24.0;
``create_causal_mask`` -> ``_preprocess_mask_arguments`` -> ``find_packed_sequence_indices``, and the
``and_masks`` of the causal function and ``packed_sequence_mask_function``)::

    def find_packed_sequence_indices(position_ids):
        first_dummy_value = position_ids[:, :1] - 1
        position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
        return (position_diff != 1).cumsum(-1)                       # segment id per token

    # sdpa_mask (5.x, non-vmap): b, h, q, kv = arange(B)[:, None, None, None], ..., arange(T)[None, None, None, :]
    mask = new_ones((), bool) & causal(b, h, pos[b, q], pos[b, kv]) & (seg[b, q] == seg[b, kv])
    mask = mask.expand(B, -1, T, T)                                   # bool [B, 1, T, T], True = attend
    # eager_mask: where(mask, 0, finfo(dtype).min)

(5.24 applies the causal function to the position *values* (``remap_positions_for_packed_sequence``),
5.10 to the indices, 4.57 builds the same functions through ``torch.vmap``, which
:mod:`qwen_npu_compile.canonicalize` desugars into plain ATen ops.) Every layer's attention reads that
``[1, 1, T, T]`` mask: T² bytes (1 GiB at T = 32k) and all T² scores where the packed sequences need
Σ lenᵢ².

The proof (:func:`packed_mask_reason`) is structural and exact: it interprets the mask's producing
subgraph node by node with a small abstract domain (the graph's integer ``[1, T]`` input *P*, its
segment ids, index grids of ``arange``, gathers of P or the segments at the query or key index,
comparisons, ANDs, ``where`` to an additive mask, views and copies that keep the values, and
``P[None].expand(k, B, -1)[i]``: the Qwen3.5 / Qwen3.5-MoE text model's mrope stack of one row, whose
``text_position_ids = position_ids[0]`` build the mask) and accepts
only ``(kv <= q) & (seg[q] == seg[kv])`` over the full ``[1, 1, T, T]`` grid, with the causal term
over indices or over P's values. Within one segment P rises by exactly 1 per token (that is what the
segment ids count), so both causal terms agree there and the mask is exactly the block-diagonal causal
mask whose blocks start where ``diff(P) != 1``: the ``"restart"`` rule of
``qwen_npu.seq_ends_from_positions``. Any other op, a second graph input (a padding mask), a sliding
window term, an offset (a KV cache), a batch above 1, or an in-place write anywhere in the subgraph
(an edit after the mask was built) leaves the mask unproven: today's explicit-mask path, with the
reason logged (logger ``qwen_npu_compile.patterns.attention_varlen``, DEBUG) and queryable per mask
(:func:`packed_mask_reason`).

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

Variants (:func:`varlen_variants`): one per attention row of :data:`.attention.SPELLINGS` that a packed
graph can show, named ``varlen_<row>`` (:data:`VARLEN_ROWS`): SDPA with a mask and no dropout
(repeat_kv, repeat_kv_symbolic, mha) and every eager row. Each matches what its row matches (its mask
input is called ``packed_mask``, so Inductor keeps it apart from the row's own pattern) and is tried
before the rows; its check runs the row's check first (so a refusal records the row's reason), then
refuses a plain causal mask (the row's ``sparse_mode=2`` needs no offsets), an unproven mask, B != 1,
dropout (the varlen op has no ``keep_prob``) and anything :func:`~qwen_npu_compile.npu_ops.varlen_attention.varlen_violation`
refuses (T <= 1M, Nq <= 256, D <= 768, GE dtypes for torchair); the row then fuses the explicit mask.

Limits: the segment count (<= 2048 per call, :data:`~qwen_npu_compile.npu_ops.varlen_attention.MAX_SEGMENTS`)
is data and unknown at compile time; a packing above it raises the op's error at run time (only
possible with T > 2048). SDPA with ``enable_gqa`` and a mask (``TRANSFORMERS_SDPA_FORCE_GQA=1``) and an
activation-checkpointed layer (its region body receives the mask, not the position ids) keep the
explicit mask.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types
import weakref

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.fusion import (
    PatternVariant,
    current_target,
    exact_pattern,
    meta_val,
    node_source,
    region_operands,
    view_key,
    with_parameters,
)
from qwen_npu_compile.npu_ops import varlen_attention as varlen_ops

from . import attention
from .attention_mask import _FULL_FACTORIES, _WHERE_OPS, _constant, _masks_exactly, _mutated_from_outside

aten = torch.ops.aten
log = logging.getLogger(__name__)

#: ``seq_ends_from_positions``' rule for transformers' packed mask: a sequence starts where diff != 1.
RULE = "restart"
#: ``varlen_attention``'s sparse_mode: right-down causal per sequence (Sq == Skv: the same as left-up).
SPARSE_MODE = 3
#: The name a varlen variant gives its mask input (the row's is ``attn_mask``).
PACKED_MASK = "packed_mask"


# --------------------------------------------------------------------------------------------------
# The proof: the mask's subgraph, interpreted.
# --------------------------------------------------------------------------------------------------


class _NotPacked(Exception):
    """The mask subgraph is not (provably) the packed causal mask; the message says why."""


@dataclasses.dataclass(frozen=True)
class _Row:
    """A ``[1, T]`` integer tensor: the graph input ``positions`` itself (``kind="positions"``) or its
    segment ids ``cumsum(diff(positions) != 1)`` (``kind="segments"``)."""

    kind: str
    positions: torch.fx.Node


@dataclasses.dataclass(frozen=True)
class _Grid:
    """An integer tensor whose value is its own index along dim ``end`` (counted from the last dim: -1, -2,
    ...; ``arange(length)`` placed on that dim, every other dim of size 1). Broadcasting aligns trailing
    dims, so the final ``[..., T, T]`` mask's query index is ``end == -2`` and its key index ``end == -1``,
    whatever the ranks on the way (transformers 5.x broadcasts 4-D grids, 4.57's desugared vmap 1-3-D)."""

    end: int
    length: object  # int or SymInt


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """Copies of the position ids along a new leading dim: ``position_ids[None, ...].expand(k, B, -1)``
    (transformers 5.x ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel.forward``: text, temporal, height and
    width ids from one ``[B, T]`` row, k = 4). Every index of the leading dim holds the row itself, so a
    ``select`` on it (the model's ``text_position_ids = position_ids[0]``) gives the row back."""

    row: _Row


@dataclasses.dataclass(frozen=True)
class _At:
    """``row[0, i]`` where i is the index along dim ``end`` (from the last): -2 the query, -1 the key."""

    row: _Row
    end: int


@dataclasses.dataclass(frozen=True)
class _Mask:
    """A 4-D mask, the AND of ``terms`` (``"causal"``: kv <= q; ``"same_sequence"``: seg[q] == seg[kv]);
    no terms = all True. Bool (True = attend), or ``additive`` (0 = attend, a fully masking value else)."""

    terms: frozenset
    additive: bool = False


_CAUSAL, _SAME = "causal", "same_sequence"
_PACKED_TERMS = frozenset({_CAUSAL, _SAME})
_QUERY, _KEY = -2, -1
#: Ops that copy or re-view a mask without changing any value at a (q, kv) position (the final shape is
#: checked separately).
_MASK_KEEPING = (
    aten.alias.default, aten.clone.default, aten.contiguous.default, aten.lift_fresh_copy.default,
    aten.detach.default, aten.expand.default,
)  # fmt: skip
_CASTS = (aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default)
_ANDS = (aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default, aten.mul.Tensor)
_ONES = (aten.ones.default, aten.new_ones.default, aten.ones_like.default)
_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def _value(node):
    return meta_val(node) if isinstance(node, torch.fx.Node) else node


def _equal(a, b) -> bool:
    """Sizes equal on this graph (guarded when symbolic: they hold whenever the mask builds at all)."""
    return guard_or_false(a == b)


class _Interpreter:
    """Abstract interpretation of a mask's ancestors (:func:`packed_mask_reason`)."""

    def __init__(self) -> None:
        self.values: dict[torch.fx.Node, object] = {}
        self.grids: list[_Grid] = []

    def __call__(self, node) -> object:
        if not isinstance(node, torch.fx.Node):
            return node
        if node not in self.values:
            self.values[node] = self._interpret(node)
        return self.values[node]

    # -- one node -----------------------------------------------------------------------------------

    def _interpret(self, node: torch.fx.Node):
        if node.op == "placeholder":
            if region_operands(node):
                raise _NotPacked(
                    f"{node.name} is an input of an activation-checkpointed region's body: the position ids "
                    "live in the calling graph, so the varlen offsets cannot be computed here"
                )
            value = meta_val(node)
            if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point() and (
                value.dtype != torch.bool
            ):
                return _Row("positions", node)
            return self._refuse(node, "a graph input that is not a [B, T] integer tensor (a padding mask, a mask "
                                      "passed in, a float input)")
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return self._refuse(node, f"{node.op} {node.target}")
        target, args = node.target, node.args
        if target is aten.cumsum.default:
            return self._segments(node)
        if target in _ARANGES:
            return self._arange(node)
        if target in (aten.add.Tensor, aten.add_.Tensor) and not isinstance(args[1], torch.fx.Node) and args[1] == 0:
            # q_arange + q_offset with q_offset 0 (no KV cache); 4.57: kv_arange += kv_offset, in place
            source = self(args[0])
            if isinstance(source, _Grid) and node.kwargs.get("alpha", 1) == 1:
                return source
            return self._refuse(node, "an addition that is not `arange + 0`")
        if target in (aten.add.Tensor, aten.sub.Tensor):
            return self._refuse(node, "an index offset or arithmetic on indices (a KV cache, a sliding window)")
        if target is aten.unsqueeze.default:
            return self._unsqueeze(node)
        if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            return self._reshape(node)
        if target is aten.index.Tensor:
            return self._gather(node)
        if target is aten.select.int:
            return self._select(node)
        if target in (aten.le.Tensor, aten.ge.Tensor, aten.eq.Tensor):
            return self._compare(node)
        if target in _ONES or target in _FULL_FACTORIES:
            return self._true(node)
        if target in _ANDS:
            return self._and(node)
        if target in _WHERE_OPS:
            return self._where(node)
        if target in _CASTS or target in _MASK_KEEPING or target is aten.slice.Tensor:
            return self._keep(node)
        return self._refuse(node, str(target))

    def _refuse(self, node, what: str):
        raise _NotPacked(
            f"its subgraph holds {node.name} ({what}) at {node_source(node)}, which is not part of the packed "
            "causal mask transformers builds from position_ids"
        )

    # -- position ids and their segment ids ----------------------------------------------------------

    def _segments(self, node: torch.fx.Node):
        """``cumsum(ne(diff(P, 1, -1, prepend), 1), -1)``: P's segment ids (the prepend's value only shifts
        every id by one constant, so seg[q] == seg[kv] does not depend on it)."""
        source, dim = node.args[0], node.args[1]
        dtype = node.kwargs.get("dtype")
        ne = source if isinstance(source, torch.fx.Node) else None
        if ne is None or ne.target is not aten.ne.Scalar or ne.args[1] != 1 or (
            dtype is not None and (dtype.is_floating_point or dtype == torch.bool)
        ):
            return self._refuse(node, "a cumsum that is not `(diff(position_ids) != 1).cumsum(-1)`")
        diff = ne.args[0]
        if not isinstance(diff, torch.fx.Node) or diff.target is not aten.diff.default:
            return self._refuse(node, "a cumsum that is not `(diff(position_ids) != 1).cumsum(-1)`")
        bound = dict(zip(("self", "n", "dim", "prepend", "append"), diff.args)) | dict(diff.kwargs)
        positions = self(bound["self"])
        prepend = _value(bound.get("prepend"))
        diff_value = meta_val(diff)
        if not isinstance(positions, _Row) or positions.kind != "positions":
            return self._refuse(diff, "a diff of something other than the graph's [B, T] integer input")
        rank = meta_val(positions.positions).dim()
        if (
            bound.get("n", 1) != 1
            or bound.get("dim", -1) % rank != rank - 1
            or dim % rank != rank - 1
            or bound.get("append") is not None
            or not isinstance(prepend, torch.Tensor)
            or prepend.dim() != rank
            or not _equal(prepend.shape[-1], 1)
            or prepend.is_floating_point()
            or diff_value.is_floating_point()
        ):
            return self._refuse(diff, "a diff that is not `torch.diff(position_ids, prepend=<one column>, dim=-1)`")
        return _Row("segments", positions.positions)

    # -- index grids ----------------------------------------------------------------------------------

    def _arange(self, node: torch.fx.Node):
        args = node.args
        if node.target is aten.arange.default:
            start, step = 0, 1
        elif node.target is aten.arange.start:
            start, step = args[0], 1
        else:
            start, step = args[0], args[2]
        value = meta_val(node)
        if start != 0 or step != 1 or value.is_floating_point():
            return self._refuse(node, "an arange that does not count 0, 1, ... in integers")
        grid = _Grid(-1, value.shape[0])  # the size (a SymInt under dynamic shapes), not the argument node
        self.grids.append(grid)
        return grid

    def _moved(self, node: torch.fx.Node, source):
        """A grid or gather after a view that only adds or removes size-1 dims: on the one dim that is not 1."""
        shape = list(meta_val(node).shape)
        length = source.length if isinstance(source, _Grid) else meta_val(source.row.positions).shape[1]
        if _equal(length, 1):
            return dataclasses.replace(source, end=-1)  # one value (index 0): the dim does not matter
        dims = [i for i, size in enumerate(shape) if not statically_known_true(size == 1)]
        if len(dims) == 1 and _equal(shape[dims[0]], length):
            return dataclasses.replace(source, end=dims[0] - len(shape))
        return self._refuse(node, "a view that spreads an index over several dims")

    def _unsqueeze(self, node: torch.fx.Node):
        source = self(node.args[0])
        if isinstance(source, _Row) and source.kind == "positions" and node.args[1] % meta_val(node).dim() == 0:
            return _Stacked(source)  # position_ids[None, ...]: one copy along a new leading dim
        if isinstance(source, (_Grid, _At)):
            return self._moved(node, source)
        if isinstance(source, _Mask):
            rank = meta_val(node).dim()
            if node.args[1] % rank < rank - 2:
                return source
            return self._refuse(node, "an unsqueeze between or after the query and key dims of a mask")
        return self._refuse(node, "an unsqueeze of something other than an index grid")

    def _select(self, node: torch.fx.Node):
        """``stacked[i]`` on the leading dim of :class:`_Stacked` copies of the position ids: the row itself."""
        source = self(node.args[0])
        if isinstance(source, _Stacked) and node.args[1] % meta_val(node.args[0]).dim() == 0:
            return source.row
        return self._refuse(node, "a select that is not one copy of position_ids[None].expand(k, B, -1)")

    def _reshape(self, node: torch.fx.Node):
        """A grid placed on another dim by a view that only adds or removes size-1 dims."""
        source = self(node.args[0])
        shape = list(meta_val(node).shape)
        if isinstance(source, (_Grid, _At)):
            return self._moved(node, source)
        if isinstance(source, _Mask) and not source.terms:
            return source  # all True (4.57's vmapped new_ones): every view of it is all True
        if isinstance(source, _Mask):
            before = list(meta_val(node.args[0]).shape)
            if len(before) >= 2 and len(shape) >= 2 and all(_equal(a, b) for a, b in zip(before[-2:], shape[-2:])):
                return source  # leading dims regrouped (a broadcast mask's values do not depend on them)
        return self._refuse(node, "a view that moves the query or key dim")

    def _gather(self, node: torch.fx.Node):
        """``row[b, i]`` with b = the batch grid (a single 0) and i = the query or key grid (the result has
        the broadcast shape of b and i: i's dim, counted from the last, is the result's)."""
        row, indices = self(node.args[0]), node.args[1]
        if not isinstance(row, _Row) or len(indices) != 2 or any(i is None for i in indices):
            return self._refuse(node, "an index that is not `row[batch_idx, q_idx]` / `row[batch_idx, kv_idx]`")
        batch, position = self(indices[0]), self(indices[1])
        tokens = meta_val(row.positions).shape[1]
        if not isinstance(batch, _Grid) or not isinstance(position, _Grid):
            return self._refuse(node, "an index by something other than index grids")
        if not _equal(batch.length, 1) or not _equal(meta_val(row.positions).shape[0], 1):
            raise _NotPacked(
                f"position_ids {row.positions.name} has batch {meta_val(row.positions).shape[0]}: varlen attention "
                "takes one packed row (B == 1); pack the micro-batch into one row (verl use_remove_padding)"
            )
        if position.end not in (_QUERY, _KEY) or not _equal(position.length, tokens):
            return self._refuse(node, "an index that does not run over all T query or key positions")
        return _At(row, position.end)

    # -- the mask terms --------------------------------------------------------------------------------

    def _compare(self, node: torch.fx.Node):
        left, right = self(node.args[0]), self(node.args[1])
        if node.target is aten.ge.Tensor:
            left, right = right, left  # q >= kv is kv <= q
        if node.target is aten.eq.Tensor:
            pair = {getattr(left, "end", None), getattr(right, "end", None)}
            if (
                isinstance(left, _At) and isinstance(right, _At) and pair == {_QUERY, _KEY}
                and left.row == right.row and left.row.kind == "segments"
            ):
                return _Mask(frozenset({_SAME}))
            return self._refuse(node, "an equality that is not seg[q] == seg[kv] of the packed segment ids")
        # kv <= q, over the indices (4.57, 5.10) or the positions' values (5.24: equal within a segment)
        if isinstance(left, _Grid) and isinstance(right, _Grid) and (left.end, right.end) == (_KEY, _QUERY):
            return _Mask(frozenset({_CAUSAL}))
        if isinstance(left, _At) and isinstance(right, _At) and left.row == right.row:
            if left.row.kind == "positions" and (left.end, right.end) == (_KEY, _QUERY):
                return _Mask(frozenset({_CAUSAL}))
        return self._refuse(node, "a comparison that is not kv <= q")

    def _true(self, node: torch.fx.Node):
        value = meta_val(node)
        fill = True
        if node.target in _FULL_FACTORIES:
            index = _FULL_FACTORIES[node.target]
            fill = node.args[index] if len(node.args) > index else node.kwargs.get("fill_value")
        if value.dtype == torch.bool and fill in (True, 1):
            return _Mask(frozenset())
        return self._refuse(node, "a constant that is not an all-True bool tensor")

    def _and(self, node: torch.fx.Node):
        left, right = self(node.args[0]), self(node.args[1])
        if (
            isinstance(left, _Mask) and isinstance(right, _Mask) and not left.additive and not right.additive
            and meta_val(node).dtype == torch.bool
        ):
            return _Mask(left.terms | right.terms)
        return self._refuse(node, "an AND (or product) of something other than two bool masks")

    def _where(self, node: torch.fx.Node):
        """transformers' eager_mask: ``where(mask, 0, finfo(dtype).min)`` (0 = attend)."""
        condition = self(node.args[0])
        if not isinstance(condition, _Mask) or condition.additive:
            return self._refuse(node, "a where() whose condition is not a bool mask")
        attend, masked = _constant(node.args[1]), _constant(node.args[2])
        if attend == 0 and masked is not None and _masks_exactly(masked):
            return _Mask(condition.terms, additive=True)
        return self._refuse(node, "a where() that is not where(mask, 0, finfo.min)")

    def _keep(self, node: torch.fx.Node):
        source = self(node.args[0])
        value, before = meta_val(node), meta_val(node.args[0])
        if isinstance(source, _Grid) and node.target is aten.slice.Tensor:
            start, step = (node.args[2] if len(node.args) > 2 else 0), (node.args[4] if len(node.args) > 4 else 1)
            if start in (0, None) and step == 1 and all(_equal(a, b) for a, b in zip(value.shape, before.shape)):
                return source  # a full slice ([:, :, None] on a symbolic dim)
            return self._refuse(node, "a slice of an index grid that drops indices")
        if isinstance(source, _Grid):
            if value.dim() == before.dim() and not value.is_floating_point() and value.dtype != torch.bool:
                return source  # an index grid copied, cast between integer types or broadcast
            return self._refuse(node, "a copy of an index grid that changes it")
        if isinstance(source, _Stacked):  # the copies broadcast along the leading dim only
            same = node.target in (aten.expand.default, aten.alias.default, aten.clone.default, aten.contiguous.default)
            if same and value.dim() == before.dim() and all(_equal(a, b) for a, b in zip(value.shape[1:], before.shape[1:])):
                return source
            return self._refuse(node, "a copy of the stacked position ids that changes them")
        if not isinstance(source, (_Mask, _Row)):
            return self._refuse(node, "a copy or view of something other than a mask or the position ids")
        if node.target is aten.slice.Tensor:
            dim, start = node.args[1] if len(node.args) > 1 else 0, node.args[2] if len(node.args) > 2 else 0
            step = node.args[4] if len(node.args) > 4 else 1
            if start not in (0, None) or step != 1 or not _equal(value.shape[dim], before.shape[dim]):
                return self._refuse(node, "a slice that drops part of the mask")
            return source
        if isinstance(source, _Row):  # position_ids.expand(B, -1) with B == 1: the same tensor
            same = node.target in (aten.expand.default, aten.alias.default, aten.clone.default, aten.contiguous.default)
            if same and value.dim() == 2 and all(_equal(a, b) for a, b in zip(value.shape, before.shape)):
                return source
            return self._refuse(node, "a copy of the position ids that changes them")
        if node.target in _CASTS:
            if value.dtype != before.dtype and not (source.additive and value.is_floating_point()):
                return self._refuse(node, f"a cast of a mask from {before.dtype} to {value.dtype}")
        return source


@dataclasses.dataclass(frozen=True)
class PackedMask:
    """A mask proven to be the packed causal mask of ``positions`` (the graph input ``[1, T]``)."""

    positions: torch.fx.Node
    tokens: object  # T: int or SymInt


#: Per graph object (weakly): ``{repr(view_key(mask)): PackedMask | reason}``, so a mask shared by every
#: layer is proven once per graph (a copy of the graph is proven afresh).
_PROOFS: weakref.WeakKeyDictionary[torch.fx.Graph, dict[str, PackedMask | str]] = weakref.WeakKeyDictionary()


def packed_mask(mask: torch.fx.Node) -> PackedMask | str:
    """The proof for the attention mask ``mask``: a :class:`PackedMask` when it is exactly the packed causal
    mask of a ``[1, T]`` integer graph input by the ``"restart"`` rule (module docstring), else the reason
    it is not (one line). Cached per graph; logged at DEBUG.

    Args:
        mask: the attention's mask node: SDPA's bool mask (True = attend) or eager's additive mask.
    """
    proofs = _PROOFS.setdefault(mask.graph, {})
    key = repr(view_key(mask))
    if key not in proofs:
        start = time.perf_counter()
        proofs[key] = _prove(mask)
        result = proofs[key]
        log.debug(
            "qwen_npu: attention mask %s (%s) %s (%.3fs)", mask.name, node_source(mask),
            f"is the packed causal mask of {result.positions.name}: varlen attention" if isinstance(result, PackedMask)
            else f"is not proven packed: {result}", time.perf_counter() - start,
        )  # fmt: skip
    return proofs[key]


def packed_mask_reason(mask: torch.fx.Node) -> str | None:
    """Why ``mask`` is not provably the packed causal mask of the graph's position ids, or None when it is
    (:func:`packed_mask`)."""
    result = packed_mask(mask)
    return None if isinstance(result, PackedMask) else result


def _prove(mask: torch.fx.Node) -> PackedMask | str:
    interpreter = _Interpreter()
    try:
        value = interpreter(mask)
    except _NotPacked as exc:
        return f"mask {mask.name}: {exc}"
    if not isinstance(value, _Mask) or value.terms != _PACKED_TERMS:
        terms = sorted(value.terms) if isinstance(value, _Mask) else type(value).__name__
        return f"mask {mask.name} is {terms}, not the AND of causal and same-sequence (the packed causal mask)"
    rows = {v for v in interpreter.values.values() if isinstance(v, _Row)}
    positions = {row.positions for row in rows}
    if len(positions) != 1:
        return f"mask {mask.name} reads {len(positions)} graph inputs as position ids; one is needed"
    (source,) = positions
    tokens = meta_val(source).shape[1]
    shape = list(meta_val(mask).shape)
    if len(shape) != 4 or not all(_equal(a, b) for a, b in zip(shape, (1, 1, tokens, tokens))):
        return f"mask {mask.name} of shape {shape} is not [1, 1, T, T] with T = {tokens} (position ids {source.name})"
    for grid in interpreter.grids:
        if not (_equal(grid.length, tokens) or _equal(grid.length, 1)):
            return f"mask {mask.name} indexes {grid.length} positions of {tokens} (a KV cache or a sliced mask)"
    nodes = set(interpreter.values) | _all_ancestors(mask)
    mutator = _mutated_from_outside(nodes)
    if mutator is not None:
        return f"mask {mask.name}'s subgraph (or the position ids) is written in place by {mutator.name} ({mutator.target})"
    return PackedMask(source, tokens)


def _all_ancestors(node: torch.fx.Node) -> set:
    seen, stack = {node}, [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen


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
    return (bsnd if attention._dense_bsnd(t) else bsnd.contiguous()).squeeze(0)


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
    first: dict[torch.fx.Node, torch.fx.Node] = {}
    removed = 0
    for node in list(graph.find_nodes(op="call_function", target=varlen_ops.SEQ_ENDS_OP)):
        if node.args[1] != RULE or not any(user.target is varlen_ops.OP for user in node.users):
            continue
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and source.op == "placeholder":
            positions = source
        else:
            proof = _stand_in_mask(source, proofs)
            if proof is None:
                continue  # not ours: exact as it is
            positions = proof.positions
        if positions not in first:
            node.update_arg(0, positions)
            if placeholders:
                placeholders[-1].append(node)
            first[positions] = node
            continue
        node.replace_all_uses_with(first[positions])
        graph.erase_node(node)
        removed += 1
    return removed


# --------------------------------------------------------------------------------------------------
# The variants.
# --------------------------------------------------------------------------------------------------


def _takes_packed_mask(row: attention.Spelling) -> bool:
    """Rows a packed whole-model graph shows: SDPA with a mask and no dropout (K/V repeated or MHA) and
    every eager row (the varlen op has no dropout; ``enable_gqa`` with a mask needs an env override)."""
    if row.impl == "sdpa":
        return row.mask == "mask" and not row.dropout and row.kv != "gqa"
    return True


#: The attention rows that get a varlen variant (:func:`varlen_variants`), in the table's order.
VARLEN_ROWS: tuple[attention.Spelling, ...] = tuple(row for row in attention.SPELLINGS if _takes_packed_mask(row))


def variant_name(row: attention.Spelling) -> str:
    return f"varlen_{row.name}"


def _parameters(row: attention.Spelling) -> tuple[str, ...]:
    return tuple(PACKED_MASK if name == "attn_mask" else name for name in row.parameters)


def _check_fn(row: attention.Spelling):
    row_check = attention._check_fn(row)

    def check(match) -> str | None:
        kwargs = dict(match.kwargs)
        mask_node = kwargs.pop(PACKED_MASK)
        # the row's own check first (its refusal is the one recorded when nothing fuses)
        reason = row_check(types.SimpleNamespace(kwargs={**kwargs, "attn_mask": mask_node}, nodes=match.nodes))
        if reason is not None:
            return reason
        if attention._CAUSAL_MASK.get():
            return "the mask is the plain causal mask: the row fuses it with sparse_mode=2, no offsets needed"
        if not isinstance(mask_node, torch.fx.Node):
            return "no mask node"
        proof = packed_mask(mask_node)
        if not isinstance(proof, PackedMask):
            return f"explicit mask kept: {proof}"
        q, k, v = (meta_val(kwargs[name]) for name in ("query", "key", "value"))
        cast = attention._AUTOCAST_DTYPE.get()
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


def _replace_fn(row: attention.Spelling):
    def replace(query, key, value, packed_mask, scale, dropout_p=0.0):
        query, key, value = attention._autocast_cast(query, key, value)
        return varlen_packed_attention(query, key, value, packed_mask, scale=attention._scale_for(scale))

    return with_parameters(replace, _parameters(row))


def _variant(row: attention.Spelling) -> PatternVariant:
    """The varlen variant of ``row``: the row's search (its mask input renamed), check, varlen replacement."""
    row_search = attention._search_fn(row)
    names = _parameters(row)
    search_fn = with_parameters(lambda **inputs: row_search(*inputs.values()), names)
    search_fn.__name__ = search_fn.__qualname__ = f"varlen_{row.name}_search"
    examples = attention._examples(row)
    magic = {"scale": attention._SCALE, "dropout_p": attention._DROPOUT_P}
    scalar_workaround = {name: value for name, value in magic.items() if name in names}
    return PatternVariant(
        name=variant_name(row),
        search_fn=search_fn,
        replace_fn=_replace_fn(row),
        example_inputs=examples,
        check=_check_fn(row),
        scalar_workaround=scalar_workaround,
        why=f"{row.why}, packed sequences (position_ids restarting, no attention_mask): varlen attention",
        search_fn_pattern=lambda: exact_pattern(search_fn, examples(), scalar_workaround),
        anchor_ops=row.anchor_ops,
    )


def varlen_variants() -> list[PatternVariant]:
    """One varlen variant per row of :data:`VARLEN_ROWS`; the attention family yields them before its rows."""
    return [_variant(row) for row in VARLEN_ROWS]


__all__ = [
    "PACKED_MASK", "RULE", "SPARSE_MODE", "VARLEN_ROWS", "PackedMask", "packed_mask", "packed_mask_reason",
    "share_seq_ends", "variant_name", "varlen_packed_attention", "varlen_variants",
]
