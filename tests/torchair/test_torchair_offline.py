"""The off-NPU torchair conversion check (qwen_npu_compile/torchair_offline, downstream "torchair").

torchair comes from the torch_npu wheel that pairs with the installed torch, downloaded into the cache
on first use (``$QWEN_NPU_TORCHAIR_CACHE``, default ``~/.cache/qwen_npu_compile``; CI reaches PyPI).
Importing torchair patches a few torch internals for the whole process (as it does on an NPU), so every
test that converts graphs runs in a subprocess; the in-process tests never import torchair.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from qwen_npu_compile import cli
from qwen_npu_compile.cli.check.models import tiny_qwen2_config
from qwen_npu_compile.config import QwenNpuConfig
from qwen_npu_compile.ops import EMITTED_OPS
from qwen_npu_compile.torchair.offline import wheel
from qwen_npu_compile.torchair.offline.wheel import ENV_CACHE, ENV_WHEEL, TorchairUnavailableError

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------
# obtaining the wheel (no torchair import)


@pytest.mark.parametrize(("torch_version", "expected"), [
    ("2.14.0+cu130", ["==2.14.0.*", "==2.14.*"]),
    ("2.13.0+cpu", ["==2.13.0.*", "==2.13.*"]),
    ("2.9.1", ["==2.9.1.*", "==2.9.*"]),
    ("2.10.0a0+git1234", ["==2.10.0.*", "==2.10.*"]),
])
def test_torch_npu_pairs_with_torch_major_minor_patch(torch_version, expected):
    assert [str(spec) for spec in wheel.paired_specifiers(torch_version)] == expected
    newest_2_13_0 = wheel.paired_specifiers("2.13.0")[0]
    assert newest_2_13_0.contains("2.13.0.post2") and not newest_2_13_0.contains("2.13.1")


def test_a_torch_newer_than_the_newest_tested_torch_npu_says_so():
    assert wheel.TESTED_TORCH_NPU[-1] == "2.14.0"
    assert wheel.beyond_tested("2.14.1") is None and wheel.beyond_tested("2.7.1+cpu") is None
    assert wheel.beyond_tested("2.15.0.dev20261201") == (
        "torch 2.15.0.dev20261201 is newer than the newest torch_npu this package is tested with (2.14.0; torch_npu "
        "pins its own torch, so a torch without a torch_npu release has no torchair to convert with)")
    with pytest.raises(ValueError, match="cannot pair torch 'next'"):
        wheel.beyond_tested("next")


def test_cache_dir_comes_from_the_environment(tmp_path):
    assert wheel.cache_dir({ENV_CACHE: str(tmp_path)}) == tmp_path
    assert wheel.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "qwen_npu_compile"
    assert wheel.cache_dir({}) == Path.home() / ".cache" / "qwen_npu_compile"


def _offline_pip_env(cache: Path) -> dict[str, str]:
    """An environment with an empty cache and no reachable package index (pip's config files ignored)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_") and key != ENV_WHEEL}
    env.update({ENV_CACHE: str(cache), "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1"})
    return env


def test_no_network_and_no_wheel_is_a_clear_error(tmp_path):
    with pytest.raises(TorchairUnavailableError) as caught:
        wheel.obtain_wheel("2.13.0", _offline_pip_env(tmp_path / "cache"))
    message = str(caught.value)
    assert "could not be obtained" in message and "pip download" in message and "torch-npu==2.13.0.*" in message
    assert f"set {ENV_WHEEL}=" in message and "never installed" in message
    assert "newer than the newest torch_npu" not in message
    assert not list((tmp_path / "cache" / "wheels").glob("*.whl"))


def test_no_wheel_for_a_torch_beyond_the_tested_range_names_the_newest_tested_release(tmp_path):
    with pytest.raises(TorchairUnavailableError) as caught:
        wheel.obtain_wheel("2.15.0", _offline_pip_env(tmp_path / "cache"))
    message = str(caught.value)
    assert "torch-npu==2.15.0.*" in message
    assert "could not be obtained: torch 2.15.0 is newer than the newest torch_npu this package is tested with (2.14.0;" in message


def test_check_without_torchair_exits_2_before_building(tmp_path, monkeypatch, capsys):
    offline = _offline_pip_env(tmp_path / "cache")
    for key in [key for key in os.environ if key not in offline]:
        monkeypatch.delenv(key)
    for key, value in offline.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["check", "qwen2.5-0.5b", "--layers", "1", "--downstream", "torchair"]) == 2
    captured = capsys.readouterr()
    assert "could not be obtained" in captured.err and "building" not in captured.out


def test_named_wheel_must_exist_and_be_a_torch_npu_wheel(tmp_path):
    with pytest.raises(TorchairUnavailableError, match="does not exist"):
        wheel.obtain_wheel("2.13.0", {ENV_WHEEL: str(tmp_path / "missing.whl")})
    other = tmp_path / "numpy-2.0.0-py3-none-any.whl"
    other.write_bytes(b"")
    with pytest.raises(TorchairUnavailableError, match="is not a torch_npu wheel"):
        wheel.obtain_wheel("2.13.0", {ENV_WHEEL: str(other)})
    with pytest.raises(TorchairUnavailableError, match="holds no torch_npu wheel matching"):
        wheel.obtain_wheel("2.13.0", {ENV_WHEEL: str(tmp_path)})


def _fake_wheel(folder: Path, files: dict[str, bytes], corrupt: str | None = None, version: str = "2.13.0") -> Path:
    """A minimal torch_npu wheel holding ``files``; ``corrupt`` names a file whose RECORD hash is wrong."""
    path = folder / f"torch_npu-{version}-cp311-cp311-manylinux_2_28_x86_64.whl"
    record = []
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(b"x" if name == corrupt else data).digest())
            record.append(f"{name},sha256={digest.rstrip(b'=').decode()},{len(data)}")
        archive.writestr(f"torch_npu-{version}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


TORCHAIR_FILES = {
    "torch_npu/dynamo/torchair/__init__.py": b"VALUE = 1\n",
    "torch_npu/dynamo/torchair/core/_torchair.so": b"\x7fELF",
    "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml": b"- func: npu_x(Tensor self) -> Tensor\n",
    "torch_npu/op_plugin/meta/_meta_registrations.py": b"# meta\n",
    "torch_npu/other.py": b"not extracted\n",
}


def test_wheel_is_verified_against_its_record_and_extracted_once(tmp_path):
    env = {ENV_CACHE: str(tmp_path / "cache"), ENV_WHEEL: str(_fake_wheel(tmp_path, TORCHAIR_FILES))}
    sources = wheel.obtain_sources("2.13.0+cpu", env)
    assert sources.torch_npu_version == "2.13.0"
    assert (sources.import_root / "torchair" / "__init__.py").read_bytes() == b"VALUE = 1\n"
    assert sources.schemas_yaml.is_file() and sources.meta_registrations.is_file()
    assert not (sources.import_root / "torchair" / "core" / "_torchair.so").exists()  # stand-ins replace it
    assert not (sources.import_root.parent / "other.py").exists()
    assert sources.seconds["extract"] > 0
    assert wheel.obtain_sources("2.13.0+cpu", env).seconds["extract"] == 0.0  # reused


def test_wheel_with_a_wrong_record_hash_is_rejected(tmp_path):
    bad = _fake_wheel(tmp_path, TORCHAIR_FILES, corrupt="torch_npu/dynamo/torchair/__init__.py")
    with pytest.raises(TorchairUnavailableError, match="its RECORD says"):
        wheel.obtain_sources("2.13.0", {ENV_CACHE: str(tmp_path / "cache"), ENV_WHEEL: str(bad)})
    assert not list((tmp_path / "cache" / "extracted").glob("torch_npu-*"))


def test_cached_wheel_that_changed_since_download_is_rejected(tmp_path):
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    cached = _fake_wheel(cache / "wheels", TORCHAIR_FILES)
    Path(f"{cached}.sha256").write_text("0" * 64 + "\n")
    with pytest.raises(TorchairUnavailableError, match="does not match the sha256 recorded"):
        wheel.obtain_wheel("2.13.0", {ENV_CACHE: str(cache)})


# ---------------------------------------------------------------------------------------------------
# torchair settings


@pytest.mark.parametrize(("options", "env", "message"), [
    ({"torchair_mode": "fast"}, {}, r"option 'torchair_mode' = 'fast' is not valid; choose one of \['max-autotune', 'reduce-overhead'\]"),
    ({}, {"QWEN_NPU_TORCHAIR_MODE": "npugraph_ex"}, r"QWEN_NPU_TORCHAIR_MODE = 'npugraph_ex' is not valid"),
    ({"torchair_dump": "json", "dump_dir": "/tmp/x"}, {}, r"'json' is not valid; choose one of \['pbtxt', 'txt', 'py'\] or 'none'"),
    ({"torchair_dump": "pbtxt"}, {}, r"option 'torchair_dump' = 'pbtxt' needs a dump folder"),
    ({"torchair_run_eagerly": "sometimes"}, {}, r"option 'torchair_run_eagerly' = 'sometimes' is not a boolean"),
])
def test_bad_torchair_settings_raise_value_error(options, env, message):
    with pytest.raises(ValueError, match=message):
        QwenNpuConfig.from_options(options, environ=env)


def test_torchair_settings_from_options_and_environment(tmp_path):
    env = {"QWEN_NPU_TORCHAIR_MODE": " Reduce-Overhead ", "QWEN_NPU_TORCHAIR_RUN_EAGERLY": "1",
           "QWEN_NPU_DUMP_DIR": str(tmp_path), "QWEN_NPU_TORCHAIR_DUMP": "txt"}
    config = QwenNpuConfig.from_options({"torchair_dump": "pbtxt"}, environ=env)
    assert (config.torchair_mode, config.torchair_dump, config.torchair_run_eagerly) == ("reduce-overhead", "pbtxt", True)
    default = QwenNpuConfig.from_options({}, environ={"QWEN_NPU_TORCHAIR_DUMP": "none"})
    assert (default.torchair_mode, default.torchair_dump, default.torchair_run_eagerly) == ("max-autotune", None, None)


# ---------------------------------------------------------------------------------------------------
# the stand-ins against the wheel (reads the wheel's files; no torchair import)


@pytest.fixture(scope="module")
def sources():
    """The torch_npu release that pairs with this stack's torch (each stack of the matrix checks its own:
    ``stack_compat``; the wheel is the one tools/ge_matrix.py converts with, from the same cache)."""
    return wheel.obtain_sources(torch.__version__)


@pytest.mark.stack_compat
def test_stand_in_schemas_equal_the_wheels(simulated_npu_ops, sources):
    from tests.helpers.wheel_contracts import schema_mismatches

    assert schema_mismatches(sources.schemas_yaml, EMITTED_OPS) == {}


def _meta_cases():
    bf16 = torch.bfloat16
    x, gamma, rstd = torch.randn(2, 16, 64, dtype=bf16), torch.randn(64, dtype=bf16), torch.rand(2, 16, 1)
    gate_up, dy_half = torch.randn(2, 16, 256, dtype=bf16), torch.randn(2, 16, 128, dtype=bf16)
    emb, cos = torch.randn(2, 16, 4, 64, dtype=bf16), torch.randn(1, 16, 1, 64, dtype=bf16)
    q, k, v = torch.randn(2, 16, 256, dtype=bf16), torch.randn(2, 16, 128, dtype=bf16), torch.randn(2, 16, 128, dtype=bf16)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool).triu(1)
    stats = torch.rand(2, 4, 16, 8) + 1
    return {
        "npu_rms_norm": ((x, gamma, 1e-6), {}),
        "npu_rms_norm_backward": ((x, x, gamma, rstd), {}),
        "npu_add_rms_norm": ((x, x, gamma, 1e-6), {}),
        "npu_swiglu": ((gate_up, -1), {}),
        "npu_swiglu_backward": ((dy_half, gate_up, -1), {}),
        "npu_rotary_mul": ((emb, cos, cos), {}),
        "npu_rotary_mul_backward": ((emb, emb, cos, cos), {}),
        "npu_fusion_attention": ((q, k, v, 4, "BSH"), {"atten_mask": mask, "scale": 0.125}),
        "npu_fusion_attention_grad": ((q, k, v, q, 4, "BSH"), {"atten_mask": mask, "softmax_max": stats,
                                                               "softmax_sum": stats, "attention_in": q, "scale_value": 0.125}),
    }


#: Output positions where the stand-in deliberately differs from the wheel's meta kernel.
KNOWN_META_DIFFERENCES = {
    # torch_npu's Meta kernel returns None for dpse, a `Tensor` output of the schema; the stand-in returns
    # an empty [0] tensor of q's dtype so that traced graphs hold a tensor there.
    ("npu_fusion_attention_grad", 3): "dpse",
}


@pytest.mark.stack_compat
def test_stand_in_fake_kernels_match_the_wheels_meta_kernels(simulated_npu_ops, sources):
    from tests.helpers.wheel_contracts import load_meta_kernels, output_differences

    kernels = load_meta_kernels(sources.meta_registrations)
    assert set(EMITTED_OPS) <= set(kernels.functions)
    differences = {}
    for op, (args, kwargs) in _meta_cases().items():
        for index, pair in output_differences(op, kernels.functions[op], args, kwargs).items():
            differences[(op, index)] = pair
    assert set(differences) == set(KNOWN_META_DIFFERENCES), differences


# ---------------------------------------------------------------------------------------------------
# conversion (each in a subprocess: torchair's import patches torch process-wide)


def _run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tiny_head_dim_64(tmp_path):
    """A 2-layer Qwen2 with head_dim 64 (hidden 256, 4 heads, 2 KV heads): what the GE kernels support."""
    folder = tmp_path / "tiny-qwen2-hd64"
    tiny_qwen2_config(hidden_size=256).save_pretrained(folder)
    return folder


def test_check_converts_a_fused_inference_graph(simulated_npu_ops, tiny_head_dim_64, tmp_path):
    out = tmp_path / "result.json"
    done = _run(["-m", "qwen_npu_compile", "check", str(tiny_head_dim_64), "--mode", "infer", "--seq-len", "16",
                 "--batch", "2", "--downstream", "torchair", "--json", str(out)], cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "GE conversion: ok" in done.stdout and "torchair 2." in done.stdout
    result = json.loads(out.read_text())
    ge = result["ge"]
    assert ge["failures"] == [] and ge["torch_npu"] == result["versions"]["torchair"].split()[0]
    assert [graph["kind"] for graph in ge["graphs"]] == ["forward"]
    ops = ge["graphs"][0]["ops"]
    # without autograd the residual add joins 4 of the 5 RMSNorms (npu_add_rms_norm -> AddRmsNorm)
    fused_ops = ("RmsNorm", "AddRmsNorm", "SwiGlu", "RotaryMul", "FlashAttentionScore")
    assert {op: ops.get(op, 0) for op in fused_ops} == {
        "RmsNorm": 1, "AddRmsNorm": 4, "SwiGlu": 2, "RotaryMul": 4, "FlashAttentionScore": 2}
    # each SwiGLU reads qwen_npu.gate_up_proj: 2 BatchMatMulV2 and a ConcatD along axis 0 (torchair/converters.py)
    assert (ops.get("BatchMatMulV2", 0), ops.get("ConcatD", 0)) == (4, 2)
    assert result["versions"]["npu_ops"] == "simulated" and result["versions"]["torch_npu"] is None
    assert result["versions"]["torch"] == torch.__version__


UNCONVERTIBLE_MODEL = '''
import json, sys
import torch
from qwen_npu_compile import ensure_npu_ops, get_reports

ensure_npu_ops()

@torch.library.custom_op("qwen_npu_test::opaque_scale", mutates_args=())
def opaque_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2

@opaque_scale.register_fake
def _(x):
    return torch.empty_like(x)

class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.proj(x).relu()
        z = opaque_scale(y) + 1  # LINE_OF_THE_OP
        q = z.reshape(1, 4, 16)  # fp32 attention: converts to FlashAttentionScore, which takes fp16/bf16 only
        attention = torch.ops.npu.npu_fusion_attention.default(q, q, q, 1, "BSH", scale=0.25)[0]  # LINE_OF_THE_LIMIT
        return attention.reshape(4, 16)

model = Toy()
compiled = torch.compile(model, backend="qwen_npu", options={
    "downstream": "torchair", "dump_dir": sys.argv[1], "torchair_dump": "pbtxt"})
x = torch.randn(4, 16)
with torch.no_grad():  # the toy op has no autograd formula
    out = compiled(x)
    torch.testing.assert_close(out, model(x))  # run_eagerly: torchair ran the FX graph with the real op
(report,) = get_reports()
print(json.dumps(report.as_dict()["ge"]))
'''


def test_unconvertible_node_is_reported_with_op_and_model_source_line(simulated_npu_ops, tmp_path):
    script = tmp_path / "modeling_toy.py"
    script.write_text(textwrap.dedent(UNCONVERTIBLE_MODEL))
    lines = {marker: number for number, text in enumerate(UNCONVERTIBLE_MODEL.splitlines(), start=1)
             for marker in ("LINE_OF_THE_OP", "LINE_OF_THE_LIMIT") if marker in text}
    done = _run([str(script), str(tmp_path / "dump")], cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ge = json.loads(done.stdout.strip().splitlines()[-1])
    converter, limit = ge["failures"]
    assert (converter["op"], converter["kind"]) == ("qwen_npu_test.opaque_scale.default", "converter")
    assert converter["source"] == f"modeling_toy.py:{lines['LINE_OF_THE_OP']}"
    assert "GE IR" in converter["error"] or "AscendIR" in converter["error"] or "not registered" in converter["error"]
    assert (limit["op"], limit["kind"]) == ("npu.npu_fusion_attention.default", "limit")
    assert limit["source"] == f"modeling_toy.py:{lines['LINE_OF_THE_LIMIT']}"
    assert limit["error"].startswith("limit: ") and "float32" in limit["error"], limit
    (graph,) = ge["graphs"]
    assert graph["kind"] == "forward" and graph["ops"].get("Relu") == 1 and graph["ops"].get("FlashAttentionScore") == 1
    assert not any("opaque" in op for op in graph["ops"])  # the failed node's mock op is not counted
    summary = json.loads((tmp_path / "dump" / "summary.json").read_text())
    assert summary["graphs"][0]["ge"]["failures"] == ge["failures"]
    assert list((tmp_path / "dump" / summary["graphs"][0]["name"] / "torchair").glob("*.pbtxt"))


def test_ascend_owner_script_parses_its_arguments():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import npu_torchair_smoke
    finally:
        sys.path.remove(str(REPO / "examples"))
    args = npu_torchair_smoke.build_parser().parse_args(["--layers", "2", "--steps", "3", "--dtype", "fp32"])
    assert (args.model, args.layers, args.steps, args.dtype, args.rtol) == ("qwen2.5-0.5b", 2, 3, "fp32", None)
    with pytest.raises(SystemExit):
        npu_torchair_smoke.build_parser().parse_args(["--steps", "0"])


def test_ascend_owner_script_dry_run_trains_through_offline_torchair(simulated_npu_ops, tiny_head_dim_64, tmp_path):
    done = _run([str(REPO / "examples" / "npu_torchair_smoke.py"), "--model", str(tiny_head_dim_64), "--seq-len", "16",
                 "--steps", "3"], cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verdict: PASS (DRY RUN" in done.stdout
    assert "FlashAttentionScoreGrad': 2" in done.stdout and "RmsNormGrad': 5" in done.stdout
