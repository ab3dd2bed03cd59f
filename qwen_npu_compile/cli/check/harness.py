"""The ``check`` run: build a model, run eager, an fp32 reference (half precision) and ``qwen_npu``
compiled, compare, and collect the results dict that ``check`` prints (:mod:`.table`) and writes as JSON.

:func:`run_model` is the one forward/backward step of the harness, the tests and the benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import time

import torch

from qwen_npu_compile import patterns
from qwen_npu_compile.cli.check import memory, model_folder, models, parity
from qwen_npu_compile.cli.check.device import check_device, describe_device, device_memory_bytes
from qwen_npu_compile.cli.check.spec import CheckSpec
from qwen_npu_compile.config import ALL_FAMILIES, QwenNpuConfig
from qwen_npu_compile.integrations.torch_compiler import torch_compile
from qwen_npu_compile.patterns import expected_fusions  # noqa: F401  (the harness's public name)
from qwen_npu_compile.substitutions import deltanet

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: Backward op that must reach the AOT backward graph once per fusion of the family (train mode);
#: declared by each family (``FusionFamily.backward_op_name``).
BACKWARD_OPS = patterns.backward_ops()


class Stages:
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


def left_padding_mask(input_ids, left_padding: int):
    """``attention_mask`` (``[B, S]``, 1 = token, 0 = padding) giving row 0 ``left_padding`` leading pads; None for 0."""
    if not left_padding:
        return None
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :left_padding] = 0
    return attention_mask


def padding_labels(input_ids, attention_mask):
    """LM labels for ``input_ids`` (``[B, S]``): -100 wherever the token or the one it is predicted from is
    padding (HF shifts labels by one), ``input_ids`` elsewhere; ``input_ids`` itself without a mask."""
    if attention_mask is None:
        return input_ids
    rows = attention_mask.bool()
    previous = torch.cat([torch.zeros_like(rows[:, :1]), rows[:, :-1]], dim=1)
    return input_ids.masked_fill(~(rows & previous), -100)


def run_model(model, runner, input_ids, train: bool, attention_mask=None, labels=None, *, losses: list | None = None,
              **kwargs):
    """Run ``runner`` (``model`` or its compiled wrapper): forward, and backward of the LM loss when ``train``.

    Args:
        model: the module whose parameters' gradients are collected (zeroed first).
        runner: ``model`` or ``torch.compile(model, ...)``.
        input_ids: ``[B, S]`` token ids.
        train: run the backward of the LM loss (labels: ``labels``, else :func:`padding_labels`).
        attention_mask: ``[B, S]``, 0 = padding, or None. With a mask only the logits of real tokens are
            returned: padded query rows are fully masked, where kernels legitimately differ (HF's eager
            softmax averages V there, SDPA gives 0 or NaN), and real tokens never read them.
        losses: when given, the loss (a float; train) is appended to it.
        kwargs: more model inputs (``position_ids``, ...); ``use_cache`` defaults to False.

    Returns:
        ``(logits, grads)``: fp32 logits (``[B, S, V]``, or ``[real tokens, V]`` with a mask) and
        ``{parameter name of model: gradient}`` (empty without ``train``). The gradients are moved out of
        the parameters (``p.grad`` is None afterwards), so that one copy of them is alive, not two.
    """
    kwargs.setdefault("use_cache", False)
    if train and labels is None:
        labels = padding_labels(input_ids, attention_mask)
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        out = runner(input_ids=input_ids, attention_mask=attention_mask, labels=labels if train else None, **kwargs)
        if train:
            if losses is not None:
                losses.append(float(out.loss.detach()))
            out.loss.backward()
    logits = out.logits.detach().float()
    if attention_mask is not None:
        logits = logits[attention_mask.bool()]
    grads = {}
    if train:
        for name, p in model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.detach()
                p.grad = None
    return logits, grads


def fp32_reference(model, input_ids, train: bool, attention_mask=None, labels=None, **kwargs):
    """:func:`run_model` of an fp32 copy of ``model`` (the yardstick of half-precision parity)."""
    fp32_model = copy.deepcopy(model).float()
    return run_model(fp32_model, fp32_model, input_ids, train, attention_mask, labels, **kwargs)


def refuse_non_finite(run, losses: list, what: str) -> None:
    """Refuse to judge parity against a yardstick run (``(logits, grads)`` of :func:`run_model`; ``losses``: the
    losses run_model appended, the last one is this run's) whose loss or logits are NaN or infinite: every
    comparison with it would pass or fail for no reason.

    Raises:
        ValueError: one line naming the run and what is not finite (``check`` exits 2).
    """
    if losses and not math.isfinite(losses[-1]):
        raise ValueError(f"the {what} loss is {losses[-1]}: nothing to check parity against (the model's weights or "
                         "the inputs give a non-finite loss)")
    logits = run[0]
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"the {what} logits hold {int((~torch.isfinite(logits)).sum())} NaN or infinite value(s): "
                         "nothing to check parity against (the model's weights give non-finite outputs)")


def run_check(args: argparse.Namespace | CheckSpec) -> dict:
    """Run the check described by ``args`` (a :class:`~.spec.CheckSpec`, or parsed ``check`` arguments); returns the
    results dict (also the JSON output).

    Every refusal comes before anything is built: the spec's own (:meth:`~.spec.CheckSpec.problem`), the backend
    settings (options over ``QWEN_NPU_*``), the model's config and weights, the memory estimate.

    Raises:
        ValueError: an unknown model, layer count or option (printed as a one-line error by main).
        MemoryError: the estimate exceeds the available memory (message suggests ``--layers``).
        TorchairUnavailableError: ``--downstream torchair`` off-NPU without what the offline conversion needs.
    """
    from qwen_npu_compile.ops import ensure_npu_ops

    spec = args if isinstance(args, CheckSpec) else CheckSpec.from_args(args)
    if (problem := spec.problem()) is not None:
        raise ValueError(problem)
    status = ensure_npu_ops()
    device = check_device(status)  # npu where torch_npu is real and an NPU is present, else cpu
    fusions, chosen_downstream = _backend_settings(spec, status)
    config, layers = _model_config(spec)
    check_memory(spec.model, config, layers=layers, batch=spec.batch, seq_len=spec.seq_len, dtype=DTYPES[spec.dtype],
                 train=spec.train, autocast=spec.autocast, device=device)

    print(describe_device(device, status), flush=True)
    offline_torchair = chosen_downstream == "torchair" and status.simulated
    stages = Stages((6 if spec.half else 5) + (1 if offline_torchair else 0))
    torchair_seconds = _load_offline_torchair(stages) if offline_torchair else {}
    model, info = _build(spec, stages, layers, device, status)
    inputs = _inputs(spec, model, device)
    reference, eager = _eager_runs(spec, stages, model, inputs, device)
    compiled_run, seconds, reports = _compiled_runs(spec, stages, model, inputs, device, fusions, status)

    stages.begin("comparing against eager")
    fused = {family: sum(r.fusions.get(family, 0) for r in reports) for family in ALL_FAMILIES if family in fusions}
    already = {family: sum(r.already_fused.get(family, 0) for r in reports) for family in fused}
    expected = expected_fusions(model.config, fusions)  # model.config has the --layers built
    backward_ops = _backward_ops(reports)
    parity_rows = parity.judge_runs(compiled_run, eager, reference)
    missing = parity.gradient_mismatch(compiled_run, eager)
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
    problems += parity.problems(parity_rows)
    ge = ge_results(reports, status)
    if ge is not None:
        problems += _ge_problems(ge, spec.train)
    if spec.train:
        if missing:
            problems.append(f"gradients missing or extra for {missing[:3]}")
        # the families' backward ops are aot_eager's forms: not the torchair forms a graph fused for torchair holds
        # when it falls back to aot_eager (on an Ascend host where a GE graph fails to run)
        if downstream == "aot_eager" and chosen_downstream == "aot_eager":
            problems += _backward_op_problems(fused, backward_ops)

    result = {
        "model": info,
        "settings": {
            "batch": spec.batch, "seq_len": spec.seq_len, "dtype": spec.dtype, "mode": spec.mode,
            "attn": spec.attn, "fusions": sorted(fusions), "downstream": downstream, "dynamic": spec.dynamic,
            "left_padding": spec.left_padding, "autocast": spec.autocast, "grad_checkpointing": spec.grad_checkpointing,
            "vocab_size": model.config.vocab_size, "vocab_override": spec.vocab_size is not None,
            "device": str(device),
        },
        "versions": run_versions(status),
        "simulated": status.simulated,
        "npu_ops": status.reason,
        "fusions": {family: {"fused": fused[family], "already_fused": already[family], "expected": expected[family]}
                    for family in expected},
        "refused": [refusal.as_dict() for report in reports for refusal in report.refused],
        "backward_ops": backward_ops,
        "parity": {**parity_rows, "metric": parity.METRIC},
        "seconds": {
            "first_compiled_run": seconds[0],
            "steady_compiled_run": seconds[1],
            "qwen_npu_canonicalize": sum(r.seconds.get("canonicalize", 0) for r in reports),
            "qwen_npu_fuse": sum(r.seconds.get("fuse", 0) for r in reports),
            **torchair_seconds,
        },
        "graphs": len(reports),
        # what ran one step down (e.g. on an Ascend host without a runnable GE graph: torchair -> aot_eager)
        "downstream_fallbacks": [dict(f, qwen_npu_graph=r.name) for r in reports for f in r.downstream_fallbacks],
        "problems": problems,
        "verdict": "PASS" if not problems else "FAIL",
    }
    if ge is not None:
        result["ge"] = ge
    return result


def _backend_settings(spec: CheckSpec, status) -> tuple[frozenset[str], str]:
    """The enabled families and the downstream the backend will pick, validated (options over ``QWEN_NPU_*``)
    before anything is built.

    Raises:
        ValueError: an unknown family or downstream (:meth:`QwenNpuConfig.from_options`).
        TorchairUnavailableError: torchair off-NPU without protobuf (checked before the wheel is fetched).
    """
    from qwen_npu_compile.backend import resolve_downstream

    backend_config = QwenNpuConfig.from_options(spec.backend_options())
    chosen = resolve_downstream(backend_config, status)
    if chosen == "torchair" and status.simulated:
        from qwen_npu_compile.torchair.offline.importer import missing_protobuf
        from qwen_npu_compile.torchair.offline.wheel import TorchairUnavailableError

        missing = missing_protobuf()
        if missing is not None:
            raise TorchairUnavailableError(missing)
    return backend_config.fusions, chosen


def _model_config(spec: CheckSpec):
    """``(config, layers)``: the model's config (``--vocab-size`` applied) and the decoder layers to build.

    Raises:
        ValueError: a broken model folder, or ``--layers`` above the model's ``num_hidden_layers``.
    """
    config = model_folder.resolve_config(spec.model)  # a broken folder: one line, exit 2
    model_folder.check_weights(spec.model)
    if spec.vocab_size is not None:
        config = models.with_vocab_size(config, spec.vocab_size)
    layers = spec.layers or config.num_hidden_layers
    if layers > config.num_hidden_layers:
        raise ValueError(f"--layers {layers} is more than {spec.model} has (maximum {config.num_hidden_layers})")
    return config, layers


def _load_offline_torchair(stages: Stages) -> dict[str, float]:
    """Obtain torchair off-NPU (a progress stage); returns its ``torchair_*`` seconds for the results."""
    from qwen_npu_compile.torchair.offline import load_offline_torchair

    stages.begin("obtaining torchair off-NPU (torch_npu wheel paired with this torch; stand-in CANN extensions)")
    offline = load_offline_torchair()
    seconds = {f"torchair_{key}": value for key, value in offline.sources.seconds.items()}
    seconds["torchair_import"] = offline.import_seconds
    stages.end(f"torch_npu {offline.torch_npu_version}, wheel {offline.sources.wheel.name}")
    return seconds


def _build(spec: CheckSpec, stages: Stages, layers: int, device: torch.device, status):
    """``(model, info)``: the model on ``device`` in the spec's mode (gradient checkpointing on when asked)."""
    stages.begin(f"building {spec.model}: {layers} layers, {spec.dtype}, attn={spec.attn}, mode={spec.mode}")
    with model_folder.building(spec.model):
        model, info = models.build_model(spec.model, layers=layers,
                                         dtype=torch.float32 if spec.autocast else DTYPES[spec.dtype],
                                         attn=spec.attn, vocab_size=spec.vocab_size)
    model.to(device)
    model.train(spec.train)
    if spec.grad_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.2x: the old name is deprecated
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # transformers 4.57-5.10
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    weights = {"preset": "random weights", "local-random": "random weights", "local-weights": "weights loaded"}[info["source"]]
    stages.end(f"{info['num_parameters'] / 1e6:.1f}M parameters, {weights}; npu ops {status.kind}; on {device}")
    return model, info


def _inputs(spec: CheckSpec, model, device: torch.device) -> dict:
    """The step's ``input_ids`` (``[B, S]``, seeded), ``attention_mask`` (or None) and ``labels``."""
    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, model.config.vocab_size, (spec.batch, spec.seq_len), generator=generator).to(device)
    attention_mask = left_padding_mask(input_ids, spec.left_padding)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": padding_labels(input_ids, attention_mask)}


def _amp(spec: CheckSpec, device: torch.device):
    """The autocast region of the eager and compiled runs (not of the fp32 reference)."""
    return torch.autocast(device.type, dtype=DTYPES[spec.dtype]) if spec.autocast else contextlib.nullcontext()


def _eager_runs(spec: CheckSpec, stages: Stages, model, inputs: dict, device: torch.device):
    """``(reference, eager)``: the fp32 reference run (half precision only, else None) and the eager run.

    The fp32 reference runs first: its fp32 copy of the model is freed before the eager run, so the peak holds
    one fp32 model, not an fp32 model beside the eager run's gradients (:func:`.memory.memory_plan`).

    Raises:
        ValueError: the yardstick run (the reference, else eager) has a non-finite loss or logits.
    """
    steps = (inputs["input_ids"], spec.train, inputs["attention_mask"], inputs["labels"])
    reference = None
    losses: list = []  # the yardstick's loss (train): a NaN or inf one leaves nothing to compare against
    if spec.half:
        stages.begin("fp32 reference run of the same weights (the yardstick for half-precision parity)")
        reference = fp32_reference(model, *steps, losses=losses)
        stages.end()
        refuse_non_finite(reference, losses, "fp32 reference")
    stages.begin(f"eager {'forward + backward' if spec.train else 'forward'}")
    with _amp(spec, device):
        eager = run_model(model, model, *steps, losses=losses)
    stages.end()
    if not spec.half:
        refuse_non_finite(eager, losses, "eager")
    return reference, eager


def _compiled_runs(spec: CheckSpec, stages: Stages, model, inputs: dict, device: torch.device, fusions, status):
    """Compile with ``qwen_npu`` and run twice (the first run compiles, the second is the steady-state timing).

    Returns:
        ``(compiled_run, (first_seconds, steady_seconds), reports)``: the second run's ``(logits, grads)`` and the
        graph reports of this compile.
    """
    from qwen_npu_compile.report import get_reports

    first_report = len(get_reports())
    if spec.dynamic:
        for tensor in {id(t): t for t in inputs.values() if t is not None}.values():
            torch._dynamo.mark_dynamic(tensor, 1)
    torch._dynamo.reset()
    # torch's own torch.compile, also where MindSpeed replaced it (a no-op there)
    compiled = torch_compile(model, backend="qwen_npu", options=spec.backend_options(),
                             dynamic=None if spec.dynamic else False)
    seconds = []
    for what in (f"compiling with backend='qwen_npu' ({status.kind} npu ops"
                 f"{', dynamic sequence length' if spec.dynamic else ''}) and running it once", "compiled run again (timing)"):
        stages.begin(what)
        compiled_run = None  # the first run's logits and gradients go before the second run makes its own
        start = time.perf_counter()
        # the DeltaNet substitution is read while Dynamo traces, before the backend sees the options: set from them
        with _amp(spec, device), deltanet.switched("gated_delta_rule" in fusions):
            compiled_run = run_model(model, compiled, inputs["input_ids"], spec.train, inputs["attention_mask"],
                                     inputs["labels"])
        seconds.append(time.perf_counter() - start)
        stages.end()
    return compiled_run, tuple(seconds), get_reports()[first_report:]


def _backward_ops(reports) -> dict[str, int]:
    """Op counts of the AOT backward graphs, summed over ``reports``; this project's ops keyed ``qwen_npu.<op>``."""
    counts: dict[str, int] = {}
    for report in reports:
        for op, count in report.aot_ops.get("backward", {}).items():
            counts[op] = counts.get(op, 0) + count
        for op, count in report.aot_qwen_npu_ops.get("backward", {}).items():
            counts[f"qwen_npu.{op}"] = counts.get(f"qwen_npu.{op}", 0) + count
    return counts


def _backward_op_problems(fused: dict[str, int], backward_ops: dict[str, int]) -> list[str]:
    """Where the AOT backward does not hold each fused family's backward ops (``FusionFamily.backward_op_counts``)
    once per fusion, summed per op over the families that bring it."""
    wants: dict[str, int] = {}
    for family, count in fused.items():
        for op, want in patterns.FAMILIES[family].backward_op_counts(count).items():
            wants[op] = wants.get(op, 0) + want
    return [f"AOT backward holds {backward_ops.get(op, 0)} {op}, expected {want}"
            for op, want in wants.items() if backward_ops.get(op, 0) != want]


def _ge_problems(ge: dict, train: bool) -> list[str]:
    """What the off-NPU GE conversion (:func:`ge_results`) got wrong: a missing forward/backward graph, or nodes
    that failed to convert."""
    problems = []
    kinds = [graph["kind"] for graph in ge["graphs"]]
    for kind in ("forward", "backward") if train else ("forward",):
        if kind not in kinds:
            problems.append(f"GE conversion: torchair built no {kind} graph")
    if ge["failures"]:
        problems.append(f"GE conversion: {len(ge['failures'])} node(s) failed to convert")
    return problems


def check_memory(model: str, config, *, layers: int, batch: int, seq_len: int, dtype: torch.dtype, train: bool,
                 autocast: bool = False, device: torch.device | None = None) -> memory.MemoryPlan:
    """Refuse a check that would not fit in memory, before anything is built.

    The estimate is :func:`qwen_npu_compile.cli.check.memory.memory_plan` (every tensor the check creates,
    run by run); the memory is :func:`~qwen_npu_compile.cli.check.memory.available_memory_bytes`
    (``MemAvailable``; 0, unknown, means no check); on an NPU ``device`` the smaller of that and the NPU's free
    memory (:func:`~.device.device_memory_bytes`: the model, its gradients and activations live there).

    Returns:
        The plan.

    Raises:
        MemoryError: the estimate exceeds the available memory; the message names the largest parts and
            what fits instead: fewer ``--layers``, ``--mode infer``, or smaller presets.
    """
    half = dtype != torch.float32

    def plan(cfg, n_layers: int, mode_train: bool) -> memory.MemoryPlan:
        return memory.memory_plan(cfg, layers=n_layers, batch=batch, seq_len=seq_len, dtype=dtype, train=mode_train,
                                  reference=half, autocast=autocast)

    wanted = plan(config, layers, train)
    have = memory.available_memory_bytes()
    on_device = device_memory_bytes(device) if device is not None else 0
    if on_device:
        have = min(have, on_device) if have else on_device
    if not have or wanted.total <= have:
        return wanted
    fits = [n for n in range(layers - 1, 0, -1) if plan(config, n, train).total <= have]
    options = []
    if fits:
        options.append(f"--layers {fits[0]}")
    if train and plan(config, layers, False).total <= have:
        options.append("--mode infer")
    if not fits:
        smaller = []
        for name in models.preset_names():
            other = models.resolve_model_config(name)
            if memory.estimate_num_parameters(other, layers=1) < memory.estimate_num_parameters(config, layers=1) \
                    and plan(other, 1, train).total <= have:
                smaller.append(name)
        if smaller:
            options.append(f"--layers 1 with a smaller preset ({', '.join(smaller)})")
    hint = f"try {' or '.join(options)}" if options else "nothing this check builds fits; use a host with more memory"
    raise MemoryError(
        f"estimated {wanted.total / 2**30:.1f} GiB needed for {layers} layer(s) of {model} ({wanted.describe()}), "
        f"{have / 2**30:.1f} GiB available; {hint} (or a smaller --batch/--seq-len)"
    )


def run_versions(status) -> dict:
    """Where the check ran: python, torch, transformers, torch_npu (real version, or None when the npu ops
    are simulated), ``npu_ops`` (``"real"``/``"simulated"``), ``torchair`` (``"<torch_npu version>
    (off-NPU, from the wheel)"``, ``"<version> (installed)"`` or None) and qwen_npu_compile."""
    from qwen_npu_compile.report import versions
    from qwen_npu_compile.torchair.offline import loaded_offline_torchair

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
