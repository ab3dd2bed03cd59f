"""Stand-ins of the torch_npu ops this project emits (``npu::``), one module per op, registered only where
torch_npu does not import (:func:`qwen_npu_compile.ops.ensure_npu_ops`).

Each module holds the op's exact torch_npu 2.13.0 schema, a CPU reference kernel that follows the documented
semantics, a fake (meta) kernel, autograd that calls the backward op, and the kernel's documented limits
(``<op>_violation``: the one home of each limit, read by the families' checks). On an Ascend host the real ops
run; the limits apply all the same.
"""
