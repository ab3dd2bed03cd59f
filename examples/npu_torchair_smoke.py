"""For Ascend owners: confirm the last unverified step, GE compile and the kernels, on an NPU.

Builds 2 Qwen2 decoder layers (Qwen2.5-0.5B widths by default, random weights), compiles one copy with
``torch.compile(backend="qwen_npu", options={"downstream": "torchair"})`` and trains it for 3 steps
(AdamW) beside an identical eager copy on the same tokens, then compares the losses step by step and
prints a verdict::

    python examples/npu_torchair_smoke.py                      # on an Ascend host: torch_npu + CANN + an NPU
    python examples/npu_torchair_smoke.py --layers 2 --steps 3 --dtype bf16 --seq-len 256

On an Ascend host this runs torchair's GE compile and the real fused kernels (the verdict says
``on npu``). Anywhere else it is a dry run: the npu ops are this project's CPU stand-ins and torchair
runs off-NPU from the torch_npu wheel (FX→GE conversion only, ``debug.run_eagerly``); the verdict then
says ``DRY RUN`` and lists the GE conversion results instead.

Exit status: 0 PASS, 1 FAIL (a loss differs by more than the tolerance, the compiled run failed, or a
node failed GE conversion), 2 bad arguments or torchair could not be obtained.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from qwen_npu_compile.cli import positive_int
from qwen_npu_compile.cli.check.harness import DTYPES

#: Largest accepted |loss_compiled - loss_eager| / |loss_eager| per step. Half precision: the fused
#: kernels compute in fp32 and round once where HF's modeling code rounds intermediates, so the two
#: runs legitimately differ at bf16's resolution (2^-8 relative), and the difference compounds over steps.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Compile 2 Qwen2 layers with qwen_npu + torchair, train a few steps beside eager, compare losses.")
    parser.add_argument("--model", default="qwen2.5-0.5b", help="preset name or local HF model directory (default qwen2.5-0.5b)")
    parser.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--steps", type=positive_int, default=3, help="training steps (default 3)")
    parser.add_argument("--batch", type=positive_int, default=2, help="batch size (default 2)")
    parser.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype (default bf16)")
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attn_implementation (default sdpa)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    parser.add_argument("--rtol", type=float, default=None,
                        help=f"per-step relative loss tolerance (default by dtype: {LOSS_RTOL})")
    parser.add_argument("--dump-dir", default=None, help="qwen_npu dump folder (graphs, reports; torchair's pbtxt GE graphs)")
    return parser


def pick_device(status) -> str:
    """``"npu"`` when torch_npu imported and an NPU is visible, else ``"cpu"`` (dry run)."""
    if status.simulated:
        return "cpu"
    npu = getattr(torch, "npu", None)
    return "npu" if npu is not None and npu.is_available() else "cpu"


def train(model, runner, input_ids, steps: int, lr: float) -> list[float]:
    """``steps`` AdamW steps of the LM loss of ``runner`` (``model`` or its compiled wrapper)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = runner(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach().float().cpu()))
    return losses


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from qwen_npu_compile import ensure_npu_ops, get_reports
    from qwen_npu_compile.cli.check import models
    from qwen_npu_compile.cli.check.table import FUSED_GE_OPS
    from qwen_npu_compile.torchair.offline import TorchairUnavailableError

    status = ensure_npu_ops()
    device = pick_device(status)
    dry_run = device != "npu"
    rtol = args.rtol if args.rtol is not None else LOSS_RTOL[args.dtype]
    try:
        eager_model, info = models.build_model(args.model, layers=args.layers, dtype=DTYPES[args.dtype], attn=args.attn)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    eager_model = eager_model.to(device).train()
    compiled_model = copy.deepcopy(eager_model)
    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, eager_model.config.vocab_size, (args.batch, args.seq_len), generator=generator).to(device)
    where = "npu (GE compile, real kernels)" if not dry_run else (
        f"DRY RUN on {device}: npu ops simulated ({status.reason}); torchair off-NPU: FX→GE conversion only")
    print(f"{info['name']}: {args.layers} layers, {args.dtype}, attn={args.attn}, batch {args.batch} x {args.seq_len} "
          f"tokens, {args.steps} steps; {where}")

    eager_losses = train(eager_model, eager_model, input_ids, args.steps, args.lr)
    options = {"downstream": "torchair"}
    if args.dump_dir:
        options.update(dump_dir=args.dump_dir, torchair_dump="pbtxt")
    compiled = torch.compile(compiled_model, backend="qwen_npu", options=options, dynamic=False)
    try:
        compiled_losses = train(compiled_model, compiled, input_ids, args.steps, args.lr)
    except TorchairUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        cause = getattr(exc, "inner_exception", None) or exc
        if isinstance(cause, TorchairUnavailableError):
            print(f"error: {cause}", file=sys.stderr)
            return 2
        print(f"FAIL: the torchair compile failed: {type(cause).__name__}: {cause}")
        return 1

    problems = []
    print(f"{'step':>4} {'eager loss':>12} {'compiled loss':>14} {'rel diff':>10}")
    for step, (eager, ours) in enumerate(zip(eager_losses, compiled_losses), start=1):
        diff = abs(ours - eager) / max(abs(eager), 1e-12)
        print(f"{step:>4} {eager:>12.6f} {ours:>14.6f} {diff:>10.2e}")
        if not diff <= rtol:
            problems.append(f"step {step}: loss differs by {diff:.2e} > {rtol:.0e}")
    reports = get_reports()
    for report in reports:
        print(report.log_line())
        if report.ge is not None:
            for graph in report.ge.graphs:
                fused = {op: graph.ops[op] for op in FUSED_GE_OPS if op in graph.ops}
                print(f"  GE {graph.name} ({graph.kind}, torch_npu {report.ge.torch_npu} torchair): {fused}")
            for failure in report.ge.failures:
                problems.append(f"GE conversion of {failure.op} at {failure.source} failed: {failure.error}")
    if not reports:
        problems.append("qwen_npu compiled no graph")
    for problem in problems:
        print(f"  problem: {problem}")
    verdict = "PASS" if not problems else "FAIL"
    print(f"verdict: {verdict}{' (DRY RUN: no NPU, GE compile and kernels not exercised)' if dry_run else ' on npu'}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
