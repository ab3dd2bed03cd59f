"""Parity with eager, judged as ``qwen-npu-compile check`` judges it, and the two error measures of the tests.

The forward/backward step (``run_model``) and the parity rule (``judge_runs``) are the ``check`` harness's own
(:mod:`qwen_npu_compile.cli.check`), so the tests judge parity exactly as ``check`` does (docs/check.md, "Parity").
"""

from __future__ import annotations

import torch

from qwen_npu_compile.cli.check.harness import fp32_reference, run_model
from qwen_npu_compile.cli.check.parity import gradient_mismatch, judge_runs, problems
from qwen_npu_compile.report import SUMMARY


def assert_runs_match(compiled, eager, reference=None) -> dict:
    """``compiled`` (``(logits, grads)`` of :func:`run_model`) has parity with ``eager`` by
    :func:`qwen_npu_compile.cli.check.parity.judge_runs` (fp32 bounds; half precision against the fp32
    ``reference`` run); with gradients, both runs have them for the same parameters. Returns the rows."""
    assert not gradient_mismatch(compiled, eager), gradient_mismatch(compiled, eager)
    assert bool(compiled[1]) == bool(eager[1])
    rows = judge_runs(compiled, eager, reference)
    assert not problems(rows), rows
    return rows


def eager_and_reference(model, input_ids, train: bool, dtype, **kwargs):
    """``(eager, reference)``: :func:`run_model` of ``model`` eagerly and, for a half-precision ``dtype``,
    of an fp32 copy (the yardstick of :func:`assert_runs_match`; None for fp32)."""
    eager = run_model(model, model, input_ids, train, **kwargs)
    return eager, (fp32_reference(model, input_ids, train, **kwargs) if dtype != torch.float32 else None)


def assert_parity(model, input_ids, train: bool, dtype, options=None, dynamic=None, **kwargs):
    """Compile ``model`` with qwen_npu, compare logits and gradients against eager (and, for half
    precision ``dtype``, an fp32 reference run) with :func:`assert_runs_match`; return the reports."""
    eager, reference = eager_and_reference(model, input_ids, train, dtype, **kwargs)
    compiled = torch.compile(model, backend="qwen_npu", options=options or {}, dynamic=dynamic)
    assert_runs_match(run_model(model, compiled, input_ids, train, **kwargs), eager, reference)
    return list(SUMMARY.graphs)


def _pair(got, want) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.as_tensor(got).detach().float(), torch.as_tensor(want).detach().float()


def relative_l2(got, want) -> float:
    """``|got - want|_2 / |want|_2`` in fp32: the error of a whole tensor (an output, a gradient) against the truth
    (tensors, or lists of numbers)."""
    got, want = _pair(got, want)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def max_abs_ratio(got, want) -> float:
    """``max|got - want| / max|want|`` in fp32: the worst element's error on the scale of the largest value (tensors,
    or lists of numbers such as per-step losses)."""
    got, want = _pair(got, want)
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def worst_relative_l2(got: dict, want: dict) -> float:
    """The largest :func:`relative_l2` over ``want``'s entries (gradients by parameter name)."""
    return max(relative_l2(got[name], value) for name, value in want.items())
