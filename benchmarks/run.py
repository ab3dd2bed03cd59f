"""Run the qwen_npu benchmarks and write ``<out>/*.json`` and ``<out>/summary.md``.

Usage (from the repository root)::

    python -m benchmarks.run --out benchmarks/results          # make bench: real Qwen2.5 shapes
    python -m benchmarks.run --quick --out /tmp/bench-quick    # smoke test: tiny shapes, seconds

Parts (``--parts``, default all): ``traffic`` (kernel_traffic.json), ``moe`` (moe_traffic.json: MoE
decoder layers, ``benchmarks/moe_traffic.py``), ``qwen3_5`` (qwen3_5_traffic.json: Qwen3.5's Gated DeltaNet and
full-attention layers, ``benchmarks/qwen3_5_traffic.py``), ``compile`` (compile_cost.json), ``registration``
(registration_cost.json), ``activation_memory`` (activation_memory.json: saved-for-backward bytes per decoder layer
per setting, ``benchmarks/activation_memory.py``; ``--plot`` also draws ``docs/figures/activation_memory.png`` from
it, which needs matplotlib). The markdown summary covers the
JSON files present in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/run.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"  # noqa: A001

from benchmarks import activation_memory, compile_cost, moe_traffic, qwen3_5_traffic, registration, traffic  # noqa: E402
from benchmarks.common import command_line, progress, with_run_metadata, write_json  # noqa: E402
from benchmarks.markdown import render_summary  # noqa: E402

PARTS = {
    "traffic": ("kernel_traffic.json", traffic.run),
    "moe": ("moe_traffic.json", moe_traffic.run),
    "qwen3_5": ("qwen3_5_traffic.json", qwen3_5_traffic.run),
    "compile": ("compile_cost.json", compile_cost.run),
    "registration": ("registration_cost.json", registration.run),
    "activation_memory": ("activation_memory.json", activation_memory.run),
}
#: The figure ``--plot`` draws from ``activation_memory.json``.
FIGURE = Path("docs/figures/activation_memory.png")


def main(argv: list[str] | None = None) -> int:
    """Run the selected parts; every JSON records versions, simulated ops, the command and timings."""
    parser = argparse.ArgumentParser(description="qwen_npu performance evidence")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 repeat: a smoke test in seconds")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)} (default: all)"
    )
    parser.add_argument("--plot", type=Path, nargs="?", const=FIGURE, default=None,
                        help=f"after the run, draw the activation-memory figure (default path {FIGURE}; needs matplotlib)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {sorted(PARTS)}")

    command = command_line() if argv is None else "python -m benchmarks.run " + " ".join(argv)
    total_start = time.perf_counter()
    # quick: the registration child (a fresh interpreter) overlaps the other parts; a full run keeps the
    # parts apart so that one part's timings are not disturbed by another's CPU use.
    child = registration.start(quick=True) if args.quick and "registration" in parts else None
    for part in parts:
        filename, fn = PARTS[part]
        progress(f"== {part} ({'quick' if args.quick else 'full'}) ==")
        start = time.perf_counter()
        if part == "registration" and child is not None:
            payload = child.finish()
            start = child.started
        elif part == "activation_memory":  # eager's and verl-style's layer times come from the traffic results
            payload = fn(quick=args.quick, results=args.out)
        else:
            payload = fn(quick=args.quick)
        elapsed = time.perf_counter() - start
        path = write_json(args.out / filename, with_run_metadata(payload, command, args.quick, elapsed))
        progress(f"wrote {path} ({elapsed:.1f}s)")

    loaded = {}
    for part, (filename, _) in PARTS.items():
        path = args.out / filename
        if path.exists():
            loaded[part] = json.loads(path.read_text())
    if args.plot is not None:
        progress(f"wrote {activation_memory.plot(loaded['activation_memory'], args.plot)}")
    summary = args.out / "summary.md"
    summary.write_text(render_summary(loaded, total_seconds=time.perf_counter() - total_start, command=command))
    progress(f"wrote {summary} (total {time.perf_counter() - total_start:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
