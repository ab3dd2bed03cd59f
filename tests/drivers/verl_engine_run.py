"""Drive verl's own FSDP engine on a CPU: model build, FSDP wrap, two training steps (gloo, world size 1).

Run by tests/integrations/test_verl_hook.py in a fresh interpreter, because ``VERL_USE_EXTERNAL_MODULES`` is read
when verl is imported::

    python tests/drivers/verl_engine_run.py SCENARIOS.json OUT.json

``SCENARIOS.json`` maps a name to ``strategy`` (``fsdp2``/``fsdp``), ``use_orig_params``,
``param_dtype`` (``fp32``/``bf16``: FSDP mixed precision, and verl's autocast dtype),
``gradient_checkpointing`` and ``forward_only`` (a reference model's engine); ``strategy`` ``fsdp_turbo`` builds
verl's ``FSDPTurboEngineWithLMHead`` instead, with the scenario's ``turbo_config`` (the stand-in
tests/stand_ins/fsdp_turbo on ``PYTHONPATH``; its module patches are undone after the scenario). Each scenario
builds a ``FSDPEngineWithLMHead`` from a tiny Qwen2 saved
with ``save_pretrained`` (``FSDPEngine.initialize``: ``_build_module``, ``_build_fsdp_module``,
optimizer, checkpoint manager), then trains two steps on a fixed batch of 4 sequences of different
lengths with verl's ``sft_loss``: the first runs the three calls of ``BaseEngine.train_batch``
(``optimizer_zero_grad``, ``forward_backward_batch``, ``optimizer_step``) so that the gradients can be
read before the optimizer step, the second is ``train_batch`` itself. ``OUT.json`` gets, per scenario,
the losses, gradients, state-dict keys and per-layer ``qwen_npu`` graphs (fusions, variants, what ran
them; with ``QWEN_NPU_DOWNSTREAM=torchair``, off-NPU, their GE graphs' fused ops and conversion failures),
or the error raised, and the hook's log lines.

Set ``VERL_ENGINE_RUN_EXTERNAL_LIB=1`` to name ``qwen_npu_compile.verl`` in the model config's
``external_lib`` (verl's other route) instead of ``VERL_USE_EXTERNAL_MODULES``. Set
``VERL_ENGINE_RUN_MINDSPEED=before`` (or ``after``) to import ``mindspeed.megatron_adaptor`` (the stand-in of
tests/helpers/mindspeed_stand_in.py, on ``PYTHONPATH``) before ``import verl`` (so before our hook) or right after
it, as verl's engine package does where MindSpeed is installed: ``torch.compile`` is MindSpeed's
``dummy_compile`` for the whole run (``OUT.json``: ``torch_compile``).

verl picks its device through its platform registry (``verl.plugin.platform``); a CPU has none, so
this script sets a CPU platform with ``set_platform`` before verl's engine module is imported (it
reads the device name at import). Nothing of verl is modified.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import tempfile
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

EXTERNAL_LIB = os.environ.pop("VERL_ENGINE_RUN_EXTERNAL_LIB", "") == "1"
MINDSPEED = os.environ.pop("VERL_ENGINE_RUN_MINDSPEED", "")

if MINDSPEED == "before":
    import mindspeed.megatron_adaptor  # noqa: E402,F401  (replaces torch.compile with dummy_compile)
import verl  # noqa: E402  (imports VERL_USE_EXTERNAL_MODULES)

if MINDSPEED == "after":
    import mindspeed.megatron_adaptor  # noqa: E402,F401
from verl.plugin.platform import set_platform  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402

HOOK_IMPORTED_BY_VERL = "qwen_npu_compile.verl" in sys.modules
#: GE op types of the fused kernels, reported per GE graph when the downstream is torchair (off-NPU).
GE_FUSED_OPS = ("RmsNorm", "RmsNormGrad", "SwiGlu", "SwiGluGrad", "RotaryMul", "RotaryMulGrad",
                "FlashAttentionScore", "FlashAttentionScoreGrad")


class CPUPlatform(PlatformBase):
    """verl's platform interface for a CPU with gloo (verl ships CUDA, ROCm and NPU platforms)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = torch.cpu

    def is_available(self):
        return True

    def current_device(self):
        return torch.device("cpu")  # FSDP1's device_id, FSDP2's mesh device

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return nullcontext()

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


LENGTHS = (12, 16, 9, 16)  # padded to 16 per micro-batch: the attention graph has a padding mask
#: verl's dynamic batch size (``use_dynamic_bsz``): per step 8 sequences of varying lengths, cut into
#: micro-batches by a token budget, so T and the number of packed sequences change every micro-batch.
DYNAMIC_TOKENS = 64


def save_tiny_qwen2(folder: str) -> None:
    from transformers import Qwen2ForCausalLM

    from qwen_npu_compile.cli.check.models import tiny_qwen2_config

    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_qwen2_config(tie_word_embeddings=False, use_cache=True)).save_pretrained(folder)


def lengths(step: int, settings: dict) -> list[int]:
    if not settings.get("use_dynamic_bsz"):
        return list(LENGTHS)
    generator = torch.Generator().manual_seed(1000 + step)
    return [int(n) for n in torch.randint(3, 30, (8,), generator=generator)]


def batch(step: int, settings: dict | None = None):
    """The step's sequences as verl's trainer hands them to the engine (nested, no padding) + its meta info."""
    from verl.utils import tensordict_utils as tu

    settings = settings or {}
    lens = lengths(step, settings)
    generator = torch.Generator().manual_seed(100 + step)
    ids = [torch.randint(0, 128, (n,), generator=generator) for n in lens]
    nested = functools.partial(torch.nested.as_nested_tensor, layout=torch.jagged)
    non_tensor = {"use_remove_padding": settings.get("use_remove_padding", False),
                  "use_dynamic_bsz": settings.get("use_dynamic_bsz", False), "micro_batch_size_per_gpu": 2,
                  "temperature": 1.0, "global_batch_size": len(lens), "pad_mode": "no_padding", "pad_token_id": 0,
                  "sp_size": settings.get("ulysses", 1)}
    if settings.get("use_dynamic_bsz"):
        non_tensor["max_token_len_per_gpu"] = DYNAMIC_TOKENS
    return tu.get_tensordict(
        tensor_dict={
            "input_ids": nested(ids),
            "position_ids": nested([torch.arange(n) for n in lens]),
            "loss_mask": nested([torch.ones(n, dtype=torch.long) for n in lens]),
        },
        non_tensor_dict=non_tensor,
    )


def full(tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float()


class HookLog(logging.Handler):
    """The hook's lines of the running scenario: "... before FSDP wrapping" (the build) and "... produced
    qwen_npu graphs" (the first forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(key in message for key in ("before FSDP wrapping", "produced qwen_npu graphs", "FSDP-Turbo")):
            self.lines.append(record.getMessage())


def run(settings: dict, model_dir: str) -> dict:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import sft_loss

    from qwen_npu_compile.layers import clean_name
    from qwen_npu_compile.report import SUMMARY
    from qwen_npu_compile.worker import layer_reports

    torch._dynamo.reset()
    SUMMARY.clear()
    attn = settings.get("attn_implementation", "sdpa")
    model_config = HFModelConfig(
        path=model_dir, load_tokenizer=False,
        # flash_attention_2 is verl's default; off-NPU it runs transformers' own NPU flash-attention functions
        # with the simulated npu ops (simulated_npu_host, entered by the caller)
        override_config={"attn_implementation": attn},
        use_remove_padding=settings.get("use_remove_padding", False),
        enable_gradient_checkpointing=settings["gradient_checkpointing"],
        external_lib="qwen_npu_compile.verl" if EXTERNAL_LIB else None,
    )
    engine_config = FSDPEngineConfig(strategy=settings["strategy"],
                                     use_orig_params=settings.get("use_orig_params", False),
                                     mixed_precision={"param_dtype": settings["param_dtype"]},
                                     forward_only=settings.get("forward_only", False),
                                     ulysses_sequence_parallel_size=settings.get("ulysses", 1),
                                     turbo_config=settings.get("turbo_config", {}))
    engine_class = FSDPEngineWithLMHead
    if settings["strategy"] == "fsdp_turbo":
        from verl.workers.engine.fsdp.fsdp_turbo_impl import FSDPTurboEngineWithLMHead as engine_class
    engine = engine_class(model_config, engine_config, FSDPOptimizerConfig(lr=1e-3, total_training_steps=2),
                                  CheckpointConfig())
    engine.initialize()  # a reference model (forward_only) stops here on a CPU: FSDP2 pins its CPU-offloaded shards
    loss_function = functools.partial(sft_loss, None)  # sft_loss(config, model_output, data, dp_group)
    losses = []
    graphs_after = []
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(batch(0, settings), loss_function, forward_only=False)
        grads = {clean_name(name): full(p.grad).flatten().tolist()
                 for name, p in engine.module.named_parameters() if p.grad is not None}
        engine.optimizer_step()
        losses.append(sum(out["loss"]))
        for step in range(1, settings.get("steps", 2)):
            out = engine.train_batch(batch(step, settings), loss_function)
            losses.append(sum(out["loss"]))
            graphs_after.append(len(SUMMARY.graphs))
    layers = {
        name: {"class": record.class_name, "calls": dict(record.calls),
               "fusions": [dict(report.fusions) for report in record.reports],
               "already_fused": [{k: n for k, n in report.already_fused.items() if n} for report in record.reports],
               "variants": [dict(report.variants) for report in record.reports],
               # what ran each graph, and (torchair off-NPU) its GE graphs and nodes that failed to convert
               "downstream": [report.downstream for report in record.reports],
               "ge": [None if report.ge is None else {
                   "graphs": [{"kind": g.kind, "ops": {op: n for op, n in g.ops.items() if op in GE_FUSED_OPS}}
                              for g in report.ge.graphs],
                   "failures": [f"{f.op}: {f.error}" for f in report.ge.failures]}
                   for report in record.reports]}
        for name, record in layer_reports(engine.module).items()
    }
    return {
        "verl_version": verl.__version__,
        "engine": type(engine).__name__,
        "torch_compile": f"{torch.compile.__module__}.{torch.compile.__qualname__}",
        "hook_imported_by": "VERL_USE_EXTERNAL_MODULES" if HOOK_IMPORTED_BY_VERL else
                            ("external_lib" if "qwen_npu_compile.verl" in sys.modules else None),
        "losses": losses,
        "grads": grads,
        "state_dict_keys": [clean_name(key) for key in engine.module.state_dict()],
        "compiled_layers": sorted(layers),
        "layers": layers,
        "graphs": len(SUMMARY.graphs),  # qwen_npu graphs compiled in this scenario (all layers share them)
        "graphs_after_step": graphs_after,
        "micro_batch_lengths": [lengths(step, settings) for step in range(settings.get("steps", 2))],
    }


def _rank(rank: int, world_size: int, spec_path: str, out_path: str, model_dir: str) -> None:
    """One gloo rank: every scenario in order (the ranks of a scenario with Ulysses sp=2 form its group);
    rank 0 writes ``out_path``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.helpers
    from tests.helpers.npu_host import simulated_npu_host

    set_platform(CPUPlatform())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    scenarios = json.loads(open(spec_path).read())
    results = {}
    hook_log = HookLog()
    logging.getLogger("qwen_npu_compile").addHandler(hook_log)
    for name, settings in scenarios.items():
        hook_log.lines = []
        host = simulated_npu_host() if settings.get("attn_implementation", "").startswith("flash") else nullcontext()
        try:
            with host:
                results[name] = run(settings, model_dir)
        except Exception as exc:  # recorded for the test (the FSDP1 refusal is expected)
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        results[name]["hook_log"] = hook_log.lines
        if "fsdp_turbo.fsdp_turbo" in sys.modules:  # the stand-in's patches are process-wide: the next scenario
            sys.modules["fsdp_turbo.fsdp_turbo"].undo_module_patches()  # starts from transformers' own forwards
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main(spec_path: str, out_path: str) -> int:
    """``VERL_ENGINE_RUN_WORLD_SIZE`` (default 1) gloo ranks, spawned when more than one."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    world_size = int(os.environ.get("VERL_ENGINE_RUN_WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory(prefix="verl_tiny_qwen2_") as model_dir:
        save_tiny_qwen2(model_dir)
        if world_size == 1:
            _rank(0, 1, spec_path, out_path, model_dir)
        else:
            import torch.multiprocessing as mp

            mp.spawn(_rank, args=(world_size, spec_path, out_path, model_dir), nprocs=world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
