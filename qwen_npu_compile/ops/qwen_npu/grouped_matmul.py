"""``qwen_npu::grouped_matmul``: the MoE family's grouped matmul with autograd, and its GE converter.

``qwen_npu::grouped_matmul(x, weight, group_list)`` is what ``patterns/moe.py`` emits in place of
``aten._grouped_mm`` / ``transformers::grouped_mm_fallback``: the forward is ``npu_grouped_matmul([x],
[weight], group_list=group_list, split_item=3, group_type=0, group_list_type=0)[0]``, the backward (as
verl's ``NPUGmmFunction``, verl #4406)::

    dx = npu_grouped_matmul([g], [weight.transpose(1, 2)], group_list, split_item=3, group_type=0)[0]  # [M, K]
    dw = npu_grouped_matmul([x.t()], [g], group_list, split_item=3, group_type=2)[0]                  # [E, K, N]
    # weight a transposed view of a [E, N, K] parameter (transformers' experts): its own layout instead,
    dw = npu_grouped_matmul([g.t()], [x], group_list, split_item=3, group_type=2)[0].transpose(1, 2)

so AOTAutograd's backward graph holds ``npu_grouped_matmul`` (which torchair converts to GE
``GroupedMatmul``), never a bare op without gradients. Its limits: :func:`grouped_matmul_violation`
(the one home of them).

GE converter (:func:`register_ge_converter`): delegates to torchair's own converter of ``npu.npu_grouped_matmul``
(torch_npu 2.13.0 ``ge_converter/custom/grouped_matmul.py`` -> GE ``GroupedMatmul``) with the arguments the op's
kernel passes (``split_item=3, group_type=0, group_list_type=0``), and returns its single output. The backward graph
holds ``npu.npu_grouped_matmul`` itself (dx: group_type 0, dW: group_type 2), which torchair converts without us.
The weight is a transposed view of ``gate_up_proj`` / ``down_proj`` (``[E, N, K]`` parameters), and torchair's
converter passes ``transpose_weight=False``: in the GE graph the view is an explicit ``Transpose`` in front of
GroupedMatmul (torchair's ``normalize_grouped_matmul_view`` pass folds such transposes only for fp8/mxfp4 weights).
Whether GE then folds it into the kernel or copies the weights is **not verified** without an NPU.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops import ge
from qwen_npu_compile.ops.define import QWEN_NPU_LIBRARY, define_op
from qwen_npu_compile.ops.torch_npu.grouped_matmul import grouped_matmul_violation, is_transposed

NAMESPACE = "qwen_npu"
SCHEMA = "grouped_matmul(Tensor x, Tensor weight, Tensor group_list) -> Tensor"



def _check(x, weight, group_list) -> None:
    reason = grouped_matmul_violation(x, weight, group_list)
    if reason is not None:
        raise RuntimeError(f"{NAMESPACE}::grouped_matmul: {reason}")


def _npu_gmm(x, weight, group_list, group_type: int) -> torch.Tensor:
    return torch.ops.npu.npu_grouped_matmul.default(
        [x], [weight], group_list=group_list, split_item=3, group_type=group_type, group_list_type=0
    )[0]


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` grouped by ``group_list`` times their group's weight (the kernel; module docstring).

    Args:
        x: ``[M, K]`` (rows sorted by group); fp16/bf16/fp32.
        weight: ``[E, K, N]``, x's dtype (a transposed view such as ``gate_up_proj.transpose(1, 2)`` is fine).
        group_list: int64 ``[E]``, cumulative group ends (non-decreasing, the last == M): ``aten._grouped_mm``'s
            ``offs`` as int64.

    Returns:
        ``[M, N]``, x's dtype: ``out[s_e:t_e] = x[s_e:t_e] @ weight[e]``.

    Raises:
        RuntimeError: a limit of :func:`grouped_matmul_violation` is broken (the message names it), or, from
            the kernel, group_list values that do not cover M.
    """
    _check(x, weight, group_list)
    return _npu_gmm(x, weight, group_list, 0)


def _fake(x, weight, group_list):
    _check(x, weight, group_list)
    return x.new_empty((x.shape[0], weight.shape[2]))


def _setup_context(ctx, inputs, output):
    x, weight, group_list = inputs
    ctx.save_for_backward(x, weight, group_list)


def _backward(ctx, grad):
    x, weight, group_list = ctx.saved_tensors
    grad = grad.contiguous()  # "x不支持转置": the grouped operand of group_type 0 must not be a transposed view
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _npu_gmm(grad, weight.transpose(1, 2), group_list, 0)
    if ctx.needs_input_grad[1]:
        if is_transposed(weight):
            # weight = param.transpose(1, 2) (transformers' experts): dWᵀ [E, N, K] in the parameter's own
            # layout, so that its transpose is the parameter's gradient without a layout copy after the graph
            # (2,304 MiB per Qwen3-30B-A3B layer at T = 4096: benchmarks/moe_traffic.py); same FLOPs
            dw = _npu_gmm(grad.t(), x, group_list, 2).transpose(1, 2)
        else:
            dw = _npu_gmm(x.t(), grad, group_list, 2)
    return dx, dw, None


#: The op overload graphs hold.
OP = define_op(QWEN_NPU_LIBRARY, SCHEMA, grouped_matmul, _fake, _backward, _setup_context)


def register_ge_converter() -> None:
    """Register the GE converter of :data:`OP` with the imported torchair (module docstring)."""
    register, _ = ge.torchair_api()
    torchair_converter = ge.torchair_grouped_matmul()

    def convert(x, weight, group_list, meta_outputs=None):
        """qwen_npu.grouped_matmul -> torchair's npu_grouped_matmul converter (GE GroupedMatmul), output 0."""
        with ge.torch_npu_importable():
            outputs = torchair_converter([x], [weight], group_list=group_list, split_item=3, group_type=0,
                                         group_list_type=0)
        return outputs[0] if isinstance(outputs, (list, tuple)) else outputs

    register(OP)(convert)


#: GE converters of this module's op, by ``"namespace.op"`` (registered by
#: :func:`qwen_npu_compile.torchair.converters.register_converters`).
GE_CONVERTERS = {"qwen_npu.grouped_matmul": register_ge_converter}
