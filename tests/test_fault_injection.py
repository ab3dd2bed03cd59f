"""The user's training never crashes because of us: a fault injected into each stage of the backend
(canonicalize, each family's fuse, emit, hand-off, dump, report) leaves the compiled model running,
unfused or eagerly as the stage allows, with exactly one warning and the results of eager (logits and
every gradient, fp32 bounds of ``check``), whole-model (``torch.compile``) and per decoder layer
(``maybe_compile``); with ``strict`` each raises a ``FusionError`` naming the stage.

The faults are exceptions injected with ``monkeypatch`` into the function each stage runs (a family's
pass ``apply``, ``emit.finalize``, the downstream backend, ``Path.write_text`` of the dumps, the
report's log line). The hand-off to torchair is faulted in-process here (no torchair import); the real
off-NPU torchair refusing a graph (BSND ``npu_fusion_attention``), and a GE graph failing at its first
run, are in :func:`test_offline_torchair_refusal_and_first_run_failure_fall_back` (a subprocess, as
every torchair import). Also here: unusable dump folders (refused at validation, one warning at
training time), protobuf missing for ``check --downstream torchair``, and the report module's imports.
"""

from __future__ import annotations

import ast
import errno
import json
import logging
import pathlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qwen_npu_compile import ALL_FAMILIES, cli, dump, handoff, maybe_compile
from qwen_npu_compile.cli.check.harness import run_model
from qwen_npu_compile.cli.check.models import tiny_qwen2, tiny_qwen2_config
from qwen_npu_compile.config import QwenNpuConfig
from qwen_npu_compile.graph import canonicalize, emit
from qwen_npu_compile.patterns import expected_fusions, get_family_pass
from qwen_npu_compile.report import SUMMARY, FusionError, GraphReport
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports
from tests.helpers import REPO
from tests.helpers.numerics import assert_runs_match

LAYERS = 1
SEQ = 16
FUSED = expected_fusions(tiny_qwen2_config(num_hidden_layers=LAYERS))
FUSED_PER_LAYER = expected_fusions(tiny_qwen2_config(num_hidden_layers=LAYERS), per_layer=True)
UNFUSED = dict.fromkeys(ALL_FAMILIES, 0)


class InjectedFault(RuntimeError):
    """The exception every injected fault raises."""


def _raise(*args, **kwargs):
    raise InjectedFault("injected fault")


def inject(stage: str, monkeypatch, dump_dir: Path) -> dict:
    """Make ``stage`` raise; returns the compile options the case needs."""
    if stage == "canonicalize":
        monkeypatch.setattr(canonicalize, "to_aten_graph", _raise)
    elif stage.startswith("fuse:"):
        monkeypatch.setattr(get_family_pass(stage.removeprefix("fuse:")), "apply", _raise)
    elif stage == "emit":
        monkeypatch.setattr(emit, "finalize", _raise)
    elif stage == "hand-off:aot_eager":
        monkeypatch.setattr(handoff, "aot_eager_hand_off", _raise)
    elif stage == "hand-off:torchair":
        # the GE conversion / compile raises inside torchair's backend (in-process: no torchair import)
        # (attention off: fp32 attention is not fused for torchair, GE takes fp16/bf16 only, and the near
        # miss would be a second warning)
        monkeypatch.setattr(handoff, "torchair_backend", lambda report, config: _raise)
        return {"downstream": "torchair", "fusions": ",".join(f for f in ALL_FAMILIES if f != "attention")}
    elif stage == "dump":
        write_text = pathlib.Path.write_text

        def full_disk(self, *args, **kwargs):
            if str(self).startswith(str(dump_dir)):
                raise OSError(errno.ENOSPC, "No space left on device", str(self))
            return write_text(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
        monkeypatch.setattr(dump, "_STOPPED", {})
        return {"dump_dir": str(dump_dir)}
    elif stage == "report":
        monkeypatch.setattr(GraphReport, "log_line", _raise)
    else:  # pragma: no cover
        raise AssertionError(stage)
    return {}


STAGES = ["canonicalize", *(f"fuse:{family}" for family in ALL_FAMILIES), "emit", "hand-off:aot_eager",
          "hand-off:torchair", "dump", "report"]
#: The stages whose failure compiles the captured graph unfused (the others keep the fusions).
UNFUSING = {"canonicalize", "emit", *(f"fuse:{family}" for family in ALL_FAMILIES)}
#: What runs the graph after the fault, by stage (default: aot_eager, the off-NPU downstream).
RUNS = {"hand-off:aot_eager": "eager", "hand-off:torchair": "aot_eager"}
#: Which stage the strict error names.
STAGE_NAME = {"hand-off:aot_eager": "hand-off", "hand-off:torchair": "hand-off"}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "qwen_npu_compile"]


def _check_report(report, stage: str, fused: dict) -> None:
    families = {family: report.fusions.get(family, 0) for family in ALL_FAMILIES}
    if stage in UNFUSING:
        assert families == UNFUSED, report.fusions
        assert report.fallback_stage == stage.split(":")[0], (report.fallback_stage, report.fallback)
        assert "injected fault" in report.fallback
        if stage.startswith("fuse:"):
            assert report.fallback.startswith(f"the {stage.removeprefix('fuse:')} pass raised: InjectedFault")
    else:
        want = dict(fused, attention=0) if stage == "hand-off:torchair" else fused
        assert families == want, (report.fusions, report.fallback)
        assert report.fallback is None
    assert report.downstream == RUNS.get(stage, "aot_eager")
    if stage.startswith("hand-off"):
        (fell,) = report.downstream_fallbacks
        assert (fell["backend"], fell["ran"], fell["graph"], fell["when"]) == (
            stage.removeprefix("hand-off:"), RUNS[stage], "whole", "compile")
        assert fell["error"] == "InjectedFault: injected fault"
    else:
        assert report.downstream_fallbacks == []


def _one_warning_naming(caplog, stage: str) -> None:
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    text = warnings[0]
    if stage in UNFUSING:
        assert f"({stage.split(':')[0]} stage), compiling the graph unfused" in text, text
    elif stage.startswith("hand-off"):
        assert f"{stage.removeprefix('hand-off:')} failed (whole graph, compile)" in text and "injected fault" in text
    elif stage == "dump":
        assert "dumping is off for the rest of this process" in text and "No space left on device" in text
    else:
        assert "the report stage failed" in text and "injected fault" in text


def _tokens():
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))


#: Whole-model cases (the first and last fusion pass; every family's pass is faulted on a small graph below).
WHOLE_MODEL_STAGES = ["canonicalize", f"fuse:{ALL_FAMILIES[0]}", "fuse:attention", "emit", "hand-off:aot_eager",
                      "hand-off:torchair", "dump", "report"]


@pytest.mark.parametrize("stage", WHOLE_MODEL_STAGES)
def test_fault_in_a_stage_leaves_the_whole_model_compile_running(stage, npu_ops, monkeypatch, caplog, tmp_path):
    model = tiny_qwen2(num_hidden_layers=LAYERS).train()
    input_ids = _tokens()
    expected = run_model(model, model, input_ids, True)
    options = inject(stage, monkeypatch, tmp_path / "dump")
    compiled = torch.compile(model, backend="qwen_npu", options=options)
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        actual = run_model(model, compiled, input_ids, True)
        again = run_model(model, compiled, input_ids, True)  # the second step: no new warning
    assert_runs_match(actual, expected)
    assert_runs_match(again, expected)
    (report,) = SUMMARY.graphs
    _check_report(report, stage, FUSED)
    _one_warning_naming(caplog, stage)
    if stage == "dump":
        assert list(dump.stopped_dumps()) == [str(tmp_path / "dump")]
        assert not list((tmp_path / "dump").rglob("*.py"))  # nothing more was tried after the first failure


@pytest.mark.parametrize("stage", ["canonicalize", "fuse:rotary", "hand-off:aot_eager", "dump"])
def test_fault_in_a_stage_leaves_maybe_compile_running(stage, npu_ops, monkeypatch, caplog, tmp_path):
    model = tiny_qwen2(num_hidden_layers=2).train()
    input_ids = _tokens()
    expected = run_model(model, model, input_ids, True)
    options = inject(stage, monkeypatch, tmp_path / "dump")
    assert maybe_compile(model, options or None, environ={ENV_COMPILE: "1"}) == ["model.layers.0", "model.layers.1"]
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        actual = run_model(model, model, input_ids, True)
    assert_runs_match(actual, expected)
    records = layer_reports(model)
    assert sorted(records) == ["model.layers.0", "model.layers.1"]
    reports = {id(r): r for record in records.values() for r in record.reports}.values()
    assert reports and all(record.calls["compiled"] == 1 for record in records.values())
    for report in reports:
        _check_report(report, stage, FUSED_PER_LAYER)
    if stage == "dump":
        _one_warning_naming(caplog, stage)  # once per process, however many graphs
    else:  # one per compiled graph
        assert len(_warnings(caplog)) == len(reports), _warnings(caplog)


class Norm(torch.nn.Module):
    """Qwen2's RMSNorm (one rms_norm fusion): the smallest graph every stage runs on."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


@pytest.mark.stack_compat
@pytest.mark.parametrize("stage", STAGES)
def test_strict_raises_a_fusion_error_naming_the_stage(stage, npu_ops, monkeypatch, tmp_path):
    options = {"strict": True, **inject(stage, monkeypatch, tmp_path / "dump")}
    compiled = torch.compile(Norm(), backend="qwen_npu", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as caught:
        compiled(torch.randn(2, 8, 64, requires_grad=True)).sum().backward()
    error = caught.value.inner_exception
    assert isinstance(error, FusionError), repr(error)
    name = STAGE_NAME.get(stage, stage.split(":")[0])
    if stage in UNFUSING:
        assert f"compiled unfused ({name} stage failed)" in str(error), str(error)
    else:
        assert f"the {name} stage failed" in str(error), str(error)
    assert isinstance(error.__cause__, (InjectedFault, OSError)) or "injected fault" in str(error)


#: Fast cases the stack matrix runs too (tools/stack_matrix.py: pytest -m stack_compat).
STACK_COMPAT = {"canonicalize", "fuse:rms_norm", "emit", "hand-off:aot_eager", "dump", "report"}


@pytest.mark.parametrize("stage", [pytest.param(s, marks=[pytest.mark.stack_compat] if s in STACK_COMPAT else [])
                                   for s in STAGES])
def test_fault_in_a_small_graph_runs_on_with_one_warning(stage, npu_ops, monkeypatch, caplog, tmp_path):
    module = Norm()
    x = torch.randn(2, 8, 64, requires_grad=True)
    expected = module(x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), module.weight)
    options = inject(stage, monkeypatch, tmp_path / "dump")
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        out = torch.compile(module, backend="qwen_npu", options=options)(x)
        (grad,) = torch.autograd.grad(out.sum(), module.weight)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, expected_grad)
    (report,) = SUMMARY.graphs
    _check_report(report, stage, {family: int(family == "rms_norm") for family in ALL_FAMILIES})
    _one_warning_naming(caplog, stage)


# ---------------------------------------------------------------------------------------------------
# unusable dump folders


UNWRITABLE = "/proc/qwen_npu_dumps/run1"  # /proc takes no new files, even for root


def test_unwritable_dump_dir_is_refused_where_options_are_validated(tmp_path):
    with pytest.raises(ValueError, match=r"option 'dump_dir' = '/proc/qwen_npu_dumps/run1' cannot be written: '/proc'"):
        QwenNpuConfig.from_options({"dump_dir": UNWRITABLE})
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"QWEN_NPU_DUMP_DIR = .* cannot be created: .*file' is not a folder"):
        QwenNpuConfig.from_options({}, environ={"QWEN_NPU_DUMP_DIR": str(a_file / "sub")})
    deferred = QwenNpuConfig.from_options({"dump_dir": UNWRITABLE}, dump_dir_errors="defer")
    assert deferred.dump_dir == Path(UNWRITABLE)
    assert QwenNpuConfig.from_options({"dump_dir": str(tmp_path / "new" / "folder")}).dump_dir == tmp_path / "new" / "folder"
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".qwen_npu_probe_*"))  # the probe leaves nothing


def test_check_exits_2_naming_an_unwritable_dump_dir(capsys):
    assert cli.main(["check", "qwen2.5-0.5b", "--dump-dir", UNWRITABLE]) == 2
    err = capsys.readouterr().err
    assert "qwen-npu-compile: error:" in err and UNWRITABLE in err and "cannot be written" in err


@pytest.mark.parametrize("where", ["folder", "unwritable"])
def test_check_exits_2_before_running_when_its_json_file_cannot_be_written(where, tmp_path, capsys, monkeypatch):
    """``check --json`` names a folder, or a file in a folder no file can be created in: exit 2 up front (the
    check is never run, so its results are not lost at the end with a traceback)."""
    monkeypatch.setattr(cli, "run_check", lambda args: pytest.fail("the check ran"))
    path = str(tmp_path) if where == "folder" else "/proc/qwen_npu_results.json"
    assert cli.main(["check", "qwen2.5-0.5b", "--layers", "1", "--json", path]) == 2
    err = capsys.readouterr().err
    expected = "is a folder; name a file" if where == "folder" else "cannot be written: '/proc': creating a file there failed"
    assert f"qwen-npu-compile: error: --json {path!r} {expected}" in err, err


def test_maybe_compile_refuses_an_unwritable_dump_dir_before_training():
    with pytest.raises(ValueError, match="cannot be written"):
        maybe_compile(tiny_qwen2(num_hidden_layers=1), {"dump_dir": UNWRITABLE}, environ={ENV_COMPILE: "1"})


@pytest.mark.stack_compat
def test_unwritable_dump_dir_in_training_warns_once_and_training_goes_on(npu_ops, monkeypatch, caplog):
    monkeypatch.setattr(dump, "_STOPPED", {})
    monkeypatch.setenv("QWEN_NPU_DUMP_DIR", UNWRITABLE)  # set in the job's environment, not validated up front
    module = Norm()
    compiled = torch.compile(module, backend="qwen_npu")
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        for shape in ((2, 8, 64), (3, 5, 64)):  # two graphs (a recompile): still one warning
            x = torch.randn(*shape, requires_grad=True)
            compiled(x).sum().backward()
            torch.testing.assert_close(compiled(x), module(x))
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and UNWRITABLE in warnings[0] and "dumping is off" in warnings[0], warnings
    assert len(SUMMARY.graphs) >= 2 and all(r.fusions["rms_norm"] == 1 for r in SUMMARY.graphs)
    assert list(dump.stopped_dumps()) == [UNWRITABLE]


# ---------------------------------------------------------------------------------------------------
# protobuf missing (a plain `pip install -e .`), the report module's imports


class _NoGoogle:
    """A meta path finder for which no ``google`` package exists (a plain ``pip install -e .``)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "google" or name.startswith("google."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.fixture
def no_google(monkeypatch):
    for name in [name for name in sys.modules if name == "google" or name.startswith("google.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoGoogle(), *sys.meta_path])


def test_missing_google_package_gives_a_clear_message(no_google):
    import importlib.util

    from qwen_npu_compile.torchair.offline import importer

    with pytest.raises(ModuleNotFoundError):
        importlib.util.find_spec("google.protobuf")  # what the old check ran into
    message = importer.missing_protobuf()
    assert message is not None and "torchair needs protobuf" in message and "pip install" in message


def test_protobuf_present_is_no_problem():
    from qwen_npu_compile.torchair.offline import importer

    pytest.importorskip("google.protobuf")
    assert importer.missing_protobuf() is None


def test_check_downstream_torchair_without_protobuf_exits_2(no_google, capsys):
    assert cli.main(["check", "qwen2.5-0.5b", "--downstream", "torchair", "--layers", "1"]) == 2
    out, err = capsys.readouterr()
    assert "torchair needs protobuf" in err and "pip install" in err and "Traceback" not in err
    assert "building" not in out and "obtaining torchair" not in out  # refused before anything is done


def test_report_imports_nothing_of_torchair_offline():
    # report -> torchair_offline -> report was a cycle (at function level); the dependency runs one way now
    tree = ast.parse((REPO / "qwen_npu_compile" / "report.py").read_text())
    imported = [getattr(node, "module", None) or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if "torchair" in name], imported


# ---------------------------------------------------------------------------------------------------
# the real off-NPU torchair: a graph it refuses, a GE graph failing at its first run


TORCHAIR_SCRIPT = '''
import json, logging, sys
import torch
import qwen_npu_compile.torchair.offline as offline
from qwen_npu_compile import ensure_npu_ops, get_reports
from qwen_npu_compile.report import SUMMARY

ensure_npu_ops()
logging.basicConfig(level=logging.WARNING, format="WARNING %(message)s", stream=sys.stdout)
# On an NPU torchair's converter errors propagate; off-NPU the conversion check records them and goes
# on. Without the recorder the off-NPU torchair behaves as on an NPU.
offline.watch = lambda *args, **kwargs: None

class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64, dtype=torch.bfloat16)

    def forward(self, x):
        q = self.proj(x).reshape(1, 8, 4, 16)  # BSND, as transformers' NPU flash-attention path emits
        out = torch.ops.npu.npu_fusion_attention.default(q, q, q, 4, "BSND", scale=0.25)[0]  # LINE_OF_THE_OP
        return out.reshape(8, 64)

class Plain(torch.nn.Module):  # converts to GE: its failure is the first run's
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.proj(x))

def step(compiled, model, x):
    model.zero_grad(set_to_none=True)
    out = compiled(x)
    out.float().square().sum().backward()
    return out.detach(), model.proj.weight.grad.clone()

def run(case):
    torch._dynamo.reset()
    SUMMARY.clear()
    model = Plain() if case == "first_run" else Toy()
    x = torch.randn(8, 64, dtype=model.proj.weight.dtype)
    expected = step(model, model, x)
    compiled = torch.compile(model, backend="qwen_npu", options={"downstream": "torchair", "strict": case == "strict"})
    print("CASE", case, flush=True)
    try:
        actual = step(compiled, model, x)
    except Exception as exc:
        cause = getattr(exc, "inner_exception", None) or exc
        return {"error": type(cause).__name__, "message": str(cause)}
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1])
    (report,) = get_reports()
    return {"downstream": report.downstream, "fallbacks": report.downstream_fallbacks, "aot_ops": report.aot_ops}

results = {"refused": run("refused"), "strict": run("strict")}
offline.load_offline_torchair()
from torchair import npu_fx_compiler

def fails(self, *args, **kwargs):
    raise RuntimeError("GE graph failed at its first run (injected)")

npu_fx_compiler._CompiledFxGraph.__call__ = fails
results["first_run"] = run("first_run")
print("RESULTS", json.dumps(results))
'''


def test_offline_torchair_refusal_and_first_run_failure_fall_back(simulated_npu_ops, tmp_path):
    script = tmp_path / "modeling_toy.py"
    script.write_text(textwrap.dedent(TORCHAIR_SCRIPT))
    line = next(n for n, text in enumerate(TORCHAIR_SCRIPT.splitlines(), start=1) if "LINE_OF_THE_OP" in text)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    results = json.loads(lines[-1].removeprefix("RESULTS "))
    warnings, case = {}, None
    for text in lines:
        if text.startswith("CASE "):
            case = text.split()[1]
        elif text.startswith("WARNING qwen_npu "):
            warnings.setdefault(case, []).append(text)

    # the forward graph (BSND attention) runs eagerly; so does the backward graph, which torchair refuses
    # too (npu_fusion_attention_grad in BSND): one warning per AOT graph, naming node, source line, error
    refused = results["refused"]
    assert refused["downstream"] == "aot_eager", refused
    assert [(f["graph"], f["when"]) for f in refused["fallbacks"]] == [("forward", "compile"), ("backward", "compile")]
    forward = refused["fallbacks"][0]
    assert forward["node"].startswith("npu_fusion_attention") and forward["source"] == f"modeling_toy.py:{line}"
    assert forward["error"].startswith("NotImplementedError") and "input_layout" in forward["error"], forward
    assert refused["aot_ops"]["forward"] == {"npu_fusion_attention": 1}
    assert refused["aot_ops"]["backward"] == {"npu_fusion_attention_grad": 1}
    assert len(warnings["refused"]) == 2, warnings
    assert all("the same graph runs eagerly through AOTAutograd" in w for w in warnings["refused"])
    assert f"modeling_toy.py:{line}" in warnings["refused"][0]

    strict = results["strict"]
    assert strict["error"] == "FusionError", strict
    assert "the hand-off stage failed: torchair (forward graph, compile) at node npu_fusion_attention" in strict["message"]
    assert f"modeling_toy.py:{line}" in strict["message"] and "NotImplementedError" in strict["message"]

    first_run = results["first_run"]
    assert first_run["downstream"] == "aot_eager", first_run
    assert [(f["graph"], f["when"]) for f in first_run["fallbacks"]] == [("forward", "first run"), ("backward", "first run")]
    assert all("GE graph failed at its first run (injected)" in f["error"] for f in first_run["fallbacks"])
    assert len(warnings["first_run"]) == 2, warnings
