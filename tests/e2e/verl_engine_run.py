"""Drive verl's own FSDP engine on a CPU: model build, FSDP wrap, two training steps (gloo, world size 1).

Run by tests/e2e/test_verl_hook.py in a fresh interpreter, because ``VERL_USE_EXTERNAL_MODULES`` is read
when verl is imported::

    python tests/e2e/verl_engine_run.py SCENARIOS.json OUT.json

``SCENARIOS.json`` maps a name to ``strategy`` (``fsdp2``/``fsdp``), ``use_orig_params``,
``param_dtype`` (``fp32``/``bf16``: FSDP mixed precision, and verl's autocast dtype),
``gradient_checkpointing`` and ``forward_only`` (a reference model's engine). Each scenario builds a ``FSDPEngineWithLMHead`` from a tiny Qwen2 saved
with ``save_pretrained`` (``FSDPEngine.initialize``: ``_build_module``, ``_build_fsdp_module``,
optimizer, checkpoint manager), then trains two steps on a fixed batch of 4 sequences of different
lengths with verl's ``sft_loss``: the first runs the three calls of ``BaseEngine.train_batch``
(``optimizer_zero_grad``, ``forward_backward_batch``, ``optimizer_step``) so that the gradients can be
read before the optimizer step, the second is ``train_batch`` itself. ``OUT.json`` gets, per scenario,
the losses, gradients, state-dict keys and per-layer ``qwen_npu`` graphs, or the error raised, and
the hook's log lines.

Set ``VERL_ENGINE_RUN_EXTERNAL_LIB=1`` to name ``qwen_npu_compile.verl`` in the model config's
``external_lib`` (verl's other route) instead of ``VERL_USE_EXTERNAL_MODULES``.

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

import torch
import torch.distributed as dist

EXTERNAL_LIB = os.environ.pop("VERL_ENGINE_RUN_EXTERNAL_LIB", "") == "1"

import verl  # noqa: E402  (imports VERL_USE_EXTERNAL_MODULES)
from verl.plugin.platform import set_platform  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402

HOOK_IMPORTED_BY_VERL = "qwen_npu_compile.verl" in sys.modules


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


def save_tiny_qwen2(folder: str) -> None:
    from transformers import Qwen2ForCausalLM

    from qwen_npu_compile.check.models import tiny_qwen2_config

    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_qwen2_config(tie_word_embeddings=False, use_cache=True)).save_pretrained(folder)


def batch(step: int):
    """4 sequences as verl's SFT trainer hands them to the engine (nested, no padding) + its meta info."""
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(100 + step)
    ids = [torch.randint(0, 128, (n,), generator=generator) for n in LENGTHS]
    nested = functools.partial(torch.nested.as_nested_tensor, layout=torch.jagged)
    return tu.get_tensordict(
        tensor_dict={
            "input_ids": nested(ids),
            "position_ids": nested([torch.arange(n) for n in LENGTHS]),
            "loss_mask": nested([torch.ones(n, dtype=torch.long) for n in LENGTHS]),
        },
        non_tensor_dict={"use_remove_padding": False, "use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2,
                         "temperature": 1.0, "global_batch_size": len(LENGTHS), "pad_mode": "no_padding",
                         "pad_token_id": 0},
    )


def full(tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float()


class HookLog(logging.Handler):
    """The hook's "compiled ... before FSDP wrapping" lines of the running scenario."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "before FSDP wrapping" in record.getMessage():
            self.lines.append(record.getMessage())


def run(settings: dict, model_dir: str) -> dict:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import sft_loss

    from qwen_npu_compile.report import SUMMARY
    from qwen_npu_compile.worker import clean_name, layer_reports

    torch._dynamo.reset()
    SUMMARY.clear()
    model_config = HFModelConfig(
        path=model_dir, load_tokenizer=False,
        override_config={"attn_implementation": "sdpa"},  # verl's default flash_attention_2 needs a GPU
        use_remove_padding=False,  # packed sequences need flash-attention varlen
        enable_gradient_checkpointing=settings["gradient_checkpointing"],
        external_lib="qwen_npu_compile.verl" if EXTERNAL_LIB else None,
    )
    engine_config = FSDPEngineConfig(strategy=settings["strategy"],
                                     use_orig_params=settings.get("use_orig_params", False),
                                     mixed_precision={"param_dtype": settings["param_dtype"]},
                                     forward_only=settings.get("forward_only", False))
    engine = FSDPEngineWithLMHead(model_config, engine_config, FSDPOptimizerConfig(lr=1e-3, total_training_steps=2),
                                  CheckpointConfig())
    engine.initialize()  # a reference model (forward_only) stops here on a CPU: FSDP2 pins its CPU-offloaded shards
    loss_function = functools.partial(sft_loss, None)  # sft_loss(config, model_output, data, dp_group)
    losses = []
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(batch(0), loss_function, forward_only=False)
        grads = {clean_name(name): full(p.grad).flatten().tolist()
                 for name, p in engine.module.named_parameters() if p.grad is not None}
        engine.optimizer_step()
        losses.append(sum(out["loss"]))
        out = engine.train_batch(batch(1), loss_function)
        losses.append(sum(out["loss"]))
    layers = {
        name: {"class": record.class_name, "calls": dict(record.calls),
               "fusions": [dict(report.fusions) for report in record.reports]}
        for name, record in layer_reports(engine.module).items()
    }
    return {
        "verl_version": verl.__version__,
        "hook_imported_by": "VERL_USE_EXTERNAL_MODULES" if HOOK_IMPORTED_BY_VERL else
                            ("external_lib" if "qwen_npu_compile.verl" in sys.modules else None),
        "losses": losses,
        "grads": grads,
        "state_dict_keys": [clean_name(key) for key in engine.module.state_dict()],
        "compiled_layers": sorted(layers),
        "layers": layers,
    }


def main(spec_path: str, out_path: str) -> int:
    set_platform(CPUPlatform())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    scenarios = json.loads(open(spec_path).read())
    results = {}
    with tempfile.TemporaryDirectory(prefix="verl_tiny_qwen2_") as model_dir:
        save_tiny_qwen2(model_dir)
        hook_log = HookLog()
        logging.getLogger("qwen_npu_compile").addHandler(hook_log)
        for name, settings in scenarios.items():
            hook_log.lines = []
            try:
                results[name] = run(settings, model_dir)
            except Exception as exc:  # recorded for the test (the FSDP1 refusal is expected)
                results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            results[name]["hook_log"] = hook_log.lines
    with open(out_path, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
