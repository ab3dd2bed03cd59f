"""The one-time cost of building the pattern passes, measured in a fresh process: wall seconds on this host, and
counts of ``register_replacement`` calls.

Each family traces and registers a pattern variant (``register_replacement``) the first time one of its
anchor ops occurs in a graph being fused (:meth:`qwen_npu_compile.fusion.family.FamilyPass.ensure_registered`),
once per process: an SDPA model never registers the eager-attention variants. This
module runs itself as a child process (``python -m benchmarks.registration --child OUT.json``) so that
nothing is registered yet, and there:

1. warms up Dynamo + AOTAutograd with an untimed ``aot_eager`` compile (their own first-use cost is not
   ours; skipped in ``--quick`` runs, where the child overlaps the other parts);
2. compiles model A (tiny Qwen2, 2 layers) with ``backend="qwen_npu"`` (training step): the first
   compile, which registers every family;
3. compiles model B (a different tiny Qwen2: 3 layers, hidden 96) the same way: the second compile;
4. calls ``ensure_registered(graph)`` once more per family on a graph that needs nothing new (the
   cached path every fuse takes: a scan of the graph's ops).

``register_replacement`` calls are counted by wrapping Inductor's function, so "the second compile does
not pay registration" is a count (0), not only a timing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import progress


def time_compile(model, backend: str, input_ids) -> dict:
    """Wall time of the first (compiling) training step with a registered backend.

    Args:
        model: the model.
        backend: ``"qwen_npu"`` (``downstream="aot_eager"``) or another registered backend name.
        input_ids: ``[B, S]`` token ids.

    Returns:
        ``{"first_s"}`` and, for qwen_npu, ``"canonicalize_s"``, ``"fuse_s"`` (from the graph reports) and
        ``"graphs"``; seconds.
    """
    import torch

    from qwen_npu_compile.report import SUMMARY, get_reports

    from .compile_cost import training_step

    torch._dynamo.reset()
    SUMMARY.clear()
    options = {"downstream": "aot_eager"} if backend == "qwen_npu" else None
    compiled = torch.compile(model, backend=backend, options=options)
    start = time.perf_counter()
    training_step(model, compiled, input_ids)
    result = {"first_s": time.perf_counter() - start}
    if backend == "qwen_npu":
        reports = get_reports()
        result["graphs"] = len(reports)
        result["canonicalize_s"] = sum(r.seconds.get("canonicalize", 0.0) for r in reports)
        result["fuse_s"] = sum(r.seconds.get("fuse", 0.0) for r in reports)
    torch._dynamo.reset()
    return result


def _child(out_path: Path, warm_up: bool = True) -> None:
    """Measure in this (fresh) process and write the results to ``out_path`` (JSON)."""
    start = time.perf_counter()
    import torch  # noqa: F401  (import cost is not ours)
    from torch._inductor import pattern_matcher as pm

    import_torch_inductor_s = time.perf_counter() - start
    calls = {"n": 0}
    original = pm.register_replacement

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    pm.register_replacement = counting  # fusion/family.py calls pm.register_replacement at registration time

    start = time.perf_counter()
    from qwen_npu_compile import ensure_npu_ops
    from qwen_npu_compile.config import ALL_FAMILIES
    from qwen_npu_compile.patterns import get_family_pass

    status = ensure_npu_ops()
    import_ours_s = time.perf_counter() - start

    from .compile_cost import tiny_model

    input_ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    if warm_up:
        time_compile(tiny_model(1), "aot_eager", input_ids)  # Dynamo/AOT first-use, untimed

    def registered() -> dict:
        return {f: get_family_pass(f).registration_seconds for f in ALL_FAMILIES}

    before = registered()
    calls_before = calls["n"]
    first = time_compile(tiny_model(2), "qwen_npu", input_ids)
    after_first = registered()
    calls_first = calls["n"] - calls_before
    second = time_compile(tiny_model(3, hidden=96), "qwen_npu", input_ids)
    after_second = registered()
    calls_second = calls["n"] - calls_before - calls_first

    registered = {family: len(get_family_pass(family).variants) for family in ALL_FAMILIES}
    cached = {}
    for family in ALL_FAMILIES:
        t0 = time.perf_counter()
        get_family_pass(family).ensure_registered(torch.fx.Graph())
        cached[family] = time.perf_counter() - t0

    per_family = {
        family: {
            "registration_s": after_first[family],
            "variants": registered[family],  # registered by the compiles (lazily: what their graphs needed)
            "declared_variants": len(get_family_pass(family).declared_variants),
            "cached_call_s": cached[family],
        }
        for family in ALL_FAMILIES
    }
    result = {
        "simulated": status.simulated,
        "warm_up": warm_up,
        "import_torch_and_inductor_pattern_matcher_s": import_torch_inductor_s,
        "import_qwen_npu_compile_and_ops_s": import_ours_s,
        "registered_before_first_compile": {f: v is not None for f, v in before.items()},
        "per_family": per_family,
        "registration_total_s": sum(v for v in after_first.values() if v is not None),
        "first_compile": {**first, "register_replacement_calls": calls_first},
        "second_compile": {**second, "register_replacement_calls": calls_second},
        "second_compile_pays_registration": calls_second > 0 or after_second != after_first,
    }
    out_path.write_text(json.dumps(result, indent=2, default=str))


class Child:
    """A running registration child process (see :func:`start`)."""

    def __init__(self, warm_up: bool) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.out = Path(self._tmp.name) / "child.json"
        self.started = time.perf_counter()
        command = [sys.executable, "-m", "benchmarks.registration", "--child", str(self.out)]
        if not warm_up:
            command.append("--no-warm-up")
        self.proc = subprocess.Popen(
            command,
            cwd=Path(__file__).resolve().parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def finish(self, timeout_s: float = 300.0) -> dict:
        """Wait for the child and return its measurements (the ``registration_cost.json`` payload).

        Raises:
            RuntimeError: the child failed; its stderr tail is in the message.
        """
        try:
            _, stderr = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        wall = time.perf_counter() - self.started
        try:
            if self.proc.returncode != 0:
                raise RuntimeError(f"registration child failed (rc {self.proc.returncode}):\n{stderr[-4000:]}")
            data = json.loads(self.out.read_text())
        finally:
            self._tmp.cleanup()
        data["child_wall_s"] = wall
        data["method"] = (
            "fresh interpreter; " + ("untimed aot_eager warm-up compile; " if data["warm_up"] else "no warm-up; ")
            + "compile A (2 layers, hidden 64) then B (3 layers, hidden 96) with backend='qwen_npu' (training "
            "step); registration_s = FamilyPass.registration_seconds set during A; register_replacement calls "
            "counted by wrapping Inductor's function"
        )
        progress(
            f"registration: {data['registration_total_s']:.2f}s total at first use; second compile registers "
            f"{data['second_compile']['register_replacement_calls']} patterns"
        )
        return data


def start(quick: bool = False) -> Child:
    """Start the child (``quick``: without the Dynamo warm-up compile, so it may overlap other work)."""
    progress("registration: fresh subprocess (first vs second compile) ...")
    return Child(warm_up=not quick)


def run(quick: bool = False, timeout_s: float = 300.0) -> dict:
    """Run the child in a fresh interpreter, wait, and return its measurements.

    Args:
        quick: skip the child's untimed warm-up compile.
        timeout_s: give up after this many seconds.

    Returns:
        The ``registration_cost.json`` payload (without run metadata).
    """
    return start(quick).finish(timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=Path, required=True, help="write the child's measurements here (JSON)")
    parser.add_argument("--no-warm-up", action="store_true", help="skip the untimed aot_eager warm-up compile")
    args = parser.parse_args(argv)
    _child(args.child, warm_up=not args.no_warm_up)
    return 0


if __name__ == "__main__":
    sys.exit(main())
