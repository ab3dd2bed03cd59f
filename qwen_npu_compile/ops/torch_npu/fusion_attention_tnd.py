"""The TND (varlen) path of the simulated ``npu_fusion_attention`` / ``npu_fusion_attention_grad``.

:mod:`.fusion_attention` hands every ``input_layout="TND"`` call here. Semantics (torch_npu 2.13.0
``npu_fusion_attention`` docs and Meta kernel; CANN ops-transformer
``attention/flash_attention_score/docs/aclnnFlashAttentionVarLenScore.md``; ``docs/npu-op-contracts.md``)::

    query [Tq, Nq, D], key [Tkv, Nkv, D], value [Tkv, Nkv, Dv]
    actual_seq_qlen / actual_seq_kvlen: int lists (or tuples) of cumulative END offsets, one per sequence
    sequence b: queries actual_seq_qlen[b-1]:actual_seq_qlen[b] attend to keys actual_seq_kvlen[b-1]:[b]

computed sequence by sequence: each sequence's scores are ``[Nq, Sq_b, Skv_b]``, never ``T x T``. GQA is
native (query head h reads key/value head ``h // (Nq // Nkv)``). ``atten_mask`` None: nothing masked
(whatever ``sparse_mode``, as for the other layouts). ``sparse_mode`` 2 / 3 with the compressed 2048x2048
causal mask: per sequence left-up (``j > i`` masked) / right-down (``j > i + Skv_b - Sq_b`` masked); they
agree when Sq_b == Skv_b. Outputs: ``attention_out [Tq, Nq, Dv]`` (q's dtype), ``softmax_max`` /
``softmax_sum`` fp32 ``[Tq, Nq, 8]`` (torch_npu's Meta kernel's TND shape; the docs say ``[N, T, 8]``),
softmax_out ``[0]``, seed, offset, numels 0. The grad op returns ``(dq, dk, dv, dpse [0], dsink [0] fp32)``.

Layering: this module imports only :mod:`.attention_contract` (the limits, the softmax math);
:mod:`.fusion_attention` imports it. Limits: :func:`~.attention_contract.tnd_violation` (offsets non-decreasing here, so an empty sequence is
skipped; last == T). Not simulated
in TND (RuntimeError): dropout (``keep_prob < 1``: the real kernel's per-sequence Philox stream has no
faithful CPU counterpart), ``pse``, an explicit mask with ``sparse_mode`` 0, ``softmax_layout``, and
everything the other layouts refuse (``padding_mask``, ``prefix``, ``sink``, ``dropout_mask``).
``pre_tockens``/``next_tockens`` have no effect (no mode-0 mask, and modes 2/3 ignore them).
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops import attention_contract as contract
from qwen_npu_compile.ops.attention_contract import tnd_violation

_UNSIMULATED = ("prefix", "sink", "dropout_mask", "pse")


def check_call(op: str, query, key, value, head_num: int, *, atten_mask=None, keep_prob: float = 1.0,
               inner_precise: int = 0, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode: int = 0,
               softmax_layout: str = "", padding_mask=None, **unsimulated) -> tuple[list, list, int]:
    """Validate a TND call of ``op``; returns ``(q_ends, kv_ends, effective sparse_mode)`` (0 without a mask).

    Raises:
        RuntimeError: naming the argument or limit (:func:`~.attention_contract.tnd_violation`) that fails.
    """
    if padding_mask is not None:
        raise RuntimeError(f"{op}: padding_mask is not supported (torch_npu 2.13.0 docs)")
    for name in _UNSIMULATED:
        if unsimulated.get(name) is not None:
            raise RuntimeError(f"{op}: argument {name!r} is not simulated by the CPU stand-in in TND (pass None)")
    if softmax_layout != "":
        raise RuntimeError(f"{op}: softmax_layout={softmax_layout!r} is not simulated by the CPU stand-in (pass '')")
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise RuntimeError(f"{op}: input_layout 'TND' needs actual_seq_qlen and actual_seq_kvlen (cumulative end "
                           "offsets of the packed sequences, e.g. cu_seqlens[1:].tolist())")
    if keep_prob != 1.0:
        raise RuntimeError(f"{op}: keep_prob={keep_prob} (dropout) in TND is not simulated by the CPU stand-in; "
                           "pass keep_prob=1.0 (attention_dropout=0)")
    if inner_precise not in contract.SUPPORTED_INNER_PRECISE:
        raise RuntimeError(f"{op}: inner_precise={inner_precise} not in {contract.SUPPORTED_INNER_PRECISE}")
    if sparse_mode not in contract.SUPPORTED_SPARSE_MODES:
        raise RuntimeError(f"{op}: sparse_mode={sparse_mode} is not simulated (supported: {contract.SUPPORTED_SPARSE_MODES})")
    if atten_mask is not None:
        if sparse_mode not in contract.COMPRESSED_MASK_MODES:
            raise RuntimeError(f"{op}: TND with sparse_mode={sparse_mode} and an explicit atten_mask is not simulated; "
                               "pass the compressed causal mask with sparse_mode 2/3, or no mask")
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError(f"{op}: atten_mask must be bool or uint8 (True = masked out), got {atten_mask.dtype}")
        n = contract.COMPRESSED_MASK_SIZE
        if tuple(atten_mask.shape) != (n, n):
            raise RuntimeError(f"{op}: sparse_mode={sparse_mode} takes the compressed {n}x{n} causal mask "
                               f"(torch.triu(torch.ones({n}, {n}), diagonal=1).bool()), got shape {tuple(atten_mask.shape)}")
    mode = sparse_mode if atten_mask is not None else 0
    q_ends, kv_ends = list(actual_seq_qlen), list(actual_seq_kvlen)
    reason = tnd_violation(query, key, value, head_num, q_ends, kv_ends, sparse_mode=mode, strict=False)
    if reason is None and len(q_ends) != len(kv_ends):
        reason = (f"actual_seq_qlen has {len(q_ends)} sequences, actual_seq_kvlen {len(kv_ends)}; they must describe "
                  "the same sequences")
    if reason is not None:
        raise RuntimeError(f"{op}: {reason}")
    return q_ends, kv_ends, mode


def _check_mask_values(op: str, atten_mask) -> None:
    if atten_mask is None:
        return
    expected = contract._cpu_compressed_causal_mask() if atten_mask.device.type == "cpu" else contract.compressed_causal_mask(atten_mask.device)
    if not torch.equal(atten_mask.bool(), expected):
        raise RuntimeError(f"{op}: the compressed causal mask must be torch.triu(torch.ones(2048, 2048), "
                           "diagonal=1).bool(); got another 2048x2048 mask")


def _segments(q_ends, kv_ends):
    """``(q_start, q_end, kv_start, kv_end)`` of every sequence with queries."""
    q_start = kv_start = 0
    for q_end, kv_end in zip(q_ends, kv_ends):
        if q_end > q_start:
            yield q_start, q_end, kv_start, kv_end
        q_start, kv_start = q_end, kv_end


def _causal(mode: int, sq: int, skv: int, device) -> torch.Tensor | None:
    """[Sq, Skv] bool, True = masked, of one sequence; None for mode 0 (no mask)."""
    if mode == 0:
        return None
    i = torch.arange(sq, device=device).unsqueeze(-1)
    j = torch.arange(skv, device=device)
    return j > i + (0 if mode == 2 else skv - sq)


def _heads_first(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``t[start:end]`` ``[S, N, D]`` -> fp32 ``[1, N, S, D]``."""
    return t[start:end].transpose(0, 1).unsqueeze(0).float()


def forward(query, key, value, head_num, *, scale=1.0, **options):
    """``npu_fusion_attention`` in TND (module docstring); ``options`` are the op's other arguments."""
    op = "npu_fusion_attention"
    q_ends, kv_ends, mode = check_call(op, query, key, value, head_num, **options)
    _check_mask_values(op, options.get("atten_mask"))
    nq, nkv = query.shape[1], key.shape[1]
    group = nq // nkv
    tokens = query.shape[0]
    out = query.new_empty((tokens, nq, value.shape[2]))
    row_max = torch.full((tokens, nq), float("-inf"), dtype=torch.float32, device=query.device)
    row_sum = torch.zeros((tokens, nq), dtype=torch.float32, device=query.device)
    for qs, qe, ks, ke in _segments(q_ends, kv_ends):
        q, k, v = _heads_first(query, qs, qe), _heads_first(key, ks, ke), _heads_first(value, ks, ke)
        p, seg_max, seg_sum = contract._probabilities(q, k, None, _causal(mode, qe - qs, ke - ks, query.device), scale, group)
        out[qs:qe] = contract.weighted_values(p, v, group)[0].transpose(0, 1).to(query.dtype)
        row_max[qs:qe] = seg_max[0, :, :, 0].transpose(0, 1)
        row_sum[qs:qe] = seg_sum[0, :, :, 0].transpose(0, 1)
    stat_shape = (tokens, nq, contract.SOFTMAX_STAT_WIDTH)
    softmax_max = row_max.unsqueeze(-1).expand(stat_shape).contiguous()
    softmax_sum = row_sum.unsqueeze(-1).expand(stat_shape).contiguous()
    return out, softmax_max, softmax_sum, query.new_empty([0]), options.get("seed", 0), options.get("offset", 0), 0


def grad(query, key, value, dy, head_num, *, scale_value=1.0, **options):
    """``npu_fusion_attention_grad`` in TND: recomputes the probabilities per sequence (softmax_max/sum,
    softmax_in, attention_in, numels, seed/offset are accepted and ignored)."""
    op = "npu_fusion_attention_grad"
    for ignored in ("softmax_max", "softmax_sum", "softmax_in", "attention_in", "numels", "seed", "offset"):
        options.pop(ignored, None)
    q_ends, kv_ends, mode = check_call(op, query, key, value, head_num, **options)
    _check_dy(op, query, value, dy)
    _check_mask_values(op, options.get("atten_mask"))
    group = query.shape[1] // key.shape[1]
    dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    dk = torch.zeros(key.shape, dtype=torch.float32, device=query.device)
    dv = torch.zeros(value.shape, dtype=torch.float32, device=query.device)
    for qs, qe, ks, ke in _segments(q_ends, kv_ends):
        q, k, v = _heads_first(query, qs, qe), _heads_first(key, ks, ke), _heads_first(value, ks, ke)
        do = _heads_first(dy, qs, qe)
        p, _, _ = contract._probabilities(q, k, None, _causal(mode, qe - qs, ke - ks, query.device), scale_value, group)
        dq_seg, dk_seg, dv_seg = contract.probability_grads(q, k, v, do, p, scale_value, group)
        dq[qs:qe] = dq_seg[0].transpose(0, 1)
        dk[ks:ke] += dk_seg[0].transpose(0, 1)
        dv[ks:ke] += dv_seg[0].transpose(0, 1)
    dtype = query.dtype
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), query.new_empty([0]), query.new_zeros([0], dtype=torch.float32)


def _check_dy(op, query, value, dy) -> None:
    expected = [query.shape[0], query.shape[1], value.shape[2]]
    if dy.dim() != 3 or not all(contract._holds(a == b) for a, b in zip(dy.shape, expected)):
        raise RuntimeError(f"{op}: dy shape {tuple(dy.shape)} != attention_out shape {tuple(expected)}")


def fake_forward(query, key, value, head_num, *, scale=1.0, **options):
    """Fake kernel of the TND forward: shapes only (T may be symbolic)."""
    check_call("npu_fusion_attention", query, key, value, head_num, **options)
    tokens, nq = query.shape[0], query.shape[1]
    stat_shape = (tokens, nq, contract.SOFTMAX_STAT_WIDTH)
    return (
        query.new_empty((tokens, nq, value.shape[2])),
        query.new_empty(stat_shape, dtype=torch.float32),
        query.new_empty(stat_shape, dtype=torch.float32),
        query.new_empty([0]),
        options.get("seed", 0),
        options.get("offset", 0),
        0,
    )


def fake_grad(query, key, value, dy, head_num, *, scale_value=1.0, **options):
    """Fake kernel of the TND grad."""
    op = "npu_fusion_attention_grad"
    for ignored in ("softmax_max", "softmax_sum", "softmax_in", "attention_in", "numels", "seed", "offset"):
        options.pop(ignored, None)
    check_call(op, query, key, value, head_num, **options)
    _check_dy(op, query, value, dy)
    return (query.new_empty(query.shape), query.new_empty(key.shape), query.new_empty(value.shape),
            query.new_empty([0]), query.new_empty([0], dtype=torch.float32))


def call_violation(query, key, value, head_num, *, atten_mask=None, sparse_mode=0, keep_prob=1.0, softmax_layout="",
                   sink=None, actual_seq_qlen=None, actual_seq_kvlen=None, downstream=None) -> str | None:
    """:func:`~.fusion_attention.call_violation` of a TND call: the kernel's limits, then, for
    ``downstream="torchair"``, torchair's own converter, which refuses TND (emit ``qwen_npu::varlen_attention``,
    which this project converts, instead)."""
    try:
        check_call("npu_fusion_attention", query, key, value, head_num, atten_mask=atten_mask, sparse_mode=sparse_mode,
                   keep_prob=keep_prob, softmax_layout=softmax_layout, sink=sink,
                   actual_seq_qlen=actual_seq_qlen if actual_seq_qlen is not None else [query.shape[0]],
                   actual_seq_kvlen=actual_seq_kvlen if actual_seq_kvlen is not None else [key.shape[0]])
    except RuntimeError as exc:
        return str(exc)
    if downstream == "torchair":
        return (f"input_layout 'TND': the {contract.GE_CONVERTER} takes {'/'.join(contract.GE_LAYOUTS)} only; "
                "qwen_npu::varlen_attention carries varlen attention to GE")
    return None
