"""Stand-in of FLA 0.5.2's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (``fla/ops/gated_delta_rule/chunk.py``).

The same signature as 0.5.2's public entry; the arguments are checked as FLA's entry and its triton-ascend backend
check them (and as our op must pass them: ``[B, T, H, K]``, ``cu_seqlens`` int64 ``[N + 1]`` with ``B == 1`` plus its
CPU copy, ``g`` fp32, one device); each call is appended to :data:`CALLS`; the result is ``qwen_npu_compile``'s
reference (per sequence, differentiable: autograd gives the gradients, as FLA's autograd function does).
"""

from __future__ import annotations

import torch

#: One dict per call: the argument names with their ``(dtype, shape, device)`` (tensors) or values, and
#: ``grad_enabled`` (whether a backward can follow).
CALLS: list[dict] = []

#: Where the tensors must live (None: any one device); the simulated Ascend host's tests set ``"npu"``.
REQUIRED_DEVICE_TYPE: str | None = None


def _describe(value):
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.device.type)
    return value


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    **kwargs,
):
    from qwen_npu_compile.npu_ops.gated_delta_rule import reference

    arguments = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                     cp_context=cp_context, **kwargs)
    CALLS.append({**{name: _describe(value) for name, value in arguments.items()},
                  "grad_enabled": torch.is_grad_enabled()})
    # FLA 0.5.2's entry checks (chunk.py) and the triton-ascend backend's (dtypes, npu tensors)
    assert q.dim() == k.dim() == v.dim() == 4 and q.shape == k.shape, "q/k/v are [B, T, H, K] / [B, T, HV, V]"
    batch, tokens, heads = q.shape[:3]
    assert v.shape[:2] == (batch, tokens) and v.shape[2] % heads == 0, "v is [B, T, HV, V], HV a multiple of H"
    assert g.shape == beta.shape == v.shape[:3], "g and beta are [B, T, HV]"
    assert q.shape[-1] <= 256, "current kernel does not support head dimension larger than 256."
    for tensor in (q, k, v, beta):
        assert tensor.dtype in (torch.float32, torch.float16, torch.bfloat16), tensor.dtype
    assert q.dtype == k.dtype == v.dtype, "q/k/v of one dtype"
    assert g.dtype == torch.float32, f"g (log decay) in fp32, got {g.dtype}"
    assert not (use_beta_sigmoid_in_kernel or allow_neg_eigval or state_v_first or kwargs or cp_context), arguments
    tensors = [t for t in (q, k, v, g, beta, initial_state, cu_seqlens) if t is not None]
    assert len({t.device for t in tensors}) == 1, "every tensor on one device"
    if REQUIRED_DEVICE_TYPE is not None:
        assert q.device.type == REQUIRED_DEVICE_TYPE, f"FLA's triton-ascend kernels take npu tensors, got {q.device}"
    if cu_seqlens is not None:
        assert batch == 1, "The batch size is expected to be 1 rather than {batch} when using `cu_seqlens`."
        assert cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1, "cu_seqlens is a LongTensor [N + 1]"
        assert cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type == "cpu"
        assert cu_seqlens_cpu.dtype == torch.int64 and cu_seqlens_cpu.tolist() == cu_seqlens.tolist()
        assert int(cu_seqlens_cpu[-1]) == tokens
        sequences = cu_seqlens.shape[0] - 1
    else:
        sequences = batch
    if initial_state is not None:
        assert tuple(initial_state.shape) == (sequences, v.shape[2], q.shape[-1], v.shape[-1]), "[N, HV, K, V]"
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if v.shape[2] != heads:  # GVA: value head i reads query/key head i // (HV / H) (FLA's i_h = i_hv // (HV // H))
        q, k = (x.repeat_interleave(v.shape[2] // heads, dim=2) for x in (q, k))
    o, final_state = reference(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm_in_kernel)
    return o.to(q.dtype), (final_state if output_final_state else None)


chunk_gdn = chunk_gated_delta_rule
