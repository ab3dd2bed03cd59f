"""Replacement forwards for ``module_patches`` in tests: what an FSDP-Turbo model patch may look like.

* :func:`fused_swiglu_mlp_forward` (for ``Qwen2MLP.forward``): the SwiGLU MLP on ``npu_swiglu`` (torch_npu's
  fused op; off-NPU ``qwen_npu_compile``'s simulated one, registered when this module is imported), as verl's own
  ``npu_patch`` writes it. Input ``[..., hidden]`` -> ``[..., hidden]``, the input's dtype.
* :func:`decoder_layer_forward` (for ``Qwen2DecoderLayer.forward``): transformers 5.10.4's Qwen2 decoder layer,
  except that attention gets only the arguments it names (no ``**kwargs``), as a hand-written layer may.
  Same arguments and result as the original (``[B, T, hidden]``).
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops import ensure_npu_ops

ensure_npu_ops()  # torch.ops.npu.npu_swiglu: torch_npu's, else the simulated one (before any trace)


def fused_swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
    return self.down_proj(torch.ops.npu.npu_swiglu(gate_up, -1))


def decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                          use_cache=False, position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values,
                                      use_cache=use_cache, position_embeddings=position_embeddings)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
    return residual + hidden_states
