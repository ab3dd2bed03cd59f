"""Kernels, HBM traffic and modelled time per dense Qwen2.5 decoder layer: eager vs verl-style vs qwen_npu.

Usage: ``python -m benchmarks.run --parts traffic --out benchmarks/results`` (``--quick``: a tiny model, seconds)
writes ``kernel_traffic.json``; ``python -m benchmarks.markdown benchmarks/results/kernel_traffic.json`` prints the
docs/performance.md tables.

Rows (:func:`run`): Qwen2.5-0.5B and Qwen2.5-7B (``qwen2.5-*`` presets of :mod:`qwen_npu_compile.cli.check.presets`)
at B = 1, bf16: training (forward + backward) at S = 4096, every variant, and at S = 32768, the headline variants;
no-grad inference forwards at both; the verl-step view (:func:`verl_step`); packed rows of Qwen2.5-7B at T = 16384
(:data:`PACKINGS`). Each model's graphs are captured under fake tensors with 1 and 2 decoder layers
(:mod:`benchmarks.capture`: the embedding and the LM head are left out) and per layer =
graph(L=2) - graph(L=1) op by op (:mod:`benchmarks.tables`); what L=1 has beyond one layer is the once-per-forward
work (position ids, causal mask, cos/sin), reported as ``per_forward``.

Variants (:data:`VARIANTS`):

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

What each row reports, per layer and graph kind (forward, backward), counted by :mod:`benchmarks.cost_model`
(whose docstring has the counting rules: kernels, bytes, glue, FLOPs):

* kernels (counts), non-matmul bytes read + written (bytes), Cube FLOPs, ``est_ms`` = non-matmul bytes / HBM
  bandwidth (milliseconds: a memory-traffic floor of the non-matmul work) and ``roofline_ms`` = the sum over every
  kernel, matmuls and attention included, of ``max(FLOPs / Cube peak, bytes / bandwidth)`` (milliseconds; no launch
  overhead, no overlap). Bandwidth and peak: the Atlas A2 figures of the CANN developer guide
  (:data:`benchmarks.cost_model.BANDWIDTH`, :data:`benchmarks.cost_model.PEAK`).
* The *fused lower bound* (``lower_bound``): the qwen_npu graph's non-matmul bytes without its glue: each fused op
  reads its inputs once and writes its outputs once, and only the work no family covers (residual adds, gradient
  accumulation, bias-gradient sums) remains; beside it an independent backward bound from the layer's math
  (:func:`math_backward_bound`).
* T×T tensors (:func:`square_tensor_count`): every tensor of the 1-layer graphs whose last two dims are ``S x S``,
  graph inputs and kernel outputs, attention included; the SwiGLU bytes of a forward (:func:`swiglu_forward_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.fx

from qwen_npu_compile.cli.check.models import resolve_model_config, tiny_qwen2_config
from qwen_npu_compile.config import ALL_FAMILIES

from .capture import ATTENTION_MODES, Variant, build_graphs
from .common import MIB, progress
from .cost_model import (BANDWIDTH, CATEGORIES, PEAK, aten, as_int, classify, graph_counts, is_glue, node_args,
                         node_bytes, tensor_numel, tensors_in, through_free)
from .tables import est_ms, graph_kinds, has_negative, per_layer_splits, subtract, summarize
from .verl_patch import FA2_SOURCES
from .verl_patch import SOURCES as VERL_SOURCES

#: The families a dense Qwen2 decoder layer holds (the fused lower bound is complete when each fused).
DENSE_LAYER_FAMILIES = ("rms_norm", "swiglu", "rotary", "attention")

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
        "npu_fusion_attention's explicit atten_mask (qwen_npu before its varlen recognition)",
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
# the tables


def per_layer_tables(config, variants: Sequence[Variant], batch: int, seq: int, dtype: torch.dtype,
                     inference: bool = False, packing: Sequence[int] | None = None) -> dict:
    """Per-op tables per layer and per forward, for the forward and backward graphs of each dense variant.

    Variants are grouped by :attr:`~benchmarks.capture.Variant.capture_key` so that each group costs one Dynamo
    capture per layer count (:func:`~benchmarks.capture.build_graphs`; :func:`~benchmarks.tables.per_layer_splits`).

    Returns:
        Per variant name: ``{"per_layer": {"forward": table, "backward": table}, "per_forward": {...},
        "fusions_per_layer": {family: count}, "refusals": [...], "square_tensors": {...}, "seconds": float}``
        (seconds: of its group).

    Raises:
        RuntimeError: a per-layer or per-forward table went negative.
    """
    kinds = graph_kinds(inference)
    lengths = tuple(packing) if packing else (seq,) * batch

    def build(layers: int, group: Sequence[Variant]) -> dict:
        if layers == 1:
            progress(f"traffic:   capture L=1 and L=2 for {', '.join(v.name for v in group)} ...")
        return build_graphs(config, layers, group, batch, seq, dtype, inference, packing)

    def counts(gm: torch.fx.GraphModule) -> dict[str, dict]:
        return graph_counts(gm, lengths)

    results = {}
    splits = per_layer_splits(build, variants, inference, counts, key=lambda variant: variant.capture_key)
    for variant, g1, g2, layer, seconds in splits:
        per_forward = {kind: subtract(counts(g1[kind]), layer[kind]) for kind in kinds}
        bad = [op for kind in kinds for op in has_negative(per_forward[kind])]
        if bad:
            raise RuntimeError(f"{variant.name}: per-forward split went negative for {bad}")
        results[variant.name] = {
            "per_layer": layer,
            "per_forward": per_forward,
            "seconds": seconds,
            "square_tensors_per_forward": square_tensors(g1["forward"], seq),
            "square_tensors": {kind: square_tensor_count(g1[kind], seq) for kind in kinds},
            # families that fused nothing in either graph (e.g. moe in a dense model) are left out
            "fusions_per_layer": {f: g2["fusions"][f] - g1["fusions"][f] for f in g1["fusions"]
                                  if g1["fusions"][f] or g2["fusions"].get(f)},
            "swiglu_forward": swiglu_forward_bytes(g1["forward"]),
            "refusals": g2["refusals"],
        }
    return {v.name: results[v.name] for v in variants}


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
            out["input_glue"] += sum(sum(node_bytes(arg)) for arg in through_free(node_args(node), node_args)
                                     if is_glue(arg))  # glue is a vector op: the walk stops there
    return out


def _square(value, seq: int) -> list[torch.Tensor]:
    """The tensors of a ``meta["val"]`` whose last two dims are ``seq x seq``."""
    return [t for t in tensors_in(value) if t.dim() >= 2 and tuple(as_int(d) for d in t.shape[-2:]) == (seq, seq)]


def square_tensors(gm: torch.fx.GraphModule, seq: int) -> dict[str, int]:
    """The ``[..., S, S]`` tensors a forward graph computes (attention masks), kernels outside attention.

    Returns:
        ``{"tensors": n, "bytes": their bytes, "traffic": bytes read + written by kernels that read or
        write an S×S tensor}``: the mask's memory and traffic (0 when no S×S tensor exists).
    """
    out = {"tensors": 0, "bytes": 0, "traffic": 0}
    for node in gm.graph.nodes:
        category = classify(node)
        if category in (None, "matmul", "attention"):
            continue
        writes = bool(_square(node.meta.get("val"), seq))
        reads = any(_square(arg.meta.get("val"), seq) for arg in node_args(node))
        if category != "free" and (writes or reads):
            out["traffic"] += sum(node_bytes(node))
        if writes and category != "free":
            out["tensors"] += 1
            out["bytes"] += sum(tensor_numel(t) * t.element_size() for t in tensors_in(node.meta.get("val")))
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
    out = {"tensors": 0, "inputs": 0, "written": 0, "bytes": 0, "kernels_reading": 0}
    for node in gm.graph.nodes:
        category = "input" if node.op == "placeholder" else classify(node)
        if category is None:
            continue
        found = _square(node.meta.get("val"), seq)
        if found and category != "free":
            out["inputs" if category == "input" else "written"] += len(found)
            out["bytes"] += sum(tensor_numel(t) * t.element_size() for t in found)
        if category not in ("input", "free") and any(_square(arg.meta.get("val"), seq) for arg in node_args(node)):
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
        variants: which :class:`~benchmarks.capture.Variant` objects (the lower bound needs ``qwen_npu``).
        inference: measure a no-grad ``eval()`` forward (forward graph only) instead of training.
        packing: packed sequence lengths (one row, summing to ``seq``), or None.
    """
    kinds = graph_kinds(inference)
    out = {"shape": model_shape(config, batch, seq, dtype, packing), "mode": "inference" if inference else "training",
           "variants": {}}
    variants = list(variants)
    progress(f"traffic: {name} B={batch} S={seq}{' packed ' + str(len(packing)) + ' seqs' if packing else ''} "
             f"{out['mode']} ({', '.join(v.name for v in variants)}; fake tensors) ...")
    all_tables = per_layer_tables(config, variants, batch, seq, dtype, inference, packing)
    for variant in variants:
        tables = all_tables[variant.name]
        entry = out["variants"][variant.name] = variant_entry(variant, tables, kinds)
        layer = entry["per_layer"]
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
    out["lower_bound"] = lower_bound(reference, kinds, out["shape"], inference)
    bound = out["lower_bound"]["bytes_per_layer"]
    for entry in out["variants"].values():
        moved = entry["bytes_per_layer"]
        entry["ratio_to_lower_bound"] = {k: moved[k] / bound[k] for k in moved}
        if not inference:
            entry["ratio_to_math_backward_bound"] = moved["backward"] / out["lower_bound"]["math_backward"]["bytes"]
    return out


def variant_entry(variant: Variant, tables: dict, kinds: Sequence[str]) -> dict:
    """One variant's results entry from its :func:`per_layer_tables`: the per-op tables with their summaries
    (:func:`~benchmarks.tables.summarize`) per layer and per forward, and the per-layer totals of the report."""
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
    layer = entry["per_layer"]
    moved = {k: layer[k]["bytes"]["non_matmul"] for k in kinds}
    moved["total"] = sum(moved[k] for k in kinds)
    entry["bytes_per_layer"] = moved
    entry["est_ms_per_layer"] = {k: est_ms(v) for k, v in moved.items()}
    entry["kernels_per_layer"] = {k: layer[k]["kernels"]["total"] for k in kinds}
    roof = {k: layer[k]["roofline_ms"] for k in kinds}
    entry["roofline_ms_per_layer"] = {
        **{k: roof[k]["total"] for k in kinds},
        "total": sum(roof[k]["total"] for k in kinds),
        "by_category": {c: sum(roof[k][c] for k in kinds) for c in CATEGORIES},
    }
    entry["attention_flops_per_layer"] = sum(layer[k]["flops"]["attention"] for k in kinds)
    entry["matmul_flops_per_layer"] = sum(layer[k]["flops"]["matmul"] for k in kinds)
    return entry


def lower_bound(reference: dict, kinds: Sequence[str], shape: dict, inference: bool) -> dict:
    """The fused lower bound per layer (module docstring) from the ``qwen_npu`` entry (:func:`variant_entry`), and in
    training the math bound of the backward (:func:`math_backward_bound` of ``shape``)."""
    bound = {}
    for kind in kinds:
        b = reference["per_layer"][kind]["bytes"]
        bound[kind] = b["non_matmul"] - b["glue"]
    bound["total"] = sum(bound[kind] for kind in kinds)
    out = {
        "definition": "qwen_npu per-layer non-matmul bytes minus its glue copies: every fused op reads its "
        "inputs once and writes its outputs once; only work no family covers (residual adds, gradient "
        "accumulation, bias-gradient sums) remains",
        "families_fused_in_reference": reference["fusions_per_layer"],
        # a family that fused nothing leaves its unfused subgraph in the bound: then it is no bound
        "complete": all(reference["fusions_per_layer"].get(f, 0) > 0 for f in DENSE_LAYER_FAMILIES),
        "bytes_per_layer": bound,
        "est_ms_per_layer": {k: est_ms(v) for k, v in bound.items()},
    }
    if not inference:
        out["math_backward"] = {
            "definition": "independent of any graph: what an ideal fused backward must read and write "
            "(benchmarks.traffic.math_backward_bound)",
            **math_backward_bound(shape),
        }
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
                     "est_ms_per_step": est_ms(step)}
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


#: What the fields of ``kernel_traffic.json`` mean (written into it).
DEFINITIONS = {
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
    "bytes / bandwidth) (benchmarks.cost_model.kernel_time); FLOPs: matmuls 2MNK, attention 2*pairs*Nq*(D+Dv) "
    "forward and 2*pairs*Nq*(3D+2Dv) backward, pairs = S(S+1)/2 per sequence for causal kernels, Sq*Skv "
    "with an explicit mask (benchmarks.cost_model.attention_pairs); vector kernels memory-bound",
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
}


def run(quick: bool = False) -> dict:
    """The dense rows for Qwen2.5-0.5B and Qwen2.5-7B at B=1, bf16: training at S=4096 (every variant) and
    S=32768 (eager, verl, qwen_npu), inference forwards at both, the verl-step view, and the packed rows
    (Qwen2.5-7B, T=16384 as 16 x 1024 and 4 x 4096, training and inference: explicit mask, varlen, verl).

    Args:
        quick: a tiny model (hidden 64) at S=64, only the headline variants (eager, verl, qwen_npu), and
            one packed training row (T=40 as 8 + 16 + 16).

    Returns:
        The ``kernel_traffic.json`` payload (without run metadata).
    """
    dtype = torch.bfloat16
    models, long_models, variants, packed, packed_modes = _rows(quick)
    result = {
        "bandwidth": BANDWIDTH,
        "peak": PEAK,
        "verl_patch_sources": list(VERL_SOURCES),
        "verl_attention_sources": list(FA2_SOURCES),
        "variants": {v.name: v.description for v in (*VARIANTS, *PACKED_VARIANTS)},
        "attention_modes": ATTENTION_MODES,
        "definitions": DEFINITIONS,
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
        key = f"{name} T={sum(lengths)} as {label}"
        result["packed"][key] = measure_packed(name, config, lengths, dtype, packed_modes)
    return result


def _rows(quick: bool) -> tuple[list, list, tuple[Variant, ...], list, tuple[str, ...]]:
    """What :func:`run` measures: ``(models, long-sequence models, their variants, packed rows, packed modes)``;
    a model is ``(name, config, B, S)``, a packed row ``(name, config, label, lengths)``."""
    if quick:
        tiny = tiny_qwen2_config()
        variants = tuple(v for v in VARIANTS if v.name in HEADLINE_VARIANTS)
        packed = [("tiny-h64", tiny, label, lengths) for label, lengths in QUICK_PACKINGS.items()]
        return [("tiny-h64", tiny, 1, 64)], [], variants, packed, ("training",)
    presets = ("qwen2.5-0.5b", "qwen2.5-7b")
    models = [(preset, resolve_model_config(preset), 1, 4096) for preset in presets]
    long_models = [(f"{preset} S=32768", resolve_model_config(preset), 1, 32768) for preset in presets]
    packed = [("qwen2.5-7b", resolve_model_config("qwen2.5-7b"), label, lengths) for label, lengths in PACKINGS.items()]
    return models, long_models, VARIANTS, packed, ("training", "inference")
