"""The simulated ``npu_fusion_attention`` / ``npu_fusion_attention_grad`` against plain SDPA math."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from qwen_npu_compile.ops import attention_contract
from qwen_npu_compile.ops.torch_npu import fusion_attention
from tests.helpers.graphs import aot_traced
from tests.helpers.graphs import call_targets as targets
from tests.helpers.tensors import random_qkv

pytestmark = pytest.mark.usefixtures("simulated_npu_ops")


def fa(*args, **kwargs):
    return torch.ops.npu.npu_fusion_attention.default(*args, **kwargs)


def fa_grad(*args, **kwargs):
    return torch.ops.npu.npu_fusion_attention_grad.default(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# plain-torch reference


def layout_qkv(layout, b, nq, nkv, sq, skv, d, dtype, requires_grad=True, seed=0):
    """``[q, k, v]`` in ``layout`` (``nq`` / ``nkv`` heads, ``sq`` / ``skv`` tokens, head dim ``d``)."""
    shapes = {
        "BNSD": lambda n, s: (b, n, s, d),
        "BSND": lambda n, s: (b, s, n, d),
        "BSH": lambda n, s: (b, s, n * d),
        "SBH": lambda n, s: (s, b, n * d),
    }[layout]
    return random_qkv(shapes(nq, sq), shapes(nkv, skv), dtype, requires_grad=requires_grad, seed=seed)


def to_bnsd(t, layout, n):
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        return t.unflatten(-1, (n, -1)).transpose(1, 2)
    return t.unflatten(-1, (n, -1)).permute(1, 2, 0, 3)  # SBH


def from_bnsd(t, layout):
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        return t.transpose(1, 2).flatten(-2)
    return t.permute(2, 0, 1, 3).flatten(-2)  # SBH


def sdpa_reference(q, k, v, layout, nq, nkv, keep=None, scale=None):
    """SDPA in fp32 with PyTorch's bool polarity (True = keep) and native GQA."""
    out = F.scaled_dot_product_attention(
        to_bnsd(q.float(), layout, nq),
        to_bnsd(k.float(), layout, nkv),
        to_bnsd(v.float(), layout, nkv),
        attn_mask=keep,
        scale=scale,
        enable_gqa=True,
    )
    return from_bnsd(out, layout)


def causal_keep(sq, skv, shift=0):
    i = torch.arange(sq).unsqueeze(-1)
    j = torch.arange(skv)
    return j <= i + shift


def mask_setup(kind, b, sq, skv):
    """Returns (npu kwargs, PyTorch keep mask or None)."""
    if kind == "none":
        return {}, None
    if kind == "pad_causal":
        # right padding: batch 1 has its last 2 keys padded; causal on top; no fully masked row.
        lengths = torch.tensor([skv, skv - 2][:b])
        key_ok = torch.arange(skv) < lengths[:, None]  # [B, Skv]
        keep = causal_keep(sq, skv)[None, None] & key_ok[:, None, None, :]  # [B, 1, Sq, Skv]
        return dict(atten_mask=~keep, sparse_mode=0), keep
    if kind == "causal2":
        return dict(atten_mask=attention_contract.compressed_causal_mask(), sparse_mode=2), causal_keep(sq, skv)
    if kind == "causal3":
        keep = causal_keep(sq, skv, shift=skv - sq)
        return dict(atten_mask=attention_contract.compressed_causal_mask(), sparse_mode=3), keep
    if kind == "band":
        # mode 0 with an all-False mask and next_tockens=0: the band makes it causal
        zeros = torch.zeros(sq, skv, dtype=torch.bool)
        return dict(atten_mask=zeros, sparse_mode=0, next_tockens=0), causal_keep(sq, skv)
    raise AssertionError(kind)


CASES = [
    # layout, B, Nq, Nkv, Sq, Skv, D, dtype, mask kind
    pytest.param("BNSD", 2, 4, 4, 6, 6, 64, torch.float32, "none", id="BNSD-MHA-d64-fp32-nomask"),
    pytest.param("BSND", 2, 4, 2, 6, 6, 128, torch.float32, "pad_causal", id="BSND-GQA-d128-fp32-mode0"),
    pytest.param("BNSD", 2, 6, 2, 6, 6, 64, torch.bfloat16, "pad_causal", id="BNSD-GQA-d64-bf16-mode0"),
    pytest.param("BSND", 1, 4, 1, 5, 8, 64, torch.bfloat16, "causal2", id="BSND-MQA-d64-bf16-mode2-Sq<Skv"),
    pytest.param("BNSD", 1, 4, 2, 8, 5, 128, torch.float32, "causal2", id="BNSD-GQA-d128-fp32-mode2-Sq>Skv"),
    pytest.param("BSND", 2, 4, 2, 4, 7, 64, torch.float32, "causal3", id="BSND-GQA-d64-fp32-mode3-Sq<Skv"),
    pytest.param("BNSD", 1, 2, 1, 7, 4, 64, torch.float32, "causal3", id="BNSD-GQA-d64-fp32-mode3-Sq>Skv"),
    pytest.param("BSH", 2, 4, 2, 5, 5, 64, torch.float32, "pad_causal", id="BSH-GQA-d64-fp32-mode0"),
    pytest.param("SBH", 2, 4, 4, 5, 5, 64, torch.bfloat16, "none", id="SBH-MHA-d64-bf16-nomask"),
    pytest.param("BNSD", 1, 2, 2, 6, 6, 64, torch.float32, "band", id="BNSD-MHA-d64-fp32-band-next0"),
]


def tolerances(dtype):
    return (2e-5, 2e-5) if dtype == torch.float32 else (3e-2, 3e-2)


@pytest.mark.parametrize("layout,b,nq,nkv,sq,skv,d,dtype,mask_kind", CASES)
def test_forward_and_backward_match_sdpa(layout, b, nq, nkv, sq, skv, d, dtype, mask_kind):
    q, k, v = layout_qkv(layout, b, nq, nkv, sq, skv, d, dtype)
    kwargs, keep = mask_setup(mask_kind, b, sq, skv)
    scale = 1 / math.sqrt(d)
    res = fa(q, k, v, nq, layout, scale=scale, **kwargs)

    out, softmax_max, softmax_sum, softmax_out, seed, offset, numels = res
    assert (out.shape, out.dtype) == (q.shape, dtype)
    assert out.is_contiguous()
    assert (softmax_max.shape, softmax_max.dtype) == ((b, nq, sq, 8), torch.float32)
    assert (softmax_sum.shape, softmax_sum.dtype) == ((b, nq, sq, 8), torch.float32)
    assert (softmax_out.shape, softmax_out.dtype) == ((0,), dtype)
    assert (seed, offset, numels) == (0, 0, 0)
    assert all(type(x) is int for x in (seed, offset, numels))

    atol, rtol = tolerances(dtype)
    expected = sdpa_reference(q.detach(), k.detach(), v.detach(), layout, nq, nkv, keep, scale)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = sdpa_reference(*leaves, layout, nq, nkv, keep, scale)
    want = torch.autograd.grad(ref_out, leaves, grad.float())
    for name, g, w, t in zip("qkv", got, want, (q, k, v)):
        assert (g.shape, g.dtype) == (t.shape, t.dtype), name
        torch.testing.assert_close(g.float(), w, atol=atol * 2, rtol=rtol * 2, msg=lambda m: f"d{name}: {m}")


def test_softmax_statistics_are_row_max_and_sum():
    b, nq, nkv, s, d = 2, 4, 2, 6, 64
    q, k, v = layout_qkv("BNSD", b, nq, nkv, s, s, d, torch.float32, requires_grad=False)
    kwargs, keep = mask_setup("pad_causal", b, s, s)
    scale = 0.125
    _, smax, ssum, *_ = fa(q, k, v, nq, "BNSD", scale=scale, **kwargs)
    scores = (q @ k.repeat_interleave(nq // nkv, 1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    assert torch.equal(smax, smax[..., :1].expand_as(smax))
    assert torch.equal(ssum, ssum[..., :1].expand_as(ssum))
    torch.testing.assert_close(smax[..., 0], scores.amax(-1))
    torch.testing.assert_close(smax[..., 0] + ssum[..., 0].log(), torch.logsumexp(scores, -1))


def test_fully_masked_rows_with_inner_precise_2_are_zero_and_finite():
    layout, b, nq, nkv, s, d = "BSND", 2, 4, 2, 6, 64
    q, k, v = layout_qkv(layout, b, nq, nkv, s, s, d, torch.float32)
    # left padding: batch 1 has 3 padded keys; causal on top -> query rows 0..2 of batch 1 see nothing
    key_ok = torch.arange(s) >= torch.tensor([0, 3])[:, None]
    keep = causal_keep(s, s)[None, None] & key_ok[:, None, None, :]
    assert (~keep.any(-1)).sum() == 3
    out, smax, ssum, *_ = fa(q, k, v, nq, layout, atten_mask=~keep, scale=0.125, inner_precise=2)
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out[1, :3]) == 0
    # documented: -inf max and 0 sum on fully masked rows
    assert torch.isneginf(smax[1, :, :3]).all() and (ssum[1, :, :3] == 0).all()
    # PyTorch's math SDPA also returns 0 on fully masked rows
    expected = sdpa_reference(q.detach(), k.detach(), v.detach(), layout, nq, nkv, keep, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)

    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.count_nonzero(grads[0][1, :3]) == 0
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(sdpa_reference(*leaves, layout, nq, nkv, keep, 0.125).sum(), leaves)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=4e-5, rtol=4e-5)


def test_inner_precise_0_also_zeroes_fully_masked_rows():
    q, k, v = layout_qkv("BNSD", 1, 2, 2, 4, 4, 64, torch.float32, requires_grad=False)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[0] = True
    out = fa(q, k, v, 2, "BNSD", atten_mask=mask, scale=0.125, inner_precise=0)[0]
    assert torch.isfinite(out).all() and torch.count_nonzero(out[:, :, 0]) == 0


def test_uint8_mask_equals_bool_mask():
    q, k, v = layout_qkv("BNSD", 2, 4, 2, 5, 5, 64, torch.float32, requires_grad=False)
    kwargs, _ = mask_setup("pad_causal", 2, 5, 5)
    bool_out = fa(q, k, v, 4, "BNSD", scale=0.125, **kwargs)[0]
    kwargs["atten_mask"] = kwargs["atten_mask"].to(torch.uint8)
    torch.testing.assert_close(fa(q, k, v, 4, "BNSD", scale=0.125, **kwargs)[0], bool_out, atol=0, rtol=0)


def test_pse_is_added_before_scaling():
    q, k, v = layout_qkv("BNSD", 1, 2, 2, 5, 5, 64, torch.float32, requires_grad=False)
    pse = torch.randn(1, 2, 5, 5)
    out = fa(q, k, v, 2, "BNSD", pse=pse, scale=0.125)[0]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=0.125 * pse, scale=0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    pse.requires_grad_()
    out = fa(q, k, v, 2, "BNSD", pse=pse, scale=0.125)[0]
    with pytest.raises(RuntimeError, match="pse"):
        out.sum().backward()


def test_dropout_is_deterministic_in_seed_and_offset_and_its_gradient_is_exact():
    layout, b, nq, nkv, s, d, kp = "BSND", 2, 4, 2, 5, 64, 0.75
    q, k, v = layout_qkv(layout, b, nq, nkv, s, s, d, torch.float32)
    kwargs, keep = mask_setup("pad_causal", b, s, s)
    res = fa(q, k, v, nq, layout, scale=0.125, keep_prob=kp, seed=1234, offset=7, **kwargs)
    out, *_, seed, offset, numels = res
    assert (seed, offset, numels) == (1234, 7, b * nq * s * s)
    again = fa(q, k, v, nq, layout, scale=0.125, keep_prob=kp, seed=1234, offset=7, **kwargs)[0]
    assert torch.equal(out, again)
    other = fa(q, k, v, nq, layout, scale=0.125, keep_prob=kp, seed=1235, offset=7, **kwargs)[0]
    assert not torch.equal(out, other)

    drop = fusion_attention.dropout_keep_mask((b, nq, s, s), kp, 1234, 7)
    assert 0.5 < drop.float().mean() < 0.95

    def plain(q, k, v):
        qb, kb, vb = (to_bnsd(t, layout, n) for t, n in ((q, nq), (k, nkv), (v, nkv)))
        kb, vb = kb.repeat_interleave(nq // nkv, 1), vb.repeat_interleave(nq // nkv, 1)
        scores = (qb @ kb.transpose(-1, -2) * 0.125).masked_fill(~keep, float("-inf"))
        p = scores.softmax(-1) * drop / kp
        return from_bnsd(p @ vb, layout)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = plain(*leaves)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    grad = torch.randn(out.shape)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, leaves, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=4e-5, rtol=4e-5)


def _bad(name):
    """Arguments that must be refused: (args, kwargs, match, also checked by the fake kernel)."""
    q, k, v = layout_qkv("BNSD", 1, 4, 2, 4, 4, 64, torch.float32, requires_grad=False)
    cmask = attention_contract.compressed_causal_mask()
    cases = {
        "tnd": ((q[0], k[0], v[0], 4, "TND"), {}, "TND", True),
        "gqa-ratio": ((q, k[:, :1].expand(1, 3, 4, 64).contiguous(), v[:, :1].expand(1, 3, 4, 64).contiguous(), 4, "BNSD"), {}, "multiple", True),
        "head-num": ((q, k, v, 8, "BNSD"), {}, "head_num", True),
        "sparse-mode-4": ((q, k, v, 4, "BNSD"), dict(atten_mask=cmask, sparse_mode=4), "sparse_mode", True),
        "mode2-full-mask": ((q, k, v, 4, "BNSD"), dict(atten_mask=torch.ones(4, 4).triu(1).bool(), sparse_mode=2), "compressed", True),
        "mode2-wrong-values": ((q, k, v, 4, "BNSD"), dict(atten_mask=torch.zeros(2048, 2048, dtype=torch.bool), sparse_mode=2), "compressed", False),
        "float-mask": ((q, k, v, 4, "BNSD"), dict(atten_mask=torch.zeros(4, 4)), "bool or uint8", True),
        "mask-shape": ((q, k, v, 4, "BNSD"), dict(atten_mask=torch.zeros(1, 2, 4, 4, dtype=torch.bool)), "BNSS", True),
        "padding-mask": ((q, k, v, 4, "BNSD"), dict(padding_mask=torch.zeros(4, 4)), "padding_mask", True),
        "dtype-mix": ((q, k.half(), v, 4, "BNSD"), {}, "dtypes differ", True),
        "keep-prob": ((q, k, v, 4, "BNSD"), dict(keep_prob=0.0), "keep_prob", True),
        "rank": ((q[0], k[0], v[0], 4, "BNSD"), {}, "4-D", True),
    }  # fmt: skip
    return cases[name]


@pytest.mark.parametrize(
    "name",
    ["tnd", "gqa-ratio", "head-num", "sparse-mode-4", "mode2-full-mask", "mode2-wrong-values", "float-mask",
     "mask-shape", "padding-mask", "dtype-mix", "keep-prob", "rank"],
)  # fmt: skip
def test_refused_arguments(name):
    args, kwargs, match, fake_too = _bad(name)
    with pytest.raises(RuntimeError, match=match):
        fa(*args, **kwargs)
    if fake_too:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake_kwargs = {key: mode.from_tensor(a) for key, a in kwargs.items() if isinstance(a, torch.Tensor)}
            fake_kwargs.update({key: a for key, a in kwargs.items() if not isinstance(a, torch.Tensor)})
            with pytest.raises(RuntimeError, match=match):
                fa(*fake_args, **fake_kwargs)


def test_mask_is_ignored_without_one_even_for_causal_modes():
    # documented: with atten_mask=None, sparse_mode / pre / next have no effect (full attention)
    q, k, v = layout_qkv("BNSD", 1, 2, 2, 4, 4, 64, torch.float32, requires_grad=False)
    full = fa(q, k, v, 2, "BNSD", scale=0.125)[0]
    torch.testing.assert_close(fa(q, k, v, 2, "BNSD", scale=0.125, sparse_mode=2)[0], full, atol=0, rtol=0)
    torch.testing.assert_close(fa(q, k, v, 2, "BNSD", scale=0.125, next_tockens=0)[0], full, atol=0, rtol=0)


def test_fake_tensor_shapes_and_dtypes():
    with FakeTensorMode():
        # BSH, GQA: H = N * D
        q = torch.empty(2, 7, 8 * 64, dtype=torch.bfloat16)
        k = torch.empty(2, 7, 2 * 64, dtype=torch.bfloat16)
        v = torch.empty(2, 7, 2 * 64, dtype=torch.bfloat16)
        out, smax, ssum, sout, seed, offset, numels = fa(q, k, v, 8, "BSH", scale=0.125)
        assert (out.shape, out.dtype) == (q.shape, torch.bfloat16)
        assert (smax.shape, smax.dtype) == ((2, 8, 7, 8), torch.float32)
        assert (ssum.shape, ssum.dtype) == ((2, 8, 7, 8), torch.float32)
        assert (sout.shape, sout.dtype) == ((0,), torch.bfloat16)
        assert (seed, offset, numels) == (0, 0, 0)
        dq, dk, dv, dpse, dsink = fa_grad(q, k, v, out, 8, "BSH", scale_value=0.125)
        assert (dq.shape, dq.dtype) == (q.shape, q.dtype)
        assert (dk.shape, dk.dtype) == (k.shape, k.dtype)
        assert (dv.shape, dv.dtype) == (v.shape, v.dtype)
        assert dpse.shape == (0,) and dsink.shape == (0,) and dsink.dtype == torch.float32


def test_grad_op_outputs_directly():
    layout, nq, nkv = "BSND", 4, 2
    q, k, v = layout_qkv(layout, 2, nq, nkv, 5, 5, 64, torch.bfloat16, requires_grad=False)
    dy = torch.randn(q.shape).to(torch.bfloat16)
    dq, dk, dv, dpse, dsink = fa_grad(q, k, v, dy, nq, layout, scale_value=0.125, inner_precise=2)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    assert (dpse.shape, dpse.dtype) == ((0,), torch.bfloat16)
    assert (dsink.shape, dsink.dtype) == ((0,), torch.float32)  # torch_npu 2.13.0 Meta kernel, no sink


def test_opcheck():
    q, k, v = layout_qkv("BSND", 2, 4, 2, 5, 5, 64, torch.float32)
    kwargs, _ = mask_setup("pad_causal", 2, 5, 5)
    torch.library.opcheck(torch.ops.npu.npu_fusion_attention.default, (q, k, v, 4, "BSND"), dict(scale=0.125, **kwargs))
    dy = torch.randn(q.shape)
    torch.library.opcheck(
        torch.ops.npu.npu_fusion_attention_grad.default,
        (q.detach(), k.detach(), v.detach(), dy, 4, "BSND"),
        dict(scale_value=0.125, **kwargs),
    )


@pytest.mark.parametrize("keep_prob", [1.0, 0.8])
def test_aot_backward_graph_contains_grad_op(keep_prob):
    layout, nq, s = "BNSD", 4, 5
    q, k, v = layout_qkv(layout, 2, nq, 2, s, s, 64, torch.float32)
    mask = attention_contract.compressed_causal_mask()

    def fn(q, k, v, mask):
        res = fa(q, k, v, nq, layout, atten_mask=mask, scale=0.125, keep_prob=keep_prob, sparse_mode=2, seed=11)
        return res[0] * 2

    compiled, graphs = aot_traced(fn)
    out = compiled(q, k, v, mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v))

    assert torch.ops.npu.npu_fusion_attention.default in targets(graphs["fw"])
    assert targets(graphs["bw"]).count(torch.ops.npu.npu_fusion_attention_grad.default) == 1
    assert torch.ops.npu.npu_fusion_attention.default not in targets(graphs["bw"])
    eager = fn(q, k, v, mask)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    for g, e in zip(grads, torch.autograd.grad(eager.sum(), (q, k, v))):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
