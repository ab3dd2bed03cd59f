"""What our canonicalize + fuse stages cost, against Dynamo capture and AOTAutograd: wall seconds on this host and
their ratios.

For tiny-width Qwen2 models (hidden 64, 4 heads, 2 KV heads, bf16, B=2, S=32, training: forward, LM
loss and backward) with 2, 8 and 24 layers, every sample is one ``torch.compile`` (after
``torch._dynamo.reset()``) whose instrumented backend times, on the same captured graph:

* ``capture_s``: from the call until Dynamo hands its graph to the backend (Dynamo capture);
* ``canonicalize_s`` and ``fuse_s`` (``ours_s`` = their sum): :func:`qwen_npu_compile.backend.rewrite`,
  the function the ``qwen_npu`` backend runs (retrace to the pre-autograd ATen graph, every family's
  pass), as recorded in :attr:`qwen_npu_compile.report.GraphReport.seconds`;
* ``aot_s``: AOTAutograd of the captured graph with no codegen (``aot_eager``; backward compiled
  eagerly, so it is inside the timing). Its result is what runs: the baseline pipeline.

Our stages run first, straight after capture, as in the real backend; AOTAutograd then runs second and
may profit from caches our retrace warmed (FakeTensor dispatch caches are process-wide), which can only
make the baseline look cheaper and our ratio worse. One Dynamo capture per sample (instead of a
compile per backend) halves the cost of this part, so that ``make bench`` stays within its budget.

Pattern registration is done once before timing (it is once per process; :mod:`benchmarks.registration`
measures it), and one untimed warm-up compile absorbs first-use imports. Samples are interleaved
(repeat -> layers); medians over the repeats; ratios are taken per sample, then the median. Absolute
seconds are noisy on a shared host: quote the same-run ratios. Dynamo/AOT caches may warm up across
runs (same code objects, same shapes): later repeats can be faster.
"""

from __future__ import annotations

import time

import torch
import transformers

from qwen_npu_compile import ensure_npu_ops
from qwen_npu_compile.cli.check.models import tiny_qwen2_config
from qwen_npu_compile.config import ALL_FAMILIES

from .common import linear_fit, median, progress

#: The timed steps of one sample (seconds), in pipeline order.
STEPS = ("capture_s", "canonicalize_s", "fuse_s", "aot_s")


def tiny_config(layers: int, hidden: int = 64) -> transformers.Qwen2Config:
    """A tiny-width Qwen2 config (4 heads, 2 KV heads: GQA) with ``layers`` decoder layers, no KV cache."""
    return tiny_qwen2_config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers)


def tiny_model(layers: int, hidden: int = 64) -> transformers.Qwen2ForCausalLM:
    """A random-weight bf16 :class:`transformers.Qwen2ForCausalLM` in training mode."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM._from_config(tiny_config(layers, hidden), attn_implementation="sdpa")
    return model.to(torch.bfloat16).train()


def training_step(model, compiled, input_ids) -> None:
    """One forward + LM loss + backward of ``compiled`` (gradients of ``model`` reset first)."""
    model.zero_grad(set_to_none=True)
    out = compiled(input_ids=input_ids, labels=input_ids)
    out.loss.backward()


def time_sample(model, input_ids) -> dict:
    """Compile ``model`` once and time capture, our canonicalize and fuse stages, and AOTAutograd.

    Args:
        model: the model (its parameters are reused; gradients are reset).
        input_ids: ``[B, S]`` token ids.

    Returns:
        ``{"capture_s", "canonicalize_s", "fuse_s", "ours_s", "aot_s", "first_step_s", "graphs",
        "fusions"}``; seconds (``first_step_s``: the whole first training step, ours included).
    """
    from torch._dynamo.backends.debugging import aot_eager
    from torch._functorch import config as functorch_config

    from qwen_npu_compile import backend as qwen_backend
    from qwen_npu_compile.config import QwenNpuConfig

    status = ensure_npu_ops()
    config = QwenNpuConfig.from_options({"fusions": "all", "downstream": "aot_eager"})
    sample = {"canonicalize_s": 0.0, "fuse_s": 0.0, "aot_s": 0.0, "graphs": 0, "fusions": {}}
    clock = {}

    def backend(gm, example_inputs):
        sample.setdefault("capture_s", time.perf_counter() - clock["start"])
        report, _ = qwen_backend.rewrite(gm, example_inputs, config, status, "aot_eager")
        sample["canonicalize_s"] += report.seconds["canonicalize"]
        sample["fuse_s"] += report.seconds["fuse"]
        for family, count in report.fusions.items():
            sample["fusions"][family] = sample["fusions"].get(family, 0) + count
        start = time.perf_counter()
        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            compiled = aot_eager(gm, example_inputs)
        sample["aot_s"] += time.perf_counter() - start
        sample["graphs"] += 1
        return compiled

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    clock["start"] = time.perf_counter()
    training_step(model, compiled, input_ids)
    sample["first_step_s"] = time.perf_counter() - clock["start"]
    sample["ours_s"] = sample["canonicalize_s"] + sample["fuse_s"]
    torch._dynamo.reset()
    return sample


def run(quick: bool = False) -> dict:
    """The compile cost for 2, 8 and 24 layers, 3 repeats (``quick``: 1 and 2 layers, 1 repeat, no warm-up).

    Returns:
        The ``compile_cost.json`` payload: raw samples, medians, ratios and growth fits.
    """
    from qwen_npu_compile.patterns import get_family_pass

    ensure_npu_ops()
    layer_counts = (1, 2) if quick else (2, 8, 24)
    repeats = 1 if quick else 3
    batch, seq = 2, 32
    input_ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(0))

    for family in ALL_FAMILIES:  # registration is once per process: keep it out of these timings
        get_family_pass(family).ensure_registered()
    if not quick:
        progress("compile: warm-up (one untimed compile) ...")
        time_sample(tiny_model(1), input_ids)

    models = {layers: tiny_model(layers) for layers in layer_counts}
    samples: dict[str, list[dict]] = {str(layers): [] for layers in layer_counts}
    for repeat in range(repeats):
        for layers in layer_counts:
            sample = time_sample(models[layers], input_ids)
            samples[str(layers)].append(sample)
            progress(
                f"compile: repeat {repeat + 1}/{repeats}, {layers} layers: capture {sample['capture_s']:.2f}s, "
                f"ours {sample['ours_s']:.2f}s (canonicalize {sample['canonicalize_s']:.2f} + fuse "
                f"{sample['fuse_s']:.2f}), AOT {sample['aot_s']:.2f}s"
            )

    medians: dict[str, dict[str, float]] = {}
    for layers in layer_counts:
        s = samples[str(layers)]
        m = {key: median([x[key] for x in s]) for key in (*STEPS, "ours_s", "first_step_s")}
        m["capture_aot_s"] = median([x["capture_s"] + x["aot_s"] for x in s])
        # ratios per sample (same capture, same conditions), then the median
        m["ratio_ours_to_capture_aot"] = median([x["ours_s"] / (x["capture_s"] + x["aot_s"]) for x in s])
        m["ratio_ours_to_capture"] = median([x["ours_s"] / x["capture_s"] for x in s])
        m["ratio_ours_to_aot"] = median([x["ours_s"] / x["aot_s"] for x in s])
        medians[str(layers)] = m

    xs = list(layer_counts)
    growth = {}
    for key in ("capture_s", "aot_s", "capture_aot_s", "canonicalize_s", "fuse_s", "ours_s"):
        ys = [medians[str(layers)][key] for layers in layer_counts]
        fit = linear_fit(xs, ys)
        growth[key] = {
            "seconds_per_layer": fit["slope"],
            "intercept_s": fit["intercept"],
            "ratio_last_to_first": ys[-1] / ys[0] if ys[0] else None,
        }
    return {
        "setup": {
            "model": "Qwen2ForCausalLM, hidden 64, intermediate 128, 4 heads, 2 KV heads, vocab 128, bf16, sdpa",
            "batch": batch,
            "seq_len": seq,
            "mode": "training: forward + LM loss + backward; the first call compiles",
            "layers": xs,
            "repeats": repeats,
            "statistic": "median over repeats; ratios per sample, then the median",
            "steps": {
                "capture_s": "call until Dynamo hands its graph to the backend",
                "canonicalize_s": "qwen_npu_compile.backend.rewrite: retrace to the pre-autograd ATen graph",
                "fuse_s": "qwen_npu_compile.backend.rewrite: every family's pattern pass (registration excluded)",
                "aot_s": "AOTAutograd (aot_eager, no codegen) of the captured graph, backward compiled eagerly",
                "capture_aot_s": "capture_s + aot_s: the baseline compile",
                "first_step_s": "the whole first training step (capture + ours + AOT + running it)",
            },
            "growth": "least-squares slope (seconds per layer) over the layer counts, and last/first ratio",
            "notes": [
                "one Dynamo capture per sample; ours runs first (as in the backend), AOTAutograd second",
                "pattern registration is done before timing (once per process; see registration_cost.json)",
                "QUICK RUN: no warm-up and 1 repeat, so first-use costs land in the first sample; do not quote"
                if quick
                else "one untimed warm-up compile absorbs first-use imports",
                "Dynamo/AOT caches may warm up across runs (same code, same shapes): later repeats can be faster",
                "absolute seconds are noisy on a shared CPU; quote the same-run ratios",
            ],
        },
        "samples": samples,
        "medians": medians,
        "growth": growth,
    }
