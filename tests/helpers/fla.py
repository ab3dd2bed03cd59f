"""An FLA-like Gated DeltaNet kernel, for tests that bind one where transformers or verl import FLA's (the
stand-in package ``tests/stand_ins/fla`` is FLA's public entry itself, with its checks and call records)."""

from __future__ import annotations

import torch


def fla_like_chunk_gated_delta_rule(calls: list):
    """A function of fla-core 0.5.2's ``chunk_gated_delta_rule`` signature and contract (``[B, T, H, K]``,
    per-sequence ``cu_seqlens``), ``@torch.compiler.disable`` as FLA's kernel is to Dynamo, computing the op's
    reference; each call appends to ``calls`` whether it got offsets."""
    from qwen_npu_compile.ops.qwen_npu.gated_delta_rule import reference

    @torch.compiler.disable
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               cp_context=None):
        calls.append(cu_seqlens is not None)
        out, state = reference(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm_in_kernel)
        return out, (state if output_final_state else None)

    return chunk_gated_delta_rule
