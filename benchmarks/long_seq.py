"""Long sequences on the CPU: the cost of the ``npu_fusion_attention`` stand-ins at S = 2048 and beyond.

Two measurements, written to ``benchmarks/results/long_seq.json`` with the machine and its load:

* ``layer_pair``: a Qwen3.5-0.8B-width layer pair (one Gated DeltaNet layer, one gated full-attention layer;
  transformers' modeling code, random fp32 weights, vocab 4096) trained one step (forward, loss, backward) at
  ``--seq-len`` (default 2048), eager (sdpa) vs ``torch.compile(backend="qwen_npu")`` with the simulated npu ops
  (downstream aot_eager). Each mode runs in its own process: one warm-up step (the compile), then ``--steps`` timed
  steps; the time is their median, the memory growth the peak resident set size during the timed steps minus the
  resident size before them (sampled every 2 ms). ``--attention dense`` makes the own loop's tiles as large as the
  sequence (one fp32 ``[B, N, S, S]`` tile; the causal flash path is unaffected): the previous stand-in's formula is
  compared in ``attention_op``. RSS growth is noisy on a loaded host (each section records its load): compare
  several runs.
* ``attention_op``: one causal GQA attention call (8 / 2 heads of 256, fp32) forward + backward at ``--seq-len``:
  PyTorch's SDPA, the stand-ins now, and the previous stand-in's dense formula (time, peak RSS growth).
* ``check``: ``qwen-npu-compile check qwen2.5-0.5b --layers 2 --seq-len 4096`` as a user runs it (wall time,
  peak RSS of the process, verdict).

    python -m benchmarks.long_seq                     # all three, ~9 min on 2 cores at load ~8
    python -m benchmarks.long_seq --skip-check        # the layer pair only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import MIB, median, progress, run_metadata, write_json

RESULTS = Path(__file__).parent / "results" / "long_seq.json"
#: The checks run: the command a user runs first (at the full vocab of 151,936 its logits alone need ~10 GiB: the memory
#: estimate may refuse it, exit status 2, recorded as such), then the same with a 4096-row vocab (no fused op sees
#: the vocab dimension; ``check --vocab-size``).
CHECK_COMMANDS = (["check", "qwen2.5-0.5b", "--layers", "2", "--seq-len", "4096"],
                  ["check", "qwen2.5-0.5b", "--layers", "2", "--seq-len", "4096", "--vocab-size", "4096"])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The peak resident set size while the block runs, sampled every 2 ms by a thread (torch ops release the GIL)."""

    def __enter__(self):
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def timed(call, steps: int) -> tuple[list[float], PeakRss]:
    """``steps`` calls of ``call``: the seconds of each, and the :class:`PeakRss` of them all."""
    times = []
    with PeakRss() as rss:
        for _ in range(steps):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return times, rss


def layer_pair_config(vocab_size: int = 4096, layer_types=("linear_attention", "full_attention")):
    """Qwen3.5-0.8B's text config (preset ``qwen3.5-0.8b``) cut to two layers of ``layer_types`` (default: one
    linear-attention and one full-attention layer)."""
    import transformers

    from qwen_npu_compile.cli.check.presets import PRESETS

    fields = dict(PRESETS["qwen3.5-0.8b"])
    fields.pop("model_type")
    fields.update(num_hidden_layers=2, layer_types=list(layer_types), vocab_size=vocab_size,
                  use_cache=False)
    return transformers.Qwen3_5TextConfig(**fields)


def one_mode(mode: str, seq_len: int, steps: int, attention: str, layer_types) -> dict:
    """Run in a child process: build, warm up, time ``steps`` steps of ``mode`` (``eager`` or ``compiled``)."""
    import torch
    import transformers

    import qwen_npu_compile
    from qwen_npu_compile.ops.torch_npu import attention_blockwise

    if attention == "dense":
        attention_blockwise.BLOCK_Q = attention_blockwise.BLOCK_K = 1 << 30
    qwen_npu_compile.ensure_npu_ops()
    torch.manual_seed(0)
    config = layer_pair_config(layer_types=layer_types)
    model = transformers.Qwen3_5ForCausalLM._from_config(config, attn_implementation="sdpa").train()
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    run = torch.compile(model, backend="qwen_npu") if mode == "compiled" else model

    def step():
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss)

    t0 = time.perf_counter()
    step()
    warmup = time.perf_counter() - t0
    times, rss = timed(step, steps)
    out = {"package": str(Path(qwen_npu_compile.__file__).parent), "warmup_s": round(warmup, 2),
           "step_s": [round(t, 3) for t in times], "median_step_s": round(median(times), 3),
           "peak_rss_growth_mib": round((rss.peak - rss.start) / MIB, 1)}
    if mode == "compiled":
        fusions: dict[str, int] = {}
        for report in qwen_npu_compile.get_reports():
            for family, n in report.fusions.items():
                fusions[family] = fusions.get(family, 0) + n
        out["fusions"] = fusions
    return out


#: The attention call of the op comparison: Qwen3.5-0.8B's full-attention layer (8 query heads, 2 KV heads, head dim 256).
OP_SHAPE = {"batch": 1, "heads": 8, "kv_heads": 2, "head_dim": 256}


def one_op(kind: str, seq_len: int, steps: int) -> dict:
    """Run in a child process: forward + backward of one causal GQA attention call at ``seq_len`` (fp32), by
    ``sdpa`` (PyTorch, eager's kernel), ``stand_in`` (npu_fusion_attention(_grad) now) or ``dense`` (the previous
    stand-in's formula: fp32 [B, N, S, S] scores and probabilities, recomputed in the grad)."""
    import torch
    import torch.nn.functional as F

    import qwen_npu_compile
    from qwen_npu_compile.ops import attention_contract
    from qwen_npu_compile.ops.attention_contract import _probabilities, probability_grads, weighted_values
    from qwen_npu_compile.ops.torch_npu import fusion_attention as fa

    qwen_npu_compile.ensure_npu_ops()
    b, n, nkv, d = (OP_SHAPE[k] for k in ("batch", "heads", "kv_heads", "head_dim"))
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, h, seq_len, d, generator=gen) for h in (n, nkv, nkv, n))
    scale, mask = d**-0.5, attention_contract.compressed_causal_mask()

    def call():
        if kind == "sdpa":
            leaves = [t.requires_grad_() for t in (q.detach(), k.detach(), v.detach())]
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True, scale=scale)
            torch.autograd.grad(out, leaves, do)
        elif kind == "stand_in":
            torch.ops.npu.npu_fusion_attention(q, k, v, n, "BNSD", atten_mask=mask, sparse_mode=2, scale=scale)
            torch.ops.npu.npu_fusion_attention_grad(q, k, v, do, n, "BNSD", atten_mask=mask, sparse_mode=2,
                                                    scale_value=scale)
        else:
            masked = fa._masked_positions(mask, 2, 2147483647, 2147483647, seq_len, seq_len, q.device)
            p, _, _ = _probabilities(q, k, None, masked, scale, n // nkv)
            weighted_values(p, v, n // nkv)
            p, _, _ = _probabilities(q, k, None, masked, scale, n // nkv)  # the grad recomputed them
            probability_grads(q, k, v, do, p, scale, n // nkv)

    call()
    times, rss = timed(call, steps)
    return {"median_s": round(median(times), 3), "peak_rss_growth_mib": round((rss.peak - rss.start) / MIB, 1)}


def op_comparison(seq_len: int, steps: int) -> dict:
    results = {}
    for kind in ("sdpa", "stand_in", "dense"):
        progress(f"attention op, S={seq_len}, {kind}")
        results[kind] = _child(["--op", kind, "--seq-len", str(seq_len), "--steps", str(steps)])
    return {"seq_len": seq_len, "dtype": "fp32", "mask": "causal (sparse_mode=2 / is_causal)", **OP_SHAPE, **results}


def _child(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.long_seq", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent.parent, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def layer_pair(seq_len: int, steps: int, attention: str, layer_types) -> dict:
    results = {}
    for mode in ("eager", "compiled"):
        progress(f"layer pair, S={seq_len}, {mode} ({attention} attention stand-in)")
        cmd = [sys.executable, "-m", "benchmarks.long_seq", "--child", mode, "--seq-len", str(seq_len),
               "--steps", str(steps), "--attention", attention, "--layer-types", *layer_types]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent.parent, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    eager, compiled = results["eager"], results["compiled"]
    results["time_ratio_compiled_over_eager"] = round(compiled["median_step_s"] / eager["median_step_s"], 2)
    results["memory_growth_ratio_compiled_over_eager"] = round(
        compiled["peak_rss_growth_mib"] / max(eager["peak_rss_growth_mib"], 1e-9), 2)
    return {"seq_len": seq_len, "batch": 1, "dtype": "fp32", "steps": steps, "attention_stand_in": attention,
            "model": f"Qwen3.5-0.8B width, layer_types {list(layer_types)}, vocab 4096", **results}


def check_run(command: list[str]) -> dict:
    """``python -m qwen_npu_compile`` + ``command`` in a child process under ``/usr/bin/time``: wall time, the
    child's peak RSS (``%M``), exit status, verdict and the last lines of its output."""
    progress("qwen-npu-compile " + " ".join(command))
    t0 = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "peak_rss_kib=%M", sys.executable, "-m", "qwen_npu_compile",
                           *command], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    errors = done.stderr.strip().splitlines()
    peak_kib = int(errors.pop().split("=")[1]) if errors and errors[-1].startswith("peak_rss_kib=") else None
    if errors and errors[-1].startswith("Command exited with non-zero status"):  # /usr/bin/time's own line
        errors.pop()
    verdict = next((line.split()[-1] for line in done.stdout.splitlines() if line.startswith("verdict")), None)
    return {"command": "qwen-npu-compile " + " ".join(command), "exit_status": done.returncode,
            "wall_s": round(wall, 1), "peak_rss_mib": round(peak_kib / 1024) if peak_kib else None,
            "verdict": verdict, "stdout_tail": done.stdout.strip().splitlines()[-4:], "stderr_tail": errors[-1:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--attention", choices=("blockwise", "dense"), default="blockwise")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-layer-pair", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--label", default=None,
                        help="key of this layer-pair run in the results (default S<seq-len>_<attention>)")
    parser.add_argument("--skip-op", action="store_true")
    parser.add_argument("--layer-types", nargs=2, default=["linear_attention", "full_attention"],
                        choices=("linear_attention", "full_attention"), help="the layer pair's two layers")
    parser.add_argument("--child", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    parser.add_argument("--op", choices=("sdpa", "stand_in", "dense"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_mode(args.child, args.seq_len, args.steps, args.attention, args.layer_types)))
        return 0
    if args.op:
        print(json.dumps(one_op(args.op, args.seq_len, args.steps)))
        return 0
    data = json.loads(args.out.read_text()) if args.out.is_file() else {}
    data.pop("metadata", None)  # each section records its own run (machine, load at its start and end)

    def measured(run):
        meta = run_metadata()
        section = run()
        meta["load_average_at_end"] = list(os.getloadavg())
        return {"metadata": meta, **section} if isinstance(section, dict) else {"metadata": meta, "runs": section}

    if not args.skip_check:
        data["check"] = measured(lambda: [check_run(command) for command in CHECK_COMMANDS])
    if not args.skip_op:
        data.setdefault("attention_op", {})[f"S{args.seq_len}"] = measured(lambda: op_comparison(args.seq_len, args.steps))
    if not args.skip_layer_pair:
        key = args.label or f"S{args.seq_len}_{args.attention}"
        data.setdefault("layer_pair", {})[key] = measured(
            lambda: layer_pair(args.seq_len, args.steps, args.attention, args.layer_types))
    write_json(args.out, data)
    progress(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
