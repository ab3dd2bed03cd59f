"""``qwen-npu-compile report DIR...`` (qwen_npu_compile/cli/report.py) on real dump folders.

One module fixture writes the dumps once (a tiny Qwen2 compiled per layer by ``maybe_compile`` with
``QWEN_NPU_DUMP_DIR``, as verl's workers do): ``run/rank0`` (two sequence lengths: a recompile of the
layer's frame) and ``run/rank1`` (a fresh "process": Dynamo and the report index reset, one length);
``patched`` (RMSNorm monkey-patched to npu_rms_norm, as verl's ``npu_patch`` does: already fused),
``refused`` (an enabled family refuses: SwiGLU gate/up dtype mismatch), ``unfused`` / ``fell_back``
(an RMSNorm whose emit stage / aot_eager hand-off fails: compiled unfused / run eagerly), ``disabled`` (RMSNorm compiled
with only swiglu enabled: a refusal of a disabled family) and ``ge`` (a graph whose torchair conversion
failed: the report objects of the GE check, :class:`~qwen_npu_compile.torchair.offline.GeResults`,
written by :func:`qwen_npu_compile.dump.publish`, since the real off-NPU conversion costs a minute in a
subprocess; ``tests/torchair/test_torchair_offline.py`` covers that the conversion fills them).
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from qwen_npu_compile import cli, dump, handoff, maybe_compile
from qwen_npu_compile.cli.check.models import tiny_qwen2_config
from qwen_npu_compile.config import ALL_FAMILIES, QwenNpuConfig
from qwen_npu_compile.graph import emit
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.report import SUMMARY, GraphReport
from qwen_npu_compile.torchair.offline import GeFailure, GeGraph, GeResults

FAMILIES = list(ALL_FAMILIES)  # every graph enables all (the default), in pass order
# one Qwen2 decoder layer's graph (a family with no Qwen2 anchor, e.g. moe, fuses 0)
PER_LAYER = {family: {"rms_norm": 2, "swiglu": 1, "rotary": 2, "attention": 1}.get(family, 0) for family in FAMILIES}
ZERO = dict.fromkeys(FAMILIES, 0)


def _fresh_process():
    """What a new rank's process starts with: no Dynamo caches or frame numbers, report index 0."""
    torch._dynamo.reset()
    SUMMARY.clear()


def npu_patched_rms_norm(self, x):
    """Qwen2RMSNorm.forward as verl's npu_patch replaces it (torch_npu.npu_rms_norm; the stand-in here)."""
    return torch.ops.npu.npu_rms_norm(x.to(self.weight.dtype), self.weight, epsilon=self.variance_epsilon)[0]


def _train_steps(folder: Path, lengths: tuple[int, ...]) -> dict[str, list[str]]:
    """Train steps of a tiny 2-layer Qwen2 compiled per layer, one per sequence length; each new length
    recompiles the layer's frame (static shapes keep the recompile as cheap as the first compile)."""
    with pytest.MonkeyPatch.context() as env, torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        env.setenv("QWEN_NPU_COMPILE", "1")
        env.setenv("QWEN_NPU_DUMP_DIR", str(folder))
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(tiny_qwen2_config(num_hidden_layers=2)).train()
        compiled = maybe_compile(model)
        for length in lengths:
            ids = torch.randint(0, 128, (2, length))
            model(input_ids=ids, labels=ids).loss.backward()
    return {name: [report.name for report in reports] for name, reports in compiled.reports().items()}


def mismatched_swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up  # SWIGLU_LINE


SWIGLU_LINE = next(number for number, line in enumerate(inspect.getsource(mismatched_swiglu).splitlines(),
                                                          start=inspect.getsourcelines(mismatched_swiglu)[1])
                   if "SWIGLU_LINE" in line)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, npu_ops):
    root = tmp_path_factory.mktemp("report")
    layers = {}
    _fresh_process()
    layers["rank0"] = _train_steps(root / "run" / "rank0", (8, 12))
    _fresh_process()
    layers["rank1"] = _train_steps(root / "run" / "rank1", (8,))

    _fresh_process()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Qwen2RMSNorm, "forward", npu_patched_rms_norm)
        layers["patched"] = _train_steps(root / "patched", (8,))

    _fresh_process()
    gate, up = torch.randn(2, 8, dtype=torch.float16), torch.randn(2, 8, dtype=torch.bfloat16)
    torch.compile(mismatched_swiglu, backend="qwen_npu", options={"dump_dir": str(root / "refused")})(gate, up)

    _fresh_process()
    torch.compile(Qwen2RMSNorm(16), backend="qwen_npu",
                  options={"dump_dir": str(root / "disabled"), "fusions": "swiglu"})(torch.randn(2, 16))

    def fault(*args, **kwargs):
        raise RuntimeError("injected fault")

    for folder, module, function in (("unfused", emit, "finalize"), ("fell_back", handoff, "aot_eager_hand_off")):
        _fresh_process()
        with pytest.MonkeyPatch.context() as patch:  # as tests/test_fault_injection.py injects them
            patch.setattr(module, function, fault)
            torch.compile(Qwen2RMSNorm(16), backend="qwen_npu", options={"dump_dir": str(root / folder)})(
                torch.randn(2, 16))

    _fresh_process()
    report = GraphReport(name="g000_0_0", simulated=True, downstream="torchair", families=FAMILIES,
                         fusions={**ZERO, "rms_norm": 1}, anchors={"rms_norm": 1}, already_fused=ZERO)
    failure = {"error": "NotImplementedError: layout TND", "source": "npu_flash_attention.py:214", "graph": "graph_1",
               "kind": "converter"}
    report.ge = GeResults(torch_npu="2.13.0", torchair="offline", mode="max-autotune",
                          graphs=[GeGraph(name="graph_1", kind="forward", ops={"RmsNorm": 1, "Data": 3})],
                          failures=[GeFailure(op="npu.npu_fusion_attention.default", node="attn", **failure),
                                    GeFailure(op="npu.npu_fusion_attention.default", node="attn_1", **failure)])
    dump.publish(report, QwenNpuConfig.from_options({"dump_dir": str(root / "ge")}))
    _fresh_process()
    return root, layers


def run_report(capsys, *args) -> tuple[int, str, str]:
    status = cli.main(["report", *map(str, args)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def json_report(capsys, *dirs, status: int) -> dict:
    """``report DIRS --json -``: the JSON object printed (alone) on stdout; the exit status must be ``status``."""
    got, out, err = run_report(capsys, *dirs, "--json", "-")
    assert got == status, err
    return json.loads(out)


def table_row(out: str, *first_cells: str) -> list[str]:
    """The cells of the printed table row starting with ``first_cells`` (cells are separated by 2+ blanks)."""
    rows = [cells for line in out.splitlines() if line.strip()
            if (cells := re.split(r"\s{2,}", line.strip()))[: len(first_cells)] == list(first_cells)]
    assert len(rows) == 1, (first_cells, out)
    return rows[0]


def graph_row(out: str, *first_cells: str) -> dict[str, str]:
    """The row of the per-graph table starting with ``first_cells``, by column name."""
    return dict(zip(table_row(out, "dump", "graph"), table_row(out, *first_cells)))


def test_per_layer_graphs_are_what_the_expectation_says():
    expected = expected_fusions(Qwen2Config(), per_layer=True)
    assert {family: expected.get(family, 0) for family in FAMILIES} == PER_LAYER


def counted(counts: dict[str, int], **columns: str) -> dict[str, str]:
    """A per-graph table row as printed: one cell per family, then ``columns``."""
    return {**{family: str(counts[family]) for family in FAMILIES}, **columns}


def test_two_ranks_table_and_json(dumps, capsys, tmp_path):
    root, layers = dumps
    # every decoder layer ran the same graphs: g000_0_0 (length 8), then the recompile g001_0_1 (length 12)
    assert layers["rank0"] == {"model.layers.0": ["g000_0_0", "g001_0_1"], "model.layers.1": ["g000_0_0", "g001_0_1"]}
    assert layers["rank1"] == {"model.layers.0": ["g000_0_0"], "model.layers.1": ["g000_0_0"]}
    run = root / "run"
    status, out, err = run_report(capsys, run, "--json", tmp_path / "r.json")
    assert status == 0, out + err
    assert err == ""
    r0, r1 = str(run / "rank0"), str(run / "rank1")
    assert table_row(out, "dump", "graph") == ["dump", "graph", *FAMILIES, "refused", "GE failed", "downstream"]
    for dump, name in ((r0, "g000_0_0"), (r0, "g001_0_1"), (r1, "g000_0_0")):
        assert graph_row(out, dump, name) == counted(
            PER_LAYER, dump=dump, graph=name, refused="0", **{"GE failed": "0", "downstream": "aot_eager"})
    assert graph_row(out, "total") == counted({f: 3 * n for f, n in PER_LAYER.items()}, dump="total",
                                              graph="3 graph(s)", refused="0", **{"GE failed": "0"})
    assert table_row(out, "dump", "frame") == ["dump", "frame", "graphs", "compiles", "recompiles", "names"]
    assert table_row(out, r0, "0") == [r0, "0", "2", "2", "1", "g000_0_0, g001_0_1"]
    assert table_row(out, r1, "0") == [r1, "0", "1", "1", "0", "g000_0_0"]
    assert "refusals by source line: none" in out and "GE conversion failures: none" in out
    assert out.splitlines()[0] == "qwen-npu-compile report: 3 graph(s) in 2 dump folder(s) (5 file(s) read)"
    assert out.splitlines()[-2].startswith("status 0")

    report = json.loads((tmp_path / "r.json").read_text())
    assert report["format"] == 1 and report["exit_status"] == 0 and report["why"] == []
    assert report["files_read"] == 5 and report["warnings"] == []  # 2 summaries + 3 report.json, graphs once
    assert report["families"] == FAMILIES
    assert [(d["dump"], d["rank"], d["graphs"], d["summary"], d["simulated"]) for d in report["dumps"]] == [
        (r0, 0, 2, True, True), (r1, 1, 1, True, True)]
    assert report["dumps"][0]["versions"]["torch"] == torch.__version__
    assert [(g["dump"], g["name"], g["compile_id"], g["frame"], g["frame_compile"]) for g in report["graphs"]] == [
        (r0, "g000_0_0", "0/0", 0, 0), (r0, "g001_0_1", "0/1", 0, 1), (r1, "g000_0_0", "0/0", 0, 0)]
    for graph in report["graphs"]:
        assert graph["fusions"] == PER_LAYER and graph["anchors"] == PER_LAYER
        assert graph["already_fused"] == ZERO and graph["missed"] == {}
        assert graph["families"] == FAMILIES and graph["refused"] == 0 and graph["ge_failures"] == 0
        assert graph["file"].endswith("report.json")
    assert report["totals"] == {
        "graphs": 3, "fusions": {family: 3 * count for family, count in PER_LAYER.items()},
        "already_fused": ZERO, "missed": {}, "refused": 0, "refused_disabled": 0,
        "ge_failures": 0, "unfused_graphs": 0, "downstream_fallbacks": 0}
    assert report["refusals"] == [] and report["ge_failures"] == []
    assert report["call_sites"] == [
        {"dump": r0, "rank": 0, "frame": 0, "compiled_autograd": None, "graphs": 2, "names": ["g000_0_0", "g001_0_1"],
         "compiles": 2, "recompiles": 1},
        {"dump": r1, "rank": 1, "frame": 0, "compiled_autograd": None, "graphs": 1, "names": ["g000_0_0"],
         "compiles": 1, "recompiles": 0}]

    # --json -: the same object, alone on stdout
    assert json_report(capsys, run, status=0) == report
    # a rank folder named twice (directly and through its parent) is read once
    assert json_report(capsys, run, run / "rank0", status=0)["totals"]["graphs"] == 3


def test_enabled_family_refusal_exits_1(dumps, capsys):
    root, _ = dumps
    refused = root / "refused"
    report = json_report(capsys, refused, status=1)
    (graph,) = report["graphs"]
    assert graph["fusions"] == ZERO
    assert graph["missed"] == {"swiglu": 1} and graph["refused"] == 1
    source = f"test_report_cli.py:{SWIGLU_LINE}"
    (group,) = report["refusals"]
    assert group["source"] == source and group["count"] == 1
    (reason,) = group["reasons"]
    assert (reason["family"], reason["enabled"], reason["count"]) == ("swiglu", True, 1)
    assert reason["reason"].startswith("dtype mismatch") and reason["graphs"] == [f"{refused}/{graph['name']}"]
    assert report["totals"]["missed"] == {"swiglu": 1} and report["totals"]["refused_disabled"] == 0
    assert report["why"] == [f"{refused}/{graph['name']}: swiglu refused 1 time(s) although enabled"]

    status, out, _ = run_report(capsys, root / "run", refused)
    assert status == 1
    assert graph_row(out, str(refused), graph["name"]) == counted(
        {**ZERO, "swiglu": "0 !1"}, dump=str(refused), graph=graph["name"], refused="1",
        **{"GE failed": "0", "downstream": "aot_eager"})
    assert graph_row(out, "total") == counted({**{f: 3 * n for f, n in PER_LAYER.items()}, "swiglu": "3 !1"},
                                              dump="total", graph="4 graph(s)", refused="1", **{"GE failed": "0"})
    assert f"  {source}  (1)" in out.splitlines()
    assert any(line.startswith("       1 x swiglu (enabled): dtype mismatch") for line in out.splitlines())
    assert "status 1: enabled families fused less than they could (1)" in out


def test_disabled_family_refusal_is_listed_and_exits_0(dumps, capsys):
    root, _ = dumps
    report = json_report(capsys, root / "disabled", status=0)
    (graph,) = report["graphs"]
    assert graph["families"] == ["swiglu"] and graph["fusions"] == {"swiglu": 0} and graph["missed"] == {}
    (group,) = report["refusals"]
    assert group["source"].startswith("modeling_qwen2.py:") and group["count"] == 1
    (reason,) = group["reasons"]
    assert (reason["family"], reason["enabled"]) == ("rms_norm", False)
    assert reason["reason"] == "family 'rms_norm' is disabled (fusions=['swiglu'])"
    assert report["totals"]["refused"] == 1 and report["totals"]["refused_disabled"] == 1
    status, out, _ = run_report(capsys, root / "disabled")
    # the columns are the families seen: the enabled one, and the disabled one that refused
    assert graph_row(out, str(root / "disabled"), graph["name"]) == {
        "dump": str(root / "disabled"), "graph": graph["name"], "rms_norm": "off", "swiglu": "0",
        "refused": "1", "GE failed": "0", "downstream": "aot_eager"}
    assert any(line.startswith("       1 x rms_norm (disabled): family 'rms_norm' is disabled") for line in out.splitlines())


def test_ge_conversion_failures_are_grouped_by_source_line(dumps, capsys):
    root, _ = dumps
    report = json_report(capsys, root / "ge", status=0)  # GE failures are reported, not part of the fusion status
    (graph,) = report["graphs"]
    assert (graph["ge_failures"], graph["ge_graphs"], graph["downstream"]) == (2, 1, "torchair")
    assert report["ge_failures"] == [{"source": "npu_flash_attention.py:214", "count": 2, "failures": [
        {"op": "npu.npu_fusion_attention.default", "kind": "converter", "error": "NotImplementedError: layout TND",
         "count": 2, "graphs": [f"{root / 'ge'}/g000_0_0"]}]}]
    status, out, _ = run_report(capsys, root / "ge")
    assert graph_row(out, str(root / "ge"), "g000_0_0") == counted(
        {**ZERO, "rms_norm": 1}, dump=str(root / "ge"), graph="g000_0_0", refused="0",
        **{"GE failed": "2", "downstream": "torchair"})
    assert "GE conversion failures by source line (2)" in out
    assert "     2 x npu.npu_fusion_attention.default (converter): NotImplementedError: layout TND" in out


def test_bad_arguments_exit_2(dumps, capsys, tmp_path):
    status, out, err = run_report(capsys, tmp_path / "missing")
    assert (status, out) == (2, "")
    assert err == f"qwen-npu-compile report: error: no such folder: {str(tmp_path / 'missing')!r} (give the dump_dir " \
                  "of a run, or a rank<N> folder in it)\n"
    (tmp_path / "file").write_text("x")
    status, _, err = run_report(capsys, tmp_path / "file")
    assert status == 2 and "not a folder" in err
    (tmp_path / "empty").mkdir()
    status, _, err = run_report(capsys, dumps[0] / "run", tmp_path / "empty")
    assert status == 2 and f"no readable summary.json or report.json under {str(tmp_path / 'empty')!r}" in err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "summary.json").write_text("[1, 2]")
    status, _, err = run_report(capsys, tmp_path / "junk")
    assert status == 2 and "Traceback" not in err
    assert f"warning: {tmp_path / 'junk' / 'summary.json'}: not a qwen_npu summary.json (a JSON list" in err
    assert "(1 found, none readable)" in err
    with pytest.raises(SystemExit) as info:  # argparse: no DIR
        cli.main(["report"])
    assert info.value.code == 2


def test_malformed_files_are_skipped_with_a_warning(dumps, capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(dumps[0] / "run", run)
    summary = run / "rank1" / "summary.json"
    summary.write_text(summary.read_text()[:100])  # a run killed mid-write
    report_json = run / "rank0" / "g001_0_1" / "report.json"
    report_json.write_text("{not json")
    wrong_types = run / "rank0" / "g009_0_9" / "report.json"  # valid JSON, not a report
    wrong_types.parent.mkdir()
    wrong_types.write_text(json.dumps({"name": "g009_0_9", "families": "rms_norm", "refused": 3}))
    status, out, err = run_report(capsys, run, "--json", "-")
    assert status == 0 and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"qwen-npu-compile report: warning: {report_json}: not valid JSON (")
    assert lines[1] == (f"qwen-npu-compile report: warning: {wrong_types}: not a qwen_npu report.json ('families' is "
                        "a JSON str, not a list); skipped")
    assert lines[2].startswith(f"qwen-npu-compile report: warning: {summary}: not valid JSON (")
    report = json.loads(out)
    # each graph is still read from its other file: rank0's g001_0_1 from the summary, rank1's from report.json
    assert [(g["name"], Path(g["file"]).name) for g in report["graphs"]] == [
        ("g000_0_0", "report.json"), ("g001_0_1", "summary.json"), ("g000_0_0", "report.json")]
    assert report["totals"]["fusions"] == {family: 3 * count for family, count in PER_LAYER.items()}
    assert report["files_read"] == 3 and len(report["warnings"]) == 3
    assert [d["summary"] for d in report["dumps"]] == [True, False]


def test_many_files_print_progress(dumps, capsys, tmp_path):
    copies = (1, 2, 3, 4, 5, 6, 10)  # 7 copies of rank0: 21 files, 14 graphs; job10 comes after job6
    for copy in copies:
        shutil.copytree(dumps[0] / "run" / "rank0", tmp_path / f"job{copy}" / "rank0")
    status, out, err = run_report(capsys, tmp_path, "--json", "-")
    assert status == 0
    assert err.splitlines() == ["qwen-npu-compile report: reading 21 files", "qwen-npu-compile report: read 21 files"]
    report = json.loads(out)
    assert report["totals"]["graphs"] == 14 and report["files_read"] == 21
    assert [d["dump"] for d in report["dumps"]] == [str(tmp_path / f"job{copy}" / "rank0") for copy in copies]


def test_monkey_patched_ops_count_as_already_fused(dumps, capsys):
    root, layers = dumps
    assert layers["patched"] == {"model.layers.0": ["g000_0_0"], "model.layers.1": ["g000_0_0"]}
    patched = str(root / "patched")
    report = json_report(capsys, root / "patched", status=0)  # an anchor already fused is not one that could fuse
    (graph,) = report["graphs"]
    assert graph["fusions"] == {**PER_LAYER, "rms_norm": 0}
    assert graph["already_fused"] == {**ZERO, "rms_norm": 2}
    assert report["totals"]["already_fused"] == {**ZERO, "rms_norm": 2} and report["refusals"] == []
    status, out, _ = run_report(capsys, root / "run", root / "patched")
    assert graph_row(out, patched, "g000_0_0") == counted(
        {**PER_LAYER, "rms_norm": "0+2a"}, dump=patched, graph="g000_0_0", refused="0",
        **{"GE failed": "0", "downstream": "aot_eager"})
    assert graph_row(out, "total") == counted(
        {**{f: 4 * n for f, n in PER_LAYER.items()}, "rms_norm": "6+2a"}, dump="total", graph="4 graph(s)",
        refused="0", **{"GE failed": "0"})


@pytest.mark.parametrize(("compile_id", "expected"), [
    (dict(frame_id=3, frame_compile_id=2), {"frame": 3, "compile": 2, "compiled_autograd": None, "id": "3/2"}),
    (dict(frame_id=1, frame_compile_id=0, compiled_autograd_id=4),
     {"frame": 1, "compile": 0, "compiled_autograd": 4, "id": "!4/1/0"}),
    (dict(frame_id=None, frame_compile_id=None, compiled_autograd_id=0),
     {"frame": None, "compile": None, "compiled_autograd": 0, "id": "!0"}),
    (None, {"frame": None, "compile": None, "compiled_autograd": None, "id": "eager"}),
])
def test_compile_id_is_read_back_from_the_graph_name(compile_id, expected):
    """The names the backend gives (report.new_graph_name, from Dynamo's own CompileId) parse back."""
    from torch._guards import CompileContext, CompileId, compile_context

    from qwen_npu_compile.cli.report import Graph
    from qwen_npu_compile.report import new_graph_name

    if compile_id is None:
        name = new_graph_name()
    else:
        with compile_context(CompileContext(CompileId(**compile_id))):
            name = new_graph_name()
    assert Graph(dump=".", rank=None, name=name, data={}, file="").compile_id == {"index": 0, **expected}
    assert Graph(dump=".", rank=None, name="not-a-graph-name", data={}, file="").compile_id["id"] is None


def test_a_graph_compiled_unfused_exits_1_and_a_downstream_fallback_is_noted(dumps, capsys):
    root, _ = dumps
    report = json_report(capsys, root / "unfused", status=1)
    (graph,) = report["graphs"]
    assert graph["fallback_stage"] == "emit" and "injected fault" in graph["fallback"]
    assert graph["fusions"] == ZERO and report["totals"]["unfused_graphs"] == 1 and report["refusals"] == []
    (why,) = report["why"]
    assert why.startswith(f"{root / 'unfused'}/g000_0_0: compiled unfused (emit stage failed): ") and "injected fault" in why

    report = json_report(capsys, root / "fell_back", status=0)  # the graph fused; only what runs it changed
    (graph,) = report["graphs"]
    assert graph["fusions"] == {**ZERO, "rms_norm": 1} and graph["downstream"] == "eager"
    assert graph["downstream_fallbacks"] == 1 and report["totals"]["downstream_fallbacks"] == 1
    status, out, _ = run_report(capsys, root / "fell_back")
    assert graph_row(out, str(root / "fell_back"), "g000_0_0")["downstream"] == "eager; 1 downstream fallback(s)"
