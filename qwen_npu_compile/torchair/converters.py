"""torchair GE converters: torchair's own corrected, and this project's ops' registered (before any torchair hand-off).

:func:`register_converters` is called by the torchair hand-off (real torchair on an Ascend host, or
the off-NPU conversion check) right after ``import torchair`` and before torchair converts a graph. It
is idempotent. Every converter is built with torchair's own registration API
(``torchair.register_fx_node_ge_converter``) from torchair's own GE op builders or converters; nothing
of torchair is copied here. A converter whose torchair API is missing in the installed release is
skipped with a warning (the graph then fails to convert exactly as it would without us).

What is registered, and why (torch_npu 2.13.0 and 2.9.0 wheels, ``torch_npu/dynamo/torchair``). The converters
of this project's ``qwen_npu::`` ops live beside each op (its module's ``GE_CONVERTERS``); this module corrects
torchair's own and registers them all:

- ``npu.npu_grouped_matmul``: torchair's converter, called with an empty ``torch_npu`` module in ``sys.modules``
  when torch_npu is not installed (its first line is ``import torch_npu``, used only for quantized dtypes,
  :func:`qwen_npu_compile.ops.ge.torch_npu_importable`), so the off-NPU conversion check runs torchair's own code;
  on an NPU a pass-through. ``qwen_npu.grouped_matmul`` delegates to it
  (:mod:`qwen_npu_compile.ops.qwen_npu.grouped_matmul`).

- ``npu.npu_fusion_attention_grad``: torchair's converter (``ge_converter/custom/npu_fusion_attention.py``)
  returns FlashAttentionScoreGrad's 4 outputs (dq, dk, dv, dpse) while the op's schema
  (``npu_native_functions_by_codegen.yaml``) declares 5 (dsink added), so every training graph with
  fused attention fails with "The length of ge_outputs must be equal to meta_outputs". Ours calls
  torchair's converter and appends dsink: zeros of the meta output's shape and dtype (the Meta kernel
  gives ``empty([0])`` fp32 in 2.13.0, ``empty([])`` in 2.9.0 when ``sink`` is None; without a sink
  there is nothing to differentiate). A ``sink`` or ``softmax_layout`` argument is refused.
- ``aten.silu_backward``: torchair's converter (``ge_converter/aten/silu_backward.py``) is a stub that
  raises NotImplementedError, so a training graph whose SwiGLU is not fused cannot convert. Ours builds
  ``d/dx x·σ(x) · g = g·σ + x·SigmoidGrad(σ, g)`` with ``SigmoidGrad(y, dy) = dy·y·(1−y)`` from GE's
  Sigmoid, SigmoidGrad, Mul and Add.
- ``qwen_npu.rotary_mul_orthogonal`` (:mod:`qwen_npu_compile.ops.qwen_npu.rotary_mul_orthogonal`): the
  rotary fusion's form whose backward is the forward op again; converted by torchair's own
  ``npu_rotary_mul`` converter (RotaryMul on A2/A3), which has none of ``npu_rotary_mul_backward``'s
  converter limits.
- ``qwen_npu.rotary_mul_aten_backward`` (:mod:`qwen_npu_compile.ops.qwen_npu.rotary_mul_aten_backward`): the
  rotary form for training graphs where sin's halves cannot be proven (per-layer graphs) and the
  backward converter's limits fail (dynamic shapes, D % 64); the same RotaryMul forward, and a backward
  of plain ATen ops that torchair converts itself.
- ``qwen_npu.gate_up_proj`` (:mod:`qwen_npu_compile.ops.qwen_npu.gate_up_proj`): the SwiGLU fusion's buffer
  of both projections; see its ``register_ge_converter`` (BatchMatMulV2 twice, ConcatD along axis 0).
  Its backward graph holds only ATen ``mm``/``add``/views, which torchair converts itself.
- ``qwen_npu.varlen_attention`` / ``varlen_attention_backward`` / ``seq_ends_from_positions``
  (:mod:`qwen_npu_compile.ops.qwen_npu.varlen_attention`, packed sequences): torchair's converter of
  ``npu_fusion_attention(_grad)`` refuses TND, so ours emit ``FlashAttentionScore(Grad)`` with
  ``input_layout="TND"`` and the offsets as INT64 tensor inputs, and the offsets from ``position_ids``
  with ``NonZero`` / ``ConcatV2``; see :mod:`qwen_npu_compile.ops.qwen_npu.varlen_attention_ge` for what is and is not
  verified without an NPU.

Not registered, on purpose: the CPU SDPA ops (``aten._scaled_dot_product_flash_attention_for_cpu`` and
its backward) have no torchair converter. They appear only when attention is left unfused *and* the
graph was traced on a CPU (:data:`CPU_ONLY_OPS`); on an Ascend host torch_npu dispatches SDPA to its own
kernels (``npu_fusion_attention`` for BNSD with a bool or no mask), so such a failure in an off-NPU
conversion check is an artifact of the CPU trace, not a blocker on the NPU.
"""

from __future__ import annotations

import importlib
import logging
import operator

import torch

from qwen_npu_compile.ops import ge
from qwen_npu_compile.ops.qwen_npu import (
    gate_up_proj,
    grouped_matmul,
    rotary_mul_aten_backward,
    rotary_mul_orthogonal,
    varlen_attention_ge,
)

log = logging.getLogger(__name__)

#: ATen ops that only a CPU trace produces and that have no torchair converter (see the module docstring).
CPU_ONLY_OPS = (
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
)

#: Names of the converters registered into the torchair of this process (idempotence).
_REGISTERED: set[str] = set()


#: The FX targets of runtime assertions on unbacked sizes (torch ``fx/passes/runtime_assert.py``, Dynamo's
#: ``insert_deferred_runtime_asserts``; see :func:`drop_runtime_asserts`).
RUNTIME_ASSERTS = (
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
)


def drop_runtime_asserts(graph: torch.fx.Graph) -> list[str]:
    """Remove the runtime assertions on unbacked sizes from ``graph`` (for torchair), with the symbolic
    computations only they used; returns the asserted expressions (for a debug log).

    Dynamo emits ``sym_size >= 1``, ``_assert_scalar`` (and ``sym_constrain_range*``) for every unbacked
    size in a graph: the number of packed sequences (``substitutions/varlen_attention.py`` marks ``seq_ends`` with
    ``mark_unbacked``; ``seq_ends_from_positions`` when Dynamo traces a call of it). torchair (torch_npu
    2.13.0, ``npu_fx_compiler._NpuGraphConverter._wrap``) runs a comparison of SymInts such as
    ``operator.ge`` directly on its ``ValuePack`` values (only ``+ - * / // ** % neg floor ceil`` get
    converters), so such a graph fails conversion with ``TypeError: '>=' not supported between instances
    of 'ValuePack' and 'int'``. Dropping them is what ``torch._dynamo.config.do_not_emit_runtime_asserts``
    does at the source: the shape environment keeps the facts, only the checks at run time go. The
    sizes they check are made valid by construction here (``host_seq_ends``: 1 <= B <= T, refused by
    ``offsets_violation`` otherwise).

    Args:
        graph: an FX graph (Dynamo's, before torchair's AOTAutograd).

    Returns:
        The message of each dropped ``_assert_scalar`` (``"Runtime assertion failed for expression ..."``)
        and the name of each dropped ``sym_constrain_range*`` node.
    """
    dropped, candidates = [], []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in RUNTIME_ASSERTS and not node.users:
            dropped.append(str(node.args[1]) if node.target is RUNTIME_ASSERTS[0] and len(node.args) > 1 else node.name)
            candidates.extend(arg for arg in node.all_input_nodes)
            graph.erase_node(node)
    while candidates:  # the comparisons / sizes feeding them, once nothing else reads them
        node = candidates.pop()
        if node.graph is graph and not node.users and node.op == "call_function" and _symbolic(node):
            candidates.extend(node.all_input_nodes)
            graph.erase_node(node)
    return dropped


#: Targets that compute a size or a comparison of sizes (no tensor, no side effect).
_SYMBOLIC_TARGETS = frozenset({
    operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne, operator.and_, operator.or_,
    operator.not_, operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
    torch.sym_not, torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
})


def _symbolic(node: torch.fx.Node) -> bool:
    """A node computing a SymInt / SymBool / SymFloat (no tensor, no side effect)."""
    value = node.meta.get("val", node.meta.get("example_value"))
    return node.target in _SYMBOLIC_TARGETS or isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat))


def register_converters() -> list[str]:
    """Register this project's GE converters with the imported torchair (idempotent).

    Must run after ``import torchair`` (and after :func:`qwen_npu_compile.ops.ensure_npu_ops`, so the
    ``npu`` ops exist) and before conversion. torchair's own custom converters are imported first, so
    that its lazy import of them cannot overwrite ours later.

    Returns:
        The names of the converters registered in this process so far (missing torchair APIs are
        logged as warnings and skipped, never raised).
    """
    try:
        import torchair  # noqa: F401

        importlib.import_module("torchair._ge_concrete_graph.ge_converter.custom")
    except Exception as exc:  # torchair absent or a release with another layout
        log.warning("qwen_npu: torchair's converters could not be imported (%s: %s); registering none",
                    type(exc).__name__, exc)
        return sorted(_REGISTERED)
    for name, register in _CONVERTERS.items():
        if name in _REGISTERED:
            continue
        try:
            register()
        except Exception as exc:  # an API this torchair release lacks: skip, say so
            log.warning("qwen_npu: GE converter for %s not registered (%s: %s); graphs holding it will not "
                        "convert", name, type(exc).__name__, exc)
            continue
        _REGISTERED.add(name)
    return sorted(_REGISTERED)


def _register_fusion_attention_grad() -> None:
    register, ge_apis = ge.torchair_api()
    op = torch.ops.npu.npu_fusion_attention_grad.default
    torchair_converter = ge.existing_converter(op)
    if getattr(torchair_converter, "_qwen_npu", False):
        return

    def convert(*args, meta_outputs=None, softmax_layout: str = "", sink=None, **kwargs):
        """npu_fusion_attention_grad -> torchair's FlashAttentionScoreGrad (dq, dk, dv, dpse) + dsink zeros."""
        if sink is not None or softmax_layout not in ("", None):
            raise NotImplementedError(
                "npu_fusion_attention_grad: torchair's converter takes neither sink nor softmax_layout"
            )
        outputs = torchair_converter(*args, **kwargs)
        if meta_outputs is None or len(outputs) >= len(meta_outputs):
            return outputs
        dsink = meta_outputs[len(outputs)]
        return (*outputs, ge_apis.Fill(list(dsink.size), ge_apis.Cast(0.0, dst_type=dsink.dtype)))

    convert._qwen_npu = True
    register(op)(convert)
    ge.existing_converter(op)._qwen_npu = True


def _register_silu_backward() -> None:
    register, ge_apis = ge.torchair_api()

    def convert(grad_output, self, meta_outputs=None):
        """aten.silu_backward: ``g·σ(x) + x·g·σ(x)·(1−σ(x))`` from GE Sigmoid / SigmoidGrad / Mul / Add."""
        sigmoid = ge_apis.Sigmoid(self)
        return ge_apis.Add(ge_apis.Mul(grad_output, sigmoid), ge_apis.Mul(self, ge_apis.SigmoidGrad(sigmoid, grad_output)))

    register(torch.ops.aten.silu_backward.default)(convert)


def _register_npu_grouped_matmul() -> None:
    register, _ = ge.torchair_api()
    torchair_converter = ge.torchair_grouped_matmul()

    def convert(*args, **kwargs):
        """npu.npu_grouped_matmul -> torchair's converter (GE GroupedMatmul), runnable off-NPU too."""
        with ge.torch_npu_importable():
            return torchair_converter(*args, **kwargs)

    convert._qwen_npu_wrapped = torchair_converter
    register(torch.ops.npu.npu_grouped_matmul.default)(convert)
    torch.ops.npu.npu_grouped_matmul.default._ge_converter._qwen_npu_wrapped = torchair_converter


#: ``"namespace.op"`` -> its registration: torchair's own converters corrected here, then each of this project's ops'
#: (their ``GE_CONVERTERS``, beside the op).
_CONVERTERS = {
    "npu.npu_fusion_attention_grad": _register_fusion_attention_grad,
    "aten.silu_backward": _register_silu_backward,
    "npu.npu_grouped_matmul": _register_npu_grouped_matmul,
    **{name: register for module in (rotary_mul_orthogonal, rotary_mul_aten_backward, gate_up_proj, varlen_attention_ge,
                                     grouped_matmul) for name, register in module.GE_CONVERTERS.items()},
}
