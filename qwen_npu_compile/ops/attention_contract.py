"""The contract of Ascend's flash-attention kernel that every attention op module shares: the bottom of the
attention ops, importing nothing of the package but :mod:`..compat`.

``ops/`` layers its attention modules one way::

    attention_contract           schemas, limits (dense, TND, varlen), the compressed causal mask, the softmax math
      ^            ^
    fusion_attention_tnd      varlen_attention      (TND stand-in path; qwen_npu::varlen_attention)
      ^
    fusion_attention             the npu_fusion_attention(_grad) stand-ins (BNSD/BSND/BSH/SBH; TND handed down)

Semantics and sources: :mod:`.torch_npu.fusion_attention` (dense layouts), :mod:`.torch_npu.fusion_attention_tnd`
(TND) and :mod:`.qwen_npu.varlen_attention` (the varlen op). Each limit has one home here: :func:`fusion_attention_violation`
(every layout), :func:`tnd_violation` (TND offsets) and :func:`varlen_violation` (the varlen op); the modules
above re-export what they re-exported before.
"""

from __future__ import annotations

import functools

import torch

from qwen_npu_compile.compat import guard_or_false

FUSION_ATTENTION_SCHEMA = (
    "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
    "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
    "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
    "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None, '
    "Tensor? dropout_mask=None, int seed=0, int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
)
FUSION_ATTENTION_GRAD_SCHEMA = (
    "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
    "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
    "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, "
    "float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
    "int inner_precise=0, int seed=0, int offset=0, int numels=0, int[]? prefix=None, "
    "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
    'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None) '
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
#: q/k/v dtypes the kernel takes (all three equal).
SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
#: Layouts the torchair GE converter accepts (and only with keep_prob == 1).
GE_LAYOUTS = ("BSH", "BNSD")
#: sparse_mode values simulated: 0 defaultMask, 2 leftUpCausal, 3 rightDownCausal.
SUPPORTED_SPARSE_MODES = (0, 2, 3)
#: sparse_mode values that take the compressed causal mask instead of a full one.
COMPRESSED_MASK_MODES = (2, 3)
#: Side of the compressed causal mask that modes 2/3 take, whatever the real sequence lengths.
COMPRESSED_MASK_SIZE = 2048
#: The real op accepts inner_precise 0..3 (0/1 reserved, 2 = compute fully masked rows correctly).
SUPPORTED_INNER_PRECISE = (0, 1, 2, 3)
#: Dq == Dk must lie in 1..MAX_HEAD_DIM (A2 docs); Dv <= Dk.
MAX_HEAD_DIM = 768
#: Nq must lie in 1..MAX_QUERY_HEADS (A2 docs).
MAX_QUERY_HEADS = 256
#: Default pre_tockens / next_tockens: no band.
NO_BAND = 2147483647
#: Last dim of softmax_max / softmax_sum (the row value repeated), as torch_npu's Meta kernel returns.
SOFTMAX_STAT_WIDTH = 8
#: q/k/v dtypes torchair's GE op FlashAttentionScore(Grad) takes (its REG_OP, torchair
#: ``_ge_concrete_graph/auto_generated_ge_raw_ops.py``): fp32 is refused there, though the aclnn kernel
#: behind eager ``torch_npu.npu_fusion_attention`` takes it.
GE_DTYPES = frozenset({torch.float16, torch.bfloat16})
#: Where the GE limits come from (named in every refusal they cause).
GE_CONVERTER = (
    "torchair GE converter of npu_fusion_attention (torch_npu 2.13.0/2.9.0 "
    "ge_converter/custom/npu_fusion_attention.py, FlashAttentionScore)"
)


# --------------------------------------------------------------------------------------------------
# limits of npu_fusion_attention (every layout)


def _holds(condition) -> bool:
    """A size condition, symbolic sizes included: decided on this graph's sizes, with a guard."""
    return guard_or_false(condition)


def fusion_attention_violation(
    query_bnsd: tuple,
    key_bnsd: tuple,
    value_bnsd: tuple,
    dtypes: tuple,
    *,
    input_layout: str,
    head_num: int | None = None,
    mask_shape: tuple | None = None,
    sparse_mode: int = 0,
    keep_prob: float = 1.0,
    downstream: str | None = None,
) -> str | None:
    """Why ``npu_fusion_attention`` (and its grad) would refuse these arguments, or None: the one home of
    this op's limits, used by the stand-in's validation, ``patterns/attention/dense.py`` and the GE conversion
    check.

    Kernel limits (torch_npu 2.13.0 ``_op_plugin_docs.py``, the op-plugin page
    ``torch_npu-npu_fusion_attention.md``; ``docs/npu-op-contracts.md``): one q/k/v dtype in fp16/bf16/fp32;
    one batch; k and v of one head count and length; Dq == Dk, 1 <= Dv <= Dk <= :data:`MAX_HEAD_DIM`;
    ``head_num`` == Nq <= :data:`MAX_QUERY_HEADS`, Nq % Nkv == 0 (native GQA); ``atten_mask`` BNSS / B1SS /
    11SS / SS (or the compressed 2048x2048 mask for sparse modes 2/3); keep_prob in (0, 1].

    With ``downstream="torchair"`` also the GE converter's (:data:`GE_CONVERTER`): layout BSH or BNSD only
    and keep_prob == 1 only (else NotImplementedError), and the GE op's q/k/v dtypes :data:`GE_DTYPES`.

    Args:
        query_bnsd: q's ``(B, Nq, Sq, D)`` (sizes may be symbolic), whatever the layout.
        key_bnsd: k's ``(B, Nkv, Skv, Dk)``.
        value_bnsd: v's ``(B, Nkv, Skv, Dv)``.
        dtypes: ``(q.dtype, k.dtype, v.dtype)``.
        input_layout: the layout passed to the op.
        head_num: the op's ``head_num`` argument, None when it is Nq by construction.
        mask_shape: ``atten_mask``'s shape, None without a mask.
        sparse_mode: the op's ``sparse_mode``.
        keep_prob: the op's ``keep_prob``.
        downstream: the backend the graph is handed to; ``"torchair"`` adds the GE limits.

    Returns:
        None when supported, else a one-line reason.
    """
    dtype = dtypes[0]
    if not all(d == dtype for d in dtypes):
        return f"dtype mismatch: query/key/value dtypes differ ({', '.join(map(str, dtypes))}); the kernel takes one dtype"
    if dtype not in SUPPORTED_DTYPES:
        return f"unsupported dtype {dtype}; npu_fusion_attention takes fp16, bf16, fp32"
    batch, q_heads, q_len, head_dim = query_bnsd
    kv_batch, kv_heads, kv_len, key_dim = key_bnsd
    v_batch, v_heads, v_len, value_dim = value_bnsd
    if not (_holds(kv_batch == batch) and _holds(v_batch == batch)):
        return f"batch sizes differ: query {batch}, key {kv_batch}, value {v_batch}"
    if not (_holds(v_heads == kv_heads) and _holds(v_len == kv_len)):
        return f"key (N={kv_heads}, S={kv_len}) and value (N={v_heads}, S={v_len}) differ in heads or length"
    if not _holds(key_dim == head_dim):
        return f"query head dim {head_dim} != key head dim {key_dim}"
    if not (_holds(1 <= value_dim) and _holds(value_dim <= head_dim) and _holds(head_dim <= MAX_HEAD_DIM)):
        return f"head dims D={head_dim}, Dv={value_dim}: npu_fusion_attention needs 1 <= Dv <= D <= {MAX_HEAD_DIM}"
    if head_num is not None and not _holds(q_heads == head_num):
        return f"head_num={head_num} != query's head count {q_heads} ({input_layout})"
    if not _holds(q_heads <= MAX_QUERY_HEADS):
        return f"Nq={q_heads} query heads > {MAX_QUERY_HEADS}"
    if not (_holds(kv_heads >= 1) and _holds(q_heads % kv_heads == 0)):
        return f"Nq={q_heads} is not a multiple of Nkv={kv_heads}; npu_fusion_attention's GQA needs Nq % Nkv == 0"
    if mask_shape is not None:
        reason = _mask_shape_violation(tuple(mask_shape), sparse_mode, batch, q_heads, q_len, kv_len)
        if reason is not None:
            return reason
    if not 0.0 < keep_prob <= 1.0:
        return f"keep_prob={keep_prob} must lie in (0, 1]"
    if downstream == "torchair":
        if input_layout not in GE_LAYOUTS:
            return f"input_layout {input_layout!r}: the {GE_CONVERTER} takes {'/'.join(GE_LAYOUTS)} only"
        if keep_prob != 1.0:
            return (
                f"keep_prob {keep_prob:g}: the {GE_CONVERTER} takes keep_prob == 1 only (NotImplementedError in GE "
                "mode); train without attention dropout or use another downstream"
            )
        if dtype not in GE_DTYPES:
            return (
                f"dtype {dtype}: the {GE_CONVERTER} emits the GE op FlashAttentionScore, whose q/k/v are fp16/bf16 "
                "only (the eager aclnn kernel takes fp32, GE does not); compute attention in bf16/fp16"
            )
    return None


def _mask_shape_violation(shape: tuple, sparse_mode: int, batch, heads, q_len, kv_len) -> str | None:
    if sparse_mode in COMPRESSED_MASK_MODES:
        n = COMPRESSED_MASK_SIZE
        if shape != (n, n):
            return (
                f"sparse_mode={sparse_mode} takes the compressed {n}x{n} causal mask "
                f"(torch.triu(torch.ones({n}, {n}), diagonal=1).bool()), got shape {shape}"
            )
        return None
    if len(shape) == 2:
        lead_ok = True
    elif len(shape) == 4:
        # BNSS, B1SS, 11SS (a 1NSS mask is not in the list)
        lead_ok = (_holds(shape[0] == 1) or _holds(shape[0] == batch)) and (
            _holds(shape[1] == 1) or (_holds(shape[1] == heads) and _holds(shape[0] == batch))
        )
    else:
        lead_ok = False
    if not (lead_ok and _holds(shape[-2] == q_len) and _holds(shape[-1] == kv_len)):
        return (
            f"attention mask shape {shape} is none of BNSS/B1SS/11SS/SS for B={batch}, N={heads}, "
            f"Sq={q_len}, Skv={kv_len} (npu_fusion_attention does not broadcast masks)"
        )
    return None


# --------------------------------------------------------------------------------------------------
# the compressed causal mask and the softmax math


def compressed_causal_mask(device: torch.device | str | None = None) -> torch.Tensor:
    """The compressed causal mask sparse modes 2/3 take: ``torch.triu(ones(2048, 2048), diagonal=1).bool()``.

    Args:
        device: where to build it.

    Returns:
        A ``[2048, 2048]`` bool tensor, True above the diagonal (True = masked out).
    """
    n = COMPRESSED_MASK_SIZE
    return torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)


@functools.cache
def _cpu_compressed_causal_mask() -> torch.Tensor:
    return compressed_causal_mask("cpu")


def compressed_mask_shift(atten_mask: torch.Tensor, sparse_mode: int, sq: int, skv: int) -> int:
    """For ``sparse_mode`` 2 / 3 (:data:`COMPRESSED_MASK_MODES`): the causal shift ``s`` (key ``j`` masked for
    query ``i`` when ``j > i + s``): 0 for mode 2 (left-up), ``Skv - Sq`` for mode 3 (right-down).

    Raises:
        RuntimeError: ``atten_mask`` is not the compressed 2048x2048 causal mask these modes require (torch_npu
            2.13.0 npu_fusion_attention docs), as the real op fails.
    """
    if not torch.equal(atten_mask.bool(), _cpu_compressed_causal_mask().to(atten_mask.device)):
        raise RuntimeError(
            f"npu_fusion_attention: sparse_mode={sparse_mode} needs the compressed causal mask "
            "torch.triu(torch.ones(2048, 2048), diagonal=1).bool(); got another 2048x2048 mask"
        )
    return 0 if sparse_mode == 2 else skv - sq


def _probabilities(q, k, pse, masked, scale, group):
    """fp32 [B, Nq, Sq, Skv] softmax probabilities (0 on fully masked rows), row max and row sum."""
    k = k.repeat_interleave(group, dim=1) if group > 1 else k
    scores = q @ k.transpose(-1, -2)
    if pse is not None:
        scores = scores + pse.float()
    scores = scores * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    safe_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    e = torch.exp(scores - safe_max)
    row_sum = e.sum(-1, keepdim=True)
    p = e / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    return p, row_max, row_sum


def weighted_values(p: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """``p @ v`` in BNSD fp32 with the key/value heads repeated over each GQA group of ``group`` query heads."""
    v = v.repeat_interleave(group, dim=1) if group > 1 else v
    return p @ v


def probability_grads(q, k, v, do, p, scale, group: int, keep=None):
    """fp32 BNSD gradients of ``out = (p * keep) @ v`` with ``p = softmax(scale * q @ k^T)`` (GQA native).

    Args:
        q, k, v: fp32 ``[B, Nq, Sq, D]``, ``[B, Nkv, Skv, D]``, ``[B, Nkv, Skv, Dv]``.
        do: the output's gradient, fp32 ``[B, Nq, Sq, Dv]``.
        p: the probabilities (:func:`_probabilities`), before dropout.
        scale: the forward's scale.
        group: Nq // Nkv.
        keep: the dropout keep mask already divided by keep_prob, or None without dropout.

    Returns:
        ``(dq [B, Nq, Sq, D], dk [B, Nkv, Skv, D], dv [B, Nkv, Skv, Dv])``, dk/dv summed over each group.
    """
    b, nkv, skv, d = k.shape
    k_rep = k.repeat_interleave(group, dim=1) if group > 1 else k
    v_rep = v.repeat_interleave(group, dim=1) if group > 1 else v
    p_drop = p * keep if keep is not None else p
    dv = p_drop.transpose(-1, -2) @ do  # [B, Nq, Skv, Dv]
    dp = do @ v_rep.transpose(-1, -2)  # [B, Nq, Sq, Skv]
    if keep is not None:
        dp = dp * keep
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
    dq = ds @ k_rep
    dk = ds.transpose(-1, -2) @ q
    if group > 1:
        dk = dk.reshape(b, nkv, group, skv, d).sum(2)
        dv = dv.reshape(b, nkv, group, skv, dv.shape[-1]).sum(2)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# limits of TND and the varlen op

#: At most this many tokens T (query and key) per call: 1M (aclnnFlashAttentionVarLenScore.md, CANN
#: ops-transformer ``attention/flash_attention_score/docs``; ``docs/npu-op-contracts.md``, "The varlen (TND) form").
MAX_TOKENS = 2**20
#: At most this many sequences (``len(actual_seq_qlen)``, 1..2K) per call (same sources).
MAX_SEGMENTS = 2048
#: sparse_mode values of the varlen op: 0 no mask (non-causal), 2 left-up causal, 3 right-down causal.
SPARSE_MODES = (0, 2, 3)
#: Where the limits come from (named in refusals).
VARLEN_SOURCE = (
    "the varlen kernel (aclnnFlashAttentionVarLenScore.md; torch_npu 2.13.0 npu_fusion_attention TND; "
    "CANN ops-transformer attention/flash_attention_score)"
)


def _known_ends(ends) -> list[int] | None:
    """The offsets' values when they can be read without tracing: a plain tensor (not fake/meta; a device
    tensor costs one copy to the host), or a list/tuple of Python ints. None otherwise (symbolic)."""
    if isinstance(ends, torch.Tensor):
        if type(ends) is not torch.Tensor or ends.is_meta:
            return None  # FakeTensor, FunctionalTensor, ...: values unknown while tracing
        return [int(e) for e in ends.tolist()]
    if all(type(e) is int for e in ends):
        return list(ends)
    return None


def _ends_tensor_violation(ends: torch.Tensor, name: str = "seq_ends") -> str | None:
    if ends.dtype != torch.int64 or ends.dim() != 1:
        return f"{name} must be a 1-D int64 tensor of cumulative end offsets, got {ends.dtype}{list(ends.shape)}"
    return None


def offsets_violation(ends, total, *, name: str = "seq_ends", strict: bool = True) -> str | None:
    """Why ``ends`` are not valid cumulative end offsets of packed sequences over ``total`` tokens, or None.

    Limits (:data:`VARLEN_SOURCE`; CANN >= 9.0 validates that the offsets end at T, vllm-ascend #10956):
    1 to :data:`MAX_SEGMENTS` entries; non-decreasing (``strict``: strictly increasing, i.e. no empty
    sequence) and non-negative; the last one == ``total``. A tensor must be 1-D int64. Values are checked
    only when known (:func:`_known_ends`); the count only when it is not an unbacked size.

    Args:
        ends: an int64 tensor ``[B]`` (maybe fake, maybe of unbacked length) or a sequence of ints.
        total: T, the token count (int or SymInt).
        name: how the offsets are called in the message.
        strict: require strictly increasing offsets.
    """
    if isinstance(ends, torch.Tensor):
        reason = _ends_tensor_violation(ends, name)
        if reason is not None:
            return reason
        count = ends.shape[0]
    else:
        count = len(ends)
    if _holds(count < 1):
        return f"{name} is empty; the varlen kernel needs 1 to {MAX_SEGMENTS} sequences"
    if _holds(count > MAX_SEGMENTS):
        return (f"{count} sequences > {MAX_SEGMENTS}, the most {VARLEN_SOURCE} takes per call; split the "
                "micro-batch")
    values = _known_ends(ends)
    if values is None:
        return None
    previous = 0
    for i, end in enumerate(values):
        if end < previous or (strict and end == previous):
            order = "strictly increasing" if strict else "non-decreasing"
            return (f"{name} must be {order} cumulative end offsets starting above 0; entry {i} is {end} after "
                    f"{previous} ({values[:8]}{'...' if len(values) > 8 else ''})")
        previous = end
    if not guard_or_false(previous == total):
        return (f"{name} ends at {previous}, not at T={total}: the offsets must cover every token (CANN >= 9.0 "
                "refuses offsets that do not end at T, vllm-ascend #10956); pack the padding as a sequence of its own")
    return None


def tnd_violation(
    query,
    key,
    value,
    head_num: int | None,
    q_ends=None,
    kv_ends=None,
    *,
    sparse_mode: int = 3,
    strict: bool = True,
    downstream: str | None = None,
) -> str | None:
    """Why ``npu_fusion_attention`` in TND would refuse these arguments, or None: :func:`varlen_violation`
    for separate query / key offsets (the stand-in's and any TND call's check).

    Adds to :func:`varlen_violation`: ``q_ends`` and ``kv_ends`` of one length, each checked by
    :func:`offsets_violation` against its own T; mode 3 needs Sq <= Skv in every sequence (the varlen docs),
    which also rules out fully masked rows; a sequence with Sq > 0 and Skv == 0 is refused (its rows would
    be fully masked, which the varlen kernel does not support).
    """
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "query, key and value must be tensors"
    if not all(t.dim() == 3 for t in tensors):
        return (f"TND needs 3-D query/key/value [T, N, D], got {[list(t.shape) for t in tensors]}; view "
                "[1, T, N, D] as [T, N, D]")
    (t_q, nq, d), (t_kv, nkv, dk), (t_v, nv, dv) = query.shape, key.shape, value.shape
    reason = fusion_attention_violation(
        (1, nq, t_q, d), (1, nkv, t_kv, dk), (1, nv, t_v, dv), (query.dtype, key.dtype, value.dtype),
        input_layout="TND", head_num=head_num,
    )
    if reason is not None:
        return reason
    if not (guard_or_false(t_q <= MAX_TOKENS) and guard_or_false(t_kv <= MAX_TOKENS)):
        return (f"T={t_q} query / {t_kv} key tokens > {MAX_TOKENS} (2**20), the most {VARLEN_SOURCE} takes; "
                "split the micro-batch")
    if sparse_mode not in SPARSE_MODES:
        return f"sparse_mode={sparse_mode}: varlen attention takes {SPARSE_MODES} (0 none, 2 left-up, 3 right-down causal)"
    for name, ends, total in (("actual_seq_qlen", q_ends, t_q), ("actual_seq_kvlen", kv_ends, t_kv)):
        if ends is None:
            continue
        reason = offsets_violation(ends, total, name=name, strict=strict)
        if reason is not None:
            return reason
    if q_ends is not None and kv_ends is not None and q_ends is not kv_ends:
        q_values, kv_values = _known_ends(q_ends), _known_ends(kv_ends)
        if q_values is not None and kv_values is not None:
            if len(q_values) != len(kv_values):
                return (f"actual_seq_qlen has {len(q_values)} sequences, actual_seq_kvlen {len(kv_values)}; "
                        "they must describe the same sequences")
            q_starts, kv_starts = [0, *q_values[:-1]], [0, *kv_values[:-1]]
            for i, (qs, qe, ks, ke) in enumerate(zip(q_starts, q_values, kv_starts, kv_values)):
                sq, skv = qe - qs, ke - ks
                if sq > 0 and skv == 0:
                    return f"sequence {i} has Sq={sq} queries and no keys: its rows would be fully masked"
                if sparse_mode == 3 and sq > skv:
                    return (f"sequence {i}: Sq={sq} > Skv={skv}; sparse_mode 3 (right-down causal) needs Sq <= Skv "
                            "in every sequence (varlen docs)")
    if downstream == "torchair" and query.dtype not in GE_DTYPES:
        return (f"dtype {query.dtype}: GE's FlashAttentionScore takes fp16/bf16 q/k/v only (torchair "
                "auto_generated_ge_raw_ops.py); compute attention in bf16/fp16")
    return None


def varlen_violation(
    query,
    key,
    value,
    seq_ends=None,
    head_num: int | None = None,
    *,
    sparse_mode: int = 3,
    downstream: str | None = None,
) -> str | None:
    """Why ``varlen_attention(query, key, value, seq_ends, head_num, ...)`` would fail, or None: THE one home
    of the varlen kernel's limits, used by this op's kernels and fake kernels, the stand-in's TND path, the
    patterns that emit the op and the GE conversion check.

    Limits (:data:`VARLEN_SOURCE`: ``aclnnFlashAttentionVarLenScore.md``; torch_npu 2.13.0
    ``npu_fusion_attention`` docs; ``docs/npu-op-contracts.md``):

    - q/k/v 3-D TND of one dtype in fp16/bf16/fp32; k and v of one T and head count, q's T == k's T
      (self-attention: one ``seq_ends`` for both);
    - T <= :data:`MAX_TOKENS` (1M); Nq == ``head_num`` <= 256 (``MAX_QUERY_HEADS``), Nq % Nkv == 0 (GQA);
      1 <= Dv <= D <= 768 (``MAX_HEAD_DIM``, as for the dense layouts);
    - ``sparse_mode`` in :data:`SPARSE_MODES`;
    - ``seq_ends`` (when given) 1-D int64 with 1 to :data:`MAX_SEGMENTS` (2K) entries (the count unless
      it is an unbacked size), strictly increasing, last == T (CANN >= 9.0) when its values are known
      (a plain tensor, read on the host);
    - ``downstream="torchair"``: q/k/v fp16/bf16 (``GE_DTYPES``: GE's FlashAttentionScore refuses fp32).

    Args:
        query: ``[T, Nq, D]`` tensor or FakeTensor (T may be symbolic).
        key: ``[T, Nkv, D]``.
        value: ``[T, Nkv, Dv]``.
        seq_ends: int64 ``[B]`` cumulative end offsets, or None to check the tensors only.
        head_num: the op's ``head_num`` (None: Nq).
        sparse_mode: the op's ``sparse_mode``.
        downstream: the backend the graph is handed to; ``"torchair"`` adds the GE limits.

    Returns:
        None when supported, else a one-line reason.
    """
    if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == 3 and key.dim() == 3:
        if not guard_or_false(query.shape[0] == key.shape[0]):
            return (f"query has {query.shape[0]} tokens, key {key.shape[0]}: varlen_attention is self-attention "
                    "over one packing (one seq_ends for both)")
    return tnd_violation(query, key, value, head_num, seq_ends, seq_ends, sparse_mode=sparse_mode,
                         downstream=downstream)
