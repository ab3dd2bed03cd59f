"""The ``npu`` op namespace of the simulated Ascend host, as torch_npu 2.13.0 defines it.

Schemas, reference kernels, fake kernels, autograd and limits are the project's own stand-ins
(``qwen_npu_compile.ops.*``: each module's ``register(lib)``), registered here through
:class:`_DeviceLibrary`, which puts each kernel on the ``PrivateUse1`` key ONLY (never the CPU): a CPU
tensor then gets "Could not run 'npu::npu_rms_norm' with arguments from the 'CPU' backend", as on a host.
Each kernel runs on CPU aliases of its npu operands (no copy) and its outputs are copied to npu; an
operand left on the CPU (beyond 0-dim scalars) raises as a device would. Every limit the stand-ins check
(dtypes, shapes, layouts, ...) raises here too, as the aclnn call fails on an NPU.

``npu_chunk_gated_delta_rule`` (not emitted by the project's rewrites; the delta rule's Ascend kernel calls
it) is defined here with its documented contract enforced (torch_npu 2.13.0 ``_op_plugin_docs.py``).
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import _C

#: op-name -> times its simulated kernel ran (tests read it to show an op really ran on the device)
CALLS: dict[str, int] = {}


def _check_devices(name: str, args, kwargs) -> None:
    leaves, _ = tree_flatten((args, kwargs))
    cpu = [t for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0]
    if cpu:
        raise RuntimeError(f"npu::{name}: Expected all tensors to be on the same device, but found at least two "
                           f"devices, npu:0 and cpu! (a {tuple(cpu[0].shape)} {cpu[0].dtype} operand is on the CPU)")


def _to_cpu(value):
    return _C.cpu_alias(value) if isinstance(value, torch.Tensor) and value.device.type == "npu" else value


def _to_npu(value):
    return _C.to_npu(value) if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value


def on_device(name: str, kernel):
    """``kernel`` (a CPU reference) as the npu kernel of ``npu::<name>``: operands aliased to the CPU,
    results copied to npu. Fails like a device for an operand on the CPU."""

    @functools.wraps(kernel)
    def npu_kernel(*args, **kwargs):
        _check_devices(name, args, kwargs)
        CALLS[name] = CALLS.get(name, 0) + 1
        out = kernel(*tree_map(_to_cpu, args), **tree_map(_to_cpu, kwargs))
        return tree_map(_to_npu, out)

    return npu_kernel


class _DeviceLibrary(torch.library.Library):
    """A ``torch.library.Library`` whose ``CompositeExplicitAutograd`` kernels go to ``PrivateUse1`` only
    (wrapped by :func:`on_device`); fake/meta and autograd registrations pass through unchanged."""

    def impl(self, op_name, fn, dispatch_key="", *, with_keyset=False, allow_override=True):
        if dispatch_key == "CompositeExplicitAutograd":
            name = op_name if isinstance(op_name, str) else op_name.__name__
            fn, dispatch_key = on_device(name.split("::")[-1].split(".")[0], fn), "PrivateUse1"
        return super().impl(op_name, fn, dispatch_key, with_keyset=with_keyset, allow_override=allow_override)


# ---------------------------------------------------------------------------------------------------------
# npu_chunk_gated_delta_rule (torch_npu 2.13.0; no backward op, no autograd)

CHUNK_GATED_DELTA_RULE_SCHEMA = (
    "npu_chunk_gated_delta_rule(Tensor query, Tensor key, Tensor value, *, Tensor? beta=None, "
    "Tensor? initial_state=None, Tensor? actual_seq_lengths=None, float? scale=None, Tensor? g=None) -> (Tensor, Tensor)"
)


#: longest sequence the op takes (torch_npu 2.13.0 ``_op_plugin_docs.py``, 约束说明: "L_i <= 8")
MAX_SEQUENCE_LENGTH = 8


def chunk_gated_delta_rule_violation(query, key, value, beta, initial_state, actual_seq_lengths, g) -> str | None:
    """Why ``npu_chunk_gated_delta_rule`` fails (its aclnn call), or None. The documented contract (torch_npu
    2.13.0 / 2.14.0 ``_op_plugin_docs.py``, the same text in both): TND ``query/key [T, Nk, Dk]``, ``value
    [T, Nv, Dv]``, ``beta [T, Nv]`` bf16, ``g [T, Nv]`` fp32, ``initial_state [N, Nv, Dv, Dk]`` bf16 (required),
    ``actual_seq_lengths [N]`` int32 summing to T; q/k/v bf16; **L_i <= 8 per sequence, Nk <= 64, Nv <= 64,
    Dk = Dv = 128, Nv a multiple of Nk** (约束说明: "L_i <= 8, N_k <= 64, N_v <= 64, D_k = 128, D_v = 128,
    N_v 是 N_k 整数倍")."""
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        return f"query/key/value must be TND (3-D), got {query.dim()}/{key.dim()}/{value.dim()}-D"
    if any(t.dtype != torch.bfloat16 for t in (query, key, value)):
        return f"query/key/value must be bf16, got {query.dtype}/{key.dtype}/{value.dtype}"
    tokens, nk, dk = query.shape
    _, nv, dv = value.shape
    if tuple(key.shape) != tuple(query.shape) or value.shape[0] != tokens:
        return f"shapes query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} do not match"
    if dk != 128 or dv != 128:
        return f"Dk = Dv = 128 only (got Dk={dk}, Dv={dv})"
    if not 1 <= nk <= 64:
        return f"Nk <= 64 only (got Nk={nk})"
    if nv > 64:
        return f"Nv <= 64 only (got Nv={nv})"
    if nv % nk:
        return f"Nv a multiple of Nk only (got Nk={nk}, Nv={nv})"
    if beta is None or beta.dtype != torch.bfloat16 or tuple(beta.shape) != (tokens, nv):
        return f"beta must be bf16 [T, Nv] = [{tokens}, {nv}]"
    if g is None or g.dtype != torch.float32 or tuple(g.shape) != (tokens, nv):
        return f"g must be fp32 [T, Nv] = [{tokens}, {nv}]"
    if actual_seq_lengths is None or actual_seq_lengths.dtype != torch.int32 or actual_seq_lengths.dim() != 1:
        return "actual_seq_lengths must be int32 [N]"
    if initial_state is None or initial_state.dtype != torch.bfloat16 or tuple(initial_state.shape) != (
            actual_seq_lengths.shape[0], nv, dv, dk):
        return f"initial_state must be bf16 [N, Nv, Dv, Dk] = [{actual_seq_lengths.shape[0]}, {nv}, {dv}, {dk}]"
    lengths = [int(n) for n in actual_seq_lengths.tolist()]
    if sum(lengths) != tokens or min(lengths, default=1) < 1:
        return f"actual_seq_lengths {lengths} must be positive and sum to T={tokens}"
    if max(lengths, default=0) > MAX_SEQUENCE_LENGTH:
        return f"L_i <= {MAX_SEQUENCE_LENGTH} per sequence only (got actual_seq_lengths {lengths})"
    return None


def _chunk_gated_delta_rule(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None, scale=None,
                            g=None):
    reason = chunk_gated_delta_rule_violation(query, key, value, beta, initial_state, actual_seq_lengths, g)
    if reason is not None:
        raise RuntimeError(f"npu_chunk_gated_delta_rule: aclnnChunkGatedDeltaRule failed: {reason}")
    lengths = [int(n) for n in actual_seq_lengths.tolist()]
    from qwen_npu_compile.ops.qwen_npu.gated_delta_rule import reference

    repeat = value.shape[1] // query.shape[1]
    q, k = (x.repeat_interleave(repeat, dim=1) for x in (query, key))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    state = initial_state.float().transpose(-1, -2)  # value-first [N, Nv, Dv, Dk] -> [N, Nv, Dk, Dv]
    out, final = reference(q[None].float(), k[None].float(), value[None].float(), g[None].float(), beta[None].float(),
                           cu_seqlens=cu, initial_state=state, scale=scale, use_qk_l2norm=False)
    return out[0].to(torch.bfloat16), final.transpose(-1, -2).to(initial_state.dtype).contiguous()


def _fake_chunk_gated_delta_rule(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None,
                                 scale=None, g=None):
    # torch_npu 2.13.0 _meta_registrations.py: out bf16 like value, final state like initial_state
    torch._check(value.dim() == 3, lambda: f"valueTensor dim must be 3, but got {value.dim()}.")
    return value.new_empty(value.shape, dtype=torch.bfloat16), torch.empty_like(initial_state)


def register_all() -> torch.library.Library:
    """Define the ``npu`` ops (every ``EMITTED_OPS`` op with its backward, verl's MoE ops, the delta rule op)."""
    from qwen_npu_compile.ops import simulated
    from qwen_npu_compile.ops.define import define_op

    lib = simulated.register(_DeviceLibrary("npu", "FRAGMENT"))
    define_op(lib, CHUNK_GATED_DELTA_RULE_SCHEMA, _chunk_gated_delta_rule, _fake_chunk_gated_delta_rule)
    define_the_rest(lib)
    return lib


# ---------------------------------------------------------------------------------------------------------
# every other op of the wheel: defined (schema + the wheel's meta kernel), never simulated

#: ``{"defined": n, "failed": [...]}`` of :func:`define_the_rest`
REST: dict = {}


def _wheel_contracts():
    """``tests.helpers.wheel_contracts``, also in a process whose ``sys.path`` lacks the repository root (a child
    process on the simulated host gets the stand-in's folder on ``PYTHONPATH``, and ``import torch_npu`` defines
    these ops): the root, found from this file, goes first on the path where it is missing."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[4])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.helpers import wheel_contracts

    return wheel_contracts


def define_the_rest(lib: torch.library.Library) -> None:
    """Define every other op of torch_npu 2.13.0 (``npu_native_functions_by_codegen.yaml``, about 1400) with its
    schema and the wheel's meta kernel (``op_plugin/meta/_meta_registrations.py``), without a device kernel: on a
    host they exist, and torchair's own passes (e.g. ``patterns/add_rms_norm_dynamic_quant.py``) trace with them.
    Calling one on npu tensors says "Could not run 'npu::<op>' with arguments from the 'PrivateUse1' backend": the
    simulated host does not compute it. The wheel comes from ``qwen_npu_compile.torchair.offline.wheel``."""
    import yaml

    from ._wheel import sources

    load_meta_kernels = _wheel_contracts().load_meta_kernels

    sources = sources()
    funcs: list[str] = []

    def visit(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("func"), str):
                funcs.append(node["func"].strip())
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(yaml.load(sources.schemas_yaml.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    defined, failed = [], []
    for func in dict.fromkeys(funcs):
        name = func.split("(", 1)[0].strip()
        base, _, overload = name.partition(".")
        packet = getattr(torch.ops.npu, base, None) if hasattr(torch.ops.npu, base) else None
        if packet is not None and (overload or "default") in packet.overloads():
            continue
        try:
            lib.define(func)
            defined.append(name)
        except Exception as exc:  # noqa: BLE001 - a schema this torch cannot parse
            failed.append(f"{name}: {type(exc).__name__}")
    metas = load_meta_kernels(sources.meta_registrations).functions
    for name in defined:
        fn = metas.get(name)
        if fn is not None:
            try:
                lib.impl(name, fn, "Meta")
            except Exception as exc:  # noqa: BLE001
                failed.append(f"{name} meta: {type(exc).__name__}")
    REST.update(defined=len(defined), failed=failed, wheel=str(sources.wheel))
