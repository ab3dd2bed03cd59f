"""The "verl-style" Qwen3-MoE baseline: transformers' Qwen3-MoE patched as verl 0.9.1's ``npu_patch`` patches it.

A model of verl's ``verl/models/transformers/npu_patch.py`` (verl 0.9.1, ``_patch_qwen3_moe``; read in
``verl-0.9.1`` site-packages, same code as verl HEAD ``1dda039b9``), written against ``torch.ops.npu.*`` (the simulated stand-ins here, torch_npu's ops on an NPU; same
schemas). verl patches three names of ``transformers.models.qwen3_moe.modeling_qwen3_moe``:

* ``Qwen3MoeRMSNorm.forward`` -> ``npu_rms_norm(x, weight, eps)[0]`` (:func:`benchmarks.verl_patch.rms_norm_forward`;
  verl casts ``x`` to the weight's dtype first, a no-op in these bf16 graphs);
* ``apply_rotary_pos_emb`` -> ``npu_rotary_mul`` on HF's BNSD q/k (:func:`benchmarks.verl_patch.apply_rotary_pos_emb_npu`);
* ``Qwen3MoeSparseMoeBlock.forward`` -> :func:`sparse_moe_block_forward` (verl's
  ``qwen3_moe_sparse_moe_block_forward_npu`` / ``_qwen3_sparse_moe_routed_forward_npu``, transformers >= 5 API:
  the router returns ``(logits, renormalised top-k weights, top-k ids)``). Per MoE layer, ``S = T·k`` routed rows::

      weights = top_k_weights.to(h.dtype)                                      # [T, k]
      gate_w, up_w = experts.gate_up_proj.chunk(2, dim=1)                      # views of [E, 2I, H]
      w1, w2, w3 = up_w.transpose(1, 2), gate_w.transpose(1, 2), down_proj.transpose(1, 2)   # views
      permuted, row_ids_map = npu_moe_token_permute(h, top_k_ids.to(int32))    # [S, H], int32 [S]
      tokens_per_expert = histc(top_k_ids, bins=E, min=0, max=E)               # int64 [E] counts
      up = Gmm(permuted, w1, counts); gate = Gmm(permuted, w2, counts)         # [S, I] each
      act = npu_swiglu(cat([gate, up], -1))                                     # the [S, 2I] cat: glue
      down = Gmm(act, w3, counts)                                              # [S, H]
      out = npu_moe_token_unpermute(down, row_ids_map, probs=weights)          # [T, H]

  ``Gmm`` is verl's ``NPUGmmFunction`` (:class:`GmmFunction`, a custom ``torch.autograd.Function``):
  forward ``npu_grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1)``;
  backward dx ``npu_grouped_matmul([g], [w.transpose(1, 2)], ..., group_type=0)`` and dW
  ``npu_grouped_matmul([x.t()], [g], ..., split_item=3, group_type=2)``; ``counts`` is kept as a ctx
  attribute (not saved for backward), as verl does.

**One modelled difference: histc.** verl calls ``torch.histc`` on the int64 top-k ids; torch_npu's (and CUDA's)
histc take integers and keep the dtype, but torch's CPU and Meta kernels refuse integer input ("histogram_cpu
not implemented for 'torch.int64'"), so a CPU FakeTensor graph cannot hold that call. :func:`histc_int` is a
one-kernel custom op ``qwen_npu_bench::histc_int`` with the same signature and output (int64 ``[E]``, the ids'
dtype), i.e. exactly one kernel reading ``S`` int64 ids and writing ``E`` int64 counts, as on the NPU. A float
cast around ``torch.histc`` (what ``tests/integrations/test_verl_moe_patch.py`` uses to *run* verl's code on a CPU) would
add two cast kernels that verl's NPU graph does not have.

Everything is applied by :func:`verl_moe_patches` inside a ``with`` block only. verl's code itself is not imported
(no torch_npu here); ``tests/benchmarks/test_moe_benchmarks.py`` checks this model against verl's real block (forward
and gradients equal) where verl is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .verl_patch import apply_rotary_pos_emb_npu, replaced, rms_norm_forward

#: Where the modelled functions come from (cited in the results).
SOURCES = (
    "https://github.com/volcengine/verl/blob/v0.9.1/verl/models/transformers/npu_patch.py "
    "(qwen3_moe_sparse_moe_block_forward_npu, _qwen3_sparse_moe_routed_forward_npu, NPUGmmFunction, _patch_qwen3_moe)",
)

npu = torch.ops.npu


@torch.library.custom_op("qwen_npu_bench::histc_int", mutates_args=())
def histc_int(ids: torch.Tensor, bins: int, min: int, max: int) -> torch.Tensor:  # noqa: A002 (torch.histc's names)
    """``torch.histc`` of integer ids as torch_npu runs it: one kernel, output in the ids' dtype.

    Args:
        ids: int32/int64 expert ids, any shape (verl: the ``[T, k]`` top-k ids, int64).
        bins, min, max: as ``torch.histc`` (verl: ``E``, 0, ``E``; bin width 1, so id ``v`` counts in bin ``v``).

    Returns:
        ``[bins]`` counts in ``ids.dtype`` (verl passes them as ``group_list_type=1`` sizes).
    """
    return torch.histc(ids.float(), bins, min, max).to(ids.dtype)


@histc_int.register_fake
def _histc_int_fake(ids, bins, min, max):  # noqa: A002
    return ids.new_empty((bins,))


class GmmFunction(torch.autograd.Function):
    """verl's ``NPUGmmFunction``: ``npu_grouped_matmul`` with a hand-written backward (dx, dW).

    Shapes: x ``[S, K]`` (rows sorted by expert), weight ``[E, K, N]`` (a transposed view is fine), group_list
    int64 ``[E]`` (``group_list_type=1``: tokens per expert); output ``[S, N]``. Backward: dx ``[S, K]``
    (``group_type=0`` with ``weight.transpose(1, 2)``), dW ``[E, K, N]`` (``group_type=2``, x transposed).
    """

    @staticmethod
    def forward(ctx, x, weight, group_list, group_list_type=1):
        ctx.save_for_backward(x, weight)
        ctx.group_list = group_list  # a ctx attribute, as in verl (not save_for_backward)
        ctx.group_list_type = group_list_type
        return npu.npu_grouped_matmul.default([x], [weight], bias=None, group_list=group_list, split_item=2,
                                              group_type=0, group_list_type=group_list_type)[0]

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        dx = npu.npu_grouped_matmul.default([grad_output], [weight.transpose(1, 2)], bias=None,
                                            group_list=ctx.group_list, split_item=2, group_type=0,
                                            group_list_type=ctx.group_list_type)[0]
        dw = npu.npu_grouped_matmul.default([x.transpose(0, 1)], [grad_output], bias=None, group_list=ctx.group_list,
                                            split_item=3, group_type=2, group_list_type=ctx.group_list_type)[0]
        return dx, dw, None, None


def sparse_moe_block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """verl's ``qwen3_moe_sparse_moe_block_forward_npu`` on transformers >= 5's ``Qwen3MoeSparseMoeBlock``.

    Args:
        hidden_states: ``[B, S, H]``, the layer's dtype (bf16 here).

    Returns:
        ``[B, S, H]``: the routed experts' weighted sum (module docstring for the ops).
    """
    output_shape = hidden_states.shape
    hidden = hidden_states.view(-1, output_shape[-1])
    _, routing_weights, selected_experts = self.gate(hidden)
    routing_weights = routing_weights.to(hidden.dtype)
    gate_w, up_w = self.experts.gate_up_proj.chunk(2, dim=1)
    w1 = up_w.transpose(1, 2).to(hidden.dtype)
    w2 = gate_w.transpose(1, 2).to(hidden.dtype)
    w3 = self.experts.down_proj.transpose(1, 2).to(hidden.dtype)
    permuted, row_ids_map = npu.npu_moe_token_permute.default(hidden, selected_experts.to(torch.int32))
    experts = self.experts.num_experts
    tokens_per_expert = histc_int(selected_experts, experts, 0, experts)
    up = GmmFunction.apply(permuted, w1, tokens_per_expert)
    gate = GmmFunction.apply(permuted, w2, tokens_per_expert)
    act = npu.npu_swiglu.default(torch.cat([gate, up], dim=-1), -1)
    down = GmmFunction.apply(act, w3, tokens_per_expert)
    out = npu.npu_moe_token_unpermute.default(down, row_ids_map, routing_weights)
    return out.reshape(output_shape)


@contextlib.contextmanager
def verl_moe_patches() -> Iterator[None]:
    """Patch transformers' Qwen3-MoE like verl's ``_patch_qwen3_moe`` (RMSNorm, sparse MoE block, rotary), inside
    the block only (originals restored on exit)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

    with replaced((modeling.Qwen3MoeRMSNorm, "forward", rms_norm_forward),
                  (modeling.Qwen3MoeSparseMoeBlock, "forward", sparse_moe_block_forward),
                  (modeling, "apply_rotary_pos_emb", apply_rotary_pos_emb_npu)):
        yield
