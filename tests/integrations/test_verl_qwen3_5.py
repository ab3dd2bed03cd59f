"""Qwen3.5 in verl's default configuration (issues 26, 34): verl 0.9.1's own packed Qwen3.5 forward
(:mod:`tests.drivers.verl_qwen3_5_run`) under ``QWEN_NPU_COMPILE=1``: one graph per layer kind over 10 packings,
exact per-layer fusions (the Gated DeltaNet as ``qwen_npu::chunk_gated_delta_rule``, varlen attention and the
partial rotary in the full-attention layer), and each sequence's logits and the gradients equal to running every
sequence alone (verl's eager path on transformers 5.9-5.10.4 leaks the DeltaNet state across sequences; ours
restarts it). Two setups that used to crash the compile (the family switched off, an FLA-like
``@torch.compiler.disable`` kernel bound on the module) train with exact counts. Runs where verl and a transformers with Qwen3.5 are installed
(``tools/verl_env_check.sh``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl.models.transformers.qwen3_5", reason="verl with its Qwen3.5 module (0.9.1)")

from tests.helpers import DRIVERS  # noqa: E402
from tests.helpers.numerics import relative_l2, worst_relative_l2  # noqa: E402

DRIVER = DRIVERS / "verl_qwen3_5_run.py"
PACKINGS = 10
#: fp32: each sequence's logits against the sequence run alone, max abs difference over max abs value (measured
#: 2.2e-6).
LOGITS_RTOL = 1e-5
#: bf16: each sequence's logits and each gradient, relative L2 distance to the fp32 truth (each sequence alone,
#: fp32), at most this times eager bf16's own (each sequence alone, bf16); measured 1.16 (logits), 1.07 (grads).
BF16_VS_EAGER = 1.5
#: fp32: the gradients (rel-L2 per parameter) after 10 packings against the same sequences run alone: summation
#: order differs (one packed backward against one per sequence); measured 7.7e-6 to 1.2e-5 worst (``A_log`` /
#: ``dt_bias`` of the first DeltaNet, sums over every token), 3e-6 for the rest.
GRADS_RTOL = 3e-5


def _run(tmp_path: Path, name: str, **env) -> tuple[dict, dict]:
    out = tmp_path / f"{name}.json"
    base = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_NPU")}
    proc = subprocess.run([sys.executable, str(DRIVER), str(out)], env={**base, "N": str(PACKINGS), **env},
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), torch.load(str(out) + ".pt")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("verl_qwen3_5")


@pytest.fixture(scope="module")
def alone(tmp):
    """Each sequence of every packing run alone, eager, per dtype: the per-sequence truth."""
    runs = {}

    def get(dtype: str):
        if dtype not in runs:
            runs[dtype] = _run(tmp, f"alone_{dtype}", DT=dtype, ALONE="1")
        return runs[dtype]

    return get


def _assert_per_sequence(run, alone) -> None:
    """fp32: every sequence's logits and the gradients equal each sequence run alone."""
    (on, on_tensors), (ref, ref_tensors) = run, alone
    assert len(on["losses"]) == len(ref["losses"]) == PACKINGS
    for got, want in zip(on["losses"], ref["losses"]):
        assert abs(got - want) <= LOGITS_RTOL * abs(want)
    for packing, reference in zip(on_tensors["logits"], ref_tensors["logits"]):
        assert [len(x) for x in packing] == [len(x) for x in reference]
        for got, want in zip(packing, reference):
            assert (got - want).abs().max() <= LOGITS_RTOL * want.abs().max()
    grads, want = on_tensors["grads"], ref_tensors["grads"]
    assert grads.keys() == want.keys()
    assert max(relative_l2(grads[n], want[n]) for n in want) <= GRADS_RTOL


def _assert_bf16_per_sequence(run, eager_bf16, truth) -> None:
    """bf16: per sequence and per gradient, no farther from the fp32 truth than eager bf16 (each alone) is."""
    (_, on), (_, eager), (_, fp32) = run, eager_bf16, truth
    for packing, eager_packing, reference in zip(on["logits"], eager["logits"], fp32["logits"]):
        for got, mine, want in zip(packing, eager_packing, reference):
            assert relative_l2(got, want) <= BF16_VS_EAGER * relative_l2(mine, want)
    for name, want in fp32["grads"].items():
        assert relative_l2(on["grads"][name], want) <= BF16_VS_EAGER * relative_l2(eager["grads"][name], want)


def _assert_graphs(on: dict, linear_attention: dict | None = None) -> None:
    """4 layers (3 DeltaNet + 1 full attention), gradient checkpointing, 10 packings: one graph per layer kind (no
    recompile per packing, no layer left eager); each graph fuses exactly its layer kind's expected counts."""
    assert on["compiled"] == [f"model.layers.{i}" for i in range(4)]
    fusions = [graph[1] for graph in on["graphs"]]
    assert fusions == [linear_attention or on["expected"]["linear_attention"], on["expected"]["full_attention"]]
    assert on["expected"]["linear_attention"]["gated_delta_rule"] == 1
    assert on["expected"]["full_attention"]["attention"] == 1 and on["expected"]["full_attention"]["rotary"] == 2


@pytest.mark.verl
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_graph_per_layer_kind_and_each_sequence_as_if_alone(dtype, tmp, alone):
    """verl's packed path compiled: 2 graphs, exact counts; every sequence's logits and the gradients equal running
    each sequence alone (bf16: no farther from the fp32 truth than eager bf16 run alone)."""
    run = _run(tmp, f"on_{dtype}", DT=dtype, QWEN_NPU_COMPILE="1")
    _assert_graphs(run[0])
    if dtype == "fp32":
        _assert_per_sequence(run, alone("fp32"))
    else:
        _assert_bf16_per_sequence(run, alone("bf16"), alone("fp32"))


@pytest.mark.verl
def test_fla_bound_module_keeps_the_op(tmp, alone):
    """An FLA-like ``@torch.compiler.disable`` kernel bound on every DeltaNet (as transformers binds FLA): no
    ``GuardOnDataDependentSymNode``, the op in the graph (FLA's kernel never called while compiled), 2 graphs over
    10 packings, per-sequence results."""
    run = _run(tmp, "on_fla", DT="fp32", QWEN_NPU_COMPILE="1", FLA="1")
    assert run[0]["fla_calls"] == []
    _assert_graphs(run[0])
    _assert_per_sequence(run, alone("fp32"))


@pytest.mark.verl
def test_family_switched_off_trains_with_verls_code(tmp):
    """``QWEN_NPU_FUSIONS`` without ``gated_delta_rule`` (verl's packed forward then crashed on unbacked offsets): verl's own DeltaNet forward runs
    outside the graph (its ``.item()`` / ``.tolist()`` never see unbacked offsets), the rest compiled with exact
    counts, losses and gradients equal to the unset run (which is verl's code too)."""
    fusions = "rms_norm,rms_norm_gated,swiglu,rotary,attention,moe"
    on, on_tensors = _run(tmp, "on_off_family", DT="fp32", QWEN_NPU_COMPILE="1", QWEN_NPU_FUSIONS=fusions, N="4")
    off, off_tensors = _run(tmp, "off", DT="fp32", N="4")
    full = {family: count for family, count in on["expected"]["full_attention"].items() if family != "gated_delta_rule"}
    zero = {family: 0 for family in full}
    # the DeltaNet layers: the graph before verl's forward (the input norm) and the one after it (residual, norm,
    # MLP; compiled again once with a dynamic T: its inputs come from the eager island, not marked dynamic)
    before, after = {**zero, "rms_norm": 1}, {**zero, "rms_norm": 1, "swiglu": 1}
    assert [graph[1] for graph in on["graphs"]] == [before, after, full, after]
    for got, want in zip(on["losses"], off["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want)
    worst = worst_relative_l2(on_tensors["grads"], off_tensors["grads"])
    assert worst <= 1e-4
