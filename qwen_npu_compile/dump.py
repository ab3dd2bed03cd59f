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
     "variants": {variant name: replacements summed over the graphs}}   # "variants": added in issue 13
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import torch.fx

from .config import QwenNpuConfig
from .report import GraphReport, versions

_LOCK = threading.Lock()
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


def graph_folder(config: QwenNpuConfig, graph_name: str) -> Path | None:
    """``<root>/<graph_name>``, or None when dumping is off."""
    return dump_root(config) / graph_name if config.dump_dir is not None else None


def write_graph(config: QwenNpuConfig, report: GraphReport, stage: str, gm_or_code: torch.fx.GraphModule | str) -> None:
    """Write one graph of ``report``'s compile as readable Python to ``<root>/<graph>/<stage>.py``
    (nothing when dumping is off); sets ``report.dump_path``."""
    folder = graph_folder(config, report.name)
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    report.dump_path = str(folder)
    code = gm_or_code if isinstance(gm_or_code, str) else gm_or_code.print_readable(print_output=False)
    (folder / f"{stage}.py").write_text(code)


def torchair_folder(config: QwenNpuConfig, report: GraphReport) -> Path:
    """``<root>/<graph>/torchair``, created, for torchair's GE graph dumps.

    Raises:
        ValueError: dumping is off.
    """
    folder = dump_root(config) / report.name / "torchair"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def publish(report: GraphReport, config: QwenNpuConfig) -> None:
    """Add ``report`` to its dump root's summary and write ``report.json`` and ``summary.json``
    (nothing when dumping is off). Publishing twice adds it once."""
    if config.dump_dir is None:
        return
    root = dump_root(config)
    with _LOCK:
        graphs = _SUMMARIES.setdefault(root.resolve(), [])
        if not any(graph is report for graph in graphs):
            graphs.append(report)
    write_report(report, config)


def write_report(report: GraphReport, config: QwenNpuConfig) -> None:
    """Write ``report.json`` of one graph and refresh its dump root's ``summary.json`` (the published
    graphs of that root); nothing when dumping is off."""
    if config.dump_dir is None:
        return
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
