"""A whole-model graph of a row packed by ``position_ids``: the Gated DeltaNet per sequence, from attention's
packing proof. Imports :mod:`.attention.packed` (the proof) and the op modules.

``torch.compile(model)`` of a Qwen3.5 given one row whose ``position_ids`` restart per sequence (verl's
``use_remove_padding`` layout, no ``attention_mask``, no ``cu_seq_lens_q``): transformers 5.24 builds the
packed causal mask for attention inside the graph, but its DeltaNet gets no offsets (``Qwen3_5DecoderLayer``
hands ``position_ids`` to attention only), so Dynamo's substitution traces the op with ``cu_seqlens=None`` and
the causal conv over the whole row: the sequences merged, as eager transformers runs them (an upstream
defect), while attention runs per sequence. This pass gives the DeltaNet the semantics attention has.

FX before (per DeltaNet layer; ``expand_2`` the SDPA mask that :func:`.attention.packed.packed_mask` proves to
be the packed causal mask of the placeholder ``position_ids`` ``[1, T]``)::

    conv1d = aten.conv1d.default(x, w, b, [1], [K - 1], [1], C)    # x [1, C, T], w [C, 1, K]: depthwise, causal
    slice_11 = aten.slice.Tensor(conv1d, 2, 0, T)
    ...
    chunk_gated_delta_rule = qwen_npu.chunk_gated_delta_rule.default(q, k, v, g, beta, None, None, scale, True)

FX after (the offsets and the conv masks once per graph, right after the placeholders)::

    seq_ends = qwen_npu.seq_ends_from_positions.default(position_ids, 'restart')   # int64 CPU [N]
    cu_seqlens = aten.cat.default([aten.new_zeros.default(seq_ends, [1]), seq_ends])  # [N + 1], from 0
    seg = cumsum(ne(diff(position_ids, prepend=position_ids[:, :1] - 1), 1), -1) # segment id per token
    keep_s = eq(seg, cat([full([1, s], -1), seg], 1)[:, :-s])[:, None].float()   # s = 1 .. K-1: tap in sequence
    ...
    padded = cat([zeros([1, C, K - 1]), x.float()], 2)
    out = b.float()[:, None] + sum_j w.float()[:, :, j] * padded[..., j:j + T] * keep_{K-1-j}   # .to(x.dtype)
    chunk_gated_delta_rule = qwen_npu.chunk_gated_delta_rule.default(q, k, v, g, beta, cu_seqlens, None, scale, True)

The conv is :func:`qwen_npu_compile.substitutions.deltanet.packed_causal_conv1d`'s arithmetic (the same taps,
fp32 accumulation, rounded once to ``x``'s dtype) before the model's own activation; the keep masks are
"no sequence start within the last ``s`` tokens", by the ``"restart"`` rule the proof establishes (a sequence
starts where ``diff(position_ids) != 1``: transformers' ``find_packed_sequence_indices``), so conv, delta rule
and attention split the row alike. The offsets are data: a new packing is neither a new graph nor a break.

Applies only when the graph holds a proven packed mask (every SDPA mask the graph has is tried) over the same
``[1, T]`` row as the op's operands; nothing else is touched (plain batches, a padding mask, an explicit mask
passed in, no ``position_ids``: no proof). Position ids that do not restart give one sequence: eager's result.
A proven packed graph whose DeltaNet is not recognised exactly (the op already given offsets is left as it is;
an initial state, a batch above 1, not the op's own ``[1, T]`` row, no or several convs feeding q/k/v, a conv
that is not the depthwise causal ``padding = K - 1`` conv sliced back to ``T``) is refused with the reason
recorded on the op (``check``/``strict`` list it): that row then runs as one sequence, as eager.

Eager differs by design (one warning per process: :func:`~qwen_npu_compile.substitutions.deltanet.warn_eager_differs`).
Not covered: flash_attention_2 (no mask in the graph to prove: transformers derives FA2's offsets with
``.item()`` outside it; ``maybe_compile``'s pre-hook covers that path), a DeltaNet inside an
activation-checkpointed region (the region's body holds no proof), transformers' eager attention rows.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

from qwen_npu_compile.fusion.family import meta_val
from qwen_npu_compile.graph.utils import node_source
from qwen_npu_compile.ops.qwen_npu import varlen_attention as varlen_ops
from qwen_npu_compile.substitutions import deltanet

from .attention.packed import RULE, PackedMask, _equal, packed_mask

aten = torch.ops.aten
log = logging.getLogger("qwen_npu_compile")

OP = torch.ops.qwen_npu.chunk_gated_delta_rule.default
#: Ops between the conv and the delta rule's q / k / v that keep the conv's values (walked back from the op).
_THROUGH = frozenset({
    aten.silu.default, aten.transpose.int, aten.split_with_sizes.default, aten.split.Tensor, operator.getitem,
    aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.repeat_interleave.self_int,
    aten.contiguous.default, aten.clone.default, aten.to.dtype, aten._to_copy.default, aten.unsqueeze.default,
    aten.expand.default, aten.slice.Tensor,
    # transformers 5.25 splits q/k/v/g/beta with torch.tensor_split(x, [T - n_keep], 1) around the chunked call (the
    # last n_keep tokens go to the recurrent kernel for a cache; n_keep = 0 in training): the op's own check that q
    # holds the proof's T tokens refuses the prefix of a cached call
    aten.tensor_split.indices, aten.tensor_split.sections, aten.tensor_split.tensor_indices_or_sections,
})
_CONVS = (aten.conv1d.default,)


@dataclasses.dataclass(frozen=True)
class _Plan:
    op: torch.fx.Node
    conv: torch.fx.Node
    sliced: torch.fx.Node  # the conv's slice back to T


def packed_row_proof(graph: torch.fx.Graph) -> PackedMask | str:
    """The packing proof of ``graph``: the :class:`PackedMask` of its SDPA masks (one ``position_ids`` input for
    all that are proven), else why there is none."""
    masks = []
    for node in graph.find_nodes(op="call_function", target=aten.scaled_dot_product_attention.default):
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, torch.fx.Node) and mask not in masks:
            masks.append(mask)
    if not masks:
        return "no attention mask in this graph to prove packed"
    proofs = [packed_mask(mask) for mask in masks]
    proven = [proof for proof in proofs if isinstance(proof, PackedMask)]
    if not proven:
        return proofs[0]
    if len({proof.positions for proof in proven}) != 1:
        return "the attention masks are proven packed over different position_ids inputs"
    return proven[0]


def _conv_of(op: torch.fx.Node) -> torch.fx.Node | str:
    """The one conv whose values reach q, k and v of ``op`` through value-keeping ops only."""
    found = set()
    for operand in op.args[:3]:
        seen, stack, convs = set(), [operand], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, torch.fx.Node) or node in seen:
                continue
            seen.add(node)
            if node.target in _CONVS:
                convs.add(node)
            elif node.op == "call_function" and node.target in _THROUGH:
                stack.extend(node.all_input_nodes)
        if len(convs) != 1:
            return f"{len(convs)} convs feed {getattr(operand, 'name', operand)} (one depthwise causal conv expected)"
        found |= convs
    if len(found) != 1:
        return "q, k and v come from different convs"
    return found.pop()


def _plan(op: torch.fx.Node, proof: PackedMask) -> _Plan | str:
    """What to rewrite for ``op`` (its conv), or why its DeltaNet is not recognised exactly."""
    query = meta_val(op.args[0])
    if len(op.args) > 6 and op.args[6] is not None:
        return "an initial state is passed (a cache)"
    if not isinstance(query, torch.Tensor) or query.dim() != 4 or not _equal(query.shape[0], 1):
        return f"q {list(getattr(query, 'shape', []))} is not one packed row [1, T, H, K]"
    if not _equal(query.shape[1], proof.tokens):
        return f"q's {query.shape[1]} tokens are not the {proof.tokens} tokens of {proof.positions.name}"
    conv = _conv_of(op)
    if isinstance(conv, str):
        return conv
    bound = dict(zip(("input", "weight", "bias", "stride", "padding", "dilation", "groups"), conv.args))
    bound.update(conv.kwargs)
    x, w = meta_val(bound["input"]), meta_val(bound["weight"])
    bias = meta_val(bound.get("bias"))
    taps = w.shape[-1] if isinstance(w, torch.Tensor) and w.dim() == 3 else None
    channels = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 3 else None
    if (taps is None or channels is None or not isinstance(taps, int) or taps < 1 or x.dtype != w.dtype
            or not x.is_floating_point() or not _equal(x.shape[0], 1) or not _equal(x.shape[2], proof.tokens)
            or not _equal(w.shape[0], channels) or w.shape[1] != 1 or bound.get("groups", 1) != channels
            or list(bound.get("stride", [1])) != [1] or list(bound.get("dilation", [1])) != [1]
            or list(bound.get("padding", [0])) != [taps - 1]
            or (bias is not None and (bias.dim() != 1 or bias.dtype != x.dtype))):
        return (f"conv {conv.name} ({node_source(conv)}) is not the depthwise causal conv [1, C, T] * [C, 1, K] "
                "with padding K - 1")
    users = list(conv.users)
    sliced = users[0] if len(users) == 1 else None
    if (sliced is None or sliced.target is not aten.slice.Tensor or tuple(sliced.args[1:2]) != (2,)
            or (sliced.args[2] if len(sliced.args) > 2 else 0) not in (0, None)
            or (sliced.args[4] if len(sliced.args) > 4 else 1) != 1
            or not _equal(meta_val(sliced).shape[2], x.shape[2])):
        return f"conv {conv.name}'s output is not sliced back to its first T tokens (and used only so)"
    return _Plan(op, conv, sliced)


class _Emitter:
    """Inserts ATen calls with their FakeTensor ``meta["val"]`` (computed in the graph's fake mode)."""

    def __init__(self, graph: torch.fx.Graph, fake_mode, meta_from: torch.fx.Node) -> None:
        self.graph, self.fake_mode, self.meta_from = graph, fake_mode, meta_from

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        values = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*values[0], **values[1])
        shape_env = self.fake_mode.shape_env
        if shape_env is not None:  # claim the op's new unbacked size (seq_ends' N), as Inductor's replacements do
            bindings = compute_unbacked_bindings(shape_env, node.meta["val"])
            if bindings:
                node.meta["unbacked_bindings"] = bindings
        for key in ("stack_trace", "nn_module_stack"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        return node


def _shared(emit: _Emitter, positions: torch.fx.Node, taps: set[int], device) -> tuple[torch.fx.Node, dict]:
    """``cu_seqlens`` ``[N + 1]`` and, per shift s in 1 .. K-1, the fp32 keep mask ``[1, 1, T]``."""
    ends = emit(varlen_ops.SEQ_ENDS_OP, positions, RULE)
    offsets = emit(aten.cat.default, [emit(aten.new_zeros.default, ends, [1]), ends])
    if torch.device(device).type != "cpu":
        offsets = emit(aten._to_copy.default, offsets, device=device)
    row = positions if meta_val(positions).dtype == torch.int64 else emit(aten.to.dtype, positions, torch.int64)
    before = emit(aten.sub.Tensor, emit(aten.slice.Tensor, row, 1, 0, 1), 1)
    segments = emit(aten.cumsum.default, emit(aten.ne.Scalar, emit(aten.diff.default, row, 1, -1, before), 1), -1)
    keep = {}
    for shift in range(1, max(taps)):
        # cat, not constant_pad_nd: the latter's fake kernel specialises a symbolic T (a recompile per packing)
        padded = emit(aten.cat.default, [emit(aten.new_full.default, segments, [1, shift], -1), segments], 1)
        earlier = emit(aten.slice.Tensor, padded, 1, 0, -shift)
        same = emit(aten.unsqueeze.default, emit(aten.eq.Tensor, segments, earlier), 1)
        keep[shift] = emit(aten.to.dtype, same, torch.float32)
    return offsets, keep


def _packed_conv(emit: _Emitter, plan: _Plan, keep: dict) -> torch.fx.Node:
    """``packed_causal_conv1d``'s taps before the activation: ``[1, C, T]`` in x's dtype."""
    x, weight = plan.conv.args[0], plan.conv.args[1]
    bias = plan.conv.args[2] if len(plan.conv.args) > 2 else plan.conv.kwargs.get("bias")
    dtype = meta_val(x).dtype
    taps = meta_val(weight).shape[-1]

    def fp32(node):
        return node if meta_val(node).dtype == torch.float32 else emit(aten.to.dtype, node, torch.float32)

    x = fp32(x)
    padded = emit(aten.cat.default, [emit(aten.new_zeros.default, x, [1, meta_val(x).shape[1], taps - 1]), x], 2)
    weight = fp32(weight)
    out = None if bias is None else emit(aten.unsqueeze.default, fp32(bias), -1)
    for j in range(taps):
        shift = taps - 1 - j
        tap = emit(aten.slice.Tensor, padded, 2, j, -shift if shift else None)
        if shift:
            tap = emit(aten.mul.Tensor, tap, keep[shift])
        term = emit(aten.mul.Tensor, emit(aten.select.int, weight, 2, j), tap)
        out = term if out is None else emit(aten.add.Tensor, out, term)
    return out if dtype == torch.float32 else emit(aten.to.dtype, out, dtype)


def rewrite_packed_rows(gm: torch.fx.GraphModule, refuse) -> int:
    """Give every ``qwen_npu.chunk_gated_delta_rule`` without offsets in ``gm`` the sequence ends of the graph's
    packing proof, and its conv the per-sequence taps (module docstring). In place.

    Args:
        gm: the pre-dispatch ATen graph of the fuse stage (FakeTensor ``meta["val"]`` on every node).
        refuse: ``refuse(node, reason)``, called for an op of a proven packed graph that is not rewritten.

    Returns:
        The number of DeltaNet layers rewritten (their ops are counted by the family as before).
    """
    graph = gm.graph
    ops = [node for node in graph.find_nodes(op="call_function", target=OP)
           if len(node.args) > 5 and node.args[5] is None]
    if not ops:
        return 0
    proof = packed_row_proof(graph)
    if not isinstance(proof, PackedMask):
        log.debug("qwen_npu: the Gated DeltaNet runs its row as one sequence in this graph: %s", proof)
        return 0
    plans = []
    for op in ops:
        plan = _plan(op, proof)
        if isinstance(plan, str):
            refuse(op, f"the row is packed (position_ids {proof.positions.name} restart per sequence; attention runs "
                       f"per sequence) but this DeltaNet keeps running it as one sequence: {plan}")
        else:
            plans.append(plan)
    if not plans:
        return 0
    fake_mode = torch._guards.detect_fake_mode([meta_val(plans[0].op.args[0])])
    first = next(node for node in graph.nodes if node.op != "placeholder")
    with graph.inserting_before(first):
        offsets, keep = _shared(_Emitter(graph, fake_mode, plans[0].op), proof.positions,
                                {meta_val(plan.conv.args[1]).shape[-1] for plan in plans},
                                meta_val(plans[0].op.args[0]).device)
    for plan in plans:
        with graph.inserting_before(plan.sliced):
            conv = _packed_conv(_Emitter(graph, fake_mode, plan.sliced), plan, keep)
        plan.sliced.replace_all_uses_with(conv)
        graph.erase_node(plan.sliced)
        graph.erase_node(plan.conv)
        plan.op.update_arg(5, offsets)
        values = torch.fx.node.map_arg((plan.op.args, plan.op.kwargs), lambda n: n.meta["val"])
        with fake_mode:
            plan.op.meta["val"] = OP(*values[0], **values[1])
        for user in plan.op.users:
            if user.target is operator.getitem:
                user.meta["val"] = plan.op.meta["val"][user.args[1]]
        deltanet.warn_eager_differs_for_positions(plan.op.meta.get("stack_trace") or "")
    log.info("qwen_npu: %d Gated DeltaNet layer(s) run the packed row of %s per sequence (the offsets and the "
             "per-sequence conv from attention's packing proof)", len(plans), proof.positions.name)
    return len(plans)
