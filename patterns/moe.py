"""MoE experts (Qwen3-MoE, Qwen2-MoE) -> ``qwen_npu::grouped_matmul`` over ``npu_grouped_matmul``.

Mirrors transformers 5.x (checked on 5.24.0) ``integrations/moe.py`` ``grouped_mm_experts_forward``, the
default ``experts_implementation`` (``"grouped_mm"``) of ``Qwen3MoeExperts`` / ``Qwen2MoeExperts``
(``gate_up_proj [E, 2I, H]``, gate rows first; ``down_proj [E, H, I]``)::

    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))               # S = T·k routed rows
    x_g = hidden_states[perm // k]
    offsets = torch.cumsum(torch.histc(expert_ids_g.float(), E, 0, E - 1), 0, dtype=torch.int32)
    gate_up = _grouped_mm(x_g, gate_up_proj.transpose(-2, -1), offs=offsets)   # [S, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    h = act_fn(gate) * up                                                   # SiLU
    out = _grouped_mm(h, down_proj.transpose(-2, -1), offs=offsets)         # [S, H]
    ...  # * top-k weight, inverse permutation, sum over k

``_grouped_mm`` is ``aten._grouped_mm`` in bf16 graphs and ``torch.ops.transformers.grouped_mm_fallback``
(a custom op with a per-expert loop) in fp32/fp16 graphs under Dynamo. FX before (pre-dispatch ATen)::

    _grouped_mm = aten._grouped_mm.default(index, transpose_4, cumsum)        # i32 offsets
    chunk = aten.chunk.default(_grouped_mm, 2, -1)
    silu = aten.silu.default(chunk[0])
    mul_15 = aten.mul.Tensor(silu, chunk[1])
    _grouped_mm_1 = aten._grouped_mm.default(mul_15, transpose_5, cumsum)

FX after (the pattern emits ``offs.to(torch.int64)``; :func:`rewrite_routing` then replaces the histc offsets)::

    arange = aten.arange.default(4, dtype=torch.int64)
    searchsorted = aten.searchsorted.Tensor(sort_values, arange, right=True)           # int64 [E] ends
    index_select = aten.index_select.default(view_3, 0, floor_divide)                  # was index.Tensor
    grouped_matmul = qwen_npu.grouped_matmul.default(index_select, transpose_4, searchsorted)  # [S, 2I]
    npu_swiglu = npu.npu_swiglu.default(grouped_matmul, -1)                            # gate = first half, no cat
    grouped_matmul_1 = qwen_npu.grouped_matmul.default(npu_swiglu, transpose_5, searchsorted)
    scatter = aten.scatter.src(empty_like, 0, sort_indices, arange_1)                  # was index_put_

``npu_swiglu`` reads the grouped matmul's contiguous ``[S, 2I]`` output directly: the ``cat([gate, up])``
copy (``[S, 2I]``, also saved for backward) that the swiglu family's ``silu(gate) * up`` variants would
add is gone. Backward: :mod:`qwen_npu_compile.ops.qwen_npu.grouped_matmul` (dx and dW as
``npu_grouped_matmul``, group_type 0 and 2). Counted: one fusion per grouped matmul, 2 per MoE layer.

Limits: :func:`~qwen_npu_compile.ops.torch_npu.grouped_matmul.grouped_matmul_violation` (int64 group_list,
<= 1024 experts, InnerLimit 65536, with M too for training graphs) and
:func:`~qwen_npu_compile.ops.torch_npu.swiglu.swiglu_violation`. The offsets HF computes always end at S (every
routed row has an expert id in ``[0, E)``), which the kernel requires.

Not covered: transformers 4.57's experts (an ``nn.ModuleList`` looped over with ``nonzero``/``.item()``:
graph breaks; one warning, :func:`warn_loop_experts`), ``experts_implementation="eager"``/``"batched_mm"``, and
verl's ``npu_patch`` MoE block (its ``npu_grouped_matmul`` calls arrive already fused).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch

from qwen_npu_compile.fusion.family import (
    EMITTED_BY,
    FamilyPass,
    FusionFamily,
    PatternVariant,
    graph_needs_autograd,
    meta_val,
)
from qwen_npu_compile.graph.utils import node_source
from qwen_npu_compile.ops.qwen_npu import grouped_matmul as gmm
from qwen_npu_compile.ops.torch_npu.grouped_matmul import GROUP_LIST_DTYPE, grouped_matmul_violation
from qwen_npu_compile.ops.torch_npu.swiglu import swiglu_violation

aten = torch.ops.aten
log = logging.getLogger(__name__)

#: transformers model types whose sparse layers hold ``@use_experts_implementation`` experts (tf >= 5).
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
#: MoE models whose sparse block adds a shared expert (an MLP, SwiGLU) under a sigmoid gate: transformers
#: ``Qwen2MoeSparseMoeBlock``, ``Qwen3NextSparseMoeBlock``, ``Qwen3_5MoeSparseMoeBlock`` (5.24)
SHARED_EXPERT_MODEL_TYPES = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
#: MoE models whose every decoder layer is sparse (no ``decoder_sparse_step`` / ``mlp_only_layers``):
#: transformers 5.24 ``Qwen3_5MoeDecoderLayer``
ALL_SPARSE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
#: The ``experts_implementation`` values whose graph this family fuses (None: transformers' default, grouped_mm).
FUSED_IMPLEMENTATIONS = (None, "grouped_mm")


def _fallback_op():
    """``torch.ops.transformers.grouped_mm_fallback.default`` when transformers registered it, else None."""
    namespace = getattr(torch.ops, "transformers", None)
    packet = getattr(namespace, "grouped_mm_fallback", None) if namespace is not None else None
    return getattr(packet, "default", None)


def _search_aten(x, weight, offs):
    return torch._grouped_mm(x, weight, offs=offs)


def _search_aten_swiglu(x, weight, offs):
    gate, up = torch._grouped_mm(x, weight, offs=offs).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _search_fallback(x, weight, offs):
    return _fallback_op()(x, weight, offs)


def _search_fallback_swiglu(x, weight, offs):
    gate, up = _fallback_op()(x, weight, offs).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _replace(x, weight, offs):
    return gmm.OP(x, weight, offs.to(GROUP_LIST_DTYPE))


def _replace_swiglu(x, weight, offs):
    return torch.ops.npu.npu_swiglu.default(gmm.OP(x, weight, offs.to(GROUP_LIST_DTYPE)), -1)


def check_grouped_mm(x, weight, offs, *, swiglu: bool, training: bool) -> str | None:
    """Refusal reason for replacing ``_grouped_mm(x, weight, offs)`` (and, with ``swiglu``, the
    ``silu(gate) * up`` of its output's two halves) by ``grouped_matmul`` (``npu_swiglu``), or None.

    Args:
        x: ``[S, K]`` routed rows sorted by expert; weight: ``[E, K, N]``; offs: int32/int64 ``[E]``
            cumulative ends (FakeTensors; sizes may be symbolic).
        swiglu: the match includes the experts' activation (N = 2I, gate first).
        training: the graph needs autograd (the backward's limits apply too).
    """
    if not isinstance(offs, torch.Tensor) or offs.dtype not in (torch.int32, torch.int64):
        return f"offs must be an int32/int64 tensor, got {getattr(offs, 'dtype', offs)}"
    reason = grouped_matmul_violation(x, weight, offs.new_empty(offs.shape, dtype=GROUP_LIST_DTYPE),
                                          backward=training)
    if reason is not None or not swiglu:
        return reason
    return swiglu_violation(x.new_empty((x.shape[0], weight.shape[2])), -1)


def _check_fn(swiglu: bool):
    def check(match) -> str | None:
        graph = match.ctx.graph
        return check_grouped_mm(*(meta_val(match.kwargs[name]) for name in ("x", "weight", "offs")),
                                swiglu=swiglu, training=graph_needs_autograd(graph))

    return check


def _examples():
    return [torch.empty(8, 16), torch.empty(4, 16, 32), torch.tensor([2, 4, 6, 8], dtype=torch.int32)]


def _sparse_layers(config: Any) -> list[int]:
    """Indices of the decoder layers whose MLP is the sparse MoE block (transformers ``Qwen3MoeDecoderLayer``
    / ``Qwen2MoeDecoderLayer`` / ``Qwen3NextDecoderLayer``: not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``; every layer of Qwen3.5-MoE)."""
    if getattr(config, "model_type", None) not in MOE_MODEL_TYPES or not getattr(config, "num_experts", 0):
        return []
    if config.model_type in ALL_SPARSE_MODEL_TYPES:
        return list(range(config.num_hidden_layers))
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_mlp = set(getattr(config, "mlp_only_layers", None) or ())
    return [i for i in range(config.num_hidden_layers) if i not in only_mlp and (i + 1) % step == 0]


_MISSING = object()


def experts_fusable(config: Any) -> bool:
    """Whether the experts of ``config``'s MoE layers run as ``grouped_mm`` (transformers >= 5 with the
    default ``experts_implementation``), the graph this family fuses."""
    implementation = getattr(config, "_experts_implementation", _MISSING)
    return implementation is not _MISSING and implementation in FUSED_IMPLEMENTATIONS


def swiglu_expected(config: Any, *, per_layer: bool) -> int | None:
    """The swiglu family's count for a MoE ``config`` (None for any other model): the dense MLPs
    (``mlp_only_layers``, ``decoder_sparse_step``) and the shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE);
    the routed experts' activation is counted here, in the moe family, when :func:`experts_fusable`."""
    if getattr(config, "model_type", None) not in MOE_MODEL_TYPES:
        return None
    sparse = _sparse_layers(config)
    shared = 1 if config.model_type in SHARED_EXPERT_MODEL_TYPES and getattr(config, "shared_expert_intermediate_size", 0) else 0
    if per_layer:  # one sparse layer's graph (maybe_compile)
        return shared if sparse else 1
    return (config.num_hidden_layers - len(sparse)) + shared * len(sparse)


# --------------------------------------------------------------------------------------------------
# Routing in ops torchair converts (after the grouped matmuls are fused)
# --------------------------------------------------------------------------------------------------

_CASTS = (aten.to.dtype, aten._to_copy.default)


def _node(value, *targets) -> bool:
    return isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target in targets


def _cast_source(node):
    """``x`` of ``x.to(dtype)`` / ``_to_copy(x, dtype=...)``, else ``node``."""
    return node.args[0] if _node(node, *_CASTS) else node


def _sort_output(node, index: int):
    """The ``aten.sort.default`` (ascending, last dim) node whose output ``index`` ``node`` is, else None."""
    if not (_node(node, operator.getitem) and node.args[1] == index):
        return None
    sort = node.args[0]
    if not _node(sort, aten.sort.default) or any(arg not in (-1, 0, False) for arg in sort.args[1:]):
        return None
    value = meta_val(sort.args[0])
    return sort if isinstance(value, torch.Tensor) and value.dim() == 1 else None


def _set_val(node: torch.fx.Node, fn, *args) -> None:
    """``node.meta["val"]``: ``fn`` run on the FakeTensors of ``args`` (nodes) in their fake mode."""
    values = [meta_val(arg) for arg in args]
    mode = next(v.fake_mode for v in values if hasattr(v, "fake_mode"))
    with mode:
        node.meta["val"] = fn(*values)


def _offsets_from_sorted_ids(graph: torch.fx.Graph, group_list: torch.fx.Node, experts: int, cache: dict):
    """``searchsorted(sorted_ids, arange(E), right=True)`` (int64 cumulative ends, no histc) for a
    ``group_list`` that is HF's ``cumsum(histc(sorted_ids.float()|.int(), E, 0, E - 1), 0)`` (cast), else None.

    For integer ids in ``[0, E)``, ``histc(bins=E, min=0, max=E-1)`` puts id ``v`` in bin
    ``floor(v·E/(E-1)) = v`` (``v/(E-1) < 1`` for ``v < E-1``; the max is inclusive), so the cumulative
    counts are the number of sorted ids ``<= e``: ``searchsorted(..., right=True)``.
    """
    cumsum = _cast_source(group_list)
    if not _node(cumsum, aten.cumsum.default) or cumsum.args[1] != 0:
        return None
    histc = cumsum.args[0]
    if not _node(histc, aten.histc.default) or tuple(histc.args[1:]) != (experts, 0, experts - 1):
        return None
    ids = _cast_source(histc.args[0])
    if _sort_output(ids, 0) is None or meta_val(ids).dtype not in (torch.int64, torch.int32):
        return None
    if cumsum in cache:
        return cache[cumsum]
    device = meta_val(ids).device
    with graph.inserting_before(cumsum):
        arange = graph.call_function(aten.arange.default, (experts,), {"dtype": torch.int64, "device": device})
        ids64 = ids if meta_val(ids).dtype == torch.int64 else graph.call_function(aten.to.dtype, (ids, torch.int64))
        ends = graph.call_function(aten.searchsorted.Tensor, (ids64, arange), {"right": True})
    for node in (arange, ids64, ends):
        node.meta.update({k: v for k, v in cumsum.meta.items() if k in ("stack_trace", "nn_module_stack")})
    _set_val(arange, lambda ref: torch.arange(experts, dtype=torch.int64, device=device), ids)
    if ids64 is not ids:
        _set_val(ids64, lambda t: t.to(torch.int64), ids)
    _set_val(ends, lambda t, a: torch.searchsorted(t, a, right=True), ids64, arange)
    cache[cumsum] = ends
    return ends


def _inverse_permutation(node) -> bool:
    """Whether ``node`` is HF's ``inv_perm[perm] = arange(S)`` on ``empty_like(perm)`` (rewritten to a scatter)."""
    return _node(node, aten.scatter.src) and node.meta.get("qwen_npu_moe") == "inverse_permutation"


def _routing_index(node) -> bool:
    """Whether ``node`` is a non-negative routing index: the sort's permutation, its ``// k``, or its inverse."""
    if _node(node, aten.floor_divide.default) and isinstance(node.args[1], int) and node.args[1] > 0:
        node = node.args[0]
    return _sort_output(node, 1) is not None or _inverse_permutation(node)


def rewrite_routing(graph: torch.fx.Graph) -> dict[str, int]:
    """Express the routing of every fused experts block in ops torchair converts (exact rewrites):

    - the offsets ``cumsum(histc(sorted_ids, E, 0, E - 1))`` feeding ``grouped_matmul`` ->
      ``searchsorted(sorted_ids, arange(E), right=True)`` (int64; torchair has no ``aten.histc`` converter);
    - ``inv_perm[perm] = arange(S)`` (``index_put_`` on ``empty_like(perm)``, whose converter raises) ->
      ``scatter(empty_like(perm), 0, perm, arange(S))`` (every position is written: perm is a permutation);
    - the gathers ``t[i]`` (``aten.index.Tensor``) by a routing index (non-negative) -> ``index_select(t, 0, i)``,
      whose backward is ``index_add`` (``index``'s is ``index_put(accumulate=True)``, which does not convert).

    Returns:
        How many of each were rewritten: ``{"offsets": n, "inverse_permutation": n, "gathers": n}``.
    """
    counts = {"offsets": 0, "inverse_permutation": 0, "gathers": 0}
    cache: dict = {}
    for node in graph.find_nodes(op="call_function", target=gmm.OP):
        weight = meta_val(node.args[1])
        ends = _offsets_from_sorted_ids(graph, node.args[2], int(weight.shape[0]), cache) if isinstance(
            weight, torch.Tensor) and isinstance(weight.shape[0], int) else None
        if ends is not None:
            node.replace_input_with(node.args[2], ends)
            counts["offsets"] += 1
    if not counts["offsets"]:
        return counts
    for node in list(graph.find_nodes(op="call_function", target=aten.index_put_.default)):
        target, indices, values = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if (accumulate or len(indices) != 1 or not _node(target, aten.empty_like.default) or len(target.users) != 1
                or _sort_output(indices[0], 1) is None or target.args[0] is not indices[0]
                or not _node(values, aten.arange.default)):
            continue
        with graph.inserting_before(node):
            scatter = graph.call_function(aten.scatter.src, (target, 0, indices[0], values))
        scatter.meta.update(node.meta)
        scatter.meta["qwen_npu_moe"] = "inverse_permutation"
        node.replace_all_uses_with(scatter)
        graph.erase_node(node)
        counts["inverse_permutation"] += 1
    for node in list(graph.find_nodes(op="call_function", target=aten.index.Tensor)):
        source, indices = node.args[:2]
        value = meta_val(indices[0]) if len(indices) == 1 else None
        if not (isinstance(value, torch.Tensor) and value.dim() == 1 and _routing_index(indices[0])):
            continue
        with graph.inserting_before(node):
            select = graph.call_function(aten.index_select.default, (source, 0, indices[0]))
        select.meta.update(node.meta)
        node.replace_all_uses_with(select)
        graph.erase_node(node)
        counts["gathers"] += 1
    graph.eliminate_dead_code()
    return counts


def loop_experts_router(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The ``one_hot`` that betrays MoE experts run as a per-expert loop, or None: HF's
    ``expert_mask = one_hot(top_k_index, E).permute(2, 1, 0)``.

    transformers 4.57's ``Qwen3MoeSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` (``nn.ModuleList`` experts) and
    5.x's ``experts_implementation="eager"`` build that mask and loop over ``expert_mask.sum(...).nonzero()``:
    Dynamo breaks the graph there (``nonzero``, then ``.item()`` in ``self.experts[expert_idx]``), so each
    expert's MLP is its own graph and no grouped matmul can form. (The top-k indices may be a graph input:
    the router can sit in an earlier graph.)
    """
    for node in graph.find_nodes(op="call_function", target=aten.one_hot.default):
        value = meta_val(node.args[0])
        if not (isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point()):
            continue
        if any(_node(user, aten.permute.default) and list(user.args[1]) == [2, 1, 0] for user in node.users):
            return node
    return None


_LOOP_WARNED: set[str] = set()


def warn_loop_experts(graph: torch.fx.Graph) -> bool:
    """Log the one warning of the process for MoE experts this family cannot fuse (:func:`loop_experts_router`);
    returns whether ``graph`` shows them."""
    router = loop_experts_router(graph)
    if router is None:
        return False
    if "loop" not in _LOOP_WARNED:
        _LOOP_WARNED.add("loop")
        log.warning(
            "qwen_npu: the MoE experts at %s run as a per-expert loop (transformers < 5, or "
            "experts_implementation='eager'): Dynamo breaks the graph per expert and they stay unfused (each expert's "
            "MLP may still fuse as swiglu); use transformers >= 5 with experts_implementation='grouped_mm' (its default) "
            "to run them through npu_grouped_matmul", node_source(router))
    return True


class MoePass(FamilyPass):
    """The grouped-matmul pattern pass, then :func:`rewrite_routing` on what it fused; warns once about
    loop experts (:func:`warn_loop_experts`)."""

    def apply(self, gm: torch.fx.GraphModule, recorder) -> int:
        warn_loop_experts(gm.graph)
        count = super().apply(gm, recorder)
        if count:
            for node in gm.graph.find_nodes(op="call_function", target=torch.ops.npu.npu_swiglu.default):
                if _node(node.args[0], gmm.OP):  # ours, not an "already fused" swiglu of the swiglu family
                    node.meta[EMITTED_BY] = self.family.name
            rewritten = rewrite_routing(gm.graph)
            log.debug("qwen_npu: MoE routing rewritten for torchair: %s", rewritten)
        return count


def _aten_grouped_mm() -> tuple:
    """``(aten._grouped_mm.default,)``, or ``()`` on a torch without it (2.7: added in torch 2.8)."""
    packet = getattr(torch.ops.aten, "_grouped_mm", None)
    return (packet.default,) if packet is not None else ()


class MoeFamily(FusionFamily):
    """``aten._grouped_mm`` / ``transformers::grouped_mm_fallback`` -> ``qwen_npu::grouped_matmul`` (with
    ``npu_swiglu`` on the gate/up output); 2 per sparse MoE layer."""

    name = "moe"
    pass_class = MoePass
    fused_op_names = ("npu_grouped_matmul",)
    backward_op_name = "npu_grouped_matmul"
    backward_per_fusion = 2  # dx (group_type 0) and dW (group_type 2)
    per_layer = 2  # gate_up and down of the routed experts

    @property
    def anchor_ops(self) -> tuple:  # the fallback op exists once transformers' integrations.moe is imported
        fallback = _fallback_op()
        return _aten_grouped_mm() + ((fallback,) if fallback is not None else ())

    @classmethod
    def backward_op_counts(cls, fusions: int) -> dict[str, int]:
        """dx and dW (``npu_grouped_matmul``) per fused grouped matmul; ``npu_swiglu_backward`` for every
        second one (the gate_up matmul's activation: one of the 2 fusions per MoE layer)."""
        return {"npu_grouped_matmul": fusions * cls.backward_per_fusion, "npu_swiglu_backward": fusions // cls.per_layer}

    @classmethod
    def expected_per_layer(cls, model_config: Any, layer_type: str | None = None) -> int:
        return cls.per_layer if _sparse_layers(model_config) and experts_fusable(model_config) else 0

    @classmethod
    def expected_count(cls, model_config: Any, *, per_layer: bool = False, layer_type: str | None = None) -> int:
        if per_layer:
            return cls.expected_per_layer(model_config, layer_type)
        return cls.per_layer * len(_sparse_layers(model_config)) if experts_fusable(model_config) else 0

    def iter_variants(self):
        anchor = _aten_grouped_mm()
        if not anchor:  # torch < 2.8 has no aten._grouped_mm (nor transformers' grouped_mm experts on it)
            return
        yield PatternVariant("moe_grouped_mm_swiglu", _search_aten_swiglu, _replace_swiglu, _examples, _check_fn(True),
                             why="bf16 grouped_mm experts: gate_up grouped matmul, chunk, silu(gate) * up",
                             anchor_ops=anchor)
        yield PatternVariant("moe_grouped_mm", _search_aten, _replace, _examples, _check_fn(False),
                             why="bf16 grouped_mm experts: the down grouped matmul", anchor_ops=anchor)
        fallback = _fallback_op()
        if fallback is not None:
            yield PatternVariant("moe_fallback_swiglu", _search_fallback_swiglu, _replace_swiglu, _examples,
                                 _check_fn(True), anchor_ops=(fallback,),
                                 why="fp32/fp16 grouped_mm experts under Dynamo (grouped_mm_fallback): gate_up + act")
            yield PatternVariant("moe_fallback", _search_fallback, _replace, _examples, _check_fn(False),
                                 anchor_ops=(fallback,), why="fp32/fp16 grouped_mm experts: the down grouped matmul")

    def explain_near_miss(self, anchor: torch.fx.Node) -> str:
        x, weight = (meta_val(arg) for arg in anchor.args[:2])
        if anchor.kwargs or len(anchor.args) > 3:
            return f"{anchor.target} at {node_source(anchor)} has a bias or out_dtype, which no variant takes"
        shapes = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in (x, weight))
        return f"{anchor.target} at {node_source(anchor)} is not a 2-D x 3-D grouped matmul of the experts {shapes}"
