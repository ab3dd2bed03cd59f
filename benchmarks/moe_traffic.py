"""Kernels, HBM traffic and roofline per MoE decoder layer (Qwen3-30B-A3B): transformers' default, verl-style, qwen_npu.

Usage (from the repository root; ~minutes on a 2-core host, nothing allocated at full size)::

    python -m benchmarks.moe_traffic --out benchmarks/results          # Qwen3-30B-A3B, T = 4096
    python -m benchmarks.moe_traffic --quick --out /tmp/moe            # tiny Qwen3-MoE, seconds

writes ``<out>/moe_traffic.json``; ``python -m benchmarks.markdown benchmarks/results/moe_traffic.json`` prints the
README table. One progress line per row goes to stderr (logger ``benchmarks.moe_traffic``).

Units: kernels (counts), bytes (non-matmul kernels' reads + writes), FLOPs (Cube), ``est_ms`` and ``roofline_ms``
(milliseconds at the Atlas A2's HBM bandwidth and Cube peak, the CANN developer guide's figures:
:data:`~benchmarks.cost_model.BANDWIDTH`, :data:`~benchmarks.cost_model.PEAK`), per decoder layer and graph kind.

How the graphs are built (:mod:`benchmarks.capture`, as for the dense rows of :mod:`benchmarks.traffic`) and counted
(:mod:`benchmarks.cost_model`, whose docstring has the counting rules, reused unchanged:
:func:`~benchmarks.cost_model.graph_counts`, :func:`~benchmarks.cost_model.node_bytes`,
:func:`~benchmarks.cost_model.kernel_flops`, :func:`~benchmarks.cost_model.kernel_time`; per layer
:func:`~benchmarks.tables.subtract`, :func:`~benchmarks.tables.summarize`):

1. A :class:`transformers.Qwen3MoeModel` with ``L`` decoder layers (every layer sparse: Qwen3-30B-A3B has
   ``decoder_sparse_step=1``, no ``mlp_only_layers``) under a :class:`~torch._subclasses.fake_tensor.FakeTensorMode`,
   bf16, one row of ``T`` tokens (B = 1, S = T) given as ``inputs_embeds``. Training: ``train()``, the input requires
   grad, the final norm is ``Identity``; inference: ``eval()`` under ``no_grad`` with the final norm kept (as the dense
   inference rows, so that every layer's norms follow a residual add).
2. ``torch.compile(fullgraph=True)`` with a recording backend, then AOTAutograd (default partitioner, backward compiled
   eagerly) records the forward and backward graphs. Per layer = graph(L=2) - graph(L=1), op by op.

Variants (:data:`MOE_VARIANTS`):

* ``transformers``: transformers 5.24's default, ``experts_implementation="grouped_mm"`` (``aten._grouped_mm`` for
  gate_up and down, sort / ``histc`` / ``cumsum`` routing, ``index`` gathers, ``index_put_`` inverse permutation),
  SDPA attention, nothing fused: the canonicalized graph with no pass (the dense rows' ``eager``).
* ``verl``: verl 0.9.1's ``npu_patch`` for Qwen3-MoE (:mod:`benchmarks.verl_moe_patch`: RMSNorm, rotary and the sparse
  MoE block with ``npu_moe_token_permute``, ``histc``, three ``NPUGmmFunction`` grouped matmuls, ``npu_swiglu`` on a
  ``cat``, ``npu_moe_token_unpermute``) and attention through transformers' NPU flash attention
  (:func:`benchmarks.verl_patch.npu_flash_attention_2`, BSND, ``sparse_mode=3``), as the dense verl-style rows. Its
  graph applies a custom ``torch.autograd.Function``, which ``canonicalize.to_aten_graph`` refuses on purpose
  (``canonicalize.refuse_custom_autograd_functions``: the pre-dispatch retrace would drop its backward), and so does
  the backend (the graph compiles unfused): Dynamo's graph goes straight to AOTAutograd, which traces the Function's
  own backward (dx and dW ``npu_grouped_matmul``). No pass of ours runs.
* ``qwen_npu``: every family (:data:`qwen_npu_compile.config.ALL_FAMILIES`), ``moe`` included: ``patterns/moe.py``
  turns both grouped matmuls into ``qwen_npu::grouped_matmul`` (backward: ``npu_grouped_matmul`` dx / dW) with
  ``npu_swiglu`` reading the gate_up output directly (no ``cat``), and the routing into convertible ops.

Counting additions for MoE (in :mod:`benchmarks.cost_model`): the grouped matmuls
(:data:`~benchmarks.cost_model.GROUPED_MATMUL_OP_NAMES`) are matmuls, with ``2·M·K·N`` FLOPs over their groups
(:func:`~benchmarks.cost_model.grouped_matmul_flops`): per layer ``6·S·H·I`` forward (gate_up ``2·S·H·2I`` + down
``2·S·I·H``, S = T·k routed rows) and ``12·S·H·I`` backward (dx and dW of each), in every variant. Like every matmul,
their bytes (x, all ``E`` experts' weights, output) enter the roofline only: at T = 4096, k = 8 an expert gets
``T·k/E = 256`` rows on average, so the grouped matmuls are about as memory- as compute-bound.

**Routing under FakeTensor.** Every routing op has a static shape (``T·k`` rows, ``E`` counts): ``sort``,
``histc``, the gathers, ``npu_moe_token_permute``/``unpermute`` and the grouped matmuls' FakeTensor kernels need
no values, so nothing is data-dependent in the graphs. What the values would decide (how many rows each expert gets)
changes neither the bytes nor the FLOPs of a grouped matmul (its groups always sum to ``T·k`` rows), only how well a
real kernel balances them, which this model does not see: it is uniform routing's cost. verl's integer ``histc``
(which torch's CPU/Meta kernels refuse) is modelled as one kernel (:func:`benchmarks.verl_moe_patch.histc_int`).

Not modelled: the permute/unpermute kernels' internals (counted as their inputs + outputs, like every fused op),
copies that torch_npu's op wrappers may make inside a call (verl's dx grouped matmuls get column slices of the
``npu_swiglu_backward`` output), load imbalance between experts, launch overhead, overlap; no kernel ran on an NPU.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.fx

from qwen_npu_compile.cli.check.models import resolve_model_config, with_layers
from qwen_npu_compile.config import ALL_FAMILIES

from .capture import LayerVariant, capture_layers
from .common import MIB, with_run_metadata, write_json
from .cost_model import BANDWIDTH, GROUPED_MATMUL_OP_NAMES, PEAK, classify, schema_name
from .tables import est_ms, graph_kinds, layer_row, per_kind, per_layer_splits, row_line
from .verl_moe_patch import SOURCES as VERL_MOE_SOURCES
from .verl_moe_patch import verl_moe_patches
from .verl_patch import FA2_SOURCES

log = logging.getLogger(__name__)

#: The model and shape of the full run: Qwen3-30B-A3B (E = 128 experts, top-k = 8), T = 4096 tokens.
MODEL = "qwen3-30b-a3b"
TOKENS = 4096
#: The quick run: a tiny Qwen3-MoE (hidden 64, 4 experts, top-2, head_dim 64; ``tests/helpers/models.py``'s ``tiny_moe``
#: shapes), T = 16 tokens.
QUICK_TOKENS = 16

#: Per-layer counts reported for each grouped-matmul op: label -> schema name (:data:`GROUPED_MATMUL_OP_NAMES`).
GROUPED_MM_LABELS = {
    "aten._grouped_mm": "aten::_grouped_mm",
    "grouped_mm_fallback": "transformers::grouped_mm_fallback",
    "qwen_npu.grouped_matmul": "qwen_npu::grouped_matmul",
    "npu_grouped_matmul": "npu::npu_grouped_matmul",
}
assert set(GROUPED_MM_LABELS.values()) == GROUPED_MATMUL_OP_NAMES


#: One way of running Qwen3-MoE (module docstring); ``verl``: verl's Qwen3-MoE ``npu_patch``
#: (:func:`benchmarks.verl_moe_patch.verl_moe_patches`), whose graph goes to AOTAutograd as it is (no canonicalization).
MoeVariant = LayerVariant


#: One row per variant: data (the MoE and Qwen3.5 benchmarks' variant tables share their shape, not logic).
MOE_VARIANTS = (
    MoeVariant("transformers", (), False,
               "transformers 5.24 default: experts_implementation='grouped_mm' (aten._grouped_mm, sort/histc/cumsum "
               "routing, index gathers, index_put_ inverse permutation), SDPA attention; nothing fused"),
    MoeVariant("verl", (), True,
               "verl 0.9.1 npu_patch for Qwen3-MoE: npu_rms_norm, npu_rotary_mul, sparse MoE block "
               "(npu_moe_token_permute, histc, 3 NPUGmmFunction npu_grouped_matmul, npu_swiglu(cat), "
               "npu_moe_token_unpermute) + transformers' NPU flash attention (BSND, sparse_mode 3); no pass of ours, "
               "Dynamo's graph straight to AOTAutograd (custom autograd.Function)"),
    MoeVariant("qwen_npu", tuple(ALL_FAMILIES), False,
               "qwen_npu, every family: rms_norm, moe (qwen_npu.grouped_matmul, npu_swiglu without cat, routing in "
               "convertible ops), swiglu, rotary, attention"),
)


def build_moe_graphs(config, layers: int, variants: Sequence[MoeVariant], tokens: int, dtype: torch.dtype,
                     inference: bool = False) -> dict[str, dict]:
    """Capture ``layers`` Qwen3-MoE decoder layers once under fake tensors; return each variant's AOT graphs.

    The variants must agree on :attr:`MoeVariant.verl` (one Dynamo capture of one model code). Non-verl variants get
    the canonical ATen graph, their passes (:func:`qwen_npu_compile.fusion.manager.fuse`, checks as for torchair on an NPU) and
    :func:`qwen_npu_compile.graph.emit.finalize`; the verl variant gets Dynamo's graph as it is (module docstring).

    Args:
        config: a :class:`transformers.Qwen3MoeConfig` (only its shapes are used).
        layers: decoder layers (1 or 2).
        variants: the variants of this capture.
        tokens: T (one row, B = 1).
        dtype: bf16 in the real runs.
        inference: a no-grad ``eval()`` forward (forward graph only).

    Returns:
        Per variant name ``{"forward": GraphModule, "backward": GraphModule (training), "fusions": {family: n}}``,
        plus ``"seconds"`` (wall time, float).

    Raises:
        ValueError: the variants disagree on ``verl``. RuntimeError: AOTAutograd did not hand over the graphs.
    """
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    return capture_layers(modeling_qwen3_moe.Qwen3MoeModel, with_layers(config, layers), variants, tokens, dtype,
                          inference, verl_moe_patches, canonical=lambda variant: not variant.verl)


def _producer_through_views(node: torch.fx.Node) -> torch.fx.Node:
    """The first non-free node above ``node`` through single-input view/free ops
    (:func:`~benchmarks.cost_model.classify`)."""
    while classify(node) == "free" and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def swiglu_cat_inputs(gm: torch.fx.GraphModule) -> dict[str, int]:
    """``npu_swiglu`` calls of ``gm`` and how many of them read a ``cat`` (through views): verl's
    ``npu_swiglu(cat([gate, up], -1))`` copy; qwen_npu's experts must have none.

    Returns:
        ``{"npu_swiglu": n, "fed_by_cat": n, "fed_by_grouped_matmul": n}``.
    """
    out = {"npu_swiglu": 0, "fed_by_cat": 0, "fed_by_grouped_matmul": 0}
    for node in gm.graph.nodes:
        if node.op != "call_function" or schema_name(node) != "npu::npu_swiglu":
            continue
        out["npu_swiglu"] += 1
        source = _producer_through_views(node.args[0])
        out["fed_by_cat"] += schema_name(source) == "aten::cat"
        out["fed_by_grouped_matmul"] += schema_name(source) in GROUPED_MATMUL_OP_NAMES
    return out


def grad_layout_copies(backward: torch.fx.GraphModule) -> dict[str, int]:
    """Gradients the backward graph returns with strides other than contiguous: what ``AccumulateGrad`` copies
    after the graph (every parameter here is contiguous, and a new gradient that does not obey the parameter's layout
    is cloned into an empty ``.grad``: torch ``autograd/functions/accumulate_grad.h``, ``clone_obey_contract``), reading
    and writing the whole tensor once (a later micro-batch's in-place add into ``.grad`` reads the view instead). Under torchair a non-contiguous graph output is a ``Transpose`` in the GE graph instead:
    the same bytes, inside the graph. Not in the kernel counts (it runs outside the graph).

    E.g. a grouped matmul's dW ``[E, K, N]`` (``group_type=2``) for a weight passed as ``param.transpose(1, 2)``
    (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) returns the transposed view of a ``[E, K, N]`` buffer.

    Returns:
        ``{"tensors": n, "bytes": 2 x their bytes}``.
    """
    out = {"tensors": 0, "bytes": 0}
    for value in backward.graph.output_node().args[0]:
        tensor = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
            out["tensors"] += 1
            out["bytes"] += 2 * tensor.numel() * tensor.element_size()
    return out


def grouped_mm_counts(table: dict[str, dict]) -> dict[str, int]:
    """Per label of :data:`GROUPED_MM_LABELS`, the kernels of a per-op table (``graph_counts``/``subtract``)."""
    by_schema = {label: 0 for label in GROUPED_MM_LABELS}
    for op, row in table.items():
        packet = op.rsplit(".", 1)[0]  # "aten._grouped_mm.default" -> "aten._grouped_mm"
        schema = packet.replace(".", "::", 1)
        for label, name in GROUPED_MM_LABELS.items():
            if schema == name:
                by_schema[label] += row["kernels"]
    return by_schema


def grouped_mm_flops(table: dict[str, dict]) -> int:
    """FLOPs of the grouped-matmul kernels of a per-op table."""
    names = {name.replace("::", ".", 1) for name in GROUPED_MATMUL_OP_NAMES}
    return sum(row["flops"] for op, row in table.items() if op.rsplit(".", 1)[0] in names)


def expected_grouped_mm_flops(config, tokens: int) -> dict[str, int]:
    """The experts' grouped-matmul FLOPs per MoE layer from the config alone (``S = T·k`` routed rows, H hidden,
    I = ``moe_intermediate_size``): forward gate_up ``2·S·H·2I`` + down ``2·S·I·H`` = ``6·S·H·I``; backward dx and
    dW of each, ``12·S·H·I``. The same in every variant (verl's separate gate and up matmuls add up to gate_up)."""
    rows = tokens * config.num_experts_per_tok
    forward = 6 * rows * config.hidden_size * config.moe_intermediate_size
    return {"forward": forward, "backward": 2 * forward}


def per_layer_rows(config, tokens: int, dtype: torch.dtype, inference: bool,
                   variants: Iterable[MoeVariant] = MOE_VARIANTS) -> dict[str, dict]:
    """Every variant's per-layer row for one mode (training or inference); one progress line per row.

    Returns:
        Per variant name: ``kernels`` / ``bytes_read`` / ``bytes_written`` / ``bytes`` / ``glue_bytes`` /
        ``flops`` / ``grouped_mm_flops`` / ``est_ms`` / ``roofline_ms`` / ``grouped_mm`` (per graph kind and
        ``total``), ``swiglu`` (:func:`swiglu_cat_inputs` per layer), ``roofline_ms_by_category``, ``fusions_per_layer``,
        ``by_op`` (the per-op tables) and ``capture_seconds``.
    """
    variants = list(variants)
    kinds = graph_kinds(inference)
    mode = "inference" if inference else "training"
    rows = {}
    splits = per_layer_splits(lambda n, group: build_moe_graphs(config, n, group, tokens, dtype, inference),
                              variants, inference)
    for variant, g1, g2, layer, seconds in splits:
        swiglu = {kind: {k: swiglu_cat_inputs(g2[kind])[k] - swiglu_cat_inputs(g1[kind])[k]
                         for k in ("npu_swiglu", "fed_by_cat", "fed_by_grouped_matmul")} for kind in kinds}
        row = layer_row(variant, g1, g2, layer, seconds, after={
            "flops": {"grouped_mm_flops": per_kind(kinds, lambda k: grouped_mm_flops(layer[k]))},
            "roofline_ms_by_category": {
                "grouped_mm": {kind: grouped_mm_counts(layer[kind]) for kind in kinds},
                "swiglu": swiglu,
                "grad_layout_copies": ({k: grad_layout_copies(g2["backward"])[k] - grad_layout_copies(g1["backward"])[k]
                                        for k in ("tensors", "bytes")} if not inference else {"tensors": 0, "bytes": 0}),
            },
        })
        copies = row["grad_layout_copies"]["bytes"]
        row["grad_layout_copies"]["ms"] = est_ms(copies)
        row["with_grad_layout_copies"] = {"bytes": row["bytes"]["total"] + copies,
                                          "est_ms": est_ms(row["bytes"]["total"] + copies),
                                          "roofline_ms": row["roofline_ms"]["total"] + est_ms(copies)}
        rows[variant.name] = row
        gmm = "; ".join(f"{k} " + ", ".join(f"{label} {n}" for label, n in row["grouped_mm"][k].items() if n)
                        for k in kinds)
        log.info("moe traffic: %s %s %s: %s; grouped matmuls %s; grad layout copies %s MiB",
                 MODEL if tokens == TOKENS else "tiny", mode, variant.name, row_line(row), gmm,
                 f"{row['grad_layout_copies']['bytes'] / MIB:,.0f}")
    return {v.name: rows[v.name] for v in variants}


def model_shape(config, tokens: int, dtype: torch.dtype) -> dict:
    """The shape fields a reader needs to check the numbers."""
    return {
        "hidden_size": config.hidden_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "tokens": tokens,
        "routed_rows": tokens * config.num_experts_per_tok,
        "dtype": str(dtype).replace("torch.", ""),
    }


def tiny_config():
    """The quick run's tiny Qwen3-MoE: ``tests/helpers/models.py``'s ``tiny_moe("qwen3_moe")`` shapes (hidden 64, 4 experts,
    top-2, ``moe_intermediate_size`` 32, head_dim 64, 4 / 2 heads), 2 layers."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, head_dim=64, norm_topk_prob=True)


def measure(name: str, config, tokens: int, dtype: torch.dtype = torch.bfloat16,
            modes: Sequence[str] = ("training", "inference")) -> dict:
    """The MoE rows of one model: per mode, per variant (:func:`per_layer_rows`), plus the formula FLOPs."""
    out = {"model": name, "shape": model_shape(config, tokens, dtype),
           "expected_grouped_mm_flops_per_layer": expected_grouped_mm_flops(config, tokens), "modes": {}}
    for mode in modes:
        out["modes"][mode] = per_layer_rows(config, tokens, dtype, inference=mode == "inference")
    return out


def run(quick: bool = False) -> dict:
    """The ``moe_traffic.json`` payload (without run metadata): Qwen3-30B-A3B at T = 4096 (quick: the tiny Qwen3-MoE
    at T = 16), training and inference, every variant of :data:`MOE_VARIANTS`."""
    if quick:
        name, config, tokens = "tiny-qwen3-moe", tiny_config(), QUICK_TOKENS
    else:
        name, config, tokens = MODEL, resolve_model_config(MODEL), TOKENS
    return {
        "kind": "moe_traffic",
        "bandwidth": BANDWIDTH,
        "peak": PEAK,
        "verl_patch_sources": list(VERL_MOE_SOURCES),
        "verl_attention_sources": list(FA2_SOURCES),
        "variants": {v.name: v.description for v in MOE_VARIANTS},
        "definitions": {
            "per_layer": "graph(L=2) - graph(L=1), op by op (benchmarks.tables.subtract); every layer is a sparse MoE layer",
            "kernels": "as benchmarks.cost_model: call_function nodes on ATen/npu ops returning a tensor, views excluded",
            "bytes": "non-matmul kernels' tensor inputs + outputs (benchmarks.cost_model.node_bytes); bytes_read/written "
            "split them; matmuls and grouped matmuls enter the roofline only",
            "glue_bytes": "copies made for a fused npu op (benchmarks.cost_model.is_glue): verl's npu_swiglu cat, contiguous "
            "copies of a grouped matmul's operand",
            "flops": "Cube FLOPs: matmuls 2MNK, grouped matmuls 2MKN over their groups, attention as benchmarks.cost_model",
            "est_ms": "non-matmul bytes / bandwidth",
            "roofline_ms": "sum over every kernel of max(FLOPs / Cube peak, bytes / bandwidth) "
            "(benchmarks.cost_model.kernel_time)",
            "grouped_mm": "per-layer kernels of aten._grouped_mm, transformers::grouped_mm_fallback, "
            "qwen_npu::grouped_matmul and npu::npu_grouped_matmul",
            "swiglu": "per layer: npu_swiglu calls, those reading a cat (through views) and those reading a grouped matmul",
            "grad_layout_copies": "backward-graph outputs (gradients) that are not contiguous: AccumulateGrad clones "
            "them into the parameter's layout after the graph (read + write once); not in bytes/kernels, added in "
            "with_grad_layout_copies (bytes, est_ms, roofline_ms)",
            "routing": "static shapes under FakeTensor (T*k rows); bytes and FLOPs do not depend on the routing; "
            "load imbalance is not modelled (uniform routing's cost)",
        },
        "models": {name: measure(name, config, tokens)},
    }


def main(argv: list[str] | None = None) -> int:
    """Write ``<out>/moe_traffic.json`` (run metadata, then :func:`run`'s payload)."""
    parser = argparse.ArgumentParser(description="qwen_npu MoE traffic per decoder layer")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="tiny Qwen3-MoE at T=16: a smoke test in seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[bench] %(message)s", stream=sys.stderr)
    start = time.perf_counter()
    payload = run(quick=args.quick)
    elapsed = time.perf_counter() - start
    command = "python -m benchmarks.moe_traffic " + " ".join(sys.argv[1:] if argv is None else argv)
    path = write_json(args.out / "moe_traffic.json", with_run_metadata(payload, command.strip(), args.quick, elapsed))
    log.info("wrote %s (%.1fs)", path, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
