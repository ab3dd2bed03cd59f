"""The proof that an attention mask is the packed causal mask of the graph's position ids (for :mod:`.varlen`).
Imports :mod:`.masks` only, of the attention family.
Packed sequences: an attention mask proven to be the packed causal mask of the graph's position ids
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
:mod:`qwen_npu_compile.graph.canonicalize` desugars into plain ATen ops.) Every layer's attention reads that
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
reason logged (logger ``qwen_npu_compile.patterns.attention.varlen``, DEBUG) and queryable per mask
(:func:`packed_mask_reason`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.compat import guard_or_false
from qwen_npu_compile.fusion.family import meta_val, region_operands, view_key
from qwen_npu_compile.graph.utils import ancestors, node_source

from .masks import _FULL_FACTORIES, _WHERE_OPS, _constant, _masks_exactly, _mutated_from_outside

aten = torch.ops.aten
log = logging.getLogger(__name__)

#: ``seq_ends_from_positions``' rule for transformers' packed mask: a sequence starts where diff != 1.
RULE = "restart"


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
    nodes = set(interpreter.values) | ancestors(mask)
    mutator = _mutated_from_outside(nodes)
    if mutator is not None:
        return f"mask {mask.name}'s subgraph (or the position ids) is written in place by {mutator.name} ({mutator.target})"
    return PackedMask(source, tokens)

