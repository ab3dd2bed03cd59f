"""Everything that calls into torchair's internals, apart from the hand-off's use of its backend
(:mod:`qwen_npu_compile.handoff.torchair`).

* :mod:`.converters` -- the GE converters registered before any torchair conversion: torchair's own corrected
  (``npu_fusion_attention_grad``'s output count, ``aten.silu_backward``'s stub, ``npu_grouped_matmul`` off-NPU),
  and this project's ops' (each beside its op, :mod:`qwen_npu_compile.ops.qwen_npu`); Dynamo's runtime asserts
  on unbacked sizes dropped before conversion.
* :mod:`.offline` -- torchair from the paired torch_npu wheel on a host without an NPU or CANN: its real FX→GE
  conversion of every graph, recorded per graph (GE op counts, each node that failed to convert).
"""
