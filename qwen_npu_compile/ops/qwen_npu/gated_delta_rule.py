"""``qwen_npu::chunk_gated_delta_rule``: the Gated DeltaNet's chunked delta rule as one op, forward and backward.

What it computes (the Gated DeltaNet of Qwen3.5 / Qwen3-Next; transformers 5.24.0
``modeling_qwen3_5.torch_chunk_gated_delta_rule``, FLA's ``chunk_gated_delta_rule``), per sequence and value
head, with ``q, k`` L2-normalised over the head dim when ``use_qk_l2norm`` (eps 1e-6) and
``α_t = exp(g_t)``::

    S_t = α_t S_{t-1} + k_t (β_t (v_t - α_t S_{t-1}ᵀ k_t))ᵀ        S: [Dk, Dv], S_0 = initial state or 0
    o_t = S_tᵀ q_t · scale

computed chunk by chunk (``chunk_size`` 64 tokens: the UT transform inside a chunk, a scan over chunks), in
fp32, the output cast to the query's dtype.

Why an op of ours: no kernel anyone ships keeps the DeltaNet inside a compiled graph (FLA's entry point is
``@torch.compiler.disable``; fla_npu is called through ctypes; torch_npu's ``npu_chunk_gated_delta_rule`` is
forward only). Traced as ATen ops, the chunk scan unrolls into ``T/64`` ``select_scatter`` copies per layer and
specialises the graph on ``T`` (a recompile per packing); packed rows (verl's ``use_remove_padding``) split on
the host with ``.tolist()`` (a graph break per layer). As one op with the sequence offsets as a **tensor**
(``cu_seqlens``), a new packing is neither a new graph nor a graph break.

Tensors (B batch, T tokens, H value heads, Dk/Dv head dims, N sequences):

- ``query``, ``key``: ``[B, T, H, Dk]`` (GQA already expanded to the value heads by the caller), any float dtype;
- ``value``: ``[B, T, H, Dv]``; ``g`` (log decay, ≤ 0), ``beta``: ``[B, T, H]``;
- ``cu_seqlens``: ``[N + 1]`` int32/int64 cumulative sequence ends starting at 0, ``B == 1`` (packed rows), or
  None (each batch row is one sequence, ``N = B``);
- ``initial_state``: ``[N, H, Dk, Dv]`` or None (zeros);
- returns ``out [B, T, H, Dv]`` (query's dtype) and ``final_state [N, H, Dk, Dv]`` (fp32).

Kernels (one op; which kernel runs and every kernel's limits: :mod:`.gated_delta_rule_kernels`):

- **CPU reference** (every host): this module's chunked algorithm, the same arithmetic as transformers'
  ``torch_chunk_gated_delta_rule`` in fp32, sequence by sequence for packed rows. Its backward op
  ``qwen_npu::chunk_gated_delta_rule_backward`` recomputes the forward with autograd and returns its gradients
  (exact for the reference by construction; the tests compare both with transformers' function).
- **Ascend** (``PrivateUse1`` kernels of both ops, registered at import whatever the import order of torch_npu
  and this package; they look torch_npu and FLA up per call): FLA >= 0.5.2's ``chunk_gated_delta_rule`` (its
  triton-ascend backend) for training and no-grad forwards inside FLA's contract, the backward FLA's autograd
  of a recomputed FLA forward; torch_npu's inference-only ``npu_chunk_gated_delta_rule`` for no-grad forwards
  inside its whole documented contract; else the reference (one INFO line; one WARNING naming what to install
  where FLA is missing). Training is one family: the op's autograd calls its forward with ``training=True``
  (a keyword-only flag; a graph's no-grad call leaves it False), which never takes torch_npu's op.
- **GE graph mode**: torch_npu 2.9.0-2.14.0's converter of ``npu_chunk_gated_delta_rule`` raises "not supported
  in GE graph mode" (read from the wheels), so a torchair graph holding this op falls back (one warning).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from qwen_npu_compile.ops.qwen_npu import gated_delta_rule_kernels as kernels
from qwen_npu_compile.ops.qwen_npu.gated_delta_rule_kernels import L2NORM_EPS, l2norm, npu_forward_violation  # noqa: F401  (this op's names)

log = logging.getLogger("qwen_npu_compile")

#: The op's qualified name, and its backward op's.
NAME = "qwen_npu::chunk_gated_delta_rule"
BACKWARD_NAME = "qwen_npu::chunk_gated_delta_rule_backward"

#: Tokens per chunk of the reference (transformers' ``chunk_size`` default, FLA's ``BT``).
CHUNK_SIZE = 64

# --------------------------------------------------------------------------------------------------
# limits (the one place)


def violation(query, key, value, g, beta, cu_seqlens=None, initial_state=None) -> str | None:
    """Why these operands are outside the op's contract (None when they are inside).

    Works on real, fake and meta tensors (shapes and dtypes only). Callers refuse with this reason.

    Returns:
        A one-line reason, e.g. ``"key [1, 8, 2, 16] and query [1, 8, 4, 16] differ"``.
    """
    if query.dim() != 4:
        return f"query has {query.dim()} dims (expected [B, T, H, Dk])"
    if tuple(key.shape) != tuple(query.shape):
        return f"key {list(key.shape)} and query {list(query.shape)} differ (expand GQA to the value heads first)"
    if value.dim() != 4 or tuple(value.shape[:3]) != tuple(query.shape[:3]):
        return f"value {list(value.shape)} does not match query {list(query.shape)} in [B, T, H]"
    for name, tensor in (("g", g), ("beta", beta)):
        if tuple(tensor.shape) != tuple(query.shape[:3]):
            return f"{name} {list(tensor.shape)} is not [B, T, H] = {list(query.shape[:3])}"
    for name, tensor in (("query", query), ("key", key), ("value", value), ("g", g), ("beta", beta)):
        if not tensor.dtype.is_floating_point:
            return f"{name} dtype {tensor.dtype} is not floating point"
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            return f"cu_seqlens {cu_seqlens.dtype} {list(cu_seqlens.shape)} is not a 1-D int32/int64 tensor"
        if query.shape[0] != 1:
            return f"packed rows (cu_seqlens) need batch 1, got {query.shape[0]}"
    if initial_state is not None:
        sequences = query.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        expected = [sequences, query.shape[2], query.shape[3], value.shape[3]]
        if list(initial_state.shape) != expected:
            return f"initial_state {list(initial_state.shape)} is not [N, H, Dk, Dv] = {expected}"
    return None


# --------------------------------------------------------------------------------------------------
# the reference (fp32, one batch of equal-length sequences)


def _chunk_rule(query, key, value, g, beta, state, scale: float, use_qk_l2norm: bool, chunk_size: int):
    """The chunked delta rule on ``[B, T, H, D]`` operands (every row one sequence); fp32 out and state.

    Mirrors transformers 5.24.0 ``torch_chunk_gated_delta_rule`` (phase 1: the UT transform per chunk with
    ``linalg.solve_triangular``; phase 2: the scan over chunks)."""
    batch, tokens, heads, k_dim = key.shape
    v_dim = value.shape[-1]
    q, k, v, b, decay = (x.transpose(1, 2).to(torch.float32) for x in (query, key, value, beta, g))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    if state is None:
        state = torch.zeros(batch, heads, k_dim, v_dim, dtype=torch.float32, device=value.device)
    else:
        state = state.to(torch.float32)
    if tokens == 0:
        return torch.zeros(batch, 0, heads, v_dim, dtype=torch.float32, device=value.device), state
    pad = (chunk_size - tokens % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    b, decay = (F.pad(x, (0, pad)) for x in (b, decay))
    chunks = (tokens + pad) // chunk_size
    v_beta, k_beta = v * b.unsqueeze(-1), k * b.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(batch, heads, chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = decay.reshape(batch, heads, chunks, chunk_size).cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * decay.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    outputs = []
    for i in range(chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, v_dim)[:, :, :tokens]
    return out.transpose(1, 2), state


def _sequence_bounds(cu_seqlens: torch.Tensor | None, batch: int) -> list[tuple[int, int]] | None:
    if cu_seqlens is None:
        return None
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{NAME}: cu_seqlens must start at 0 and not decrease, got {offsets}")
    return list(zip(offsets[:-1], offsets[1:]))


def reference(query, key, value, g, beta, cu_seqlens=None, initial_state=None, scale: float | None = None,
              use_qk_l2norm: bool = True, chunk_size: int = CHUNK_SIZE):
    """The op's CPU reference, differentiable (plain ATen ops): ``(out [B, T, H, Dv], final_state [N, H, Dk, Dv])``.

    Packed rows (``cu_seqlens``) run sequence by sequence; ``scale`` defaults to ``Dk ** -0.5``.

    Raises:
        ValueError: operands outside the contract (:func:`violation`), or ``cu_seqlens`` not starting at 0 /
            decreasing / ending past ``T``.
    """
    reason = violation(query, key, value, g, beta, cu_seqlens, initial_state)
    if reason is not None:
        raise ValueError(f"{NAME}: {reason}")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    bounds = _sequence_bounds(cu_seqlens, query.shape[0])
    if bounds is None:
        out, state = _chunk_rule(query, key, value, g, beta, initial_state, scale, use_qk_l2norm, chunk_size)
        return out.to(query.dtype), state
    if bounds and bounds[-1][1] > query.shape[1]:
        raise ValueError(f"{NAME}: cu_seqlens ends at {bounds[-1][1]}, past the {query.shape[1]} tokens")
    outs, states = [], []
    for i, (start, end) in enumerate(bounds):
        state = None if initial_state is None else initial_state[i:i + 1]
        out, state = _chunk_rule(query[:, start:end], key[:, start:end], value[:, start:end], g[:, start:end],
                                 beta[:, start:end], state, scale, use_qk_l2norm, chunk_size)
        outs.append(out)
        states.append(state)
    tail = query.shape[1] - (bounds[-1][1] if bounds else 0)
    if tail:  # tokens after the last sequence end (padding to a fixed T): zeros, as FLA leaves them
        outs.append(torch.zeros(1, tail, *value.shape[2:], dtype=torch.float32, device=value.device))
    final = (torch.cat(states) if states
             else torch.zeros(0, *query.shape[2:], value.shape[-1], dtype=torch.float32, device=value.device))
    return torch.cat(outs, dim=1).to(query.dtype), final


# --------------------------------------------------------------------------------------------------
# the ops

#: The forward op's schema. ``training`` (keyword-only, default False) is set by the op's own autograd for a
#: forward whose backward follows (eager and AOTAutograd's joint graph alike); callers leave it out.
SCHEMA = ("chunk_gated_delta_rule(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, Tensor? cu_seqlens, "
          "Tensor? initial_state, float scale, bool use_qk_l2norm, *, bool training=False) -> (Tensor, Tensor)")

LIBRARY = torch.library.Library("qwen_npu", "FRAGMENT")
LIBRARY.define(SCHEMA)


@contextlib.contextmanager
def _autograd_inside_kernel():
    """Autograd back on inside a kernel: the dispatcher runs kernels below the Autograd keys (excluded in the
    thread's dispatch TLS), so a kernel that differentiates its own reference must lift that exclusion."""
    C = torch._C
    excluded = C._dispatch_tls_local_exclude_set()
    for key in ("AutogradCPU", "AutogradCUDA", "AutogradPrivateUse1", "ADInplaceOrView"):
        excluded = excluded.remove(getattr(C.DispatchKey, key))
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


def _empty_state(query, value, cu_seqlens):
    sequences = query.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return query.new_empty((sequences, query.shape[2], query.shape[3], value.shape[3]), dtype=torch.float32)


def _forward_kernel(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, *, training=False):
    """The reference forward (every backend without a kernel of its own)."""
    with torch.no_grad():
        out, state = reference(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    return out.contiguous(), state.clone()  # an op's outputs never alias its inputs


def _fake(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, *, training=False):
    return value.new_empty(value.shape, dtype=query.dtype), _empty_state(query, value, cu_seqlens)


LIBRARY.impl("chunk_gated_delta_rule", _forward_kernel, "CompositeExplicitAutograd")
torch.library.register_fake(NAME, _fake, lib=LIBRARY)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None,
                           scale: float, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.qwen_npu.chunk_gated_delta_rule``; see the module docstring: ``(out [B, T, H, Dv] in query's
    dtype, final_state [N, H, Dk, Dv] fp32)``."""
    return torch.ops.qwen_npu.chunk_gated_delta_rule.default(query, key, value, g, beta, cu_seqlens, initial_state,
                                                             scale, use_qk_l2norm)


@torch.library.custom_op(BACKWARD_NAME, mutates_args=())
def chunk_gated_delta_rule_backward(
    grad_out: torch.Tensor, grad_state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None,
    scale: float, use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv, dg, dbeta, d_initial_state)`` of :func:`chunk_gated_delta_rule` (each in its
    input's dtype; ``d_initial_state`` is empty ``[0]`` without an initial state): the reference recomputed
    with autograd."""
    return _backward_kernel(grad_out, grad_state, query, key, value, g, beta, cu_seqlens, initial_state, scale,
                            use_qk_l2norm)


def _backward_kernel(grad_out, grad_state, query, key, value, g, beta, cu_seqlens, initial_state, scale,
                     use_qk_l2norm, forward=None):
    """Gradients of ``forward`` (default: :func:`reference`; FLA's public entry on Ascend) recomputed under
    autograd, taken with ``torch.autograd.grad``."""
    forward = forward or (lambda *args: reference(*args))
    with _autograd_inside_kernel():
        inputs = [t.detach().requires_grad_(True) for t in (query, key, value, g, beta)]
        state = None if initial_state is None else initial_state.detach().requires_grad_(True)
        out, final = forward(*inputs, cu_seqlens, state, scale, use_qk_l2norm)
        wrt = inputs + ([state] if state is not None else [])
        grads = torch.autograd.grad((out, final), wrt, (grad_out.to(out.dtype), grad_state.to(final.dtype)),
                                    allow_unused=True)
    # contiguous, as the fake kernel says (a gradient's layout must not depend on autograd's choices)
    grads = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) if d is None else d.to(t.dtype).contiguous()
             for d, t in zip(grads, wrt)]
    d_state = grads[5] if state is not None else query.new_empty((0,))
    return (*grads[:5], d_state)


@chunk_gated_delta_rule_backward.register_fake
def _fake_backward(grad_out, grad_state, query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    d_state = initial_state.new_empty(initial_state.shape) if initial_state is not None else query.new_empty((0,))
    return (*(t.new_empty(t.shape) for t in (query, key, value, g, beta)), d_state)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """The forward op's autograd: its forward runs the op with ``training=True`` (one kernel family with the
    backward on Ascend), its backward calls :func:`chunk_gated_delta_rule_backward`."""

    @staticmethod
    def forward(ctx, query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
        with torch._C._AutoDispatchBelowAutograd():
            out, final = torch.ops.qwen_npu.chunk_gated_delta_rule.default(
                query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, training=True)
        ctx.save_for_backward(query, key, value, g, beta, cu_seqlens, initial_state)
        ctx.scale, ctx.use_qk_l2norm = scale, use_qk_l2norm
        ctx.has_state = initial_state is not None
        return out, final

    @staticmethod
    def backward(ctx, grad_out, grad_state):
        query, key, value, g, beta, cu_seqlens, initial_state = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(value, dtype=query.dtype)
        if grad_state is None:
            grad_state = _empty_state(query, value, cu_seqlens).zero_()
        dq, dk, dv, dg, dbeta, d_state = chunk_gated_delta_rule_backward(
            grad_out, grad_state, query, key, value, g, beta, cu_seqlens, initial_state, ctx.scale,
            ctx.use_qk_l2norm)
        return dq, dk, dv, dg, dbeta, None, d_state if ctx.has_state else None, None, None


def _autograd_kernel(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, *,
                     training=False):
    differentiable = (query, key, value, g, beta, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable):
        return _ChunkGatedDeltaRule.apply(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.qwen_npu.chunk_gated_delta_rule.default(
            query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, training=training)


LIBRARY.impl("chunk_gated_delta_rule", _autograd_kernel, "Autograd")


# --------------------------------------------------------------------------------------------------
# the Ascend kernels (PrivateUse1: registered at import; torch_npu and FLA looked up per call)


def _fla_forward(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    """FLA's public ``chunk_gated_delta_rule`` on the op's operands (:func:`kernels.fla_arguments`)."""
    args, kwargs = kernels.fla_arguments(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    out, final = kernels.fla_entry()(*args, **kwargs)
    return out.to(query.dtype), final.to(torch.float32)


def npu_forward(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, npu_op=None):
    """The forward through torch_npu's ``npu_chunk_gated_delta_rule`` (:func:`kernels.npu_arguments`), or None
    where :func:`npu_forward_violation` refuses. ``npu_op`` defaults to ``torch.ops.npu.npu_chunk_gated_delta_rule``."""
    if npu_forward_violation(query, key, value, g, beta, cu_seqlens, initial_state) is not None:
        return None
    npu_op = npu_op or torch.ops.npu.npu_chunk_gated_delta_rule
    args, kwargs = kernels.npu_arguments(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    out, final = npu_op(*args, **kwargs)
    return out.reshape(value.shape).to(query.dtype), final.transpose(-1, -2).float().contiguous()


def _npu_forward_kernel(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, *,
                        training=False):
    """The forward op on an Ascend tensor: the kernel :func:`kernels.select` picks."""
    choice = kernels.select(query, key, value, g, beta, cu_seqlens, initial_state, training=training)
    if choice.kernel == "fla":
        with torch.no_grad():
            out, final = _fla_forward(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
        return out.contiguous(), final.contiguous()
    if choice.kernel == "torch_npu":
        return npu_forward(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    return _forward_kernel(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


def _npu_backward_kernel(grad_out, grad_state, query, key, value, g, beta, cu_seqlens, initial_state, scale,
                         use_qk_l2norm):
    """The backward op on an Ascend tensor: FLA's autograd where the training forward ran FLA, else the
    reference's (the same :func:`kernels.select` call as the forward's, so one family)."""
    choice = kernels.select(query, key, value, g, beta, cu_seqlens, initial_state, training=True)
    forward = _fla_forward if choice.kernel == "fla" else None
    return _backward_kernel(grad_out, grad_state, query, key, value, g, beta, cu_seqlens, initial_state, scale,
                            use_qk_l2norm, forward=forward)


LIBRARY.impl("chunk_gated_delta_rule", _npu_forward_kernel, "PrivateUse1")
LIBRARY.impl("chunk_gated_delta_rule_backward", _npu_backward_kernel, "PrivateUse1")
