#!/usr/bin/env python
"""Load a model folder with ``from_pretrained``, compile it with ``qwen_npu`` and train it one step.

What a training script does with a checkpoint on disk (e.g. one fetched with
``hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir Qwen2.5-0.5B-Instruct``):

    python examples/from_pretrained_train.py --model-dir Qwen2.5-0.5B-Instruct --seq-len 32

Without ``--model-dir`` a tiny random-weight Qwen2 (``qwen_npu_compile.cli.check.models.tiny_qwen2``) is written with
``save_pretrained`` to a temporary folder first, so the example runs anywhere in seconds. Then:
``AutoModelForCausalLM.from_pretrained(folder)``, ``torch.compile(model, backend="qwen_npu")``, one AdamW step on
random tokens (labels = inputs), and the fusions per family of the compiled training graph are printed (a Qwen2 of L layers: rms_norm 2L + 1,
swiglu L, rotary 2L, attention L). Without an
NPU the npu ops are the simulated CPU stand-ins (``qwen_npu_compile.ensure_npu_ops``). Exit status 0 when the
step ran, the loss is finite and the weights changed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a local Hugging Face model folder (config.json + weights); default: a tiny random Qwen2")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    return parser.parse_args(argv)


def save_tiny_model(folder: Path) -> Path:
    """Write a tiny random-weight Qwen2 (2 layers, hidden 64) to ``folder`` with ``save_pretrained``."""
    from qwen_npu_compile.cli.check.models import tiny_qwen2

    tiny_qwen2(num_hidden_layers=2).save_pretrained(folder)
    return folder


def train_one_step(folder: Path, seq_len: int, batch: int, lr: float) -> dict:
    """``from_pretrained(folder)``, compile with ``qwen_npu``, one AdamW step. Returns the losses, whether the
    weights changed, and the fusions per family summed over the compiled graphs."""
    import torch
    from transformers import AutoModelForCausalLM

    import qwen_npu_compile

    status = qwen_npu_compile.ensure_npu_ops()  # torch_npu's ops on an NPU, simulated CPU stand-ins elsewhere
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    compiled = torch.compile(model, backend="qwen_npu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in model.parameters()]

    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():  # eager: a no-grad call of the compiled model would compile a second graph
        loss_after = model(input_ids=ids, labels=ids).loss

    fusions: dict[str, int] = {}
    for report in qwen_npu_compile.get_reports():
        for family, count in report.fusions.items():
            fusions[family] = fusions.get(family, 0) + count
    return {
        "npu_ops": "simulated" if status.simulated else "torch_npu",
        "model_type": model.config.model_type,
        "layers": model.config.num_hidden_layers,
        "loss": loss.item(),
        "loss_after_step": loss_after.item(),
        "weights_changed": any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters())),
        "fusions": fusions,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_dir if args.model_dir is not None else save_tiny_model(Path(tmp) / "tiny-qwen2")
        print(f"from_pretrained({str(folder)!r})")
        result = train_one_step(folder, args.seq_len, args.batch, args.lr)
    print(f"{result['model_type']}, {result['layers']} layers, npu ops {result['npu_ops']}")
    print(f"loss {result['loss']:.4f} -> {result['loss_after_step']:.4f} after one AdamW step")
    print("fusions: " + ", ".join(f"{family} {count}" for family, count in result["fusions"].items()))
    ok = result["weights_changed"] and result["loss"] == result["loss"] and result["loss_after_step"] < float("inf")
    print("OK" if ok else "FAILED: the step did not change the weights or the loss is not finite")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
