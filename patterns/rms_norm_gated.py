"""Gated RMSNorm -> ``npu_rms_norm`` + ``npu_swiglu`` on one ``[2, ..., D]`` buffer.

Mirrors transformers 5.24.0 ``models/qwen3_5/modeling_qwen3_5.py`` ``Qwen3_5RMSNormGated.forward`` (the same
in ``qwen3_5_moe``, and ``Qwen3NextRMSNormGated`` in ``qwen3_next``, 5.x and 4.57.6), the output norm of
every Gated DeltaNet (linear-attention) layer, over ``head_v_dim`` (``core_attn_out`` and the gate ``z``
reshaped to ``[B·S·Nv, Dv]``)::

    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight * hidden_states.to(input_dtype)
    hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))   # silu
    return hidden_states.to(input_dtype)

FX before (pre-dispatch ATen, bf16; in fp32 the four casts are no-ops and are removed)::

    ...                                   # to(h), pow_1, mean, add, rsqrt, mul: as in patterns/rms_norm.py
    to_1 = aten.to.dtype(mul, torch.bfloat16)
    mul_1 = aten.mul.Tensor(weight, to_1)
    to_2 = aten.to.dtype(gate, torch.float32)
    silu = aten.silu.default(to_2)
    mul_2 = aten.mul.Tensor(mul_1, silu)                      # fp32
    out = aten.to.dtype(mul_2, torch.bfloat16)

FX after::

    npu_rms_norm = npu.npu_rms_norm.default(h, weight, eps)
    y = operator.getitem(npu_rms_norm, 0)                     # h's dtype: weight * norm(h), rounded once
    stack = aten.stack.default([gate, y])                     # [2, N, D], contiguous: [0] gate, [1] y
    npu_swiglu = npu.npu_swiglu.default(stack, 0)             # silu(gate) * y in fp32, rounded once
    out = aten.squeeze.dim(npu_swiglu, 0)                     # a view

Numerics: ``npu_swiglu`` computes ``silu(A) * B`` in fp32 and rounds once, as eager's fp32 multiply and
single cast do; ``npu_rms_norm`` rounds ``weight * norm(h)`` once where eager rounds ``norm(h)`` and then
the product (about 1 ulp, as for every fused RMSNorm). The gate's ``silu`` never exists as an fp32
``[N, D]`` tensor, nor does the fp32 product.

Design (why two torch_npu ops and a ``stack``): torch_npu 2.13.0 has no gated-RMSNorm op
(``npu_native_functions_by_codegen.yaml``), so the norm and the gate go to the two fused kernels that
exist, both with backward ops and bundled GE converters (RmsNorm/RmsNormGrad, SwiGlu/SwiGluGrad, and
Pack for ``aten.stack``). VeOmni's ``npu_swiglu(cat([gate, rms_norm(h)], -1))`` moves the same bytes
(both halves copied once); splitting along a new leading dim instead (as ``qwen_npu::gate_up_proj`` does
for SwiGLU) keeps each half one contiguous block, so in the backward ``npu_swiglu_backward``'s
``[2, N, D]`` gradient hands ``npu_rms_norm_backward`` a contiguous ``dy`` (``grad[1]``, a view) instead of
a strided ``[..., D:]`` slice. Not done: writing the halves in place (no copy at all) would need
``npu_rms_norm`` to write into a given buffer (it has no ``out=`` form in 2.13.0) and the gate's
producer, ``in_proj_z``, to be pulled into the pattern through two reshapes; the copy of ``gate`` and
``y`` (``2·N·D`` elements each way) is what remains.

Constraints: :func:`~qwen_npu_compile.ops.torch_npu.rms_norm.rms_norm_violation` on ``(h, weight)`` (a (bf16,
fp32) pair is the autocast case: ``weight * norm(h)`` is fp32 in eager, ``y`` is rounded to bf16 here,
one more rounding) and :func:`~qwen_npu_compile.ops.torch_npu.swiglu.swiglu_violation` on the ``[2, N, D]``
buffer along dim 0; gate of h's shape and dtype (``stack`` would promote otherwise); weight 1-D. The
anchor is ``aten.silu`` (the ``rsqrt`` is also the rms_norm family's, which refuses this norm, see
``patterns/rms_norm.py``). This family runs before rms_norm.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.fusion.family import EMITTED_BY, FamilyPass, FusionFamily, meta_val, per_dtype_family
from qwen_npu_compile.ops.torch_npu.rms_norm import rms_norm_violation
from qwen_npu_compile.ops.torch_npu.swiglu import swiglu_violation

from .rms_norm import EPSILON, decide_epsilon, epsilon

aten = torch.ops.aten
F = torch.nn.functional

#: ``model_type`` values whose linear-attention layers end in a gated RMSNorm (transformers 5.24.0
#: ``Qwen3_5GatedDeltaNet.norm``, ``Qwen3_5MoeGatedDeltaNet.norm``, ``Qwen3NextGatedDeltaNet.norm``).
GATED_NORM_MODEL_TYPES = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})

#: The dim ``npu_swiglu`` splits the ``[2, ..., D]`` buffer along: gate first, the normalised h second.
SPLIT_DIM = 0


def _search(h, gate, weight, eps):
    input_dtype = h.dtype
    hidden = h.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    hidden = weight * hidden.to(input_dtype)
    hidden = hidden * F.silu(gate.to(torch.float32))
    return hidden.to(input_dtype)


def _replace(h, gate, weight, eps):
    y = torch.ops.npu.npu_rms_norm.default(h, weight, epsilon(eps))[0]
    return torch.ops.npu.npu_swiglu.default(torch.stack([gate, y]), SPLIT_DIM).squeeze(SPLIT_DIM)


def check_rms_norm_gated(h, gate, weight) -> str | None:
    """Refusal reason for fusing ``silu(gate) * (weight * rms_norm(h))`` into ``npu_rms_norm`` and
    ``npu_swiglu(stack([gate, y]), 0)`` (FakeTensors), or None to fuse.

    Limits: :func:`~qwen_npu_compile.ops.torch_npu.rms_norm.rms_norm_violation` (torch_npu 2.13.0 ``npu_rms_norm``
    docs: dtype pairs, gamma of x's trailing shape) and
    :func:`~qwen_npu_compile.ops.torch_npu.swiglu.swiglu_violation` (``npu_swiglu`` docs: dtype, even size along
    the split dim, contiguous) on the ``[2, *h.shape]`` buffer ``stack`` builds; plus gate and h of one
    shape and dtype (``stack`` takes no broadcasting, and would promote), a 1-D weight, a non-empty input.

    Args:
        h: ``[..., D]`` the DeltaNet's output (fp16/bf16/fp32).
        gate: ``[..., D]`` the gate ``z``, h's dtype.
        weight: ``[D]`` the norm weight (h's dtype, or fp32).
    """
    if not all(isinstance(t, torch.Tensor) for t in (h, gate, weight)):
        return "h, gate or weight is not a tensor"
    if gate.dtype != h.dtype:
        return f"dtype mismatch: gate {gate.dtype}, h {h.dtype} (npu_swiglu takes one tensor)"
    if len(gate.shape) != len(h.shape) or not all(statically_known_true(a == b) for a, b in zip(gate.shape, h.shape)):
        return f"shape mismatch (broadcasting): gate {tuple(gate.shape)}, h {tuple(h.shape)}"
    if weight.dim() != 1 or h.dim() < 1:
        return f"weight shape {tuple(weight.shape)} is not the last dim of h {tuple(h.shape)}"
    if statically_known_true(h.numel() == 0):
        return "empty input"
    reason = rms_norm_violation(h, weight)
    if reason is not None:
        return reason
    return swiglu_violation(h.new_empty((2, *h.shape)), SPLIT_DIM)


def _check(match) -> str | None:
    return decide_epsilon(match) or check_rms_norm_gated(*(meta_val(match.kwargs[name]) for name in ("h", "gate", "weight")))


def _gates_a_product(silu: torch.fx.Node) -> bool:
    """Whether ``silu`` multiplies a product (``mul(weight * norm(h), silu(gate))``): the gated norm's silu,
    not the MLP's (times a linear) nor the DeltaNet conv's (transposed)."""
    for user in silu.users:
        if user.target is aten.mul.Tensor:
            others = [arg for arg in user.args if arg is not silu]
            if any(isinstance(arg, torch.fx.Node) and arg.target is aten.mul.Tensor for arg in others):
                return True
    return False


class RmsNormGatedPass(FamilyPass):
    """The family's pattern pass; its anchors (near misses) are the ``silu`` nodes that gate a product,
    not every ``silu`` of the graph (the swiglu family reports those)."""

    def anchor_nodes(self, graph: torch.fx.Graph) -> list[torch.fx.Node]:
        return [node for node in super().anchor_nodes(graph) if _gates_a_product(node)]

    def apply(self, gm: torch.fx.GraphModule, recorder) -> int:
        """The pattern pass, then its emitted ``npu_rms_norm`` / ``npu_swiglu`` tagged as this family's
        (``EMITTED_BY``), so that rms_norm and swiglu do not count them as already fused."""
        count = super().apply(gm, recorder)
        if count:
            for swiglu in gm.graph.find_nodes(op="call_function", target=torch.ops.npu.npu_swiglu.default):
                stack = swiglu.args[0]
                if not (isinstance(stack, torch.fx.Node) and stack.target is aten.stack.default
                        and len(stack.args[0]) == 2 and isinstance(stack.args[0][1], torch.fx.Node)):
                    continue
                getitem = stack.args[0][1]
                norm = getitem.args[0] if getitem.target is operator.getitem else None
                if isinstance(norm, torch.fx.Node) and norm.target is torch.ops.npu.npu_rms_norm.default:
                    swiglu.meta[EMITTED_BY] = norm.meta[EMITTED_BY] = self.family.name
        return count


class RmsNormGatedFamily(FusionFamily):
    """Qwen3_5RMSNormGated -> ``npu_swiglu(stack([gate, npu_rms_norm(h, w, eps)[0]]), 0)``; one per
    linear-attention layer of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next."""

    name = "rms_norm_gated"
    anchor_ops = (aten.silu.default,)
    fused_op_names = ()  # npu_rms_norm and npu_swiglu are counted as already fused by rms_norm and swiglu
    backward_op_name = "npu_rms_norm_backward"
    per_linear_attention_layer_of = GATED_NORM_MODEL_TYPES
    pass_class = RmsNormGatedPass

    @classmethod
    def backward_op_counts(cls, fusions: int) -> dict[str, int]:
        """Each fusion brings one ``npu_rms_norm_backward`` and one ``npu_swiglu_backward``."""
        return {"npu_rms_norm_backward": fusions, "npu_swiglu_backward": fusions}

    def iter_variants(self):
        # One variant per dtype family: half precision casts h, the product and gate; in fp32 all are no-ops.
        # A bf16 h with an fp32 weight (autocast) traces as the half graph (the weight is never cast).
        why = ("Qwen3_5RMSNormGated / Qwen3NextRMSNormGated (transformers 5.24.0, 4.57.6), the Gated DeltaNet's "
               "output norm: ")
        yield from per_dtype_family(
            "rms_norm_gated",
            lambda dtype: [torch.empty(8, 16, dtype=dtype), torch.empty(8, 16, dtype=dtype),
                           torch.empty(16, dtype=dtype), 1e-6],
            why={"half": why + "bf16/fp16 h and gate", "fp32": why + "fp32 (no-op casts removed)"},
            search_fn=_search, replace_fn=_replace, check=_check, scalar_workaround={"eps": 1e-6}, decides=(EPSILON,),
        )
