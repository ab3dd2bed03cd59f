"""Part 1: kernels and HBM traffic per Qwen2.5 decoder layer: eager vs verl-style vs qwen_npu.

How the graphs are built (no memory needed, B=1, S=4096 at 7B costs ~0.5 GB of host RAM):

1. A :class:`transformers.Qwen2Model` with ``L`` decoder layers is built under a
   :class:`~torch._subclasses.fake_tensor.FakeTensorMode` (parameters are CPU FakeTensors: shapes,
   no storage), ``attn_implementation="sdpa"``, bf16, training mode. Its final norm is replaced by
   ``Identity`` and it is called with ``inputs_embeds`` (requires grad), so that neither the embedding,
   the final norm nor the LM head is counted, while the rotary cos/sin and the causal mask are built
   exactly as the model builds them.
2. ``torch.compile(fullgraph=True)`` with a recording backend: Dynamo's graph goes through
   :func:`qwen_npu_compile.graph.canonicalize.to_aten_graph`, then the variant's family passes
   (:func:`qwen_npu_compile.fusion.manager.fuse`, checks as for torchair on an NPU) and
   :func:`qwen_npu_compile.graph.emit.finalize`, then AOTAutograd (default partitioner, no recomputation, backward
   compiled eagerly) whose forward and backward compilers record the two graphs. Variants that run the
   same model code share one Dynamo capture (each gets its own ATen graph, passes and AOT run).
3. Per layer = graph(L=2) - graph(L=1), op by op; what L=1 has beyond one layer is the once-per-forward
   work (position ids, causal mask, cos/sin), reported separately as ``per_forward``.

Variants:

* ``eager``: no fusion (canonicalized graph, no pass): what the unpatched model runs.
* ``verl``: what verl runs on Ascend: transformers patched like verl's ``npu_patch``
  (:mod:`benchmarks.verl_patch`: RMSNorm, SwiGLU via ``cat`` and rotary on BNSD q/k fused) and
  attention through transformers' NPU flash attention, verl's default ``flash_attention_2``
  (:func:`benchmarks.verl_patch.npu_flash_attention_2`: ``npu_fusion_attention`` in BSND for one
  sequence, TND with ``actual_seq_qlen`` when packed, ``sparse_mode=3``); no pass of ours runs.
* ``qwen_npu_no_attention``: our passes for rms_norm, swiglu, rotary (the verl set, our rewrites).
* ``qwen_npu``: every family in :data:`qwen_npu_compile.config.ALL_FAMILIES`.

Packed rows (:data:`PACKED_VARIANTS`; one row of T tokens, ``position_ids`` restarting per sequence, no
``attention_mask``: verl's ``use_remove_padding``): ``qwen_npu_explicit_mask`` (every family, varlen
recognition off: transformers' ``[1, 1, T, T]`` SDPA mask fused as an explicit ``atten_mask``),
``qwen_npu_varlen`` (every family: the mask proven packed, ``qwen_npu.varlen_attention`` in TND) and
``verl`` (as above, TND).

Counting rules (:func:`classify`, :func:`node_bytes`):

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
  sparse modes 2/3 counts ``min(2048², Sq·Skv)`` bytes (:func:`_compressed_mask_bytes`). Matmuls are not counted. Attention kernels are reported in
  their own column: their internal traffic (score tiles) depends on the kernel, and on this CPU host
  SDPA lowers to ``_scaled_dot_product_flash_attention_for_cpu``, a stand-in for whatever the NPU's
  SDPA dispatches to.
* *Glue*: the copies a rewrite or a patch adds for a fused kernel: a ``cat``/``clone``/``_to_copy``/
  ``logical_not`` whose output feeds a fused npu op (through views: verl's and our fallback SwiGLU
  ``cat([gate, up], -1)``), a ``cat`` feeding a matmul that feeds a fused op (an in-graph weight
  concatenation such as ``cat([w_gate, w_up])``, which our SwiGLU rewrite no longer builds), or a
  ``_to_copy`` of a fused op's output (e.g. npu_rms_norm_backward's fp32 dgamma cast to the weight
  dtype). Our SwiGLU linear form (``gate_up_proj`` + ``npu_swiglu(dim=0)``) has no glue.
* *Fused lower bound* (per layer): the qwen_npu graph's non-matmul bytes without its glue: each
  fused op reads its inputs once and writes its outputs once, and only the work no family covers
  (residual adds, gradient accumulation, bias-gradient sums) remains.
* Time estimates (Atlas A2 figures, :data:`BANDWIDTH` and :data:`PEAK`, sourced): ``est_ms`` = non-matmul
  bytes / HBM bandwidth, a memory-traffic floor for the non-matmul work; ``roofline_ms`` = the sum over
  every kernel, matmuls and attention included, of ``max(FLOPs / Cube peak, bytes / bandwidth)``
  (:func:`kernel_flops`, :func:`kernel_time`; no launch overhead, no overlap).
* T×T tensors (:func:`square_tensor_count`): every tensor of the 1-layer graphs whose last two dims are
  ``S x S``, graph inputs and kernel outputs, attention included.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.fx
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.qwen2 import modeling_qwen2

from qwen_npu_compile.graph import canonicalize, emit
from qwen_npu_compile import ensure_npu_ops
from qwen_npu_compile.config import ALL_FAMILIES, QwenNpuConfig
from qwen_npu_compile.fusion.manager import fuse
from qwen_npu_compile.fusion.family import CompileTarget
from qwen_npu_compile.substitutions import deltanet
from qwen_npu_compile.ops.qwen_npu import gate_up_proj
from qwen_npu_compile.ops.limits import bound_arguments
from qwen_npu_compile.cli.check.models import resolve_model_config, tiny_qwen2_config, with_layers

from .common import MIB, progress
from .verl_patch import SOURCES as VERL_SOURCES
from .verl_patch import FA2_SOURCES, npu_flash_attention_2, verl_patches

aten = torch.ops.aten

#: Atlas A2 (Ascend 910B) figures of the time estimates, from the CANN developer guide "算子跨平台迁移指导"
#: (cross-platform operator migration guide), table "代际规格参数对比": AI Core 24 cores at 1.8 GHz, Cube
#: 353T/376T @BF16/FP16, Vector 23.5T (FP16), memory 64 GB at 1.6 TB/s, for "a representative
#: configuration" (the 910B2; ``../shared/reference/ascend-a2-figures.md``). 353.9e12 = 24 cores x 4096
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
#: :func:`_grouped_matmul_flops` (benchmarks/moe_traffic.py's rows).
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

#: The families a dense Qwen2 decoder layer holds (the fused lower bound is complete when each fused).
DENSE_LAYER_FAMILIES = ("rms_norm", "swiglu", "rotary", "attention")


#: How a variant's model runs attention (which decides the captured model code; see :func:`build_graphs`).
ATTENTION_MODES = {
    "sdpa": "transformers' SDPA attention (attn_implementation='sdpa'; packed: the [1, 1, T, T] mask)",
    "npu_fa2": "transformers' flash_attention_2 on NPU (benchmarks.verl_patch.npu_flash_attention_2): "
    "npu_fusion_attention in BSND (one sequence) or TND with actual_seq_qlen (packed), sparse_mode 3",
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running the model: which passes run, whether verl's monkey patches are on, and how the
    model's attention runs (:data:`ATTENTION_MODES`)."""

    name: str
    families: tuple[str, ...]
    verl: bool
    description: str
    attention: str = "sdpa"
    #: False: the attention pass may not prove a packed mask (:func:`explicit_mask_only`).
    varlen_recognition: bool = True

    @property
    def capture_key(self) -> tuple[bool, str]:
        """Variants with the same key run the same model code and share one Dynamo capture."""
        return self.verl, self.attention


VERL_DESCRIPTION = (
    "what verl runs on Ascend: npu_patch (RMSNorm, SwiGLU via cat, rotary on BNSD q/k fused) + transformers' "
    "NPU flash attention (npu_fusion_attention: BSND for one sequence, TND with actual_seq_qlen when packed; "
    "sparse_mode 3 with the 2048x2048 compressed mask); no pass of ours"
)

VARIANTS = (
    Variant("eager", (), False, "no fusion: the canonicalized graph of the unpatched model"),
    Variant("verl", (), True, VERL_DESCRIPTION, attention="npu_fa2"),
    Variant(
        "qwen_npu_no_attention",
        ("rms_norm", "swiglu", "rotary"),
        False,
        "qwen_npu with the verl set of families (rms_norm, swiglu, rotary): our rewrites, attention left to SDPA",
    ),
    Variant("qwen_npu", tuple(ALL_FAMILIES), False, "qwen_npu, every family (rms_norm, swiglu, rotary, attention)"),
)

#: The packed rows (``position_ids`` restarting per sequence, no attention mask: verl's use_remove_padding).
PACKED_VARIANTS = (
    Variant(
        "qwen_npu_explicit_mask",
        tuple(ALL_FAMILIES),
        False,
        "qwen_npu, every family, varlen recognition off: transformers' [1, 1, T, T] packed SDPA mask fused as "
        "npu_fusion_attention's explicit atten_mask (qwen_npu before issue 18)",
        varlen_recognition=False,
    ),
    Variant(
        "qwen_npu_varlen",
        tuple(ALL_FAMILIES),
        False,
        "qwen_npu, every family: the packed mask proven from position_ids (patterns/attention/varlen.py), "
        "attention as qwen_npu.varlen_attention (TND, seq_ends_from_positions once per graph; no T x T tensor)",
    ),
    Variant("verl", (), True, VERL_DESCRIPTION, attention="npu_fa2"),
)
HEADLINE_VARIANTS = ("eager", "verl", "qwen_npu")


# ----------------------------------------------------------------------------------------------------
# counting


def _tensors(value) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _node_args(node: torch.fx.Node) -> Iterable[torch.fx.Node]:
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
    if not any(True for _ in _tensors(node.meta.get("val"))):
        return "free"  # sym_size & co, ops returning only scalars
    if target in MATMUL_OPS or target._schema.name in GROUPED_MATMUL_OP_NAMES:
        return "matmul"
    if target._schema.name in ATTENTION_OP_NAMES:
        return "attention"
    if target.namespace == "npu":
        return "fused"
    return "vector"


#: What an unbacked size counts as (:func:`_dim`): the number of packed sequences of the graph measured.
_UNBACKED_SIZE: contextvars.ContextVar[int] = contextvars.ContextVar("unbacked_size", default=1)


def _dim(size) -> int:
    """A size or stride as an int. An unbacked SymInt, i.e. the data-dependent length of
    ``qwen_npu.seq_ends_from_positions``'s int64 output (one entry per packed sequence), counts as the
    number of sequences of the row being measured (:data:`_UNBACKED_SIZE`, set by :func:`graph_counts`)."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt) and not size.node.has_hint():
        return _UNBACKED_SIZE.get()
    return int(size)


def _numel(tensor: torch.Tensor) -> int:
    numel = 1
    for size in tensor.shape:
        numel *= _dim(size)
    return numel


def _unique_bytes(tensor: torch.Tensor) -> int:
    """Bytes a kernel reads from ``tensor``: broadcast (stride-0) dims count once."""
    sizes = [_dim(size) for size in tensor.shape]
    if any(size == 0 for size in sizes):
        return 0
    numel = 1
    for size, stride in zip(sizes, tensor.stride()):
        if _dim(stride) != 0:
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


def _schema_name(node: torch.fx.Node) -> str | None:
    target = node.target
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else None


def _varlen_mask_bytes(node: torch.fx.Node) -> int:
    """Bytes ``qwen_npu.varlen_attention``/``_backward`` read of the compressed causal mask they pass inside.

    The op calls ``npu_fusion_attention(_grad)(..., "TND", atten_mask=<2048x2048 bool>, sparse_mode=3)``
    (``ops/qwen_npu/varlen_attention.py``), so its kernel reads the mask although no graph node holds it:
    ``min(2048², T²)`` bytes, the rule of :func:`_compressed_mask_bytes` with ``Sq = Skv = T`` (what
    verl's TND call of ``npu_fusion_attention`` is charged too). 0 for any other node.
    """
    if _schema_name(node) not in VARLEN_OP_NAMES:
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
    written = sum(_numel(t) * t.element_size() for t in _tensors(node.meta.get("val")))
    if _schema_name(node) in METADATA_ONLY_OP_NAMES:
        return 0, written
    read = _varlen_mask_bytes(node)
    compressed_mask, compressed_bytes = _compressed_mask_bytes(node)
    for arg in _node_args(node):
        if arg is compressed_mask:
            read += compressed_bytes
            continue
        for tensor in _tensors(arg.meta.get("val")):
            read += _unique_bytes(tensor)
    return read, written


# ----------------------------------------------------------------------------------------------------
# the roofline


#: Where each matmul's contraction dim K is: ``(argument index, dim)`` of the left operand.
_MATMUL_K = {
    "aten::mm": 0, "aten::bmm": 0, "aten::matmul": 0, "aten::mv": 0, "aten::dot": 0, "aten::linear": 0,
    "aten::addmm": 1, "aten::baddbmm": 1, "aten::addmv": 1, "qwen_npu::gate_up_proj": 0,
}


def _grouped_matmul_flops(node: torch.fx.Node) -> int:
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
    name = _schema_name(node)
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
        return 2 * _dim(a.shape[0]) * _dim(a.shape[1]) * _dim(b.shape[1])
    out = sum(_numel(t) for t in _tensors(node.meta.get("val")))
    return 2 * out * _dim(a.shape[-1])


def _matmul_flops(node: torch.fx.Node) -> int:
    """``2·M·N·K`` of a matmul kernel: 2 x (elements of its output) x K (the left operand's last dim);
    grouped matmuls: :func:`_grouped_matmul_flops`."""
    if _schema_name(node) in GROUPED_MATMUL_OP_NAMES:
        return _grouped_matmul_flops(node)
    left = node.args[_MATMUL_K[_schema_name(node)]].meta["val"]
    out = sum(_numel(t) for t in _tensors(node.meta.get("val")))
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
    name = _schema_name(node)
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
    name = _schema_name(node)
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


def _through_free(start, step) -> Iterator[torch.fx.Node]:
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
    return any(_is_fused(node) for node in _through_free(start, step))


def _feeds_fused(node: torch.fx.Node) -> bool:
    return _reaches_fused(node.users, lambda n: n.users)


def _feeds_fused_through_matmul(node: torch.fx.Node) -> bool:
    """Whether ``node`` feeds (through views) a matmul whose output feeds (through views) a fused op:
    an in-graph weight concatenation such as ``cat([w_gate, w_up])``."""
    return any(classify(user) == "matmul" and _feeds_fused(user) for user in _through_free(node.users, lambda n: n.users))


def _fed_by_fused(node: torch.fx.Node) -> bool:
    return _reaches_fused(_node_args(node), _node_args)


def is_glue(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a copy made for a fused npu op (see the module docstring).

    Input glue: a cat/clone/_to_copy/logical_not whose output feeds a fused op (through views).
    Weight glue: a ``cat`` feeding a matmul whose output feeds a fused op (the merged gate/up weight
    built in the graph). Output glue: a ``_to_copy`` (dtype cast) of a fused op's output. A clone *of* a fused op's output
    that feeds something else (repeat_kv after a fused rotary) is ordinary work, not glue.
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


def swiglu_forward_bytes(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Bytes of the SwiGLU elementwise work in a forward graph (matmuls excluded).

    Unfused: ``silu(gate)`` plus the ``mul`` consuming it; fused: ``npu_swiglu`` plus the glue copies
    feeding it (verl's ``cat`` of gate and up; none for our ``gate_up_proj`` buffer). In a 1-layer graph
    this is exactly one layer's MLP.

    Returns:
        ``{"silu_mul": bytes, "npu_swiglu": bytes, "input_glue": bytes}``.
    """
    out = {"silu_mul": 0, "npu_swiglu": 0, "input_glue": 0}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is aten.silu.default:
            out["silu_mul"] += sum(node_bytes(node))
            out["silu_mul"] += sum(sum(node_bytes(u)) for u in node.users if u.target is aten.mul.Tensor)
        elif node.target._schema.name == "npu::npu_swiglu":
            out["npu_swiglu"] += sum(node_bytes(node))
            out["input_glue"] += sum(sum(node_bytes(arg)) for arg in _through_free(_node_args(node), _node_args)
                                     if is_glue(arg))  # glue is a vector op: the walk stops there
    return out


_NUMERIC = ("kernels", "bytes_read", "bytes_written", "glue_kernels", "glue_bytes", "flops", "roofline_ps")


def subtract(big: dict[str, dict], small: dict[str, dict]) -> dict[str, dict]:
    """Op-by-op ``big - small`` (zero rows dropped)."""
    out = {}
    for name in sorted(set(big) | set(small)):
        a, b = big.get(name), small.get(name)
        category = (a or b)["category"]
        row = {"category": category}
        for key in _NUMERIC:
            row[key] = (a[key] if a else 0) - (b[key] if b else 0)
        if any(row[key] for key in _NUMERIC):
            out[name] = row
    return out


def summarize(table: dict[str, dict]) -> dict:
    """Totals of a per-op table: kernels by category, non-matmul bytes split attention / rest, glue."""
    kernels = Counter()
    bytes_by = Counter()
    glue = Counter()
    for row in table.values():
        kernels[row["category"]] += row["kernels"]
        moved = row["bytes_read"] + row["bytes_written"]
        bytes_by[row["category"]] += moved
        glue["kernels"] += row["glue_kernels"]
        glue["bytes"] += row["glue_bytes"]
    non_matmul = bytes_by["attention"] + bytes_by["fused"] + bytes_by["vector"]
    roofline = Counter()
    flops = Counter()
    for row in table.values():
        roofline[row["category"]] += row.get("roofline_ps", 0)
        flops[row["category"]] += row.get("flops", 0)
    return {
        "flops": {"total": sum(flops.values()), "matmul": flops["matmul"], "attention": flops["attention"]},
        "roofline_ms": {"total": sum(roofline.values()) * 1e-9, **{c: roofline[c] * 1e-9 for c in CATEGORIES}},
        "kernels": {"total": sum(kernels.values()), **{c: kernels[c] for c in CATEGORIES}},
        "bytes": {
            "non_matmul": non_matmul,
            "attention": bytes_by["attention"],
            "vector_and_fused": bytes_by["fused"] + bytes_by["vector"],
            "glue": glue["bytes"],
        },
        "glue_kernels": glue["kernels"],
    }


def has_negative(table: dict[str, dict]) -> list[str]:
    """Ops whose per-layer difference went negative (the layer split is then not clean)."""
    return [name for name, row in table.items() if any(row[key] < 0 for key in _NUMERIC)]


# ----------------------------------------------------------------------------------------------------
# graph building


#: The checks run as they would for an Ascend host: torchair downstream, real npu ops.
MODELLED_TARGET = CompileTarget("torchair", simulated=False)


@contextlib.contextmanager
def explicit_mask_only() -> Iterator[None]:
    """Within the block, no attention mask is proven packed: the attention pass fuses transformers'
    ``[1, 1, T, T]`` packed mask as an explicit ``atten_mask`` (qwen_npu before the varlen recognition,
    ``patterns/attention/varlen.py``). Its varlen variants then refuse with this reason."""
    from unittest import mock

    from qwen_npu_compile.patterns.attention import varlen as attention_varlen

    reason = "varlen recognition off (benchmarks.traffic.explicit_mask_only: the explicit-mask configuration)"
    with mock.patch.object(attention_varlen, "packed_mask", lambda mask: reason):
        yield


def recording_compiler(slot: dict, kind: str):
    """An AOTAutograd forward/backward compiler that keeps the graph it gets in ``slot[kind]`` and runs it as is."""
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        slot[kind] = gm
        return make_boxed_func(gm.forward)

    return compiler


def build_graphs(
    config: transformers.Qwen2Config,
    layers: int,
    variants: Sequence[Variant],
    batch: int,
    seq: int,
    dtype: torch.dtype,
    inference: bool = False,
    packing: Sequence[int] | None = None,
) -> dict[str, dict]:
    """Capture ``layers`` decoder layers once under fake tensors; return each variant's AOT graphs.

    The variants share one Dynamo capture (they must agree on :attr:`Variant.capture_key`: verl's patches
    and the attention mode change the model code); each gets its own canonical ATen graph, its passes and
    its AOTAutograd run, with the backward compiled eagerly (``force_non_lazy_backward_lowering``), so
    nothing has to run.

    Packed rows (``packing``): the model also gets ``position_ids`` ``[1, T]`` (a fake int64 tensor: the
    graph is the same for any values; verl's restart at 0 per sequence); ``npu_fa2`` gets the packing
    itself (:func:`benchmarks.verl_patch.npu_flash_attention_2`). Nothing of size T x T is allocated:
    every tensor is fake, and the varlen recognition's proof is structural.

    Args:
        config: the full model config (only its shapes are used).
        layers: decoder layers to build (1 or 2 here).
        variants: the variants to build from this capture.
        batch: B; seq: S (tokens).
        dtype: parameter and activation dtype.
        inference: ``model.eval()`` under ``torch.no_grad()`` (a log-prob forward): only a forward graph.
        packing: packed sequence lengths summing to ``seq`` (B must be 1), or None (one sequence per row).

    Returns:
        Per variant name: ``{"forward": GraphModule, "backward": GraphModule (training only), "fusions": {family: count},
        "refusals": [reason, ...]}``, plus ``"seconds"`` (wall time of the whole capture, float).

    Raises:
        ValueError: the variants disagree on their capture key, or ``packing`` does not fit ``batch``/``seq``.
        RuntimeError: AOTAutograd did not hand over both graphs.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config

    if len({v.capture_key for v in variants}) != 1:
        raise ValueError("variants sharing one capture must agree on the verl patches and the attention mode")
    if packing is not None and (batch != 1 or sum(packing) != seq):
        raise ValueError(f"packing {tuple(packing)} must sum to S={seq} in one row (B=1), got B={batch}")
    attention = variants[0].attention
    ensure_npu_ops()
    cfg = with_layers(config, layers)
    captured: dict[str, dict] = {v.name: {"fusions": {}, "refusals": []} for v in variants}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        for variant in variants:
            slot = captured[variant.name]
            aten_gm = canonicalize.to_aten_graph(gm, example_inputs)
            recognition = contextlib.nullcontext() if variant.varlen_recognition else explicit_mask_only()
            with recognition:
                result = fuse(aten_gm, QwenNpuConfig(fusions=frozenset(variant.families)), target=MODELLED_TARGET)
            emit.finalize(aten_gm)
            slot["fusions"] = result.fusions
            slot["refusals"] = sorted({f"{r.family}: {r.reason}" for r in result.refusals if r.family in variant.families})
            # tensor constants become trailing inputs, as in the backend (transformers 4.x's mask scalars)
            inputs = [*example_inputs, *(fake_mode.from_tensor(c) for c in emit.lift_constants(aten_gm))]
            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                aot_autograd(fw_compiler=recording_compiler(slot, "forward"),
                             bw_compiler=recording_compiler(slot, "backward"))(aten_gm, inputs)
        return gm.forward  # both graphs are recorded; Dynamo runs the captured graph once, on fake tensors

    start = time.perf_counter()
    with fresh_capture(variants), contextlib.ExitStack() as stack:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        kwargs = {}
        with fake_mode:
            model = modeling_qwen2.Qwen2Model._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
            inputs_embeds = torch.empty(batch, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
            if packing is not None:
                kwargs["position_ids"] = torch.empty(1, seq, dtype=torch.int64)
        if attention == "npu_fa2":
            stack.enter_context(npu_flash_attention_2(model, packing or (seq,)))
        if not inference:
            model.norm = torch.nn.Identity()  # count decoder layers only (no final norm)
        # inference keeps the final norm: with it every layer's 2 norms follow a residual add in both
        # L=1 and L=2 (npu_add_rms_norm), and per_forward holds layer 0's add-free input norm instead
        model.train(not inference)
        if inference:
            inputs_embeds.requires_grad_(False)
        with torch.set_grad_enabled(not inference):
            torch.compile(model, backend=backend, fullgraph=True)(inputs_embeds=inputs_embeds, **kwargs)
    torch._dynamo.reset()
    return _handed_over(captured, inference, start)


def _handed_over(captured: dict[str, dict], inference: bool, start: float) -> dict:
    """``captured`` with ``"seconds"`` since ``start``, after checking that AOTAutograd handed every variant its
    forward graph (and, training, its backward graph); RuntimeError naming the variant otherwise."""
    for name, slot in captured.items():
        if "forward" not in slot or ("backward" not in slot and not inference):
            raise RuntimeError(f"{name}: AOTAutograd did not hand over both graphs ({sorted(slot)})")
    return {**captured, "seconds": time.perf_counter() - start}


@dataclasses.dataclass(frozen=True)
class LayerVariant:
    """One way of running a model's decoder layers in the per-layer benchmarks (:mod:`benchmarks.moe_traffic`'s
    ``MoeVariant``, :mod:`benchmarks.qwen3_5_traffic`'s ``Qwen35Variant``; their module docstrings name them).

    Attributes:
        name: key in the results.
        families: the qwen_npu families whose passes run (empty: none).
        verl: the model's verl ``npu_patch`` and transformers' NPU flash attention (one capture of its own).
        description: one line for the results.
    """

    name: str
    families: tuple[str, ...]
    verl: bool
    description: str


@contextlib.contextmanager
def fresh_capture(variants: Sequence[LayerVariant], patches=verl_patches) -> Iterator[None]:
    """Reset Dynamo and, inside the block, what a new capture of ``variants`` traces: ``patches()`` (verl's patches of
    the model code captured; Qwen2's by default) for verl variants, and the DeltaNet substitution, decided while
    Dynamo traces, so set for the whole capture: on only if every variant has the ``gated_delta_rule`` family. The
    substitution's previous setting is restored on exit (it is process-wide: later compiles must not inherit it)."""
    torch._dynamo.reset()
    with deltanet.switched(all("gated_delta_rule" in v.families for v in variants)):
        with patches() if variants[0].verl else contextlib.nullcontext():
            yield


def capture_layers(model_class, cfg, variants: Sequence, tokens: int, dtype: torch.dtype, inference: bool,
                   verl_patches, *, canonical=lambda variant: True) -> dict[str, dict]:
    """Capture the decoder layers of ``model_class`` built from ``cfg`` once under fake tensors (one row of
    ``tokens``); each variant's AOT graphs: the MoE and Qwen3.5 benchmarks' capture (:mod:`benchmarks.moe_traffic`,
    :mod:`benchmarks.qwen3_5_traffic`; :func:`build_graphs` is the dense one, with padding and packing).

    The variants must agree on ``verl`` (one Dynamo capture of one model code; ``verl_patches()`` is entered for
    verl variants). Each gets the canonical ATen graph (unless ``canonical(variant)`` is False: a graph applying a
    custom ``autograd.Function``, which canonicalization refuses, is handed over as captured), its passes
    (:func:`qwen_npu_compile.fusion.manager.fuse`, checks as for torchair on an NPU) and
    :func:`qwen_npu_compile.graph.emit.finalize`, then AOTAutograd (backward compiled eagerly).

    Returns:
        Per variant name ``{"forward": GraphModule, "backward": GraphModule (training), "fusions": {family: n}}``,
        plus ``"seconds"`` (wall time, float).

    Raises:
        ValueError: the variants disagree on ``verl``. RuntimeError: AOTAutograd did not hand over the graphs.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config

    if len({v.verl for v in variants}) != 1:
        raise ValueError("variants sharing one capture must agree on verl's patches")
    ensure_npu_ops()
    captured: dict[str, dict] = {v.name: {"fusions": {}} for v in variants}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        for variant in variants:
            slot = captured[variant.name]
            if not canonical(variant):
                graph, inputs = gm, list(example_inputs)
            else:
                graph = canonicalize.to_aten_graph(gm, example_inputs)
                result = fuse(graph, QwenNpuConfig(fusions=frozenset(variant.families)), target=MODELLED_TARGET)
                emit.finalize(graph)
                slot["fusions"] = dict(result.fusions)
                inputs = [*example_inputs, *(fake_mode.from_tensor(c) for c in emit.lift_constants(graph))]
            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                aot_autograd(fw_compiler=recording_compiler(slot, "forward"),
                             bw_compiler=recording_compiler(slot, "backward"))(graph, inputs)
        return gm.forward

    start = time.perf_counter()
    with fresh_capture(variants, verl_patches), contextlib.ExitStack() as stack:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            model = model_class._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
            inputs_embeds = torch.empty(1, tokens, cfg.hidden_size, dtype=dtype, requires_grad=not inference)
        if variants[0].verl:
            stack.enter_context(npu_flash_attention_2(model, (tokens,)))
        if not inference:
            model.norm = torch.nn.Identity()  # decoder layers only
        model.train(not inference)
        with torch.set_grad_enabled(not inference):
            torch.compile(model, backend=backend, fullgraph=True)(inputs_embeds=inputs_embeds)
    torch._dynamo.reset()
    return _handed_over(captured, inference, start)


def per_kind(kinds: Sequence[str], fn) -> dict:
    """``{kind: fn(kind), ..., "total": sum}`` over the graph kinds (forward, backward)."""
    values = {kind: fn(kind) for kind in kinds}
    return {**values, "total": sum(values.values())}


def capture_verl(variant) -> tuple[bool]:
    """What a Dynamo capture is shared by: verl's patches on or off."""
    return (variant.verl,)


def capture_verl_deltanet(variant) -> tuple[bool, bool]:
    """:func:`capture_verl` for models with a Gated DeltaNet: also whether its delta rule is substituted by
    ``qwen_npu::chunk_gated_delta_rule`` while Dynamo traces (the ``gated_delta_rule`` family,
    :mod:`qwen_npu_compile.substitutions.deltanet`), which a capture fixes for all its variants."""
    return variant.verl, "gated_delta_rule" in variant.families


def per_layer_splits(build, variants: Sequence, inference: bool, counts=graph_counts, where: str = "",
                     key=capture_verl) -> Iterator[tuple]:
    """The per-layer tables of the per-layer benchmarks (:mod:`benchmarks.moe_traffic`, :mod:`benchmarks.qwen3_5_traffic`):
    per group of variants sharing a capture (``key``: :func:`capture_verl`), ``build(1, group)`` and ``build(2, group)`` (captures of
    :func:`capture_layers`); per variant, each graph kind's table (``counts``) of 2 layers minus that of 1.

    Yields:
        ``(variant, captures of 1 layer, of 2 layers, {kind: per-layer table}, capture seconds)``, grouped by ``verl``.

    Raises:
        RuntimeError: a per-layer table went negative (the message names ``where`` before the graph kind).
    """
    kinds = _kinds(inference)
    for shared in dict.fromkeys(key(v) for v in variants):
        group = [v for v in variants if key(v) == shared]
        one, two = build(1, group), build(2, group)
        for variant in group:
            g1, g2 = one[variant.name], two[variant.name]
            layer = {}
            for kind in kinds:
                layer[kind] = subtract(counts(g2[kind]), counts(g1[kind]))
                bad = has_negative(layer[kind])
                if bad:
                    raise RuntimeError(f"{variant.name} {where}{kind}: per-layer split went negative for {bad}")
            yield variant, g1, g2, layer, one["seconds"] + two["seconds"]


def layer_row(variant, g1: dict, g2: dict, layer: dict[str, dict], seconds: float,
              after: dict[str, dict] | None = None) -> dict:
    """The fields every per-layer row has (description, families, fusions, kernels, bytes read / written /
    non-matmul / glue, FLOPs, est. and roofline ms per graph kind, roofline by category, capture seconds, the
    per-op tables), each followed by the benchmark's own fields ``after[field]``.

    Args:
        variant: a :class:`LayerVariant`.
        g1: its capture of 1 layer; g2: of 2 layers (their ``fusions``).
        layer: per graph kind, the per-layer table (:func:`per_layer_splits`).
        seconds: the capture time.
        after: the benchmark's own fields, by the common field they follow.
    """
    kinds = tuple(layer)
    sums = {k: summarize(layer[k]) for k in kinds}
    fields = {
        "description": variant.description,
        "families": list(variant.families),
        "fusions_per_layer": {f: n - g1["fusions"].get(f, 0) for f, n in g2["fusions"].items()
                              if n or g1["fusions"].get(f)},
        "kernels": per_kind(kinds, lambda k: sums[k]["kernels"]["total"]),
        "bytes_read": per_kind(kinds, lambda k: sum(r["bytes_read"] for r in layer[k].values())),
        "bytes_written": per_kind(kinds, lambda k: sum(r["bytes_written"] for r in layer[k].values())),
        "bytes": per_kind(kinds, lambda k: sums[k]["bytes"]["non_matmul"]),
        "glue_bytes": per_kind(kinds, lambda k: sums[k]["bytes"]["glue"]),
        "flops": per_kind(kinds, lambda k: sums[k]["flops"]["total"]),
        "est_ms": per_kind(kinds, lambda k: _ms(sums[k]["bytes"]["non_matmul"])),
        "roofline_ms": per_kind(kinds, lambda k: sums[k]["roofline_ms"]["total"]),
        "roofline_ms_by_category": {c: sum(sums[k]["roofline_ms"][c] for k in kinds) for c in CATEGORIES},
        "capture_seconds": round(seconds, 2),
        "by_op": layer,
    }
    row = {}
    for key, value in fields.items():
        row[key] = value
        row.update((after or {}).get(key, {}))
    return row


def row_line(row: dict) -> str:
    """A per-layer row's progress line: ``kernels 9 / 14, 3 + 5 MiB non-matmul (glue 0), 0.12 TFLOP, est 0.01 ms,
    roofline 0.05 ms``."""
    kinds = [k for k in ("forward", "backward") if k in row["kernels"]]
    kernels = " / ".join(str(row["kernels"][k]) for k in kinds)
    mib = " + ".join(f"{row['bytes'][k] / MIB:,.0f}" for k in kinds)
    return (f"kernels {kernels}, {mib} MiB non-matmul (glue {row['glue_bytes']['total'] / MIB:,.0f}), "
            f"{row['flops']['total'] / 1e12:.2f} TFLOP, est {row['est_ms']['total']:.2f} ms, "
            f"roofline {row['roofline_ms']['total']:.2f} ms")


def per_layer_tables(config, variants: Sequence[Variant], batch: int, seq: int, dtype: torch.dtype,
                     inference: bool = False, packing: Sequence[int] | None = None) -> dict:
    """Per-op tables per layer and per forward, for the forward and backward graphs of each variant.

    Variants are grouped by :attr:`Variant.capture_key` so that each group costs one Dynamo capture per
    layer count.

    Returns:
        Per variant name: ``{"per_layer": {"forward": table, "backward": table}, "per_forward": {...},
        "fusions_per_layer": {family: count}, "refusals": [...], "square_tensors": {...}, "seconds": float}``
        (seconds: of its group).
    """
    results = {}
    keys = list(dict.fromkeys(v.capture_key for v in variants))
    lengths = tuple(packing) if packing else (seq,) * batch
    for key in keys:
        group = [v for v in variants if v.capture_key == key]
        names = ", ".join(v.name for v in group)
        progress(f"traffic:   capture L=1 and L=2 for {names} ...")
        one = build_graphs(config, 1, group, batch, seq, dtype, inference, packing)
        two = build_graphs(config, 2, group, batch, seq, dtype, inference, packing)
        for variant in group:
            g1, g2 = one[variant.name], two[variant.name]
            result = {"per_layer": {}, "per_forward": {}, "seconds": one["seconds"] + two["seconds"]}
            result["square_tensors_per_forward"] = square_tensors(g1["forward"], seq)
            result["square_tensors"] = {kind: square_tensor_count(g1[kind], seq) for kind in _kinds(inference)}
            for kind in _kinds(inference):
                t1, t2 = graph_counts(g1[kind], lengths), graph_counts(g2[kind], lengths)
                layer = subtract(t2, t1)
                result["per_layer"][kind] = layer
                result["per_forward"][kind] = subtract(t1, layer)
                bad = has_negative(layer) + has_negative(result["per_forward"][kind])
                if bad:
                    raise RuntimeError(f"{variant.name} {kind}: per-layer split went negative for {bad}")
            # families that fused nothing in either graph (e.g. moe in a dense model) are left out
            result["fusions_per_layer"] = {f: g2["fusions"][f] - g1["fusions"][f] for f in g1["fusions"]
                                           if g1["fusions"][f] or g2["fusions"].get(f)}
            result["swiglu_forward"] = swiglu_forward_bytes(g1["forward"])
            result["refusals"] = g2["refusals"]
            results[variant.name] = result
    return {v.name: results[v.name] for v in variants}


def _kinds(inference: bool) -> tuple[str, ...]:
    return ("forward",) if inference else ("forward", "backward")


def square_tensors(gm: torch.fx.GraphModule, seq: int) -> dict[str, int]:
    """The ``[..., S, S]`` tensors a forward graph computes (attention masks), kernels outside attention.

    Returns:
        ``{"tensors": n, "bytes": their bytes, "traffic": bytes read + written by kernels that read or
        write an S×S tensor}``: the mask's memory and traffic (0 when no S×S tensor exists).
    """
    def square(value) -> bool:
        return any(t.dim() >= 2 and tuple(_dim(d) for d in t.shape[-2:]) == (seq, seq) for t in _tensors(value))

    out = {"tensors": 0, "bytes": 0, "traffic": 0}
    for node in gm.graph.nodes:
        category = classify(node)
        if category in (None, "matmul", "attention"):
            continue
        writes = square(node.meta.get("val"))
        reads = any(square(arg.meta.get("val")) for arg in _node_args(node))
        if category != "free" and (writes or reads):
            out["traffic"] += sum(node_bytes(node))
        if writes and category != "free":
            out["tensors"] += 1
            out["bytes"] += sum(_numel(t) * t.element_size() for t in _tensors(node.meta.get("val")))
    return out


def square_tensor_count(gm: torch.fx.GraphModule, seq: int) -> dict[str, int]:
    """Every tensor of ``gm`` whose last two dims are ``S x S`` (T x T for a packed row), attention included.

    Counts the graph's inputs (``placeholder``: e.g. a mask saved for the backward) and the outputs of
    every kernel (views excluded: they allocate nothing), whatever the kernel, plus the kernels that
    read one. A varlen graph must have none.

    Returns:
        ``{"tensors": inputs + written, "inputs": n, "written": n, "bytes": bytes of those tensors,
        "kernels_reading": n}``.
    """
    def square(value) -> list[torch.Tensor]:
        return [t for t in _tensors(value) if t.dim() >= 2 and tuple(_dim(d) for d in t.shape[-2:]) == (seq, seq)]

    out = {"tensors": 0, "inputs": 0, "written": 0, "bytes": 0, "kernels_reading": 0}
    for node in gm.graph.nodes:
        category = "input" if node.op == "placeholder" else classify(node)
        if category is None:
            continue
        found = square(node.meta.get("val"))
        if found and category != "free":
            out["inputs" if category == "input" else "written"] += len(found)
            out["bytes"] += sum(_numel(t) * t.element_size() for t in found)
        if category not in ("input", "free") and any(square(arg.meta.get("val")) for arg in _node_args(node)):
            out["kernels_reading"] += 1
    out["tensors"] = out["inputs"] + out["written"]
    return out


def math_backward_bound(shape: dict) -> dict:
    """An independent lower bound of one decoder layer's non-matmul backward bytes, from its math alone.

    What an ideal fused backward must read and write once (tokens T = B·S, element size b of the
    activation dtype; matmuls excluded, as everywhere here):

    * SwiGLU: read the incoming gradient ``[T, I]`` and the saved gate/up ``[T, 2I]``, write
      d(gate, up) ``[T, 2I]``: ``5·T·I·b``.
    * Each of the 2 RMSNorms, with the residual-gradient add fused in: read dy, the saved input and the
      residual gradient ``[T, H]``, write dx ``[T, H]``: ``4·T·H·b``; plus rstd (``4·T`` bytes) and
      gamma/dgamma (``H·(b + 4)``).
    * Attention (flash backward): read q, dO, O ``[T, Nq·D]``, k, v ``[T, Nkv·D]`` and the softmax
      statistics (2 × ``[T, Nq, 8]`` fp32), write dq, dk, dv: ``(3·Nq + 4·Nkv)·D·T·b + 64·T·Nq``.
    * Rotary on q and k: read and write dq, dk: ``2·(Nq + Nkv)·D·T·b`` (cos/sin ``2·S·D·b`` more).
    * Bias gradients, the dx accumulation of the q/k/v and gate/up projections: 0 (fused into the
      kernels that produce those gradients, or accumulated by the matmuls).

    Args:
        shape: :func:`model_shape`'s dict.

    Returns:
        ``{"bytes": total, "terms": {name: bytes}}``.
    """
    b = torch.empty((), dtype=getattr(torch, shape["dtype"])).element_size()
    tokens = shape["batch"] * shape["seq_len"]
    hidden, inter, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    nq, nkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    terms = {
        "swiglu": 5 * tokens * inter * b,
        "rms_norm_x2_with_residual_grad": 2 * (4 * tokens * hidden * b + 4 * tokens + hidden * (b + 4)),
        "attention": (3 * nq + 4 * nkv) * head_dim * tokens * b + 64 * tokens * nq,
        "rotary_q_k": 2 * (nq + nkv) * head_dim * tokens * b + 2 * shape["seq_len"] * head_dim * b,
    }
    return {"bytes": sum(terms.values()), "terms": terms}


# ----------------------------------------------------------------------------------------------------
# the report


def model_shape(config, batch: int, seq: int, dtype: torch.dtype, packing: Sequence[int] | None = None) -> dict:
    """The shape fields a reader needs to check the numbers (``packing``: the packed sequence lengths)."""
    heads = config.num_attention_heads
    shape = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "batch": batch,
        "seq_len": seq,
        "dtype": str(dtype).replace("torch.", ""),
    }
    if packing is not None:
        shape["packing"] = [int(n) for n in packing]
    return shape


def _ms(num_bytes: float) -> float:
    return num_bytes / BANDWIDTH["bytes_per_second"] * 1e3


def measure_model(
    name: str,
    config,
    batch: int,
    seq: int,
    dtype: torch.dtype,
    variants: Iterable[Variant] = VARIANTS,
    inference: bool = False,
    packing: Sequence[int] | None = None,
) -> dict:
    """Every variant of one model: per-layer kernels, bytes, ratio to the fused lower bound, ms, roofline.

    Args:
        name: label in the results (a preset name).
        config: its :class:`transformers.Qwen2Config`.
        batch, seq: B and S.
        dtype: bf16 in the real runs.
        variants: which :class:`Variant` objects (the lower bound needs ``qwen_npu``).
        inference: measure a no-grad ``eval()`` forward (forward graph only) instead of training.
        packing: packed sequence lengths (one row, summing to ``seq``), or None.
    """
    kinds = _kinds(inference)
    out = {"shape": model_shape(config, batch, seq, dtype, packing), "mode": "inference" if inference else "training",
           "variants": {}}
    variants = list(variants)
    progress(f"traffic: {name} B={batch} S={seq}{' packed ' + str(len(packing)) + ' seqs' if packing else ''} "
             f"{out['mode']} ({', '.join(v.name for v in variants)}; fake tensors) ...")
    all_tables = per_layer_tables(config, variants, batch, seq, dtype, inference, packing)
    for variant in variants:
        tables = all_tables[variant.name]
        entry = {
            "description": variant.description,
            "families": list(variant.families),
            "attention": variant.attention,
            "fusions_per_layer": tables["fusions_per_layer"],
            "refusals": tables["refusals"],
            "capture_seconds": round(tables["seconds"], 2),
            "swiglu_forward_bytes_per_layer": tables["swiglu_forward"],
            "square_tensors_per_forward": tables["square_tensors_per_forward"],
            "square_tensors": tables["square_tensors"],
            "per_layer": {},
            "per_forward": {},
        }
        for scope in ("per_layer", "per_forward"):
            for kind in kinds:
                entry[scope][kind] = {**summarize(tables[scope][kind]), "by_op": tables[scope][kind]}
        out["variants"][variant.name] = entry
        layer = entry["per_layer"]
        moved = {k: layer[k]["bytes"]["non_matmul"] for k in kinds}
        moved["total"] = sum(moved[k] for k in kinds)
        entry["bytes_per_layer"] = moved
        entry["est_ms_per_layer"] = {k: _ms(v) for k, v in moved.items()}
        entry["kernels_per_layer"] = {k: layer[k]["kernels"]["total"] for k in kinds}
        roof = {k: layer[k]["roofline_ms"] for k in kinds}
        entry["roofline_ms_per_layer"] = {
            **{k: roof[k]["total"] for k in kinds},
            "total": sum(roof[k]["total"] for k in kinds),
            "by_category": {c: sum(roof[k][c] for k in kinds) for c in CATEGORIES},
        }
        entry["attention_flops_per_layer"] = sum(layer[k]["flops"]["attention"] for k in kinds)
        entry["matmul_flops_per_layer"] = sum(layer[k]["flops"]["matmul"] for k in kinds)
        progress(
            f"traffic: {name} {variant.name}: fused {tables['fusions_per_layer'] or '-'}; per layer "
            + "/".join(kinds) + " "
            + "/".join(str(layer[k]["kernels"]["total"]) for k in kinds) + " kernels, "
            + "/".join(f"{layer[k]['bytes']['non_matmul'] / MIB:.0f}" for k in kinds) + " MiB non-matmul, roofline "
            + f"{entry['roofline_ms_per_layer']['total']:.2f} ms; "
            + f"{sum(sq['tensors'] for sq in tables['square_tensors'].values())} SxS tensors"
        )

    reference = out["variants"].get("qwen_npu")
    if reference is None:
        return out
    bound = {}
    for kind in kinds:
        b = reference["per_layer"][kind]["bytes"]
        bound[kind] = b["non_matmul"] - b["glue"]
    bound["total"] = sum(bound[kind] for kind in kinds)
    out["lower_bound"] = {
        "definition": "qwen_npu per-layer non-matmul bytes minus its glue copies: every fused op reads its "
        "inputs once and writes its outputs once; only work no family covers (residual adds, gradient "
        "accumulation, bias-gradient sums) remains",
        "families_fused_in_reference": reference["fusions_per_layer"],
        # a family that fused nothing leaves its unfused subgraph in the bound: then it is no bound
        "complete": all(reference["fusions_per_layer"].get(f, 0) > 0 for f in DENSE_LAYER_FAMILIES),
        "bytes_per_layer": bound,
        "est_ms_per_layer": {k: _ms(v) for k, v in bound.items()},
    }
    if not inference:
        math_bound = math_backward_bound(out["shape"])
        out["lower_bound"]["math_backward"] = {
            "definition": "independent of any graph: what an ideal fused backward must read and write "
            "(benchmarks.traffic.math_backward_bound)",
            **math_bound,
        }
    for entry in out["variants"].values():
        moved = entry["bytes_per_layer"]
        entry["ratio_to_lower_bound"] = {k: moved[k] / bound[k] for k in moved}
        if not inference:
            entry["ratio_to_math_backward_bound"] = moved["backward"] / out["lower_bound"]["math_backward"]["bytes"]
    return out


def verl_step(training: dict, inference: dict, layers: int) -> dict:
    """One verl step: a training forward + backward and two inference forwards (reference and old-policy
    log-probs), per decoder layer and for the whole model's decoder stack.

    Args:
        training, inference: :func:`measure_model` results of one model and shape.
        layers: the model's number of decoder layers.

    Returns:
        Per variant: ``{"bytes_per_layer", "bytes_per_step", "est_ms_per_step"}``; per step = layers ×
        per layer + the once-per-forward work (mask, cos/sin) of the three forwards.
    """
    out = {}
    for name, train in training["variants"].items():
        infer = inference["variants"].get(name)
        if infer is None:
            continue
        per_layer = train["bytes_per_layer"]["total"] + 2 * infer["bytes_per_layer"]["total"]
        per_forward = sum(train["per_forward"][k]["bytes"]["non_matmul"] for k in ("forward", "backward"))
        per_forward += 2 * infer["per_forward"]["forward"]["bytes"]["non_matmul"]
        step = layers * per_layer + per_forward
        out[name] = {"bytes_per_layer": per_layer, "bytes_per_step": step, "per_forward_bytes": per_forward,
                     "est_ms_per_step": _ms(step)}
    return out


#: The packed rows of the full run: Qwen2.5-7B, T = 16384 tokens in one row (verl's use_remove_padding).
PACKINGS = {"16x1024": (1024,) * 16, "4x4096": (4096,) * 4}
#: The packed row of the quick run (tiny model, T = 40: no other dim of the tiny model is 40, so the T x T
#: count cannot mistake a weight for a mask; unequal lengths, so that Σ len² differs from B·len²).
QUICK_PACKINGS = {"8+16+16": (8, 16, 16)}


def measure_packed(
    name: str, config, packing: Sequence[int], dtype: torch.dtype, modes: Sequence[str] = ("training", "inference")
) -> dict:
    """The packed rows of one model and packing (one row of ``sum(packing)`` tokens), :data:`PACKED_VARIANTS`.

    Args:
        modes: ``"training"`` (forward + backward) and/or ``"inference"`` (no-grad eval forward).

    Returns:
        ``{mode: measure_model(...), "ratios": {mode: {...}}}``; ratios are per layer, explicit mask ÷
        varlen and verl ÷ varlen, of non-matmul bytes, of the roofline time and of the attention FLOPs.
    """
    seq = sum(packing)
    out = {}
    for mode in modes:
        out[mode] = measure_model(name, config, 1, seq, dtype, PACKED_VARIANTS, inference=mode == "inference",
                                  packing=packing)
    out["ratios"] = {}
    for mode in modes:
        v = out[mode]["variants"]
        varlen = v["qwen_npu_varlen"]
        out["ratios"][mode] = {
            other: {
                "bytes": v[other]["bytes_per_layer"]["total"] / varlen["bytes_per_layer"]["total"],
                "roofline": v[other]["roofline_ms_per_layer"]["total"] / varlen["roofline_ms_per_layer"]["total"],
                "attention_flops": v[other]["attention_flops_per_layer"] / varlen["attention_flops_per_layer"],
            }
            for other in ("qwen_npu_explicit_mask", "verl")
        }
    return out


def run(quick: bool = False) -> dict:
    """Part 1 for Qwen2.5-0.5B and Qwen2.5-7B at B=1, bf16: training at S=4096 (every variant) and
    S=32768 (eager, verl, qwen_npu), inference forwards at both, the verl-step view, and the packed rows
    (Qwen2.5-7B, T=16384 as 16 x 1024 and 4 x 4096, training and inference: explicit mask, varlen, verl).

    Args:
        quick: a tiny model (hidden 64) at S=64, only the headline variants (eager, verl, qwen_npu), and
            one packed training row (T=40 as 8 + 16 + 16).

    Returns:
        The ``kernel_traffic.json`` payload (without run metadata).
    """
    dtype = torch.bfloat16
    if quick:
        tiny = tiny_qwen2_config()
        models = [("tiny-h64", tiny, 1, 64)]
        long_models = []
        variants = tuple(v for v in VARIANTS if v.name in HEADLINE_VARIANTS)
        packed = [("tiny-h64", tiny, label, lengths) for label, lengths in QUICK_PACKINGS.items()]
        packed_modes = ("training",)
    else:
        variants = VARIANTS
        presets = ("qwen2.5-0.5b", "qwen2.5-7b")
        models = [(preset, resolve_model_config(preset), 1, 4096) for preset in presets]
        long_models = [(f"{preset} S=32768", resolve_model_config(preset), 1, 32768) for preset in presets]
        packed = [("qwen2.5-7b", resolve_model_config("qwen2.5-7b"), label, lengths)
                  for label, lengths in PACKINGS.items()]
        packed_modes = ("training", "inference")
    result = {
        "bandwidth": BANDWIDTH,
        "peak": PEAK,
        "verl_patch_sources": list(VERL_SOURCES),
        "verl_attention_sources": list(FA2_SOURCES),
        "variants": {v.name: v.description for v in (*VARIANTS, *PACKED_VARIANTS)},
        "attention_modes": ATTENTION_MODES,
        "definitions": {
            "kernel": "call_function node on an ATen/npu OpOverload that returns a tensor, excluding view ops "
            "(OpOverload.is_view) and _unsafe_view/empty*/lift_fresh; getitem and SymInt ops are free",
            "bytes": "tensor inputs (stride-0 broadcast dims once) + tensor outputs, numel x itemsize from "
            "meta['val']; matmuls (mm/bmm/addmm/baddbmm/linear/matmul, qwen_npu.gate_up_proj) not counted; "
            "npu_fusion_attention's compressed mask (sparse modes 2/3) min(2048^2, Sq*Skv) bytes, also read by "
            "qwen_npu.varlen_attention inside (min(2048^2, T^2))",
            "attention": "SDPA kernels (eager: _scaled_dot_product_flash_attention_for_cpu[_backward]), "
            "npu_fusion_attention[_grad] and qwen_npu.varlen_attention[_backward]: counted in non_matmul bytes "
            "but also shown apart",
            "glue": "cat/clone/_to_copy/logical_not whose output feeds a fused npu op (through views), or a "
            "_to_copy of a fused op's output",
            "per_layer": "graph(L=2) - graph(L=1), op by op; per_forward = graph(L=1) - per_layer (position "
            "ids, causal mask, rotary cos/sin: once per forward, shared by all layers)",
            "est_ms": "non-matmul bytes / bandwidth: memory-traffic floor of the non-matmul work; no launch overhead",
            "roofline_ms": "sum over every kernel (matmuls and attention included) of max(FLOPs / Cube peak, "
            "bytes / bandwidth) (benchmarks.traffic.kernel_time); FLOPs: matmuls 2MNK, attention 2*pairs*Nq*(D+Dv) "
            "forward and 2*pairs*Nq*(3D+2Dv) backward, pairs = S(S+1)/2 per sequence for causal kernels, Sq*Skv "
            "with an explicit mask (benchmarks.traffic.attention_pairs); vector kernels memory-bound",
            "partitioner": "AOTAutograd default partitioner (saves activations, no recomputation)",
            "square_tensors_per_forward": "[..., S, S] tensors written by non-attention kernels of a 1-layer "
            "forward graph (the attention mask and its conversions): count, bytes, and the traffic of every "
            "kernel reading or writing one",
            "square_tensors": "per graph of the 1-layer model (forward, backward): every tensor whose last two "
            "dims are S x S (T x T), graph inputs and kernel outputs, attention included; kernels reading one",
            "math_backward": "lower_bound.math_backward: an independent per-layer backward bound from the "
            "layer's math (math_backward_bound), beside the graph-derived bound",
            "inference": "the same models as a no-grad eval() forward (the log-prob forwards of a verl step)",
            "verl_step": "1 training forward+backward + 2 inference forwards; per step = layers x per layer + "
            "once-per-forward work",
            "packed": "one row of T tokens holding several sequences: position_ids restart at 0 per sequence, no "
            "attention_mask (verl's use_remove_padding); explicit mask = transformers' [1, 1, T, T] SDPA mask "
            "fused as npu_fusion_attention's atten_mask, varlen = qwen_npu.varlen_attention (TND), verl = "
            "npu_patch + transformers' NPU flash attention (TND)",
        },
        "models": {},
    }
    for name, config, batch, seq in models:
        result["models"][name] = measure_model(name, config, batch, seq, dtype, variants)
    result["inference"], result["verl_step"] = {}, {}
    headline = tuple(v for v in VARIANTS if v.name in HEADLINE_VARIANTS)
    for name, config, batch, seq in models + long_models:
        if name not in result["models"]:  # long-sequence training rows: headline variants only
            result["models"][name] = measure_model(name, config, batch, seq, dtype, headline)
        result["inference"][name] = measure_model(name, config, batch, seq, dtype, headline, inference=True)
        result["verl_step"][name] = {
            "layers": config.num_hidden_layers,
            "definition": "1 training forward+backward + 2 inference forwards (no grad), decoder layers only",
            "variants": verl_step(result["models"][name], result["inference"][name], config.num_hidden_layers),
        }
    result["packed"] = {}
    for name, config, label, lengths in packed:
        result["packed"][f"{name} T={sum(lengths)} as {label}"] = measure_packed(name, config, lengths, dtype, packed_modes)
    return result
