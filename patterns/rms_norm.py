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

Constraints (torch_npu 2.13.0 ``npu_rms_norm`` docs, ``shared/reference/npu-op-contracts.md``): the
(x, gamma) dtypes must be one of :data:`SUPPORTED_DTYPES`; gamma must have the trailing shape of x.
The kernel returns x's dtype, while HF promotes ``fp32 weight * bf16`` to fp32: the replacement casts
the result to the promoted dtype (the kernel computes in fp32 and rounds once, about 1 ulp from HF,
which rounds before the weight multiply). The anchor is ``aten.rsqrt``.

Inference graphs (:func:`~qwen_npu_compile.fusion.graph_needs_autograd` is False): after the pattern pass, a fused norm whose
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

import contextvars
import logging
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qwen_npu_compile.fusion import FamilyPass, FusionFamily, PatternVariant, graph_needs_autograd, meta_val, node_source
from qwen_npu_compile.npu_ops.add_rms_norm import add_rms_norm_violation
from qwen_npu_compile.npu_ops.rms_norm import rms_norm_violation
from qwen_npu_compile.npu_ops.scalars import scalar_argument

aten = torch.ops.aten
log = logging.getLogger(__name__)

#: ``model_type`` values whose attention adds two RMSNorms per layer: q_norm and k_norm over head_dim
#: (transformers ``models/qwen3/modeling_qwen3.py`` ``Qwen3Attention``).
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})


def _search(x, weight, eps):
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


#: The epsilon the check read from a constant one-element tensor (npu_rms_norm's ``float epsilon``), for
#: the replacement Inductor traces right after the check accepts; None = pass the matched eps.
_EPS_CONSTANT: contextvars.ContextVar[float | None] = contextvars.ContextVar("qwen_npu_rms_norm_eps", default=None)


def _replace(x, weight, eps):
    constant = _EPS_CONSTANT.get()
    out = torch.ops.npu.npu_rms_norm.default(x, weight, eps if constant is None else constant)[0]
    promoted = torch.promote_types(x.dtype, weight.dtype)
    # HF returns weight * x.to(input_dtype): fp32 when a bf16/fp16 input meets an fp32 weight.
    return out if promoted == out.dtype else out.to(promoted)


def check_rms_norm(x, weight) -> str | None:
    """Refusal reason for fusing RMSNorm of ``x`` (FakeTensor) with ``weight``, or None to fuse.

    The op's limits are :func:`~qwen_npu_compile.npu_ops.rms_norm.rms_norm_violation`'s; this adds a
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


def _matched_eps(match):
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
    # eps must be npu_rms_norm's Python float epsilon (a tensor variance_epsilon is read only when constant)
    eps, reason = scalar_argument("npu_rms_norm", "epsilon", _matched_eps(match))
    if reason is not None:
        return reason
    # a number the match does not bind itself (a constant tensor's value, or ≤ 2.9's literal) goes in verbatim
    _EPS_CONSTANT.set(eps if isinstance(eps, (int, float)) and eps is not match.kwargs.get("eps") else None)
    return check_rms_norm(meta_val(match.kwargs["x"]), meta_val(match.kwargs["weight"]))


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
    by :func:`~qwen_npu_compile.npu_ops.add_rms_norm.add_rms_norm_violation` (a refused one stays
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
        """2 per decoder layer, 4 where attention normalises q and k per head (:data:`QK_NORM_MODEL_TYPES`)."""
        return cls.per_layer + (2 if getattr(model_config, "model_type", None) in QK_NORM_MODEL_TYPES else 0)

    def iter_variants(self):
        # One variant per dtype family, because the normalised graphs differ structurally:
        # half precision casts to fp32 and back; in fp32 both casts are no-ops and are removed.
        for label, dtype in (("half", torch.bfloat16), ("fp32", torch.float32)):
            yield PatternVariant(
                name=f"rms_norm_{label}",
                search_fn=_search,
                replace_fn=_replace,
                example_inputs=lambda dtype=dtype: [torch.empty(2, 4, 16, dtype=dtype), torch.empty(16, dtype=dtype), 1e-6],
                check=_check,
                # eps is a literal in static graphs and a graph input under dynamic=True: never bake it in.
                scalar_workaround={"eps": 1e-6},
                why="fp16/bf16 activations" if label == "half" else "fp32 activations (no-op casts removed)",
            )
