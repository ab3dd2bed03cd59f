"""Dumping: the one owner of dump folders, the graph files, ``report.json`` and ``summary.json``.

With ``dump_dir`` set (option or ``QWEN_NPU_DUMP_DIR``), the *dump root* is ``dump_dir``
(``dump_dir/rank<N>`` under torch.distributed) and every compiled graph gets a folder
``<root>/<graph name>/`` holding, by stage:

- ``captured.py`` (Dynamo's graph) and ``canonical.py`` (after canonicalize: pre-autograd ATen),
- ``rewritten.py`` (after fuse and emit),
- ``aot_forward.py`` / ``aot_backward.py`` (hand off to aot_eager; the backward at the first backward
  call), ``torchair/`` (torchair's own GE dumps, with ``torchair_dump``),
- ``report.json`` (:meth:`qwen_npu_compile.report.GraphReport.as_dict`), refreshed when the hand-off
  learns more (AOT graphs, GE conversion).

``<root>/summary.json`` lists the graphs of this process dumped to that root, and only those (two
models compiled in one process with two dump dirs get one summary each)::

    {"simulated": bool, "versions": {...}, "graphs": [report.json, ...],
     "totals": {family: fusions summed over the graphs},
     "variants": {variant name: replacements summed over the graphs}}

Dumps never stop training: the first write that fails (an unwritable or vanished folder, a
full disk) logs one warning naming the folder and the error, and dumping stays off for that dump
folder for the rest of the process; with ``strict`` it raises
:class:`~qwen_npu_compile.report.FusionError` naming the dump stage instead. A ``dump_dir`` that cannot
be written at all is refused earlier, where options are validated
(:func:`qwen_npu_compile.config.dump_dir_problem`: ``qwen-npu-compile check`` exits 2).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import Counter
from pathlib import Path

import torch.fx

from .config import QwenNpuConfig
from .report import FusionError, GraphReport, versions

log = logging.getLogger("qwen_npu_compile")

_LOCK = threading.Lock()
#: dump_dir (absolute) -> why dumping to it stopped (its first failed write), for the rest of the process.
_STOPPED: dict[str, str] = {}
#: Per dump root (resolved), the published reports of the graphs dumped there, oldest first.
_SUMMARIES: dict[Path, list[GraphReport]] = {}


def dump_root(config: QwenNpuConfig) -> Path:
    """The dump folder of this process: ``dump_dir``, or ``dump_dir/rank<N>`` under torch.distributed
    (each rank compiles the same graphs and would overwrite the others' files).

    Raises:
        ValueError: ``config.dump_dir`` is None (dumping is off).
    """
    import torch.distributed as dist

    if config.dump_dir is None:
        raise ValueError("qwen_npu: dumping is off (no dump_dir); check config.dump_dir first")
    if dist.is_available() and dist.is_initialized():
        return config.dump_dir / f"rank{dist.get_rank()}"
    return config.dump_dir


def dumping(config: QwenNpuConfig) -> bool:
    """Whether dumps are written for ``config``: a ``dump_dir`` is set and no write to it has failed."""
    return config.dump_dir is not None and _key(config) not in _STOPPED


def stopped_dumps() -> dict[str, str]:
    """``{dump_dir: why dumping to it stopped}`` for every dump folder whose writes failed in this process."""
    with _LOCK:
        return dict(_STOPPED)


def _key(config: QwenNpuConfig) -> str:
    return os.path.abspath(config.dump_dir)


@contextlib.contextmanager
def _writing(config: QwenNpuConfig, what: str):
    """Run one dump write: a failure stops dumping to ``config.dump_dir`` with one warning (strict: raises).

    Raises:
        FusionError: ``config.strict`` and the write failed (chained to the error).
    """
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - a dump must never stop the user's training
        reason = f"{type(exc).__name__}: {exc}"
        if config.strict:
            raise FusionError(f"qwen_npu strict mode: the dump stage failed writing {what} under dump_dir "
                              f"{str(config.dump_dir)!r}: {reason}") from exc
        with _LOCK:
            first = _key(config) not in _STOPPED
            _STOPPED.setdefault(_key(config), reason)
        if first:
            log.warning("qwen_npu: cannot write %s under dump_dir %r (%s); dumping is off for the rest of this "
                        "process, training goes on", what, str(config.dump_dir), reason)


def write_graph(config: QwenNpuConfig, report: GraphReport, stage: str, gm_or_code: torch.fx.GraphModule | str) -> None:
    """Write one graph of ``report``'s compile as readable Python to ``<root>/<graph>/<stage>.py``
    (nothing when dumping is off); sets ``report.dump_path``. A failed write stops dumping (module docstring)."""
    if not dumping(config):
        return
    with _writing(config, f"{report.name}/{stage}.py"):
        folder = dump_root(config) / report.name
        folder.mkdir(parents=True, exist_ok=True)
        code = gm_or_code if isinstance(gm_or_code, str) else gm_or_code.print_readable(print_output=False)
        (folder / f"{stage}.py").write_text(code)
        report.dump_path = str(folder)


def torchair_folder(config: QwenNpuConfig, report: GraphReport) -> Path | None:
    """``<root>/<graph>/torchair``, created, for torchair's GE graph dumps; None when dumping is off or
    the folder cannot be created (dumping then stops, module docstring)."""
    if not dumping(config):
        return None
    with _writing(config, f"{report.name}/torchair/"):
        folder = dump_root(config) / report.name / "torchair"
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return None


def publish(report: GraphReport, config: QwenNpuConfig) -> None:
    """Add ``report`` to its dump root's summary and write ``report.json`` and ``summary.json``
    (nothing when dumping is off). Publishing twice adds it once."""
    if not dumping(config):
        return
    with _writing(config, "summary.json"):
        root = dump_root(config)
        with _LOCK:
            graphs = _SUMMARIES.setdefault(root.resolve(), [])
            if not any(graph is report for graph in graphs):
                graphs.append(report)
    write_report(report, config)


def write_report(report: GraphReport, config: QwenNpuConfig) -> None:
    """Write ``report.json`` of one graph and refresh its dump root's ``summary.json`` (the published
    graphs of that root); nothing when dumping is off. A failed write stops dumping (module docstring)."""
    if not dumping(config):
        return
    with _writing(config, f"{report.name}/report.json"):
        root = dump_root(config)
        folder = root / report.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.json").write_text(json.dumps(report.as_dict(), indent=2, default=str))
        with _LOCK:
            graphs = list(_SUMMARIES.get(root.resolve(), []))
        (root / "summary.json").write_text(json.dumps(summary(graphs), indent=2, default=str))


def summary(graphs: list[GraphReport]) -> dict:
    """The ``summary.json`` payload of ``graphs`` (format in the module docstring)."""
    totals: Counter[str] = Counter()
    variants: Counter[str] = Counter()
    for report in graphs:
        totals.update(report.fusions)
        variants.update(report.variants)
    return {
        "simulated": any(report.simulated for report in graphs),
        "versions": versions(),
        "graphs": [report.as_dict() for report in graphs],
        "totals": dict(totals),
        "variants": dict(variants),
    }
