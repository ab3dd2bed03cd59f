"""Part 1: kernels and HBM traffic per Qwen2.5 decoder layer: eager vs verl-style vs qwen_npu.

How the graphs are built (no memory needed, B=1, S=4096 at 7B costs ~0.5 GB of host RAM):

1. A :class:`transformers.Qwen2Model` with ``L`` decoder layers is built under a
   :class:`~torch._subclasses.fake_tensor.FakeTensorMode` (parameters are CPU FakeTensors: shapes,
   no storage), ``attn_implementation="sdpa"``, bf16, training mode. Its final norm is replaced by
   ``Identity`` and it is called with ``inputs_embeds`` (requires grad), so that neither the embedding,
   the final norm nor the LM head is counted, while the rotary cos/sin and the causal mask are built
   exactly as the model builds them.
2. ``torch.compile(fullgraph=True)`` with a recording backend: Dynamo's graph goes through
   :func:`qwen_npu_compile.canonicalize.to_aten_graph`, then the variant's family passes
   (:func:`qwen_npu_compile.fuse.fuse`, checks as for torchair on an NPU) and
   :func:`qwen_npu_compile.emit.finalize`, then AOTAutograd (default partitioner, no recomputation, backward
   compiled eagerly) whose forward and backward compilers record the two graphs. Variants that run the
   same model code share one Dynamo capture (each gets its own ATen graph, passes and AOT run).
3. Per layer = graph(L=2) - graph(L=1), op by op; what L=1 has beyond one layer is the once-per-forward
   work (position ids, causal mask, cos/sin), reported separately as ``per_forward``.

Variants:

* ``eager``: no fusion (canonicalized graph, no pass): what the unpatched model runs.
* ``verl``: transformers patched like verl (:mod:`benchmarks.verl_patch`): RMSNorm, SwiGLU (via
  ``cat``) and rotary (on BNSD q/k) fused, attention left to SDPA; no pass of ours runs.
* ``qwen_npu_no_attention``: our passes for rms_norm, swiglu, rotary (the verl set, our rewrites).
* ``qwen_npu``: every family in :data:`qwen_npu_compile.config.ALL_FAMILIES`.

Counting rules (:func:`classify`, :func:`node_bytes`):

* A *kernel* is a ``call_function`` node whose target is an ATen/npu ``OpOverload`` returning a tensor,
  except view ops (``OpOverload.is_view``: view, t, transpose, expand, unsqueeze, squeeze, slice,
  select, permute, detach, alias, as_strided, split, ...) and :data:`FREE_OPS` (``_unsafe_view`` and
  allocations without a fill); ``operator.getitem`` and SymInt arithmetic are free too.
* Kernel categories: ``matmul`` (:data:`MATMUL_OPS`, including ``qwen_npu.gate_up_proj``: the SwiGLU
  fusion's gate and up projections, two matmuls writing one buffer), ``attention`` (SDPA's kernels and
  ``npu_fusion_attention``/``_grad``, :data:`ATTENTION_OP_NAMES`), ``fused`` (other ``npu`` ops) and
  ``vector`` (everything else: elementwise, reductions, casts, copies, cat, mask building).
* Bytes of a kernel = bytes of its tensor inputs (each argument once, broadcast (stride-0) dims
  counted once: an ``expand``-ed input reads its un-expanded storage) + bytes of its tensor outputs,
  from ``meta["val"]`` (numel x itemsize); the compressed causal mask of ``npu_fusion_attention``'s
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
* Time estimate: bytes / HBM bandwidth (:data:`BANDWIDTH`): a memory-traffic floor for the non-matmul
  work, which ignores launch overheads and the attention kernels' FLOPs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
import torch.fx
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.qwen2 import modeling_qwen2

from qwen_npu_compile import canonicalize, emit, ensure_npu_ops
from qwen_npu_compile.config import ALL_FAMILIES, QwenNpuConfig
from qwen_npu_compile.fuse import fuse
from qwen_npu_compile.fusion import CompileTarget
from qwen_npu_compile.npu_ops import gate_up_proj
from qwen_npu_compile.npu_ops.limits import bound_arguments
from qwen_npu_compile.check.models import resolve_model_config, tiny_qwen2_config, with_layers

from .common import MIB, progress
from .verl_patch import SOURCES as VERL_SOURCES
from .verl_patch import verl_patches

aten = torch.ops.aten

#: Published HBM bandwidth used for the time estimate. Huawei publishes no memory bandwidth for the
#: Ascend 910B (Atlas A2) on its product pages; third-party figures range from 0.4 to 2.0 TB/s. We use
#: 1.6 TB/s per 910B die: TechPowerUp (citing DigiTimes) gives the Ascend 910C, a package of two
#: 910B-class dies, "eight HBM2E stacks and 3,200 GB/s", i.e. 4 stacks and 1.6 TB/s per die.
BANDWIDTH = {
    "bytes_per_second": 1.6e12,
    "label": "ASSUMPTION: 1.6 TB/s HBM2e per Ascend 910B (Atlas A2) die",
    "source_url": "https://techpowerup.com/335749/huawei-prepares-6-nm-ascend-920c-accelerator-900-teraflops-4000-gb-s-hbm3",
    "derivation": (
        "TechPowerUp (citing DigiTimes, 2025-04-21): Ascend 910C = two 910B-class dies with 'eight HBM2E "
        "stacks and 3,200 GB/s' -> 1.6 TB/s per die. Huawei publishes no official 910B bandwidth; other "
        "third-party pages quote 0.4-2.0 TB/s. Times scale as 1.6 TB/s / your bandwidth."
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
    }
)

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

#: Copies that count as glue when they touch a fused npu op (see the module docstring).
GLUE_OP_NAMES = frozenset({"aten::cat", "aten::clone", "aten::_to_copy", "aten::logical_not", "aten::copy"})

CATEGORIES = ("matmul", "attention", "fused", "vector")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running the model: which passes run, and whether verl's monkey patches are on."""

    name: str
    families: tuple[str, ...]
    verl: bool
    description: str


VARIANTS = (
    Variant("eager", (), False, "no fusion: the canonicalized graph of the unpatched model"),
    Variant(
        "verl",
        (),
        True,
        "verl-style monkey patches (RMSNorm, SwiGLU via cat, rotary on BNSD q/k fused; attention left to SDPA)",
    ),
    Variant(
        "qwen_npu_no_attention",
        ("rms_norm", "swiglu", "rotary"),
        False,
        "qwen_npu with the verl set of families (rms_norm, swiglu, rotary): our rewrites, attention left to SDPA",
    ),
    Variant("qwen_npu", tuple(ALL_FAMILIES), False, "qwen_npu, every family (rms_norm, swiglu, rotary, attention)"),
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
    if target in MATMUL_OPS:
        return "matmul"
    if target._schema.name in ATTENTION_OP_NAMES:
        return "attention"
    if target.namespace == "npu":
        return "fused"
    return "vector"


def _unique_bytes(tensor: torch.Tensor) -> int:
    """Bytes a kernel reads from ``tensor``: broadcast (stride-0) dims count once."""
    sizes = [int(size) for size in tensor.shape]
    if any(size == 0 for size in sizes):
        return 0
    numel = 1
    for size, stride in zip(sizes, tensor.stride()):
        if int(stride) != 0:
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
    seq_dim = 1 if bound["input_layout"] in ("BSH", "BSND") else 2  # BNSD
    window = int(query.shape[seq_dim]) * int(key.shape[seq_dim])
    return mask, min(_unique_bytes(mask.meta["val"]), window * mask.meta["val"].element_size())


def node_bytes(node: torch.fx.Node) -> tuple[int, int]:
    """``(bytes read, bytes written)`` by ``node`` (see the module docstring for the rules)."""
    read = 0
    compressed_mask, compressed_bytes = _compressed_mask_bytes(node)
    for arg in _node_args(node):
        if arg is compressed_mask:
            read += compressed_bytes
            continue
        for tensor in _tensors(arg.meta.get("val")):
            read += _unique_bytes(tensor)
    written = sum(int(t.numel()) * t.element_size() for t in _tensors(node.meta.get("val")))
    return read, written


def _is_fused(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "npu"
    )


def _reaches_fused(start, step) -> bool:
    """Whether a fused op is reachable from ``start`` through free (view-like) nodes, moving by ``step``."""
    stack, seen = list(start), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_fused(node):
            return True
        if classify(node) == "free":
            stack.extend(step(node))
    return False


def _feeds_fused(node: torch.fx.Node) -> bool:
    return _reaches_fused(node.users, lambda n: n.users)


def _feeds_fused_through_matmul(node: torch.fx.Node) -> bool:
    """Whether ``node`` feeds (through views) a matmul whose output feeds (through views) a fused op:
    an in-graph weight concatenation such as ``cat([w_gate, w_up])``."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if classify(user) == "free":
            stack.extend(user.users)
        elif classify(user) == "matmul" and _feeds_fused(user):
            return True
    return False


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


def graph_counts(gm: torch.fx.GraphModule) -> dict[str, dict]:
    """Per op of ``gm``: category, kernels, bytes read/written, glue kernels/bytes (free ops omitted)."""
    table: dict[str, dict] = {}
    for node in gm.graph.nodes:
        category = classify(node)
        if category in (None, "free"):
            continue
        row = table.setdefault(
            op_name(node),
            {"category": category, "kernels": 0, "bytes_read": 0, "bytes_written": 0, "glue_kernels": 0, "glue_bytes": 0},
        )
        row["kernels"] += 1
        if category == "matmul":
            continue
        read, written = node_bytes(node)
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
            stack, seen = list(_node_args(node)), set()
            while stack:
                arg = stack.pop()
                if arg in seen:
                    continue
                seen.add(arg)
                if is_glue(arg):
                    out["input_glue"] += sum(node_bytes(arg))
                elif classify(arg) == "free":
                    stack.extend(_node_args(arg))
    return out


_NUMERIC = ("kernels", "bytes_read", "bytes_written", "glue_kernels", "glue_bytes")


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
    return {
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


def build_graphs(
    config: transformers.Qwen2Config,
    layers: int,
    variants: Sequence[Variant],
    batch: int,
    seq: int,
    dtype: torch.dtype,
    inference: bool = False,
) -> dict[str, dict]:
    """Capture ``layers`` decoder layers once under fake tensors; return each variant's AOT graphs.

    The variants share one Dynamo capture (they must agree on ``verl``: the patches change the model
    code); each gets its own canonical ATen graph, its passes and its AOTAutograd run, with the
    backward compiled eagerly (``force_non_lazy_backward_lowering``), so nothing has to run.

    Args:
        config: the full model config (only its shapes are used).
        layers: decoder layers to build (1 or 2 here).
        variants: the variants to build from this capture.
        batch: B; seq: S (tokens).
        dtype: parameter and activation dtype.
        inference: ``model.eval()`` under ``torch.no_grad()`` (a log-prob forward): only a forward graph.

    Returns:
        Per variant name: ``{"forward": GraphModule, "backward": GraphModule (training only), "fusions": {family: count},
        "refusals": [reason, ...]}``, plus ``"seconds"`` (wall time of the whole capture, float).

    Raises:
        ValueError: the variants disagree on ``verl``.
        RuntimeError: AOTAutograd did not hand over both graphs.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import make_boxed_func

    if len({v.verl for v in variants}) != 1:
        raise ValueError("variants sharing one capture must agree on the verl patches")
    ensure_npu_ops()
    cfg = with_layers(config, layers)
    captured: dict[str, dict] = {v.name: {"fusions": {}, "refusals": []} for v in variants}

    def record(slot: dict, kind: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs):
            slot[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    def backend(gm: torch.fx.GraphModule, example_inputs):
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        for variant in variants:
            slot = captured[variant.name]
            aten_gm = canonicalize.to_aten_graph(gm, example_inputs)
            result = fuse(aten_gm, QwenNpuConfig(fusions=frozenset(variant.families)), target=MODELLED_TARGET)
            emit.finalize(aten_gm)
            slot["fusions"] = result.fusions
            slot["refusals"] = sorted({f"{r.family}: {r.reason}" for r in result.refusals if r.family in variant.families})
            # tensor constants become trailing inputs, as in the backend (transformers 4.x's mask scalars)
            inputs = [*example_inputs, *(fake_mode.from_tensor(c) for c in emit.lift_constants(aten_gm))]
            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                aot_autograd(fw_compiler=record(slot, "forward"), bw_compiler=record(slot, "backward"))(aten_gm, inputs)
        return gm.forward  # both graphs are recorded; Dynamo runs the captured graph once, on fake tensors

    start = time.perf_counter()
    torch._dynamo.reset()
    patches = verl_patches() if variants[0].verl else contextlib.nullcontext()
    with patches:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            model = modeling_qwen2.Qwen2Model._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
            inputs_embeds = torch.empty(batch, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
        if not inference:
            model.norm = torch.nn.Identity()  # count decoder layers only (no final norm)
        # inference keeps the final norm: with it every layer's 2 norms follow a residual add in both
        # L=1 and L=2 (npu_add_rms_norm), and per_forward holds layer 0's add-free input norm instead
        model.train(not inference)
        if inference:
            inputs_embeds.requires_grad_(False)
        with torch.set_grad_enabled(not inference):
            torch.compile(model, backend=backend, fullgraph=True)(inputs_embeds=inputs_embeds)
    torch._dynamo.reset()
    for name, slot in captured.items():
        if "forward" not in slot or ("backward" not in slot and not inference):
            raise RuntimeError(f"{name}: AOTAutograd did not hand over both graphs ({sorted(slot)})")
    return {**captured, "seconds": time.perf_counter() - start}


def per_layer_tables(
    config, variants: Sequence[Variant], batch: int, seq: int, dtype: torch.dtype, inference: bool = False
) -> dict:
    """Per-op tables per layer and per forward, for the forward and backward graphs of each variant.

    Variants are grouped by ``verl`` so that each group costs one Dynamo capture per layer count.

    Returns:
        Per variant name: ``{"per_layer": {"forward": table, "backward": table}, "per_forward": {...},
        "fusions_per_layer": {family: count}, "refusals": [...], "seconds": float}`` (seconds: of its group).
    """
    results = {}
    for verl in (False, True):
        group = [v for v in variants if v.verl == verl]
        if not group:
            continue
        names = ", ".join(v.name for v in group)
        progress(f"traffic:   capture L=1 and L=2 for {names} ...")
        one = build_graphs(config, 1, group, batch, seq, dtype, inference)
        two = build_graphs(config, 2, group, batch, seq, dtype, inference)
        for variant in group:
            g1, g2 = one[variant.name], two[variant.name]
            result = {"per_layer": {}, "per_forward": {}, "seconds": one["seconds"] + two["seconds"]}
            result["square_tensors_per_forward"] = square_tensors(g1["forward"], seq)
            for kind in _kinds(inference):
                t1, t2 = graph_counts(g1[kind]), graph_counts(g2[kind])
                layer = subtract(t2, t1)
                result["per_layer"][kind] = layer
                result["per_forward"][kind] = subtract(t1, layer)
                bad = has_negative(layer) + has_negative(result["per_forward"][kind])
                if bad:
                    raise RuntimeError(f"{variant.name} {kind}: per-layer split went negative for {bad}")
            result["fusions_per_layer"] = {f: g2["fusions"][f] - g1["fusions"][f] for f in g1["fusions"]}
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
        return any(t.dim() >= 2 and tuple(int(d) for d in t.shape[-2:]) == (seq, seq) for t in _tensors(value))

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
            out["bytes"] += sum(int(t.numel()) * t.element_size() for t in _tensors(node.meta.get("val")))
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


def model_shape(config, batch: int, seq: int, dtype: torch.dtype) -> dict:
    """The shape fields a reader needs to check the numbers."""
    heads = config.num_attention_heads
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "batch": batch,
        "seq_len": seq,
        "dtype": str(dtype).replace("torch.", ""),
    }


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
) -> dict:
    """Every variant of one model: per-layer kernels, bytes, ratio to the fused lower bound, ms.

    Args:
        name: label in the results (a preset name).
        config: its :class:`transformers.Qwen2Config`.
        batch, seq: B and S.
        dtype: bf16 in the real runs.
        variants: which :class:`Variant` objects (the lower bound needs ``qwen_npu``).
        inference: measure a no-grad ``eval()`` forward (forward graph only) instead of training.
    """
    kinds = _kinds(inference)
    out = {"shape": model_shape(config, batch, seq, dtype), "mode": "inference" if inference else "training",
           "variants": {}}
    variants = list(variants)
    progress(f"traffic: {name} B={batch} S={seq} {out['mode']} ({', '.join(v.name for v in variants)}; fake tensors) ...")
    all_tables = per_layer_tables(config, variants, batch, seq, dtype, inference)
    for variant in variants:
        tables = all_tables[variant.name]
        entry = {
            "description": variant.description,
            "families": list(variant.families),
            "fusions_per_layer": tables["fusions_per_layer"],
            "refusals": tables["refusals"],
            "capture_seconds": round(tables["seconds"], 2),
            "swiglu_forward_bytes_per_layer": tables["swiglu_forward"],
            "square_tensors_per_forward": tables["square_tensors_per_forward"],
            "per_layer": {},
            "per_forward": {},
        }
        for scope in ("per_layer", "per_forward"):
            for kind in kinds:
                entry[scope][kind] = {**summarize(tables[scope][kind]), "by_op": tables[scope][kind]}
        out["variants"][variant.name] = entry
        layer = entry["per_layer"]
        progress(
            f"traffic: {name} {variant.name}: fused {tables['fusions_per_layer'] or '-'}; per layer "
            + "/".join(kinds) + " "
            + "/".join(str(layer[k]["kernels"]["total"]) for k in kinds) + " kernels, "
            + "/".join(f"{layer[k]['bytes']['non_matmul'] / MIB:.0f}" for k in kinds) + " MiB non-matmul"
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
        "complete": all(reference["fusions_per_layer"].get(f, 0) > 0 for f in ALL_FAMILIES),
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
        moved = {k: entry["per_layer"][k]["bytes"]["non_matmul"] for k in kinds}
        moved["total"] = sum(moved[k] for k in kinds)
        entry["bytes_per_layer"] = moved
        entry["ratio_to_lower_bound"] = {k: moved[k] / bound[k] for k in moved}
        if not inference:
            entry["ratio_to_math_backward_bound"] = moved["backward"] / out["lower_bound"]["math_backward"]["bytes"]
        entry["est_ms_per_layer"] = {k: _ms(v) for k, v in moved.items()}
        entry["kernels_per_layer"] = {k: entry["per_layer"][k]["kernels"]["total"] for k in kinds}
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


def run(quick: bool = False) -> dict:
    """Part 1 for Qwen2.5-0.5B and Qwen2.5-7B at B=1, bf16: training at S=4096 (every variant) and
    S=32768 (eager, verl, qwen_npu), inference forwards at both, and the verl-step view.

    Args:
        quick: a tiny model (hidden 64) at S=64 and only the headline variants (eager, verl, qwen_npu).

    Returns:
        The ``kernel_traffic.json`` payload (without run metadata).
    """
    dtype = torch.bfloat16
    if quick:
        tiny = tiny_qwen2_config()
        models = [("tiny-h64", tiny, 1, 64)]
        long_models = []
        variants = tuple(v for v in VARIANTS if v.name in HEADLINE_VARIANTS)
    else:
        variants = VARIANTS
        presets = ("qwen2.5-0.5b", "qwen2.5-7b")
        models = [(preset, resolve_model_config(preset), 1, 4096) for preset in presets]
        long_models = [(f"{preset} S=32768", resolve_model_config(preset), 1, 32768) for preset in presets]
    result = {
        "bandwidth": BANDWIDTH,
        "verl_patch_sources": list(VERL_SOURCES),
        "variants": {v.name: v.description for v in VARIANTS},
        "definitions": {
            "kernel": "call_function node on an ATen/npu OpOverload that returns a tensor, excluding view ops "
            "(OpOverload.is_view) and _unsafe_view/empty*/lift_fresh; getitem and SymInt ops are free",
            "bytes": "tensor inputs (stride-0 broadcast dims once) + tensor outputs, numel x itemsize from "
            "meta['val']; matmuls (mm/bmm/addmm/baddbmm/linear/matmul, qwen_npu.gate_up_proj) not counted",
            "attention": "SDPA kernels (here _scaled_dot_product_flash_attention_for_cpu[_backward]) and "
            "npu_fusion_attention[_grad]: counted in non_matmul bytes but also shown apart, since SDPA's "
            "internal traffic depends on the kernel",
            "glue": "cat/clone/_to_copy/logical_not whose output feeds a fused npu op (through views), or a "
            "_to_copy of a fused op's output",
            "per_layer": "graph(L=2) - graph(L=1), op by op; per_forward = graph(L=1) - per_layer (position "
            "ids, causal mask, rotary cos/sin: once per forward, shared by all layers)",
            "est_ms": "bytes / bandwidth: memory-traffic floor of the non-matmul work; no launch overhead",
            "partitioner": "AOTAutograd default partitioner (saves activations, no recomputation)",
            "square_tensors_per_forward": "[..., S, S] tensors written by non-attention kernels of a 1-layer "
            "forward graph (the attention mask and its conversions): count, bytes, and the traffic of every "
            "kernel reading or writing one",
            "math_backward": "lower_bound.math_backward: an independent per-layer backward bound from the "
            "layer's math (math_backward_bound), beside the graph-derived bound",
            "inference": "the same models as a no-grad eval() forward (the log-prob forwards of a verl step)",
            "verl_step": "1 training forward+backward + 2 inference forwards; per step = layers x per layer + "
            "once-per-forward work",
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
    return result
