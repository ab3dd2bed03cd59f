"""Gated DeltaNet chunked delta rule -> ``qwen_npu::chunk_gated_delta_rule`` (put in place at trace time).

Mirrors transformers 5.24.0 ``models/qwen3_5/modeling_qwen3_5.py`` ``torch_chunk_gated_delta_rule`` (the same
in ``qwen3_5_moe`` and ``qwen3_next``, 5.x and 4.57.6), called once per linear-attention layer by
``Qwen3_5GatedDeltaNet.forward`` with ``use_qk_l2norm_in_kernel=True``, and verl 0.9.1's packed
``qwen3_5_gated_delta_net_forward`` (``verl/models/transformers/qwen3_5.py``)::

    query, key = l2norm(query), l2norm(key)                   # fp32, [B, H, T, D]
    query = query * query.shape[-1] ** -0.5
    ... pad T to a multiple of 64, UT transform per chunk (two linalg.solve_triangular) ...
    for i in range(num_chunks):                               # the scan: one select_scatter per chunk
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        core_attn_out[:, :, i] = query[:, :, i] @ state + intra_chunk_attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new

FX before (traced as Python, 2 layers of a 4-layer Qwen3.5 at T = 70: 2 chunks): ``aten.linalg_solve_triangular``
x2, ``aten.select_scatter`` x2 per chunk, the graph specialised on ``T`` (the loop bound is ``ceil(T/64)``).

FX after::

    chunk_gated_delta_rule = qwen_npu.chunk_gated_delta_rule.default(q, k, v, g, beta, cu_seqlens, None, scale, True)
    out = operator.getitem(chunk_gated_delta_rule, 0)

Unlike the other families, the replacement is not an FX rewrite: the chunk scan is a Python loop over
``ceil(T/64)`` chunks, so its traced form depends on ``T`` and no fixed pattern matches it. The op is put in
place while Dynamo traces (:mod:`qwen_npu_compile.substitutions.deltanet`: a ``substitute_in_graph`` of
transformers' function, and a takeover of verl's packed forward), with its limits checked by the op
(:func:`qwen_npu_compile.ops.qwen_npu.gated_delta_rule.violation`). This family counts those calls (variant
:data:`SUBSTITUTED_VARIANT`) and reports a traced delta rule (its ``linalg_solve_triangular`` anchors) as a
near miss that says why.

Packed rows: the op gets the row's offsets wherever the caller has them (verl's ``cu_seqlens``, transformers'
``cu_seq_lens_q``, FLA's ``cu_seqlens``, or the sequence ends ``maybe_compile``'s pre-hook proves from
``position_ids``) and runs each sequence from a zero state, as if alone (FLA's semantics), also where eager
transformers / verl do not (see :mod:`qwen_npu_compile.substitutions.deltanet`). A whole-model
``torch.compile`` of a row packed only by ``position_ids`` reaches this pass with op calls without offsets
(the decoder layer hands ``position_ids`` to attention only): where the graph holds attention's packing proof,
:mod:`.gated_delta_rule_packed` gives them the proof's sequence ends and makes their causal conv restart per
sequence, before they are counted (same count); refused, with the reason recorded, where the DeltaNet is not
recognised exactly.

Numerics: the op's CPU kernel is the same arithmetic as transformers' reference (equal to the last bit in
fp32 and bf16); the backward recomputes it with autograd (gradients equal the reference's).
"""

from __future__ import annotations

import torch

from qwen_npu_compile.fusion.family import FamilyPass, FusionFamily, count_applied
from qwen_npu_compile.ops.qwen_npu import gated_delta_rule
from qwen_npu_compile.substitutions import deltanet

from . import gated_delta_rule_packed

aten = torch.ops.aten

#: Variant name of a ``qwen_npu.chunk_gated_delta_rule`` that Dynamo's substitution put in the captured graph.
SUBSTITUTED_VARIANT = "chunk_gated_delta_rule_substituted"

#: model_type values whose linear-attention layers hold one Gated DeltaNet.
DELTANET_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


class GatedDeltaRulePass(FamilyPass):
    """Gives the ops of a row packed by ``position_ids`` the sequence ends of attention's packing proof
    (:mod:`.gated_delta_rule_packed`), counts the substituted ops (no pattern to register), then the near misses
    of the base pass."""

    def apply(self, gm: torch.fx.GraphModule, recorder) -> int:
        target = torch.ops.qwen_npu.chunk_gated_delta_rule.default
        gated_delta_rule_packed.rewrite_packed_rows(
            gm, lambda node, reason: recorder.refuse(self.family.name, node, reason))
        count = len(gm.graph.find_nodes(op="call_function", target=target))
        count_applied(SUBSTITUTED_VARIANT, count)
        return count + super().apply(gm, recorder)


class GatedDeltaRuleFamily(FusionFamily):
    """The Gated DeltaNet's chunked delta rule -> ``qwen_npu::chunk_gated_delta_rule``; 1 per linear-attention layer."""

    name = "gated_delta_rule"
    pass_class = GatedDeltaRulePass
    anchor_ops = (aten.linalg_solve_triangular.default,)
    fused_op_names = ()  # a qwen_npu op, counted by the pass
    backward_op_name = ""
    per_linear_attention_layer_of = frozenset(DELTANET_MODEL_TYPES)

    @classmethod
    def backward_op_counts(cls, fusions: int) -> dict[str, int]:
        """No ``npu`` backward op: the backward is ``qwen_npu::chunk_gated_delta_rule_backward``, once per fusion
        (keyed ``qwen_npu.<op>``, as ``check`` lists our own ops of the AOT backward graph)."""
        return {"qwen_npu.chunk_gated_delta_rule_backward": fusions}

    def iter_variants(self):
        return iter(())

    def explain_near_miss(self, anchor: torch.fx.Node) -> str:
        problems = deltanet.setup_problems()
        cause = (f"the substitution could not be set up: {'; '.join(problems)}" if problems else
                 "the substitution was not in place when Dynamo traced this frame (qwen_npu_compile.integrations."
                 "deltanet.install runs at maybe_compile and when the backend is looked up: a model module imported "
                 "after both, or the family switched off for that trace)")
        return (f"the chunked delta rule was traced as Python (transformers' torch_chunk_gated_delta_rule), not "
                f"{gated_delta_rule.NAME}: {cause}")
