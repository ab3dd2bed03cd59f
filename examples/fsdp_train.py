#!/usr/bin/env python
"""Multi-process FSDP training of a small Qwen2 with ``QWEN_NPU_COMPILE`` off and/or on (CPU, gloo).

What a verl FSDP worker does, in miniature: every rank builds the Hugging Face model, calls
``qwen_npu_compile.maybe_compile(model)`` (a no-op unless ``QWEN_NPU_COMPILE=1`` reached the
process), wraps it with FSDP2 (``fully_shard`` per decoder layer, then the root, as verl's
``apply_fsdp2``) or FSDP1, and trains a few AdamW steps. The launcher sets the variable in its own
environment; the spawned ranks inherit it, as Ray workers inherit ``runtime_env`` ``env_vars``.

    python examples/fsdp_train.py --ranks 2 --steps 5 --layers 2 --compile both --out losses.json

``--compile both`` runs off, then on (each in fresh processes), compares the per-rank losses
(``--atol``), checks that the state-dict keys equal the uncompiled model's and that every decoder
layer ran a ``qwen_npu`` graph, prints a verdict and exits 0 (PASS) or 1 (FAIL). The JSON written to
``--out`` holds the losses, per-layer fusions and timings of every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

ENV_COMPILE = "QWEN_NPU_COMPILE"  # qwen_npu_compile.worker.ENV_COMPILE (kept import-free for the launcher)


# --------------------------------------------------------------------------------------------------
# one rank


def tiny_config(layers: int):
    """A Qwen2 small enough for CPU: hidden 64, 4 heads (2 KV heads), vocab 128, fp32."""
    from qwen_npu_compile.cli.check.models import tiny_qwen2_config

    return tiny_qwen2_config(num_hidden_layers=layers, tie_word_embeddings=False, use_cache=True)


def _layer_classes(model) -> set:
    """The decoder layer classes named in ``model._no_split_modules`` (what verl's wrap policies use)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def _wrap(model, spec: dict):
    """Wrap ``model`` with FSDP as verl's fsdp_workers.py does; return the module to train."""
    import torch

    if spec["strategy"] == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        classes = tuple(_layer_classes(model))
        for module in [m for m in model.modules() if isinstance(m, classes)]:
            fully_shard(module)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(_layer_classes(model)),
        use_orig_params=spec["use_orig_params"],
        device_id=torch.device("cpu"),
    )


def _layer_summary(compiled) -> dict:
    from qwen_npu_compile.worker import layer_reports

    return {
        name: {
            "class": record.class_name,
            "calls": dict(record.calls),
            "graphs": [
                {"name": r.name, "fusions": dict(r.fusions), "already_fused": dict(r.already_fused),
                 "refused": len(r.refused)}
                for r in record.reports
            ],
        }
        for name, record in layer_reports(compiled).items()
    }


def train(spec: dict, rank: int) -> dict:
    """Build, (maybe) compile, wrap and train one model on this rank; return what happened.

    Args:
        spec: ``layers, steps, batch_size, seq_len, lr, seed, strategy ("fsdp2"|"fsdp1"),
            use_orig_params, compile_when ("before"|"after" wrapping), gradient_checkpointing``.
        rank: this process's rank (selects its data).

    Returns:
        ``losses`` (one per step), ``state_dict_keys_equal`` (vs. the unwrapped, uncompiled model),
        ``compiled_layers``, ``layers`` (per-layer graphs and fusions), ``layer_classes``, ``seconds``.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    import qwen_npu_compile

    torch.manual_seed(spec["seed"])  # the same initial weights on every rank
    model = Qwen2ForCausalLM(tiny_config(spec["layers"]))
    reference_keys = list(model.state_dict())
    if spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    compiled = []
    if spec["compile_when"] == "before":
        compiled = qwen_npu_compile.maybe_compile(model)  # reads QWEN_NPU_COMPILE
    wrapped = _wrap(model, spec)
    if spec["compile_when"] == "after":
        compiled = qwen_npu_compile.maybe_compile(wrapped)

    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=spec["lr"])
    data = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    losses = []
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        tokens = torch.randint(0, model.config.vocab_size, (spec["batch_size"], spec["seq_len"]), generator=data)
        loss = wrapped(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - start

    keys = list(wrapped.state_dict())
    return {
        "losses": losses,
        "state_dict_keys_equal": keys == reference_keys,
        "state_dict_keys": len(keys),
        "compiled_layers": list(compiled),
        "layers": _layer_summary(model),
        "layer_classes": sorted({type(m).__name__ for m in model.modules() if "DecoderLayer" in type(m).__name__}),
        "seconds": seconds,
    }


def rank_main(rank: int, world_size: int, specs: list[dict], result_dir: str) -> None:
    """Entry point of one spawned rank: run every spec in turn, write ``rank<r>.json``.

    A spec may set ``env`` (e.g. ``{"QWEN_NPU_COMPILE": "1"}``) to change this process's environment
    before it runs; an exception is recorded (type, message) instead of the results of that spec.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = []
    try:
        for spec in specs:
            os.environ.update(spec.get("env", {}))
            try:
                results.append({"spec": spec, **train(spec, rank)})
            except Exception as exc:  # recorded for the launcher; the ranks fail alike
                results.append({"spec": spec, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()})
            dist.barrier()
    finally:
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# the launcher


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(specs: list[dict], ranks: int, compile_env: str | None) -> list[list[dict]]:
    """Spawn ``ranks`` processes (gloo on 127.0.0.1) that run ``specs``; return their results.

    Args:
        specs: what each rank trains, in order (see :func:`train`).
        ranks: the world size.
        compile_env: the value of ``QWEN_NPU_COMPILE`` the ranks inherit (None: unset).

    Returns:
        ``results[rank][spec index]``.
    """
    import torch.multiprocessing as mp

    names = (ENV_COMPILE, "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    if compile_env is None:
        os.environ.pop(ENV_COMPILE, None)
    else:
        os.environ[ENV_COMPILE] = compile_env  # what the spawned ranks inherit
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        with tempfile.TemporaryDirectory(prefix="fsdp_train_") as result_dir:
            mp.spawn(rank_main, args=(ranks, specs, result_dir), nprocs=ranks, join=True)
            return [json.loads(Path(result_dir, f"rank{r}.json").read_text()) for r in range(ranks)]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_run(results: list[dict], compiled: bool, layers: int) -> list[str]:
    """Problems with one run (all ranks): errors, changed state-dict keys, layers without fusions."""
    problems = []
    for rank, result in enumerate(results):
        if "error" in result:
            problems.append(f"rank {rank}: {result['error']}")
            continue
        if not result["state_dict_keys_equal"]:
            problems.append(f"rank {rank}: state-dict keys differ from the uncompiled model's")
        if not compiled:
            if result["compiled_layers"]:
                problems.append(f"rank {rank}: layers were compiled with {ENV_COMPILE} off")
            continue
        if len(result["compiled_layers"]) != layers:
            problems.append(f"rank {rank}: {len(result['compiled_layers'])} of {layers} decoder layers compiled")
        for name, layer in result["layers"].items():
            if not layer["graphs"]:
                problems.append(f"rank {rank}: {name} ran no qwen_npu graph")
            elif not any(any(graph["fusions"].values()) for graph in layer["graphs"]):
                problems.append(f"rank {rank}: {name} fused nothing")
    return problems


def compare(off: list[dict], on: list[dict], atol: float, layers: int) -> dict:
    """Compare an off run and an on run (per rank); return the verdict as a dict."""
    problems = check_run(off, False, layers) + check_run(on, True, layers)
    max_diff = 0.0
    for rank, (a, b) in enumerate(zip(off, on)):
        if "losses" in a and "losses" in b:
            diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
            max_diff = max(max_diff, diff)
            if diff > atol:
                problems.append(f"rank {rank}: losses differ by {diff:.3g} > atol {atol:g}")
    fusions = {}
    for result in on:
        for layer in result.get("layers", {}).values():
            for graph in layer["graphs"]:
                fusions = {k: v for k, v in graph["fusions"].items() if v} or fusions
    return {"passed": not problems, "max_loss_diff": max_diff, "atol": atol, "problems": problems,
            "fusions_per_layer": fusions}


def verdict_text(verdict: dict, ranks: int, steps: int, layers: int) -> str:
    if not verdict["passed"]:
        return "FAIL: " + "; ".join(verdict["problems"])
    fused = ", ".join(f"{k} {v}" for k, v in verdict["fusions_per_layer"].items()) or "nothing"
    return (
        f"PASS: {ENV_COMPILE}=1 matches the uncompiled run: max |loss difference| "
        f"{verdict['max_loss_diff']:.2e} over {ranks} ranks x {steps} steps (atol {verdict['atol']:g}); "
        f"every decoder layer ({layers} per rank) ran a qwen_npu graph fusing {fused}; state-dict keys unchanged"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from qwen_npu_compile.cli import positive_int

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=positive_int, default=2, help="world size (processes); default 2")
    parser.add_argument("--steps", type=positive_int, default=5, help="optimizer steps; default 5")
    parser.add_argument("--layers", type=positive_int, default=2, help="decoder layers; default 2")
    parser.add_argument("--compile", choices=("on", "off", "both"), default="both",
                        help=f"{ENV_COMPILE} for the ranks; 'both' runs off then on and compares (default)")
    parser.add_argument("--strategy", choices=("fsdp2", "fsdp1"), default="fsdp2", help="default fsdp2")
    parser.add_argument("--use-orig-params", action=argparse.BooleanOptionalAction, default=True,
                        help="FSDP1 use_orig_params (default true; false is refused when compiling)")
    parser.add_argument("--compile-when", choices=("before", "after"), default="before",
                        help="call maybe_compile before (default, as in verl) or after FSDP wrapping")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="enable activation checkpointing")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atol", type=float, default=1e-5, help="loss tolerance for 'both'; default 1e-5")
    parser.add_argument("--out", type=Path, default=Path("fsdp_train_losses.json"), help="JSON results file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = {
        "layers": args.layers, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "lr": args.lr, "seed": args.seed, "strategy": args.strategy, "use_orig_params": args.use_orig_params,
        "compile_when": args.compile_when, "gradient_checkpointing": args.gradient_checkpointing,
    }
    modes = ["off", "on"] if args.compile == "both" else [args.compile]
    runs = {}
    for mode in modes:
        start = time.perf_counter()
        results = [rank_results[0] for rank_results in launch([spec], args.ranks, "1" if mode == "on" else "0")]
        runs[mode] = {"ranks": results, "wall_seconds": time.perf_counter() - start}
        for rank, result in enumerate(results):
            if "error" in result:
                print(f"[{ENV_COMPILE}={mode}] rank {rank}: {result['error']}", file=sys.stderr)
            else:
                print(f"[{ENV_COMPILE}={mode}] rank {rank}: losses {[round(x, 6) for x in result['losses']]}")
    output = {"spec": spec, "ranks": args.ranks, "runs": runs}
    if args.compile == "both":
        verdict = compare(runs["off"]["ranks"], runs["on"]["ranks"], args.atol, args.layers)
        output["verdict"] = verdict
        text = verdict_text(verdict, args.ranks, args.steps, args.layers)
        passed = verdict["passed"]
    else:
        problems = check_run(runs[modes[0]]["ranks"], modes[0] == "on", args.layers)
        passed = not problems
        text = ("OK: " if passed else "FAIL: ") + ("; ".join(problems) or f"{ENV_COMPILE}={modes[0]} run finished")
    output["passed"] = passed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(output, indent=1))
    print(text)
    print(f"results written to {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
