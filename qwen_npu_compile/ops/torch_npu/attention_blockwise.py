"""Blockwise CPU math of the dense-layout ``npu_fusion_attention`` stand-in (and its grad): online softmax over
key blocks, as FlashAttention (Dao et al. 2022, "FlashAttention", Algorithm 1; FlashAttention-2, Algorithm 2
for the backward) and torch's own CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``)
compute it. Nothing here builds an ``[Sq, Skv]`` fp32 tensor: the scores live one ``[B, N, BLOCK_Q, BLOCK_K]``
tile at a time; masks that have a compact form (the causal modes 2/3, the ``pre_tockens``/``next_tockens``
band) are built per tile from indices, an explicit mode-0 mask (bool, the caller's ``[B|1, N|1, Sq, Skv]``) is
sliced per tile, and tiles that are masked out entirely are skipped. Where torch's CPU flash attention computes
a call exactly (no ``pse``, no mask or the left-up causal one, Dv == D), its forward and backward are used
(``aten._scaled_dot_product_flash_attention_for_cpu`` and ``..._backward``, with the KV heads expanded over each
GQA group), and the row maximum comes from one more pass over the score tiles.

What the loop keeps per query row is exactly what ``npu_fusion_attention`` returns as its softmax statistics
(torch_npu 2.13.0 ``_op_plugin_docs.py``: ``softmax_max`` / ``softmax_sum``): the running row maximum of the
scaled, masked scores and the sum of ``exp(score - max)``; a fully masked row keeps ``max = -inf`` and
``sum = 0`` and gets 0 output and no gradient.

Imports only torch and :mod:`.attention_contract` (the compressed mask, ``NO_BAND``).
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops.attention_contract import COMPRESSED_MASK_MODES, NO_BAND, compressed_mask_shift

#: Query rows per tile.
BLOCK_Q = 512
#: Key positions per tile (the online softmax's block).
BLOCK_K = 512

#: Query rows and keys per tile of the row-maximum pass of the flash path (:func:`_row_max`): one matmul and one
#: max per tile, larger tiles are faster there (measured: 0.9 s at 512, 0.6 s at 1024 for S = 2048, 8 heads of 256).
ROW_MAX_BLOCK = 1024

_NEG_INF = float("-inf")


def _grouped(t: torch.Tensor, nkv: int, group: int) -> torch.Tensor:
    """A ``[B|1, Nq|1, X, Y]`` tensor viewed ``[B|1, Nkv|1, G|1, X, Y]`` (query head ``h`` is KV head
    ``h // G``'s group member ``h % G``); a 2-D ``[X, Y]`` one is returned as is (it broadcasts)."""
    if t.dim() == 2:
        return t
    if t.shape[1] == 1:
        return t.unsqueeze(2)
    return t.reshape(t.shape[0], nkv, group, *t.shape[2:])


def _tile(t: torch.Tensor, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """Rows ``r0:r1`` and columns ``c0:c1`` of the last two dims of ``t``; a size-1 dim (broadcast) is kept."""
    rows = slice(r0, r1) if t.shape[-2] != 1 else slice(None)
    cols = slice(c0, c1) if t.shape[-1] != 1 else slice(None)
    return t[..., rows, cols]


class Masking:
    """The masked positions of one call, per tile (True = masked out, the op's polarity).

    Args:
        atten_mask: None (nothing masked: ``sparse_mode``/``pre_tockens``/``next_tockens`` have no effect), the
            compressed causal mask (modes 2/3), or a bool/uint8 BNSS/B1SS/11SS/SS mask (mode 0).
        sparse_mode: 0, 2 (left-up causal: ``j > i`` masked) or 3 (right-down: ``j > i + Skv - Sq``).
        pre_tockens, next_tockens: mode 0's band: keys ``j < i - pre_tockens`` or ``j > i + next_tockens`` are
            masked too.
        sq, skv: query and key lengths.
        nkv, group: KV heads and query heads per KV head (the explicit mask is viewed grouped).

    Raises:
        RuntimeError: modes 2/3 with a mask other than the compressed causal mask.
    """

    def __init__(self, atten_mask, sparse_mode: int, pre_tockens: int, next_tockens: int, sq: int, skv: int,
                 nkv: int, group: int):
        self.explicit = None
        self.pre = None  # mask j < i - pre
        self.next = None  # mask j > i + next
        #: torch's CPU flash attention computes this call exactly: no mask, or the left-up causal one (``j > i``)
        self.flash_causal: bool | None = False if atten_mask is None else None
        if atten_mask is None:
            return
        if sparse_mode in COMPRESSED_MASK_MODES:
            self.next = compressed_mask_shift(atten_mask, sparse_mode, sq, skv)
            if self.next == 0:  # mode 2, or mode 3 with Sq == Skv (no row is fully masked)
                self.flash_causal = True
            return
        self.explicit = _grouped(atten_mask.bool(), nkv, group)
        if pre_tockens < NO_BAND:
            self.pre = pre_tockens
        if next_tockens < NO_BAND:
            self.next = next_tockens

    def tile(self, r0: int, r1: int, c0: int, c1: int, device) -> tuple[bool, torch.Tensor | None]:
        """``(skip, mask)`` of the tile rows ``r0:r1`` x keys ``c0:c1``: skip when every position of the tile
        is masked out (for every batch and head), else the bool mask broadcastable to the grouped tile
        ``[B, Nkv, G, r1 - r0, c1 - c0]`` (None: nothing masked in the tile)."""
        if self.next is not None and c0 - (r1 - 1) > self.next:
            return True, None
        if self.pre is not None and r0 - (c1 - 1) > self.pre:
            return True, None
        mask = None
        if (self.next is not None and c1 - 1 - r0 > self.next) or (self.pre is not None and r1 - 1 - c0 > self.pre):
            i = torch.arange(r0, r1, device=device).unsqueeze(-1)
            j = torch.arange(c0, c1, device=device)
            if self.next is not None:
                mask = j - i > self.next
            if self.pre is not None:
                band = i - j > self.pre
                mask = band if mask is None else mask | band
        if self.explicit is not None:
            given = _tile(self.explicit, r0, r1, c0, c1)
            mask = given if mask is None else given | mask
        if mask is not None and bool(mask.all()):
            return True, None
        return False, mask


def _scores(qi, kj, pse_g, mask, scale: float, shape5, r0, r1, c0, c1) -> torch.Tensor:
    """fp32 ``scale * (qi @ kj^T + pse)`` of one tile, masked positions ``-inf``: ``[B, Nkv, G * bq, bk]``."""
    s = qi @ kj.transpose(-1, -2)
    s5 = s.view(shape5)
    if pse_g is not None:
        s5.add_(_tile(pse_g, r0, r1, c0, c1).float())
    s.mul_(scale)
    if mask is not None:
        s5.masked_fill_(mask, _NEG_INF)
    return s


def _query_block(t5: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0:r1`` of a grouped ``[B, Nkv, G, S, X]`` tensor as ``[B, Nkv, G * (r1 - r0), X]``."""
    b, nkv, g, _, x = t5.shape
    return t5[:, :, :, r0:r1].reshape(b, nkv, g * (r1 - r0), x)


def _flash_applies(q, v, pse, masking: Masking) -> bool:
    """Whether torch's CPU flash attention computes this call as the op defines it: no ``pse``, no mask or the
    left-up causal one (PyTorch's ``is_causal``), Dv == D."""
    return pse is None and masking.flash_causal is not None and v.shape[-1] == q.shape[-1] and q.device.type == "cpu"


def _flash_forward(q, k, v, causal: bool, scale: float, group: int):
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (blockwise, with a log-sum-exp) with the KV heads
    expanded over each group: ``(out [B, Nq, Sq, Dv], lse [B, Nq, Sq], k, v)`` (k, v as expanded)."""
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, scale=scale)
    return out, lse, k, v


def _row_max(q, k, masking: Masking, scale: float, group: int) -> torch.Tensor:
    """The row maximum of the scaled, masked scores, tile by tile: fp32 ``[B, Nq, Sq, 1]``."""
    b, nq, sq, d = q.shape
    nkv, skv = k.shape[1], k.shape[2]
    q5 = q.reshape(b, nkv, group, sq, d)
    row_max = q.new_empty(b, nkv, group, sq, 1)
    block = ROW_MAX_BLOCK
    for r0 in range(0, sq, block):
        r1 = min(r0 + block, sq)
        qi = _query_block(q5, r0, r1)
        m = q.new_full((b, nkv, qi.shape[2], 1), _NEG_INF)
        for c0 in range(0, skv, block):
            c1 = min(c0 + block, skv)
            skip, mask = masking.tile(r0, r1, c0, c1, q.device)
            if not skip:
                s = _scores(qi, k[:, :, c0:c1], None, mask, scale, (b, nkv, group, r1 - r0, c1 - c0), r0, r1, c0, c1)
                m = torch.maximum(m, s.amax(-1, keepdim=True))
        row_max[:, :, :, r0:r1] = m.view(b, nkv, group, r1 - r0, 1)
    return row_max.view(b, nq, sq, 1)


def forward(q, k, v, pse, masking: Masking, scale: float, group: int):
    """Blockwise softmax attention: torch's CPU flash attention where it computes the call exactly (no ``pse``, no
    mask or the left-up causal one; the row max then from one more pass over the score tiles, the sum from the
    log-sum-exp), else the online-softmax loop below.

    Args:
        q: fp32 ``[B, Nq, Sq, D]``; k: fp32 ``[B, Nkv, Skv, D]``; v: fp32 ``[B, Nkv, Skv, Dv]`` (BNSD, Nq = G * Nkv).
        pse: None or a ``[B|1, Nq|1, Sq|1, Skv|1]`` additive bias (any float dtype; added before scaling).
        masking: the call's :class:`Masking`.
        scale: multiplies ``q @ k^T + pse``.
        group: G = Nq // Nkv.

    Returns:
        ``(out, row_max, row_sum)``: fp32 ``[B, Nq, Sq, Dv]``, ``[B, Nq, Sq, 1]``, ``[B, Nq, Sq, 1]`` (a fully
        masked row: 0 output, ``-inf`` max, 0 sum).
    """
    if _flash_applies(q, v, pse, masking):
        out, lse, _, _ = _flash_forward(q, k, v, masking.flash_causal, scale, group)
        row_max = _row_max(q, k, masking, scale, group)
        return out, row_max, torch.exp(lse.unsqueeze(-1) - row_max)
    b, nq, sq, d = q.shape
    nkv, skv, dv = k.shape[1], k.shape[2], v.shape[-1]
    q5 = q.reshape(b, nkv, group, sq, d)
    pse_g = None if pse is None else _grouped(pse, nkv, group)
    out = q.new_empty(b, nkv, group, sq, dv)
    row_max = q.new_empty(b, nkv, group, sq, 1)
    row_sum = q.new_empty(b, nkv, group, sq, 1)
    for r0 in range(0, sq, BLOCK_Q):
        r1 = min(r0 + BLOCK_Q, sq)
        rows = group * (r1 - r0)
        qi = _query_block(q5, r0, r1)
        m = q.new_full((b, nkv, rows, 1), _NEG_INF)
        lsum = q.new_zeros((b, nkv, rows, 1))
        acc = q.new_zeros((b, nkv, rows, dv))
        for c0 in range(0, skv, BLOCK_K):
            c1 = min(c0 + BLOCK_K, skv)
            skip, mask = masking.tile(r0, r1, c0, c1, q.device)
            if skip:
                continue
            s = _scores(qi, k[:, :, c0:c1], pse_g, mask, scale, (b, nkv, group, r1 - r0, c1 - c0), r0, r1, c0, c1)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)
            alpha = torch.exp(m - m_safe)  # 0 while the row has seen nothing (m = -inf)
            p = s.sub_(m_safe).exp_()
            lsum = lsum * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ v[:, :, c0:c1]
            m = m_new
        shape5 = (b, nkv, group, r1 - r0)
        out[:, :, :, r0:r1] = (acc / torch.where(lsum == 0, 1.0, lsum)).view(*shape5, dv)
        row_max[:, :, :, r0:r1] = m.view(*shape5, 1)
        row_sum[:, :, :, r0:r1] = lsum.view(*shape5, 1)
    return out.view(b, nq, sq, dv), row_max.view(b, nq, sq, 1), row_sum.view(b, nq, sq, 1)


def backward(q, k, v, do, pse, masking: Masking, scale: float, group: int):
    """Blockwise gradients of :func:`forward`'s output: torch's CPU flash attention backward where the forward uses
    it, else FlashAttention-2's backward (the probabilities of each tile rebuilt from the row log-sum-exp,
    ``delta = rowsum(dO * O)``). The forward is recomputed here.

    Args:
        q, k, v, pse, masking, scale, group: as for :func:`forward`.
        do: fp32 ``[B, Nq, Sq, Dv]``, the output's gradient.

    Returns:
        fp32 ``(dq [B, Nq, Sq, D], dk [B, Nkv, Skv, D], dv [B, Nkv, Skv, Dv])``, dk/dv summed over each group.
    """
    b, nq, sq, d = q.shape
    nkv, skv, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    if _flash_applies(q, v, pse, masking):  # torch's CPU flash attention forward and backward
        out, lse, k_rep, v_rep = _flash_forward(q, k, v, masking.flash_causal, scale, group)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            do, q, k_rep, v_rep, out, lse, 0.0, masking.flash_causal, scale=scale)
        if group > 1:
            dk = dk.reshape(b, nkv, group, skv, d).sum(2)
            dv = dv.reshape(b, nkv, group, skv, dv_dim).sum(2)
        return dq, dk, dv
    out, row_max, row_sum = forward(q, k, v, pse, masking, scale, group)
    # p = exp(s - lse); a fully masked row (sum 0) gets lse = +inf, hence p = 0.
    lse = torch.where(row_sum == 0, float("inf"), row_max + row_sum.log())
    delta = (do * out).sum(-1, keepdim=True)
    q5 = q.reshape(b, nkv, group, sq, d)
    do5 = do.reshape(b, nkv, group, sq, dv_dim)
    lse5 = lse.view(b, nkv, group, sq, 1)
    delta5 = delta.view(b, nkv, group, sq, 1)
    pse_g = None if pse is None else _grouped(pse, nkv, group)
    dq = q.new_empty(b, nkv, group, sq, d)
    dk = k.new_zeros(b, nkv, skv, d)
    dv = v.new_zeros(b, nkv, skv, dv_dim)
    for r0 in range(0, sq, BLOCK_Q):
        r1 = min(r0 + BLOCK_Q, sq)
        qi = _query_block(q5, r0, r1)
        doi = _query_block(do5, r0, r1)
        lse_i = _query_block(lse5, r0, r1)
        delta_i = _query_block(delta5, r0, r1)
        dqi = torch.zeros_like(qi)
        for c0 in range(0, skv, BLOCK_K):
            c1 = min(c0 + BLOCK_K, skv)
            skip, mask = masking.tile(r0, r1, c0, c1, q.device)
            if skip:
                continue
            kj, vj = k[:, :, c0:c1], v[:, :, c0:c1]
            s = _scores(qi, kj, pse_g, mask, scale, (b, nkv, group, r1 - r0, c1 - c0), r0, r1, c0, c1)
            p = s.sub_(lse_i).exp_()
            dv[:, :, c0:c1] += p.transpose(-1, -2) @ doi
            ds = (doi @ vj.transpose(-1, -2)).sub_(delta_i).mul_(p).mul_(scale)
            dqi += ds @ kj
            dk[:, :, c0:c1] += ds.transpose(-1, -2) @ qi
        dq[:, :, :, r0:r1] = dqi.view(b, nkv, group, r1 - r0, d)
    return dq.view(b, nq, sq, d), dk, dv
