"""torchair's converter API, for the GE converters of this project's ``qwen_npu::`` ops (each beside its op in
:mod:`qwen_npu_compile.ops.qwen_npu`) and for :mod:`qwen_npu_compile.torchair.converters`.

Every accessor imports torchair when called, never at import: the ops load everywhere, torchair only where a graph
goes to it (the installed one on an Ascend host, the paired wheel's off-NPU). Converters are built with torchair's
own registration API and GE op builders; nothing of torchair is copied.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

import torch

#: The device name the off-NPU stand-in module reports to torchair (an Atlas A2 training chip).
OFFLINE_DEVICE_NAME = "Ascend910B"


def torchair_api():
    """``(register_fx_node_ge_converter, ge_apis)``: torchair's public registration decorator and the GE op
    builders its own converters use (``torchair._ge_concrete_graph.ge_apis``).

    Raises:
        ImportError: torchair is not importable.
    """
    from torchair import register_fx_node_ge_converter
    from torchair._ge_concrete_graph import ge_apis

    return register_fx_node_ge_converter, ge_apis


def existing_converter(op):
    """torchair's converter of ``op`` (set on the op by ``register_fx_node_ge_converter``).

    Raises:
        LookupError: torchair has none for ``op``.
    """
    converter = getattr(op, "_ge_converter", None)
    if converter is None:
        raise LookupError(f"torchair has no converter for {op}")
    return converter


def torchair_grouped_matmul():
    """torchair's own converter of ``npu.npu_grouped_matmul.default`` (before ours wraps it,
    :func:`qwen_npu_compile.torchair.converters.register_converters`).

    Raises:
        LookupError: torchair has none.
    """
    converter = existing_converter(torch.ops.npu.npu_grouped_matmul.default)
    return getattr(converter, "_qwen_npu_wrapped", converter)


@contextlib.contextmanager
def torch_npu_importable():
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
    # this project), so the converter takes its A2 (non-arch35) path
    placeholder.npu = types.SimpleNamespace(get_device_name=lambda *args: OFFLINE_DEVICE_NAME)
    sys.modules["torch_npu"] = placeholder
    try:
        yield
    finally:
        if sys.modules.get("torch_npu") is placeholder:
            del sys.modules["torch_npu"]


def register_rotary_form(op) -> None:
    """Register the converter of a rotary form ``op`` (``qwen_npu.rotary_mul_orthogonal`` /
    ``rotary_mul_aten_backward``): torchair's own ``npu_rotary_mul`` converter (RotaryMul, mode ``"half"``);
    their backwards are RotaryMul again and plain ATen ops, which torchair converts itself."""
    register, _ = torchair_api()
    npu_rotary_mul = existing_converter(torch.ops.npu.npu_rotary_mul.default)

    def convert(x, r1, r2, meta_outputs=None):
        """The rotary form -> torchair's npu_rotary_mul converter (RotaryMul, mode 'half')."""
        return npu_rotary_mul(x, r1, r2, "half", None)

    register(op)(convert)
