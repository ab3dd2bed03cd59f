"""The cost model of the traffic benchmarks: what one kernel of an AOT graph moves, computes and costs on an Atlas A2.

Measures, per FX node of a forward or backward graph built under fake tensors (nothing runs): its kernel category
(:func:`classify`), the HBM bytes it reads and writes (:func:`node_bytes`, bytes), its Cube FLOPs
(:func:`kernel_flops`, FLOPs) and its roofline time (:func:`kernel_time`, seconds); per graph, the per-op table of
all of them (:func:`graph_counts`, times in integer picoseconds so that subtracting tables is exact). The dense,
MoE and Qwen3.5 benchmarks (:mod:`benchmarks.traffic`, :mod:`benchmarks.moe_traffic`,
:mod:`benchmarks.qwen3_5_traffic`) and :mod:`benchmarks.activation_memory` count with these rules.

Where each figure comes from:

* Hardware (:data:`BANDWIDTH`, :data:`PEAK`): the CANN developer guide's table of Atlas A2 (910B2) figures, HBM
  1.6 TB/s, Cube 353.9 TFLOPS BF16, Vector 23.5 TFLOPS FP16 (:data:`A2_SOURCE_URL`).
* Bytes: the ``meta["val"]`` FakeTensors of the graph (numel x itemsize); the compressed causal mask's window from
  torch_npu 2.13.0's ``npu_fusion_attention`` documentation (sparse_mode).
* FLOPs: ``2·M·N·K`` per matmul; attention forward and backward as FlashAttention-2 computes them (Dao 2023,
  arXiv:2307.08691, Algorithm 2), causal kernels halved (:func:`kernel_flops`).

Counting rules:

* A *kernel* is a ``call_function`` node whose target is an ATen/npu ``OpOverload`` returning a tensor,
  except view ops (``OpOverload.is_view``: view, t, transpose, expand, unsqueeze, squeeze, slice,
  select, permute, detach, alias, as_strided, split, ...) and :data:`FREE_OPS` (``_unsafe_view`` and
  allocations without a fill); ``operator.getitem`` and SymInt arithmetic are free too.
* Kernel categories: ``matmul`` (:data:`MATMUL_OPS`, including ``qwen_npu.gate_up_proj``: the SwiGLU
  fusion's gate and up projections, two matmuls writing one buffer; and the MoE experts' grouped matmuls,
  :data:`GROUPED_MATMUL_OP_NAMES`, ``2·M·K·N`` over their groups), ``attention`` (SDPA's kernels and
  ``npu_fusion_attention``/``_grad``, :data:`ATTENTION_OP_NAMES`), ``fused`` (other ``npu`` ops) and
  ``vector`` (everything else: elementwise, reductions, casts, copies, cat, mask building).
* Bytes of a kernel = bytes of its tensor inputs (each argument once, broadcast (stride-0) dims
  counted once: an ``expand``-ed input reads its un-expanded storage) + bytes of its tensor outputs,
  from ``meta["val"]`` (numel x itemsize); allocate-and-fill ops (``new_zeros``, ``zeros_like``, ...:
  :data:`METADATA_ONLY_OP_NAMES`) read nothing; the compressed causal mask of ``npu_fusion_attention``'s
  sparse modes 2/3 counts ``min(2048², Sq·Skv)`` bytes (:func:`_compressed_mask_bytes`). A matmul's bytes
  enter only its roofline time. Attention kernels are reported in their own column: their internal traffic
  (score tiles) depends on the kernel, and on this CPU host SDPA lowers to
  ``_scaled_dot_product_flash_attention_for_cpu``, a stand-in for whatever the NPU's SDPA dispatches to.
* *Glue*: the copies a rewrite or a patch adds for a fused kernel: a ``cat``/``clone``/``_to_copy``/
  ``logical_not`` whose output feeds a fused npu op (through views: verl's and our fallback SwiGLU
  ``cat([gate, up], -1)``), a ``cat`` feeding a matmul that feeds a fused op (an in-graph weight
  concatenation such as ``cat([w_gate, w_up])``, which our SwiGLU rewrite no longer builds), or a
  ``_to_copy`` of a fused op's output (e.g. npu_rms_norm_backward's fp32 dgamma cast to the weight
  dtype). Our SwiGLU linear form (``gate_up_proj`` + ``npu_swiglu(dim=0)``) has no glue.
* Roofline (:func:`kernel_flops`, :func:`kernel_time`): per kernel ``max(FLOPs / Cube peak, bytes / HBM
  bandwidth)``, matmuls and attention included (their bytes enter only here); vector and fused kernels have
  FLOPs 0 (memory-bound). No launch overhead, no overlap between kernels.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.fx

from qwen_npu_compile.ops.limits import bound_arguments
from qwen_npu_compile.ops.qwen_npu import gate_up_proj

aten = torch.ops.aten

#: Atlas A2 (Ascend 910B) figures of the time estimates, from the CANN developer guide "算子跨平台迁移指导"
#: (cross-platform operator migration guide), table "代际规格参数对比": AI Core 24 cores at 1.8 GHz, Cube
#: 353T/376T @BF16/FP16, Vector 23.5T (FP16), memory 64 GB at 1.6 TB/s, for "a representative
#: configuration" (the 910B2; the guide publishes no figures for the 910B3/910B4). 353.9e12 = 24 cores x 4096
#: FP16 MAC/cycle x 2 x 1.8 GHz, the Cube alone (the figure verl's and MindSpeed-LLM's MFU use: 354e12).
A2_SOURCE_URL = (
    "https://github.com/hicann/ops-nn/blob/16079eedd3c988516ba363ffa4a3eb9ba94ffaf4/"
    "docs/zh/develop/cross_platform_migration_guide.md"
)

#: HBM bandwidth of the time estimates (bytes / bandwidth), with its source.
BANDWIDTH = {
    "bytes_per_second": 1.6e12,
    "label": "Atlas A2 HBM bandwidth 1.6 TB/s (CANN developer guide, representative configuration 910B2)",
    "source_url": A2_SOURCE_URL,
    "derivation": (
        "CANN developer guide '算子跨平台迁移指导' (hicann/ops-nn docs/zh/develop/cross_platform_migration_guide.md, "
        "same table in hicann/ops-transformer), table '代际规格参数对比': Atlas A2 memory 64 GB, bandwidth 1.6 TB/s. "
        "No figure is published for the 910B3/910B4; times scale as 1.6 TB/s / your bandwidth."
    ),
}

#: Compute peaks of the roofline (FLOP/s), same table: Cube (matmuls, attention) and Vector.
PEAK = {
    "cube_bf16_flops_per_second": 353.9e12,
    "vector_fp16_flops_per_second": 23.5e12,
    "label": "Atlas A2 Cube 353.9 TFLOPS BF16 (listed as 353T/376T BF16/FP16), Vector 23.5 TFLOPS FP16",
    "source_url": A2_SOURCE_URL,
    "derivation": (
        "353.9e12 = 24 AI cores x 4096 FP16 MAC/cycle x 2 FLOP x 1.8 GHz (the Cube alone; docs-feedback issue "
        "gitcode cann/ops-nn #6033 on the same guide); verl (verl/utils/flops_counter.py) and MindSpeed-LLM use "
        "354e12 for '910B'."
    ),
}

#: Matrix multiplications: not counted in bytes (compute-bound at these shapes, identical in every variant).
#: ``qwen_npu.gate_up_proj`` is gate_proj's and up_proj's two matmuls, each writing its half of one buffer.
MATMUL_OPS = frozenset(
    {
        gate_up_proj.OP,
        aten.mm.default,
        aten.bmm.default,
        aten.addmm.default,
        aten.baddbmm.default,
        aten.linear.default,
        aten.matmul.default,
        aten.mv.default,
        aten.addmv.default,
        aten.dot.default,
    }
)

#: Grouped matmuls (MoE experts; schema names, as the npu op exists only once registered): transformers'
#: ``aten._grouped_mm`` (bf16) / ``transformers::grouped_mm_fallback`` (fp32/fp16 under Dynamo), our
#: ``qwen_npu::grouped_matmul`` and torch_npu's ``npu_grouped_matmul``. Matmuls, with the FLOPs of
#: :func:`grouped_matmul_flops` (benchmarks/moe_traffic.py's rows).
GROUPED_MATMUL_OP_NAMES = frozenset(
    {"aten::_grouped_mm", "transformers::grouped_mm_fallback", "qwen_npu::grouped_matmul", "npu::npu_grouped_matmul"}
)

#: Attention kernels (schema names): SDPA and what it lowers to, and the fused NPU attention.
ATTENTION_OP_NAMES = frozenset(
    {
        "aten::scaled_dot_product_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_backward",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_efficient_attention_backward",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_cudnn_attention_backward",
        "aten::_flash_attention_forward",
        "aten::_flash_attention_backward",
        "aten::_efficient_attention_forward",
        "aten::_efficient_attention_backward",
        "npu::npu_fusion_attention",
        "npu::npu_fusion_attention_grad",
        "qwen_npu::varlen_attention",
        "qwen_npu::varlen_attention_backward",
    }
)

#: Our fused varlen attention (``qwen_npu_compile/ops/qwen_npu/varlen_attention.py``): counted like the npu ops
#: (a copy feeding it is glue), although it lives in the ``qwen_npu`` namespace.
VARLEN_OP_NAMES = frozenset({"qwen_npu::varlen_attention", "qwen_npu::varlen_attention_backward"})

#: Non-view ops that move no data: a view of a fresh tensor, and allocations without a fill.
FREE_OPS = frozenset(
    {
        aten._unsafe_view.default,
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.lift_fresh.default,
    }
)

#: Allocate-and-fill ops that read only the metadata (shape, dtype, device) of their tensor argument: their bytes
#: are the output's only (``new_zeros(grad, size)`` in a backward reads nothing of ``grad``).
METADATA_ONLY_OP_NAMES = frozenset(
    {"aten::new_zeros", "aten::new_ones", "aten::new_full", "aten::zeros_like", "aten::ones_like", "aten::full_like"}
)

#: Copies that count as glue when they touch a fused npu op (see the module docstring).
GLUE_OP_NAMES = frozenset({"aten::cat", "aten::clone", "aten::_to_copy", "aten::logical_not", "aten::copy"})

CATEGORIES = ("matmul", "attention", "fused", "vector")


# ----------------------------------------------------------------------------------------------------
# counting


def tensors_in(value) -> Iterable[torch.Tensor]:
    """The tensors of a ``meta["val"]``: the value itself, or those of a (nested) list or tuple."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def node_args(node: torch.fx.Node) -> Iterable[torch.fx.Node]:
    """The nodes among ``node``'s arguments and keyword arguments (lists and tuples flattened), in order."""
    stack = [*node.args, *node.kwargs.values()]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.fx.Node):
            yield item
        elif isinstance(item, (list, tuple)):
            stack[:0] = list(item)


def classify(node: torch.fx.Node) -> str | None:
    """The kernel category of ``node`` (one of :data:`CATEGORIES`), ``"free"``, or None (not a call)."""
    if node.op != "call_function":
        return None
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return "free"  # operator.getitem, SymInt arithmetic
    if target.is_view or target in FREE_OPS:
        return "free"
    if not any(True for _ in tensors_in(node.meta.get("val"))):
        return "free"  # sym_size & co, ops returning only scalars
    if target in MATMUL_OPS or target._schema.name in GROUPED_MATMUL_OP_NAMES:
        return "matmul"
    if target._schema.name in ATTENTION_OP_NAMES:
        return "attention"
    if target.namespace == "npu":
        return "fused"
    return "vector"


#: What an unbacked size counts as (:func:`as_int`): the number of packed sequences of the graph measured.
_UNBACKED_SIZE: contextvars.ContextVar[int] = contextvars.ContextVar("unbacked_size", default=1)


def as_int(size) -> int:
    """A size or stride as an int. An unbacked SymInt, i.e. the data-dependent length of
    ``qwen_npu.seq_ends_from_positions``'s int64 output (one entry per packed sequence), counts as the
    number of sequences of the row being measured (:data:`_UNBACKED_SIZE`, set by :func:`graph_counts`)."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt) and not size.node.has_hint():
        return _UNBACKED_SIZE.get()
    return int(size)


def tensor_numel(tensor: torch.Tensor) -> int:
    """Elements of ``tensor`` (:func:`as_int` of each size)."""
    count = 1
    for size in tensor.shape:
        count *= as_int(size)
    return count


def _unique_bytes(tensor: torch.Tensor) -> int:
    """Bytes a kernel reads from ``tensor``: broadcast (stride-0) dims count once."""
    sizes = [as_int(size) for size in tensor.shape]
    if any(size == 0 for size in sizes):
        return 0
    numel = 1
    for size, stride in zip(sizes, tensor.stride()):
        if as_int(stride) != 0:
            numel *= size
    return numel * tensor.element_size()


#: npu_fusion_attention's sparse modes that take the compressed causal mask (torch_npu 2.13.0 docs).
_COMPRESSED_MASK_SPARSE_MODES = (2, 3)


def _compressed_mask_bytes(node: torch.fx.Node) -> tuple[torch.fx.Node | None, int]:
    """``(mask node, bytes)`` an ``npu_fusion_attention``/``_grad`` call reads of its compressed causal mask.

    With ``sparse_mode`` 2 or 3 the kernel skips the blocks above the diagonal and applies the
    ``[2048, 2048]`` compressed mask only to the diagonal blocks of its ``Sq x Skv`` window (torch_npu
    2.13.0 ``npu_fusion_attention`` docs, sparse_mode), so it reads at most ``min(2048², Sq·Skv)`` of
    its bytes: counting the whole 4 MiB would charge a short sequence more than an explicit S×S mask.
    ``(None, 0)`` for any other node.
    """
    if not (isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "npu"
            and node.target.name().split("::")[-1] in ("npu_fusion_attention", "npu_fusion_attention_grad")):
        return None, 0
    bound = bound_arguments(node)
    mask = bound.get("atten_mask")
    if bound.get("sparse_mode") not in _COMPRESSED_MASK_SPARSE_MODES or not isinstance(mask, torch.fx.Node):
        return None, 0
    query, key = bound["query"].meta["val"], bound["key"].meta["val"]
    seq_dim = {"BSH": 1, "BSND": 1, "BNSD": 2, "SBH": 0, "TND": 0}[bound["input_layout"]]  # TND: Sq = Skv = T
    window = int(query.shape[seq_dim]) * int(key.shape[seq_dim])
    return mask, min(_unique_bytes(mask.meta["val"]), window * mask.meta["val"].element_size())


def schema_name(node: torch.fx.Node) -> str | None:
    """``"aten::add"``: the schema name of an ``OpOverload`` target; None for any other node."""
    target = node.target
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else None


def _varlen_mask_bytes(node: torch.fx.Node) -> int:
    """Bytes ``qwen_npu.varlen_attention``/``_backward`` read of the compressed causal mask they pass inside.

    The op calls ``npu_fusion_attention(_grad)(..., "TND", atten_mask=<2048x2048 bool>, sparse_mode=3)``
    (``ops/qwen_npu/varlen_attention.py``), so its kernel reads the mask although no graph node holds it:
    ``min(2048², T²)`` bytes, the rule of :func:`_compressed_mask_bytes` with ``Sq = Skv = T`` (what
    verl's TND call of ``npu_fusion_attention`` is charged too). 0 for any other node.
    """
    if schema_name(node) not in VARLEN_OP_NAMES:
        return 0
    query = bound_arguments(node)["query"].meta["val"]
    tokens = int(query.shape[0])
    return min(2048 * 2048, tokens * tokens)


def node_bytes(node: torch.fx.Node) -> tuple[int, int]:
    """``(bytes read, bytes written)`` by ``node`` (see the module docstring for the rules).

    ``qwen_npu.varlen_attention`` (TND: q ``[T, Nq, D]``, k ``[T, Nkv, D]``, v ``[T, Nkv, Dv]``, seq_ends
    ``[B]`` int64) reads q, k, v, seq_ends and the compressed mask (:func:`_varlen_mask_bytes`) and writes
    out ``[T, Nq, Dv]`` plus softmax_max/sum ``[T, Nq, 8]`` fp32: ``(Nq·D + Nkv·(D + Dv))·T·b + 8·B +
    min(2048², T²)`` read, ``Nq·Dv·T·b + 64·T·Nq`` written (b = element size). Its backward reads dy, q, k,
    v, out, softmax_max/sum, seq_ends and the mask and writes dq, dk, dv. As for every kernel, these are
    the op's tensor arguments and outputs (``meta["val"]``); the kernel's internal score tiles stay on chip.
    """
    written = sum(tensor_numel(t) * t.element_size() for t in tensors_in(node.meta.get("val")))
    if schema_name(node) in METADATA_ONLY_OP_NAMES:
        return 0, written
    read = _varlen_mask_bytes(node)
    compressed_mask, compressed_bytes = _compressed_mask_bytes(node)
    for arg in node_args(node):
        if arg is compressed_mask:
            read += compressed_bytes
            continue
        for tensor in tensors_in(arg.meta.get("val")):
            read += _unique_bytes(tensor)
    return read, written


# ----------------------------------------------------------------------------------------------------
# the roofline


#: Where each matmul's contraction dim K is: ``(argument index, dim)`` of the left operand.
_MATMUL_K = {
    "aten::mm": 0, "aten::bmm": 0, "aten::matmul": 0, "aten::mv": 0, "aten::dot": 0, "aten::linear": 0,
    "aten::addmm": 1, "aten::baddbmm": 1, "aten::addmv": 1, "qwen_npu::gate_up_proj": 0,
}


def grouped_matmul_flops(node: torch.fx.Node) -> int:
    """``2·M·K·N`` summed over the groups of a grouped matmul (:data:`GROUPED_MATMUL_OP_NAMES`).

    * Groups along the rows (``x [M, K]`` x ``w [E, K, N]`` -> ``[M, N]``; the forward and dx of MoE experts:
      ``aten._grouped_mm`` / ``grouped_mm_fallback`` 2-D x 3-D, ``qwen_npu::grouped_matmul``,
      ``npu_grouped_matmul`` ``group_type=0``): row group ``e`` costs ``2·m_e·K·N``, in all ``2·M·K·N`` =
      2 x (output elements) x K, whatever the split.
    * Groups along the contraction (``a [K, M]`` x ``b [M, N]`` -> ``[E, K, N]``; dW: ``aten._grouped_mm``
      2-D x 2-D, ``npu_grouped_matmul`` ``group_type=2``): group ``e`` costs ``2·K·m_e·N``, in all ``2·K·M·N``
      (not 2 x output x M: the output holds E blocks).
    * ``aten._grouped_mm`` 3-D x 2-D / 3-D x 3-D: 2 x (output elements) x K.

    Raises:
        ValueError: an ``npu_grouped_matmul`` with several x or weight tensors (not emitted by any variant).
    """
    name = schema_name(node)
    if name == "npu::npu_grouped_matmul":
        bound = bound_arguments(node)
        xs, ws = bound["x"], bound["weight"]
        if len(xs) != 1 or len(ws) != 1:
            raise ValueError(f"{node.name}: npu_grouped_matmul with {len(xs)} x / {len(ws)} weight tensors")
        a, b = xs[0].meta["val"], ws[0].meta["val"]
        contraction_groups = bound.get("group_type") == 2
    else:
        a, b = node.args[0].meta["val"], node.args[1].meta["val"]
        contraction_groups = a.dim() == 2 and b.dim() == 2
    if contraction_groups:
        return 2 * as_int(a.shape[0]) * as_int(a.shape[1]) * as_int(b.shape[1])
    out = sum(tensor_numel(t) for t in tensors_in(node.meta.get("val")))
    return 2 * out * as_int(a.shape[-1])


def _matmul_flops(node: torch.fx.Node) -> int:
    """``2·M·N·K`` of a matmul kernel: 2 x (elements of its output) x K (the left operand's last dim);
    grouped matmuls: :func:`grouped_matmul_flops`."""
    if schema_name(node) in GROUPED_MATMUL_OP_NAMES:
        return grouped_matmul_flops(node)
    left = node.args[_MATMUL_K[schema_name(node)]].meta["val"]
    out = sum(tensor_numel(t) for t in tensors_in(node.meta.get("val")))
    return 2 * out * int(left.shape[-1])


def _causal_pairs(length: int) -> int:
    return length * (length + 1) // 2


def attention_pairs(node: torch.fx.Node, lengths: Sequence[int] | None = None) -> tuple[int, int, int, int]:
    """``(score pairs, Nq, D, Dv)`` an attention kernel computes: the ``(query, key)`` pairs of every head.

    * A causal kernel (SDPA ``is_causal=True`` without a mask; ``npu_fusion_attention`` ``sparse_mode``
      2/3, which skip the blocks above the diagonal) computes ``S·(S+1)/2`` pairs per sequence; a kernel
      with an explicit mask, or none, computes all ``Sq·Skv`` (the mask is data: no block is skipped).
    * TND (``npu_fusion_attention`` with ``actual_seq_qlen``; ``qwen_npu.varlen_attention``) attends within
      each packed sequence: ``Σ len_i·(len_i+1)/2`` (causal modes) or ``Σ len_i²``. The lengths come from the
      node's ``actual_seq_qlen`` (constants in verl's graph) or, for ``varlen_attention`` (whose offsets are
      a tensor), from ``lengths``.

    Raises:
        ValueError: a ``varlen_attention`` node without ``lengths``.
    """
    name = schema_name(node)
    bound = bound_arguments(node)
    q, v = bound["query"].meta["val"], bound["value"].meta["val"]
    if name in VARLEN_OP_NAMES:
        if not lengths:
            raise ValueError(f"{node.name}: the packed sequence lengths are needed to count varlen attention FLOPs")
        nq, d, dv = int(q.shape[1]), int(q.shape[2]), int(v.shape[2])
        causal = bound.get("sparse_mode", 3) in _COMPRESSED_MASK_SPARSE_MODES
        return sum(_causal_pairs(n) if causal else n * n for n in lengths), nq, d, dv
    if name.startswith("npu::"):
        layout, heads = bound["input_layout"], int(bound["head_num"])
        causal = bound.get("sparse_mode", 0) in _COMPRESSED_MASK_SPARSE_MODES and bound.get("atten_mask") is not None
        if layout == "TND":
            ends = list(bound["actual_seq_qlen"])
            seqs = [b - a for a, b in zip([0, *ends[:-1]], ends)]
            nq, d, dv = int(q.shape[1]), int(q.shape[2]), int(v.shape[2])
            return sum(_causal_pairs(n) if causal else n * n for n in seqs), nq, d, dv
        k = bound["key"].meta["val"]
        if layout in ("BSND", "BNSD"):
            s_dim, d, dv = (1 if layout == "BSND" else 2), int(q.shape[-1]), int(v.shape[-1])
        else:  # BSH / SBH
            s_dim, d = (1 if layout == "BSH" else 0), int(q.shape[-1]) // heads
            dv = int(v.shape[-1]) * d // int(k.shape[-1])
        batch = int(q.shape[0 if layout != "SBH" else 1])
        sq, skv = int(q.shape[s_dim]), int(k.shape[s_dim])
        return batch * (_causal_pairs(sq) if causal else sq * skv), heads, d, dv
    # SDPA's kernels: q [B, Nq, Sq, D], k/v [B, Nkv, Skv, D]
    k = bound["key"].meta["val"]
    causal = bool(bound.get("is_causal", False)) and bound.get("attn_mask") is None
    batch, nq, sq, d = (int(x) for x in q.shape)
    skv, dv = int(k.shape[2]), int(v.shape[-1])
    return batch * (_causal_pairs(sq) if causal else sq * skv), nq, d, dv


def _is_backward_attention(node: torch.fx.Node) -> bool:
    name = schema_name(node)
    return name.endswith("_backward") or name.endswith("_grad")


def kernel_flops(node: torch.fx.Node, category: str, lengths: Sequence[int] | None = None) -> int:
    """FLOPs of one kernel on the Cube: matmuls and attention; 0 for the rest (see :func:`kernel_time`).

    * matmul: ``2·M·N·K`` (:func:`_matmul_flops`).
    * attention forward: two matmuls per score pair and head, ``QKᵀ`` (``2·D``) and ``PV`` (``2·Dv``):
      ``2·pairs·Nq·(D + Dv)``; backward (FlashAttention-2's, with the scores recomputed: Dao 2023,
      arXiv:2307.08691, Algorithm 2): ``QKᵀ`` again, ``dV = PᵀdO``, ``dP = dO·Vᵀ``, ``dQ = dS·K``,
      ``dK = dSᵀ·Q``: ``2·pairs·Nq·(3·D + 2·Dv)``, 2.5x the forward at D = Dv, the factor of
      Dao-AILab/flash-attention ``benchmarks/benchmark_flash_attention.py`` ``flops()``, which also halves
      causal attention, as :func:`attention_pairs` does (verl's ``flops_counter`` likewise:
      ``6·Σ len²·D·N`` for forward + backward).
    """
    if category == "matmul":
        return _matmul_flops(node)
    if category != "attention":
        return 0
    pairs, nq, d, dv = attention_pairs(node, lengths)
    if _is_backward_attention(node):
        return 2 * pairs * nq * (3 * d + 2 * dv)
    return 2 * pairs * nq * (d + dv)


def kernel_time(flops: int, num_bytes: int) -> float:
    """Roofline time of one kernel in seconds: ``max(FLOPs / Cube peak, bytes / HBM bandwidth)``.

    Vector and fused elementwise kernels enter with FLOPs 0: their arithmetic intensity (a few FLOPs per
    byte at most: norms, SwiGLU, rotary, adds, casts) is far below the Vector unit's ridge point,
    23.5e12 / 1.6e12 ≈ 15 FLOP/byte, so bytes / bandwidth is their time. Peaks: :data:`PEAK`,
    :data:`BANDWIDTH` (Atlas A2). No launch overhead, no overlap between kernels.
    """
    return max(flops / PEAK["cube_bf16_flops_per_second"], num_bytes / BANDWIDTH["bytes_per_second"])


def _is_fused(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and (node.target.namespace == "npu" or node.target._schema.name in VARLEN_OP_NAMES)
    )


def through_free(start, step) -> Iterator[torch.fx.Node]:
    """Every node reachable from the nodes ``start``, moving by ``step`` (users or arguments) only on from free
    (view-like) nodes; each once, the nodes of ``start`` included."""
    stack, seen = list(start), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        if classify(node) == "free":
            stack.extend(step(node))


def _reaches_fused(start, step) -> bool:
    """Whether a fused op is reachable from ``start`` through free (view-like) nodes, moving by ``step``."""
    return any(_is_fused(node) for node in through_free(start, step))


def _feeds_fused(node: torch.fx.Node) -> bool:
    return _reaches_fused(node.users, lambda n: n.users)


def _feeds_fused_through_matmul(node: torch.fx.Node) -> bool:
    """Whether ``node`` feeds (through views) a matmul whose output feeds (through views) a fused op:
    an in-graph weight concatenation such as ``cat([w_gate, w_up])``."""
    return any(classify(user) == "matmul" and _feeds_fused(user)
               for user in through_free(node.users, lambda n: n.users))


def _fed_by_fused(node: torch.fx.Node) -> bool:
    return _reaches_fused(node_args(node), node_args)


def is_glue(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a copy made for a fused npu op (see the module docstring).

    Input glue: a cat/clone/_to_copy/logical_not whose output feeds a fused op (through views).
    Weight glue: a ``cat`` feeding a matmul whose output feeds a fused op (the merged gate/up weight
    built in the graph). Output glue: a ``_to_copy`` (dtype cast) of a fused op's output. A clone *of* a fused op's
    output that feeds something else (repeat_kv after a fused rotary) is ordinary work, not glue.
    """
    if classify(node) != "vector" or node.target._schema.name not in GLUE_OP_NAMES:
        return False
    if node.target._schema.name == "aten::cat" and _feeds_fused_through_matmul(node):
        return True  # weight glue: e.g. cat([w_gate, w_up]) -> mm -> npu_swiglu
    return _feeds_fused(node) or (node.target._schema.name == "aten::_to_copy" and _fed_by_fused(node))


def op_name(node: torch.fx.Node) -> str:
    """``aten.add.Tensor`` / ``npu.npu_rms_norm.default``: the key of the per-op tables."""
    return str(node.target)


def graph_counts(gm: torch.fx.GraphModule, lengths: Sequence[int] | None = None) -> dict[str, dict]:
    """Per op of ``gm``: category, kernels, bytes read/written, glue kernels/bytes (free ops omitted), and
    the roofline: Cube FLOPs and the sum of the kernels' :func:`kernel_time` (``roofline_ps``, integer
    picoseconds, so that the per-layer subtraction is exact). Matmuls' bytes enter only their roofline time.

    Args:
        gm: a forward or backward graph.
        lengths: the packed sequence lengths (needed for ``qwen_npu.varlen_attention``'s FLOPs).
    """
    token = _UNBACKED_SIZE.set(len(lengths) if lengths else 1)
    try:
        return _graph_counts(gm, lengths)
    finally:
        _UNBACKED_SIZE.reset(token)


def _graph_counts(gm: torch.fx.GraphModule, lengths: Sequence[int] | None) -> dict[str, dict]:
    table: dict[str, dict] = {}
    for node in gm.graph.nodes:
        category = classify(node)
        if category in (None, "free"):
            continue
        row = table.setdefault(
            op_name(node),
            {"category": category, "kernels": 0, "bytes_read": 0, "bytes_written": 0, "glue_kernels": 0,
             "glue_bytes": 0, "flops": 0, "roofline_ps": 0},
        )
        row["kernels"] += 1
        read, written = node_bytes(node)
        flops = kernel_flops(node, category, lengths)
        row["flops"] += flops
        row["roofline_ps"] += round(kernel_time(flops, read + written) * 1e12)
        if category == "matmul":
            continue
        row["bytes_read"] += read
        row["bytes_written"] += written
        if is_glue(node):
            row["glue_kernels"] += 1
            row["glue_bytes"] += read + written
    return table
