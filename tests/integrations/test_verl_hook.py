"""qwen_npu_compile.verl: switching qwen_npu on in an unmodified verl by environment variables only.

Two parts:

* the hook's own logic, with stand-in verl modules (fake module objects, and a fake ``verl`` package
  on disk imported in a subprocess): off means untouched, the engine method is hooked once and
  compiles before FSDP wrapping, a missing or changed verl function fails loudly. Runs everywhere.
* ``-m verl``: verl 0.9.1's own FSDP engine (``FSDPEngineWithLMHead``) on CPU, driven in subprocesses
  (``VERL_USE_EXTERNAL_MODULES`` is read by ``import verl``): model build from a tiny Qwen2 saved with
  ``save_pretrained``, gloo, world size 1, verl's ``train_batch`` steps with verl's ``sft_loss``; the
  run with ``QWEN_NPU_COMPILE=1`` must compile every layer, fuse exactly, and match the unset run's
  losses and gradients. Skipped where verl is not installed (``tools/verl_env_check.sh`` makes a
  venv with it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import transformers

import qwen_npu_compile.verl as hook
from qwen_npu_compile.patterns import expected_fusions
from qwen_npu_compile.worker import ENV_COMPILE, layer_reports
from tests.helpers import DRIVERS, REPO
from tests.helpers.mindspeed_stand_in import DUMMY, write_stand_in
from tests.helpers.numerics import max_abs_ratio
from tests.helpers.runs import assert_every_layer_fused

PER_LAYER = expected_fusions(transformers.Qwen2Config(), per_layer=True)  # one Qwen2 decoder layer graph
VERL_INSTALLED = importlib.util.find_spec("verl") is not None


def tiny_qwen2(layers: int = 2):
    from qwen_npu_compile.cli.check.models import tiny_qwen2

    return tiny_qwen2(num_hidden_layers=layers).train()


def compiled_layers(model) -> list[bool]:
    return [layer._compiled_call_impl is not None for layer in model.model.layers]


# --------------------------------------------------------------------------------------------------
# stand-in verl modules


def fake_engine_module(**extra) -> types.ModuleType:
    """A stand-in for verl.workers.engine.fsdp.transformer_impl: FSDPEngine whose FSDP step records the model."""

    class FSDPEngine:
        def __init__(self, strategy="fsdp2", use_orig_params=False):
            self.engine_config = types.SimpleNamespace(strategy=strategy, use_orig_params=use_orig_params)
            self.wrapped = None

        def _build_fsdp_module(self, module):
            self.wrapped = (module, compiled_layers(module))  # what FSDP would wrap, compiled or not
            return module

    module = types.ModuleType("fake_transformer_impl")
    module.FSDPEngine = FSDPEngine
    for name, value in extra.items():
        setattr(module, name, value)
    return module


@pytest.fixture
def fake_verl(monkeypatch, tmp_path):
    """A fake ``verl`` in sys.modules (version 0.0.fake) whose folder is ``tmp_path``."""
    module = types.ModuleType("verl")
    module.__path__ = [str(tmp_path)]
    module.__version__ = "0.0.fake"
    monkeypatch.setitem(sys.modules, "verl", module)
    return tmp_path


# --- the switch ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "", "0", "off"])
def test_switched_off_install_touches_nothing(monkeypatch, value):
    environ = {} if value is None else {ENV_COMPILE: value}
    meta_path = list(sys.meta_path)
    assert hook.install(environ) is False
    assert sys.meta_path == meta_path


def test_bad_value_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=ENV_COMPILE):
        hook.install({ENV_COMPILE: "enable"})


def test_switched_on_without_verl_fails_loudly(monkeypatch):
    monkeypatch.setattr(hook, "_verl_dirs", lambda: [])
    with pytest.raises(hook.VerlHookError, match="verl is not installed"):
        hook.install({ENV_COMPILE: "1"})


def test_switched_on_with_a_verl_that_has_neither_module_fails_loudly(fake_verl):
    (fake_verl / "workers").mkdir()
    with pytest.raises(hook.VerlHookError) as info:
        hook.install({ENV_COMPILE: "1"})
    message = str(info.value)
    assert "verl 0.0.fake" in message and "verl.workers.engine.fsdp.transformer_impl" in message
    assert "FSDPEngine._build_fsdp_module" in message and hook.CHECKED_VERL_VERSION in message
    assert ENV_COMPILE in message  # says how to switch it off


# --- the engine hook -------------------------------------------------------------------------------


def test_engine_method_compiles_before_fsdp_wraps_and_is_hooked_once(monkeypatch, fake_verl):
    monkeypatch.setenv(ENV_COMPILE, "1")
    module = fake_engine_module()
    original = module.FSDPEngine._build_fsdp_module
    assert hook.patch_engine(module) is True
    patched = module.FSDPEngine._build_fsdp_module
    assert patched is not original and patched.__wrapped__ is original
    assert hook.patch_engine(module) is False  # idempotent
    assert module.FSDPEngine._build_fsdp_module is patched

    engine, model = module.FSDPEngine(), tiny_qwen2()
    assert engine._build_fsdp_module(model) is model
    assert engine.wrapped == (model, [True, True])  # compiled before the FSDP step ran
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    for name, record in layer_reports(model).items():
        assert record.reports and record.reports[-1].fusions == PER_LAYER, (name, record.reports)


def test_engine_method_does_nothing_when_switched_off_at_build(monkeypatch, fake_verl):
    module = fake_engine_module()
    monkeypatch.setenv(ENV_COMPILE, "1")
    hook.patch_engine(module)
    monkeypatch.setenv(ENV_COMPILE, "0")
    engine, model = module.FSDPEngine(strategy="fsdp", use_orig_params=False), tiny_qwen2()
    engine._build_fsdp_module(model)
    assert engine.wrapped == (model, [False, False])


def test_fsdp1_without_orig_params_is_refused_at_build(monkeypatch, fake_verl):
    monkeypatch.setenv(ENV_COMPILE, "1")
    module = fake_engine_module()
    hook.patch_engine(module)
    engine, model = module.FSDPEngine(strategy="fsdp", use_orig_params=False), tiny_qwen2()
    with pytest.raises(ValueError) as info:
        engine._build_fsdp_module(model)
    message = str(info.value)
    assert "use_orig_params=False" in message and "actor_rollout_ref.actor.fsdp_config.use_orig_params=True" in message
    assert "actor_rollout_ref.actor.strategy=fsdp2" in message
    assert engine.wrapped is None and compiled_layers(model) == [False, False]
    # FSDP1 with use_orig_params=True compiles
    engine = module.FSDPEngine(strategy="fsdp", use_orig_params=True)
    engine._build_fsdp_module(model)
    assert engine.wrapped[1] == [True, True]


def test_engine_subclass_with_its_own_fsdp_step_is_refused(monkeypatch, fake_verl):
    monkeypatch.setenv(ENV_COMPILE, "1")
    module = fake_engine_module()

    class TurboEngine(module.FSDPEngine):  # verl 0.9.1: FSDPTurboEngineWithLMHead
        def _build_fsdp_module(self, module):
            return module

    class LMHeadEngine(module.FSDPEngine):  # inherits the hooked method
        pass

    hook.patch_engine(module)
    with pytest.raises(hook.VerlHookError, match="TurboEngine overrides FSDPEngine._build_fsdp_module"):
        TurboEngine(strategy="fsdp_turbo")._build_fsdp_module(tiny_qwen2())
    engine = LMHeadEngine()
    engine._build_fsdp_module(tiny_qwen2())
    assert engine.wrapped[1] == [True, True]
    monkeypatch.setenv(ENV_COMPILE, "0")
    model = tiny_qwen2()
    assert TurboEngine()._build_fsdp_module(model) is model  # off: the subclass runs as before


def _without_method():
    module = fake_engine_module()
    del module.FSDPEngine._build_fsdp_module
    return module


def _changed_signature():
    module = fake_engine_module()
    module.FSDPEngine._build_fsdp_module = lambda self, module, mesh: module
    return module


@pytest.mark.parametrize("make, missing", [
    (lambda: types.ModuleType("empty"), "has no class FSDPEngine"),
    (_without_method, "has no method FSDPEngine._build_fsdp_module"),
    (_changed_signature, "takes ('self', 'module', 'mesh'), not ('self', 'module')"),
], ids=["no-class", "no-method", "changed-signature"])
def test_missing_engine_function_fails_loudly(fake_verl, make, missing):
    with pytest.raises(hook.VerlHookError) as info:
        hook.patch_engine(make())
    message = str(info.value)
    assert missing in message and "verl 0.0.fake" in message
    assert f"checked against verl {hook.CHECKED_VERL_VERSION}" in message and "maybe_compile" in message


# --- the legacy worker hook (verl <= 0.7) ---------------------------------------------------------------


def test_legacy_wrap_policy_compiles_first_and_is_hooked_once(monkeypatch, fake_verl):
    monkeypatch.setenv(ENV_COMPILE, "1")
    seen = []

    def get_fsdp_wrap_policy(module, config=None, is_lora=False):
        seen.append(compiled_layers(module))
        return "policy"

    module = types.ModuleType("fake_fsdp_workers")
    module.get_fsdp_wrap_policy = get_fsdp_wrap_policy
    assert hook.patch_legacy(module) is True and hook.patch_legacy(module) is False
    assert module.get_fsdp_wrap_policy(module=tiny_qwen2(), config={}, is_lora=False) == "policy"
    assert seen == [[True, True]]


def test_legacy_module_without_the_function_fails_loudly(fake_verl):
    with pytest.raises(hook.VerlHookError, match="verl 0.0.fake has no get_fsdp_wrap_policy in verl.workers.fsdp_workers"):
        hook.patch_legacy(types.ModuleType("fake_fsdp_workers"))


# --- importing: lazy, idempotent, loud (a fake verl package on disk, fresh interpreters) ---------------------

FAKE_ENGINE = '''
class FSDPEngine:
    def _build_fsdp_module(self, module):
        return module

class FSDPEngineWithLMHead(FSDPEngine):
    pass
'''
FAKE_TURBO = '''
from .transformer_impl import FSDPEngineWithLMHead

class FSDPTurboEngineWithLMHead(FSDPEngineWithLMHead):
    def _build_fsdp_module(self, module):
        return module
'''


def write_fake_verl(root: Path, engine: str | None = FAKE_ENGINE, legacy: bool = False) -> Path:
    """verl/__init__.py imports VERL_USE_EXTERNAL_MODULES as verl 0.9.1 does; engine code as given."""
    package = root / "verl"
    (package / "workers" / "engine" / "fsdp").mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent('''
        import importlib, os
        __version__ = "0.0.fake"
        for name in filter(None, os.getenv("VERL_USE_EXTERNAL_MODULES", "").split(",")):
            importlib.import_module(name)
    '''))
    for folder in ("workers", "workers/engine"):
        (package / folder / "__init__.py").write_text("")
    if engine is not None:
        (package / "workers/engine/fsdp/__init__.py").write_text(
            "from .transformer_impl import FSDPEngine, FSDPEngineWithLMHead\n"
            "from .fsdp_turbo_impl import FSDPTurboEngineWithLMHead\n")
        (package / "workers/engine/fsdp/transformer_impl.py").write_text(engine)
        (package / "workers/engine/fsdp/fsdp_turbo_impl.py").write_text(FAKE_TURBO)
    if legacy:
        (package / "workers/fsdp_workers.py").write_text(
            "def get_fsdp_wrap_policy(module, config=None, is_lora=False):\n    return None\n")
    return root


PROBE = '''
import json, sys
import verl
result = {"engine_imported_by_verl": "verl.workers.engine.fsdp" in sys.modules,
          "hook_imported": "qwen_npu_compile.verl" in sys.modules}
from verl.workers.engine.fsdp import transformer_impl, fsdp_turbo_impl
import qwen_npu_compile.verl as hook
hook.install()  # a second install (as importing twice would) changes nothing
result["hooked"] = hasattr(transformer_impl.FSDPEngine._build_fsdp_module, "__wrapped__")
method = transformer_impl.FSDPEngine._build_fsdp_module
result["wrapped_once"] = not hasattr(getattr(method, "__wrapped__", None), "__wrapped__")
result["turbo_refuses"] = hasattr(fsdp_turbo_impl.FSDPTurboEngineWithLMHead._build_fsdp_module, "__wrapped__")
result["finder_left"] = any(type(f).__name__ == "_AfterImport" for f in sys.meta_path)
print("RESULT" + json.dumps(result))
'''


def run_probe(root: Path, compile_value: str | None, code: str = PROBE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN_NPU", "VERL_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(root), str(REPO)]), VERL_USE_EXTERNAL_MODULES="qwen_npu_compile.verl")
    if compile_value is not None:
        env[ENV_COMPILE] = compile_value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def probe_result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_import_from_verl_patches_the_engine_when_it_is_imported(tmp_path):
    result = probe_result(run_probe(write_fake_verl(tmp_path), "1"))
    assert result == {"engine_imported_by_verl": False, "hook_imported": True, "hooked": True,
                      "wrapped_once": True, "turbo_refuses": True, "finder_left": False}


def test_import_from_verl_with_the_switch_off_patches_nothing(tmp_path):
    result = probe_result(run_probe(write_fake_verl(tmp_path), None))
    assert result == {"engine_imported_by_verl": False, "hook_imported": True, "hooked": False,
                      "wrapped_once": True, "turbo_refuses": False, "finder_left": False}


def test_engine_without_the_hooked_method_fails_when_verl_imports_it(tmp_path):
    proc = run_probe(write_fake_verl(tmp_path, engine=FAKE_ENGINE.replace("_build_fsdp_module", "_build_fsdp")), "1")
    assert proc.returncode != 0
    assert "VerlHookError" in proc.stderr and "verl 0.0.fake has no method FSDPEngine._build_fsdp_module" in proc.stderr


def test_verl_without_engine_or_legacy_worker_fails_at_import(tmp_path):
    proc = run_probe(write_fake_verl(tmp_path, engine=None), "1", code="import verl")
    assert proc.returncode != 0
    assert "VerlHookError" in proc.stderr and "verl 0.0.fake has no verl.workers.engine.fsdp.transformer_impl" in proc.stderr


def test_legacy_worker_is_hooked_when_the_release_has_it(tmp_path):
    code = ("import verl, verl.workers.fsdp_workers as w\n"
            "assert hasattr(w.get_fsdp_wrap_policy, '__wrapped__'), 'not hooked'\nprint('RESULT{}')")
    probe_result(run_probe(write_fake_verl(tmp_path, engine=None, legacy=True), "1", code=code))


# --------------------------------------------------------------------------------------------------
# verl 0.9.1's own engine (pytest -m verl; needs verl installed)

ENGINE_RUN = DRIVERS / "verl_engine_run.py"
needs_verl = pytest.mark.skipif(
    not VERL_INSTALLED,
    reason="verl is not installed here; tools/verl_env_check.sh makes a venv with verl 0.9.1 and runs these",
)
#: the engine runs compared (see tests/verl_engine_run.py): name -> settings
SCENARIOS = {
    # fp32 params (mixed_precision param_dtype fp32): compiled and eager agree to float rounding
    "fsdp2_fp32": {"strategy": "fsdp2", "param_dtype": "fp32", "gradient_checkpointing": False},
    # verl's defaults for the actor: bf16 mixed precision under autocast, gradient checkpointing on
    "fsdp2_bf16_checkpointing": {"strategy": "fsdp2", "param_dtype": "bf16", "gradient_checkpointing": True},
    # a reference model: FSDPEngineConfig(forward_only=True) (bf16 weights, CPU-offloaded FSDP2 shards). Its
    # build passes the hook, then stops on a CPU inside fully_shard (pin_memory needs an accelerator).
    "ref_forward_only": {"strategy": "fsdp2", "param_dtype": "bf16", "gradient_checkpointing": False,
                         "forward_only": True},
    # verl's default FSDP1 setting: refused with QWEN_NPU_COMPILE=1 before FSDP1 is called. (FSDP1 itself
    # cannot run here: verl passes sync_module_states=True, which FSDP1 allows on GPUs only; FSDP1 with
    # use_orig_params=True is trained by tests/integrations/test_fsdp.py, in verl's order, with the same maybe_compile.)
    "fsdp1_flat_params": {"strategy": "fsdp", "use_orig_params": False, "param_dtype": "fp32",
                          "gradient_checkpointing": False},
}
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}  # relative: max|on - off| / max|off|
#: the hook's two lines per trained model: at the build, and when every layer has run once
BUILD_LINE = ("qwen_npu: verl 0.9.1: FSDPEngineWithLMHead._build_fsdp_module: set 2 decoder layer(s) of "
              "Qwen2ForCausalLM to compile before FSDP wrapping (graphs at the first forward)")
GRAPHS_LINE = ("qwen_npu: verl 0.9.1: FSDPEngineWithLMHead._build_fsdp_module: 2 of 2 decoder layer(s) of "
               "Qwen2ForCausalLM produced qwen_npu graphs at their first call; 2 of 2 reached their expected fusions")


def run_engine(tmp_path: Path, name: str, env: dict, scenarios: list[str]) -> dict:
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({key: SCENARIOS[key] for key in scenarios}))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN_NPU", "VERL_USE_EXTERNAL"))}
    proc = subprocess.run([sys.executable, str(ENGINE_RUN), str(spec), str(tmp_path / f"{name}.out.json")],
                          env={**base, **env}, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {"results": json.loads((tmp_path / f"{name}.out.json").read_text()), "log": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """The same verl engine runs with QWEN_NPU_COMPILE unset, and set by the two env-only routes."""
    tmp = tmp_path_factory.mktemp("verl_engine")
    stand_in = write_stand_in(tmp / "mindspeed_site")
    all_runs = list(SCENARIOS)
    return {
        "off": run_engine(tmp, "off", {"VERL_USE_EXTERNAL_MODULES": "qwen_npu_compile.verl"}, all_runs),
        "on": run_engine(tmp, "on", {"VERL_USE_EXTERNAL_MODULES": "qwen_npu_compile.verl", ENV_COMPILE: "1"},
                         all_runs),
        # actor_rollout_ref.model.external_lib: HFModelConfig imports the module, no VERL_USE_EXTERNAL_MODULES
        "external_lib": run_engine(tmp, "external_lib", {ENV_COMPILE: "1", "VERL_ENGINE_RUN_EXTERNAL_LIB": "1"},
                                   ["fsdp2_fp32"]),
        # MindSpeed (tests/helpers/mindspeed_stand_in.py) replaced torch.compile before our hook was imported / after
        **{f"mindspeed_{order}": run_engine(tmp, f"mindspeed_{order}", {
            "VERL_USE_EXTERNAL_MODULES": "qwen_npu_compile.verl", ENV_COMPILE: "1", "VERL_ENGINE_RUN_MINDSPEED": order,
            "PYTHONPATH": os.pathsep.join([str(stand_in), *filter(None, [os.environ.get("PYTHONPATH")])])},
            [scenario]) for order, scenario in (("before", "fsdp2_bf16_checkpointing"), ("after", "fsdp2_fp32"))},
    }


def assert_matches(on: dict, off: dict, dtype: str, steps: int = 2) -> None:
    assert on["verl_version"] == off["verl_version"] == "0.9.1"
    assert len(on["losses"]) == len(off["losses"]) == steps
    if dtype == "fp32":  # (a bf16 loss of ~4.9 has a resolution of 0.03: both steps may round alike)
        assert len(set(off["losses"])) == steps  # each step (new data, updated weights) has another loss
    assert max_abs_ratio(on["losses"], off["losses"]) <= TOLERANCE[dtype], (on["losses"], off["losses"])
    assert set(on["grads"]) == set(off["grads"]) and len(off["grads"]) > 10
    worst = max(max_abs_ratio(on["grads"][name], off["grads"][name]) for name in off["grads"])
    assert worst <= 5 * TOLERANCE[dtype], worst


def assert_fused_and_called(run: dict, calls_key: str, calls: int) -> None:
    """Every decoder layer of ``run`` fused a Qwen2 layer's families in every graph, and ran ``calls`` times as
    ``calls_key`` (compiled / checkpointed)."""
    assert_every_layer_fused(run, PER_LAYER)
    for name, layer in run["layers"].items():
        assert layer["calls"][calls_key] == calls, (name, layer["calls"])


@pytest.mark.verl
@needs_verl
@pytest.mark.parametrize("scenario", ["fsdp2_fp32", "fsdp2_bf16_checkpointing"])
def test_verl_engine_compiles_fuses_and_matches_the_unset_run(engine_runs, scenario):
    off, on = engine_runs["off"]["results"][scenario], engine_runs["on"]["results"][scenario]
    assert "error" not in off and "error" not in on, (off.get("error"), on.get("error"))
    assert off["compiled_layers"] == [] and off["layers"] == {}  # unset: verl runs as it always did
    settings = SCENARIOS[scenario]
    # 2 train_batch steps x 2 micro-batches (verl's micro_batch_size_per_gpu=2, batch of 4)
    assert_fused_and_called(on, "checkpointed" if settings["gradient_checkpointing"] else "compiled", 4)
    assert_matches(on, off, settings["param_dtype"])
    assert on["state_dict_keys"] == off["state_dict_keys"]
    assert on["hook_log"] == [BUILD_LINE, GRAPHS_LINE]
    assert on["torch_compile"] == off["torch_compile"] == "torch.compile"


@pytest.mark.verl
@needs_verl
@pytest.mark.parametrize("order", ["before", "after"])
def test_verl_engine_under_mindspeed_fuses_exactly_as_without_it(engine_runs, order):
    """MindSpeed's dummy_compile in place of torch.compile (imported before our hook, or after it as verl's
    engine package does): every layer fuses exactly as without it, and the run matches the unset one."""
    scenario = "fsdp2_bf16_checkpointing" if order == "before" else "fsdp2_fp32"
    on = engine_runs[f"mindspeed_{order}"]["results"][scenario]
    off = engine_runs["off"]["results"][scenario]
    assert "error" not in on, on.get("error")
    assert on["torch_compile"] == DUMMY
    settings = SCENARIOS[scenario]
    assert_fused_and_called(on, "checkpointed" if settings["gradient_checkpointing"] else "compiled", 4)
    assert_matches(on, off, settings["param_dtype"])
    assert on["hook_log"] == [BUILD_LINE + f"; torch.compile is {DUMMY}, compiled with torch's own", GRAPHS_LINE]


@pytest.mark.verl
@needs_verl
def test_verl_engine_logs_the_compile_once_per_model(engine_runs):
    lines = [line for line in engine_runs["on"]["log"].splitlines() if "before FSDP wrapping" in line]
    assert len(lines) == 3, lines  # the two that train, and the reference model (the refused one stops before)
    assert all(line.endswith(BUILD_LINE) for line in lines), lines
    graphs = [line for line in engine_runs["on"]["log"].splitlines() if "produced qwen_npu graphs" in line]
    assert len(graphs) == 2 and all(line.endswith(GRAPHS_LINE) for line in graphs), graphs  # the two that train
    assert not [line for line in engine_runs["off"]["log"].splitlines() if "qwen_npu" in line]


@pytest.mark.verl
@needs_verl
def test_verl_engine_with_fsdp1_flat_params_is_refused_at_build(engine_runs):
    error = engine_runs["on"]["results"]["fsdp1_flat_params"]["error"]
    assert error.startswith("ValueError: qwen_npu: QWEN_NPU_COMPILE=1 but verl's FSDPEngineWithLMHead wraps"), error
    assert "actor_rollout_ref.actor.fsdp_config.use_orig_params=True" in error


@pytest.mark.verl
@needs_verl
def test_verl_reference_model_build_is_compiled_before_fsdp(engine_runs):
    off, on = engine_runs["off"]["results"]["ref_forward_only"], engine_runs["on"]["results"]["ref_forward_only"]
    cpu_limit = "Cannot access accelerator device when none is available"
    assert cpu_limit in off["error"] and cpu_limit in on["error"]  # fully_shard's pin_memory, with or without us
    assert off["hook_log"] == []
    assert on["hook_log"] == [BUILD_LINE]  # it stops in fully_shard, before any forward


@pytest.mark.verl
@needs_verl
def test_verl_external_lib_key_switches_it_on_too(engine_runs):
    on = engine_runs["external_lib"]["results"]["fsdp2_fp32"]
    assert "error" not in on, on.get("error")
    assert on["hook_imported_by"] == "external_lib"
    assert_fused_and_called(on, "compiled", 4)
    assert_matches(on, engine_runs["off"]["results"]["fsdp2_fp32"], "fp32")


@pytest.mark.verl
@needs_verl
def test_the_real_verl_has_the_hooked_function():
    """The installed verl (0.9.1) has what the hook needs, and patch_engine accepts it (in a fresh process).

    The actor/reference (LM head) and critic (value head) engines resolve the hooked method. (The critic's
    build cannot run on a CPU: verl's load_valuehead_model asks for flash_attention_2.)
    """
    code = ("import qwen_npu_compile.verl as hook, verl.workers.engine.fsdp.transformer_impl as t, verl\n"
            "assert verl.__version__ == '0.9.1', verl.__version__\n"
            "assert hook.patch_engine(t) is True and hook.patch_engine(t) is False\n"
            "hooked = t.FSDPEngine.__dict__['_build_fsdp_module']\n"
            "assert t.FSDPEngineWithLMHead._build_fsdp_module is hooked  # actor, reference\n"
            "assert t.FSDPEngineWithValueHead._build_fsdp_module is hooked  # critic\n"
            "import verl.workers.engine.fsdp.fsdp_turbo_impl as turbo\n"
            "assert hasattr(turbo.FSDPTurboEngineWithLMHead._build_fsdp_module, '__wrapped__')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN_NPU", "VERL_USE_EXTERNAL"))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# --------------------------------------------------------------------------------------------------
# verl's default configuration: flash_attention_2, use_remove_padding (packed micro-batches), dynamic batch
# size, gradient checkpointing, FSDP2; Ulysses sp=2 on 2 gloo ranks

#: verl's defaults; flash_attention_2 runs transformers' own NPU flash-attention functions with the
#: simulated npu ops (tests.helpers.npu_host.simulated_npu_host, entered by the driver).
DEFAULT_PATH = {"strategy": "fsdp2", "attn_implementation": "flash_attention_2", "use_remove_padding": True,
                "use_dynamic_bsz": True, "gradient_checkpointing": True, "steps": 6}
DEFAULT_SCENARIOS = {
    "fa2_packed_fp32": {**DEFAULT_PATH, "param_dtype": "fp32"},
    "fa2_packed_bf16": {**DEFAULT_PATH, "param_dtype": "bf16", "steps": 3},
    "sdpa_packed_fp32": {**DEFAULT_PATH, "attn_implementation": "sdpa", "param_dtype": "fp32", "steps": 3},
}
ULYSSES_SCENARIOS = {
    "fa2_packed_sp2": {**DEFAULT_PATH, "param_dtype": "fp32", "ulysses": 2, "steps": 3},
    "sdpa_sp2": {**DEFAULT_PATH, "attn_implementation": "sdpa", "param_dtype": "fp32", "ulysses": 2, "steps": 2},
}


def run_scenarios(tmp_path: Path, name: str, env: dict, scenarios: dict) -> dict:
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps(scenarios))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("QWEN_NPU", "VERL_USE_EXTERNAL"))}
    proc = subprocess.run([sys.executable, str(ENGINE_RUN), str(spec), str(tmp_path / f"{name}.out.json")],
                          env={**base, **env}, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((tmp_path / f"{name}.out.json").read_text())


@pytest.fixture(scope="module")
def default_path_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl_default_path")
    env = {"VERL_USE_EXTERNAL_MODULES": "qwen_npu_compile.verl"}
    sp2 = {"VERL_ENGINE_RUN_WORLD_SIZE": "2"}
    return {
        "off": run_scenarios(tmp, "off", env, DEFAULT_SCENARIOS),
        "on": run_scenarios(tmp, "on", {**env, ENV_COMPILE: "1"}, DEFAULT_SCENARIOS),
        "sp2_off": run_scenarios(tmp, "sp2_off", {**env, **sp2}, {"fa2_packed_sp2": ULYSSES_SCENARIOS["fa2_packed_sp2"]}),
        "sp2_on": run_scenarios(tmp, "sp2_on", {**env, **sp2, ENV_COMPILE: "1"}, ULYSSES_SCENARIOS),
    }


@pytest.mark.verl
@needs_verl
@pytest.mark.parametrize("scenario", list(DEFAULT_SCENARIOS))
def test_verl_default_path_runs_varlen_in_one_graph_per_layer(default_path_runs, scenario):
    """verl's defaults with QWEN_NPU_COMPILE=1: every layer call site compiles at most 2 graphs over all the
    steps' packings (the first shape, then one dynamic graph), each fused 2/1/2/1 with the varlen attention,
    no layer ran eagerly, losses and gradients equal the unset run."""
    off, on = default_path_runs["off"][scenario], default_path_runs["on"][scenario]
    assert "error" not in off and "error" not in on, (off.get("error"), on.get("error"), on.get("traceback"))
    settings = DEFAULT_SCENARIOS[scenario]
    assert len({tuple(lens) for lens in on["micro_batch_lengths"]}) == settings["steps"]  # a new packing each step
    assert on["compiled_layers"] == ["model.layers.0", "model.layers.1"]
    for name, layer in on["layers"].items():
        assert 1 <= len(layer["fusions"]) <= 2, (name, layer["fusions"])
        assert all(fusions == PER_LAYER for fusions in layer["fusions"]), (name, layer["fusions"])
        assert all(variants.get("varlen_packed_offsets") == 1 for variants in layer["variants"]), layer["variants"]
        assert layer["calls"]["eager"] == 0 and layer["calls"]["checkpointed"] > settings["steps"], layer["calls"]
    assert on["graphs"] <= 2 * 2  # forward graphs of 2 call-site compiles (all layers share them), <= 2 shapes
    assert on["graphs_after_step"][-1] == on["graphs_after_step"][0], on["graphs_after_step"]  # no new graphs later
    assert_matches(on, off, settings["param_dtype"], steps=settings["steps"])


@pytest.mark.verl
@needs_verl
def test_verl_ulysses_sp2_matches_the_unset_run(default_path_runs):
    """Ulysses sp=2 on 2 gloo ranks: verl's all-to-all around attention keeps working (global offsets), the
    varlen attention runs between the all-to-alls outside the graph (substitutions/varlen_attention.py _ulysses_dispatch),
    and with Dynamo's nested graph breaks each layer splits exactly once around it: the graph before attention
    (rms_norm 1, rotary 2) and the graph after (rms_norm 1, swiglu 1), at most 2 of each per layer call site
    over all packings, none after the first step; parity with the unset run."""
    off, on = default_path_runs["sp2_off"]["fa2_packed_sp2"], default_path_runs["sp2_on"]["fa2_packed_sp2"]
    assert "error" not in off and "error" not in on, (off.get("error"), on.get("traceback"))
    assert on["compiled_layers"] == ["model.layers.0", "model.layers.1"]
    zero = {family: 0 for family in PER_LAYER}
    before, after = {**zero, "rms_norm": 1, "rotary": 2}, {**zero, "rms_norm": 1, "swiglu": 1}
    for name, layer in on["layers"].items():
        assert layer["calls"]["eager"] == 0, layer["calls"]
        assert before in layer["fusions"] and after in layer["fusions"], (name, layer["fusions"])
        assert all(fusions in (before, after) for fusions in layer["fusions"]), (name, layer["fusions"])
    # both halves x (first shape, dynamic) x (forward, checkpoint recomputation): <= 8 (measured: 7); 17 before
    assert on["graphs"] <= 8, on["graphs"]
    assert on["graphs_after_step"][-1] == on["graphs_after_step"][0], on["graphs_after_step"]
    assert_matches(on, off, "fp32", steps=ULYSSES_SCENARIOS["fa2_packed_sp2"]["steps"])


@pytest.mark.verl
@needs_verl
def test_verl_sdpa_with_ulysses_is_refused_at_build(default_path_runs):
    error = default_path_runs["sp2_on"]["sdpa_sp2"]["error"]
    assert error.startswith("ValueError: qwen_npu: QWEN_NPU_COMPILE=1 with ulysses_sequence_parallel_size=2 and "
                            "attn_implementation='sdpa'"), error
    assert "flash_attention_2" in error


@pytest.fixture(scope="module")
def torchair_default_path_run(tmp_path_factory):
    """verl's defaults in bf16 with QWEN_NPU_DOWNSTREAM=torchair: every layer graph goes through torchair's
    FX->GE conversion off-NPU (the torch_npu wheel's torchair, qwen_npu_compile.torchair.offline) and runs
    eagerly; skipped when no torch_npu wheel can be obtained."""
    from tests.helpers.torchair import torchair_wheel_sources

    torchair_wheel_sources()  # skips without the wheel
    tmp = tmp_path_factory.mktemp("verl_default_path_torchair")
    env = {"VERL_USE_EXTERNAL_MODULES": "qwen_npu_compile.verl", ENV_COMPILE: "1", "QWEN_NPU_DOWNSTREAM": "torchair"}
    sp2 = {**ULYSSES_SCENARIOS["fa2_packed_sp2"], "param_dtype": "bf16"}
    return {**run_scenarios(tmp, "torchair", env, {"fa2_packed_bf16": DEFAULT_SCENARIOS["fa2_packed_bf16"]}),
            **run_scenarios(tmp, "torchair_sp2", {**env, "VERL_ENGINE_RUN_WORLD_SIZE": "2"}, {"fa2_packed_sp2": sp2})}


@pytest.mark.verl
@needs_verl
def test_verl_default_path_graphs_convert_for_ge(torchair_default_path_run):
    """Every layer graph of verl's default path (flash_attention_2, packed, dynamic batch size, gradient
    checkpointing, FSDP2, bf16) converts for GE with 0 failures: forward RmsNorm 2, SwiGlu 1, RotaryMul 2
    (rotary_mul_aten_backward: cos/sin are layer inputs, T is dynamic) and TND FlashAttentionScore 1; the
    backward FlashAttentionScoreGrad 1 and no RotaryMulGrad (its converter refuses dynamic shapes)."""
    run = torchair_default_path_run["fa2_packed_bf16"]
    assert "error" not in run, (run.get("error"), run.get("traceback"))
    assert run["compiled_layers"] == ["model.layers.0", "model.layers.1"]
    fused_forward = {"RmsNorm": 2, "SwiGlu": 1, "RotaryMul": 2, "FlashAttentionScore": 1}
    for name, layer in run["layers"].items():
        assert layer["calls"]["eager"] == 0, layer["calls"]
        assert all(fusions == PER_LAYER for fusions in layer["fusions"]), (name, layer["fusions"])
        assert set(layer["downstream"]) == {"torchair"}, layer["downstream"]
        for ge in layer["ge"]:
            assert ge["failures"] == [], (name, ge["failures"])
            forward = [g["ops"] for g in ge["graphs"] if g["kind"] == "forward"]
            backward = [g["ops"] for g in ge["graphs"] if g["kind"] == "backward"]
            assert forward and all(ops == fused_forward for ops in forward), (name, ge["graphs"])
            assert all(ops.get("FlashAttentionScoreGrad") == 1 and "RotaryMulGrad" not in ops for ops in backward)
    assert run["graphs_after_step"][-1] == run["graphs_after_step"][0], run["graphs_after_step"]


@pytest.mark.verl
@needs_verl
def test_verl_ulysses_sp2_graphs_convert_for_ge(torchair_default_path_run):
    """Ulysses sp=2 (2 gloo ranks, bf16): both halves of every layer (before attention: RmsNorm 1, RotaryMul 2;
    after: RmsNorm 1, SwiGlu 1) convert for GE with 0 failures; attention runs between them in verl's wrapper."""
    run = torchair_default_path_run["fa2_packed_sp2"]
    assert "error" not in run, (run.get("error"), run.get("traceback"))
    halves = [{"RmsNorm": 1, "RotaryMul": 2}, {"RmsNorm": 1, "SwiGlu": 1}]
    for name, layer in run["layers"].items():
        assert layer["calls"]["eager"] == 0 and set(layer["downstream"]) == {"torchair"}, layer
        for ge in layer["ge"]:
            assert ge["failures"] == [], (name, ge["failures"])
            forward = [g["ops"] for g in ge["graphs"] if g["kind"] == "forward"]
            assert forward and all(ops in halves for ops in forward), (name, ge["graphs"])
            assert all("RotaryMulGrad" not in g["ops"] for g in ge["graphs"])
