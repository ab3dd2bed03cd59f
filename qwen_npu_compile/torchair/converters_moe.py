"""torchair GE converters of the MoE family's ops (merged into :data:`qwen_npu_compile.torchair.converters._CONVERTERS`).

- ``npu.npu_grouped_matmul``: torchair's converter, called with an empty ``torch_npu`` module in
  ``sys.modules`` when torch_npu is not installed (its first line is ``import torch_npu``, used only for
  quantized dtypes), so the off-NPU conversion check runs torchair's own code; on an NPU a pass-through.
- ``qwen_npu.grouped_matmul`` (:mod:`qwen_npu_compile.ops.torch_npu.grouped_matmul`): delegates to torchair's own
  converter of ``npu.npu_grouped_matmul`` (torch_npu 2.13.0 ``ge_converter/custom/grouped_matmul.py`` ->
  GE ``GroupedMatmul``) with the arguments the op's kernel passes (``split_item=3, group_type=0,
  group_list_type=0``), and returns its single output. The backward graph holds ``npu.npu_grouped_matmul``
  itself (dx: group_type 0, dW: group_type 2), which torchair converts without us.

  The weight is a transposed view of ``gate_up_proj`` / ``down_proj`` (``[E, N, K]`` parameters), and
  torchair's converter passes ``transpose_weight=False``: in the GE graph the view is an explicit
  ``Transpose`` in front of GroupedMatmul (torchair's ``normalize_grouped_matmul_view`` pass folds such
  transposes only for fp8/mxfp4 weights). Whether GE then folds it into the kernel or copies the weights
  is **not verified** without an NPU.

The routing around the grouped matmuls (sort, gathers, offsets, inverse permutation) is rewritten by
``patterns/moe.py`` into ops torchair converts itself (``searchsorted``, ``index_select``, ``scatter``), so
no converter is needed for it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import torch


#: The device name the off-NPU stand-in module reports to torchair (an Atlas A2 training chip).
OFFLINE_DEVICE_NAME = "Ascend910B"


def _api():
    """torchair's registration decorator (the public one converters use)."""
    from torchair import register_fx_node_ge_converter

    return register_fx_node_ge_converter


@contextlib.contextmanager
def _torch_npu_importable():
    """Off-NPU only (torch_npu not installed): an empty ``torch_npu`` module in ``sys.modules`` for the
    duration of a call of torchair's ``npu_grouped_matmul`` converter, which starts with ``import torch_npu``
    and reads from it the quantized dtypes (``torch_npu.float4_e2m1fn_x2`` ...), for int4 weights
    ``torch_npu.npu.utils``, and (``is_arch35``) ``torch_npu.npu.get_device_name()``, which answers
    :data:`OFFLINE_DEVICE_NAME`; the non-quantized path reads nothing else, and any read of the empty module raises
    AttributeError (a reported conversion failure, never a silent one). With torch_npu installed: nothing."""
    if "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None:
        yield
        return
    placeholder = types.ModuleType("torch_npu", "qwen_npu's empty stand-in for torchair's converter import (off-NPU)")
    # torchair's is_arch35() asks torch_npu.npu.get_device_name(): answer an Atlas A2 (the training target of
    # this project, docs/ascend-a2-figures.md), so the converter takes its A2 (non-arch35) path
    placeholder.npu = types.SimpleNamespace(get_device_name=lambda *args: OFFLINE_DEVICE_NAME)
    sys.modules["torch_npu"] = placeholder
    try:
        yield
    finally:
        if sys.modules.get("torch_npu") is placeholder:
            del sys.modules["torch_npu"]


def _torchair_grouped_matmul():
    """torchair's own converter of ``npu.npu_grouped_matmul.default`` (before ours wraps it)."""
    op = torch.ops.npu.npu_grouped_matmul.default
    converter = getattr(op, "_ge_converter", None)
    if converter is None:
        raise LookupError("torchair has no converter for npu.npu_grouped_matmul")
    return getattr(converter, "_qwen_npu_wrapped", converter)


def _register_npu_grouped_matmul() -> None:
    register = _api()
    torchair_converter = _torchair_grouped_matmul()

    def convert(*args, **kwargs):
        """npu.npu_grouped_matmul -> torchair's converter (GE GroupedMatmul), runnable off-NPU too."""
        with _torch_npu_importable():
            return torchair_converter(*args, **kwargs)

    convert._qwen_npu_wrapped = torchair_converter
    register(torch.ops.npu.npu_grouped_matmul.default)(convert)
    torch.ops.npu.npu_grouped_matmul.default._ge_converter._qwen_npu_wrapped = torchair_converter


def _register_grouped_matmul() -> None:
    from qwen_npu_compile.ops.torch_npu import grouped_matmul

    register = _api()
    torchair_converter = _torchair_grouped_matmul()

    def convert(x, weight, group_list, meta_outputs=None):
        """qwen_npu.grouped_matmul -> torchair's npu_grouped_matmul converter (GE GroupedMatmul), output 0."""
        with _torch_npu_importable():
            outputs = torchair_converter([x], [weight], group_list=group_list, split_item=3, group_type=0,
                                         group_list_type=0)
        return outputs[0] if isinstance(outputs, (list, tuple)) else outputs

    register(grouped_matmul.OP)(convert)


#: ``"namespace.op"`` -> its registration (merged into :data:`qwen_npu_compile.torchair.converters._CONVERTERS`).
CONVERTERS = {
    "npu.npu_grouped_matmul": _register_npu_grouped_matmul,
    "qwen_npu.grouped_matmul": _register_grouped_matmul,
}
