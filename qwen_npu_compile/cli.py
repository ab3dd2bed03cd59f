"""``qwen-npu-compile``: the command line. ``check MODEL`` is the main job.

``check`` builds a Qwen2/Qwen2.5 model (a preset or a local Hugging Face directory), runs eager and
``torch.compile(backend="qwen_npu")`` forward (and backward in train mode) on the same random tokens,
and prints, stage by stage, then as a table: per family fused vs expected (from the config), the
error of logits and gradients against eager with the tolerance used, compile time, and a verdict.
Exit status 0 only when every expected fusion happened and parity holds (1: check failed,
2: bad arguments or the run would not fit in memory).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from .config import ALL_FAMILIES, DOWNSTREAMS, parse_fusions

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: Parity tolerances, as max|compiled - eager| / max|eager| per tensor (the worst tensor counts).
#: Half precision: the fused kernels compute in fp32 and round once, where HF rounds intermediate
#: results (e.g. before RMSNorm's weight multiply): about 1 ulp per op (bf16 ulp = 2^-8 = 0.4%),
#: compounded over layers and by the backward. fp32: reassociation only.
TOLERANCES = {
    torch.float32: {"logits": 1e-4, "gradients": 1e-3},
    torch.bfloat16: {"logits": 3e-2, "gradients": 5e-2},
    torch.float16: {"logits": 1e-2, "gradients": 2e-2},
}

#: Backward op that must reach the AOT backward graph once per fusion of the family (train mode).
BACKWARD_OPS = {
    "rms_norm": "npu_rms_norm_backward",
    "swiglu": "npu_swiglu_backward",
    "rotary": "npu_rotary_mul_backward",
    "attention": "npu_fusion_attention_grad",
}

log = logging.getLogger("qwen_npu_compile")


def expected_fusions(num_layers: int, families) -> dict[str, int]:
    """Fusions a Qwen2 model of ``num_layers`` decoder layers must give, per enabled family.

    RMSNorm: 2 per layer + the final norm; SwiGLU: 1 per layer; rotary: q and k per layer;
    attention: 1 per layer.
    """
    per_family = {"rms_norm": 2 * num_layers + 1, "swiglu": num_layers, "rotary": 2 * num_layers, "attention": num_layers}
    return {family: per_family[family] for family in ALL_FAMILIES if family in families}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen-npu-compile",
        description="Fuse Qwen2/Qwen2.5 subgraphs into Ascend NPU ops with torch.compile(backend='qwen_npu').",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="compile a model and check fusion counts and parity against eager",
        description="Build MODEL, run eager and qwen_npu-compiled forward (and backward), compare, print a verdict.",
    )
    check.add_argument("model", metavar="MODEL", help="a preset name (e.g. qwen2.5-0.5b) or a local HF model directory")
    check.add_argument("--layers", type=_positive_int, default=None, help="decoder layers to build (default: all)")
    check.add_argument("--batch", type=_positive_int, default=1, help="batch size (default 1)")
    check.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per sequence (default 64)")
    check.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype (default bf16)")
    check.add_argument("--mode", choices=("train", "infer"), default="train", help="train adds the backward (default)")
    check.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attn_implementation (default sdpa)")
    check.add_argument("--fusions", default="all", help=f"families to enable: all, none or a subset of {','.join(ALL_FAMILIES)}")
    check.add_argument("--downstream", choices=DOWNSTREAMS, default=None, help="backend after fusion (default: torchair on NPU, else aot_eager)")
    check.add_argument("--dump-dir", type=Path, default=None, help="write graphs, report.json and summary.json here")
    check.add_argument("--json", type=Path, default=None, dest="json_path", metavar="FILE", help="write the results as JSON")
    check.add_argument("-v", "--verbose", action="store_true", help="log every qwen_npu line")
    return parser


class _Stages:
    """Prints ``[i/n] what ... seconds`` progress lines."""

    def __init__(self, total: int) -> None:
        self.total, self.index, self.start = total, 0, 0.0

    def begin(self, text: str) -> None:
        self.index += 1
        self.start = time.perf_counter()
        print(f"[{self.index}/{self.total}] {text} ...", flush=True)

    def end(self, detail: str = "") -> float:
        seconds = time.perf_counter() - self.start
        print(f"      done in {seconds:.1f}s{'; ' + detail if detail else ''}", flush=True)
        return seconds


def _run(model, runner, input_ids, train: bool):
    """Run ``runner`` (``model`` or its compiled wrapper): forward, and backward of the LM loss.

    Returns:
        fp32 logits ``[B, S, V]`` and ``{parameter name of model: gradient}`` (empty in infer mode).
    """
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        out = runner(input_ids=input_ids, labels=input_ids if train else None, use_cache=False)
        if train:
            out.loss.backward()
    logits = out.logits.detach().float()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None} if train else {}
    return logits, grads


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """``(max |a - e|, max |a - e| / max |e|)`` in fp32; 0 relative error when both are all zeros."""
    diff = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    return diff, (diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))


def _compare_grads(compiled: dict, eager: dict) -> dict:
    worst = {"max_abs": 0.0, "max_rel": 0.0, "parameter": None}
    missing = sorted(set(eager) ^ set(compiled))
    for name, grad in eager.items():
        if name not in compiled:
            continue
        abs_err, rel_err = relative_error(compiled[name], grad)
        if rel_err >= worst["max_rel"]:
            worst = {"max_abs": abs_err, "max_rel": rel_err, "parameter": name}
    worst["missing"] = missing
    return worst


def run_check(args: argparse.Namespace) -> dict:
    """Run the check described by parsed ``args``; returns the results dict (also the JSON output).

    Raises:
        ValueError: an unknown model, layer count or option (printed as a one-line error by main).
        MemoryError: the estimate exceeds the available memory (message suggests ``--layers``).
    """
    from . import models
    from .npu_ops import ensure_npu_ops
    from .report import get_reports

    dtype = DTYPES[args.dtype]
    train = args.mode == "train"
    fusions = parse_fusions(args.fusions, "--fusions")
    config = models.resolve_model_config(args.model)
    layers = args.layers or config.num_hidden_layers
    if layers > config.num_hidden_layers:
        raise ValueError(f"--layers {layers} is more than {args.model} has (maximum {config.num_hidden_layers})")
    need = models.estimate_memory_bytes(config, layers=layers, batch=args.batch, seq_len=args.seq_len, dtype=dtype, train=train)
    have = models.available_memory_bytes()
    if have and need > have:
        fit = max(1, int(layers * (have * 0.8) / need))
        raise MemoryError(
            f"estimated {need / 2**30:.1f} GiB needed for {layers} layers, {have / 2**30:.1f} GiB available; "
            f"try --layers {fit} (or a smaller --batch/--seq-len)"
        )

    status = ensure_npu_ops()
    stages = _Stages(5)
    stages.begin(f"building {args.model}: {layers} layers, {args.dtype}, attn={args.attn}, mode={args.mode}")
    model, info = models.build_model(args.model, layers=layers, dtype=dtype, attn=args.attn)
    model.train(train)
    stages.end(f"{info['num_parameters'] / 1e6:.1f}M parameters, {info['source']} weights; npu ops {status.kind}")

    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=generator)

    stages.begin(f"eager {'forward + backward' if train else 'forward'}")
    eager_logits, eager_grads = _run(model, model, input_ids, train)
    stages.end()

    options = {"fusions": sorted(fusions)}
    if args.dump_dir is not None:
        options["dump_dir"] = str(args.dump_dir)
    if args.downstream is not None:
        options["downstream"] = args.downstream
    first_report = len(get_reports())
    stages.begin(f"compiling with backend='qwen_npu' ({status.kind} npu ops) and running it once")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="qwen_npu", options=options, dynamic=False)
    start = time.perf_counter()
    compiled_logits, compiled_grads = _run(model, compiled, input_ids, train)
    compile_seconds = time.perf_counter() - start
    stages.end()

    stages.begin("compiled run again (timing)")
    start = time.perf_counter()
    compiled_logits, compiled_grads = _run(model, compiled, input_ids, train)
    steady_seconds = time.perf_counter() - start
    stages.end()

    stages.begin("comparing against eager")
    reports = get_reports()[first_report:]
    fused = {family: sum(r.fusions.get(family, 0) for r in reports) for family in ALL_FAMILIES if family in fusions}
    already = {family: sum(r.already_fused.get(family, 0) for r in reports) for family in fused}
    expected = expected_fusions(layers, fusions)
    backward_ops: dict[str, int] = {}
    for report in reports:
        for op, count in report.aot_ops.get("backward", {}).items():
            backward_ops[op] = backward_ops.get(op, 0) + count
    tolerance = TOLERANCES[dtype]
    logits_abs, logits_rel = relative_error(compiled_logits, eager_logits)
    grads = _compare_grads(compiled_grads, eager_grads) if train else None
    downstream = reports[0].downstream if reports else None
    stages.end()

    problems = []
    if not reports:
        problems.append("qwen_npu compiled no graph")
    if len(reports) > 1:
        problems.append(f"{len(reports)} graphs compiled (graph breaks or recompiles); expected 1")
    for family, want in expected.items():
        if fused[family] + already[family] != want:
            problems.append(f"{family}: fused {fused[family]} (+{already[family]} already fused), expected {want}")
    if logits_rel > tolerance["logits"]:
        problems.append(f"logits differ: rel err {logits_rel:.2e} > {tolerance['logits']:.0e}")
    if train:
        if grads["missing"]:
            problems.append(f"gradients missing for {grads['missing'][:3]}")
        if grads["max_rel"] > tolerance["gradients"]:
            problems.append(f"gradients differ: rel err {grads['max_rel']:.2e} ({grads['parameter']}) > {tolerance['gradients']:.0e}")
        if downstream == "aot_eager":
            for family, count in fused.items():
                op = BACKWARD_OPS[family]
                if backward_ops.get(op, 0) != count:
                    problems.append(f"AOT backward holds {backward_ops.get(op, 0)} {op}, expected {count}")

    return {
        "model": info,
        "settings": {
            "batch": args.batch, "seq_len": args.seq_len, "dtype": args.dtype, "mode": args.mode,
            "attn": args.attn, "fusions": sorted(fusions), "downstream": downstream,
        },
        "simulated": status.simulated,
        "npu_ops": status.reason,
        "fusions": {family: {"fused": fused[family], "already_fused": already[family], "expected": expected[family]} for family in expected},
        "refused": [refusal.as_dict() for report in reports for refusal in report.refused],
        "backward_ops": backward_ops,
        "parity": {
            "logits": {"max_abs": logits_abs, "max_rel": logits_rel, "tolerance": tolerance["logits"]},
            "gradients": None if grads is None else {**grads, "tolerance": tolerance["gradients"]},
            "metric": "max|compiled - eager| / max|eager| per tensor",
        },
        "seconds": {
            "first_compiled_run": compile_seconds,
            "steady_compiled_run": steady_seconds,
            "qwen_npu_canonicalize": sum(r.seconds.get("canonicalize", 0) for r in reports),
            "qwen_npu_fuse": sum(r.seconds.get("fuse", 0) for r in reports),
        },
        "graphs": len(reports),
        "problems": problems,
        "verdict": "PASS" if not problems else "FAIL",
    }


def print_table(result: dict) -> None:
    """Print the human-readable summary of :func:`run_check`'s result."""
    kind = "simulated" if result["simulated"] else "real"
    print()
    print(f"qwen_npu check: {result['model']['name']} ({result['model']['layers']} layers), "
          f"{result['settings']['dtype']} {result['settings']['mode']}, attn={result['settings']['attn']}, "
          f"npu ops {kind}, downstream {result['settings']['downstream']}")
    print(f"  {'family':<12}{'fused':>8}{'expected':>10}  status")
    for family, row in result["fusions"].items():
        got = row["fused"] + row["already_fused"]
        note = f" ({row['already_fused']} already fused)" if row["already_fused"] else ""
        print(f"  {family:<12}{got:>8}{row['expected']:>10}  {'ok' if got == row['expected'] else 'MISSING'}{note}")
    print(f"  {'parity':<12}{'max abs':>11}{'max rel':>11}{'tolerance':>11}  status")
    for what in ("logits", "gradients"):
        row = result["parity"][what]
        if row is None:
            continue
        print(f"  {what:<12}{row['max_abs']:>11.3e}{row['max_rel']:>11.3e}{row['tolerance']:>11.0e}  "
              f"{'ok' if row['max_rel'] <= row['tolerance'] else 'FAIL'}")
    print(f"  (rel = {result['parity']['metric']})")
    if result["backward_ops"]:
        print("  AOT backward graph: " + ", ".join(f"{op} {n}" for op, n in result["backward_ops"].items()))
    secs = result["seconds"]
    print(f"  compile + first run {secs['first_compiled_run']:.1f}s (qwen_npu canonicalise "
          f"{secs['qwen_npu_canonicalize']:.2f}s, fuse {secs['qwen_npu_fuse']:.2f}s); steady run {secs['steady_compiled_run']:.2f}s")
    for refusal in result["refused"][:10]:
        print(f"  refused {refusal['family']} at {refusal['source']}: {refusal['reason']}")
    for problem in result["problems"]:
        print(f"  problem: {problem}")
    print(f"verdict: {result['verdict']}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qwen-npu-compile`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        result = run_check(args)
    except (ValueError, MemoryError) as exc:
        print(f"qwen-npu-compile: error: {exc}", file=sys.stderr)
        return 2
    print_table(result)
    if args.json_path is not None:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(result, indent=2, default=str))
        print(f"results written to {args.json_path}")
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
