"""Anchor ops in other roles (qwen_npu_compile.fusion.near_miss): the Gated DeltaNet's l2norm rsqrt, its conv's
SiLU activation and the negated decay are not near misses (strict mode passes), while a real RMSNorm whose
intermediate is reused stays one (strict mode raises)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen_npu_compile.report import SUMMARY


def _l2norm(x):  # transformers 5.24 modeling_qwen3_5.l2norm
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _conv_activation(x):  # causal_conv1d_fn's activation, then the DeltaNet's transpose and split into q, k, v
    q, k = torch.split(F.silu(x).transpose(1, 2), [8, 8], dim=-1)
    return q - k


def _decay(a_log, a):  # the DeltaNet's g
    return -a_log.float().exp() * F.softplus(a.float())


CASES = {
    "l2norm": (_l2norm, lambda: (torch.randn(2, 8, 32),)),
    "conv_activation": (_conv_activation, lambda: (torch.randn(2, 16, 8),)),
    "decay": (_decay, lambda: (torch.randn(4), torch.randn(2, 8, 4))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_other_roles_are_not_near_misses(npu_ops, caplog, case):
    fn, inputs = CASES[case]
    args = inputs()
    out = torch.compile(fn, backend="qwen_npu", options={"strict": True})(*args)
    torch.testing.assert_close(out, fn(*args), rtol=0, atol=0)
    (report,) = SUMMARY.graphs
    assert report.refused == [] and sum(report.fusions.values()) == 0
    assert sum(report.anchors.values()) == 0  # what could fuse: nothing
    assert "fused nothing" not in caplog.text


def test_rms_norm_with_a_reused_intermediate_stays_a_near_miss(npu_ops):
    from qwen_npu_compile.report import FusionError

    def norm(x, w):
        variance = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(variance + 1e-6)), variance  # the mean of squares leaves the subgraph

    with pytest.raises(Exception) as info:
        torch.compile(norm, backend="qwen_npu", options={"strict": True})(torch.randn(2, 8, 32), torch.randn(32))
    assert isinstance(info.value, FusionError) or isinstance(info.value.__cause__, FusionError) or "near miss" in str(info.value)
    assert "rms_norm: near miss" in str(info.value)


def test_a_silu_that_leaves_the_graph_stays_a_near_miss(npu_ops):
    """A SiLU whose result is the graph's output may be gated after a graph break: not recognised as an
    activation, so still a near miss (strict raises)."""
    with pytest.raises(Exception, match="swiglu: near miss"):
        torch.compile(lambda x: F.silu(x).transpose(1, 2), backend="qwen_npu", options={"strict": True})(torch.randn(2, 8, 4))
