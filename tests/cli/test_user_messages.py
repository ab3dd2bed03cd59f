"""What a user is told: no silent no-op, no vacuous PASS, quick one-line answers.

* ``maybe_compile`` in a plain training loop (a model whose config keeps ``use_cache=True``) fuses, saying so once;
  switched off it says so in one INFO line;
* ``check`` refuses what it cannot check, and a broken model folder, with exit 2 and one line;
* ``report`` reads the graphs ``summary.json`` names and says when a folder holds graphs of other runs;
* refusal warnings name the reason; ``check`` groups identical refusal lines;
* ``--help``, argument errors and ``report`` import no torch;
* the README's first examples print exactly what the README shows, and its check sample is what check prints.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from qwen_npu_compile import cli, maybe_compile
from qwen_npu_compile.cli.check.models import tiny_qwen2_config
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports

REPO = Path(__file__).resolve().parents[2]


def _plain_model(seed: int = 0) -> Qwen2ForCausalLM:
    """What a user gets from ``from_config``: train mode, ``use_cache=True`` in the config."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(num_hidden_layers=2, use_cache=True))
    assert model.config.use_cache and model.training
    return model


# --- maybe_compile: no silent no-op ----------------------------------------------------------------


def test_a_plain_training_loop_fuses_with_the_config_cache_on(caplog):
    model, reference = _plain_model(), _plain_model()
    result = maybe_compile(model, environ={ENV_COMPILE: "1"})
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"):
        for _ in range(2):  # two steps: said once
            loss = model(input_ids=ids, labels=ids).loss  # no use_cache=False: the config's True applies
            loss.backward()
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for name, record in layer_reports(model).items():
        assert record.calls["eager"] == 0 and record.calls["compiled"] == 2, (name, record.calls)
        assert record.reports and record.reports[0].fusions.get("rms_norm") == 2, (name, record.reports)
    said = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert len(said) == 1, said
    assert "run compiled without it" in said[0] and "use_cache=False" in said[0]
    assert not [r for r in caplog.records if "ran without a qwen_npu graph" in r.getMessage()]
    assert len(result) == 2


def test_generation_keeps_its_cache_and_runs_eagerly():
    model = _plain_model(seed=3)
    result = maybe_compile(model, environ={ENV_COMPILE: "1"})
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # as generate() runs, here in train mode
        out = model(input_ids=ids, use_cache=True)
    assert out.past_key_values.get_seq_length() == 8  # the cache was filled: not dropped
    assert all(record.calls["eager"] == 1 and record.calls["compiled"] == 0 for record in result.records.values())


@pytest.mark.parametrize("environ", [{}, {ENV_COMPILE: "0"}])
def test_switched_off_says_so_in_one_info_line(environ, caplog):
    model = _plain_model()
    with caplog.at_level(logging.INFO, logger="qwen_npu_compile"):
        assert maybe_compile(model, environ=environ) == []
    lines = [r for r in caplog.records if r.name == "qwen_npu_compile"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [r.getMessage() for r in lines]
    message = lines[0].getMessage()
    assert "uncompiled" in message and f"set {ENV_COMPILE}=1" in message
    assert ("unset" if not environ else "'0'") in message


# --- start-up: no torch for --help, argument errors and report ------------------------------------------------------

#: What ``--help``, an argument error and ``report`` must not import (``qwen_npu_compile.config`` is torch-free: the
#: command imports its family names from there).
_NO_TORCH = """
import sys
from qwen_npu_compile import cli
try:
    status = cli.main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
heavy = sorted(m for m in ("torch", "transformers", "qwen_npu_compile.patterns") if m in sys.modules)
print("HEAVY", heavy, "STATUS", status)
"""


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["check", "qwen2.5-0.5b", "--seq-len", "0"],
                                  ["report", "DUMP"], ["report", "/nonexistent/qwen_npu_dump"]])
def test_help_argument_errors_and_report_import_no_torch(argv, tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "summary.json").write_text(json.dumps({"graphs": []}))
    argv = [str(dump) if arg == "DUMP" else arg for arg in argv]
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=120, cwd=REPO)
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("HEAVY [] STATUS"), (last, done.stderr[-2000:])


def test_check_help_lists_every_preset(capsys):
    from qwen_npu_compile.cli.check.models import preset_names

    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in preset_names():  # the MoE and Qwen3.5 presets too
        assert name in text, name


def test_cli_spells_the_names_of_their_sources():
    from qwen_npu_compile.cli.check.harness import DTYPES
    from qwen_npu_compile.config import ALL_FAMILIES, DOWNSTREAMS

    assert cli.DTYPE_NAMES == tuple(sorted(DTYPES))
    assert cli.ALL_FAMILIES is ALL_FAMILIES
    assert cli.DOWNSTREAM_NAMES == DOWNSTREAMS


# --- check: refuses what it cannot check, and every broken model folder, with exit 2 and one line ----------------


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    # transformers' own progress bars (loading the folder's weights) are not ours
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("qwen-npu-compile: error: "), lines
    return lines[0]


def _tiny_folder(path: Path, weights: bool = False, **overrides) -> Path:
    """A local model folder: the tiny Qwen2's config.json (with ``overrides``), and its weights when asked."""
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_qwen2_config(**overrides)
    if weights:
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    data.pop("layer_types", None)  # so that a test may change num_hidden_layers in the file
    data.update(overrides)
    (path / "config.json").write_text(json.dumps(data))
    return path


_FAST = ["--layers", "1", "--dtype", "fp32", "--vocab-size", "128"]


@pytest.mark.parametrize(("extra", "expected"), [
    (["--seq-len", "1"], "--mode train needs --seq-len >= 2, got 1"),
    (["--seq-len", "2", "--left-padding", "1"], "--left-padding 1 leaves no token with a target"),
])
def test_check_refuses_a_training_check_without_a_target_token(extra, expected, capsys):
    assert cli.main(["check", "qwen2.5-0.5b", *_FAST, *extra]) == 2
    assert expected in _one_error_line(capsys)


def test_check_refuses_dynamic_one_token_before_building(capsys, monkeypatch):
    """``--dynamic`` with one token is a settings clash (:meth:`CheckSpec.problem`): refused before the model is
    built or any run starts, like every other clash of flags."""
    from qwen_npu_compile.cli.check import models

    monkeypatch.setattr(models, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    argv = ["check", "qwen2.5-0.5b", *_FAST, "--mode", "infer", "--seq-len", "1", "--dynamic"]
    assert cli.main(argv) == 2
    assert "--dynamic needs --seq-len >= 2" in _one_error_line(capsys)


def test_check_spec_takes_the_parsers_defaults():
    """The spec built from parsed arguments equals the spec of the same model with the dataclass's defaults: the
    two lists of defaults cannot drift apart."""
    from qwen_npu_compile.cli.check.spec import CheckSpec

    assert CheckSpec.from_args(cli.build_parser().parse_args(["check", "qwen2.5-0.5b"])) == CheckSpec("qwen2.5-0.5b")


def test_check_infer_with_one_token_still_runs(capsys, tmp_path):
    folder = _tiny_folder(tmp_path / "tiny")
    assert cli.main(["check", str(folder), "--dtype", "fp32", "--mode", "infer", "--seq-len", "1"]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out
    # the table gives a row to what the model has, and names in one line the families it has nothing of
    table = out.split("  family ")[1].split("  parity ")[0].splitlines()
    assert [line.split()[0] for line in table[1:-1]] == ["rms_norm", "swiglu", "rotary", "attention"], table
    assert table[-1].startswith("  (nothing to fuse in this model for ") and "moe" in table[-1], table


def test_check_refuses_a_nan_reference_loss(capsys, tmp_path):
    folder = _tiny_folder(tmp_path / "nan", weights=True)
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert cli.main(["check", str(folder), "--dtype", "fp32", "--seq-len", "8"]) == 2
    line = _one_error_line(capsys)
    assert "the eager loss is nan: nothing to check parity against" in line


def _corrupt(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"not a safetensors file" * 4)


def _truncated(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _wrong_shape(folder: Path) -> None:
    data = json.loads((folder / "config.json").read_text())
    data["intermediate_size"] = 96  # the weights hold 128
    (folder / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize(("case", "overrides", "weights", "damage", "expected"), [
    ("heads0", {"num_attention_heads": 0}, False, None, "num_attention_heads must be a positive integer, got 0"),
    ("hidden_odd", {"hidden_size": 66}, False, None, "hidden_size 66 is not divisible by num_attention_heads 4"),
    ("kv_heads", {"num_key_value_heads": 3}, False, None, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("vocab0", {"vocab_size": 0}, False, None, "vocab_size must be a positive integer, got 0"),
    ("corrupt", {}, True, _corrupt, "model.safetensors: header length"),
    ("truncated", {}, True, _truncated, "lies outside the file"),
    ("wrong_shape", {}, True, _wrong_shape, "cannot build the model in"),
])
def test_a_broken_model_folder_is_one_line_and_exit_2(case, overrides, weights, damage, expected, capsys, tmp_path):
    folder = _tiny_folder(tmp_path / case, weights=weights, **overrides)
    if damage is not None:
        damage(folder)
    capsys.readouterr()
    assert cli.main(["check", str(folder), "--dtype", "fp32", "--seq-len", "8"]) == 2
    line = _one_error_line(capsys)
    assert expected in line and str(folder) in line, line


def test_a_multi_line_config_error_is_one_line(capsys, tmp_path):
    folder = _tiny_folder(tmp_path / "layers", num_hidden_layers=2)
    data = json.loads((folder / "config.json").read_text())
    data["layer_types"] = ["full_attention"] * 3  # transformers' validator: a two-line message
    (folder / "config.json").write_text(json.dumps(data))
    assert cli.main(["check", str(folder), "--dtype", "fp32", "--seq-len", "8"]) == 2
    assert "is not a valid Qwen2 config" in _one_error_line(capsys)


def test_check_groups_identical_refusal_lines(capsys, tmp_path):
    folder = _tiny_folder(tmp_path / "tiny")  # 2 layers: each disabled family refuses once per layer, same line
    assert cli.main(["check", str(folder), "--dtype", "fp32", "--seq-len", "8", "--fusions", "rms_norm"]) == 0
    out = capsys.readouterr().out
    refused = [line for line in out.splitlines() if line.startswith("  refused ")]
    assert len(refused) == len(set(refused)) == 3, refused  # swiglu, rotary, attention: one line each
    swiglu = next(line for line in refused if line.startswith("  refused swiglu"))
    assert swiglu.endswith("family 'swiglu' is disabled (fusions=['rms_norm']) (2 times)"), swiglu


# --- report: the graphs summary.json names ------------------------------------------------------------------------


def _graph(name: str, fused: int) -> dict:
    return {"name": name, "families": ["rms_norm"], "fusions": {"rms_norm": fused}, "already_fused": {},
            "anchors": {"rms_norm": fused}, "refused": [], "downstream": "aot_eager", "simulated": True}


def test_report_counts_the_graphs_summary_json_names_and_says_what_else_is_there(capsys, tmp_path):
    root = tmp_path / "dump"
    for graph in (_graph("g000_0_0", 5), _graph("g001_1_0", 7), _graph("g002_2_0", 9)):  # an earlier run: 3 graphs
        (root / graph["name"]).mkdir(parents=True)
        (root / graph["name"] / "report.json").write_text(json.dumps(graph))
    this_run = _graph("g000_0_0", 2)  # this run: 1 graph, same name, written over the earlier one
    (root / "g000_0_0" / "report.json").write_text(json.dumps(this_run))
    (root / "summary.json").write_text(json.dumps({"simulated": True, "versions": {}, "graphs": [this_run],
                                                  "totals": {"rms_norm": 2}}))
    assert cli.main(["report", str(root), "--json", "-"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["totals"]["graphs"] == 1 and report["totals"]["fusions"] == {"rms_norm": 2}, report["totals"]
    assert report["dumps"][0]["other_runs"] == 2
    lines = [line for line in captured.err.splitlines() if "another run" in line]
    assert len(lines) == 1 and "g001_1_0, g002_2_0" in lines[0] and "not counted" in lines[0], captured.err


def test_report_without_a_readable_summary_reads_every_report_json(capsys, tmp_path):
    root = tmp_path / "dump"
    for graph in (_graph("g000_0_0", 5), _graph("g001_1_0", 7)):
        (root / graph["name"]).mkdir(parents=True)
        (root / graph["name"] / "report.json").write_text(json.dumps(graph))
    assert cli.main(["report", str(root), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["graphs"] == 2


# --- what a compile says ------------------------------------------------------------------------------------------


def _report(refused, anchors=2):
    from qwen_npu_compile.fusion.family import Refusal
    from qwen_npu_compile.report import GraphReport

    return GraphReport(name="g000_0_0", simulated=True, downstream="aot_eager", families=["rms_norm"],
                       fusions={"rms_norm": 0}, anchors={"rms_norm": anchors},
                       refused=[Refusal(family, reason, "modeling_x.py:42", f"n{i}")
                                for i, (family, reason) in enumerate(refused)])


def test_a_refused_family_warning_names_the_reason(caplog, monkeypatch):
    from qwen_npu_compile import backend
    from qwen_npu_compile.config import QwenNpuConfig

    for name in ("QWEN_NPU_DUMP_DIR", "QWEN_NPU_STRICT", "QWEN_NPU_FUSIONS"):
        monkeypatch.delenv(name, raising=False)
    report = _report([("rms_norm", "weight dtype float64 is not supported")] * 2 + [("swiglu", "family 'swiglu' is disabled")])
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        backend.publish(report, QwenNpuConfig.from_options({}))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "rms_norm: weight dtype float64 is not supported (at modeling_x.py:42, 2 times)" in warnings[0], warnings
    assert "swiglu" not in warnings[0] and "read <dir>/summary.json" not in warnings[0]


def test_the_graph_line_names_what_the_graph_holds():
    from qwen_npu_compile.report import GraphReport

    families = ["rms_norm_gated", "rms_norm", "moe", "swiglu", "rotary", "attention"]
    report = GraphReport(name="g000_0_0", simulated=True, downstream="aot_eager", families=families,
                         fusions={**dict.fromkeys(families, 0), "rms_norm": 5, "swiglu": 2},
                         anchors={"rms_norm": 5, "swiglu": 2, "rotary": 1})
    assert report.log_line() == ("qwen_npu [simulated npu ops] g000_0_0: fused rms_norm 5, swiglu 2, rotary 0; "
                                 "downstream aot_eager")


def test_the_graph_line_tells_refusals_from_disabled_families():
    line = _report([("swiglu", "family 'swiglu' is disabled")] * 2 + [("rotary", "family 'rotary' is disabled")],
                   anchors=0).log_line()
    assert "left to disabled families: swiglu 2, rotary 1" in line and "refused" not in line, line
    line = _report([("rms_norm", "weight dtype float64 is not supported")]).log_line()
    assert "1 refused (first: rms_norm: weight dtype float64 is not supported at modeling_x.py:42)" in line, line


# --- the README's first screen runs and prints what it shows ----------------------------------------------


def _readme_blocks(section: str) -> list[tuple[str, str]]:
    """The fenced blocks of the README section titled ``section``: ``[(language, text), ...]`` in order."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {section}\n")
    end = text.index("\n## ", start + 1)
    parts = text[start:end].split("```")
    return [(p.split("\n", 1)[0].strip(), p.split("\n", 1)[1]) for p in parts[1::2]]


def _run_script(source: str, tmp_path: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_NPU_")}
    script = tmp_path / "readme_example.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stderr + done.stdout).splitlines()
    return [line for line in lines if not line.startswith(("  ", "warnings.warn"))
            and "Warning:" not in line]  # library deprecation warnings are not ours to pin


def test_the_readme_fused_training_step_prints_what_it_shows(tmp_path):
    """The README's first example, run as a user pastes it, prints exactly the lines the README shows."""
    (code, source), (_, shown) = _readme_blocks("A fused training step in your code")
    assert code == "python"
    assert _run_script(source, tmp_path) == shown.strip().splitlines()


def test_the_readme_maybe_compile_example_prints_what_it_shows(tmp_path):
    """``maybe_compile`` as the README shows it, on the first example's model: its log lines, exactly."""
    (_, first), _ = _readme_blocks("A fused training step in your code")
    (code, source), (_, shown) = _readme_blocks("Per decoder layer, as verl's worker does: `maybe_compile`")
    assert code == "python"
    setup = "\n".join(line for line in first.splitlines()
                      if "compiled" not in line and "get_reports" not in line)  # the model, not its torch.compile
    assert _run_script(setup + "\n" + source, tmp_path) == shown.strip().splitlines()


_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]\d+)?s?")


def _readme_stack() -> bool:
    """Whether this is the stack the README's outputs were taken on (requirements.txt's torch and transformers)."""
    import transformers

    pins = dict(line.strip().split("==") for line in (REPO / "requirements.txt").read_text().splitlines()
                if line.startswith(("torch==", "transformers==")))
    return torch.__version__.split("+")[0] == pins["torch"] and transformers.__version__ == pins["transformers"]


@pytest.mark.skipif(not _readme_stack(), reason="the README's check sample names requirements.txt's torch and "
                                                "transformers versions (its 'ran with' line)")
def test_the_readme_check_sample_is_what_check_prints(capsys):
    """The README's ``check`` sample against a run of its first command: every line equal but for the measured
    numbers of the parity rows and the timing line (CPU-dependent), and the progress-line count it states."""
    text = (REPO / "README.md").read_text()
    command = next(line.split("#")[0].split() for line in text.splitlines()
                   if line.startswith("qwen-npu-compile check qwen2.5-0.5b --layers 2"))
    start = text.index("The first prints ")
    said = re.search(r"\((\d+) lines for its (\d+) stages\)", text[start:start + 200])
    shown = text[start:].split("```", 2)[1].split("\n", 1)[1].rstrip("\n").splitlines()
    assert cli.main(command[1:]) == 0
    printed = capsys.readouterr().out.rstrip("\n").splitlines()
    progress = [line for line in printed if re.match(r"^\[\d+/\d+\] |^ +done in ", line)]
    assert said and (int(said.group(1)), int(said.group(2))) == (len(progress), sum(p.startswith("[") for p in progress))
    output = [line for line in printed if line not in progress and line.strip()]

    def shape(line: str) -> str:
        varying = line.startswith(("  logits ", "  gradients ", "  compile + first run"))
        return _NUMBER.sub("N", line) if varying else line

    assert [shape(line) for line in output] == [shape(line) for line in shown], "\n".join(output)
