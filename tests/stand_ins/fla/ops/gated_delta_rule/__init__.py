"""Stand-in of FLA's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (``fla/ops/gated_delta_rule/chunk.py``), as
fla-core 0.5.2 or 0.6.0 has it (the release :data:`fla.__version__` names; :func:`fla.pretend` switches).

Each release's exact signature (names, kinds, defaults; read from its ``fla-core`` wheel): 0.6.0 adds the keyword
``chunk_indices: LongTensor | None = None`` between ``cu_seqlens_cpu`` and ``cp_context``, and its entry is
``@torch.compiler.disable`` as a whole (0.5.2: the backend dispatch wrapper around a disabled function; the stand-in's
0.5.2 entry is not disabled, as before). The arguments are checked as FLA's entry checks them (the ``ValueError`` s of
both releases' ``chunk.py``; 0.6.0: ``chunk_indices``, where given, must be what FLA's ``prepare_chunk_indices``
would build, since FLA's kernels trust it) and as its triton-ascend backend would (layouts ``[B, T, H, K]``, dtypes,
``cu_seqlens`` int64 ``[N + 1]`` with ``B == 1`` and its CPU copy, one device); each call is appended to
:data:`CALLS`; the result is ``qwen_npu_compile``'s reference (per sequence, differentiable: autograd gives the
gradients, as FLA's autograd function does).
"""

from __future__ import annotations

import inspect

import torch

import fla

#: One dict per call: the argument names with their ``(dtype, shape, device)`` (tensors) or values, ``version``
#: (the release the entry called speaks) and ``grad_enabled`` (whether a backward can follow).
CALLS: list[dict] = []

#: Where the tensors must live (None: any one device); the simulated Ascend host's tests set ``"npu"``.
REQUIRED_DEVICE_TYPE: str | None = None

#: FLA's default ``chunk_size`` (both releases' entry: ``kwargs.pop('chunk_size', 64)``, one of 16, 32, 64).
CHUNK_SIZE = 64


def _describe(value):
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.device.type)
    return value


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """What FLA's ``fla.ops.utils.prepare_chunk_indices`` builds (0.6.0 ``fla/ops/utils/index.py``): one row
    ``[sequence, chunk within it]`` per chunk of ``chunk_size`` tokens, ``[NT, 2]``, ``cu_seqlens``'s dtype and
    device."""
    lengths = torch.diff(cu_seqlens.to("cpu", torch.int64)).tolist()
    rows = [[n, i] for n, length in enumerate(lengths) for i in range(-(-length // chunk_size))]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2).to(cu_seqlens)


def _run(version: str, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
         use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_indices,
         cp_context, kwargs):
    from qwen_npu_compile.ops.qwen_npu.gated_delta_rule import reference

    arguments = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                     cp_context=cp_context, **kwargs)
    if version != "0.5.2":
        arguments["chunk_indices"] = chunk_indices
    CALLS.append({**{name: _describe(value) for name, value in arguments.items()}, "version": version,
                  "grad_enabled": torch.is_grad_enabled()})
    kwargs = dict(kwargs)
    # the entry's own checks (chunk.py, both releases)
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        state_v_first = kwargs.pop("transpose_state_layout")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same number of heads, but got q.shape[2]={q.shape[2]} and "
                         f"k.shape[2]={k.shape[2]}")
    if v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"For GVA, num_v_heads (HV={v.shape[2]}) must be evenly divisible by num_heads "
                         f"(H={q.shape[2]}), but got HV % H = {v.shape[2] % q.shape[2]}")
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    chunk_size = kwargs.pop("chunk_size", CHUNK_SIZE)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                             f"Please flatten variable-length inputs before processing.")
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError(f"The number of initial states is expected to be equal to the number of input "
                             f"sequences, i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    # what the stand-in (and the op's binding) does not use, and the triton-ascend backend's checks (dtypes, npu)
    assert not (use_beta_sigmoid_in_kernel or state_v_first or kwargs or cp_context), arguments
    assert q.dim() == k.dim() == v.dim() == 4 and q.shape == k.shape, "q/k/v are [B, T, H, K] / [B, T, HV, V]"
    batch, tokens, heads = q.shape[:3]
    assert v.shape[:2] == (batch, tokens), "v is [B, T, HV, V]"
    assert g.shape == beta.shape == v.shape[:3], "g and beta are [B, T, HV]"
    assert q.shape[-1] <= 256, "current kernel does not support head dimension larger than 256."
    for tensor in (q, k, v, beta):
        assert tensor.dtype in (torch.float32, torch.float16, torch.bfloat16), tensor.dtype
    assert q.dtype == k.dtype == v.dtype, "q/k/v of one dtype"
    assert g.dtype == torch.float32, f"g (log decay) in fp32, got {g.dtype}"
    tensors = [t for t in (q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices) if t is not None]
    assert len({t.device for t in tensors}) == 1, "every tensor on one device"
    if REQUIRED_DEVICE_TYPE is not None:
        assert q.device.type == REQUIRED_DEVICE_TYPE, f"FLA's triton-ascend kernels take npu tensors, got {q.device}"
    if cu_seqlens is not None:
        assert cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1, "cu_seqlens is a LongTensor [N + 1]"
        assert cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type == "cpu"
        assert cu_seqlens_cpu.dtype == torch.int64 and cu_seqlens_cpu.tolist() == cu_seqlens.tolist()
        assert int(cu_seqlens_cpu[-1]) == tokens
        sequences = cu_seqlens.shape[0] - 1
    else:
        sequences = batch
    if chunk_indices is not None:  # 0.6.0: used as given (the kernels index chunks by it), never checked by FLA
        assert cu_seqlens is not None, "chunk_indices without cu_seqlens"
        want = prepare_chunk_indices(cu_seqlens_cpu, chunk_size)
        assert (chunk_indices.dtype, chunk_indices.device) == (cu_seqlens.dtype, cu_seqlens.device), chunk_indices
        assert torch.equal(chunk_indices.cpu(), want), f"chunk_indices {chunk_indices.tolist()} are not FLA's {want.tolist()}"
    if initial_state is not None:
        assert tuple(initial_state.shape) == (sequences, v.shape[2], q.shape[-1], v.shape[-1]), "[N, HV, K, V]"
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if v.shape[2] != heads:  # GVA: value head i reads query/key head i // (HV / H) (FLA's i_h = i_hv // (HV // H))
        q, k = (x.repeat_interleave(v.shape[2] // heads, dim=2) for x in (q, k))
    o, final_state = reference(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm_in_kernel)
    return o.to(q.dtype), (final_state if output_final_state else None)


def chunk_gated_delta_rule_0_5_2(
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
    """fla-core 0.5.2's signature (``fla/ops/gated_delta_rule/chunk.py``)."""
    return _run("0.5.2", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu, None,
                cp_context, kwargs)


def _with_chunk_indices(entry):
    """fla-core 0.6.0's entry (``fla/ops/gated_delta_rule/chunk.py``): ``entry``'s (0.5.2's) parameters plus
    ``chunk_indices: LongTensor | None = None`` before ``cp_context``, the call bound by that signature."""
    base = inspect.signature(entry)
    parameters = list(base.parameters.values())
    parameters.insert([p.name for p in parameters].index("cp_context"),
                      inspect.Parameter("chunk_indices", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                        annotation="torch.LongTensor | None"))
    signature = base.replace(parameters=parameters)

    def chunk_gated_delta_rule_0_6_0(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        return _run("0.6.0", kwargs=arguments.pop("kwargs"), **arguments)

    chunk_gated_delta_rule_0_6_0.__signature__ = signature
    return chunk_gated_delta_rule_0_6_0


chunk_gated_delta_rule_0_6_0 = _with_chunk_indices(chunk_gated_delta_rule_0_5_2)


for _function in (chunk_gated_delta_rule_0_5_2, chunk_gated_delta_rule_0_6_0):
    _function.__name__ = _function.__qualname__ = "chunk_gated_delta_rule"

#: Each release's public entry: 0.6.0's is ``@torch.compiler.disable`` as a whole (its outermost decorator).
ENTRIES = {"0.5.2": chunk_gated_delta_rule_0_5_2,
           "0.6.0": torch.compiler.disable(chunk_gated_delta_rule_0_6_0)}


def bind(version: str) -> None:
    """Bind ``chunk_gated_delta_rule`` / ``chunk_gdn`` to ``version`` 's entry (:func:`fla.pretend` calls it)."""
    global chunk_gated_delta_rule, chunk_gdn
    chunk_gated_delta_rule = chunk_gdn = ENTRIES[version]


chunk_gated_delta_rule = chunk_gdn = ENTRIES[fla.__version__]
