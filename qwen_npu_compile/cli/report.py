"""``qwen-npu-compile report DIR...``: read the dump folders of a finished run and say what fused.

A run with a dump dir (``dump_dir`` option or ``QWEN_NPU_DUMP_DIR``) leaves one *dump root* per process:
``dump_dir`` itself, or ``dump_dir/rank<N>/`` under torch.distributed (a verl run: one per rank), each
with ``summary.json`` and a folder per graph holding ``report.json`` (formats:
:mod:`qwen_npu_compile.dump`, :meth:`qwen_npu_compile.report.GraphReport.as_dict`). :func:`read_dumps`
finds every ``summary.json`` and ``report.json`` under the given folders (recursively) and keeps each
graph once; :func:`build_report` turns the graphs into the report; :func:`format_report` formats it for the terminal;
:func:`main` is the command (argparse lives in :mod:`qwen_npu_compile.cli`).

**One graph, two files.** A graph is identified by its dump root and its name (``g<index>_<compile
id>``, unique in its process); ``<root>/summary.json`` lists it and ``<root>/<name>/report.json`` holds
it too. When both are there, ``report.json`` wins: :func:`qwen_npu_compile.dump.write_report` writes it
first and the summary after, so it is never older. A ``report.json`` under a root without a readable summary
(a process stopped before its first summary write) is still read.

**Graphs of other runs.** Where a root's ``summary.json`` is readable, only the graphs it names are read: a
``report.json`` it does not name belongs to another process (an earlier run whose graph folders were left in
the same dump folder, or a second process writing there). Those are left out of every count, with one warning
line per root naming them (and ``other_runs`` in the JSON's ``dumps``).

**Call sites and recompiles.** The reports carry no per-layer attribution (that lives in memory,
:func:`qwen_npu_compile.worker.layer_reports`), but the graph name encodes Dynamo's compile id
(:func:`qwen_npu_compile.report.new_graph_name`: ``str(CompileId)`` with ``/`` → ``_``):
``g003_1_2`` is the process's graph 3, compiled for Dynamo frame 1 on that frame's compile 2
(``frame_id/frame_compile_id``; ``!<n>_<frame>_<compile>`` under compiled autograd, ``eager`` outside a
Dynamo compile). Dynamo numbers frames per code object (``torch/_dynamo/convert_frame.py``,
``FRAME_COUNTER`` / ``FRAME_COMPILE_COUNTER``), so a *call site* is one frame of one dump root: under
per-layer compile (:func:`qwen_npu_compile.maybe_compile`) every decoder layer runs the same frame, and
its graphs are the graphs per layer call site; each graph break adds a frame (the resume function).
``recompiles`` of a frame is the highest compile number seen (compile ``n`` is the frame's ``n+1``-th
compile; numbers that never reached ``qwen_npu``, e.g. a compile that produced no graph, still count).

**Exit status** (:func:`exit_status`): 1 when an enabled family fused less than it could, which the
reports show as (a) a refusal or near miss of a family in the graph's ``families`` (an anchor of an
enabled family that was neither fused nor already fused; refusals of *disabled* families, reason
``family '<name>' is disabled``, do not count), or (b) a graph with ``fallback`` set and a family
enabled (compiled unfused after a stage of ours failed). This is the rule of strict mode
(:func:`qwen_npu_compile.backend.refuse_in_strict_mode`). GE conversion failures and downstream
fallbacks are reported but do not change the status. 2: bad arguments (a folder that does not exist,
or one holding no readable ``summary.json`` / ``report.json``). 0 otherwise. A file that is not valid
JSON, or not a report, is skipped with a warning naming it.

The JSON written by ``--json`` is :func:`build_report`'s dict (keys documented there and in the
docs/using-the-backend.md, "Reading a run afterwards").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from qwen_npu_compile.config import ALL_FAMILIES

#: Version of the ``--json`` object (bumped when a key changes meaning; new keys do not bump it).
FORMAT = 1


#: Files read under each folder.
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.json"

#: More files than this get a progress line on stderr.
PROGRESS_FROM = 20

#: ``g<index>_<compile id>``; the compile id as :func:`qwen_npu_compile.report.new_graph_name` writes it.
_NAME = re.compile(
    r"^g(?P<index>\d+)_(?:(?P<eager>eager)|!(?P<ca>\d+)(?:_(?P<ca_frame>\d+)_(?P<ca_compile>\d+))?"
    r"|(?P<frame>\d+)_(?P<compile>\d+))$"
)

#: ``<dump_dir>/rank<N>`` (:func:`qwen_npu_compile.dump.dump_root`).
_RANK = re.compile(r"^rank(\d+)$")

_DISABLED = re.compile(r"^family '[^']+' is disabled")


class ReportError(Exception):
    """Bad arguments to ``report``: a folder that does not exist or holds no readable report (exit 2).

    Attributes:
        warnings: the files skipped before the error (each line names the file).
    """

    def __init__(self, message: str, warnings: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.warnings = list(warnings)


@dataclasses.dataclass
class Graph:
    """One compiled graph as read from a dump.

    Attributes:
        dump: the dump root it belongs to, as shown (the folder given on the command line, joined with
            the root's path below it).
        rank: ``N`` of a ``rank<N>`` dump root, else None.
        name: the graph name, ``g<index>_<compile id>``.
        data: the ``report.json`` payload (:meth:`qwen_npu_compile.report.GraphReport.as_dict`).
        file: the file it was read from (a ``report.json``, or the ``summary.json`` that lists it).
    """

    dump: str
    rank: int | None
    name: str
    data: dict
    file: str

    @property
    def compile_id(self) -> dict:
        """The Dynamo compile id in the name: ``{"index", "frame", "compile", "compiled_autograd", "id"}``
        (``frame``/``compile`` None for ``eager`` or an unparsable name; ``id`` as Dynamo prints it)."""
        match = _NAME.match(self.name)
        if match is None:
            return {"index": None, "frame": None, "compile": None, "compiled_autograd": None, "id": None}
        groups = match.groupdict()
        index = int(groups["index"])
        if groups["eager"]:
            return {"index": index, "frame": None, "compile": None, "compiled_autograd": None, "id": "eager"}
        if groups["ca"] is not None:
            frame = int(groups["ca_frame"]) if groups["ca_frame"] is not None else None
            compile_ = int(groups["ca_compile"]) if groups["ca_compile"] is not None else None
            text = f"!{groups['ca']}" + (f"/{frame}/{compile_}" if frame is not None else "")
            return {"index": index, "frame": frame, "compile": compile_, "compiled_autograd": int(groups["ca"]),
                    "id": text}
        frame, compile_ = int(groups["frame"]), int(groups["compile"])
        return {"index": index, "frame": frame, "compile": compile_, "compiled_autograd": None,
                "id": f"{frame}/{compile_}"}

    @property
    def families(self) -> list[str]:
        return list(self.data.get("families") or [])

    def refusals(self) -> list[dict]:
        """The ``refused`` entries, each with ``enabled``: whether its family is enabled in this graph."""
        enabled = set(self.families)
        out = []
        for entry in self.data.get("refused") or []:
            if isinstance(entry, dict):
                out.append({"family": str(entry.get("family")), "reason": str(entry.get("reason")),
                            "source": str(entry.get("source", "<unknown>")), "node": entry.get("node"),
                            "enabled": entry.get("family") in enabled})
        return out

    def missed(self) -> dict[str, int]:
        """Per enabled family, its refusals and near misses in this graph (what it could have fused more)."""
        counts: Counter[str] = Counter(r["family"] for r in self.refusals() if r["enabled"])
        return dict(counts)

    def unfused(self) -> bool:
        """Compiled unfused although a family was enabled (``fallback`` set)."""
        return bool(self.data.get("fallback")) and bool(self.families)

    def ge_failures(self) -> list[dict]:
        ge = self.data.get("ge")
        if not isinstance(ge, dict):
            return []
        failures = ge.get("failures")
        return [failure for failure in failures if isinstance(failure, dict)] if isinstance(failures, list) else []


@dataclasses.dataclass
class Dumps:
    """What :func:`read_dumps` found.

    Attributes:
        graphs: every graph once, by dump root (in argument order) then graph index.
        roots: per dump root shown: ``{"dump", "rank", "summary": bool, "simulated", "versions"}``.
        files_read: the ``summary.json`` / ``report.json`` files parsed.
        warnings: one line per file skipped (names the file and why).
    """

    graphs: list[Graph]
    roots: list[dict]
    files_read: int
    warnings: list[str]


def _natural(name: str) -> list:
    """Sort key that puts ``rank2`` before ``rank10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _find_files(folder: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort(key=_natural)
        for name in (SUMMARY_FILE, REPORT_FILE):
            if name in filenames:
                found.append(Path(dirpath) / name)
    return found


def _load(path: Path, warnings: list[str]) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        warnings.append(f"{path}: not valid JSON ({exc}); skipped")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        warnings.append(f"{path}: cannot be read ({type(exc).__name__}: {exc}); skipped")
        return None
    if not isinstance(data, dict):
        warnings.append(f"{path}: not a qwen_npu {path.name} (a JSON {type(data).__name__}, not an object); skipped")
        return None
    return data


#: The fields of a graph's report this module reads, and their JSON types (None: absent or null is fine).
_FIELDS = {"name": str, "families": list, "fusions": dict, "already_fused": dict, "anchors": dict, "refused": list,
           "ge": dict, "downstream_fallbacks": list}


def _graph_problem(data: object) -> str | None:
    """Why ``data`` is not a graph report (:meth:`~qwen_npu_compile.report.GraphReport.as_dict`), or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if not isinstance(data.get("name"), str):
        return "no 'name'"
    for field, kind in _FIELDS.items():
        if data.get(field) is not None and not isinstance(data[field], kind):
            return f"'{field}' is a JSON {type(data[field]).__name__}, not {'an object' if kind is dict else 'a list'}"
    return None


def _progress(done: int, total: int, final: bool = False) -> None:
    if total < PROGRESS_FROM:
        return
    if sys.stderr.isatty():
        print(f"\rqwen-npu-compile report: read {done}/{total} files", end="\n" if final else "",
              file=sys.stderr, flush=True)
    elif final or done == 0:
        print(f"qwen-npu-compile report: {'read' if final else 'reading'} {total} files", file=sys.stderr, flush=True)


def read_dumps(folders: Sequence[str | os.PathLike]) -> Dumps:
    """Read every ``summary.json`` and ``report.json`` under ``folders`` (recursively).

    Args:
        folders: dump dirs, dump roots (``rank<N>`` folders) or any folder above them.

    Returns:
        :class:`Dumps`; each graph once per dump root (``report.json`` preferred over the summary's copy,
        module docstring). A root reached through two arguments is shown under the first.

    Raises:
        ReportError: a folder does not exist or is not a folder, or holds no readable report.
    """
    warnings: list[str] = []
    per_folder = [(str(folder), path, _find_files(path)) for folder, path in _folders(folders)]
    total = sum(len(files) for _, _, files in per_folder)
    _progress(0, total)

    root_label: dict[Path, str] = {}
    root_order: list[Path] = []
    from_report: dict[tuple[Path, str], Graph] = {}
    from_summary: dict[tuple[Path, str], Graph] = {}
    summaries: dict[Path, dict] = {}
    named: dict[Path, set[str]] = {}  # per root with a readable summary.json: the graphs it names
    files_read = 0
    done = 0
    for shown, path, files in per_folder:
        usable = 0
        for file in files:
            done += 1
            _progress(done, total)
            data = _load(file, warnings)
            read = _graph_entries(file, data, warnings) if data is not None else None
            if read is None:
                continue
            root, entries = read
            files_read += 1
            usable += 1
            key_root = root.resolve()
            if key_root not in root_label:
                relative = os.path.relpath(root, path)
                root_label[key_root] = shown if relative == "." else os.path.normpath(os.path.join(shown, relative))
                root_order.append(key_root)
            if file.name == SUMMARY_FILE:
                summaries.setdefault(key_root, data)
                named.setdefault(key_root, {name for name, _ in entries})
            target = from_summary if file.name == SUMMARY_FILE else from_report
            for name, graph in entries:
                label = root_label[key_root]
                rank = _RANK.match(key_root.name)
                target.setdefault((key_root, name), Graph(label, int(rank.group(1)) if rank else None, name, graph,
                                                          str(file)))
        if usable == 0:
            _progress(done, total, final=True)
            raise ReportError(
                f"no readable {SUMMARY_FILE} or {REPORT_FILE} under {shown!r}"
                f"{f' ({len(files)} found, none readable)' if files else ''}: is it a dump_dir "
                "(QWEN_NPU_DUMP_DIR, options={'dump_dir': ...}, check --dump-dir) of a run that compiled something?",
                warnings,
            )
    _progress(done, total, final=True)

    # A root's summary.json names the graphs of the process that wrote it; a report.json it does not name is
    # another run's (an earlier run left in the same dump folder, or another process that shares it): said in
    # one line per root, and not counted. Without a readable summary every report.json counts.
    others = _drop_other_runs(from_report, named, root_label, warnings)
    merged = {**from_summary, **from_report}
    order = {root: i for i, root in enumerate(root_order)}

    def sort_key(item):
        (root, name), graph = item
        index = graph.compile_id["index"]
        return order[root], index if index is not None else 1 << 62, name

    graphs = [graph for _, graph in sorted(merged.items(), key=sort_key)]
    roots = [_root_row(root, root_label[root], summaries.get(root), merged, len(others.get(root, [])))
             for root in root_order]
    return Dumps(graphs=graphs, roots=roots, files_read=files_read, warnings=warnings)


def _folders(folders: Sequence[str | os.PathLike]) -> list[tuple[str | os.PathLike, Path]]:
    """``(as given, path)`` of each folder argument.

    Raises:
        ReportError: one does not exist or is not a folder.
    """
    checked = []
    for folder in folders:
        path = Path(folder)
        if not path.exists():
            raise ReportError(f"no such folder: {str(folder)!r} (give the dump_dir of a run, or a rank<N> folder in it)")
        if not path.is_dir():
            raise ReportError(f"not a folder: {str(folder)!r} (give the dump_dir of a run, or a rank<N> folder in it)")
        checked.append((folder, path))
    return checked


def _graph_entries(file: Path, data: dict, warnings: list[str]) -> tuple[Path, list[tuple[str, dict]]] | None:
    """``(dump root, [(graph name, graph report)])`` of one parsed file: a ``summary.json`` (root: its folder; every
    well-formed entry of its ``graphs``) or a ``report.json`` (root: the folder above its graph folder). None, with a
    warning, when the file is neither; a malformed summary entry is skipped with a warning of its own."""
    if file.name == SUMMARY_FILE:
        graphs = data.get("graphs")
        if not isinstance(graphs, list):
            warnings.append(f"{file}: not a qwen_npu summary.json (no 'graphs' list); skipped")
            return None
        entries = []
        for number, graph in enumerate(graphs):
            problem = _graph_problem(graph)
            if problem is None:
                entries.append((graph["name"], graph))
            else:
                warnings.append(f"{file}: 'graphs'[{number}] is not a graph report ({problem}); skipped")
        return file.parent, entries
    problem = _graph_problem(data)
    if problem is not None:
        warnings.append(f"{file}: not a qwen_npu report.json ({problem}); skipped")
        return None
    return file.parent.parent, [(data["name"], data)]


def _drop_other_runs(from_report: dict[tuple[Path, str], Graph], named: dict[Path, set[str]],
                     root_label: dict[Path, str], warnings: list[str]) -> dict[Path, list[str]]:
    """Remove from ``from_report`` the graphs a root's ``summary.json`` does not name (``named``); one warning per
    root. Returns the removed names per root, in natural order."""
    others: dict[Path, list[str]] = {}
    for root, name in list(from_report):
        if root in named and name not in named[root]:
            others.setdefault(root, []).append(name)
            del from_report[(root, name)]
    for root, names in others.items():
        names.sort(key=_natural)
        shown_names = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.append(f"{root_label[root]}: {len(names)} graph folder(s) its {SUMMARY_FILE} does not name "
                        f"({shown_names}): graphs of another run in the same dump folder, not counted (start each "
                        f"run with an empty dump_dir)")
    return others


def _root_row(root: Path, label: str, summary: dict | None, merged: dict[tuple[Path, str], Graph],
              other_runs: int) -> dict:
    """One entry of :attr:`Dumps.roots`: where the dump root is shown, its rank, whether it had a summary, its graph
    count, the graphs of other runs left out, simulated, versions."""
    rank = _RANK.match(root.name)
    mine = [graph for (r, _), graph in merged.items() if r == root]
    found = summary or {}
    return {
        "dump": label,
        "rank": int(rank.group(1)) if rank else None,
        "summary": summary is not None,
        "graphs": len(mine),
        "other_runs": other_runs,
        "simulated": found.get("simulated", any(g.data.get("simulated") for g in mine)),
        "versions": found.get("versions") if isinstance(found.get("versions"), dict) else {},
    }


def _family_order(graphs: Iterable[Graph]) -> list[str]:
    seen: list[str] = []
    for graph in graphs:
        for family in [*graph.families, *(graph.data.get("fusions") or {}), *(graph.data.get("already_fused") or {}),
                       *(refusal["family"] for refusal in graph.refusals())]:
            if family not in seen:
                seen.append(family)
    known = [family for family in ALL_FAMILIES if family in seen]
    return known + sorted(family for family in seen if family not in ALL_FAMILIES)


def _counts(mapping: object) -> dict[str, int]:
    if not isinstance(mapping, dict):
        return {}
    return {str(key): int(value) for key, value in mapping.items() if isinstance(value, (int, float))}


def build_report(dumps: Dumps) -> dict:
    """The report of ``dumps`` as a JSON-ready dict (printed as :func:`format_report` formats it, written by ``--json``).

    Keys:
        ``format`` (:data:`FORMAT`), ``exit_status`` (:func:`exit_status`), ``why`` (one line per reason
        for status 1), ``files_read``, ``warnings`` (files skipped), ``families`` (all families seen, in
        pass order), ``dumps`` (per dump root: ``dump``, ``rank``, ``summary``, ``graphs``, ``simulated``,
        ``versions``, ``other_runs``: graph folders its summary.json does not name, not counted), ``graphs`` (per graph: ``dump``, ``rank``, ``name``, ``compile_id``, ``frame``,
        ``frame_compile``, ``compiled_autograd``, ``downstream``, ``families`` (enabled), ``fusions``,
        ``already_fused``, ``anchors``, ``missed`` (per enabled family, its refusals), ``refused``
        (count, all families), ``ge_failures`` (count), ``ge_graphs`` (count), ``fallback``,
        ``fallback_stage``, ``downstream_fallbacks`` (count), ``file``), ``totals`` (``graphs``, and
        summed over the graphs: ``fusions``, ``already_fused``, ``missed``, ``refused``,
        ``refused_disabled``, ``ge_failures``, ``unfused_graphs``, ``downstream_fallbacks``),
        ``refusals`` (grouped by source line: ``source``, ``count``, ``reasons``: ``family``,
        ``enabled``, ``reason``, ``count``, ``graphs`` as ``<dump>/<name>``), ``ge_failures``
        (grouped by source line: ``source``, ``count``, ``failures``: ``op``, ``kind``, ``error``,
        ``count``, ``graphs``), ``call_sites`` (per dump root and Dynamo frame: ``dump``, ``rank``,
        ``frame``, ``compiled_autograd``, ``graphs``, ``compiles`` (distinct compile numbers seen),
        ``recompiles`` (highest compile number), ``names``).
    """
    graphs = dumps.graphs
    families = _family_order(graphs)
    rows = []
    totals = {
        "graphs": len(graphs), "fusions": Counter(), "already_fused": Counter(), "missed": Counter(),
        "refused": 0, "refused_disabled": 0, "ge_failures": 0, "unfused_graphs": 0, "downstream_fallbacks": 0,
    }
    by_source: dict[str, dict[tuple, dict]] = defaultdict(dict)
    ge_by_source: dict[str, dict[tuple, dict]] = defaultdict(dict)
    why: list[str] = []
    for graph in graphs:
        refusals = graph.refusals()
        missed = graph.missed()
        failures = graph.ge_failures()
        where = f"{graph.dump}/{graph.name}"
        rows.append(_graph_row(graph, refusals, missed, failures))
        totals["fusions"].update(rows[-1]["fusions"])
        totals["already_fused"].update(rows[-1]["already_fused"])
        totals["missed"].update(missed)
        totals["refused"] += len(refusals)
        totals["refused_disabled"] += sum(1 for r in refusals if not r["enabled"])
        totals["ge_failures"] += len(failures)
        totals["downstream_fallbacks"] += rows[-1]["downstream_fallbacks"]
        for family, count in missed.items():
            why.append(f"{where}: {family} refused {count} time(s) although enabled")
        if graph.unfused():
            totals["unfused_graphs"] += 1
            why.append(f"{where}: compiled unfused ({graph.data.get('fallback_stage') or 'a'} stage failed): "
                       f"{graph.data.get('fallback')}")
        for refusal in refusals:
            _count_in_group(by_source[refusal["source"]], where, family=refusal["family"], enabled=refusal["enabled"],
                            reason=refusal["reason"])
        for failure in failures:
            _count_in_group(ge_by_source[str(failure.get("source", "<unknown>"))], where, op=str(failure.get("op")),
                            kind=str(failure.get("kind", "converter")), error=str(failure.get("error")))

    def grouped(table: dict[str, dict[tuple, dict]], inner: str) -> list[dict]:
        out = [{"source": source, "count": sum(g["count"] for g in groups.values()),
                inner: sorted(groups.values(), key=lambda g: -g["count"])} for source, groups in table.items()]
        return sorted(out, key=lambda g: (-g["count"], g["source"]))

    status = 1 if why else 0
    return {
        "format": FORMAT,
        "exit_status": status,
        "why": why,
        "files_read": dumps.files_read,
        "warnings": list(dumps.warnings),
        "families": families,
        "dumps": dumps.roots,
        "graphs": rows,
        "totals": {key: dict(value) if isinstance(value, Counter) else value for key, value in totals.items()},
        "refusals": grouped(by_source, "reasons"),
        "ge_failures": grouped(ge_by_source, "failures"),
        "call_sites": _call_sites(graphs),
    }


def _graph_row(graph: Graph, refusals: list[dict], missed: dict[str, int], failures: list[dict]) -> dict:
    """One entry of the report's ``graphs`` (keys: :func:`build_report`)."""
    cid = graph.compile_id
    ge = graph.data.get("ge") if isinstance(graph.data.get("ge"), dict) else None
    fallbacks = graph.data.get("downstream_fallbacks") or []  # a list (_graph_problem)
    return {
        "dump": graph.dump, "rank": graph.rank, "name": graph.name, "compile_id": cid["id"],
        "frame": cid["frame"], "frame_compile": cid["compile"], "compiled_autograd": cid["compiled_autograd"],
        "downstream": graph.data.get("downstream"), "families": graph.families,
        "fusions": _counts(graph.data.get("fusions")), "already_fused": _counts(graph.data.get("already_fused")),
        "anchors": _counts(graph.data.get("anchors")), "missed": missed, "refused": len(refusals),
        "ge_failures": len(failures),
        "ge_graphs": len(ge["graphs"]) if ge and isinstance(ge.get("graphs"), list) else 0,
        "fallback": graph.data.get("fallback"), "fallback_stage": graph.data.get("fallback_stage"),
        "downstream_fallbacks": len(fallbacks) if isinstance(fallbacks, list) else 0, "file": graph.file,
    }


def _count_in_group(groups: dict[tuple, dict], where: str, **fields) -> None:
    """Count one refusal or GE failure (``fields``, its identity within a source line) seen in graph ``where``."""
    group = groups.setdefault(tuple(fields.values()), {**fields, "count": 0, "graphs": []})
    group["count"] += 1
    if where not in group["graphs"]:
        group["graphs"].append(where)


def _call_sites(graphs: Sequence[Graph]) -> list[dict]:
    """The report's ``call_sites``: graphs grouped per dump root and Dynamo frame (one site per graph where the
    compile id names no frame), in order of first appearance (keys: :func:`build_report`)."""
    sites: dict[tuple, dict] = {}
    for graph in graphs:
        cid = graph.compile_id
        key = (graph.dump, cid["compiled_autograd"], cid["frame"], cid["id"] if cid["frame"] is None else None)
        site = sites.setdefault(key, {
            "dump": graph.dump, "rank": graph.rank,
            "frame": cid["frame"] if cid["frame"] is not None else (cid["id"] or "?"),
            "compiled_autograd": cid["compiled_autograd"], "graphs": 0, "_compiles": set(), "names": []})
        site["graphs"] += 1
        site["names"].append(graph.name)
        if cid["compile"] is not None:
            site["_compiles"].add(cid["compile"])
    for site in sites.values():
        compiles = site.pop("_compiles")
        site["compiles"] = len(compiles)
        site["recompiles"] = max(compiles) if compiles else 0
    return list(sites.values())


def exit_status(report: dict) -> int:
    """1 when an enabled family fused less than it could (module docstring), else 0."""
    return report["exit_status"]


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Aligned text columns: the first two and the last left-aligned, counts right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = []
    left = {0, 1, len(header) - 1}
    for row in [header, *rows]:
        cells = [str(cell).ljust(width) if i in left else str(cell).rjust(width)
                 for i, (cell, width) in enumerate(zip(row, widths))]
        lines.append(indent + "  ".join(cells).rstrip())
    return lines


def _family_cell(row: dict, family: str) -> str:
    if family not in row["families"]:
        return "off"
    cell = str(row["fusions"].get(family, 0))
    if row["already_fused"].get(family):
        cell += f"+{row['already_fused'][family]}a"
    if row["missed"].get(family):
        cell += f" !{row['missed'][family]}"
    return cell


def format_report(report: dict) -> str:
    """The human-readable report (what ``report`` prints without ``--json -``)."""
    families = report["families"]
    totals = report["totals"]
    out = [f"qwen-npu-compile report: {totals['graphs']} graph(s) in {len(report['dumps'])} dump folder(s) "
           f"({report['files_read']} file(s) read)"]
    for dump in report["dumps"]:
        versions = dump["versions"]
        stack = ", ".join(f"{key} {versions.get(key) or 'none'}" for key in ("torch", "transformers", "torch_npu")
                          if key in versions)
        out.append(f"  {dump['dump']}: {dump['graphs']} graph(s), npu ops {'simulated' if dump['simulated'] else 'real'}"
                   f"{'; ' + stack if stack else ''}{'' if dump['summary'] else '; no summary.json (report.json files only)'}")
    out.append("")
    out.append("fusions per graph (fused; +Na: already fused in the captured graph; !N: refused although enabled; "
               "off: family disabled)")
    header = ["dump", "graph", *families, "refused", "GE failed", "downstream"]
    rows = []
    for row in report["graphs"]:
        notes = row["downstream"] or "?"
        if row["fallback"]:
            notes += f"; UNFUSED ({row['fallback_stage'] or '?'}): {row['fallback']}"
        if row["downstream_fallbacks"]:
            notes += f"; {row['downstream_fallbacks']} downstream fallback(s)"
        rows.append([row["dump"], row["name"], *(_family_cell(row, f) for f in families), str(row["refused"]),
                     str(row["ge_failures"]), notes])
    total_cells = []
    for family in families:
        cell = str(totals["fusions"].get(family, 0))
        if totals["already_fused"].get(family):
            cell += f"+{totals['already_fused'][family]}a"
        if totals["missed"].get(family):
            cell += f" !{totals['missed'][family]}"
        total_cells.append(cell)
    rows.append(["total", f"{totals['graphs']} graph(s)", *total_cells, str(totals["refused"]),
                 str(totals["ge_failures"]), ""])
    out.extend(_table(header, rows))
    out.append("  (counts are per graph; a graph that several decoder layers run is counted once)")

    out.append("")
    if report["refusals"]:
        out.append(f"refusals by source line ({totals['refused']}: {totals['refused'] - totals['refused_disabled']} "
                   f"of enabled families, {totals['refused_disabled']} of disabled ones)")
        for group in report["refusals"]:
            out.append(f"  {group['source']}  ({group['count']})")
            for reason in group["reasons"]:
                state = "enabled" if reason["enabled"] else "disabled"
                graphs = ", ".join(reason["graphs"][:3]) + (f", ... {len(reason['graphs']) - 3} more"
                                                           if len(reason["graphs"]) > 3 else "")
                out.append(f"    {reason['count']:>4} x {reason['family']} ({state}): {reason['reason']}  [{graphs}]")
    else:
        out.append("refusals by source line: none")

    out.append("")
    if report["ge_failures"]:
        out.append(f"GE conversion failures by source line ({totals['ge_failures']})")
        for group in report["ge_failures"]:
            out.append(f"  {group['source']}  ({group['count']})")
            for failure in group["failures"]:
                graphs = ", ".join(failure["graphs"][:3]) + (f", ... {len(failure['graphs']) - 3} more"
                                                            if len(failure["graphs"]) > 3 else "")
                out.append(f"    {failure['count']:>4} x {failure['op']} ({failure['kind']}): {failure['error']}  [{graphs}]")
    else:
        converted = sum(1 for row in report["graphs"] if row["ge_graphs"])
        out.append(f"GE conversion failures: none ({converted} graph(s) went through torchair's GE conversion)")

    out.append("")
    out.append("graphs per call site (a Dynamo frame; under per-layer compile all decoder layers share one; "
               "recompiles = highest compile number of the frame)")
    site_rows = []
    for site in report["call_sites"]:
        frame = str(site["frame"])
        if site["compiled_autograd"] is not None:
            frame = f"!{site['compiled_autograd']}/{frame}"
        names = ", ".join(site["names"][:4]) + (f", ... {len(site['names']) - 4} more" if len(site["names"]) > 4 else "")
        site_rows.append([site["dump"], frame, str(site["graphs"]), str(site["compiles"]), str(site["recompiles"]), names])
    out.extend(_table(["dump", "frame", "graphs", "compiles", "recompiles", "names"], site_rows))

    out.append("")
    if report["why"]:
        out.append(f"status 1: enabled families fused less than they could ({len(report['why'])})")
        out.extend(f"  {line}" for line in report["why"][:20])
        if len(report["why"]) > 20:
            out.append(f"  ... {len(report['why']) - 20} more (all in --json)")
    else:
        out.append("status 0: every anchor of an enabled family fused or was already fused")
    return "\n".join(out)


def main(args) -> int:
    """Run ``report`` for parsed ``args`` (``dirs``, ``json_path``: a file, ``-`` for stdout, or None).

    Returns:
        The exit status (module docstring). Never raises for bad input: errors go to stderr.
    """
    try:
        dumps = read_dumps(args.dirs)
    except ReportError as exc:
        for line in exc.warnings:
            print(f"qwen-npu-compile report: warning: {line}", file=sys.stderr)
        print(f"qwen-npu-compile report: error: {exc}", file=sys.stderr)
        return 2
    for line in dumps.warnings:
        print(f"qwen-npu-compile report: warning: {line}", file=sys.stderr)
    report = build_report(dumps)
    text = json.dumps(report, indent=2, default=str)
    if args.json_path == "-":
        print(text)
    else:
        print(format_report(report))
        if args.json_path is not None:
            path = Path(args.json_path)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text + "\n")
            except OSError as exc:
                print(f"qwen-npu-compile report: error: cannot write --json {str(path)!r}: {exc}", file=sys.stderr)
                return 2
            print(f"report written to {path}")
    return exit_status(report)
