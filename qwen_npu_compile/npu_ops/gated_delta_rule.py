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

Kernels (one op, one place for the limits: :func:`violation`, :func:`npu_forward_violation`):

- **CPU reference** (every host): this module's chunked algorithm, the same arithmetic as transformers'
  ``torch_chunk_gated_delta_rule`` in fp32, sequence by sequence for packed rows. Its backward op
  ``qwen_npu::chunk_gated_delta_rule_backward`` recomputes the forward with autograd and returns its gradients
  (exact for the reference by construction; the tests compare both with transformers' function).
- **Ascend** (a ``PrivateUse1`` kernel, registered only where torch_npu is importable): the forward runs
  torch_npu's ``npu_chunk_gated_delta_rule`` where its contract holds (:func:`npu_forward_violation`: bf16
  TND, value-first state ``[N, H, Dv, Dk]``, ``actual_seq_lengths`` int32; op-plugin
  ``ChunkGatedDeltaRuleKernelNpuOpApi.cpp``, MindSpore lite_boost ``chunk_gated_delta_rule`` docs), else the
  reference; the backward runs the reference (torch_npu 2.13.0 has no backward op), with one warning naming
  what would train faster (fla_npu, FLA's triton-ascend backend), which this op does not call yet.
- **GE graph mode**: torch_npu 2.9.0-2.14.0's converter of ``npu_chunk_gated_delta_rule`` raises "not supported
  in GE graph mode" (read from the wheels), so a torchair graph holding this op falls back (one warning).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("qwen_npu_compile")

#: The op's qualified name, and its backward op's.
NAME = "qwen_npu::chunk_gated_delta_rule"
BACKWARD_NAME = "qwen_npu::chunk_gated_delta_rule_backward"

#: Tokens per chunk of the reference (transformers' ``chunk_size`` default, FLA's ``BT``).
CHUNK_SIZE = 64

#: The L2 norm's epsilon inside the kernel (transformers' ``l2norm``, FLA's ``l2norm_fwd``).
L2NORM_EPS = 1e-6


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


def npu_forward_violation(query, value, g) -> str | None:
    """Why torch_npu's ``npu_chunk_gated_delta_rule`` cannot run this forward (None when it can).

    Its contract (torch_npu 2.13.0 meta kernel and op-plugin ``ChunkGatedDeltaRuleKernelNpuOpApi.cpp``;
    lite_boost ``chunk_gated_delta_rule`` docs): TND ``query/key [T, Nk, Dk]``, ``value [T, Nv, Dv]`` with
    Nv a multiple of Nk, ``beta [T, Nv]``, ``g [T, Nv]`` fp32, a required ``initial_state [N, Nv, Dv, Dk]``,
    ``actual_seq_lengths [N]`` int32, output always bf16; Atlas A2 only.
    """
    if query.dtype != torch.bfloat16 or value.dtype != torch.bfloat16:
        return f"npu_chunk_gated_delta_rule takes bf16 q/k/v (got {query.dtype}, {value.dtype}); its output is bf16"
    if g.dtype != torch.float32:
        return f"npu_chunk_gated_delta_rule takes g in fp32 (got {g.dtype})"
    return None


# --------------------------------------------------------------------------------------------------
# the reference (fp32, one batch of equal-length sequences)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x²) + eps)`` over the last dim (transformers' ``l2norm``, aligned with FLA)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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


@torch.library.custom_op(NAME, mutates_args=())
def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None,
                           scale: float, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring: ``(out [B, T, H, Dv] in query's dtype, final_state [N, H, Dk, Dv] fp32)``."""
    return _forward_kernel(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


def _forward_kernel(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    with torch.no_grad():
        out, state = reference(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    return out.contiguous(), state.clone()  # a custom op's outputs never alias its inputs


@chunk_gated_delta_rule.register_fake
def _fake(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    return value.new_empty(value.shape, dtype=query.dtype), _empty_state(query, value, cu_seqlens)


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
                     use_qk_l2norm):
    with _autograd_inside_kernel():
        inputs = [t.detach().requires_grad_(True) for t in (query, key, value, g, beta)]
        state = None if initial_state is None else initial_state.detach().requires_grad_(True)
        out, final = reference(*inputs, cu_seqlens, state, scale, use_qk_l2norm)
        wrt = inputs + ([state] if state is not None else [])
        grads = torch.autograd.grad((out, final), wrt, (grad_out.to(out.dtype), grad_state.to(final.dtype)),
                                    allow_unused=True)
    # contiguous, as the fake kernel says (a gradient's layout must not depend on autograd's choices)
    grads = [torch.zeros(t.shape, dtype=t.dtype) if d is None else d.to(t.dtype).contiguous() for d, t in zip(grads, wrt)]
    d_state = grads[5] if state is not None else query.new_empty((0,))
    return (*grads[:5], d_state)


@chunk_gated_delta_rule_backward.register_fake
def _fake_backward(grad_out, grad_state, query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    d_state = initial_state.new_empty(initial_state.shape) if initial_state is not None else query.new_empty((0,))
    return (*(t.new_empty(t.shape) for t in (query, key, value, g, beta)), d_state)


def _setup_context(ctx, inputs, output):
    query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm = inputs
    ctx.save_for_backward(query, key, value, g, beta, cu_seqlens, initial_state)
    ctx.scale, ctx.use_qk_l2norm = scale, use_qk_l2norm
    ctx.has_state = initial_state is not None


def _backward(ctx, grad_out, grad_state):
    query, key, value, g, beta, cu_seqlens, initial_state = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(value, dtype=query.dtype)
    if grad_state is None:
        grad_state = _empty_state(query, value, cu_seqlens).zero_()
    dq, dk, dv, dg, dbeta, d_state = chunk_gated_delta_rule_backward(
        grad_out, grad_state, query, key, value, g, beta, cu_seqlens, initial_state, ctx.scale, ctx.use_qk_l2norm)
    return dq, dk, dv, dg, dbeta, None, d_state if ctx.has_state else None, None, None


chunk_gated_delta_rule.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# the Ascend kernel (registered only where torch_npu imports)


def npu_forward(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, npu_op=None):
    """The forward through torch_npu's ``npu_chunk_gated_delta_rule`` (TND, value-first state), or None when
    :func:`npu_forward_violation` refuses. ``npu_op`` defaults to ``torch.ops.npu.npu_chunk_gated_delta_rule``
    (a stand-in with its contract in the tests)."""
    if npu_forward_violation(query, value, g) is not None:
        return None
    npu_op = npu_op or torch.ops.npu.npu_chunk_gated_delta_rule
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
    if initial_state is None:
        initial_state = _empty_state(query, value, cu_seqlens).zero_()
    state = initial_state.transpose(-1, -2).to(torch.bfloat16).contiguous()  # [N, H, Dv, Dk]
    out, final = npu_op(q, k, v.contiguous(), beta=b.to(torch.bfloat16), initial_state=state,
                        actual_seq_lengths=lengths, scale=scale, g=decay.float())
    return out.reshape(value.shape).to(query.dtype), final.transpose(-1, -2).float().contiguous()


_npu_warned: set[str] = set()


def _register_npu_kernel() -> None:
    """Ascend kernels of both ops (see the module docstring), where ``torch_npu`` is importable."""
    def forward(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
        result = npu_forward(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
        if result is not None:
            return result
        return _forward_kernel(query, key, value, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)

    def backward(*args):
        if "backward" not in _npu_warned:
            _npu_warned.add("backward")
            log.warning("qwen_npu: the Gated DeltaNet's backward runs the ATen reference on the NPU (torch_npu has "
                        "no backward of npu_chunk_gated_delta_rule); fla_npu or FLA's triton-ascend backend would "
                        "train faster, and this op does not call them yet")
        return _backward_kernel(*args)

    chunk_gated_delta_rule.register_kernel("npu")(forward)
    chunk_gated_delta_rule_backward.register_kernel("npu")(backward)


if torch._C._get_privateuse1_backend_name() == "npu":  # torch_npu renamed PrivateUse1: an Ascend host
    _register_npu_kernel()
