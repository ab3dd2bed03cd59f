"""``qwen_npu::chunk_gated_delta_rule`` against transformers' own ``torch_chunk_gated_delta_rule``: forward and
backward, fp32 and bf16, padded and packed rows (lengths at the chunk edges), an initial state, opcheck, fake
shapes under a dynamic token count, the limits; the Ascend kernels' choice (:mod:`gated_delta_rule_kernels`):
training flag, torch_npu's whole documented contract, FLA through a stand-in of 0.5.2's exact signature (forward and
backward through the PrivateUse1 kernels, called directly: no device here), the translation to torch_npu's op."""

from __future__ import annotations

import ast
import inspect
import itertools
import logging
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from qwen_npu_compile.ops.qwen_npu import gated_delta_rule as G
from qwen_npu_compile.ops.qwen_npu import gated_delta_rule_kernels as K
from tests.helpers.numerics import relative_l2

modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
hf_rule = modeling.torch_chunk_gated_delta_rule

OP = torch.ops.qwen_npu.chunk_gated_delta_rule.default
HEAD_DIM = 128  # Qwen3.5 / Qwen3-Next linear_key_head_dim and linear_value_head_dim


def _operands(batch, tokens, heads=2, dim=HEAD_DIM, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(batch, tokens, heads, dim).to(dtype) for _ in range(3))
    g = -torch.rand(batch, tokens, heads) * 0.3  # fp32, as the DeltaNet computes it
    beta = torch.rand(batch, tokens, heads).to(dtype)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _grads(outputs, inputs, seed=1):
    torch.manual_seed(seed)
    cotangents = [torch.randn(o.shape, dtype=o.dtype) for o in outputs]  # not randn_like: it follows strides
    return torch.autograd.grad(outputs, inputs, cotangents)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_padded_with_initial_state_matches_transformers(dtype, tol):
    q, k, v, g, beta = _operands(2, 100, dtype=dtype)
    state = (torch.randn(2, 2, HEAD_DIM, HEAD_DIM) * 0.05).requires_grad_()
    inputs = [q, k, v, g, beta, state]
    out, final = OP(q, k, v, g, beta, None, state, HEAD_DIM ** -0.5, True)
    ref_out, ref_final = hf_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
    assert out.dtype == ref_out.dtype == dtype and final.dtype == torch.float32
    assert relative_l2(out, ref_out) <= tol and relative_l2(final, ref_final) <= tol
    for ours, theirs in zip(_grads((out, final), inputs), _grads((ref_out, ref_final), inputs)):
        assert relative_l2(ours, theirs) <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_packed_rows_equal_each_sequence_alone(dtype, tol):
    lengths = [1, 63, 64, 65, 130]  # a single token and the chunk edges
    q, k, v, g, beta = _operands(1, sum(lengths), dtype=dtype)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    state = (torch.randn(len(lengths), 2, HEAD_DIM, HEAD_DIM) * 0.05).requires_grad_()
    inputs = [q, k, v, g, beta, state]
    out, final = OP(q, k, v, g, beta, cu_seqlens, state, HEAD_DIM ** -0.5, True)
    ref = [hf_rule(*(t[:, a:b] for t in (q, k, v, g, beta)), initial_state=state[i:i + 1], output_final_state=True,
                   use_qk_l2norm_in_kernel=True)
           for i, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))]
    ref_out, ref_final = torch.cat([r[0] for r in ref], dim=1), torch.cat([r[1] for r in ref])
    assert relative_l2(out, ref_out) <= tol and relative_l2(final, ref_final) <= tol
    for ours, theirs in zip(_grads((out, final), inputs), _grads((ref_out, ref_final), inputs)):
        assert relative_l2(ours, theirs) <= tol


def test_packing_is_not_one_sequence():
    """The offsets change the result (a test that would pass with cu_seqlens ignored is not one)."""
    q, k, v, g, beta = (t.detach() for t in _operands(1, 130))
    packed, _ = OP(q, k, v, g, beta, torch.tensor([0, 65, 130]), None, HEAD_DIM ** -0.5, True)
    whole, _ = OP(q, k, v, g, beta, None, None, HEAD_DIM ** -0.5, True)
    assert torch.equal(packed[:, :65], whole[:, :65]) and relative_l2(packed[:, 65:], whole[:, 65:]) > 1e-2


def test_opcheck():
    q, k, v, g, beta = (t.detach() for t in _operands(1, 70, dim=32))
    cu = torch.tensor([0, 5, 70])
    state = torch.randn(2, 2, 32, 32) * 0.05
    for args in [(q, k, v, g, beta, None, None, 32 ** -0.5, True), (q, k, v, g, beta, cu, state, 0.2, False)]:
        args = tuple(t.clone().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                     for t in args)
        torch.library.opcheck(OP, args)


def test_fake_shapes_under_dynamic_tokens():
    """One graph for every T and every number of sequences: the op's shapes follow its inputs symbolically."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def run(q, k, v, g, beta, cu):
        out, final = OP(q, k, v, g, beta, cu, None, HEAD_DIM ** -0.5, True)
        return out.sum() + final.sum(), final.shape[0]

    for tokens, cu in [(70, [0, 70]), (200, [0, 1, 64, 200]), (131, [0, 63, 65, 100, 131])]:
        q, k, v, g, beta = _operands(1, tokens)
        cu = torch.tensor(cu)
        torch._dynamo.decorators.mark_unbacked(cu, 0)
        total, sequences = run(q, k, v, g, beta, cu)
        assert sequences == len(cu) - 1
        total.backward()
    assert counter.frame_count == 1


@pytest.mark.parametrize("change,reason", [
    (lambda a: a.__setitem__(1, a[1][..., :1, :]), "key"),
    (lambda a: a.__setitem__(3, a[3][..., :1]), "g "),
    (lambda a: a.__setitem__(5, torch.tensor([0.0, 4.0])), "cu_seqlens"),
    (lambda a: a.__setitem__(6, torch.zeros(3, 2, 8, 8)), "initial_state"),
])
def test_limits_refuse_with_a_reason(change, reason):
    args = [*(t.detach() for t in _operands(1, 4, dim=8)), torch.tensor([0, 4]), None]
    change(args)
    message = G.violation(*args)
    assert message is not None and reason in message
    with pytest.raises(ValueError, match="qwen_npu::chunk_gated_delta_rule"):
        G.reference(*args)


STAND_INS = Path(__file__).resolve().parents[1] / "stand_ins"
FLA_WHEEL = Path("/work/wheels/fla_core-0.5.2-py3-none-any.whl")


@pytest.fixture
def ascend(monkeypatch, caplog):
    """The Ascend kernels' choice on CPU tensors: DEVICE_TYPE "cpu", FLA not importable, fresh log-once state."""
    monkeypatch.setattr(K, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(K, "_logged", set())
    monkeypatch.setitem(sys.modules, "fla", None)  # FLA absent, whatever is installed
    K._fla_probe.cache_clear()
    caplog.set_level(logging.INFO, logger="qwen_npu_compile")
    yield caplog
    K._fla_probe.cache_clear()


@pytest.fixture
def stand_in_fla(ascend, monkeypatch):
    """The stand-in FLA 0.5.2 bound (tests/stand_ins), on Ascend's triton (IS_NPU)."""
    monkeypatch.delitem(sys.modules, "fla")
    monkeypatch.syspath_prepend(str(STAND_INS))
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    import fla.ops.gated_delta_rule as entry
    import fla.utils

    monkeypatch.setattr(fla.utils, "IS_NPU", True)
    entry.CALLS.clear()
    K._fla_probe.cache_clear()
    yield entry
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        sys.modules.pop(name)


def _detached(*args, **kwargs):
    return [t.detach() for t in _operands(*args, **kwargs)]


def test_the_ascend_kernels_are_registered_whatever_the_import_order():
    """PrivateUse1 kernels of both ops exist at import, on a host where torch_npu never imported."""
    for name in (G.NAME, G.BACKWARD_NAME):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1")


def test_the_training_flag_follows_autograd():
    """The op's autograd runs its forward with training=True (eager and the AOT forward graph); a no-grad call and
    a graph compiled for inference leave it False."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is OP:
                seen.append((kwargs or {}).get("training", False))
            return func(*args, **(kwargs or {}))

    q, k, v, g, beta = _operands(1, 8, dim=8)
    with Spy():
        OP(q, k, v, g, beta, None, None, 0.3, True)
        with torch.no_grad():
            OP(q, k, v, g, beta, None, None, 0.3, True)
    assert seen == [True, False]

    graphs = []

    def backend(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

        def keep(graph, _):
            graphs.append(graph)
            return make_boxed_func(graph)
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    run = torch.compile(lambda *a: OP(*a, None, None, 0.3, True)[0].sum(), backend=backend, fullgraph=True)
    run(q, k, v, g, beta).backward()
    with torch.no_grad():
        run(*(t.detach() for t in (q, k, v, g, beta)))
    flags = [n.kwargs.get("training", False) for gm in graphs for n in gm.graph.find_nodes(op="call_function", target=OP)]
    assert flags == [True, False]


@pytest.mark.parametrize("change,reason", [
    (dict(dim=64), "Dk = Dv = 128"),
    (dict(heads=65, tokens=2), "at most 64 heads"),
    (dict(tokens=9), "at most 8 tokens"),
    (dict(dtype=torch.float16), "bf16 query"),
    (dict(state=torch.float32), "initial_state in torch.float32"),
    (dict(beta=torch.float32), "bf16 beta"),
])
def test_npu_forward_violation_holds_the_whole_documented_contract(ascend, change, reason):
    """torch_npu 2.13.0 / 2.14.0 _op_plugin_docs: bf16, Dk = Dv = 128, Nk, Nv <= 64, L_i <= 8, bf16 state."""
    tokens, heads, dim = change.get("tokens", 8), change.get("heads", 2), change.get("dim", 128)
    q, k, v, g, beta = _detached(1, tokens, heads=heads, dim=dim, dtype=change.get("dtype", torch.bfloat16))
    beta = beta.to(change.get("beta", q.dtype))
    state = torch.zeros(1, heads, dim, dim, dtype=change.get("state", torch.bfloat16))
    assert K.npu_forward_violation(*_detached(1, 8, dtype=torch.bfloat16), torch.tensor([0, 3, 8]), None) is None
    message = K.npu_forward_violation(q, k, v, g, beta, None, state)
    assert message is not None and reason in message


def test_packed_lengths_are_read_for_the_npu_contract(ascend):
    q, k, v, g, beta = _detached(1, 16, dtype=torch.bfloat16)
    assert K.npu_forward_violation(q, k, v, g, beta, torch.tensor([0, 8, 16], dtype=torch.int32)) is None
    assert "at most 8 tokens (got 9)" in K.npu_forward_violation(q, k, v, g, beta, torch.tensor([0, 7, 16]))


def test_without_fla_training_is_the_reference_with_one_warning(ascend):
    """Head dim 32 (a tiny Qwen3.5): training and no-grad on the reference; one WARNING naming what to install, one
    INFO line per mode with the reason."""
    operands = _detached(1, 8, dim=32, dtype=torch.bfloat16)
    for _ in range(3):
        assert K.select(*operands, training=True, npu_op_available=True).kernel == "reference"
    no_grad = K.select(*operands, training=False, npu_op_available=True)
    assert no_grad.kernel == "reference" and "Dk = Dv = 128 (got Dk = 32" in no_grad.reason
    warnings = [r.getMessage() for r in ascend.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in ascend.records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "flash-linear-attention>=0.5.2" in warnings[0] and "triton-ascend" in warnings[0]
    assert len(infos) == 2 and "training on the ATen reference: flash-linear-attention is not importable" in infos[0]


def test_without_fla_a_no_grad_forward_inside_the_contract_takes_torch_npu(ascend):
    operands = _detached(1, 8, dtype=torch.bfloat16)
    assert K.select(*operands, training=False, npu_op_available=True).kernel == "torch_npu"
    assert K.select(*operands, training=True, npu_op_available=True).kernel == "reference"  # inference-only op
    assert K.select(*operands, training=False, npu_op_available=False).kernel == "reference"


def test_fla_older_than_0_5_2_or_off_ascend_is_refused(stand_in_fla, monkeypatch):
    import fla
    import fla.utils

    operands = _detached(1, 8, dim=32)
    assert K.select(*operands, training=True).kernel == "fla"
    monkeypatch.setattr(fla, "__version__", "0.5.0")
    K._fla_probe.cache_clear()
    assert "0.5.0 is older than 0.5.2" in K.select(*operands, training=True).reason
    monkeypatch.setattr(fla, "__version__", "0.5.2")
    monkeypatch.setattr(fla.utils, "IS_NPU", False)
    K._fla_probe.cache_clear()
    assert "IS_NPU is False" in K.select(*operands, training=True).reason
    monkeypatch.setattr(fla.utils, "IS_NPU", True)
    K._fla_probe.cache_clear()
    assert "Dk = 512" in K.select(*_detached(1, 2, dim=512), training=True).reason
    assert "one dtype" in K.select(*operands[:2], operands[2].half(), *operands[3:], training=True).reason


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_ascend_kernels_train_on_fla(stand_in_fla, dtype, tol):
    """Training with FLA bound: the forward and the backward call FLA's public entry with its arguments (int64
    cu_seqlens and their CPU copy, fp32 g, key-first fp32 state), the gradients equal the reference's."""
    q, k, v, g, beta = _operands(1, 70, heads=2, dim=32, dtype=dtype)
    cu = torch.tensor([0, 5, 70], dtype=torch.int32)
    state = (torch.randn(2, 2, 32, 32) * 0.05).requires_grad_()
    args = (q, k, v, g, beta, cu, state, 32 ** -0.5, True)
    with torch.no_grad():
        out, final = G._npu_forward_kernel(*(t.detach() if isinstance(t, torch.Tensor) else t for t in args),
                                           training=True)
    calls = stand_in_fla.CALLS
    assert len(calls) == 1 and not calls[0]["grad_enabled"]
    assert calls[0]["cu_seqlens"] == (torch.int64, (3,), "cpu") == calls[0]["cu_seqlens_cpu"]
    assert calls[0]["q"] == (dtype, (1, 70, 2, 32), "cpu") and calls[0]["g"][0] == torch.float32
    assert calls[0]["initial_state"] == (torch.float32, (2, 2, 32, 32), "cpu")
    assert calls[0]["output_final_state"] is True and calls[0]["use_qk_l2norm_in_kernel"] is True
    ref_out, ref_final = G.reference(*args)
    assert relative_l2(out, ref_out) <= tol and relative_l2(final, ref_final) <= tol
    torch.manual_seed(1)
    grad_out, grad_state = torch.randn(out.shape, dtype=dtype), torch.randn(final.shape)
    grads = G._npu_backward_kernel(grad_out, grad_state, *(t.detach() if isinstance(t, torch.Tensor) else t
                                                           for t in args))
    assert len(calls) == 2 and calls[1]["grad_enabled"]  # FLA's forward recomputed under autograd
    want = torch.autograd.grad((ref_out, ref_final), [q, k, v, g, beta, state], (grad_out, grad_state))
    for ours, theirs in zip(grads, want):
        assert ours.dtype == theirs.dtype and relative_l2(ours, theirs) <= tol


def test_a_no_grad_forward_with_fla_is_fla_not_torch_npu(stand_in_fla):
    operands = _detached(1, 8, dtype=torch.bfloat16)
    assert K.select(*operands, training=False, npu_op_available=True).kernel == "fla"


def test_the_stand_in_has_fla_0_5_2s_signature(stand_in_fla):
    """The stand-in's entry has the wheel's exact parameters (names, kinds, defaults), read from fla-core 0.5.2's
    fla/ops/gated_delta_rule/chunk.py without importing it."""
    if not FLA_WHEEL.exists():
        pytest.skip(f"{FLA_WHEEL} is not here")
    with zipfile.ZipFile(FLA_WHEEL) as wheel:
        tree = ast.parse(wheel.read("fla/ops/gated_delta_rule/chunk.py"))
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "chunk_gated_delta_rule")
    args = function.args
    wheel_params = [a.arg for a in args.args] + [f"**{args.kwarg.arg}"]
    wheel_defaults = [ast.literal_eval(d) for d in args.defaults]
    parameters = inspect.signature(stand_in_fla.chunk_gated_delta_rule).parameters.values()
    ours = [("**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in parameters]
    defaults = [p.default for p in parameters if p.default is not inspect.Parameter.empty]
    assert ours == wheel_params and defaults == wheel_defaults
    assert any(isinstance(d, ast.Attribute) and d.attr == "disable" for d in function.decorator_list)


def test_npu_arguments_match_the_documented_recurrence(ascend):
    """What the Ascend kernel hands npu_chunk_gated_delta_rule (TND, int32 lengths, value-first bf16 state, l2norm
    outside) gives the reference's result on a stand-in following the op's documented recurrence."""
    q, k, v, g, beta = _detached(1, 13, dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 13])
    state = (torch.randn(2, 2, 128, 128) * 0.05).to(torch.bfloat16)
    assert K.npu_forward_violation(q, k, v, g, beta, cu, state) is None
    got = G.npu_forward(q, k, v, g, beta, cu, state, 128 ** -0.5, True, npu_op=_npu_stand_in)
    want = G.reference(q, k, v, g, beta, cu, state.float(), 128 ** -0.5, True)
    assert relative_l2(got[0], want[0]) < 2e-2 and relative_l2(got[1], want[1]) < 2e-2


def _npu_stand_in(query, key, value, *, beta, initial_state, actual_seq_lengths, scale, g):
    """torch_npu's documented contract (_op_plugin_docs): TND bf16, state value-first [N, Nv, Dv, Dk] bf16, lengths
    int32, g fp32, no l2norm inside, out bf16. Token by token."""
    assert value.dim() == 3 and query.dtype == key.dtype == value.dtype == beta.dtype == torch.bfloat16
    assert actual_seq_lengths.dtype == torch.int32 and g.dtype == torch.float32
    assert initial_state.dtype == torch.bfloat16 and initial_state.shape[1:] == (value.shape[1], value.shape[2],
                                                                                 query.shape[2])
    outs, finals, start = [], [], 0
    for n, length in enumerate(actual_seq_lengths.tolist()):
        state = initial_state[n].float()  # [H, Dv, Dk]
        for t in range(start, start + length):
            state = g[t].exp()[:, None, None] * state
            delta = beta[t].float()[:, None] * (value[t].float() - (state @ key[t].float()[..., None])[..., 0])
            state = state + delta[..., None] * key[t].float()[:, None, :]
            outs.append((state @ query[t].float()[..., None])[..., 0] * scale)
        finals.append(state)
        start += length
    return torch.stack(outs).to(torch.bfloat16), torch.stack(finals).to(torch.bfloat16)
