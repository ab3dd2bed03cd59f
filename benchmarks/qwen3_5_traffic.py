"""Kernels, HBM traffic and roofline per Qwen3.5 decoder layer, per layer kind: eager, verl-style, qwen_npu.

Usage (from the repository root; nothing allocated at full size)::

    python -m benchmarks.qwen3_5_traffic --out benchmarks/results          # Qwen3.5-27B widths, S = 4096
    python -m benchmarks.qwen3_5_traffic --quick --out /tmp/q35            # tiny Qwen3.5, S = 128, training

writes ``<out>/qwen3_5_traffic.json``; ``python -m benchmarks.markdown benchmarks/results/qwen3_5_traffic.json``
prints the README table. One progress line per row goes to stderr (logger ``benchmarks.qwen3_5_traffic``).

Qwen3.5 is hybrid: three Gated DeltaNet (``linear_attention``) layers, then one gated full-attention layer
(``full_attention``), repeated. Each kind is measured on its own: a :class:`transformers.Qwen3_5TextModel` whose
``layer_types`` are ``[kind] * L`` (L = 1, 2) under a :class:`~torch._subclasses.fake_tensor.FakeTensorMode`, bf16,
one row of ``S`` tokens (B = 1) given as ``inputs_embeds``; per layer = graph(L=2) - graph(L=1) op by op, so the
once-per-forward work (rotary cos/sin, masks) cancels. Training: ``train()``, the input requires grad, the final
norm is ``Identity``; inference: ``eval()`` under ``no_grad`` with the final norm kept (as the dense and MoE
inference rows). The graphs are captured as the dense and MoE rows' are (:mod:`benchmarks.capture`:
``torch.compile(fullgraph=True)`` with a recording backend, then AOTAutograd, default partitioner), and counted
with the same rules (:mod:`benchmarks.cost_model`: :func:`~benchmarks.cost_model.graph_counts`,
:func:`~benchmarks.cost_model.node_bytes`, :func:`~benchmarks.cost_model.kernel_flops`,
:func:`~benchmarks.cost_model.kernel_time`). Units: kernels (counts), bytes (non-matmul kernels' reads + writes),
FLOPs (Cube; the triangular solves' apart, Vector), ``est_ms`` and ``roofline_ms`` (milliseconds at the Atlas A2
figures of the CANN developer guide, :data:`~benchmarks.cost_model.BANDWIDTH` / :data:`~benchmarks.cost_model.PEAK`),
per decoder layer and graph kind.

Variants (:data:`VARIANTS`):

* ``eager``: transformers 5.24's modeling code as is (SDPA attention with transformers' explicit mask, the torch
  reference ``torch_chunk_gated_delta_rule``, the ``F.conv1d`` fallback of ``causal_conv1d_fn``, unfused (1+w)
  and gated norms, partial rotary as slice + rotate_half + cat); the canonicalized graph with no pass.
* ``verl``: verl 0.9.1's ``npu_patch`` for Qwen3.5 (:mod:`benchmarks.verl_qwen3_5_patch`: (1+w) RMSNorm as
  ``npu_rms_norm`` on fp32 with ``1 + w``, gated norm as ``npu_rms_norm`` + eager fp32 ``* silu(gate)``, partial
  rotary as slice + ``npu_rotary_mul`` + ``cat``) and attention through transformers' NPU flash attention
  (:func:`benchmarks.verl_patch.npu_flash_attention_2`, BSND, ``sparse_mode=3``), as the dense verl-style rows;
  no pass of ours. The attention output gate, the DeltaNet and the dense MLP are not patched by verl.
* ``qwen_npu``: every family (:data:`qwen_npu_compile.config.ALL_FAMILIES`): whatever the families emit at the
  time of the run (``fusions_per_layer`` in the results says what fused), the delta rule op on its **reference
  kernel** (what an Ascend host runs without FLA: ``ops/qwen_npu/gated_delta_rule_kernels.py``).
* ``qwen_npu_fla``: the same graphs, the delta rule op on **FLA >= 0.5.2's kernels** (triton-ascend), what an
  Ascend host with FLA runs.

**The chunked delta rule** (``torch_chunk_gated_delta_rule``, chunk size ``C`` = 64) is traced ATen ops in eager and
verl-style (Dynamo unrolls its scan over the ``S/C`` chunks; the capture runs with the substitution off); qwen_npu
runs it as one op, ``qwen_npu::chunk_gated_delta_rule`` (the ``gated_delta_rule`` family), costed as its kernel runs it
(:func:`cost_delta_rule`): ``qwen_npu`` counts the ATen graph of the op's reference kernel traced at the node's
shapes (:func:`reference_kernel_graph`: the forward; for the backward op the forward recomputed and differentiated by
autograd), ``qwen_npu_fla`` one row per FLA 0.5.2 kernel (``fla.*`` ops, :data:`FLA_KERNELS`: each kernel of
``chunk_gated_delta_rule_fwd`` / ``chunk_gated_delta_rule_bwd`` in ``fla/ops/gated_delta_rule/chunk.py`` with its
Cube FLOPs and the HBM bytes of the tensors it reads and writes; :func:`fla_cost`). Matmuls (``@`` on 4-/5-D fp32
tensors, ``aten.bmm`` after decomposition) are matmuls (Cube, ``2·M·N·K``); the two ``linalg_solve_triangular``
calls (and their backward) are vector kernels whose FLOPs (:func:`solve_triangular_flops`: ``C·(C-1)·D`` per
``C x C`` unit-triangular system and ``D`` right-hand sides) are reported and enter the roofline at the Vector peak
(:func:`solve_triangular_time`); every other kernel is counted as in the other rows. Per DeltaNet layer
(``H`` = value heads after ``repeat_interleave``, ``dk``/``dv`` head dims; derived from transformers' code,
:func:`expected_deltanet_flops`): chunk matmuls ``S·H·(4·C·dk + 2·C·dv + 6·dk·dv)`` forward less the last chunk's
state update (dead code without ``output_final_state``), triangular solves ``S·H·(C-1)·(dv + dk)``.

Not modelled: fp32 matmuls (the DeltaNet's, all fp32) counted at the BF16 Cube peak (optimistic), the
kernels' internals (FLA's: tiles kept on chip between its reads and writes), launch overhead (the unrolled scan is about 10 kernels per chunk per graph), overlap; no
kernel ran on an NPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.fx

from qwen_npu_compile.config import ALL_FAMILIES

from .capture import LayerVariant, capture_layers
from .common import MIB, with_run_metadata, write_json
from .cost_model import BANDWIDTH, PEAK, as_int, graph_counts, node_bytes, op_name, tensor_numel
from .tables import (capture_verl_deltanet, graph_kinds, layer_row, per_kind, per_layer_splits, row_line, subtract,
                     summarize)
from .verl_patch import FA2_SOURCES
from .verl_qwen3_5_patch import SOURCES as VERL_SOURCES
from .verl_qwen3_5_patch import verl_qwen3_5_patches

log = logging.getLogger(__name__)

aten = torch.ops.aten

#: The model and shape of the full run: Qwen3.5-27B's text widths, S = 4096 tokens.
MODEL = "qwen3.5-27b"
TOKENS = 4096
#: The quick run: a tiny Qwen3.5 (``tests/helpers/models.py``'s ``tiny_hybrid("qwen3_5")`` shapes), S = 128 (2 chunks).
QUICK_TOKENS = 128

#: Qwen3.5-27B's text config (``Qwen/Qwen3.5-27B`` ``config.json`` ``text_config``): attention and MLP widths as in
#: THUDM/slime ``scripts/models/qwen3.5-27B.sh`` (24 / 4 heads, kv-channels 256, hidden 5120, ffn 17408, rotary
#: 0.25, base 1e7, eps 1e-6, 64 layers), the linear-attention widths (16 key / 48 value heads of 128, conv 4) as in
#: the public copies of the ``qwen3_5`` 27B ``config.json`` (the Qwen3.6-27B one is the same architecture and
#: widths). Only the shapes matter here.
QWEN3_5_27B = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    use_cache=False,
)
#: ``tests/helpers/models.py``'s ``TINY_HYBRID`` (hidden 128, head_dim 64, 4 / 2 heads, linear 2 key / 4 value heads
#: of 32) with ``intermediate_size`` 256.
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=256,
            use_cache=False)

#: The two layer kinds (``config.layer_types`` values).
LAYER_KINDS = ("linear_attention", "full_attention")
#: transformers' ``torch_chunk_gated_delta_rule`` default chunk size.
CHUNK = 64

SOLVE_TRIANGULAR = "aten.linalg_solve_triangular.default"
#: The Gated DeltaNet's delta rule as one op (``qwen_npu_compile.ops.qwen_npu.gated_delta_rule``) and its backward op.
DELTA_RULE = "qwen_npu.chunk_gated_delta_rule.default"
DELTA_RULE_BACKWARD = "qwen_npu.chunk_gated_delta_rule_backward.default"

#: How each qwen_npu variant costs the delta rule op's nodes (:func:`cost_delta_rule`); other variants have none.
DELTA_RULE_KERNEL = {"qwen_npu": "reference", "qwen_npu_fla": "fla"}


#: One way of running Qwen3.5 (module docstring); ``verl``: verl's Qwen3.5 ``npu_patch``.
Qwen35Variant = LayerVariant


#: One row per variant: data (the MoE and Qwen3.5 benchmarks' variant tables share their shape, not logic).
VARIANTS = (
    Qwen35Variant("eager", (), False,
                  "transformers 5.24 as is: SDPA (explicit mask), torch chunked delta rule, F.conv1d causal conv, "
                  "unfused (1+w) / gated RMSNorm, partial rotary as slice + rotate_half + cat; nothing fused"),
    Qwen35Variant("verl", (), True,
                  "verl 0.9.1 npu_patch for Qwen3.5: (1+w) RMSNorm npu_rms_norm(x.float(), 1 + w.float()), gated "
                  "norm npu_rms_norm + eager fp32 * silu(gate), partial rotary slice + npu_rotary_mul + cat; "
                  "attention through transformers' NPU flash attention (BSND, sparse_mode 3); attention gate, "
                  "DeltaNet and dense MLP unpatched; no pass of ours"),
    Qwen35Variant("qwen_npu", tuple(ALL_FAMILIES), False,
                  "qwen_npu, every family (rms_norm incl. (1+w) and q/k norms, rms_norm_gated, swiglu, rotary incl. "
                  "partial, attention, gated_delta_rule, ...), the delta rule op on its reference kernel (what runs on "
                  "an Ascend host without FLA: the op's ATen reference forward, its backward recomputing it under "
                  "autograd; counted from a trace of that kernel)"),
    Qwen35Variant("qwen_npu_fla", tuple(ALL_FAMILIES), False,
                  "qwen_npu, every family, the delta rule op on FLA >= 0.5.2's chunk_gated_delta_rule (triton-ascend): "
                  "its kernels' FLOPs and HBM bytes from FLA 0.5.2's algorithm (fla_kernels); not measured on an NPU"),
)


def qwen3_5_27b_config(**overrides):
    """Qwen3.5-27B's text config (:data:`QWEN3_5_27B`)."""
    import transformers

    return transformers.Qwen3_5TextConfig(**{**QWEN3_5_27B, **overrides})


def tiny_config(**overrides):
    """The quick run's tiny Qwen3.5 (:data:`TINY`)."""
    import transformers

    return transformers.Qwen3_5TextConfig(**{**TINY, **overrides})


def _with_layers(config, kind: str, layers: int):
    """A copy of ``config`` with ``layers`` decoder layers, all of kind ``kind``."""
    import copy

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    cfg.layer_types = [kind] * layers
    return cfg


# ----------------------------------------------------------------------------------------------------
# counting additions: the triangular solves of the chunked delta rule


def solve_triangular_flops(node: torch.fx.Node) -> int:
    """FLOPs of one ``aten.linalg_solve_triangular`` kernel: forward/back substitution.

    ``A [..., n, n]`` triangular, ``B [..., n, m]`` (``left=True``) or ``[..., m, n]`` (``left=False``), batch dims
    broadcast: per system and right-hand side, ``n·(n-1)`` FLOPs (one multiply and one add per off-diagonal entry)
    with ``unitriangular=True``, ``n²`` otherwise (the ``n`` divisions). 0 for any other node.
    """
    if node.op != "call_function" or op_name(node) != SOLVE_TRIANGULAR:
        return 0
    a = node.args[0].meta["val"]
    kwargs = dict(node.kwargs)
    names = ("upper", "left", "unitriangular")
    for i, name in enumerate(names, start=2):
        if len(node.args) > i:
            kwargs[name] = node.args[i]
    unit = kwargs.get("unitriangular", False)
    n = int(a.shape[-1])
    # the output has B's (broadcast) shape: n entries per system and right-hand side, whichever side A is on
    systems_times_rhs = tensor_numel(node.meta["val"]) // n
    return systems_times_rhs * (n * (n - 1) if unit else n * n)


def solve_triangular_time(flops: int, num_bytes: int) -> float:
    """Roofline time of a triangular solve: ``max(FLOPs / Vector peak, bytes / bandwidth)`` (a substitution is a
    chain of dependent vector updates, not a Cube matmul)."""
    return max(flops / PEAK["vector_fp16_flops_per_second"], num_bytes / BANDWIDTH["bytes_per_second"])


def delta_rule_op_flops(node: torch.fx.Node) -> tuple[int, int]:
    """``(Cube FLOPs, vector FLOPs)`` modelled for one ``qwen_npu.chunk_gated_delta_rule`` (or its backward op) node.

    Forward: the chunked algorithm of :func:`expected_deltanet_flops` on ``S`` padded to whole chunks, with the last
    chunk's state update (the op returns the final state): ``S·H·(4·C·dk + 2·C·dv + 6·dk·dv)`` matmul FLOPs and
    ``S·H·(C-1)·(dv + dk)`` triangular-solve FLOPs. Backward (the op's: the forward recomputed, then each matmul's
    two gradient matmuls, each solve's transposed solve): 3x the forward's matmul FLOPs, 2x its solve FLOPs, the
    usual 2x-forward backward of matmuls (as :func:`benchmarks.cost_model.kernel_flops` counts attention's) plus the
    recompute. A model of what a fused kernel must compute; FLA's / fla_npu's kernels were not measured. (0, 0) for
    any other node."""
    name = op_name(node) if node.op == "call_function" else ""
    if name not in (DELTA_RULE, DELTA_RULE_BACKWARD):
        return 0, 0
    first = 2 if name == DELTA_RULE_BACKWARD else 0  # the backward op's args start with the two gradients
    query, value = node.args[first].meta["val"], node.args[first + 2].meta["val"]
    batch, tokens, heads, dk = (as_int(x) for x in query.shape)
    dv = as_int(value.shape[-1])
    padded = batch * -(-tokens // CHUNK) * CHUNK
    cube = padded * heads * (4 * CHUNK * dk + 2 * CHUNK * dv + 6 * dk * dv)
    vector = padded * heads * (CHUNK - 1) * (dv + dk)
    return (3 * cube, 2 * vector) if name == DELTA_RULE_BACKWARD else (cube, vector)


def _op_shapes(node: torch.fx.Node) -> tuple:
    first = 2 if op_name(node) == DELTA_RULE_BACKWARD else 0  # the backward op's args start with the gradients
    return tuple(node.args[first + i].meta["val"] for i in range(5)), node.args[first + 5], node.args[first + 7]


def reference_kernel_graph(node: torch.fx.Node) -> torch.fx.GraphModule:
    """The ATen graph of the op's reference kernel at this node's shapes (fake tensors, ``make_fx``): the forward
    (:func:`qwen_npu_compile.ops.qwen_npu.gated_delta_rule.reference`) or, for the backward op, the reference recomputed
    and differentiated by autograd (what the backward op's reference kernel runs). Only ``cu_seqlens = None`` (the
    benchmark's one row)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from qwen_npu_compile.ops.qwen_npu.gated_delta_rule import reference

    (q, k, v, g, beta), cu_seqlens, scale = _op_shapes(node)
    if cu_seqlens is not None:
        raise ValueError("reference_kernel_graph: packed rows (cu_seqlens) are not modelled")
    shapes = [(tuple(as_int(d) for d in t.shape), t.dtype) for t in (q, k, v, g, beta)]
    backward = op_name(node) == DELTA_RULE_BACKWARD

    def forward(q, k, v, g, beta):
        return reference(q, k, v, g, beta, None, None, scale, True)

    def forward_and_backward(q, k, v, g, beta, grad_out):
        inputs = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        with torch.enable_grad():
            out, _ = forward(*inputs)
            return torch.autograd.grad(out, inputs, grad_out)

    with FakeTensorMode():
        args = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
        if backward:
            args.append(torch.empty(shapes[2][0], dtype=q.dtype))
        return make_fx(forward_and_backward if backward else forward)(*args)


#: FLA 0.5.2's kernels of one ``chunk_gated_delta_rule`` call (``fla/ops/gated_delta_rule/chunk.py``:
#: ``ChunkGatedDeltaRuleFunction.forward`` -> ``l2norm_fwd`` x2, ``chunk_gated_delta_rule_fwd`` ->
#: ``chunk_local_cumsum``, ``chunk_gated_delta_rule_fwd_intra`` (triton-ascend: ``chunk_scaled_dot_kkt_fwd``,
#: ``solve_tril``, ``recompute_w_u_fwd``), ``chunk_gated_delta_rule_fwd_h``, ``chunk_fwd_o``; ``backward`` ->
#: ``chunk_gated_delta_rule_bwd``: ``recompute_w_u_fwd``, ``chunk_gated_delta_rule_fwd_h`` (recomputed),
#: ``chunk_bwd_dv_local``, ``chunk_gated_delta_rule_bwd_dhu``, ``chunk_bwd_dqkwg``, ``prepare_wy_repr_bwd``,
#: ``chunk_local_cumsum`` (reverse), ``l2norm_bwd`` x2). Per kernel: ``(name, Cube FLOPs per token and head,
#: tensors read, tensors written)``; a tensor is ``(per-token elements, bytes per element: "e" the operands' dtype,
#: 4 fp32)`` with ``C`` the chunk, ``K``/``V`` the head dims; ``h``/``dh`` are ``K·V`` per chunk (``K·V/C`` per
#: token). FLOPs: ``2·M·N·K`` per matmul of the kernel (``kkt`` ``β·K·Kᵀ`` per chunk: ``2·C·K`` per token; the
#: triangular inverse ``C²/3``; ``w = A·(k·β·e^g)``, ``u = A·(v·β)``: ``2·C·K``, ``2·C·V``; the state pass ``v_new = u
#: - w·h`` and ``h += kᵀ·v_new``: ``4·K·V``; ``o = q·h + (q·kᵀ ⊙ M)·v_new``: ``2·K·V + 2·C·K + 2·C·V``; the backward's
#: as the transposed products of each). Bytes: each kernel reads its inputs and writes its outputs once (tiles
#: in UB/L1 between); the recurrences' sequential state is on chip.
FLA_KERNELS = {
    "forward": (
        ("l2norm_fwd(q, k)", "0", [("2*K", "e")], [("2*K", "e"), ("2", 4)]),
        ("chunk_local_cumsum(g)", "0", [("1", 4)], [("1", 4)]),
        ("chunk_scaled_dot_kkt_fwd", "2*C*K", [("K", "e"), ("1", "e"), ("1", 4)], [("C", 4)]),
        ("solve_tril", "C*C/3", [("C", 4)], [("C", "e")]),
        ("recompute_w_u_fwd", "2*C*K + 2*C*V", [("K + V + C + 1", "e"), ("1", 4)], [("K + V", "e")]),
        ("chunk_gated_delta_rule_fwd_h", "4*K*V", [("2*K + V", "e"), ("1", 4)], [("K*V/C + V", "e")]),
        ("chunk_fwd_o", "2*K*V + 2*C*K + 2*C*V", [("2*K + V + K*V/C", "e"), ("1", 4)], [("V", "e")]),
    ),
    "backward": (
        ("recompute_w_u_fwd", "2*C*K + 2*C*V", [("K + V + C + 1", "e"), ("1", 4)], [("K + V", "e")]),
        ("chunk_gated_delta_rule_fwd_h", "4*K*V", [("2*K + V", "e"), ("1", 4)], [("K*V/C + V", "e")]),
        ("chunk_bwd_dv_local", "2*C*K + 2*C*V", [("2*K + V", "e"), ("1", 4)], [("V", "e")]),
        ("chunk_gated_delta_rule_bwd_dhu", "6*K*V", [("3*K + 2*V", "e"), ("1", 4)], [("K*V/C + V", "e")]),
        ("chunk_bwd_dqkwg", "6*K*V + 4*C*K + 2*C*V", [("3*K + 3*V + 2*K*V/C", "e"), ("1", 4)],
         [("3*K", "e"), ("1", 4)]),
        ("prepare_wy_repr_bwd", "4*C*K + 4*C*V + 2*C*C", [("2*K + 2*V + C + 1", "e"), ("1", 4)],
         [("K + V + 1", "e"), ("1", 4)]),
        ("chunk_local_cumsum(dg, reverse)", "0", [("1", 4)], [("1", 4)]),
        ("l2norm_bwd(q, k)", "0", [("4*K", "e"), ("2", 4)], [("2*K", "e")]),
    ),
}


def fla_cost(node: torch.fx.Node) -> list[dict]:
    """FLA 0.5.2's kernels for one delta rule op node (:data:`FLA_KERNELS`; the backward op's: FLA's forward,
    recomputed under autograd, then its backward): per kernel ``name``, ``flops`` (Cube),
    ``bytes_read``, ``bytes_written``, ``roofline_ps`` (``max(FLOPs / Cube peak, bytes / bandwidth)``), for ``B·T``
    tokens (padded to whole chunks) and ``H`` heads."""
    (q, _, v, _, _), _, _ = _op_shapes(node)
    batch, tokens, heads, k_dim = (as_int(x) for x in q.shape)
    values = dict(C=CHUNK, K=k_dim, V=as_int(v.shape[-1]))
    element = q.dtype.itemsize
    units = batch * -(-tokens // CHUNK) * CHUNK * heads  # token-heads
    out = []
    # the backward op recomputes FLA's forward under autograd, then runs FLA's backward (gated_delta_rule.py)
    kernels = (FLA_KERNELS["forward"] + FLA_KERNELS["backward"] if op_name(node) == DELTA_RULE_BACKWARD
               else FLA_KERNELS["forward"])
    for name, flops, reads, writes in kernels:
        def moved(tensors):
            return round(sum(eval(n, {}, values) * (element if size == "e" else size) for n, size in tensors) * units)
        kernel = {"name": name, "flops": round(eval(flops, {}, values) * units), "bytes_read": moved(reads),
                  "bytes_written": moved(writes)}
        kernel["roofline_ps"] = round(max(kernel["flops"] / PEAK["cube_bf16_flops_per_second"],
                                          (kernel["bytes_read"] + kernel["bytes_written"]) / BANDWIDTH["bytes_per_second"])
                                      * 1e12)
        out.append(kernel)
    return out


_REFERENCE_COSTS: dict[tuple, tuple[dict, dict]] = {}


def _reference_costs(node: torch.fx.Node) -> tuple[dict[str, dict], dict[str, int]]:
    """(:func:`counts`, :func:`solve_counts`) of :func:`reference_kernel_graph` for this node, cached by shapes."""
    (q, k, v, g, beta), _, scale = _op_shapes(node)
    key = (op_name(node), scale, *((tuple(as_int(d) for d in t.shape), t.dtype) for t in (q, v, g, beta)))
    if key not in _REFERENCE_COSTS:
        gm = reference_kernel_graph(node)
        _REFERENCE_COSTS[key] = counts(gm), solve_counts(gm)
    return _REFERENCE_COSTS[key]


def delta_rule_solves(gm: torch.fx.GraphModule, kernel: str | None) -> dict[str, int]:
    """:func:`solve_counts` of ``gm`` plus, for the reference kernel, its delta rule ops' traced solves."""
    out = solve_counts(gm)
    if kernel == "reference":
        for node in gm.graph.nodes:
            if node.op == "call_function" and op_name(node) in (DELTA_RULE, DELTA_RULE_BACKWARD):
                for key, value in _reference_costs(node)[1].items():
                    out[key] += value
    return out


def _add(table: dict[str, dict], other: dict[str, dict], times: int = 1) -> None:
    for op, row in other.items():
        mine = table.setdefault(op, {key: 0 for key in row} | {"category": row["category"]})
        for key, value in row.items():
            if key != "category":
                mine[key] = mine.get(key, 0) + value * times


def cost_delta_rule(table: dict[str, dict], gm: torch.fx.GraphModule, kernel: str | None) -> dict[str, dict]:
    """``table`` (:func:`counts` of ``gm``) with the delta rule op's nodes costed as ``kernel`` runs them:
    ``"reference"``: each node replaced by the per-op table of its reference kernel's ATen graph
    (:func:`reference_kernel_graph`); ``"fla"``: each node one row per FLA kernel (:func:`fla_cost`, op names
    ``fla.<kernel>``, category ``fused``); None: unchanged."""
    if kernel is None:
        return table
    out = {op: dict(row) for op, row in table.items() if op not in (DELTA_RULE, DELTA_RULE_BACKWARD)}
    for node in gm.graph.nodes:
        if node.op != "call_function" or op_name(node) not in (DELTA_RULE, DELTA_RULE_BACKWARD):
            continue
        if kernel == "reference":
            _add(out, _reference_costs(node)[0])
            continue
        for row in fla_cost(node):
            _add(out, {f"fla.{row['name']}": {"category": "fused", "kernels": 1, "flops": row["flops"],
                                               "bytes_read": row["bytes_read"], "bytes_written": row["bytes_written"],
                                               "roofline_ps": row["roofline_ps"], "glue_kernels": 0,
                                               "glue_bytes": 0}})
    return out


def counts(gm: torch.fx.GraphModule) -> dict[str, dict]:
    """:func:`benchmarks.cost_model.graph_counts` with the triangular solves' vector FLOPs: their rows get ``flops``
    = 0 (the Cube FLOPs, as every vector kernel) and their ``roofline_ps`` from :func:`solve_triangular_time`;
    the vector FLOPs are in :func:`solve_counts`. The delta rule op (and its backward) get the Cube FLOPs of
    :func:`delta_rule_op_flops` and the roofline ``max((cube / Cube peak + vector / Vector peak), bytes / bandwidth)``,
    its bytes being only its operands and results (one kernel)."""
    table = graph_counts(gm)
    for op in (DELTA_RULE, DELTA_RULE_BACKWARD):
        row = table.get(op)
        if row is None:
            continue
        row["category"], row["flops"], row["roofline_ps"] = "fused", 0, 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and op_name(node) == op:
                cube, vector = delta_rule_op_flops(node)
                read, written = node_bytes(node)
                seconds = max(cube / PEAK["cube_bf16_flops_per_second"] + vector / PEAK["vector_fp16_flops_per_second"],
                              (read + written) / BANDWIDTH["bytes_per_second"])
                row["flops"] += cube
                row["roofline_ps"] += round(seconds * 1e12)
    row = table.get(SOLVE_TRIANGULAR)
    if row is not None:
        row["roofline_ps"] = 0
        for node in gm.graph.nodes:
            if node.op == "call_function" and op_name(node) == SOLVE_TRIANGULAR:
                read, written = node_bytes(node)
                row["roofline_ps"] += round(solve_triangular_time(solve_triangular_flops(node), read + written) * 1e12)
    return table


def solve_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """``{"kernels", "vector_flops", "bytes"}`` of the graph's triangular solves."""
    out = {"kernels": 0, "vector_flops": 0, "bytes": 0}
    for node in gm.graph.nodes:
        if node.op == "call_function" and op_name(node) == SOLVE_TRIANGULAR:
            out["kernels"] += 1
            out["vector_flops"] += solve_triangular_flops(node)
            out["bytes"] += sum(node_bytes(node))
    return out


def expected_deltanet_flops(config, tokens: int, chunk: int = CHUNK) -> dict[str, int]:
    """The chunked delta rule's forward FLOPs per DeltaNet layer from the config (derived from transformers 5.24's
    ``torch_chunk_gated_delta_rule``; ``S`` a multiple of ``C``, B = 1; ``H`` value heads, ``dk``/``dv`` head dims).

    Per chunk and head: ``k_beta @ kᵀ`` and ``q @ kᵀ`` (``2·C²·dk`` each), in the scan ``k_cumdecay @ state`` and
    ``q @ state`` (``2·C·dk·dv`` each), ``intra_attn @ v_new`` (``2·C²·dv``) and ``kᵀ @ v_new`` (``2·C·dk·dv``);
    over ``S/C`` chunks: ``S·H·(4·C·dk + 2·C·dv + 6·dk·dv)``, less the last chunk's state update ``2·C·dk·dv·H``,
    which is dead code without ``output_final_state`` (the graph drops it): the ``bmm`` kernels'
    ``S·H·(4·C·dk + 2·C·dv + 6·dk·dv) - 2·C·H·dk·dv``. The two unit-triangular solves (``C x C``, ``dv`` and ``dk``
    right-hand sides): ``S·H·(C-1)·(dv + dk)``.
    """
    heads, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    return {"bmm": tokens * heads * (4 * chunk * dk + 2 * chunk * dv + 6 * dk * dv) - 2 * chunk * heads * dk * dv,
            "solve_triangular": tokens * heads * (chunk - 1) * (dv + dk)}


def expected_projection_flops(config, tokens: int, kind: str) -> int:
    """Forward FLOPs of one layer's linear projections (2-D ``mm``), ``2·S·K·N`` each: DeltaNet ``in_proj_qkv``
    (``H → 2·Nk·dk + Nv·dv``), ``in_proj_z`` (``Nv·dv``), ``in_proj_b``/``a`` (``Nv``), ``out_proj``; full attention
    ``q_proj`` (``H → 2·Nq·D``: query and gate), ``k_proj``/``v_proj`` (``Nkv·D``), ``o_proj``; the MLP ``3·H·I``."""
    h, s = config.hidden_size, tokens
    if kind == "linear_attention":
        kd = config.linear_num_key_heads * config.linear_key_head_dim
        vd = config.linear_num_value_heads * config.linear_value_head_dim
        mixer = h * (2 * kd + vd) + h * vd + 2 * h * config.linear_num_value_heads + vd * h
    else:
        d = config.head_dim
        mixer = h * 2 * config.num_attention_heads * d + 2 * h * config.num_key_value_heads * d \
            + config.num_attention_heads * d * h
    return 2 * s * (mixer + 3 * h * config.intermediate_size)


# ----------------------------------------------------------------------------------------------------
# graph building


def build_graphs(config, kind: str, layers: int, variants: Sequence[Qwen35Variant], tokens: int, dtype: torch.dtype,
                 inference: bool = False) -> dict[str, dict]:
    """Capture ``layers`` Qwen3.5 decoder layers of kind ``kind`` once under fake tensors; each variant's AOT graphs.

    The variants must agree on :attr:`Qwen35Variant.verl` (one Dynamo capture of one model code). Each gets the
    canonical ATen graph, its passes (:func:`qwen_npu_compile.fusion.manager.fuse`, checks as for torchair on an NPU; none for
    eager and verl) and :func:`qwen_npu_compile.graph.emit.finalize`, then AOTAutograd (backward compiled eagerly).

    Returns:
        Per variant name ``{"forward": GraphModule, "backward": GraphModule (training), "fusions": {family: n}}``,
        plus ``"seconds"``.

    Raises:
        ValueError: the variants disagree on ``verl``. RuntimeError: AOTAutograd did not hand over the graphs.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return capture_layers(modeling_qwen3_5.Qwen3_5TextModel, _with_layers(config, kind, layers), variants, tokens,
                          dtype, inference, verl_qwen3_5_patches)


# ----------------------------------------------------------------------------------------------------
# rows


def fused_kernels(table: dict[str, dict]) -> dict[str, int]:
    """Per op, the kernels of fused ops (``npu`` namespace, and ``qwen_npu`` ops) in a per-op table."""
    return {op: row["kernels"] for op, row in sorted(table.items())
            if op.startswith(("npu.", "qwen_npu.")) and row["kernels"]}


def op_kernels(table: dict[str, dict], op: str) -> int:
    row = table.get(op)
    return row["kernels"] if row else 0


def top_ops(layer: dict[str, dict], kinds: Iterable[str], top: int = 10) -> list[dict]:
    """The ops with the largest roofline time over ``kinds`` (per layer): op, kernels, MiB, ms."""
    merged: dict[str, dict] = {}
    for kind in kinds:
        for op, row in layer[kind].items():
            m = merged.setdefault(op, {"op": op, "category": row["category"], "kernels": 0, "bytes": 0, "roofline_ps": 0})
            m["kernels"] += row["kernels"]
            m["bytes"] += row["bytes_read"] + row["bytes_written"]
            m["roofline_ps"] += row["roofline_ps"]
    ranked = sorted(merged.values(), key=lambda r: -r["roofline_ps"])[:top]
    return [{"op": r["op"], "category": r["category"], "kernels": r["kernels"], "mib": round(r["bytes"] / MIB, 1),
             "roofline_ms": round(r["roofline_ps"] * 1e-9, 4)} for r in ranked]


def per_layer_rows(config, kind: str, tokens: int, dtype: torch.dtype, inference: bool,
                   variants: Iterable[Qwen35Variant] = VARIANTS) -> dict[str, dict]:
    """Every variant's per-layer row for one layer kind and one mode; one progress line per row.

    Returns:
        Per variant name: ``kernels`` / ``bytes_read`` / ``bytes_written`` / ``bytes`` / ``glue_bytes`` / ``flops``
        (Cube) / ``est_ms`` / ``roofline_ms`` (per graph kind and ``total``), ``roofline_ms_by_category``,
        ``fusions_per_layer``, ``fused_kernels`` (per graph kind), ``solve_triangular`` (per graph kind:
        kernels, vector FLOPs, bytes), ``bmm`` (per graph kind: kernels, FLOPs), ``top_ops``, ``by_op``,
        ``capture_seconds``.
    """
    variants = list(variants)
    kinds = graph_kinds(inference)
    mode = "inference" if inference else "training"
    rows = {}
    splits = per_layer_splits(lambda n, group: build_graphs(config, kind, n, group, tokens, dtype, inference),
                              variants, inference, counts=counts, where=f"{kind} ", key=capture_verl_deltanet)
    for variant, g1, g2, layer, seconds in splits:
        kernel = DELTA_RULE_KERNEL.get(variant.name)
        if kernel is not None:  # the delta rule op costed as its kernel runs it (cost_delta_rule)
            layer = {k: subtract(cost_delta_rule(counts(g2[k]), g2[k], kernel),
                                 cost_delta_rule(counts(g1[k]), g1[k], kernel)) for k in kinds}
        solves = {k: {key: delta_rule_solves(g2[k], kernel)[key] - delta_rule_solves(g1[k], kernel)[key]
                      for key in ("kernels", "vector_flops", "bytes")} for k in kinds}
        sums = {k: summarize(layer[k]) for k in kinds}
        row = layer_row(variant, g1, g2, layer, seconds, after={
            "fusions_per_layer": {"fused_kernels": {k: fused_kernels(layer[k]) for k in kinds}},
            "bytes": {"attention_bytes": per_kind(kinds, lambda k: sums[k]["bytes"]["attention"])},
            "flops": {"attention_flops": per_kind(kinds, lambda k: sums[k]["flops"]["attention"])},
            "roofline_ms_by_category": {
                "solve_triangular": solves,
                "bmm": {k: {"kernels": op_kernels(layer[k], "aten.bmm.default"),
                            "flops": layer[k].get("aten.bmm.default", {}).get("flops", 0)} for k in kinds},
                "top_ops": top_ops(layer, kinds),
            },
        })
        rows[variant.name] = row
        log.info("qwen3.5 traffic: %s %s %s: %s; fused %s (%.0fs)", kind, mode, variant.name, row_line(row),
                 row["fusions_per_layer"], row["capture_seconds"])
    return {v.name: rows[v.name] for v in variants}


def model_shape(config, tokens: int, dtype: torch.dtype) -> dict:
    """The shape fields a reader needs to check the numbers."""
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "partial_rotary_factor": config.rope_parameters.get("partial_rotary_factor"),
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "chunk_size": CHUNK,
        "tokens": tokens,
        "dtype": str(dtype).replace("torch.", ""),
    }


def measure(name: str, config, tokens: int, dtype: torch.dtype = torch.bfloat16,
            modes: Sequence[str] = ("training", "inference"), kinds: Sequence[str] = LAYER_KINDS,
            variants: Iterable[Qwen35Variant] = VARIANTS) -> dict:
    """The rows of one model: per layer kind, per mode, per variant (:func:`per_layer_rows`), plus the formulas."""
    variants = list(variants)
    out = {"model": name, "shape": model_shape(config, tokens, dtype),
           "expected_forward_flops_per_layer": {
               "linear_attention": {"deltanet": expected_deltanet_flops(config, tokens),
                                    "projections": expected_projection_flops(config, tokens, "linear_attention")},
               "full_attention": {"projections": expected_projection_flops(config, tokens, "full_attention")}},
           "layer_kinds": {}}
    for kind in kinds:
        out["layer_kinds"][kind] = {"modes": {}}
        for mode in modes:
            out["layer_kinds"][kind]["modes"][mode] = per_layer_rows(config, kind, tokens, dtype,
                                                                     inference=mode == "inference", variants=variants)
    return out


def run(quick: bool = False, kinds: Sequence[str] = LAYER_KINDS, modes: Sequence[str] | None = None) -> dict:
    """The ``qwen3_5_traffic.json`` payload (without run metadata): Qwen3.5-27B widths at S = 4096, both layer kinds,
    training and inference, every variant of :data:`VARIANTS` (quick: the tiny Qwen3.5 at S = 128, training only:
    a smoke test of the same code, 8 captures)."""
    if quick:
        name, config, tokens, default_modes = "tiny-qwen3.5", tiny_config(), QUICK_TOKENS, ("training",)
    else:
        name, config, tokens, default_modes = MODEL, qwen3_5_27b_config(), TOKENS, ("training", "inference")
    modes = tuple(modes or default_modes)
    return {
        "kind": "qwen3_5_traffic",
        "bandwidth": BANDWIDTH,
        "peak": PEAK,
        "verl_patch_sources": list(VERL_SOURCES),
        "verl_attention_sources": list(FA2_SOURCES),
        "variants": {v.name: v.description for v in VARIANTS},
        "definitions": {
            "per_layer": "graph(L=2) - graph(L=1), op by op, every layer of the same kind (layer_types = [kind] * L)",
            "kernels": "as benchmarks.cost_model: call_function nodes on ATen/npu ops returning a tensor, views excluded",
            "bytes": "non-matmul kernels' tensor inputs + outputs (benchmarks.cost_model.node_bytes); matmuls (the "
            "DeltaNet's chunk bmm included) enter the roofline only",
            "flops": "Cube FLOPs: matmuls 2MNK, attention as benchmarks.cost_model; the triangular solves' FLOPs are "
            "vector FLOPs (solve_triangular)",
            "solve_triangular": "aten.linalg_solve_triangular kernels: n(n-1) FLOPs per unit-triangular n x n system "
            "and right-hand side (n^2 otherwise), roofline max(FLOPs / Vector peak, bytes / bandwidth)",
            "est_ms": "non-matmul bytes / bandwidth",
            "roofline_ms": "sum over every kernel of max(FLOPs / peak, bytes / bandwidth) (benchmarks.cost_model."
            "kernel_time; solve_triangular at the Vector peak)",
            "fusions_per_layer": "qwen_npu families' rewrites per layer (g2 - g1)",
            "fused_kernels": "per layer and graph, kernels of npu.* / qwen_npu.* ops",
        },
        "models": {name: measure(name, config, tokens, modes=modes, kinds=kinds)},
    }


def main(argv: list[str] | None = None) -> int:
    """Write ``<out>/qwen3_5_traffic.json`` (run metadata, then :func:`run`'s payload)."""
    parser = argparse.ArgumentParser(description="qwen_npu Qwen3.5 traffic per decoder layer kind")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="tiny Qwen3.5 at S=128, training only: a smoke test")
    parser.add_argument("--kinds", default=",".join(LAYER_KINDS), help="comma-separated layer kinds (default: both)")
    parser.add_argument("--modes", default=None, help="comma-separated modes: training,inference (default: both)")
    parser.add_argument("--merge", nargs="+", type=Path, default=None,
                        help="merge these partial results files (runs of --kinds/--modes subsets) into <out>")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[bench] %(message)s", stream=sys.stderr)
    command = "python -m benchmarks.qwen3_5_traffic " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.merge:
        path = write_json(args.out / "qwen3_5_traffic.json", merge([json.loads(p.read_text()) for p in args.merge]))
        log.info("wrote %s (merged %d files)", path, len(args.merge))
        return 0
    kinds = tuple(k for k in args.kinds.split(",") if k)
    modes = tuple(m for m in args.modes.split(",") if m) if args.modes else None
    start = time.perf_counter()
    payload = run(quick=args.quick, kinds=kinds, modes=modes)
    elapsed = time.perf_counter() - start
    data = with_run_metadata(payload, command.strip(), args.quick, elapsed)
    partial = kinds != LAYER_KINDS or modes is not None
    name = f"qwen3_5_traffic.{'+'.join(kinds)}.{'+'.join(modes or ('all',))}.json" if partial else "qwen3_5_traffic.json"
    path = write_json(args.out / name, data)
    log.info("wrote %s (%.1fs)", path, elapsed)
    return 0


def merge(parts: Sequence[dict]) -> dict:
    """One results payload from runs of subsets of the layer kinds and modes (same model): the first file's fields,
    every file's rows; ``meta.part_seconds`` is the sum and ``meta.merged_from`` lists the files' commands (the
    subsets can run in parallel processes)."""
    out = json.loads(json.dumps(parts[0]))
    (name, model), = out["models"].items()
    for part in parts[1:]:
        other = part["models"][name]
        for kind, entry in other["layer_kinds"].items():
            model["layer_kinds"].setdefault(kind, {"modes": {}})["modes"].update(entry["modes"])
    order = {k: i for i, k in enumerate(LAYER_KINDS)}
    model["layer_kinds"] = {k: {"modes": {m: v["modes"][m] for m in ("training", "inference") if m in v["modes"]}}
                            for k, v in sorted(model["layer_kinds"].items(), key=lambda kv: order.get(kv[0], 9))}
    out["meta"]["part_seconds"] = round(sum(p["meta"]["part_seconds"] for p in parts), 1)
    out["meta"]["wall_seconds_max"] = max(p["meta"]["part_seconds"] for p in parts)
    out["meta"]["merged_from"] = [p["meta"]["command"] for p in parts]
    return out


if __name__ == "__main__":
    sys.exit(main())
