"""RMSNorm -> ``npu_rms_norm``.

Mirrors transformers ``models/qwen2/modeling_qwen2.py`` ``Qwen2RMSNorm.forward`` (4.5x and 5.x)::

    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)

FX before (pre-dispatch ATen, bf16)::

    to = aten.to.dtype(x, torch.float32)
    pow_1 = aten.pow.Tensor_Scalar(to, 2)
    mean = aten.mean.dim(pow_1, [-1], True)
    add = aten.add.Tensor(mean, eps)
    rsqrt = aten.rsqrt.default(add)
    mul = aten.mul.Tensor(to, rsqrt)
    to_1 = aten.to.dtype(mul, torch.bfloat16)
    out = aten.mul.Tensor(weight, to_1)

FX after::

    npu_rms_norm = npu.npu_rms_norm.default(x, weight, eps)
    out = operator.getitem(npu_rms_norm, 0)

Constraints (torch_npu 2.13.0 ``npu_rms_norm`` docs, ``docs/npu-op-contracts.md``): the
(x, gamma) dtypes must be one of :data:`~qwen_npu_compile.ops.torch_npu.rms_norm.SUPPORTED_DTYPES`; gamma must have the trailing shape of x.
The kernel returns x's dtype, while HF promotes ``fp32 weight * bf16`` to fp32: the replacement casts
the result to the promoted dtype (the kernel computes in fp32 and rounds once, about 1 ulp from HF,
which rounds before the weight multiply). The anchor is ``aten.rsqrt``.

**(1 + w) RMSNorm** (transformers 5.24.0 ``models/qwen3_5/modeling_qwen3_5.py`` ``Qwen3_5RMSNorm``, the same in
``qwen3_5_moe`` and ``qwen3_next``, and Qwen3-Next in 4.57.6): the weight is initialised to zeros and applied
as ``1 + w``, everything in fp32, one cast at the end::

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)

FX before (bf16; in fp32 the two ``to`` casts are no-ops and are removed)::

    ...                                                       # to, pow_1, mean, add, rsqrt, mul: as above
    to_1 = aten.to.dtype(weight, torch.float32)               # outside the pattern: its ``weight`` input
    add_1 = aten.add.Tensor(to_1, 1.0)
    mul_1 = aten.mul.Tensor(mul, add_1)
    out = aten.type_as.default(mul_1, x)

FX after::

    add_1 = aten.add.Tensor(to_1, 1.0)                        # gamma = 1 + w, fp32, on the [H] vector
    npu_rms_norm = npu.npu_rms_norm.default(x, add_1, eps)    # (bf16, fp32) or (fp32, fp32)
    out = operator.getitem(npu_rms_norm, 0)

That is verl 0.9.1 ``npu_patch``'s ``npu_rms_norm(x, 1 + w, eps)``, without its ``x.float()`` copy: the
kernel takes a bf16/fp16 x with an fp32 gamma, computes in fp32 and rounds once to x's dtype, exactly what
``type_as(x)`` does after HF's fp32 computation. The ``1 + w`` add stays an ATen op on an ``[H]`` vector,
so the gradient of w flows through it. **Not** ``npu_gemma_rms_norm`` (the (1+gamma) kernel): torch_npu
2.13.0 has it forward only (``npu_native_functions_by_codegen.yaml``: no ``npu_gemma_rms_norm_backward``,
no autograd), its torchair has no converter for it (nothing under ``_ge_concrete_graph/ge_converter``),
and its docs take gamma in x's dtype only and refuse non-contiguous input (the q_norm's input is a
``chunk`` of q_proj's output). The weight variant's ``weight`` input is whatever feeds ``add(·, 1.0)``
(``w.float()``, or ``w`` itself where it is already fp32), so one trace covers bf16 and fp32 weights.

The norm inside Qwen3.5's *gated* RMSNorm (``Qwen3_5RMSNormGated``: ``weight * norm(h).to(dtype)``, then
``* silu(gate.float())``) is the ``rms_norm_gated`` family's (``patterns/rms_norm_gated.py``), which runs
before this one; where it did not fuse (disabled, refused) this family refuses that norm too, so that the
counts stay those of :meth:`RmsNormFamily.expected_per_layer`.

Inference graphs (:func:`~qwen_npu_compile.fusion.family.graph_needs_autograd` is False): after the pattern pass, a fused norm whose
input is the residual add ``x1 + x2`` becomes ``npu_add_rms_norm`` (:func:`fuse_residual_adds`)::

    add = aten.add.Tensor(residual, linear)                  # also the next residual
    npu_rms_norm = npu.npu_rms_norm.default(add, weight, eps)
    ->
    npu_add_rms_norm = npu.npu_add_rms_norm.default(residual, linear, weight, eps)
    getitem = operator.getitem(npu_add_rms_norm, 0)          # the norm; [2] = the sum, the residual

It saves one write and one read of the residual stream per norm (the add's output is written once,
by the fused kernel, and never re-read). The op has no backward, so it is never emitted where autograd
may run. These norms still count as ``rms_norm`` fusions (2L+1 per model whatever the graph): in a
Qwen2 inference graph 2L of them take the add form (all but layer 0's input norm, whose input is the
embedding); per-layer graphs get 1 of 2 (the input norm's input is the graph input).

Whether a graph needs autograd is decided as Dynamo guards it: grad mode at compile time
(``torch.no_grad()``/``inference_mode`` disable it; Dynamo recompiles when it changes) and
``requires_grad`` of the graph inputs (guarded per input). A graph with grad enabled and a parameter
that requires grad keeps ``npu_rms_norm`` even in ``model.eval()``.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.fusion.family import (
    CheckDecision,
    FamilyPass,
    FusionFamily,
    graph_needs_autograd,
    meta_val,
    per_dtype_family,
)
from qwen_npu_compile.graph.utils import node_source
from qwen_npu_compile.ops.scalars import scalar_argument
from qwen_npu_compile.ops.torch_npu.add_rms_norm import add_rms_norm_violation
from qwen_npu_compile.ops.torch_npu.rms_norm import rms_norm_violation

aten = torch.ops.aten
log = logging.getLogger(__name__)

#: ``model_type`` values whose attention adds two RMSNorms per layer: q_norm and k_norm over head_dim
#: (transformers ``models/qwen3/modeling_qwen3.py`` ``Qwen3Attention``).
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})

#: ``model_type`` values of the hybrid models whose norms are ``(1 + w)`` RMSNorms (transformers 5.24.0
#: ``Qwen3_5RMSNorm``, ``Qwen3_5MoeRMSNorm``, ``Qwen3NextRMSNorm``): 2 per decoder layer, and q_norm/k_norm
#: in the full-attention layers; the linear-attention layers' gated norm is ``rms_norm_gated``'s.
ONE_PLUS_WEIGHT_MODEL_TYPES = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})


def _search(x, weight, eps):
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


#: The epsilon the check read that the match does not bind itself (a constant one-element tensor's value, or
#: torch <= 2.9's literal; npu_rms_norm takes a Python ``float epsilon``); None: pass the matched eps.
EPSILON: CheckDecision[float | None] = CheckDecision("rms_norm_epsilon", default=None)


def epsilon(matched_eps):
    """For a replacement: the epsilon its check decided (:data:`EPSILON`), else the matched ``eps``."""
    constant = EPSILON.get()
    return matched_eps if constant is None else constant


def _replace(x, weight, eps):
    out = torch.ops.npu.npu_rms_norm.default(x, weight, epsilon(eps))[0]
    promoted = torch.promote_types(x.dtype, weight.dtype)
    # HF returns weight * x.to(input_dtype): fp32 when a bf16/fp16 input meets an fp32 weight.
    return out if promoted == out.dtype else out.to(promoted)


def _search_one_plus(x, weight, eps):
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    hidden = hidden * (1.0 + weight)
    return hidden.type_as(x)


def _replace_one_plus(x, weight, eps):
    # gamma = 1 + w in w's dtype (fp32 after HF's .float()); the kernel rounds once to x's dtype, as type_as
    return torch.ops.npu.npu_rms_norm.default(x, 1.0 + weight, epsilon(eps))[0]


def check_rms_norm(x, weight) -> str | None:
    """Refusal reason for fusing RMSNorm of ``x`` (FakeTensor) with ``weight``, or None to fuse.

    The op's limits are :func:`~qwen_npu_compile.ops.torch_npu.rms_norm.rms_norm_violation`'s; this adds a
    1-D weight (HF's) and a non-empty input.

    Args:
        x: ``[..., H]`` activation (fp16/bf16/fp32).
        weight: ``[H]`` gamma.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "input or weight is not a tensor"
    if weight.dim() != 1 or x.dim() < 1:
        return f"weight shape {tuple(weight.shape)} is not the last dim of x {tuple(x.shape)}"
    reason = rms_norm_violation(x, weight)
    if reason is not None:
        return reason
    if statically_known_true(x.numel() == 0):
        return "empty input"
    return None


def matched_eps(match):
    """The match's ``eps``: its keyword, else the second operand of the ``add`` under the matched ``rsqrt``.

    torch ≤ 2.9 hands the check the match of the pattern re-traced with the graph's values, where a literal
    eps other than the tracing's magic 1e-6 (e.g. Llama's and Mistral's 1e-5) is exact, not a keyword, so it
    is missing from ``match.kwargs`` (torch ≥ 2.10 fills it in from the first match).
    """
    if "eps" in match.kwargs:
        return match.kwargs["eps"]
    for node in match.nodes:
        if node.target is aten.rsqrt.default:
            add = node.args[0]
            if isinstance(add, torch.fx.Node) and add.target is aten.add.Tensor and len(add.args) == 2:
                return add.args[1]
    return None


def _check(match) -> str | None:
    reason = _gated_norm_reason(match)
    if reason is not None:
        return reason
    return _check_norm(match)


def _check_one_plus(match) -> str | None:
    """The (1 + w) variants: the kernel's limits on (x, gamma = 1 + weight), gamma in weight's dtype."""
    return _check_norm(match)


def _gated_norm_reason(match) -> str | None:
    """A reason when the matched ``weight * norm(x)`` is the norm of a gated RMSNorm (its output times
    ``silu(...)``, ``Qwen3_5RMSNormGated``): that one is ``rms_norm_gated``'s, whole or not at all."""
    for out in match.output_nodes():
        for user in getattr(out, "users", ()):
            if user.target is aten.mul.Tensor and any(
                isinstance(arg, torch.fx.Node) and arg.target is aten.silu.default for arg in user.args
            ):
                return ("the norm of a gated RMSNorm (times silu(gate), Qwen3_5RMSNormGated): "
                        "left whole to the rms_norm_gated family")
    return None


def decide_epsilon(match) -> str | None:
    """Decide :data:`EPSILON` for ``match`` (a norm with an ``eps`` argument); a refusal reason when its eps cannot
    be npu_rms_norm's Python float epsilon (a tensor variance_epsilon is read only when constant), else None."""
    eps, reason = scalar_argument("npu_rms_norm", "epsilon", matched_eps(match))
    if reason is not None:
        return reason
    # a number the match does not bind itself (a constant tensor's value, or ≤ 2.9's literal) goes in verbatim
    EPSILON.decide(eps if isinstance(eps, (int, float)) and eps is not match.kwargs.get("eps") else None)
    return None


def _check_norm(match) -> str | None:
    return decide_epsilon(match) or check_rms_norm(meta_val(match.kwargs["x"]), meta_val(match.kwargs["weight"]))


def _residual_add(node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(x1, x2)`` when ``node`` is ``aten.add.Tensor(x1, x2)`` of two tensors (no alpha), else None."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return None
    x1, x2 = node.args
    if not (isinstance(x1, torch.fx.Node) and isinstance(x2, torch.fx.Node)):
        return None
    return x1, x2


def fuse_residual_adds(graph: torch.fx.Graph) -> int:
    """Turn ``npu_rms_norm(x1 + x2, w, eps)`` into ``npu_add_rms_norm(x1, x2, w, eps)`` (inference only).

    The add's output is also the residual stream (used after the norm), which a single-output pattern
    cannot express; so this is a direct rewrite of the fused norms the pattern pass left, each checked
    by :func:`~qwen_npu_compile.ops.torch_npu.add_rms_norm.add_rms_norm_violation` (a refused one stays
    ``npu_rms_norm``, with the reason logged at DEBUG). The caller decides that the graph needs no
    autograd.

    Returns:
        How many norms were merged with their add.
    """
    merged = 0
    for norm in list(graph.find_nodes(op="call_function", target=torch.ops.npu.npu_rms_norm.default)):
        operands = _residual_add(norm.args[0])
        if operands is None or not all(user.target is operator.getitem for user in norm.users):
            continue
        add, (x1, x2), gamma = norm.args[0], operands, norm.args[1]
        eps = norm.args[2] if len(norm.args) > 2 else norm.kwargs.get("epsilon", 1e-6)
        values = [meta_val(n) for n in (x1, x2, gamma)]
        if not all(isinstance(v, torch.Tensor) for v in values):
            continue
        reason = add_rms_norm_violation(*values)
        if reason is not None:
            log.debug("qwen_npu: rms_norm at %s stays npu_rms_norm: %s", node_source(add), reason)
            continue
        if not _hoist_before(gamma, add):
            continue
        fake_mode = torch._guards.detect_fake_mode(values)
        with graph.inserting_before(add):
            fused = graph.call_function(torch.ops.npu.npu_add_rms_norm.default, (x1, x2, gamma, eps))
            total = graph.call_function(operator.getitem, (fused, 2))
        with fake_mode if fake_mode is not None else torch._subclasses.fake_tensor.unset_fake_temporarily():
            fused.meta["val"] = torch.ops.npu.npu_add_rms_norm.default(*values, meta_val(eps))
        total.meta["val"] = fused.meta["val"][2]
        for meta_key in ("stack_trace", "nn_module_stack"):
            if meta_key in norm.meta:
                fused.meta[meta_key] = norm.meta[meta_key]
        for user in list(norm.users):  # getitem(norm, 0 | 1) -> getitem(fused, 0 | 1)
            user.args = (fused, user.args[1])
        graph.erase_node(norm)
        add.replace_all_uses_with(total)
        graph.erase_node(add)
        merged += 1
    return merged


def _hoist_before(node, anchor: torch.fx.Node) -> bool:
    """Move ``node`` (and the pure ATen nodes it depends on) before ``anchor`` where it comes after it, so
    that a fused op inserted at ``anchor`` may read it: the (1 + w) variant's gamma ``add(w, 1.0)`` is
    emitted where the norm was, after the residual add. Only ``aten.to`` / ``aten.add`` of parameters and
    constants move; returns False (nothing moved) for anything else after ``anchor``."""
    if not isinstance(node, torch.fx.Node):
        return True
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    chain: list[torch.fx.Node] = []

    def collect(n) -> bool:
        if not isinstance(n, torch.fx.Node) or order[n] < order[anchor]:
            return True
        if n.op != "call_function" or n.target not in (aten.add.Tensor, aten.to.dtype, aten._to_copy.default):
            return False
        if not all(collect(arg) for arg in n.all_input_nodes):
            return False
        if n not in chain:
            chain.append(n)
        return True

    if not collect(node):
        return False
    for n in sorted(chain, key=order.__getitem__):
        anchor.prepend(n)
    return True


class RmsNormPass(FamilyPass):
    """The rms_norm pattern pass, then (inference graphs only) :func:`fuse_residual_adds`."""

    #: How many norms the last :meth:`apply` merged with their residual add (for logs and benchmarks).
    last_add_fused: int = 0

    def apply(self, gm: torch.fx.GraphModule, recorder) -> int:
        count = super().apply(gm, recorder)
        self.last_add_fused = 0 if graph_needs_autograd(gm.graph) else fuse_residual_adds(gm.graph)
        if self.last_add_fused:
            log.debug("qwen_npu: %d of the fused RMSNorms take npu_add_rms_norm (inference graph)", self.last_add_fused)
        return count


class RmsNormFamily(FusionFamily):
    """Qwen2RMSNorm -> ``npu_rms_norm(x, w, eps)[0]``, or ``npu_add_rms_norm`` on a residual add in an
    inference graph; 2L+1 per Qwen2 model (2 per layer + final), 2L of them add-fused in inference."""

    name = "rms_norm"
    anchor_ops = (aten.rsqrt.default,)
    fused_op_names = ("npu_rms_norm", "npu_add_rms_norm")
    backward_op_name = "npu_rms_norm_backward"
    per_layer = 2  # input_layernorm, post_attention_layernorm
    outside_layers = 1  # the final norm
    pass_class = RmsNormPass

    @classmethod
    def expected_per_layer(cls, model_config, layer_type: str | None = None) -> int:
        """2 per decoder layer, 4 where attention normalises q and k per head (:data:`QK_NORM_MODEL_TYPES`;
        in the hybrid :data:`ONE_PLUS_WEIGHT_MODEL_TYPES`, the full-attention layers: ``layer_type``
        ``"full_attention"``, or None where every layer is one); a linear-attention layer has 2 (its gated
        norm is ``rms_norm_gated``'s)."""
        model_type = getattr(model_config, "model_type", None)
        if model_type in ONE_PLUS_WEIGHT_MODEL_TYPES:
            return cls.per_layer + (0 if layer_type == "linear_attention" else 2)
        return cls.per_layer + (2 if model_type in QK_NORM_MODEL_TYPES else 0)

    def iter_variants(self):
        # (1 + w) first: Qwen3.5 / Qwen3-Next; one per dtype family of x (w's cast is outside the pattern).
        why = "Qwen3_5RMSNorm / Qwen3NextRMSNorm (transformers 5.24.0, 4.57.6): fp32 x * (1 + w.float()), "
        yield from per_dtype_family(
            "rms_norm_one_plus_weight",
            lambda dtype: [torch.empty(2, 4, 16, dtype=dtype), torch.empty(16), 1e-6],
            why={"half": why + "type_as a bf16/fp16 x", "fp32": why + "fp32 activations (no-op casts removed)"},
            search_fn=_search_one_plus, replace_fn=_replace_one_plus, check=_check_one_plus,
            scalar_workaround={"eps": 1e-6}, decides=(EPSILON,),
        )
        # eps is a literal in static graphs and a graph input under dynamic=True: never bake it in.
        yield from per_dtype_family(
            "rms_norm",
            lambda dtype: [torch.empty(2, 4, 16, dtype=dtype), torch.empty(16, dtype=dtype), 1e-6],
            why={"half": "fp16/bf16 activations", "fp32": "fp32 activations (no-op casts removed)"},
            search_fn=_search, replace_fn=_replace, check=_check, scalar_workaround={"eps": 1e-6}, decides=(EPSILON,),
        )
