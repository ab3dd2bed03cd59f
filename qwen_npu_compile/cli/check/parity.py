"""Parity of a compiled run with eager: the one definition, used by ``check`` and by the tests.

fp32: the relative L2 error ``||compiled - eager|| / ||eager||`` (gradients: all parameters together)
must stay within :data:`FP32_TOLERANCE`; fp32 differences come from reassociation only.

Half precision (bf16/fp16) is judged against an fp32 reference run of the same weights, as
torch._dynamo's accuracy checker does (``torch._dynamo.utils.same`` with ``fp64_ref``): the fused
kernels compute in fp32 and round once where HF rounds intermediate results, so neither run is
"exact"; the compiled run passes when its error to the fp32 reference is at most
:data:`HALF_MULTIPLIER` times eager's own error, plus :data:`HALF_SLACK`.
"""

from __future__ import annotations

import torch

#: fp32 bounds of the relative L2 error, per quantity (docs/check.md, "Parity").
FP32_TOLERANCE = {"logits": 1e-5, "gradients": 1e-4}
#: Half precision: compiled's relative L2 error to the fp32 reference <= HALF_MULTIPLIER x eager's + HALF_SLACK.
HALF_MULTIPLIER = 2.0
HALF_SLACK = 1e-3

#: What :func:`judge_runs` checks, in words (``check``'s JSON ``parity.metric``).
METRIC = (
    "rel l2 = ||a-b||/||b||; fp32: compiled vs eager <= bound; half precision: compiled's rel l2 "
    f"to an fp32 reference <= {HALF_MULTIPLIER:g} x eager's + {HALF_SLACK:g}"
)


#: Elements per block of the error computations: their fp32 temporaries stay below 16 MiB each, however
#: large the tensor (a 128k-vocab embedding's gradient is 525 M elements; cast whole, both sides and
#: their difference would be three 2 GiB temporaries).
BLOCK_ELEMENTS = 1 << 22


def _blocks(actual, expected):
    """Matching flat blocks of ``actual`` and ``expected``, each cast to fp32."""
    a, e = actual.reshape(-1), expected.reshape(-1)
    if a.numel() != e.numel():
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    for start in range(0, max(e.numel(), 1), BLOCK_ELEMENTS):
        yield a[start:start + BLOCK_ELEMENTS].float(), e[start:start + BLOCK_ELEMENTS].float()


def relative_l2(actual, expected) -> float:
    """``||a - e||_2 / ||e||_2`` over one tensor or a dict of tensors (all entries together).

    Norms are taken in fp32 per block of :data:`BLOCK_ELEMENTS` and combined in Python floats. Returns
    0.0 when both are zero, ``inf`` when only the reference is.
    """
    pairs = [(actual[name], expected[name]) for name in expected] if isinstance(expected, dict) else [(actual, expected)]
    diff = norm = 0.0
    for a, e in pairs:
        for a_block, e_block in _blocks(a, e):
            diff += torch.linalg.vector_norm(a_block - e_block).item() ** 2
            norm += torch.linalg.vector_norm(e_block).item() ** 2
    diff, norm = diff ** 0.5, norm ** 0.5
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def max_abs_error(actual, expected) -> float:
    """``max |a - e|`` over one tensor or a dict of tensors (in fp32 blocks of :data:`BLOCK_ELEMENTS`)."""
    if isinstance(expected, dict):
        return max((max_abs_error(actual[n], e) for n, e in expected.items()), default=0.0)
    if expected.numel() == 0:
        return 0.0
    return max((a - e).abs().max().item() for a, e in _blocks(actual, expected))


def judge_parity(compiled, eager, reference, fp32_tolerance: float) -> dict:
    """Parity of one quantity (logits or the gradient dict) of the compiled run.

    Args:
        compiled, eager: the compiled and eager results (tensor or ``{name: tensor}``).
        reference: the fp32 reference results for half-precision runs, None for fp32 runs.
        fp32_tolerance: the relative L2 bound of an fp32 run.

    Returns:
        ``{"max_abs", "rel_l2"}`` (compiled vs eager), and for half precision also
        ``"eager_rel_l2_to_fp32"``, ``"compiled_rel_l2_to_fp32"``; ``"bound"``, ``"ok"``, ``"judged"``.
    """
    row = {"max_abs": max_abs_error(compiled, eager), "rel_l2": relative_l2(compiled, eager)}
    if reference is None:
        row.update(bound=fp32_tolerance, ok=row["rel_l2"] <= fp32_tolerance, judged="rel_l2 vs eager")
        return row
    eager_err = relative_l2(eager, reference)
    compiled_err = relative_l2(compiled, reference)
    bound = HALF_MULTIPLIER * eager_err + HALF_SLACK
    row.update(eager_rel_l2_to_fp32=eager_err, compiled_rel_l2_to_fp32=compiled_err, bound=bound,
               ok=compiled_err <= bound, judged="rel_l2 to fp32 reference")
    return row


def judge_runs(compiled, eager, reference=None) -> dict:
    """Parity of a compiled run: ``{"logits": row, "gradients": row or None}`` (rows of :func:`judge_parity`).

    Args:
        compiled, eager: ``(logits, {parameter name: gradient})`` of the two runs (see
            :func:`qwen_npu_compile.cli.check.harness.run_model`); the gradient dicts are empty in inference.
        reference: the same pair from an fp32 run of the same weights (half precision), else None.

    ``"gradients"`` is None when there are no gradients or the two runs' parameter names differ
    (:func:`gradient_mismatch` names them).
    """
    logits = judge_parity(compiled[0], eager[0], reference and reference[0], FP32_TOLERANCE["logits"])
    gradients = None
    if eager[1] and not gradient_mismatch(compiled, eager):
        gradients = judge_parity(compiled[1], eager[1], reference and reference[1], FP32_TOLERANCE["gradients"])
    return {"logits": logits, "gradients": gradients}


def gradient_mismatch(compiled, eager) -> list[str]:
    """Parameter names that have a gradient in only one of the two runs (sorted)."""
    return sorted(set(eager[1]) ^ set(compiled[1]))


def problems(rows: dict) -> list[str]:
    """One line per quantity of :func:`judge_runs`' result that broke its bound."""
    return [f"{what} parity: {row['judged']} {row.get('compiled_rel_l2_to_fp32', row['rel_l2']):.2e} > bound {row['bound']:.2e}"
            for what, row in rows.items() if row is not None and not row["ok"]]
