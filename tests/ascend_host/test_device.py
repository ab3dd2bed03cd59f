"""The simulated Ascend host itself: what ``import torch_npu`` does there (tensors on ``npu``, ``torch.npu``, the
``npu`` ops for npu tensors only with their limits, autograd, fake kernels, the lazy torchair module)."""

from __future__ import annotations

import sys

import pytest
import sim
import torch


def test_import_renames_privateuse1_and_registers_torch_npu(npu):
    import torch_npu

    assert torch_npu.__version__ == "2.13.0" and sim.is_simulated_host()
    assert torch._C._get_privateuse1_backend_name() == "npu"
    assert torch.npu is torch_npu.npu and torch.npu.is_available() and torch.npu.device_count() == 1
    assert torch.npu.current_device() == 0 and torch.npu.get_device_name() == "Ascend910B2"
    x = torch.arange(6.0).reshape(2, 3).npu()
    assert x.device == npu and x.is_npu and str(x.device) == "npu:0"
    y = (x * 2).t().contiguous()
    assert y.device == npu and y.cpu().tolist() == [[0, 6], [2, 8], [4, 10]]
    view = x[:, 1]
    view.add_(100)  # a view writes through to its base, as on a device
    assert x.cpu()[:, 1].tolist() == [101, 104]
    assert torch.nn.Linear(3, 2).to("npu").weight.device == npu


def test_transformers_and_verl_detect_the_npu():
    from transformers.utils import is_torch_npu_available

    assert is_torch_npu_available() and is_torch_npu_available(check_device=True)


def test_uninitialised_memory_is_poisoned(npu):
    """Fresh npu memory reads as NaN (0xFF bytes), so a kernel reading memory it never wrote shows at once."""
    assert torch.empty(4, device=npu).isnan().all()
    assert torch.zeros(4, device=npu).eq(0).all()


def test_mixing_devices_fails_as_on_a_device(npu):
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3, device=npu) + torch.ones(3)
    assert (torch.ones(3, device=npu) + torch.tensor(1.0)).device == npu  # a 0-dim CPU tensor is a scalar


def test_npu_op_runs_on_npu_tensors_only(npu):
    import torch_npu

    x = torch.randn(2, 5, 8, device=npu, requires_grad=True)
    gamma = torch.randn(8, device=npu, requires_grad=True)
    y, rstd = torch_npu.npu_rms_norm(x, gamma, 1e-6)
    assert y.device == npu and rstd.dtype == torch.float32 and rstd.shape == (2, 5, 1)
    ref = x.detach().cpu() * torch.rsqrt(x.detach().cpu().pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.detach().cpu()
    torch.testing.assert_close(y.detach().cpu(), ref)
    before = sim.op_calls().get("npu_rms_norm_backward", 0)
    y.sum().backward()  # autograd calls npu_rms_norm_backward on the device, as torch_npu's does
    assert sim.op_calls()["npu_rms_norm_backward"] == before + 1 and x.grad.device == npu and gamma.grad.device == npu
    with pytest.raises(NotImplementedError, match="Could not run 'npu::npu_rms_norm' with arguments from the 'CPU' backend"):
        torch.ops.npu.npu_rms_norm(x.detach().cpu(), gamma.detach().cpu())
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.npu.npu_rms_norm(x.detach(), gamma.detach().cpu())


def test_npu_op_limits_raise_as_the_kernel_would(npu):
    with pytest.raises(RuntimeError, match="unsupported dtype pair"):
        torch.ops.npu.npu_rms_norm(torch.randn(2, 8, device=npu), torch.randn(8, device=npu, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="swiglu|even|divisible|split"):
        torch.ops.npu.npu_swiglu(torch.randn(2, 7, device=npu))


def test_fake_kernels_keep_the_device(npu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 4, 8, device=npu, dtype=torch.bfloat16)
        y, rstd = torch.ops.npu.npu_rms_norm(x, torch.empty(8, device=npu, dtype=torch.bfloat16))
        assert y.device == npu and rstd.device == npu and rstd.dtype == torch.float32


@pytest.mark.parametrize("head_dim, heads, ok", [(128, 4, True), (32, 4, False), (128, 65, False)])
def test_chunk_gated_delta_rule_contract(npu, head_dim, heads, ok):
    """torch_npu 2.13.0 ``npu_chunk_gated_delta_rule``: Dk = Dv = 128, at most 64 heads; outside it the aclnn call fails."""
    t = 6
    bf = dict(device=npu, dtype=torch.bfloat16)
    args = (torch.randn(t, heads, head_dim, **bf), torch.randn(t, heads, head_dim, **bf), torch.randn(t, heads, head_dim, **bf))
    kwargs = dict(beta=torch.rand(t, heads, **bf), g=-torch.rand(t, heads, device=npu),
                  initial_state=torch.zeros(2, heads, head_dim, head_dim, **bf),
                  actual_seq_lengths=torch.tensor([4, 2], dtype=torch.int32, device=npu))
    if not ok:
        with pytest.raises(RuntimeError, match="aclnnChunkGatedDeltaRule failed"):
            torch.ops.npu.npu_chunk_gated_delta_rule(*args, **kwargs)
        return
    out, state = torch.ops.npu.npu_chunk_gated_delta_rule(*args, **kwargs)
    assert out.shape == (t, heads, head_dim) and out.dtype == torch.bfloat16 and out.device == npu
    assert state.shape == (2, heads, head_dim, head_dim) and torch.isfinite(out.float().cpu()).all()


def _delta_rule_call(npu, lengths=(4, 2), nk=2, nv=4, dk=128, dv=128, **dtypes):
    """Arguments of ``npu_chunk_gated_delta_rule`` inside its contract, with ``dtypes`` (name -> dtype) changed."""
    t = sum(lengths)
    dt = {"query": torch.bfloat16, "key": torch.bfloat16, "value": torch.bfloat16, "beta": torch.bfloat16,
          "g": torch.float32, "initial_state": torch.bfloat16, "actual_seq_lengths": torch.int32, **dtypes}
    query = torch.randn(t, nk, dk).to(npu, dt["query"])
    key = torch.randn(t, nk, dk).to(npu, dt["key"])
    value = torch.randn(t, nv, dv).to(npu, dt["value"])
    kwargs = dict(beta=torch.rand(t, nv).to(npu, dt["beta"]), g=(-torch.rand(t, nv)).to(npu, dt["g"]),
                  initial_state=torch.zeros(len(lengths), nv, dv, dk).to(npu, dt["initial_state"]),
                  actual_seq_lengths=torch.tensor(lengths).to(npu, dt["actual_seq_lengths"]))
    return (query, key, value), kwargs


@pytest.mark.parametrize("change, reason", [
    (dict(lengths=(9, 2)), "L_i <= 8 per sequence"),
    (dict(lengths=(8, 8, 1)), None),  # the longest allowed sequences
    (dict(nk=65, nv=65), "Nk <= 64"),
    (dict(nk=2, nv=66), "Nv <= 64"),
    (dict(nk=64, nv=64), None),
    (dict(nk=4, nv=6), "Nv a multiple of Nk"),
    (dict(dk=64), "Dk = Dv = 128"),
    (dict(dv=64), "Dk = Dv = 128"),
    (dict(query=torch.float16), "query/key/value must be bf16"),
    (dict(value=torch.float32), "query/key/value must be bf16"),
    (dict(beta=torch.float32), "beta must be bf16"),
    (dict(g=torch.bfloat16), "g must be fp32"),
    (dict(initial_state=torch.float32), "initial_state must be bf16"),
    (dict(actual_seq_lengths=torch.int64), "actual_seq_lengths must be int32"),
])
def test_chunk_gated_delta_rule_whole_contract(npu, change, reason):
    """Every clause of torch_npu 2.13.0 ``_op_plugin_docs.py`` ``npu_chunk_gated_delta_rule`` (约束说明: L_i <= 8,
    Nk <= 64, Nv <= 64, Dk = Dv = 128, Nv a multiple of Nk; bf16 query/key/value/beta/initial_state, fp32 g,
    int32 actual_seq_lengths): outside it the aclnn call fails, naming the clause; at its edges the op runs."""
    shape = {k: change[k] for k in ("lengths", "nk", "nv", "dk", "dv") if k in change}
    dtypes = {k: v for k, v in change.items() if k not in shape}
    args, kwargs = _delta_rule_call(npu, **shape, **dtypes)
    if reason is not None:
        with pytest.raises(RuntimeError, match=f"aclnnChunkGatedDeltaRule failed: {reason}"):
            torch.ops.npu.npu_chunk_gated_delta_rule(*args, **kwargs)
        return
    out, state = torch.ops.npu.npu_chunk_gated_delta_rule(*args, **kwargs)
    assert out.shape == args[2].shape and out.dtype == torch.bfloat16 and out.device == npu
    assert state.shape == kwargs["initial_state"].shape and torch.isfinite(out.float().cpu()).all()


def test_lazy_torchair_module_is_installed():
    proxy = sys.modules["torchair"]
    assert type(proxy).__name__ == "_LazyTorchair"
    assert proxy.CompilerConfig().mode.value == "max-autotune"  # the first attribute imports the wheel's torchair
    from torchair.core import _torchair

    assert type(_torchair).__name__ == "_ExtensionStandIn"


def test_storages_deepcopy_and_memory_statistics(npu):
    import copy

    model = torch.nn.Linear(4, 4).to(npu)
    twin = copy.deepcopy(model)  # UntypedStorage(n, device="npu") + storage copy_
    assert twin.weight.device == npu and torch.equal(twin.weight.cpu(), model.weight.cpu())
    torch.npu.reset_peak_memory_stats()
    before = torch.npu.memory_allocated()
    big = torch.empty(1024, 1024, device=npu)
    assert torch.npu.memory_allocated() - before == big.numel() * 4 <= torch.npu.max_memory_allocated() - before
    big.untyped_storage().resize_(16)
    assert torch.npu.memory_allocated() - before == 16


def test_parameter_data_takes_npu_tensors_as_torch_npu_allows(npu):
    """torch_npu's ``_has_compatible_shallow_copy_type`` (libtorch_npu.so: ``at_npu::native::
    _has_compatible_shallow_copy_type``): dense CPU and npu tensors are compatible, so ``param.data = npu_tensor``
    (FSDP2's ``fully_shard``) works and ``Module.to("npu")`` keeps its Parameter objects, as on CUDA."""
    param = torch.nn.Parameter(torch.randn(3))
    on_npu = param.detach().to(npu)
    assert torch._has_compatible_shallow_copy_type(param, on_npu) and torch._has_compatible_shallow_copy_type(on_npu, param)
    assert not torch._has_compatible_shallow_copy_type(torch.randn(2).to_sparse(), on_npu)  # sparse: not dense
    param.data = on_npu
    assert param.device == npu and isinstance(param, torch.nn.Parameter) and param.requires_grad
    linear = torch.nn.Linear(2, 3)
    weight = linear.weight
    assert linear.to(npu).weight is weight and weight.device == npu


def test_hccl_process_group_is_one_rank(npu, tmp_path):
    """``init_process_group("cpu:gloo,npu:hccl")`` (verl's ``initialize_global_process_group``): npu collectives
    run on one rank (gloo refuses npu tensors); a group of two is refused with a clear error."""
    import types

    import torch.distributed as dist
    from torch_npu import _distributed

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("cpu:gloo,npu:hccl", store=store, rank=0, world_size=1)
    try:
        t = torch.arange(4.0, device=npu)
        dist.broadcast(t, 0)
        dist.all_reduce(t)
        gathered, scattered = torch.empty(4, device=npu), torch.empty(4, device=npu)
        dist.all_gather_single(gathered, t * 2)
        dist.reduce_scatter_single(scattered, t * 3)
        assert [x.cpu().tolist() for x in (t, gathered, scattered)] == [[0, 1, 2, 3], [0, 2, 4, 6], [0, 3, 6, 9]]
        assert dist.get_backend() == "cpu:gloo,npu:hccl"
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="one rank only, got a group of 2"):
        _distributed._new_process_group_hccl(types.SimpleNamespace(group_size=2, group_rank=0), None)
