"""torchair FX→GE conversion of Qwen2.5-0.5B-width graphs across the settings users train with (CI).

Runs ``qwen-npu-compile check qwen2.5-0.5b --layers 2 --vocab-size 4096 --downstream torchair`` (off-NPU: torchair's
own converters from the torch_npu wheel that pairs with the installed torch, see
``qwen_npu_compile/torchair/offline``) once per combination of mode (train/infer), dtype (bf16/fp16),
attention (sdpa/eager) and sequence length (static/``--dynamic``), plus left-padded training runs
(``--left-padding``), each in its own process (importing
torchair patches torch for the whole process). Prints one line per run: the verdict, the fusion
counts, the GE op counts, every refusal with its reason and every conversion failure; writes all
results as JSON with ``--json``. Exit status 1 when any run fails (a conversion failure, a missing
fusion or parity), 0 otherwise.

    python tools/ge_matrix.py [--scope {full,quick,core} | --quick] [--json FILE] [--jobs N]

``--scope``: ``full`` (default) the 18 runs below; ``quick`` (``--quick``) the 4 bf16/sdpa combinations and one
padded run; ``core`` 4 runs: bf16/sdpa training static and left-padded dynamic, inference static and dynamic
(quick without its unpadded dynamic training run, which the padded one covers: the same dynamic training graphs
plus the padding mask). The stack matrix runs ``full`` on the primary stack, ``quick`` on the newest, ``core``
on the older stacks (``tools/stack_matrix.py``); 4 runs on 2 jobs take two rounds, 5 take three.
``--jobs N`` runs N checks at once, each with ``cpu_count // N`` threads (tracing, AOTAutograd and the GE
conversion are single-threaded Python, so 2 jobs on 2 cores take about half the time of 1); the lines are
printed in the runs' order.

The sequence length (80, or 24 in fp16) is a size no dimension of the model has: torchair's view optimisation
(``_ge_concrete_graph/continguous.py``, ``optimize_view``) compares view dims and pins a dynamic
sequence length that equals the head dim (64, check's default length) at the first compile; under
``mark_dynamic`` that is an error, under Dynamo's automatic dynamic one extra recompile (docs/limitations.md,
torchair).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Sequence length per dtype: 80 in bf16; 24 in fp16, whose CPU matmuls run slower than bf16 ones.
#: Neither equals a model dimension (see above).
SEQ_LEN = {"bf16": 80, "fp16": 24}

#: ``check --vocab-size``: the embedding and LM head rows (the preset's 151,936 otherwise). No fused op or
#: converter sees the vocab dimension. On a CPU without AVX512-BF16 (CI's 2-core AVX2 host) the LM head's
#: bf16 input gradient at V = 151,936 took ~130 s per backward, and a training run 7 min 53 s (2026-12-02;
#: CI's full matrix then ran past 90 min); at 4096 the eager bf16 step takes ~7 s. 4096 is no model dimension.
VOCAB_SIZE = 4096
MODES, DTYPES, ATTNS, SHAPES = ("train", "infer"), ("bf16", "fp16"), ("sdpa", "eager"), ("static", "dynamic")


#: Leading padding tokens of the first sequence in the padded runs (``check --left-padding``).
PADDING = 5


SCOPES = ("full", "quick", "core")


def combinations(scope: str | bool) -> list[tuple[str, ...]]:
    """(mode, dtype, attention, shape, padding) per run of ``scope`` (see the module docstring): ``full`` every
    unpadded combination plus left-padded training runs (eager and sdpa; sdpa with a dynamic length), ``quick``
    the 4 bf16/sdpa unpadded ones plus the padded dynamic sdpa training run, ``core`` quick without its unpadded
    dynamic training run. A bool is the old ``quick`` flag (True: ``quick``, False: ``full``).

    Raises:
        ValueError: an unknown scope.
    """
    scope = {True: "quick", False: "full"}.get(scope, scope) if isinstance(scope, bool) else scope
    if scope not in SCOPES:
        raise ValueError(f"unknown GE matrix scope {scope!r}; choose one of {list(SCOPES)}")
    padded = [("train", "bf16", "sdpa", "dynamic", "left_padding")]
    quick = [(mode, "bf16", "sdpa", shape, "no_padding") for mode, shape in itertools.product(MODES, SHAPES)] + padded
    if scope == "quick":
        return quick
    if scope == "core":
        return [combo for combo in quick if combo != ("train", "bf16", "sdpa", "dynamic", "no_padding")]
    return [(*combo, "no_padding") for combo in itertools.product(MODES, DTYPES, ATTNS, SHAPES)] + padded + [
        ("train", "bf16", "eager", "static", "left_padding")]


def run_one(mode: str, dtype: str, attn: str, shape: str, padding: str, folder: Path, threads: int | None = None) -> dict:
    """One ``check`` run in its own process (``threads``: its torch/OpenMP threads, default torch's); returns its
    JSON result (or the error it printed)."""
    out = folder / f"{mode}-{dtype}-{attn}-{shape}-{padding}.json"
    command = [sys.executable, "-m", "qwen_npu_compile", "check", "qwen2.5-0.5b", "--layers", "2", "--seq-len", str(SEQ_LEN[dtype]),
               "--vocab-size", str(VOCAB_SIZE),
               "--downstream", "torchair", "--mode", mode, "--dtype", dtype, "--attn", attn, "--json", str(out)]
    if shape == "dynamic":
        command.append("--dynamic")
    if padding == "left_padding":
        command += ["--left-padding", str(PADDING)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    began = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - began
    if out.exists():
        result = json.loads(out.read_text())
        result["exit"] = proc.returncode
        result["wall_seconds"] = round(seconds, 1)
        return result
    return {"exit": proc.returncode, "verdict": "ERROR", "error": (proc.stderr or proc.stdout).strip()[-2000:],
            "wall_seconds": round(seconds, 1)}


def describe(result: dict) -> list[str]:
    """The lines printed for one run."""
    if result.get("verdict") == "ERROR":
        return [f"    error: {result['error']}"]
    fused = ", ".join(f"{family} {row['fused'] + row['already_fused']}/{row['expected']}"
                      for family, row in result["fusions"].items())
    lines = [f"    fused: {fused}"]
    ge = result.get("ge") or {}
    for graph in ge.get("graphs", []):
        ops = ", ".join(f"{op} {n}" for op, n in sorted(graph.get("ops", {}).items())
                        if op[0].isupper() and any(k in op for k in ("Rms", "SwiGlu", "Rotary", "FlashAttention")))
        lines.append(f"    GE {graph['name']}: {ops}")
    lines += [f"    refused {r['family']} at {r['source']}: {r['reason']}" for r in result.get("refused", [])]
    lines += [f"    GE failure {f['op']} at {f.get('source')}: {f['error']}" for f in ge.get("failures", [])]
    lines += [f"    problem: {p}" for p in result.get("problems", [])]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ge_matrix", description=__doc__.split("\n\n")[0])
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--scope", choices=SCOPES, default="full", help="which runs (default %(default)s; see above)")
    scope.add_argument("--quick", action="store_const", const="quick", dest="scope", help="same as --scope quick")
    parser.add_argument("--json", type=Path, default=None, help="write every run's result here")
    parser.add_argument("--jobs", type=int, default=1, help="checks run at once (default 1)")
    args = parser.parse_args(argv)
    runs = combinations(args.scope)
    jobs = max(1, min(args.jobs, len(runs)))
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None
    results = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qwen_npu_ge_matrix_") as tmp, \
            concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_one, *combo, Path(tmp), threads) for combo in runs]
        for index, (combo, future) in enumerate(zip(runs, futures), 1):
            name = "-".join(combo)
            result = future.result()
            results[name] = result
            failures = len((result.get("ge") or {}).get("failures", []))
            print(f"[{index}/{len(runs)}] {name}: {result.get('verdict')} (GE failures {failures}, "
                  f"{result['wall_seconds']:.0f}s)", flush=True)
            for line in describe(result):
                print(line, flush=True)
    failed = [name for name, result in results.items() if result.get("exit") != 0 or result.get("verdict") != "PASS"]
    print(f"ge_matrix: {len(runs) - len(failed)}/{len(runs)} runs converted and passed in {time.perf_counter() - start:.0f}s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if failed:
        print("ge_matrix: FAILED: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
