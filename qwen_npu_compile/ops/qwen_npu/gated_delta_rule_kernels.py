"""Which kernel runs ``qwen_npu::chunk_gated_delta_rule`` on an Ascend host, and every limit of each (the one place).

The op (:mod:`.gated_delta_rule`) has three kernels on a ``PrivateUse1`` ("npu") tensor; :func:`select` picks one
per call and says why:

==================  =====================================================  ===========================================
kernel              used for                                               contract (checked here)
==================  =====================================================  ===========================================
``fla``             training (forward and backward) and no-grad forwards,  :func:`fla_unavailable` (FLA >= 0.5.2
                    where FLA is importable and inside its contract        importable, its entry taking the keywords
                                                                           passed, its triton-ascend backend active)
                                                                           and :func:`fla_violation`
``torch_npu``       no-grad forwards only (torch_npu's op is               :func:`npu_forward_violation` (the whole
                    inference-only), where FLA is not the kernel           documented contract)
``reference``       everything else (the op's ATen reference, fp32,        none (the op's own
                    backward by autograd)                                  :func:`~.gated_delta_rule.violation`)
==================  =====================================================  ===========================================

Training uses one kernel family for forward and backward: the op's training forward (``training=True``, set by its
autograd) never runs torch_npu's inference op; with FLA, the forward is FLA's and the backward recomputes FLA's
forward under autograd through FLA's public entry and takes ``torch.autograd.grad`` of it (FLA's own backward,
``ChunkGatedDeltaRuleFunction.backward``, stable across releases where its internal ``chunk_gated_delta_rule_bwd``
is not). Where FLA cannot be used, one WARNING per process names what to install (:data:`FLA_INSTALL`); outside
a contract, one INFO line per distinct reason says why the reference (or FLA instead of torch_npu) runs.

Sources: FLA 0.5.2 and 0.6.0 (the ``fla-core`` wheels; every limit below is the same in both):
``fla/ops/gated_delta_rule/chunk.py`` ``chunk_gated_delta_rule`` (entry, ``[B, T, H, K]``, ``cu_seqlens`` LongTensor
``[N + 1]`` with ``B == 1``; 0.6.0 adds the keyword ``chunk_indices``, not passed here: :func:`fla_arguments`),
``fla/ops/common/chunk_delta_h.py`` (``K <= 256``), ``fla/ops/gated_delta_rule/backends/triton_ascend`` (dtypes
fp32/fp16/bf16, NPU tensors), ``fla.utils.IS_NPU`` (0.5.2 ``fla/utils/_device.py``, 0.6.0 ``fla/utils/hardware.py``:
triton's active driver is triton-ascend's). torch_npu 2.13.0 / 2.14.0 ``_op_plugin_docs.py``
``npu_chunk_gated_delta_rule`` (the same text in both).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging

import torch

log = logging.getLogger("qwen_npu_compile")

#: The device type of an Ascend tensor (torch_npu renames PrivateUse1 to it).
DEVICE_TYPE = "npu"

#: The L2 norm's epsilon inside the kernels (transformers' ``l2norm``, FLA's ``l2norm_fwd``).
L2NORM_EPS = 1e-6

# --------------------------------------------------------------------------------------------------
# FLA (training and no-grad)

#: The first FLA release with a triton-ascend Gated DeltaNet backend (FLA PR #1011, 0.5.2).
FLA_MIN_VERSION = (0, 5, 2)

#: The FLA releases this binding was read against and tested with (stand-in signatures, the op against 0.6.0's
#: ``naive_recurrent_gated_delta_rule``): 0.5.2 and 0.6.0. A later release is used where :func:`fla_unavailable`
#: finds its entry still taking :data:`FLA_KEYWORDS`; the install hint and the ``[npu]`` extra stay below 0.7.
FLA_VERSIONS = ">=0.5.2,<0.7"

#: What to install on an Ascend host for a trainable kernel (the ``[npu]`` extra of pyproject.toml): ``fla-core``,
#: the package of FLA's kernels (``fla.ops``; it requires only ``einops``), not ``flash-linear-attention``, whose
#: 0.6.0 requires ``transformers>=5.6.2,<6`` (it would replace a transformers 4.57.x), and not ``fla-core[npu]`` /
#: ``flash-linear-attention[npu]``, which pin torch (0.5.2: 2.7.1 with torch_npu 2.7.1.post4; 0.6.0: 2.10.0 with
#: torch_npu 2.10.0.post7 and triton-ascend 3.6.0). Read from the wheels' metadata.
FLA_INSTALL = (f'pip install "fla-core{FLA_VERSIONS}" "triton-ascend>=3.2.0" (flash-linear-attention{FLA_VERSIONS}\'s '
               'kernels without its transformers requirement; or qwen_npu_compile[npu])')

#: FLA's public entry (0.5.2 and 0.6.0 ``fla/ops/gated_delta_rule/__init__.py``).
FLA_MODULE, FLA_FUNCTION = "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"

#: The keywords :func:`fla_arguments` passes; 0.5.2's and 0.6.0's entry both take them (``chunk.py``).
FLA_KEYWORDS = ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens",
                "cu_seqlens_cpu")

#: Largest head dim FLA's state kernels take (0.5.2 and 0.6.0 ``fla/ops/common/chunk_delta_h.py``:
#: ``assert K <= 256``).
FLA_MAX_HEAD_DIM = 256

#: Dtypes of q/k/v/beta FLA's triton-ascend backend takes (0.5.2 and 0.6.0 ``fla/ops/gated_delta_rule/backends/
#: triton_ascend/__init__.py`` ``recompute_w_u_fwd_verifier``).
FLA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


@functools.cache
def _fla_probe() -> tuple[object | None, str | None]:
    try:
        fla = importlib.import_module("fla")
        module = importlib.import_module(FLA_MODULE)
    except Exception as exc:  # ImportError, or triton failing to load its driver
        return None, f"flash-linear-attention is not importable ({type(exc).__name__}: {exc})"
    version = str(getattr(fla, "__version__", "0"))
    if _version_tuple(version) < FLA_MIN_VERSION:
        return None, (f"flash-linear-attention {version} is older than "
                      f"{'.'.join(map(str, FLA_MIN_VERSION))} (no triton-ascend Gated DeltaNet backend)")
    try:
        on_npu = bool(importlib.import_module("fla.utils").IS_NPU)
    except Exception as exc:
        return None, f"fla.utils.IS_NPU could not be read ({type(exc).__name__}: {exc})"
    if not on_npu:
        return None, "FLA's triton backend is not Ascend's (fla.utils.IS_NPU is False: triton-ascend not active)"
    entry = getattr(module, FLA_FUNCTION, None)
    if entry is None:
        return None, f"flash-linear-attention {version} has no {FLA_MODULE}.{FLA_FUNCTION}"
    try:
        parameters = inspect.signature(entry).parameters  # follows torch.compiler.disable's __wrapped__
    except (TypeError, ValueError):  # no signature to read: the call itself will say
        return entry, None
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    missing = [name for name in FLA_KEYWORDS if name not in parameters]
    if missing and not takes_any:
        return None, (f"flash-linear-attention {version}'s {FLA_FUNCTION} takes no {', '.join(missing)} "
                      f"(this package passes 0.5.2's / 0.6.0's keywords: install fla-core{FLA_VERSIONS})")
    return entry, None


def fla_entry():
    """FLA's public ``chunk_gated_delta_rule`` where it can run on an Ascend NPU, else None (see
    :func:`fla_unavailable`). Looked up once per process (``_fla_probe.cache_clear()`` forgets it)."""
    return _fla_probe()[0]


def fla_unavailable() -> str | None:
    """Why FLA cannot be the kernel in this process (None when it can): not importable, older than
    :data:`FLA_MIN_VERSION`, its triton backend not triton-ascend's (``fla.utils.IS_NPU``), or its entry not taking
    :data:`FLA_KEYWORDS` (a release after 0.6.0 that renamed them)."""
    return _fla_probe()[1]


def fla_violation(query, key, value, g, beta, cu_seqlens=None, initial_state=None) -> str | None:
    """Why FLA's ``chunk_gated_delta_rule`` cannot take these operands of the op (None when it can).

    The op's own contract (:func:`.gated_delta_rule.violation`) is assumed: ``[B, T, H, D]`` operands with GQA
    expanded, ``cu_seqlens`` only with ``B == 1``. FLA 0.5.2 and 0.6.0 add: q/k/v/beta in fp32/fp16/bf16, q/k/v one dtype,
    ``Dk <= 256`` (``chunk_delta_h.py``), every tensor on one NPU device, ``cu_seqlens`` ending at ``T`` (reads
    its last value).
    """
    for name, tensor in (("query", query), ("key", key), ("value", value), ("beta", beta)):
        if tensor.dtype not in FLA_DTYPES:
            return f"FLA takes fp32/fp16/bf16 {name} (got {tensor.dtype})"
    if not query.dtype == key.dtype == value.dtype:
        return f"FLA takes q/k/v of one dtype (got {query.dtype}, {key.dtype}, {value.dtype})"
    if query.shape[-1] > FLA_MAX_HEAD_DIM:
        return f"FLA's kernels take head dims up to {FLA_MAX_HEAD_DIM} (got Dk = {query.shape[-1]})"
    tensors = [t for t in (query, key, value, g, beta, cu_seqlens, initial_state) if t is not None]
    if any(t.device != query.device for t in tensors) or query.device.type != DEVICE_TYPE:
        return f"FLA's triton-ascend kernels take tensors on one npu device (got {sorted({str(t.device) for t in tensors})})"
    if cu_seqlens is not None and cu_seqlens.numel() and int(cu_seqlens[-1]) != query.shape[1]:
        # FLA leaves the tokens after the last sequence unwritten (its output is torch.empty_like)
        return f"FLA covers every token (cu_seqlens ends at {int(cu_seqlens[-1])} of {query.shape[1]})"
    return None


def fla_arguments(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm) -> tuple[tuple, dict]:
    """The op's operands as FLA's ``chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
    output_final_state, use_qk_l2norm_in_kernel, ..., cu_seqlens, cu_seqlens_cpu)`` takes them, the same keywords
    for 0.5.2 and 0.6.0 (:data:`FLA_KEYWORDS`): the same ``[B, T, H, K]`` layout (q/k/v of the query's dtype), ``g``
    ``[B, T, H]`` fp32 log decay, ``beta`` ``[B, T, H]``, ``initial_state [N, H, Dk, Dv]`` fp32 (key-first,
    ``state_v_first=False``), ``cu_seqlens`` int64 ``[N + 1]`` on the device with its CPU copy.

    0.6.0's ``chunk_indices`` (``[NT, 2]`` rows ``[sequence, chunk]``, used instead of ``prepare_chunk_indices``) is
    not passed: FLA builds the same rows from the CPU copy given here (``prepare_chunk_indices(cu_seqlens, 64,
    cu_seqlens_cpu=...)`` on the host), and rows built here would tie the op to FLA's internal chunk size and row
    layout, which FLA's kernels trust without a check (wrong rows give wrong results, not an error)."""
    kwargs = dict(scale=scale, initial_state=None if initial_state is None else initial_state.float(),
                  output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    if cu_seqlens is not None:
        kwargs.update(cu_seqlens=cu_seqlens.to(torch.int64), cu_seqlens_cpu=cu_seqlens.to("cpu", torch.int64))
    return (query, key, value, g.float(), beta), kwargs


# --------------------------------------------------------------------------------------------------
# torch_npu's npu_chunk_gated_delta_rule (no-grad forwards)

#: torch_npu 2.13.0 / 2.14.0 ``_op_plugin_docs.py`` ``npu_chunk_gated_delta_rule``, 约束说明 (constraints):
#: "L_i <= 8, N_k <= 64, N_v <= 64, D_k = 128, D_v = 128, N_v 是 N_k 整数倍"; query/key/value/beta/initial_state
#: bfloat16, g float32, actual_seq_lengths int32, output bfloat16; "该接口支持推理场景下使用" (inference only).
NPU_HEAD_DIM = 128
NPU_MAX_HEADS = 64
NPU_MAX_SEQUENCE_LENGTH = 8


def npu_forward_violation(query, key, value, g, beta, cu_seqlens=None, initial_state=None) -> str | None:
    """Why torch_npu's ``npu_chunk_gated_delta_rule`` cannot run this forward exactly (None when it can).

    The whole documented contract (torch_npu 2.13.0 / 2.14.0 ``_op_plugin_docs.py``): TND ``query/key [T, Nk,
    Dk]``, ``value [T, Nv, Dv]``, ``beta [T, Nv]`` bf16, ``g [T, Nv]`` fp32, a value-first ``initial_state [N, Nv,
    Dv, Dk]`` bf16, ``actual_seq_lengths [N]`` int32; ``Dk = Dv = 128``, ``Nk <= 64``, ``Nv <= 64``, ``Nv`` a
    multiple of ``Nk`` (the op's heads are already expanded: ``Nk = Nv = H``), every sequence ``L_i <= 8`` tokens;
    inference only (the caller decides that: :func:`select`). ``g`` is widened to fp32 exactly; an fp32
    ``initial_state`` or ``beta`` would be rounded to bf16, so they must be bf16 already (or absent).
    Reads ``cu_seqlens`` (a host copy) for the sequence lengths.
    """
    if query.device.type != DEVICE_TYPE:
        return f"torch_npu's op takes npu tensors (got {query.device})"
    for name, tensor in (("query", query), ("key", key), ("value", value), ("beta", beta)):
        if tensor.dtype != torch.bfloat16:
            return f"npu_chunk_gated_delta_rule takes bf16 {name} (got {tensor.dtype})"
    if not g.dtype.is_floating_point or g.dtype == torch.float64:
        return f"npu_chunk_gated_delta_rule takes g in fp32 (got {g.dtype}, not exactly convertible)"
    if initial_state is not None and initial_state.dtype != torch.bfloat16:
        return f"npu_chunk_gated_delta_rule keeps its state in bf16 (an initial_state in {initial_state.dtype} would be rounded)"
    k_dim, v_dim, heads = query.shape[-1], value.shape[-1], query.shape[2]
    if k_dim != NPU_HEAD_DIM or v_dim != NPU_HEAD_DIM:
        return f"npu_chunk_gated_delta_rule needs Dk = Dv = {NPU_HEAD_DIM} (got Dk = {k_dim}, Dv = {v_dim})"
    if heads > NPU_MAX_HEADS:
        return f"npu_chunk_gated_delta_rule takes at most {NPU_MAX_HEADS} heads (got {heads})"
    if cu_seqlens is None:
        longest = query.shape[1]
    else:
        offsets = cu_seqlens.to("cpu", torch.int64)
        longest = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
        if offsets.numel() > 1 and int(offsets[-1]) != query.shape[1]:
            return f"npu_chunk_gated_delta_rule covers every token (cu_seqlens ends at {int(offsets[-1])} of {query.shape[1]})"
    if longest > NPU_MAX_SEQUENCE_LENGTH:
        return f"npu_chunk_gated_delta_rule takes sequences of at most {NPU_MAX_SEQUENCE_LENGTH} tokens (got {longest})"
    return None


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x²) + eps)`` over the last dim (transformers' ``l2norm``, aligned with FLA)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def npu_arguments(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm) -> tuple[tuple, dict]:
    """The op's operands as torch_npu's ``npu_chunk_gated_delta_rule(query, key, value, *, beta, initial_state,
    actual_seq_lengths, scale, g)`` takes them (TND, lengths int32, value-first bf16 state, q/k L2-normalised
    outside: the op has no such flag). Only inside :func:`npu_forward_violation`."""
    batch, tokens, heads, k_dim = query.shape
    if cu_seqlens is None:
        lengths = torch.full((batch,), tokens, dtype=torch.int32, device=query.device)
        flat = [t.reshape(batch * tokens, *t.shape[2:]) for t in (query, key, value, beta, g)]
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        flat = [t[0] for t in (query, key, value, beta, g)]
    q, k, v, b, decay = flat
    if use_qk_l2norm:
        q, k = l2norm(q.float()).to(q.dtype), l2norm(k.float()).to(k.dtype)
    sequences = lengths.shape[0]
    if initial_state is None:
        state = torch.zeros(sequences, heads, value.shape[-1], k_dim, dtype=torch.bfloat16, device=query.device)
    else:
        state = initial_state.transpose(-1, -2).contiguous()  # [N, H, Dk, Dv] -> [N, H, Dv, Dk]
    return (q.contiguous(), k.contiguous(), v.contiguous()), dict(
        beta=b.contiguous(), initial_state=state, actual_seq_lengths=lengths, scale=scale, g=decay.float().contiguous())


# --------------------------------------------------------------------------------------------------
# the choice


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel :func:`select` picked: ``kernel`` is ``"fla"``, ``"torch_npu"`` or ``"reference"``; ``reason``
    says why the better ones were not taken (None for FLA)."""

    kernel: str
    reason: str | None = None


_logged: set[str] = set()


def _once(key: str, level: int, message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, message)


def select(query, key, value, g, beta, cu_seqlens=None, initial_state=None, *, training: bool,
           npu_op_available: bool | None = None) -> Choice:
    """The kernel for one call of the op on an Ascend host, with its reason; logs it once per distinct reason.

    Args:
        training: the op's training forward (its autograd saves for a backward) or its backward: FLA or the
            reference only (one family for forward and backward; torch_npu's op is inference-only).
        npu_op_available: whether ``torch.ops.npu.npu_chunk_gated_delta_rule`` exists (looked up when None).

    FLA first (where :func:`fla_unavailable` and :func:`fla_violation` are None), then, for no-grad forwards,
    torch_npu's op inside :func:`npu_forward_violation`, else the reference. Where FLA is not installed or not on
    Ascend's triton: one WARNING per process naming :data:`FLA_INSTALL`; the reference: one INFO line per process
    and mode (training, no-grad forward) with the first call's reason.
    """
    missing = fla_unavailable()
    if missing is None:
        reason = fla_violation(query, key, value, g, beta, cu_seqlens, initial_state)
        if reason is None:
            return Choice("fla")
    else:
        reason = missing
        _once("install", logging.WARNING, f"qwen_npu: the Gated DeltaNet runs its ATen reference on the NPU in training ({missing}); "
                               f"for a trainable Ascend kernel: {FLA_INSTALL}")
    if not training:
        if npu_op_available is None:
            npu_op_available = hasattr(torch.ops.npu, "npu_chunk_gated_delta_rule")
        npu_reason = (npu_forward_violation(query, key, value, g, beta, cu_seqlens, initial_state)
                      if npu_op_available else "torch_npu has no npu_chunk_gated_delta_rule")
        if npu_reason is None:
            if missing is None:
                _once("torch_npu", logging.INFO, f"qwen_npu: Gated DeltaNet no-grad forward on torch_npu's npu_chunk_gated_delta_rule, not FLA: {reason}")
            return Choice("torch_npu", reason)
        reason = f"{reason}; {npu_reason}"
    mode = "training" if training else "no-grad forward"
    _once(mode, logging.INFO, f"qwen_npu: Gated DeltaNet {mode} on the ATen reference: {reason}")
    return Choice("reference", reason)
