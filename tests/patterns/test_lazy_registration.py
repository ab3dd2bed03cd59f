"""FamilyPass registers a variant only when a graph holds one of its anchor ops; variants registered
later join the same PatternMatcherPass in declaration order, as one registration would give."""

from __future__ import annotations

import torch
import torch.fx

from qwen_npu_compile.fusion.family import FusionFamily, PatternVariant
from qwen_npu_compile.patterns import FAMILIES

aten = torch.ops.aten


def _graph_calling(*ops) -> torch.fx.Graph:
    """A graph whose call_function nodes have these targets (only the targets are read)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for op in ops:
        graph.call_function(op, (x,))
    return graph


def _ranks(family_pass) -> dict:
    """Per matcher key, the declaration index of each registered entry, in the order the matcher tries them."""
    return {key: [family_pass._entry_rank[id(entry)] for entry in entries] for key, entries in family_pass.matcher.patterns.items()}


def test_variants_register_when_their_anchor_appears_and_keep_declaration_order(npu_ops):
    lazy = FAMILIES["attention"]().make_pass()
    declared = [variant.name for variant in lazy.declared_variants]
    # the packed-mask variants (patterns/attention/varlen.py, varlen_<row>) share their row's anchor
    sdpa = [name for name in declared if name.removeprefix("varlen_").startswith("sdpa_")]
    eager = [name for name in declared if name.removeprefix("varlen_").startswith("eager_")]
    assert sdpa and eager and len(sdpa) + len(eager) == len(declared)

    assert lazy.ensure_registered(_graph_calling(aten.rsqrt.default)) == []
    assert lazy.registration_seconds is None and not lazy.matcher.patterns

    added = lazy.ensure_registered(_graph_calling(aten.softmax.int))
    assert [variant.name for variant in added] == eager
    assert lazy.ensure_registered(_graph_calling(aten.softmax.int)) == []  # once per process

    added = lazy.ensure_registered(_graph_calling(aten.scaled_dot_product_attention.default))
    assert [variant.name for variant in added] == sdpa
    assert [variant.name for variant in lazy.variants] == declared

    eager_first = _ranks(lazy)
    assert all(ranks == sorted(ranks) for ranks in eager_first.values()), eager_first
    at_once = FAMILIES["attention"]().make_pass()
    at_once.ensure_registered()  # every variant, in declaration order
    assert _ranks(at_once) == eager_first
    assert lazy.duplicates == at_once.duplicates == set()


def _sin_plus_one(x):
    return torch.sin(x) + 1


def _cos_plus_one(x):
    return torch.cos(x) + 1


class _TwoSpellings(FusionFamily):
    """Two variants whose patterns end in the same op (aten.add), each with its own anchor."""

    name = "two_spellings"
    anchor_ops = (aten.sin.default, aten.cos.default)

    def iter_variants(self):
        examples = lambda: [torch.empty(4)]  # noqa: E731
        yield PatternVariant("sin_first", _sin_plus_one, _sin_plus_one, examples, anchor_ops=(aten.sin.default,))
        yield PatternVariant("cos_second", _cos_plus_one, _cos_plus_one, examples, anchor_ops=(aten.cos.default,))


def test_a_variant_registered_later_is_tried_in_declaration_order():
    family_pass = _TwoSpellings().make_pass()
    family_pass.ensure_registered(_graph_calling(aten.cos.default))
    family_pass.ensure_registered(_graph_calling(aten.sin.default))
    assert _ranks(family_pass) == {("call_function", aten.add.Tensor): [0, 1]}
    assert [variant.name for variant in family_pass.variants] == ["sin_first", "cos_second"]
