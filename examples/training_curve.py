#!/usr/bin/env python
"""Training curves, eager against ``qwen_npu``, on verl-style packed micro-batches: the losses per step as a picture.

Two tiny random-weight models of transformers' real modeling code are trained from the same initial weights on the
same data, once eagerly and once compiled the way verl's FSDP worker compiles them, and the loss of every step is
written to a JSON file and plotted (one panel per model):

- **Qwen2** (``Qwen2ForCausalLM``, 2 layers, hidden 64, vocab 128: ``qwen_npu_compile.cli.check.models.tiny_qwen2``);
- **Qwen3.5** (``Qwen3_5ForCausalLM``, 4 layers: 3 Gated DeltaNet + 1 full attention, hidden 128, vocab 256).

The data is verl's ``use_remove_padding`` layout: each micro-batch is one packed row, ``input_ids [1, T]`` (int64)
holding 2 to 4 sequences of random lengths, ``position_ids [1, T]`` restarting at 0 per sequence, no attention mask.
Every sequence is an arithmetic progression modulo the vocabulary (random start and stride), so next-token
prediction is learnable and the loss visibly falls. The loss is what verl's actor computes from its log-probs: the
mean over the micro-batch's tokens of ``-log p(next token)`` (log-softmax of fp32 logits; the last token of each
sequence predicts nothing), accumulated over ``--micro-batches`` rows with weight ``1 / micro-batches``, then one
AdamW step. Each step draws new rows (as new rollouts would), identical for both runs.

**Compiled run: per decoder layer, as verl does.** ``qwen_npu_compile.maybe_compile(model,
environ={"QWEN_NPU_COMPILE": "1"})`` is what ``QWEN_NPU_COMPILE=1`` makes verl's worker call: every decoder layer is
compiled in place, the packed row's sequence ends are proven from ``position_ids`` once per forward (varlen
attention, and each sequence alone through the Gated DeltaNet); the embedding, the final norm, the LM head and the
loss stay eager. A whole-model ``torch.compile(model, backend="qwen_npu")`` would fuse the same families, but it is
not what a verl job runs.

**Eager run: the same semantics.** Qwen2's eager run takes the packed row as is (transformers builds the
block-diagonal mask from ``position_ids``). Qwen3.5's does not: eager transformers runs a row packed only by
``position_ids`` through the Gated DeltaNet as one sequence (the state and the causal conv flow across sequence
boundaries; docs/hybrid-models.md, "Packed rows: each sequence as if alone"), while the compiled layers run each
sequence as if alone, which is FLA's semantics and what verl means. So Qwen3.5's eager run gives every sequence its
own forward (``position_ids`` 0..n-1) and sums the same per-token losses: the honest yardstick. The curves then
differ only by rounding (fp32) or by bf16's different rounding orders (``--dtype bf16``).

``--reference`` trains a third copy eagerly one precision up (fp64 for an fp32 run, fp32 for bf16) from the same
initial weights, and plots each run's |loss difference| to it: AdamW's per-element normalised updates amplify
rounding-level gradient differences over the steps, and the reference shows whether qwen_npu's curve strays from
the rounding-free one further than eager's does (docs/performance.md, "Training curves: eager against qwen_npu").

    python examples/training_curve.py                    # 30 steps, fp32, both models, JSON + PNG
    python examples/training_curve.py --reference        # the committed figure: + an fp64 eager run per model
    python examples/training_curve.py --reference --dtype bf16 --out-json examples/results/training_curve_bf16.json \\
        --out-png docs/figures/training_curve_bf16.png
    python examples/training_curve.py --quick --out-json out/c.json --out-png out/c.png   # 4 steps, for tests

Prints the fusions of every compiled graph (``qwen_npu_compile`` graph reports: families fused in the forward and
the fused backward ops of its AOT graph), one line per step, and the largest |loss difference| per model. Without
an NPU the npu ops are the simulated CPU stand-ins (``qwen_npu_compile.ensure_npu_ops``). The PNG needs matplotlib
(``pip install matplotlib``, not a dependency of the package); ``--out-png ''`` skips it. Exit status 0 when both
runs of every model finished with finite losses.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSON = REPO / "examples" / "results" / "training_curve.json"
DEFAULT_PNG = REPO / "docs" / "figures" / "training_curve.png"

#: A tiny Qwen3.5 text model: 3 Gated DeltaNet layers and 1 full-attention layer (transformers' default
#: ``layer_types`` for 4 layers), 4 query / 2 KV heads of 64 with the output gate and partial rotary, DeltaNet
#: 2 key / 4 value heads of 32, conv kernel 4. The widths of the project's tests (tests/helpers/models.py).
TINY_QWEN3_5 = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=256, use_cache=False,
)  # fmt: skip

MODELS = ("qwen2", "qwen3_5")
LABELS = {"qwen2": "Qwen2 (2 layers)", "qwen3_5": "Qwen3.5 (3 DeltaNet + 1 attention layers)"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--micro-batches", type=int, default=2,
                        help="packed rows per step, gradients accumulated (default 2)")
    parser.add_argument("--seqs", default="2,4", help="sequences per packed row, min,max (default 2,4)")
    parser.add_argument("--lengths", default="8,72",
                        help="tokens per sequence, min,max (default 8,72: crosses the DeltaNet's 64-token chunk)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="parameters, activations and AdamW state (default fp32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data (default 0)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--out-json", type=Path, default=DEFAULT_JSON,
                        help=f"losses, fusions, timings (default {DEFAULT_JSON.relative_to(REPO)})")
    parser.add_argument("--out-png", default=str(DEFAULT_PNG),
                        help=f"the plot (default {DEFAULT_PNG.relative_to(REPO)}; '' for none)")
    parser.add_argument("--reference", action="store_true",
                        help="also train an eager copy one precision up (fp64 for fp32, fp32 for bf16) from the same "
                             "initial weights: how far each run is from the rounding-free curve (adds an eager run)")
    parser.add_argument("--quick", action="store_true",
                        help="4 steps of 1 micro-batch of 2-3 sequences of 8-40 tokens (tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.micro_batches, args.seqs, args.lengths = 4, 1, "2,3", "8,40"
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    args.seqs = tuple(int(v) for v in args.seqs.split(","))
    args.lengths = tuple(int(v) for v in args.lengths.split(","))
    return args


# --------------------------------------------------------------------------------------------------
# data


def make_batches(steps: int, micro_batches: int, seqs: tuple[int, int], lengths: tuple[int, int], vocab: int,
                 seed: int) -> list[list[list[list[int]]]]:
    """The sequences of every step: ``[step][micro-batch][sequence] -> token ids`` (Python ints in
    ``[0, vocab)``). Each sequence is ``(start + stride * i) % vocab``, ``stride`` in 1..7, ``i < length``."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        rows = []
        for _ in range(micro_batches):
            row = []
            for _ in range(rng.randint(*seqs)):
                start, stride, n = rng.randrange(vocab), rng.randint(1, 7), rng.randint(*lengths)
                row.append([(start + stride * i) % vocab for i in range(n)])
            rows.append(row)
        out.append(rows)
    return out


def packed_row(sequences: list[list[int]]):
    """verl's ``use_remove_padding`` micro-batch: ``input_ids [1, T]`` and ``position_ids [1, T]`` (int64,
    restarting at 0 per sequence), ``labels [1, T]`` (the next token of the same sequence, -100 at each sequence's
    last token)."""
    import torch

    ids = torch.tensor([t for seq in sequences for t in seq]).unsqueeze(0)
    positions = torch.cat([torch.arange(len(seq)) for seq in sequences]).unsqueeze(0)
    labels = torch.tensor([t for seq in sequences for t in [*seq[1:], -100]]).unsqueeze(0)
    return ids, positions, labels


def token_nll_sum(model, ids, positions, labels):
    """Sum over the row of ``-log p(label)`` (log-softmax of the logits in fp32, or fp64 for an fp64 model; labels
    -100 skipped), a 0-dim tensor of that dtype, and the number of tokens it sums."""
    import torch

    logits = model(input_ids=ids, position_ids=positions).logits  # [1, T, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = labels != -100
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(logp * valid).sum(), int(valid.sum())


def micro_batch_loss(model, sequences: list[list[int]], each_alone: bool):
    """Mean token NLL of one packed micro-batch (0-dim fp32 or fp64, with grad). ``each_alone``: one forward per
    sequence (position ids 0..n-1) instead of one over the packed row; the same tokens, the same mean."""
    if not each_alone:
        total, count = token_nll_sum(model, *packed_row(sequences))
        return total / count
    parts = [token_nll_sum(model, *packed_row([seq])) for seq in sequences]
    return sum(p[0] for p in parts) / sum(p[1] for p in parts)


# --------------------------------------------------------------------------------------------------
# models and training


def build_model(name: str, dtype, seed: int):
    """A random-weight tiny model (``torch.manual_seed(seed)``, transformers' initialisation), sdpa, in ``dtype``,
    in train mode."""
    import torch
    import transformers

    from qwen_npu_compile.cli.check.models import tiny_qwen2_config

    torch.manual_seed(seed)
    if name == "qwen2":
        config = tiny_qwen2_config(use_cache=False)
        model = transformers.Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")
    else:
        if not hasattr(transformers, "Qwen3_5ForCausalLM"):
            raise SystemExit(f"transformers {transformers.__version__} has no Qwen3_5ForCausalLM (needs >= 5); "
                             "run with --models qwen2")
        config = transformers.Qwen3_5TextConfig(**TINY_QWEN3_5)
        model = transformers.Qwen3_5ForCausalLM._from_config(config, attn_implementation="sdpa")
    return model.to(dtype).train()


def train(model, batches, lr: float, each_alone: bool, label: str) -> tuple[list[float], float]:
    """AdamW over ``batches`` (:func:`make_batches`); returns the loss of every step (the mean of its micro-batch
    losses, before the step's update) and the wall time in seconds (compiles included)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    start = time.perf_counter()
    for step, rows in enumerate(batches):
        total = 0.0
        for sequences in rows:
            loss = micro_batch_loss(model, sequences, each_alone) / len(rows)
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        print(f"  {label} step {step + 1:3d}/{len(batches)}: loss {total:.6f}", flush=True)
    return losses, time.perf_counter() - start


def graph_summary(compiled) -> list[dict]:
    """The distinct ``qwen_npu`` graphs the compiled layers ran: name, layer classes and layer count, families
    fused (forward), the npu / qwen_npu ops of its AOT backward graph, refusals."""
    graphs: dict[str, dict] = {}
    for name, record in compiled.records.items():
        for report in record.reports:
            entry = graphs.setdefault(report.name, {
                "graph": report.name, "layer_class": record.class_name, "layers": [],
                "fusions": {k: v for k, v in report.fusions.items() if v},
                "backward_ops": {**report.aot_ops.get("backward", {}),
                                 **report.aot_qwen_npu_ops.get("backward", {})},
                "refused": len(report.refused), "fallback": report.fallback, "downstream": report.downstream,
            })
            entry["layers"].append(name)
    return list(graphs.values())


def run_model(name: str, args, dtype) -> dict:
    """Both runs of one model: eager and per-layer ``qwen_npu``, from one set of initial weights."""
    import torch

    import qwen_npu_compile

    eager = build_model(name, dtype, args.seed)
    ours = copy.deepcopy(eager)  # the same initial weights, bit for bit
    # the reference starts from the same (already rounded) weights, one precision up
    higher = torch.float64 if dtype == torch.float32 else torch.float32
    reference = copy.deepcopy(eager).to(higher) if args.reference else None
    batches = make_batches(args.steps, args.micro_batches, args.seqs, args.lengths, eager.config.vocab_size,
                           args.seed + 1)
    each_alone = name == "qwen3_5"  # see the module docstring: the eager DeltaNet would merge packed sequences
    compiled = qwen_npu_compile.maybe_compile(ours, environ={"QWEN_NPU_COMPILE": "1"})

    print(f"{LABELS[name]}: eager ({'each sequence its own forward' if each_alone else 'packed rows'})", flush=True)
    eager_losses, eager_s = train(eager, batches, args.lr, each_alone, "eager   ")
    print(f"{LABELS[name]}: qwen_npu (maybe_compile, packed rows)", flush=True)
    ours_losses, ours_s = train(ours, batches, args.lr, False, "qwen_npu")
    extra = {}
    if reference is not None:
        ref_name = str(higher).removeprefix("torch.")
        print(f"{LABELS[name]}: eager {ref_name} reference", flush=True)
        ref_losses, ref_s = train(reference, batches, args.lr, each_alone, f"{ref_name} ")
        extra = {"reference": {
            "dtype": ref_name, "losses": ref_losses, "seconds": round(ref_s, 2),
            "eager_abs_delta": [abs(a - r) for a, r in zip(eager_losses, ref_losses)],
            "qwen_npu_abs_delta": [abs(a - r) for a, r in zip(ours_losses, ref_losses)],
        }}
        extra["reference"]["eager_max_abs_delta"] = max(extra["reference"]["eager_abs_delta"])
        extra["reference"]["qwen_npu_max_abs_delta"] = max(extra["reference"]["qwen_npu_abs_delta"])

    deltas = [abs(a - b) for a, b in zip(eager_losses, ours_losses)]
    rel = [d / abs(a) for d, a in zip(deltas, eager_losses)]
    graphs = graph_summary(compiled)
    eager_layers = compiled.not_compiled()
    return {
        "model": LABELS[name],
        "class": type(eager).__name__,
        "parameters": sum(p.numel() for p in eager.parameters()),
        "eager_layout": "each sequence its own forward" if each_alone else "packed rows",
        "compiled_layout": "packed rows, maybe_compile per decoder layer",
        "tokens_per_step": [sum(len(s) for row in rows for s in row) for rows in batches],
        "sequences_per_step": [sum(len(row) for row in rows) for rows in batches],
        "eager": eager_losses,
        "qwen_npu": ours_losses,
        "abs_delta": deltas,
        "max_abs_delta": max(deltas),
        "max_rel_delta": max(rel),
        "seconds": {"eager": round(eager_s, 2), "qwen_npu": round(ours_s, 2)},
        "compiled_layers": len(compiled),
        "layers_without_graph": eager_layers,
        "graphs": graphs,
        **extra,
    }


# --------------------------------------------------------------------------------------------------
# the plot


def plot(result: dict, path: Path) -> None:
    """One column per model: the losses per step of both runs (top) and their |difference| (bottom, log scale)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install matplotlib (or pass --out-png '')") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(6.2 * len(models), 6.4), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.3]}, sharex="col")
    meta = result["meta"]
    for col, (name, data) in enumerate(models.items()):
        steps = list(range(1, len(data["eager"]) + 1))
        top, bottom = axes[0][col], axes[1][col]
        top.plot(steps, data["eager"], "o-", color="tab:blue", ms=4, lw=2.2,
                 label=f"eager transformers ({data['eager_layout']})")
        top.plot(steps, data["qwen_npu"], "x--", color="tab:orange", ms=5, lw=1.4,
                 label="qwen_npu, maybe_compile (packed rows)")
        top.set_title(f"{data['model']}, {meta['dtype']}\nmax |Δloss| = {data['max_abs_delta']:.2e} "
                      f"(relative {data['max_rel_delta']:.1e})", fontsize=10)
        top.set_ylabel("loss (mean token NLL)")
        top.grid(alpha=0.3)
        top.legend(fontsize=8)
        fused = sorted({f"{k} {v}" for g in data["graphs"] for k, v in g["fusions"].items()})
        top.text(0.02, 0.03, f"{len(data['graphs'])} compiled graph(s), fused per graph: " + ", ".join(fused),
                 transform=top.transAxes, fontsize=7, color="0.3", wrap=True)
        ref = data.get("reference")
        series = [("|eager − qwen_npu|", data["abs_delta"], "tab:red", ".-")]
        if ref:
            series += [(f"|eager − {ref['dtype']} eager|", ref["eager_abs_delta"], "tab:blue", "o:"),
                       (f"|qwen_npu − {ref['dtype']} eager|", ref["qwen_npu_abs_delta"], "tab:orange", "x:")]
        floor = min([d for _, values, _, _ in series for d in values if d > 0], default=1e-12) / 10
        for label, values, color, style in series:  # a zero difference drawn at the floor: log axes have no 0
            bottom.semilogy(steps, [max(d, floor) for d in values], style, color=color, lw=1, ms=3,
                            label=f"{label} (max {max(values):.1e})")
        bottom.legend(fontsize=7)
        bottom.set_ylabel("|Δloss| (0 at the floor)")
        bottom.set_xlabel("step")
        bottom.grid(alpha=0.3, which="both")
    fig.suptitle(f"Packed micro-batches (verl use_remove_padding), {meta['steps']} AdamW steps × "
                 f"{meta['micro_batches']} rows, npu ops {meta['npu_ops']}; torch {meta['torch']}, "
                 f"transformers {meta['transformers']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out_png:  # fail before minutes of training, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("the plot needs matplotlib: pip install matplotlib (or pass --out-png '')") from None
    start = time.perf_counter()
    import torch
    import transformers

    import qwen_npu_compile

    status = qwen_npu_compile.ensure_npu_ops()  # torch_npu's ops on an NPU, the simulated stand-ins elsewhere
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    result = {
        "meta": {
            "command": "python examples/training_curve.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "steps": args.steps, "micro_batches": args.micro_batches, "sequences_per_row": list(args.seqs),
            "tokens_per_sequence": list(args.lengths), "dtype": args.dtype, "lr": args.lr, "seed": args.seed,
            "loss": "mean token NLL per packed row, averaged over the step's micro-batches",
            "npu_ops": "simulated" if status.simulated else "torch_npu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu_threads": torch.get_num_threads(),
        },
        "models": {},
    }
    for name in args.models:
        result["models"][name] = run_model(name, args, dtype)
    result["meta"]["seconds"] = round(time.perf_counter() - start, 1)

    print("compiled graphs (qwen_npu reports):")
    for name, data in result["models"].items():
        for graph in data["graphs"]:
            fused = ", ".join(f"{k} {v}" for k, v in graph["fusions"].items()) or "nothing"
            backward = ", ".join(f"{k} {v}" for k, v in sorted(graph["backward_ops"].items())) or "none"
            print(f"  {name} {graph['graph']} ({graph['layer_class']} x{len(graph['layers'])}): fused {fused}; "
                  f"backward ops {backward}; refused {graph['refused']}; downstream {graph['downstream']}")
        if data["layers_without_graph"]:
            print(f"  {name}: layers that ran without a qwen_npu graph: {data['layers_without_graph']}")
    for name, data in result["models"].items():
        print(f"{name}: {len(data['eager'])} steps, loss {data['eager'][0]:.4f} -> {data['eager'][-1]:.4f} (eager), "
              f"{data['qwen_npu'][0]:.4f} -> {data['qwen_npu'][-1]:.4f} (qwen_npu); max |Δloss| "
              f"{data['max_abs_delta']:.3e} (relative {data['max_rel_delta']:.3e}); "
              f"{data['seconds']['eager']:.1f} s eager, {data['seconds']['qwen_npu']:.1f} s qwen_npu")
        if "reference" in data:
            ref = data["reference"]
            print(f"{name}: against the eager {ref['dtype']} reference, max |Δloss| {ref['eager_max_abs_delta']:.3e} "
                  f"(eager), {ref['qwen_npu_max_abs_delta']:.3e} (qwen_npu)")

    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out_json}")
    if args.out_png:
        plot(result, Path(args.out_png))
        print(f"wrote {args.out_png}")
    print(f"total {result['meta']['seconds']:.1f} s")
    finite = all(math.isfinite(v) for d in result["models"].values() for v in [*d["eager"], *d["qwen_npu"]])
    ok = finite and all(d["graphs"] and not d["layers_without_graph"] for d in result["models"].values())
    print("OK" if ok else "FAILED: a loss is not finite or a layer ran without a qwen_npu graph")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
