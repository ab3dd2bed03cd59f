"""The attention family: :class:`AttentionFamily` and its pass (the top of ``patterns/attention/``).

The pass counts the packed-sequence takeovers the graph already holds, spells every key transpose one way
(:func:`spell_key_transposes`), runs the variants (the packed ones of :mod:`.varlen` first, then the rows of
:data:`.spellings.SPELLINGS` through :mod:`.dense`), then shares the mask conversions
(:func:`.masks.share_mask_conversions`) and the varlen offsets (:func:`.varlen.share_seq_ends`). The anchors
are ``aten.scaled_dot_product_attention`` (SDPA rows) and the eager chain's ``aten.softmax.int`` (eager
rows); a softmax over a linear's logits is no anchor (:func:`is_linear_logits_softmax`).

Hybrid models (transformers 5.24 ``Qwen3_5Attention``, ``Qwen3_5MoeAttention``, ``Qwen3NextAttention``): the
full-attention layers' gated attention reaches this family as the same rows; the linear-attention (Gated
DeltaNet) layers hold no softmax attention: 0 expected there.
"""

from __future__ import annotations

import torch
import torch.fx

from qwen_npu_compile.fusion.family import FamilyPass, FusionFamily, count_applied, meta_val
from qwen_npu_compile.graph.utils import node_source
from qwen_npu_compile.ops.limits import bound_arguments
from qwen_npu_compile.ops.qwen_npu import varlen_attention

from . import varlen
from .dense import _variant
from .masks import share_mask_conversions
from .spellings import SPELLINGS

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------------
# The family.
# --------------------------------------------------------------------------------------------------


#: Variant name of a ``qwen_npu.varlen_attention`` that the captured graph already holds because the
#: packed-sequence integration put it in place of transformers' flash-attention / SDPA call at trace time
#: (:mod:`qwen_npu_compile.substitutions.varlen_attention`, per-layer compile): its limits were checked there.
TAKEOVER_VARIANT = "varlen_packed_offsets"


def count_varlen_takeovers(graph: torch.fx.Graph) -> int:
    """Count (as fusions of :data:`TAKEOVER_VARIANT`) the ``qwen_npu.varlen_attention`` calls ``graph``
    holds before the attention pass runs; returns their number."""
    count = len(graph.find_nodes(op="call_function", target=varlen_attention.OP))
    count_applied(TAKEOVER_VARIANT, count)
    return count


class AttentionPass(FamilyPass):
    """The attention pattern pass (after :func:`spell_key_transposes`), then
    :func:`.masks.share_mask_conversions` and :func:`.varlen.share_seq_ends`."""

    def apply(self, gm: torch.fx.GraphModule, recorder) -> int:
        taken_over = count_varlen_takeovers(gm.graph)
        spell_key_transposes(gm.graph)
        count = super().apply(gm, recorder)
        if count:
            share_mask_conversions(gm.graph)
            varlen.share_seq_ends(gm.graph)
        return count + taken_over

    def anchor_nodes(self, graph: torch.fx.Graph) -> list[torch.fx.Node]:
        """The family's anchors, less the softmaxes that are not attention (:func:`is_linear_logits_softmax`):
        those are neither near misses nor counted as anchors."""
        return [node for node in super().anchor_nodes(graph) if not is_linear_logits_softmax(node)]


class AttentionFamily(FusionFamily):
    """SDPA / eager attention (after repeat_kv) -> ``npu_fusion_attention``; 1 per layer."""

    name = "attention"
    pass_class = AttentionPass
    anchor_ops = (aten.scaled_dot_product_attention.default, aten.softmax.int)
    fused_op_names = ("npu_fusion_attention",)
    backward_op_name = "npu_fusion_attention_grad"
    per_layer = 1

    @classmethod
    def expected_per_layer(cls, model_config, layer_type: str | None = None) -> int:
        """1 per decoder layer; 0 in a hybrid model's linear-attention (Gated DeltaNet) layers (Qwen3.5,
        Qwen3.5-MoE, Qwen3-Next ``layer_types``): their chunked delta rule is no softmax attention."""
        return 0 if layer_type == "linear_attention" else cls.per_layer

    def iter_variants(self):
        # the packed-sequence variants first: each takes what its row would, when the mask is proven packed
        yield from varlen.varlen_variants()
        yield from (_variant(row) for row in SPELLINGS)

    def explain_near_miss(self, anchor: torch.fx.Node) -> str:
        if anchor.target is aten.scaled_dot_product_attention.default:
            return (
                f"scaled_dot_product_attention at {node_source(anchor)} has a form no variant covers "
                f"({_describe_sdpa(anchor)}); variants take attn_mask, or attn_mask=None with is_causal, "
                "and K/V plain, repeat_kv'd or enable_gqa"
            )
        generic = super().explain_near_miss(anchor)
        spelling = _describe_eager_chain(anchor) if anchor.target is aten.softmax.int else None
        return generic if spelling is None or "also used outside" in generic else f"{generic}: {spelling}"


# --------------------------------------------------------------------------------------------------
# Before matching: one spelling of the key transpose. After: naming what did not match.
# --------------------------------------------------------------------------------------------------


def _swaps_last_two(node) -> bool:
    """Whether ``node`` is a 4-D view that swaps the last two dims: ``transpose(2, 3)`` in any spelling
    (``(-2, -1)``, ``(3, 2)``, ``(-1, 2)``...) or ``permute(0, 1, 3, 2)``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    source = meta_val(node.args[0]) if node.args else None
    if not isinstance(source, torch.Tensor) or source.dim() != 4:
        return False
    if node.target is aten.transpose.int and len(node.args) == 3:
        return {d % 4 for d in node.args[1:3]} == {2, 3}
    if node.target is aten.permute.default:
        return [d % 4 for d in node.args[1]] == [0, 1, 3, 2]
    return False


def spell_key_transposes(graph: torch.fx.Graph) -> int:
    """Respell every ``matmul(q, kt)`` whose ``kt`` swaps k's last two dims in another spelling
    (``k.transpose(-2, -1)``, ``k.mT``-like permutes) as HF's ``k.transpose(2, 3)``, the one the eager
    variants are traced with. The same view, so exact; returns how many were respelled."""
    count = 0
    for matmul in graph.find_nodes(op="call_function", target=aten.matmul.default):
        kt = matmul.args[1]
        if not _swaps_last_two(kt) or (kt.target is aten.transpose.int and tuple(kt.args[1:3]) == (2, 3)):
            continue
        with graph.inserting_before(matmul):
            spelled = graph.call_function(aten.transpose.int, (kt.args[0], 2, 3))
        spelled.meta.update(kt.meta)
        matmul.replace_input_with(kt, spelled)
        if not kt.users:
            graph.erase_node(kt)
        count += 1
    return count


#: Ops that pass scores through unchanged in kind (casts and views): walked over to find what made them.
_PASS_THROUGH = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.view.default,
                 aten.reshape.default, aten.contiguous.default, aten.clone.default)


def is_linear_logits_softmax(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a softmax of the logits of a linear layer (an activation times a weight:
    ``aten.linear``, after casts and views), such as the MoE router's ``softmax(linear(x, gate.weight))``
    (transformers ``Qwen3MoeTopKRouter`` / ``Qwen2MoeTopKRouter``, 4.57's ``self.gate`` nn.Linear). Attention
    scores are a product of two activations (``matmul(q, k.transpose(2, 3))``, or SDPA), never a
    linear layer, so such a softmax is not attention and not an attention near miss."""
    if node.target is not aten.softmax.int or not node.args:
        return False
    scores = node.args[0]
    for _ in range(len(_PASS_THROUGH) + 1):
        if not isinstance(scores, torch.fx.Node) or scores.target not in _PASS_THROUGH:
            break
        scores = scores.args[0]
    return isinstance(scores, torch.fx.Node) and scores.target is aten.linear.default


def _describe_eager_chain(softmax: torch.fx.Node) -> str | None:
    """Name the first piece of the eager chain ending at ``softmax`` that is not spelled as the variants
    expect (``softmax(matmul(q, k.transpose(2, 3)) * scale [+ mask], -1, float32)``), or None."""
    args = softmax.args
    if len(args) < 3 or args[2] != torch.float32:
        return "softmax without dtype=torch.float32 (eager_attention_forward upcasts the scores)"
    node = args[0]
    if isinstance(node, torch.fx.Node) and node.target is aten.add.Tensor:
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.target in (aten.mul.Tensor, aten.div.Tensor)):
        return f"the scores are {getattr(node, 'target', node)}, not matmul(q, k.transpose(2, 3)) * scale"
    if node.target is aten.div.Tensor:
        return "the scores are divided (matmul / d), not multiplied by the scale (matmul * scale)"
    matmul = node.args[0]
    if not (isinstance(matmul, torch.fx.Node) and matmul.target is aten.matmul.default):
        return f"the scaled scores come from {getattr(matmul, 'target', matmul)}, not matmul(q, k.transpose(2, 3))"
    kt = matmul.args[1]
    if not (isinstance(kt, torch.fx.Node) and kt.target is aten.transpose.int and tuple(kt.args[1:3]) == (2, 3)):
        spelled = f"{kt.target}{tuple(kt.args[1:])}" if isinstance(kt, torch.fx.Node) else repr(kt)
        return (
            f"the key operand of matmul {matmul.name} is {spelled}, not a [B, N, S, D] key's transpose(2, 3) "
            "(the spelling the variants match; other spellings of that swap are respelled)"
        )
    return None


def _describe_sdpa(node: torch.fx.Node) -> str:
    bound = bound_arguments(node)
    parts = []
    for name in ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"):
        value = bound.get(name)
        if isinstance(value, torch.fx.Node):
            val = meta_val(value)
            value = f"{val.dtype} {tuple(val.shape)}" if isinstance(val, torch.Tensor) else value.name
        parts.append(f"{name}={value}")
    return ", ".join(parts)
