"""Qwen3.5 in verl's default configuration (issue 26): verl 0.9.1's own packed Qwen3.5 forward
(:mod:`tests.e2e.verl_qwen3_5_run`) under ``QWEN_NPU_COMPILE=1``: one graph per layer kind over 10 packings,
exact per-layer fusions (the Gated DeltaNet as ``qwen_npu::chunk_gated_delta_rule``, varlen attention and the
partial rotary in the full-attention layer), parity with the unset run. Runs where verl and a transformers
with Qwen3.5 are installed (``tools/verl_env_check.sh``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.models.transformers.qwen3_5", reason="verl with its Qwen3.5 module (0.9.1)")

DRIVER = Path(__file__).with_name("verl_qwen3_5_run.py")
PACKINGS = 10


def _run(tmp_path: Path, name: str, **env) -> dict:
    out = tmp_path / f"{name}.json"
    base = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_NPU")}
    proc = subprocess.run([sys.executable, str(DRIVER), str(out)], env={**base, "N": str(PACKINGS), **env},
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"verl_qwen3_5_{request.param}")
    return request.param, _run(tmp, "off", DT=request.param), _run(tmp, "on", DT=request.param, QWEN_NPU_COMPILE="1")


@pytest.mark.verl
def test_one_graph_per_layer_kind_with_exact_fusions(runs):
    """4 layers (3 DeltaNet + 1 full attention), gradient checkpointing, 10 packings: 2 graphs in all, no
    recompile per packing, no layer left eager; each graph fuses exactly its layer kind's expected counts."""
    _, _, on = runs
    assert on["compiled"] == [f"model.layers.{i}" for i in range(4)]
    fusions = [graph[1] for graph in on["graphs"]]
    assert fusions == [on["expected"]["linear_attention"], on["expected"]["full_attention"]]
    assert on["expected"]["linear_attention"]["gated_delta_rule"] == 1
    assert on["expected"]["full_attention"]["attention"] == 1 and on["expected"]["full_attention"]["rotary"] == 2


@pytest.mark.verl
def test_losses_and_gradients_match_the_unset_run(runs):
    dtype, off, on = runs
    tol = 1e-4 if dtype == "fp32" else 2e-2
    assert len(on["losses"]) == len(off["losses"]) == PACKINGS
    for got, want in zip(on["losses"], off["losses"]):
        assert abs(got - want) <= tol * abs(want)
    assert on["grads"].keys() == off["grads"].keys()
    worst = max(abs(on["grads"][n] - off["grads"][n]) / max(off["grads"][n], 1e-12) for n in off["grads"])
    assert worst <= (1e-3 if dtype == "fp32" else 5e-2)
