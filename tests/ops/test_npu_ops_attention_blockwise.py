"""The blockwise ``npu_fusion_attention`` stand-in (:mod:`qwen_npu_compile.ops.torch_npu.attention_blockwise`) against the
dense formula it replaced (fp32 ``[B, N, Sq, Skv]`` scores and probabilities, :mod:`.attention_contract`), on
several tiles per row and column: the masks the patterns emit (none; the compressed causal mask with
``sparse_mode=2``; an explicit padded causal mask with ``sparse_mode=0``), mode 3, the band, GQA, ``pse``, fully
masked rows, fp32 and bf16, and the softmax statistics."""

from __future__ import annotations

import pytest
import torch

from qwen_npu_compile.ops import attention_contract
from qwen_npu_compile.ops.attention_contract import _probabilities, probability_grads, weighted_values
from qwen_npu_compile.ops.torch_npu import attention_blockwise, fusion_attention

pytestmark = pytest.mark.usefixtures("simulated_npu_ops")


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 5 query rows x 4 keys (the flash path's row-max pass: 3 x 3): every case below spans several tiles
    both ways (and a ragged last one)."""
    monkeypatch.setattr(attention_blockwise, "BLOCK_Q", 5)
    monkeypatch.setattr(attention_blockwise, "BLOCK_K", 4)
    monkeypatch.setattr(attention_blockwise, "ROW_MAX_BLOCK", 3)


def dense(q, k, v, do, nq, nkv, scale, pse=None, atten_mask=None, sparse_mode=0, pre=2147483647, nxt=2147483647):
    """The previous stand-in's formula (BNSD, fp32): out, row max, row sum, dq, dk, dv."""
    q, k, v, do = (t.float() for t in (q, k, v, do))
    masked = fusion_attention._masked_positions(atten_mask, sparse_mode, pre, nxt, q.shape[2], k.shape[2], q.device)
    p, row_max, row_sum = _probabilities(q, k, pse, masked, scale, nq // nkv)
    out = weighted_values(p, v, nq // nkv)
    dq, dk, dv = probability_grads(q, k, v, do, p, scale, nq // nkv)
    return out, row_max, row_sum, dq, dk, dv


def padded_causal(b, s, pads, left=True):
    """[B, 1, S, S] bool, True = masked: causal plus ``pads[i]`` padding keys (left: leading ones)."""
    j = torch.arange(s)
    i = j.unsqueeze(-1)
    pad = torch.tensor(pads)[:, None]
    key_pad = (j < pad) if left else (j >= s - pad)
    return ((j > i)[None] | key_pad[:, None, :])[:, None]


CASES = [
    # id, B, Nq, Nkv, Sq, Skv, D, mask kind
    pytest.param(1, 4, 4, 13, 13, 64, "none", id="MHA-nomask"),
    pytest.param(2, 6, 2, 13, 13, 64, "causal2", id="GQA-mode2"),
    pytest.param(1, 4, 1, 9, 14, 64, "causal2", id="MQA-mode2-Sq<Skv"),
    pytest.param(1, 4, 2, 14, 9, 128, "causal3", id="GQA-mode3-Sq>Skv"),
    pytest.param(2, 4, 2, 13, 13, 64, "left_pad", id="GQA-mode0-left-padded-causal"),
    pytest.param(2, 4, 2, 13, 13, 64, "right_pad", id="GQA-mode0-right-padded-causal"),
    pytest.param(2, 4, 2, 13, 13, 64, "bnss", id="GQA-mode0-BNSS-random"),
    pytest.param(1, 2, 2, 13, 13, 64, "band", id="MHA-mode0-band"),
    pytest.param(2, 4, 2, 13, 11, 64, "pse", id="GQA-pse-nomask"),
]


def setup(kind, b, nq, sq, skv, gen):
    if kind == "none":
        return {}
    if kind in ("causal2", "causal3"):
        return dict(atten_mask=attention_contract.compressed_causal_mask(), sparse_mode=int(kind[-1]))
    if kind == "left_pad":  # batch 1's first 6 rows see nothing at all (fully masked rows)
        return dict(atten_mask=padded_causal(b, sq, [0, 6]), sparse_mode=0)
    if kind == "right_pad":
        return dict(atten_mask=padded_causal(b, sq, [3, 0], left=False), sparse_mode=0)
    if kind == "bnss":
        return dict(atten_mask=torch.rand(b, nq, sq, skv, generator=gen) < 0.4, sparse_mode=0)
    if kind == "band":
        return dict(atten_mask=torch.zeros(sq, skv, dtype=torch.bool), sparse_mode=0, pre_tockens=5, next_tockens=1)
    if kind == "pse":
        return dict(pse=torch.randn(b, 1, sq, skv, generator=gen))
    raise AssertionError(kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,nq,nkv,sq,skv,d,kind", CASES)
def test_blockwise_equals_the_dense_formula(small_tiles, b, nq, nkv, sq, skv, d, kind, dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, nq, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, nkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, nkv, skv, d, generator=gen).to(dtype)
    do = torch.randn(b, nq, sq, d, generator=gen).to(dtype)
    options = setup(kind, b, nq, sq, skv, gen)
    if "pse" in options:
        options["pse"] = options["pse"].to(dtype)
    scale = d**-0.5
    out, smax, ssum, *_ = fusion_attention.reference_fusion_attention(q, k, v, nq, "BNSD", scale=scale, **options)
    dq, dk, dv, *_ = fusion_attention.reference_fusion_attention_grad(
        q, k, v, do, nq, "BNSD", scale_value=scale, **options)
    want = dense(q, k, v, do, nq, nkv, scale, pse=options.get("pse"), atten_mask=options.get("atten_mask"),
                 sparse_mode=options.get("sparse_mode", 0), pre=options.get("pre_tockens", 2147483647),
                 nxt=options.get("next_tockens", 2147483647))
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), want[0].to(dtype).float(), **tol)
    torch.testing.assert_close(smax, want[1].expand_as(smax), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssum, want[2].expand_as(ssum), atol=1e-4, rtol=1e-5)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want[3:]):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.float(), ref.to(dtype).float(), msg=lambda m, n=name: f"{n}: {m}",
                                   **({k_: 2 * x for k_, x in tol.items()}))
    if kind == "left_pad":  # documented: fully masked rows give -inf / 0 statistics, 0 output and no dq
        assert torch.isneginf(smax[1, :, :6]).all() and (ssum[1, :, :6] == 0).all()
        assert torch.count_nonzero(out[1, :, :6]) == 0 and torch.count_nonzero(dq[1, :, :6]) == 0


@pytest.mark.parametrize("kind,flash", [("none", True), ("causal2", True), ("causal3", False), ("left_pad", False),
                                        ("band", False), ("pse", False)])
def test_torch_flash_attention_only_where_it_computes_the_call(small_tiles, monkeypatch, kind, flash):
    """aten._scaled_dot_product_flash_attention_for_cpu (forward and backward) for no mask and the left-up causal
    mask (mode 2; mode 3 only with Sq == Skv); the own loop for explicit masks, the band, pse and mode 3 with
    Sq > Skv (fully masked rows)."""
    used = []
    real = attention_blockwise._flash_forward
    monkeypatch.setattr(attention_blockwise, "_flash_forward", lambda *a: used.append(a[3]) or real(*a))
    sq, skv = (14, 9) if kind == "causal3" else (13, 13)
    q, k, v = torch.randn(2, 4, sq, 64), torch.randn(2, 2, skv, 64), torch.randn(2, 2, skv, 64)
    options = setup(kind, 2, 4, sq, skv, torch.Generator().manual_seed(0))
    fusion_attention.reference_fusion_attention(q, k, v, 4, "BNSD", scale=0.125, **options)
    fusion_attention.reference_fusion_attention_grad(q, k, v, torch.randn(2, 4, sq, 64), 4, "BNSD", scale_value=0.125,
                                                     **options)
    assert used == ([kind == "causal2"] * 2 if flash else [])


def test_masked_out_tiles_are_skipped(small_tiles, monkeypatch):
    """The own loop with a causal band (mode 0, next_tockens=0): the tiles above the diagonal are never computed
    (the work of a causal call is about half)."""
    calls = []
    real = attention_blockwise._scores
    monkeypatch.setattr(attention_blockwise, "_scores", lambda *a: calls.append(a[-4:]) or real(*a))
    q = torch.randn(1, 2, 20, 64)
    fusion_attention.reference_fusion_attention(q, q, q, 2, "BNSD", scale=0.125, next_tockens=0,
                                                atten_mask=torch.zeros(20, 20, dtype=torch.bool), sparse_mode=0)
    # rows in 4 blocks of 5, keys in 5 blocks of 4: tiles with c0 <= r1 - 1 only
    expected = [(r0, r0 + 5, c0, c0 + 4) for r0 in range(0, 20, 5) for c0 in range(0, 20, 4) if c0 <= r0 + 4]
    assert calls == expected


@pytest.mark.parametrize("kind", ["causal2", "left_pad"])
def test_no_full_score_matrix_at_a_long_length(monkeypatch, kind):
    """At S = 1024 (4 x 4 tiles of 256) no [S, S] fp32 tensor is allocated, on the flash path (causal) or the own
    loop (a padded causal mask): the largest fp32 tensor is at most a quarter of one [B, N, S, S] score matrix, and
    the results equal the dense formula's."""
    for name in ("BLOCK_Q", "BLOCK_K", "ROW_MAX_BLOCK"):
        monkeypatch.setattr(attention_blockwise, name, 256)
    torch.manual_seed(0)
    b, n, s, d = 1, 2, 1024, 64
    q, k, v, do = (torch.randn(b, n, s, d) for _ in range(4))
    options = setup(kind, b, n, s, s, None)
    if kind == "left_pad":
        options = dict(atten_mask=padded_causal(b, s, [100]), sparse_mode=0)
    mask, mode = options["atten_mask"], options["sparse_mode"]
    sizes = []

    class Watch(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    sizes.append(t.numel())
            return out

    with Watch():
        out, *_ = fusion_attention.reference_fusion_attention(q, k, v, n, "BNSD", scale=0.125, atten_mask=mask,
                                                              sparse_mode=mode)
        grads = fusion_attention.reference_fusion_attention_grad(q, k, v, do, n, "BNSD", scale_value=0.125,
                                                                 atten_mask=mask, sparse_mode=mode)
    assert max(sizes) <= b * n * s * s // 4
    want = dense(q, k, v, do, n, n, 0.125, atten_mask=mask, sparse_mode=mode)
    torch.testing.assert_close(out, want[0], atol=2e-5, rtol=2e-5)
    for got, ref in zip(grads[:3], want[3:]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
