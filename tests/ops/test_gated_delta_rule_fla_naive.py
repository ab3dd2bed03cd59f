"""``qwen_npu::chunk_gated_delta_rule`` against FLA 0.6.0's own token-by-token reference, read from the released wheel.

FLA's ``fla/ops/gated_delta_rule/naive.py`` ``naive_recurrent_gated_delta_rule`` (fla-core 0.6.0; the same file as
0.5.2's) is loaded at test time from the ``fla-core==0.6.0`` wheel (:func:`fla_wheel`: ``$QWEN_NPU_WHEELHOUSE``,
``~/.cache/qwen_npu_compile/wheels`` or ``/work/wheels``, else ``pip download --no-deps`` into the cache; skipped only
where that download fails) with ``zipimport``: just that file, nothing of it copied here. It imports only torch and
``einops.rearrange`` (used by ``naive_chunk_gated_delta_rule`` alone), so where einops is missing a shim that raises
stands in while it loads.

Its conventions (read from the file), and how the op's operands meet them:

- layout ``[B, T, H, K]`` (it transposes to ``[B, H, T, K]`` inside), ``initial_state`` / final state
  ``[B, H, K, V]`` (key-first, the op's ``[N, H, Dk, Dv]``); one sequence per batch row, so packed rows (``cu_seqlens``)
  run it sequence by sequence, each from its own initial state;
- argument order ``(q, k, v, beta, g, scale, initial_state, output_final_state)`` (beta before g: passed by keyword);
  ``g`` in log space (``h * g.exp()``), ``beta`` after the sigmoid; ``scale`` multiplies q (default ``K ** -0.5``);
- no q/k L2 norm: applied outside as FLA's kernel does it with ``use_qk_l2norm_in_kernel`` (fla-core 0.6.0
  ``fla/modules/norm/l2norm.py``: ``x / sqrt(sum(x²) + 1e-6)``);
- everything cast to fp32 inside, the output fp32;
- heads of q, k and v equal: GQA (Qwen3.5's ``linear_num_value_heads > linear_num_key_heads``) is expanded by the
  caller with ``repeat_interleave`` on both sides, as the op's contract asks (key heads expanded to the value heads).

Every case compares the forward output, the final state and the gradient of every differentiable input (q, k, v, g,
beta, initial_state; the unexpanded q/k under GQA) with autograd through the naive reference: fp32 rel-L2 <= 1e-4;
bf16 operands (q, k, v, beta; g and the state fp32, as the DeltaNet has them) rel-L2 <= 2e-2 to the fp32 reference on
the same (bf16-rounded) values, the naive reference run on the bf16 operands measured against it the same way.

The module also pins the FLA stand-in (``tests/stand_ins/fla``) pretending 0.6.0 to that wheel's entry signature, and
the op's Ascend binding (``ops/qwen_npu/gated_delta_rule_kernels.py``) to 0.6.0's entry through the stand-in.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import itertools
import logging
import os
import subprocess
import sys
import types
import zipfile
import zipimport
from pathlib import Path

import pytest
import torch

from qwen_npu_compile.ops.qwen_npu import gated_delta_rule as G
from qwen_npu_compile.ops.qwen_npu import gated_delta_rule_kernels as K
from tests.helpers.numerics import relative_l2

OP = torch.ops.qwen_npu.chunk_gated_delta_rule
FLA_CORE = "fla-core==0.6.0"
WHEEL_NAME = "fla_core-0.6.0-py3-none-any.whl"
NAIVE = "fla/ops/gated_delta_rule/naive.py"
STAND_INS = Path(__file__).resolve().parents[1] / "stand_ins"

#: rel-L2 bounds per dtype (bf16: to the fp32 reference on the same bf16-rounded values).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# --------------------------------------------------------------------------------------------------
# the wheel and FLA's naive reference


def _wheelhouses() -> list[Path]:
    places = [os.environ.get("QWEN_NPU_WHEELHOUSE"), Path.home() / ".cache" / "qwen_npu_compile" / "wheels",
              "/work/wheels"]
    return [Path(p) for p in places if p]


def find_or_download_wheel(folders: list[Path]) -> Path:
    """The fla-core 0.6.0 wheel in one of ``folders``, else downloaded (``pip download --no-deps``) into the first;
    ``pytest.skip`` where the download fails (the package registry unreachable)."""
    for folder in folders:
        if (folder / WHEEL_NAME).is_file():
            return folder / WHEEL_NAME
    target = folders[0]
    target.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                               "--retries", "1", "--timeout", "30", FLA_CORE, "-d", str(target)],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download {FLA_CORE} timed out after 300 s (package registry unreachable?)")
    if done.returncode != 0 or not (target / WHEEL_NAME).is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"pip download --no-deps {FLA_CORE} into {target} failed (registry unreachable?): {tail[0]}")
    return target / WHEEL_NAME


@pytest.fixture(scope="session")
def fla_wheel() -> Path:
    return find_or_download_wheel(_wheelhouses())


@contextlib.contextmanager
def _einops_if_missing():
    """naive.py's ``from einops import rearrange`` where einops is not installed: a module whose ``rearrange`` raises
    (only ``naive_chunk_gated_delta_rule`` calls it), in sys.modules while the file loads."""
    try:
        import einops  # noqa: F401
    except ImportError:
        shim = types.ModuleType("einops")

        def rearrange(*args, **kwargs):
            raise NotImplementedError("einops is not installed (a shim for loading FLA's naive.py)")

        shim.rearrange = rearrange
        sys.modules["einops"] = shim
        try:
            yield
        finally:
            sys.modules.pop("einops", None)
    else:
        yield


@pytest.fixture(scope="session")
def naive(fla_wheel):
    """FLA 0.6.0's ``naive_recurrent_gated_delta_rule``, loaded from the wheel's naive.py alone (not registered in
    sys.modules, no other file of FLA imported)."""
    with zipfile.ZipFile(fla_wheel) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        assert "\nVersion: 0.6.0\n" in wheel.read(metadata).decode(), f"{fla_wheel} is not fla-core 0.6.0"
        source = wheel.read(NAIVE).decode()
    imported = {n.names[0].name.split(".")[0] if isinstance(n, ast.Import) else n.module.split(".")[0]
                for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert imported <= {"torch", "einops"}, f"naive.py imports {imported}: load it with FLA, not alone"
    spec = zipimport.zipimporter(f"{fla_wheel}/{NAIVE.rsplit('/', 1)[0]}/").find_spec("naive")
    module = importlib.util.module_from_spec(spec)
    with _einops_if_missing():
        spec.loader.exec_module(module)
    return module.naive_recurrent_gated_delta_rule


def _l2norm(x):
    """FLA's ``l2norm_fwd`` (fla-core 0.6.0 ``fla/modules/norm/l2norm.py``): ``x / sqrt(sum(x²) + 1e-6)``, fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _naive_rule(naive, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    """The op's contract computed by FLA's naive reference: ``[B, T, H, D]`` operands, one naive call per packed
    sequence (``cu_seqlens``, B == 1) or one for the batch; returns ``(out [B, T, H, Dv], final [N, H, Dk, Dv])`` in
    fp32."""
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if cu_seqlens is None:
        return naive(q=q, k=k, v=v, beta=beta, g=g, scale=scale, initial_state=initial_state, output_final_state=True)
    outs, finals = [], []
    bounds = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = None if initial_state is None else initial_state[n:n + 1]
        out, final = naive(*(t[:, start:end] for t in (q, k, v)), beta=beta[:, start:end], g=g[:, start:end],
                           scale=scale, initial_state=state, output_final_state=True)
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1), torch.cat(finals)


# --------------------------------------------------------------------------------------------------
# the op against it


CASES = {
    # Qwen3.5's widths (K = V = 128), packed rows across the chunk edges (1, 63, 65 and 130 tokens), a state each
    "packed_k128_v128": dict(lengths=[1, 63, 65, 130], key_heads=2, value_heads=2, k_dim=128, v_dim=128),
    # small heads, K != V (the state's [K, V] orientation), no l2norm, a scale not K ** -0.5, GQA 2 -> 4 packed
    "packed_gqa_k32_v16_no_l2norm": dict(lengths=[3, 64, 70, 17], key_heads=2, value_heads=4, k_dim=32, v_dim=16,
                                         scale=0.3, use_qk_l2norm=False),
    # a padded batch (no cu_seqlens: each row one sequence), GQA 1 -> 3, K = V = 64
    "batch2_gqa_k64_v64": dict(batch=2, tokens=80, key_heads=1, value_heads=3, k_dim=64, v_dim=64),
}


def _leaves(case, dtype, seed=0):
    """The DeltaNet's operands for ``case``: q/k ``[B, T, Hk, K]`` (unexpanded), v ``[B, T, Hv, V]``, g ``[B, T, Hv]``
    fp32 log decay in [-0.3, 0], beta in (0, 1), an initial state ``[N, Hv, K, V]`` fp32; q, k, v, beta in ``dtype``.
    Without the l2norm, k is scaled to about unit norm (a stable recurrence)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = case.get("lengths")
    batch, tokens = (1, sum(lengths)) if lengths else (case["batch"], case["tokens"])
    sequences = len(lengths) if lengths else batch
    hk, hv, kd, vd = case["key_heads"], case["value_heads"], case["k_dim"], case["v_dim"]

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k = randn(batch, tokens, hk, kd), randn(batch, tokens, hk, kd)
    if not case.get("use_qk_l2norm", True):
        q, k = q * kd ** -0.5, k * kd ** -0.5
    v = randn(batch, tokens, hv, vd)
    g = -torch.rand(batch, tokens, hv, generator=generator) * 0.3
    beta = torch.rand(batch, tokens, hv, generator=generator) * 0.9 + 0.05
    state = randn(sequences, hv, kd, vd) * 0.05
    leaves = [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), state]
    return [t.requires_grad_() for t in leaves]


def _run(rule, leaves, case):
    """``rule(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)`` on ``leaves`` with GQA expanded;
    returns ``(out, final, gradients of every leaf)`` for fixed cotangents."""
    q, k, v, g, beta, state = leaves
    group = case["value_heads"] // case["key_heads"]
    qe, ke = (x.repeat_interleave(group, dim=2) for x in (q, k))  # transformers' expansion of the key heads
    lengths = case.get("lengths")
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)]) if lengths else None
    scale = case.get("scale", case["k_dim"] ** -0.5)
    out, final = rule(qe, ke, v, g, beta, cu_seqlens, state, scale, case.get("use_qk_l2norm", True))
    generator = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(out.shape, generator=generator).to(out.dtype),
                  torch.randn(final.shape, generator=generator).to(final.dtype)]
    grads = torch.autograd.grad((out, final), leaves, cotangents)
    return out, final, grads


NAMES = ("out", "final_state", "d_q", "d_k", "d_v", "d_g", "d_beta", "d_initial_state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_name", list(CASES))
def test_the_op_equals_flas_naive_recurrent_reference(naive, case_name, dtype):
    """The op (its CPU kernel; forward, final state, every gradient) against FLA 0.6.0's naive_recurrent_gated_delta_rule
    run per sequence: fp32 within 1e-4 rel-L2; bf16 within 2e-2 of the fp32 reference on the same rounded values."""
    case, bound = CASES[case_name], TOLERANCE[dtype]

    def naive_rule(*args):
        return _naive_rule(naive, *args)

    leaves = _leaves(case, dtype)
    ours = _run(OP, leaves, case)
    reference = _run(naive_rule, [t.detach().float().requires_grad_() for t in leaves], case)
    ours_flat = [ours[0], ours[1], *ours[2]]
    reference_flat = [reference[0], reference[1], *reference[2]]
    distances = {name: relative_l2(a, b) for name, a, b in zip(NAMES, ours_flat, reference_flat)}
    for tensor, leaf in zip(ours[2], leaves):
        assert tensor.dtype == leaf.dtype and tensor.shape == leaf.shape
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    line = f"{case_name} {str(dtype)[6:]}: max rel-L2 {max(distances.values()):.2e} ({', '.join(f'{n} {d:.1e}' for n, d in distances.items())})"
    if dtype != torch.float32:  # the naive reference on the same bf16 operands, measured the same way
        theirs = _run(naive_rule, leaves, case)
        naive_distances = [relative_l2(a, b) for a, b in zip([theirs[0], theirs[1], *theirs[2]], reference_flat)]
        line += f"; naive on bf16: max {max(naive_distances):.2e}"
        assert max(naive_distances) <= bound, naive_distances
    print(line)
    assert all(d <= bound for d in distances.values()), line


def test_the_reference_sees_each_sequence_alone(naive):
    """Guard of the comparison: run on the whole row as one sequence, FLA's naive reference differs from the op's packed
    result after the first sequence (so the per-sequence loop is what the op is checked against)."""
    case = CASES["packed_k128_v128"]
    q, k, v, g, beta, state = (t.detach() for t in _leaves(case, torch.float32))
    cu_seqlens = torch.tensor([0, *itertools.accumulate(case["lengths"])])
    ours, _ = OP(q, k, v, g, beta, cu_seqlens, state, 128 ** -0.5, True)
    whole, _ = naive(q=_l2norm(q), k=_l2norm(k), v=v, beta=beta, g=g, scale=128 ** -0.5, initial_state=state[:1])
    assert relative_l2(ours[:, :1], whole[:, :1]) <= 1e-5 and relative_l2(ours[:, 1:], whole[:, 1:]) > 1e-2


# --------------------------------------------------------------------------------------------------
# the FLA stand-in pretending 0.6.0, and the op's Ascend binding on it


@pytest.fixture
def fla_0_6_0(monkeypatch, caplog):
    """The stand-in FLA pretending 0.6.0, on Ascend's triton (IS_NPU), the kernel choice on CPU tensors."""
    monkeypatch.setattr(K, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(K, "_logged", set())
    monkeypatch.syspath_prepend(str(STAND_INS))
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    import fla
    import fla.ops.gated_delta_rule as entry
    import fla.utils

    fla.pretend("0.6.0")
    monkeypatch.setattr(fla.utils, "IS_NPU", True)
    entry.CALLS.clear()
    K._fla_probe.cache_clear()
    caplog.set_level(logging.INFO, logger="qwen_npu_compile")
    yield entry
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        sys.modules.pop(name)
    K._fla_probe.cache_clear()


def test_the_stand_in_has_fla_0_6_0s_signature(fla_wheel, fla_0_6_0):
    """The stand-in's 0.6.0 entry has the wheel's parameters (names, defaults), read from fla-core 0.6.0's chunk.py
    without importing it, and is wrapped by torch.compiler.disable as a whole (the wheel's outermost decorator)."""
    with zipfile.ZipFile(fla_wheel) as wheel:
        tree = ast.parse(wheel.read("fla/ops/gated_delta_rule/chunk.py"))
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "chunk_gated_delta_rule")
    wheel_params = [a.arg for a in function.args.args] + [f"**{function.args.kwarg.arg}"]
    parameters = inspect.signature(fla_0_6_0.chunk_gated_delta_rule).parameters.values()
    assert [("**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in parameters] == wheel_params
    assert [p.default for p in parameters if p.default is not inspect.Parameter.empty] == \
        [ast.literal_eval(d) for d in function.args.defaults]
    assert "chunk_indices" in wheel_params
    outermost = function.decorator_list[0]
    assert isinstance(outermost, ast.Attribute) and outermost.attr == "disable"
    assert hasattr(fla_0_6_0.chunk_gated_delta_rule, "__wrapped__")  # the stand-in's: torch.compiler.disable


def test_the_stand_in_checks_chunk_indices_as_flas_kernels_need_them(fla_0_6_0):
    q, k, v = (torch.randn(1, 70, 2, 16) for _ in range(3))
    g, beta = -torch.rand(1, 70, 2) * 0.3, torch.rand(1, 70, 2)
    cu = torch.tensor([0, 5, 70])
    good = fla_0_6_0.prepare_chunk_indices(cu)
    assert good.tolist() == [[0, 0], [1, 0], [1, 1]]
    out, _ = fla_0_6_0.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu, chunk_indices=good)
    assert fla_0_6_0.CALLS[-1]["version"] == "0.6.0" and fla_0_6_0.CALLS[-1]["chunk_indices"][1] == (3, 2)
    with pytest.raises(AssertionError, match="are not FLA's"):
        fla_0_6_0.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu, chunk_indices=good[:2])
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        fla_0_6_0.chunk_gated_delta_rule(*(t.expand(2, *t.shape[1:]) for t in (q, k, v, g, beta)), cu_seqlens=cu,
                                         cu_seqlens_cpu=cu)


def test_the_ascend_binding_trains_on_fla_0_6_0(fla_0_6_0):
    """With 0.6.0 bound, the op's FLA kernel passes 0.5.2's keywords (no chunk_indices: FLA builds them from the host
    copy of cu_seqlens), forward and backward; results equal the reference's."""
    q, k, v = (torch.randn(1, 70, 2, 32).requires_grad_() for _ in range(3))
    g, beta = (-torch.rand(1, 70, 2) * 0.3).requires_grad_(), torch.rand(1, 70, 2).requires_grad_()
    state = (torch.randn(2, 2, 32, 32) * 0.05).requires_grad_()
    args = (q, k, v, g, beta, torch.tensor([0, 5, 70], dtype=torch.int32), state, 32 ** -0.5, True)
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    assert K.select(*detached[:7], training=True).kernel == "fla"
    with torch.no_grad():
        out, final = G._npu_forward_kernel(*detached, training=True)
    grads = G._npu_backward_kernel(torch.ones_like(out), torch.ones_like(final), *detached)
    calls = fla_0_6_0.CALLS
    assert [(c["version"], c["grad_enabled"], c["chunk_indices"]) for c in calls] == [("0.6.0", False, None),
                                                                                       ("0.6.0", True, None)]
    assert calls[0]["cu_seqlens"] == (torch.int64, (3,), "cpu") == calls[0]["cu_seqlens_cpu"]
    ref_out, ref_final = G.reference(*args)
    want = torch.autograd.grad((ref_out, ref_final), [q, k, v, g, beta, state],
                               (torch.ones_like(ref_out), torch.ones_like(ref_final)))
    assert relative_l2(out, ref_out) <= 1e-5 and relative_l2(final, ref_final) <= 1e-5
    assert all(relative_l2(a, b) <= 1e-5 for a, b in zip(grads, want))


def test_an_fla_entry_without_the_keywords_is_refused(fla_0_6_0, monkeypatch):
    """A later release that renamed a keyword the binding passes: the reference runs, and the reason says which."""
    def renamed(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, offsets=None, offsets_cpu=None):
        raise AssertionError("not called")

    monkeypatch.setattr(fla_0_6_0, "chunk_gated_delta_rule", renamed)
    K._fla_probe.cache_clear()
    choice = K.select(*(torch.randn(1, 8, 2, 16) for _ in range(3)), -torch.rand(1, 8, 2), torch.rand(1, 8, 2),
                      training=True)
    assert choice.kernel == "reference" and "takes no cu_seqlens, cu_seqlens_cpu" in choice.reason
    assert ">=0.5.2,<0.7" in choice.reason
