"""Helpers shared by the benchmark parts: run metadata, JSON writing, small statistics."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

MIB = 1024**2


def command_line() -> str:
    """The command that started this process, as a user would type it (``python -m benchmarks.run ...``)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(os.path.join("benchmarks", "run.py")):
        argv[0] = "-m benchmarks.run"
        return "python " + " ".join([argv[0], *map(shlex.quote, argv[1:])])
    return "python " + " ".join(map(shlex.quote, argv))


def run_metadata(command: str | None = None) -> dict:
    """What every results file records: versions, simulated ops, the command, the host and its load.

    Args:
        command: the command line to record; default :func:`command_line`.
    """
    import torch

    from qwen_npu_compile import ensure_npu_ops
    from qwen_npu_compile.report import versions

    status = ensure_npu_ops()
    try:
        load = list(os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        load = None
    return {
        "command": command or command_line(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "npu_ops": {"simulated": status.simulated, "reason": status.reason},
        "host": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1_5_15min": load,
        },
    }


def with_run_metadata(payload: dict, command: str, quick: bool, seconds: float) -> dict:
    """A results file's content: ``meta`` (:func:`run_metadata` of ``command``, whether the run was ``--quick``, the
    part's wall time ``part_seconds`` rounded to 0.1 s), then ``payload``."""
    return {"meta": {**run_metadata(command), "quick": quick, "part_seconds": round(seconds, 1)}, **payload}


def write_json(path: Path, data: dict) -> Path:
    """Write ``data`` as indented JSON (via a ``.tmp`` file, so a crash never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (seconds, or anything)."""
    return float(statistics.median(values))


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares line ``y = slope·x + intercept``.

    Args:
        xs: e.g. layer counts.
        ys: e.g. seconds.

    Returns:
        ``{"slope": ..., "intercept": ...}`` in the units of ys per unit of xs (seconds per layer).
    """
    fit = statistics.linear_regression(list(map(float, xs)), list(map(float, ys)))
    return {"slope": fit.slope, "intercept": fit.intercept}


def progress(message: str) -> None:
    """One progress line on stderr, flushed (``make bench`` shows what it is doing)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)
