"""This project's own ops (``qwen_npu::``), real on an Ascend host too: each is built from torch_npu kernels (or
FLA's on triton-ascend) with the autograd and the layout the fused graph needs, and carries its GE converter beside
it (the module's ``GE_CONVERTERS``, registered by :func:`qwen_npu_compile.torchair.converters.register_converters`).

``gate_up_proj`` (SwiGLU's two projections into one buffer), ``rotary_mul_orthogonal`` and
``rotary_mul_aten_backward`` (the rotary forms a torchair training graph converts), ``varlen_attention`` (packed
rows, TND; converters in :mod:`.varlen_attention_ge`), ``grouped_matmul`` (MoE experts, with autograd),
``chunk_gated_delta_rule`` (the Gated DeltaNet, :mod:`.gated_delta_rule`; which kernel runs it on an NPU:
:mod:`.gated_delta_rule_kernels`).
"""
