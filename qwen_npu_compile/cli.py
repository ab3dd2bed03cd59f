"""``qwen-npu-compile``: the command line. ``check MODEL`` is the main job.

``check`` builds a Qwen2/Qwen2.5 model (a preset or a local Hugging Face directory), runs eager and
``torch.compile(backend="qwen_npu")`` forward (and backward in train mode) on the same random tokens,
and prints, stage by stage, then as a table: per family fused vs expected (from the config), the
error of logits and gradients against eager with the tolerance used, compile time, and a verdict.
With ``--downstream torchair`` on a host without an NPU, torchair's own FX→GE conversion runs off-NPU
(:mod:`qwen_npu_compile.torchair_offline`) and the check also fails on any node that did not convert.
Exit status 0 only when every expected fusion happened and parity holds (1: check failed,
2: bad arguments, the run would not fit in memory, or torchair could not be obtained).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import sys
import time
from pathlib import Path

import torch

from .config import ALL_FAMILIES, DOWNSTREAMS, QwenNpuConfig
from .patterns import backward_ops, expected_fusions  # noqa: F401  (expected_fusions: cli's public name)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: fp32 parity: relative L2 error ||compiled - eager|| / ||eager|| (gradients: over all parameters
#: together) must stay below these; fp32 differences come from reassociation only.
FP32_TOLERANCE = {"logits": 1e-5, "gradients": 1e-4}

#: Half-precision parity (bf16/fp16) is judged against an fp32 reference run of the same weights, as
#: torch._dynamo's accuracy checker (``torch._dynamo.utils.same`` with ``fp64_ref``) does: the fused
#: kernels compute in fp32 and round once where HF rounds intermediate results, so neither run is
#: "exact"; the compiled run passes when its error to the fp32 reference is at most
#: ``HALF_MULTIPLIER`` times eager's own error, plus ``HALF_SLACK``.
HALF_MULTIPLIER = 2.0
HALF_SLACK = 1e-3

#: Backward op that must reach the AOT backward graph once per fusion of the family (train mode);
#: declared by each family (``FusionFamily.backward_op_name``).
BACKWARD_OPS = backward_ops()

log = logging.getLogger("qwen_npu_compile")


def positive_int(text: str) -> int:
    """argparse ``type`` for counts (layers, batch, steps): an int >= 1.

    Raises:
        argparse.ArgumentTypeError: not an int, or below 1.
    """
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
    check.add_argument("--layers", type=positive_int, default=None, help="decoder layers to build (default: all)")
    check.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    check.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence (default 64)")
    check.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype (default bf16)")
    check.add_argument("--mode", choices=("train", "infer"), default="train", help="train adds the backward (default)")
    check.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attn_implementation (default sdpa)")
    check.add_argument("--fusions", default=None,
                       help=f"families to enable: all, none or a subset of {','.join(ALL_FAMILIES)} "
                            "(default: $QWEN_NPU_FUSIONS, else all)")
    check.add_argument("--downstream", choices=DOWNSTREAMS, default=None,
                       help="backend after fusion (default: torchair on NPU, else aot_eager); torchair without an NPU "
                            "runs torchair's FX->GE conversion off-NPU (torch_npu wheel downloaded into a cache)")
    check.add_argument("--dynamic", action="store_true",
                       help="mark the sequence length dynamic (torch._dynamo.mark_dynamic(input_ids, 1)), as verl's "
                            "varying micro-batch lengths make it")
    check.add_argument("--left-padding", type=int, default=0, metavar="N",
                       help="give the first sequence N leading padding tokens (attention_mask 0, labels -100); "
                            "logits are compared on real tokens (default 0: no attention_mask)")
    check.add_argument("--grad-checkpointing", action="store_true",
                       help="train with model.gradient_checkpointing_enable(use_reentrant=False), as HF Trainer does")
    check.add_argument("--autocast", action="store_true",
                       help="fp32 weights run under torch.autocast('cpu', dtype=--dtype) (bf16/fp16), as Trainer's bf16=True")
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


def padded_inputs(input_ids, left_padding: int):
    """``(attention_mask, labels)`` for ``input_ids`` ``[B, S]`` with ``left_padding`` leading pads in row 0.

    Without padding: ``(None, input_ids)``. With it, labels are -100 wherever the token or the one it
    is predicted from is padding (HF shifts labels by one).
    """
    if not left_padding:
        return None, input_ids
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :left_padding] = 0
    rows = attention_mask.bool()
    previous = torch.cat([torch.zeros_like(rows[:, :1]), rows[:, :-1]], dim=1)
    return attention_mask, input_ids.masked_fill(~(rows & previous), -100)


def _run(model, runner, input_ids, train: bool, attention_mask=None, labels=None):
    """Run ``runner`` (``model`` or its compiled wrapper): forward, and backward of the LM loss.

    With ``attention_mask`` (``[B, S]``, 0 = padding; see :func:`padded_inputs`) only the logits of
    real tokens are returned: padded query rows are fully masked, where kernels legitimately differ
    (HF's eager softmax averages V there, SDPA gives 0 or NaN), and real tokens never read them.

    Returns:
        fp32 logits (``[B, S, V]``, or ``[real tokens, V]`` with a mask) and ``{parameter name of
        model: gradient}`` (empty in infer mode).
    """
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        out = runner(input_ids=input_ids, attention_mask=attention_mask,
                     labels=(input_ids if labels is None else labels) if train else None, use_cache=False)
        if train:
            out.loss.backward()
    logits = out.logits.detach().float()
    if attention_mask is not None:
        logits = logits[attention_mask.bool()]
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None} if train else {}
    return logits, grads


def relative_l2(actual, expected) -> float:
    """``||a - e||_2 / ||e||_2`` over one tensor or a dict of tensors (all entries together).

    Norms are taken in fp32 per tensor and combined in Python floats. Returns 0.0 when both are zero,
    ``inf`` when only the reference is.
    """
    pairs = [(actual[name], expected[name]) for name in expected] if isinstance(expected, dict) else [(actual, expected)]
    diff = sum(torch.linalg.vector_norm(a.float() - e.float()).item() ** 2 for a, e in pairs) ** 0.5
    norm = sum(torch.linalg.vector_norm(e.float()).item() ** 2 for _, e in pairs) ** 0.5
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def max_abs_error(actual, expected) -> float:
    """``max |a - e|`` over one tensor or a dict of tensors."""
    if isinstance(expected, dict):
        return max((max_abs_error(actual[n], e) for n, e in expected.items()), default=0.0)
    return (actual.float() - expected.float()).abs().max().item()


def judge_parity(compiled, eager, reference, fp32_tolerance: float) -> dict:
    """Parity of one quantity (logits or the gradient dict) of the compiled run.

    Args:
        compiled, eager: the compiled and eager results (tensor or ``{name: tensor}``).
        reference: the fp32 reference results for half-precision runs, None for fp32 runs.
        fp32_tolerance: the relative L2 bound of an fp32 run.

    Returns:
        ``{"max_abs", "rel_l2"}`` (compiled vs eager), and for half precision also
        ``"eager_rel_l2_to_fp32"``, ``"compiled_rel_l2_to_fp32"``; ``"bound"``, ``"ok"``.
    """
    row = {"max_abs": max_abs_error(compiled, eager), "rel_l2": relative_l2(compiled, eager)}
    if reference is None:
        row.update(bound=fp32_tolerance, ok=row["rel_l2"] <= fp32_tolerance, judged="rel_l2 vs eager")
        return row
    eager_err = relative_l2(eager, reference)
    compiled_err = relative_l2(compiled, reference)
    bound = HALF_MULTIPLIER * eager_err + HALF_SLACK
    row.update(eager_rel_l2_to_fp32=eager_err, compiled_rel_l2_to_fp32=compiled_err, bound=bound,
               ok=compiled_err <= bound, judged="rel_l2 to fp32 reference")
    return row


def run_check(args: argparse.Namespace) -> dict:
    """Run the check described by parsed ``args``; returns the results dict (also the JSON output).

    Raises:
        ValueError: an unknown model, layer count or option (printed as a one-line error by main).
        MemoryError: the estimate exceeds the available memory (message suggests ``--layers``).
    """
    from . import models
    from .backend import resolve_downstream
    from .npu_ops import ensure_npu_ops
    from .report import get_reports

    dtype = DTYPES[args.dtype]
    train = args.mode == "train"
    autocast = getattr(args, "autocast", False)
    checkpointing = getattr(args, "grad_checkpointing", False)
    if autocast and dtype == torch.float32:
        raise ValueError("--autocast needs --dtype bf16 or fp16 (the autocast dtype; the weights stay fp32)")
    if checkpointing and not train:
        raise ValueError("--grad-checkpointing needs --mode train")

    def amp():
        """The autocast region of the eager and compiled runs (not of the fp32 reference)."""
        return torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext()
    # Validate every backend setting (options over QWEN_NPU_* env) before building anything.
    options = {"fusions": args.fusions, "downstream": args.downstream,
               "dump_dir": str(args.dump_dir) if args.dump_dir is not None else None}
    options = {key: value for key, value in options.items() if value is not None}
    backend_config = QwenNpuConfig.from_options(options)
    chosen_downstream = resolve_downstream(backend_config, ensure_npu_ops())
    fusions = backend_config.fusions
    config = models.resolve_model_config(args.model)
    layers = args.layers or config.num_hidden_layers
    if layers > config.num_hidden_layers:
        raise ValueError(f"--layers {layers} is more than {args.model} has (maximum {config.num_hidden_layers})")
    need = models.estimate_memory_bytes(config, layers=layers, batch=args.batch, seq_len=args.seq_len, dtype=dtype, train=train)
    if dtype != torch.float32:
        # the fp32 reference copy: parameters, and gradients in train mode
        need += models.estimate_num_parameters(config, layers=layers) * 4 * (2 if train else 1)
    have = models.available_memory_bytes()
    if have and need > have:
        fit = max(1, int(layers * (have * 0.8) / need))
        raise MemoryError(
            f"estimated {need / 2**30:.1f} GiB needed for {layers} layers, {have / 2**30:.1f} GiB available; "
            f"try --layers {fit} (or a smaller --batch/--seq-len)"
        )

    status = ensure_npu_ops()
    half = dtype != torch.float32
    offline_torchair = chosen_downstream == "torchair" and status.simulated
    stages = _Stages((6 if half else 5) + (1 if offline_torchair else 0))
    torchair_seconds = {}
    if offline_torchair:
        from .torchair_offline import load_offline_torchair

        stages.begin("obtaining torchair off-NPU (torch_npu wheel paired with this torch; stand-in CANN extensions)")
        offline = load_offline_torchair()
        torchair_seconds = {f"torchair_{key}": value for key, value in offline.sources.seconds.items()}
        torchair_seconds["torchair_import"] = offline.import_seconds
        stages.end(f"torch_npu {offline.torch_npu_version}, wheel {offline.sources.wheel.name}")
    stages.begin(f"building {args.model}: {layers} layers, {args.dtype}, attn={args.attn}, mode={args.mode}")
    model, info = models.build_model(args.model, layers=layers, dtype=torch.float32 if autocast else dtype, attn=args.attn)
    model.train(train)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    weights = {"preset": "random weights", "local-random": "random weights", "local-weights": "weights loaded"}[info["source"]]
    stages.end(f"{info['num_parameters'] / 1e6:.1f}M parameters, {weights}; npu ops {status.kind}")

    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=generator)
    if not 0 <= args.left_padding < args.seq_len:
        raise ValueError(f"--left-padding must be >= 0 and below --seq-len {args.seq_len}, got {args.left_padding}")
    attention_mask, labels = padded_inputs(input_ids, args.left_padding)

    stages.begin(f"eager {'forward + backward' if train else 'forward'}")
    with amp():
        eager_logits, eager_grads = _run(model, model, input_ids, train, attention_mask, labels)
    stages.end()

    reference = None
    if half:
        stages.begin("fp32 reference run of the same weights (the yardstick for half-precision parity)")
        fp32_model = copy.deepcopy(model).float()
        reference = _run(fp32_model, fp32_model, input_ids, train, attention_mask, labels)
        del fp32_model
        stages.end()

    first_report = len(get_reports())
    if args.dynamic:
        if args.seq_len < 2:
            raise ValueError("--dynamic needs --seq-len >= 2 (Dynamo specialises sizes 0 and 1)")
        for tensor in {id(t): t for t in (input_ids, attention_mask, labels) if t is not None}.values():
            torch._dynamo.mark_dynamic(tensor, 1)
    stages.begin(f"compiling with backend='qwen_npu' ({status.kind} npu ops{', dynamic sequence length' if args.dynamic else ''}) "
                 "and running it once")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="qwen_npu", options=options, dynamic=None if args.dynamic else False)
    start = time.perf_counter()
    with amp():
        compiled_logits, compiled_grads = _run(model, compiled, input_ids, train, attention_mask, labels)
    compile_seconds = time.perf_counter() - start
    stages.end()

    stages.begin("compiled run again (timing)")
    start = time.perf_counter()
    with amp():
        compiled_logits, compiled_grads = _run(model, compiled, input_ids, train, attention_mask, labels)
    steady_seconds = time.perf_counter() - start
    stages.end()

    stages.begin("comparing against eager")
    reports = get_reports()[first_report:]
    fused = {family: sum(r.fusions.get(family, 0) for r in reports) for family in ALL_FAMILIES if family in fusions}
    already = {family: sum(r.already_fused.get(family, 0) for r in reports) for family in fused}
    expected = expected_fusions(model.config, fusions)  # model.config has the --layers built
    backward_ops: dict[str, int] = {}
    for report in reports:
        for op, count in report.aot_ops.get("backward", {}).items():
            backward_ops[op] = backward_ops.get(op, 0) + count
    logits_parity = judge_parity(compiled_logits, eager_logits, reference and reference[0], FP32_TOLERANCE["logits"])
    missing = sorted(set(eager_grads) ^ set(compiled_grads))
    grads_parity = None
    if train and not missing:
        grads_parity = judge_parity(compiled_grads, eager_grads, reference and reference[1], FP32_TOLERANCE["gradients"])
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
    for what, row in (("logits", logits_parity), ("gradients", grads_parity)):
        if row is not None and not row["ok"]:
            problems.append(f"{what} parity: {row['judged']} {row.get('compiled_rel_l2_to_fp32', row['rel_l2']):.2e} > bound {row['bound']:.2e}")
    ge = ge_results(reports, status)
    if ge is not None:
        kinds = [graph["kind"] for graph in ge["graphs"]]
        for kind in ("forward", "backward") if train else ("forward",):
            if kind not in kinds:
                problems.append(f"GE conversion: torchair built no {kind} graph")
        if ge["failures"]:
            problems.append(f"GE conversion: {len(ge['failures'])} node(s) failed to convert")
    if train:
        if missing:
            problems.append(f"gradients missing or extra for {missing[:3]}")
        if downstream == "aot_eager":
            for family, count in fused.items():
                op = BACKWARD_OPS[family]
                if backward_ops.get(op, 0) != count:
                    problems.append(f"AOT backward holds {backward_ops.get(op, 0)} {op}, expected {count}")

    result = {
        "model": info,
        "settings": {
            "batch": args.batch, "seq_len": args.seq_len, "dtype": args.dtype, "mode": args.mode,
            "attn": args.attn, "fusions": sorted(fusions), "downstream": downstream, "dynamic": args.dynamic,
            "left_padding": args.left_padding, "autocast": autocast, "grad_checkpointing": checkpointing,
        },
        "versions": run_versions(status),
        "simulated": status.simulated,
        "npu_ops": status.reason,
        "fusions": {family: {"fused": fused[family], "already_fused": already[family], "expected": expected[family]} for family in expected},
        "refused": [refusal.as_dict() for report in reports for refusal in report.refused],
        "backward_ops": backward_ops,
        "parity": {
            "logits": logits_parity,
            "gradients": grads_parity,
            "metric": (
                "rel l2 = ||a-b||/||b||; fp32: compiled vs eager <= bound; half precision: compiled's rel l2 "
                f"to an fp32 reference <= {HALF_MULTIPLIER:g} x eager's + {HALF_SLACK:g}"
            ),
        },
        "seconds": {
            "first_compiled_run": compile_seconds,
            "steady_compiled_run": steady_seconds,
            "qwen_npu_canonicalize": sum(r.seconds.get("canonicalize", 0) for r in reports),
            "qwen_npu_fuse": sum(r.seconds.get("fuse", 0) for r in reports),
            **torchair_seconds,
        },
        "graphs": len(reports),
        "problems": problems,
        "verdict": "PASS" if not problems else "FAIL",
    }
    if ge is not None:
        result["ge"] = ge
    return result


def run_versions(status) -> dict:
    """Where the check ran: python, torch, transformers, torch_npu (real version, or None when the npu ops
    are simulated), ``npu_ops`` (``"real"``/``"simulated"``), ``torchair`` (``"<torch_npu version>
    (off-NPU, from the wheel)"``, ``"<version> (installed)"`` or None) and qwen_npu_compile."""
    from .report import versions
    from .torchair_offline import loaded_offline_torchair

    found = versions()
    offline = loaded_offline_torchair() if status.simulated else None
    torchair = None
    if offline is not None:
        torchair = f"{offline.torch_npu_version} (off-NPU, from the wheel {offline.sources.wheel.name})"
    elif not status.simulated:
        torchair = f"{status.torch_npu_version} (installed)"
    return {
        "python": found["python"], "torch": found["torch"], "transformers": found["transformers"],
        "torch_npu": None if status.simulated else status.torch_npu_version, "npu_ops": status.kind,
        "torchair": torchair, "qwen_npu_compile": found["qwen_npu_compile"],
    }


def ge_results(reports, status) -> dict | None:
    """torchair's off-NPU FX→GE conversion of ``reports``' graphs, or None when none was converted off-NPU.

    Returns:
        ``{"torch_npu": version, "torchair": "offline", "graphs": [{"name", "kind", "qwen_npu_graph", "ops", "seconds"}],
        "failures": [{"op", "error", "source", "graph", "node", "kind", "qwen_npu_graph"}]}``; ``kind`` is
        ``"converter"`` (torchair's converter raised) or ``"limit"`` (converted, but breaks the op's limits).
    """
    converted = [report for report in reports if report.ge is not None]
    if not converted:
        return None
    return {
        "torch_npu": converted[0].ge.torch_npu,
        "torchair": converted[0].ge.torchair,
        "graphs": [{"name": graph.name, "kind": graph.kind, "qwen_npu_graph": report.name, "ops": dict(graph.ops),
                    "seconds": graph.seconds}
                   for report in converted for graph in report.ge.graphs],
        "failures": [{"op": f.op, "error": f.error, "source": f.source, "graph": f.graph, "node": f.node,
                      "kind": f.kind, "qwen_npu_graph": report.name}
                     for report in converted for f in report.ge.failures],
    }


def print_table(result: dict) -> None:
    """Print the human-readable summary of :func:`run_check`'s result."""
    kind = "simulated" if result["simulated"] else "real"
    print()
    dynamic = ", dynamic sequence length" if result["settings"].get("dynamic") else ""
    print(f"qwen_npu check: {result['model']['name']} ({result['model']['layers']} layers), "
          f"{result['settings']['dtype']} {result['settings']['mode']}, attn={result['settings']['attn']}{dynamic}, "
          f"npu ops {kind}, downstream {result['settings']['downstream']}")
    found = result["versions"]
    torch_npu = found["torch_npu"] if found["torch_npu"] else "none (npu ops simulated)"
    torchair = f", torchair {found['torchair']}" if found["torchair"] else ""
    print(f"  ran with torch {found['torch']}, transformers {found['transformers']}, torch_npu {torch_npu}{torchair}")
    print(f"  {'family':<12}{'fused':>8}{'expected':>10}  status")
    for family, row in result["fusions"].items():
        got = row["fused"] + row["already_fused"]
        note = f" ({row['already_fused']} already fused)" if row["already_fused"] else ""
        print(f"  {family:<12}{got:>8}{row['expected']:>10}  {'ok' if got == row['expected'] else 'MISSING'}{note}")
    half = "eager_rel_l2_to_fp32" in result["parity"]["logits"]
    if half:
        print(f"  {'parity':<12}{'max abs':>11}{'rel l2':>11}{'eager→fp32':>12}{'ours→fp32':>11}{'bound':>10}  status")
    else:
        print(f"  {'parity':<12}{'max abs':>11}{'rel l2':>11}{'bound':>10}  status")
    for what in ("logits", "gradients"):
        row = result["parity"][what]
        if row is None:
            continue
        cells = f"  {what:<12}{row['max_abs']:>11.3e}{row['rel_l2']:>11.3e}"
        if half:
            cells += f"{row['eager_rel_l2_to_fp32']:>12.3e}{row['compiled_rel_l2_to_fp32']:>11.3e}"
        print(f"{cells}{row['bound']:>10.2e}  {'ok' if row['ok'] else 'FAIL'}")
    print(f"  ({result['parity']['metric']})")
    if result["backward_ops"]:
        print("  AOT backward graph: " + ", ".join(f"{op} {n}" for op, n in result["backward_ops"].items()))
    secs = result["seconds"]
    print(f"  compile + first run {secs['first_compiled_run']:.1f}s (qwen_npu canonicalize "
          f"{secs['qwen_npu_canonicalize']:.2f}s, fuse {secs['qwen_npu_fuse']:.2f}s); steady run {secs['steady_compiled_run']:.2f}s")
    for refusal in result["refused"][:10]:
        print(f"  refused {refusal['family']} at {refusal['source']}: {refusal['reason']}")
    if len(result["refused"]) > 10:
        print(f"  ... {len(result['refused']) - 10} more refusals (all in --json / --dump-dir)")
    if "ge" in result:
        print_ge(result["ge"])
    for problem in result["problems"]:
        print(f"  problem: {problem}")
    print(f"verdict: {result['verdict']}")


#: GE op types of the fused kernels, printed with the GE conversion line (torch_npu 2.13.0 torchair
#: converters of npu_rms_norm(_backward), npu_add_rms_norm, npu_swiglu(_backward), npu_rotary_mul(_backward),
#: npu_fusion_attention(_grad)).
FUSED_GE_OPS = ("RmsNorm", "RmsNormGrad", "AddRmsNorm", "SwiGlu", "SwiGluGrad", "RotaryMul", "RotaryMulGrad",
                "FlashAttentionScore", "FlashAttentionScoreGrad")


def print_ge(ge: dict) -> None:
    """Print the ``GE conversion:`` line (``ok`` or the blockers) and the fused GE ops per graph."""
    graphs = ", ".join(f"{graph['name']} ({graph['kind']})" for graph in ge["graphs"])
    where = f"torchair of torch_npu {ge['torch_npu']}, {ge['torchair']}"
    if not ge["failures"]:
        print(f"  GE conversion: ok ({len(ge['graphs'])} graphs: {graphs}; {where})")
    else:
        print(f"  GE conversion: {len(ge['failures'])} node(s) failed to convert or break a GE limit ({where}):")
        from . import ge_converters

        cpu_only = getattr(ge_converters, "CPU_ONLY_OPS", ())
        for failure in ge["failures"]:
            note = " [only in a CPU trace: on an NPU torch_npu dispatches SDPA to its own kernels]" \
                if failure["op"] in cpu_only else ""
            print(f"    {failure['op']} at {failure['source']} ({failure['graph']}): {failure['error']}{note}")
    for graph in ge["graphs"]:
        fused = ", ".join(f"{op} {graph['ops'][op]}" for op in FUSED_GE_OPS if op in graph["ops"])
        print(f"  GE {graph['name']} ({graph['kind']}): {sum(graph['ops'].values())} ops, converted in "
              f"{graph['seconds']:.1f}s; {fused or 'no fused op'}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qwen-npu-compile`` console script; returns the exit status."""
    from .torchair_offline.wheel import TorchairUnavailableError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        result = run_check(args)
    except (ValueError, MemoryError, TorchairUnavailableError) as exc:
        print(f"qwen-npu-compile: error: {exc}", file=sys.stderr)
        return 2
    except torch._dynamo.exc.BackendCompilerFailed as exc:  # e.g. strict mode's FusionError
        cause = exc.inner_exception if getattr(exc, "inner_exception", None) is not None else exc
        print(f"qwen-npu-compile: compile failed: {type(cause).__name__}: {cause}", file=sys.stderr)
        return 1
    except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as exc:
        # --dynamic marked the sequence length dynamic and something specialised it (e.g. torchair's
        # view optimisation when --seq-len equals a head or hidden size): a finding, not a crash.
        first = str(exc).strip().splitlines()
        print(f"qwen-npu-compile: --dynamic: the sequence length was specialised during the compile "
              f"({' '.join(first[:2])}); try another --seq-len to see whether it is a size coincidence",
              file=sys.stderr)
        return 1
    print_table(result)
    if args.json_path is not None:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(result, indent=2, default=str))
        print(f"results written to {args.json_path}")
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
