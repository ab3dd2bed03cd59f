"""Render the benchmark JSON files as ``summary.md`` (markdown tables)."""

from __future__ import annotations

from .common import MIB

_LABELS = {
    "eager": "eager (no fusion)",
    "verl": "verl-style (npu_patch + NPU FA2)",
    "qwen_npu_explicit_mask": "qwen_npu, explicit T×T mask",
    "qwen_npu_varlen": "qwen_npu, varlen",
    "qwen_npu_no_attention": "qwen_npu, no attention",
    "qwen_npu": "qwen_npu",
}


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / MIB:,.1f}"


def _fusions(entry: dict) -> str:
    if entry["families"]:
        return ", ".join(f"{f} {n}" for f, n in entry["fusions_per_layer"].items())
    if entry.get("attention") == "npu_fa2":
        return "patched: rms_norm 2, swiglu 1, rotary 2; attention: NPU FA2"
    return "-"


def _traffic(data: dict) -> list[str]:
    bw = data["bandwidth"]
    lines = [
        "## 1. Kernels and HBM traffic per decoder layer (training: AOT forward + backward)",
        "",
        f"Bandwidth for the time estimates: **{bw['bytes_per_second'] / 1e12:.1f} TB/s** ({bw['label']}; "
        f"{bw['derivation']} Source: {bw['source_url']}).",
        "",
    ]
    peak = data.get("peak")
    if peak:
        lines += [
            f"Roofline peaks: Cube **{peak['cube_bf16_flops_per_second'] / 1e12:.1f} TFLOPS** BF16 ({peak['label']}; "
            f"{peak['derivation']} Source: {peak['source_url']}).",
            "",
        ]
    lines += [
        "Per layer = graph(2 layers) − graph(1 layer). Bytes = non-matmul kernels' inputs + outputs (matmuls "
        "excluded; attention kernels included and also shown apart). ×LB = bytes / fused lower bound. "
        "ms = bytes / bandwidth (traffic floor, no launch overhead, no FLOPs). Roofline = Σ over every kernel, "
        "matmuls and attention included, of max(FLOPs / Cube peak, bytes / bandwidth).",
        "",
    ]
    for model, m in data["models"].items():
        shape = m["shape"]
        lines += [
            f"### {model}: hidden {shape['hidden_size']}, {shape['num_attention_heads']} heads / "
            f"{shape['num_key_value_heads']} KV heads (D={shape['head_dim']}), intermediate "
            f"{shape['intermediate_size']}; B={shape['batch']}, S={shape['seq_len']}, {shape['dtype']}",
            "",
            "| variant | fused per layer | kernels fw / bw | non-matmul MiB fw / bw | of which attention MiB | glue MiB | ×LB | est. ms/layer (fw+bw) | roofline ms/layer |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, entry in m["variants"].items():
            layer = entry["per_layer"]
            fw, bw_ = layer["forward"], layer["backward"]
            attention = fw["bytes"]["attention"] + bw_["bytes"]["attention"]
            glue = fw["bytes"]["glue"] + bw_["bytes"]["glue"]
            ratio = entry.get("ratio_to_lower_bound", {}).get("total")
            ms = entry.get("est_ms_per_layer", {}).get("total")
            roof = entry.get("roofline_ms_per_layer", {}).get("total")
            lines.append(
                f"| {_LABELS.get(name, name)} | {_fusions(entry)} | {fw['kernels']['total']} / {bw_['kernels']['total']} "
                f"| {_mib(fw['bytes']['non_matmul'])} / {_mib(bw_['bytes']['non_matmul'])} | {_mib(attention)} "
                f"| {_mib(glue)} | {_num(ratio, 2)} | {_num(ms, 3)} | {_num(roof, 3)} |"
            )
        lb = m.get("lower_bound")
        if lb:
            b = lb["bytes_per_layer"]
            lines.append(
                f"| **fused lower bound** | - | - | {_mib(b['forward'])} / {_mib(b['backward'])} | - | 0 | 1.00 "
                f"| {lb['est_ms_per_layer']['total']:.3f} | - |"
            )
            math = lb.get("math_backward")
            if math:
                ours = m["variants"].get("qwen_npu", {}).get("ratio_to_math_backward_bound")
                lines.append(
                    f"| *math backward bound* | - | - | - / {_mib(math['bytes'])} | - | - | - | "
                    f"{(math['bytes'] / data['bandwidth']['bytes_per_second'] * 1e3):.3f} (bw only) | - |"
                )
                lines += [
                    "",
                    "Independent backward bound from the layer's math (ideal fused kernels, residual-gradient adds "
                    "fused into the norms): " + ", ".join(f"{k} {_mib(v)}" for k, v in math["terms"].items())
                    + f" MiB; qwen_npu's backward is {ours:.2f}x of it." if ours else "",
                ]
            if not lb["complete"]:
                lines += [
                    "",
                    f"**Warning**: qwen_npu fused only {lb['families_fused_in_reference']} per layer, so this "
                    "\"lower bound\" still holds the unfused families' subgraphs: the true bound is lower.",
                ]
        eager_pf = m["variants"].get("eager", {}).get("per_forward")
        if eager_pf:
            pf = eager_pf["forward"]
            lines += [
                "",
                f"Once per forward (position ids, causal mask, rotary cos/sin), not in the "
                f"table: eager {pf['kernels']['total']} kernels, {_mib(pf['bytes']['non_matmul'])} MiB.",
            ]
        lines += ["", _square_line(m)]
        lines += ["", *_where_bytes_go(m), ""]
    lines += _findings(data)
    if data.get("inference"):
        lines += _inference(data)
    if data.get("packed"):
        lines += _packed(data)
    return lines


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _packed(data: dict) -> list[str]:
    """Section 1d: the packed rows (explicit mask vs varlen vs verl-style), from ``data["packed"]``."""
    lines = [
        "## 1d. Packed sequences (one row of T tokens, position_ids restarting per sequence, no attention_mask)",
        "",
        "verl's `use_remove_padding`. Per layer = graph(2 layers) − graph(1 layer); T×T = tensors whose last two "
        "dims are T×T in the 1-layer forward / backward graphs (inputs and kernel outputs, attention included). "
        "Attention TFLOP: Σ over the attention kernels (forward 2 matmuls, backward 5) of the score pairs "
        "computed: per sequence len(len+1)/2 for a causal kernel (varlen, verl's TND), T² for the explicit mask. "
        "Roofline ms = Σ per kernel max(FLOPs / Cube peak, bytes / bandwidth): total (matmul + attention + rest).",
        "",
        "| row | mode | variant | fused per layer | kernels fw / bw | non-matmul MiB fw / bw | of which attention MiB "
        "| T×T tensors fw / bw | attention TFLOP | roofline ms/layer (matmul + attention + rest) | ÷ varlen: bytes / roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, packed in data["packed"].items():
        for mode in ("training", "inference"):
            m = packed.get(mode)
            if m is None:
                continue
            ratios = packed["ratios"][mode]
            for name, entry in m["variants"].items():
                layer = entry["per_layer"]
                kinds = [k for k in ("forward", "backward") if k in layer]
                kernels = " / ".join(str(layer[k]["kernels"]["total"]) for k in kinds)
                moved = " / ".join(_mib(layer[k]["bytes"]["non_matmul"]) for k in kinds)
                attention = sum(layer[k]["bytes"]["attention"] for k in kinds)
                square = " / ".join(str(entry["square_tensors"][k]["tensors"]) for k in kinds)
                roof = entry["roofline_ms_per_layer"]
                by = roof["by_category"]
                ratio = ratios.get(name)
                lines.append(
                    f"| {row} | {mode} | {_LABELS.get(name, name)} | {_fusions(entry)} | {kernels} | {moved} "
                    f"| {_mib(attention)} | {square} | {entry['attention_flops_per_layer'] / 1e12:.3f} "
                    f"| {roof['total']:.2f} ({by['matmul']:.2f} + {by['attention']:.2f} + "
                    f"{by['fused'] + by['vector']:.2f}) | "
                    + (f"{ratio['bytes']:.2f} / {ratio['roofline']:.2f} |" if ratio else "1 / 1 |")
                )
    return lines + [""]


def _square_line(m: dict) -> str:
    cells = []
    for name, entry in m["variants"].items():
        sq = entry.get("square_tensors_per_forward")
        if sq is not None:
            cells.append(f"{_LABELS.get(name, name)} {sq['tensors']} tensors, {_mib(sq['bytes'])} MiB written, "
                         f"{_mib(sq['traffic'])} MiB moved")
    return "S×S tensors per forward (the attention mask and its conversions): " + "; ".join(cells) + "."


def _inference(data: dict) -> list[str]:
    lines = [
        "## 1b. Inference forwards (no grad, eval: the two log-prob forwards of a verl step)",
        "",
        "Per layer = graph(2 layers) − graph(1 layer), final norm kept (so both norms of a layer follow a "
        "residual add). qwen_npu fuses residual add + RMSNorm into `npu_add_rms_norm` here.",
        "",
        "| model | variant | fused per layer | kernels | non-matmul MiB | ×LB | est. ms/layer |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, m in data["inference"].items():
        for name, entry in m["variants"].items():
            fw = entry["per_layer"]["forward"]
            add = fw["by_op"].get("npu.npu_add_rms_norm.default", {}).get("kernels", 0)
            fused = _fusions(entry) + (f" (add_rms_norm {add})" if add else "")
            lines.append(
                f"| {model} | {_LABELS.get(name, name)} | {fused} | {fw['kernels']['total']} | "
                f"{_mib(fw['bytes']['non_matmul'])} | {entry['ratio_to_lower_bound']['forward']:.2f} | "
                f"{entry['est_ms_per_layer']['forward']:.3f} |"
            )
        lines.append(f"| {model} | **lower bound** | - | - | {_mib(m['lower_bound']['bytes_per_layer']['forward'])} | 1.00 | - |")
    lines += ["", "## 1c. One verl step (1 training forward+backward + 2 inference forwards)", "",
              "| model | variant | MiB per layer | GiB per step (all layers) | est. ms per step | eager bytes ÷ these |",
              "|---|---|---|---|---|---|"]
    for model, step in data.get("verl_step", {}).items():
        eager = step["variants"].get("eager", {}).get("bytes_per_step")
        for name, entry in step["variants"].items():
            lines.append(
                f"| {model} ({step['layers']} layers) | {_LABELS.get(name, name)} | {_mib(entry['bytes_per_layer'])} | "
                f"{entry['bytes_per_step'] / 1024**3:,.1f} | {entry['est_ms_per_step']:.1f} | "
                f"{(eager / entry['bytes_per_step']):.2f} |" if eager else "- |"
            )
    return lines + [""]


def _where_bytes_go(m: dict, top: int = 12) -> list[str]:
    variants = [v for v in ("eager", "verl", "qwen_npu") if v in m["variants"]]
    totals: dict[str, dict[str, int]] = {}
    glue: dict[str, dict[str, int]] = {}
    for v in variants:
        for kind in ("forward", "backward"):
            for op, row in m["variants"][v]["per_layer"][kind]["by_op"].items():
                if row["category"] == "matmul":
                    continue
                totals.setdefault(op, {}).setdefault(v, 0)
                totals[op][v] += row["bytes_read"] + row["bytes_written"]
                glue.setdefault(op, {}).setdefault(v, 0)
                glue[op][v] += row["glue_bytes"]
    ranked = sorted(totals, key=lambda op: -max(totals[op].values()))[:top]
    lines = [
        f"Where the bytes go (per layer, fw+bw, MiB; top {len(ranked)} ops; *g* = of which glue):",
        "",
        "| op | " + " | ".join(_LABELS[v] for v in variants) + " |",
        "|---|" + "---|" * len(variants),
    ]
    for op in ranked:
        cells = []
        for v in variants:
            value = totals[op].get(v, 0)
            g = glue[op].get(v, 0)
            cells.append(f"{_mib(value)}" + (f" (*g* {_mib(g)})" if g else "") if value else "-")
        lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return lines


def _glue_by_op(entry: dict) -> dict[str, int]:
    glue: dict[str, int] = {}
    for kind in ("forward", "backward"):
        for op, row in entry["per_layer"][kind]["by_op"].items():
            if row["glue_bytes"]:
                glue[op] = glue.get(op, 0) + row["glue_bytes"]
    return glue


def _findings(data: dict) -> list[str]:
    """What the traffic numbers say, computed from them (docs/performance.md's closing note quotes these)."""
    bw = data["bandwidth"]["bytes_per_second"]
    lines = ["### Findings (computed from the tables above)", ""]
    for model, m in data["models"].items():
        v = m["variants"]
        if not {"eager", "qwen_npu"} <= set(v):
            continue
        eager, ours = v["eager"], v["qwen_npu"]
        verl = v.get("verl")
        parts = [
            f"**{model}**: qwen_npu moves {eager['bytes_per_layer']['total'] / ours['bytes_per_layer']['total']:.2f}x "
            f"fewer non-matmul bytes per layer than eager ({eager['ratio_to_lower_bound']['total']:.2f}x -> "
            f"{ours['ratio_to_lower_bound']['total']:.2f}x the fused lower bound"
            + (f"; verl-style {verl['ratio_to_lower_bound']['total']:.2f}x" if verl else "")
            + f") and launches {eager['kernels_per_layer']['forward'] + eager['kernels_per_layer']['backward']} -> "
            f"{ours['kernels_per_layer']['forward'] + ours['kernels_per_layer']['backward']} kernels (fw+bw)."
        ]
        sw_e = eager.get("swiglu_forward_bytes_per_layer")
        sw_f = ours.get("swiglu_forward_bytes_per_layer")
        if sw_e and sw_f and sw_f["npu_swiglu"] and sw_f["input_glue"]:
            fused = sw_f["npu_swiglu"] + sw_f["input_glue"]
            parts.append(
                f"SwiGLU forward: unfused silu+mul {_mib(sw_e['silu_mul'])} MiB, fused cat+npu_swiglu {_mib(fused)} MiB "
                f"({(fused / sw_e['silu_mul'] - 1) * 100:+.0f}%; the cat alone {_mib(sw_f['input_glue'])} MiB); "
                f"npu_swiglu reading a merged gate_up matmul output would move {_mib(sw_f['npu_swiglu'])} MiB."
            )
        glue = _glue_by_op(ours)
        if glue:
            total = sum(glue.values())
            listed = ", ".join(f"`{op}` {_mib(b)} MiB" for op, b in sorted(glue.items(), key=lambda kv: -kv[1]))
            parts.append(
                f"qwen_npu glue per layer: {listed} = {_mib(total)} MiB, "
                f"{total / ours['bytes_per_layer']['total'] * 100:.0f}% of its non-matmul bytes, "
                f"{total / bw * 1e3:.3f} ms/layer at the A2's bandwidth."
            )
        lines += [" ".join(parts), ""]
    return lines


def _compile(data: dict) -> list[str]:
    setup = data["setup"]
    lines = [
        "## 2. Compile cost (same process, tiny width, training step)",
        "",
        f"{setup['model']}; B={setup['batch']}, S={setup['seq_len']}; median of {setup['repeats']} repeat(s). "
        "Each sample is one Dynamo capture, on which our canonicalize + fuse (`backend.rewrite`, registration "
        "excluded: see part 3) and AOTAutograd (`aot_eager`, the baseline) are both timed. Ratios are per "
        "sample, then the median.",
        "",
        "| layers | Dynamo capture s | AOTAutograd s | ours s (canon + fuse) | ours / (capture+AOT) | ours / capture | ours / AOT |",
        "|---|---|---|---|---|---|---|",
    ]
    for layers, m in data["medians"].items():
        lines.append(
            f"| {layers} | {m['capture_s']:.2f} | {m['aot_s']:.2f} | {m['ours_s']:.2f} "
            f"({m['canonicalize_s']:.2f} + {m['fuse_s']:.2f}) | {m['ratio_ours_to_capture_aot']:.2f} "
            f"| {m['ratio_ours_to_capture']:.2f} | {m['ratio_ours_to_aot']:.2f} |"
        )
    layers = setup["layers"]
    lines += [
        "",
        f"Growth (least-squares slope over {layers} layers, and the {layers[-1]}-layer / {layers[0]}-layer ratio):",
        "",
        "| step | s per layer | ratio |",
        "|---|---|---|",
    ]
    for key, label in (
        ("capture_s", "Dynamo capture"),
        ("aot_s", "AOTAutograd"),
        ("capture_aot_s", "capture + AOT (baseline)"),
        ("canonicalize_s", "ours: canonicalize"),
        ("fuse_s", "ours: fuse"),
        ("ours_s", "ours: canonicalize + fuse"),
    ):
        g = data["growth"][key]
        ratio = g["ratio_last_to_first"]
        lines.append(f"| {label} | {g['seconds_per_layer']:.3f} | " + (f"{ratio:.1f}× |" if ratio else "- |"))
    lines += ["", "Notes: " + "; ".join(setup["notes"]) + ".", ""]
    return lines


def _registration(data: dict) -> list[str]:
    lines = [
        "## 3. Pattern registration (fresh process)",
        "",
        "| family | variants registered / declared | registration s (first use) | cached call s |",
        "|---|---|---|---|",
    ]
    for family, f in data["per_family"].items():
        reg = f"{f['registration_s']:.2f}" if f["registration_s"] is not None else "-"
        lines.append(f"| {family} | {f['variants']} / {f.get('declared_variants', '-')} | {reg} | {f['cached_call_s']:.1e} |")
    first, second = data["first_compile"], data["second_compile"]
    lines += [
        f"| **total** | {sum(f['variants'] for f in data['per_family'].values())} | {data['registration_total_s']:.2f} | - |",
        "",
        "| compile in one process | total s | fuse s | register_replacement calls |",
        "|---|---|---|---|",
        f"| first (model A, 2 layers) | {first['first_s']:.2f} | {first['fuse_s']:.2f} | {first['register_replacement_calls']} |",
        f"| second (model B, 3 layers, hidden 96) | {second['first_s']:.2f} | {second['fuse_s']:.2f} | {second['register_replacement_calls']} |",
        "",
        f"Second compile pays registration again: **{'yes' if data['second_compile_pays_registration'] else 'no'}**.",
        "",
    ]
    return lines


def render_summary(loaded: dict[str, dict], total_seconds: float, command: str) -> str:
    """The markdown summary of whichever result files are present.

    Args:
        loaded: part name (``traffic``/``moe``/``qwen3_5``/``compile``/``registration``) -> its JSON payload.
        total_seconds: wall time of this invocation (seconds).
        command: the command line that produced this invocation.
    """
    meta = next(iter(loaded.values()))["meta"] if loaded else {}
    versions = meta.get("versions", {})
    lines = [
        "# qwen_npu benchmark results",
        "",
        f"Produced by `{command}` ({'quick' if meta.get('quick') else 'full'} run, {meta.get('date_utc', '?')}); "
        f"this invocation took {total_seconds:.0f} s. torch {versions.get('torch')}, transformers "
        f"{versions.get('transformers')}, npu ops {'simulated' if meta.get('npu_ops', {}).get('simulated') else 'real'}; "
        f"host: {meta.get('host', {}).get('cpu_count')} CPUs, load average {meta.get('host', {}).get('load_average_1_5_15min')}.",
        "",
    ]
    part_seconds = {part: data["meta"].get("part_seconds") for part, data in loaded.items()}
    lines += [f"Part wall times (s): {part_seconds}.", ""]
    if "traffic" in loaded:
        lines += _traffic(loaded["traffic"])
    if "moe" in loaded:
        lines += ["## MoE per decoder layer", "", moe_table(loaded["moe"]), ""]
    if "qwen3_5" in loaded:
        lines += ["## Qwen3.5 per decoder layer kind", "", qwen3_5_table(loaded["qwen3_5"]), ""]
    if "compile" in loaded:
        lines += _compile(loaded["compile"])
    if "registration" in loaded:
        lines += _registration(loaded["registration"])
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------------
# the tables of docs/performance.md


_SHORT = {"qwen2.5-0.5b": "0.5B", "qwen2.5-7b": "7B"}
_README_LABELS = {"eager": "eager", "verl": "verl-style", "qwen_npu": "qwen_npu",
                  "qwen_npu_explicit_mask": "qwen_npu, explicit mask", "qwen_npu_varlen": "qwen_npu, varlen"}


def _model_label(name: str, shape: dict) -> str:
    base = name.split(" ")[0]
    return f"{_SHORT.get(base, base)}, {shape['seq_len']}"


def readme_tables(traffic: dict) -> str:
    """The traffic tables of docs/performance.md, from ``kernel_traffic.json``'s payload.

    ``python -m benchmarks.markdown benchmarks/results/kernel_traffic.json`` prints them (docs/performance.md's
    tables are pasted from that output, so that they match the results file).
    """
    out = ["| model, S | variant | kernels fw / bw | non-matmul MiB fw + bw | × LB fw / bw / total | bw × math bound "
           "| est. ms/layer | roofline ms/layer |", "|---|---|---|---|---|---|---|---|"]
    for name, m in traffic["models"].items():
        label = _model_label(name, m["shape"])
        for i, (variant, entry) in enumerate((v, m["variants"][v]) for v in ("eager", "verl", "qwen_npu")
                                             if v in m["variants"]):
            layer = entry["per_layer"]
            r = entry["ratio_to_lower_bound"]
            out.append(
                f"| {label if i == 0 else ''} | {_README_LABELS[variant]} | {layer['forward']['kernels']['total']} / "
                f"{layer['backward']['kernels']['total']} | {layer['forward']['bytes']['non_matmul'] / MIB:,.0f} + "
                f"{layer['backward']['bytes']['non_matmul'] / MIB:,.0f} | {r['forward']:.2f} / {r['backward']:.2f} / "
                f"{r['total']:.2f} | {entry['ratio_to_math_backward_bound']:.2f} | {entry['est_ms_per_layer']['total']:.2f} "
                f"| {entry['roofline_ms_per_layer']['total']:.2f} |"
            )
        lb = m["lower_bound"]
        b = lb["bytes_per_layer"]
        out.append(f"| | lower bound (math bw bound) | – | {b['forward'] / MIB:,.0f} + {b['backward'] / MIB:,.0f} "
                   f"({lb['math_backward']['bytes'] / MIB:,.0f}) | 1.00 | – | {lb['est_ms_per_layer']['total']:.2f} | – |")
    out += ["", "| model, S | eager | verl-style | qwen_npu | lower bound | qwen_npu × LB |", "|---|---|---|---|---|---|"]
    for name, m in traffic.get("inference", {}).items():
        v = m["variants"]
        out.append(
            f"| {_model_label(name, m['shape'])} | " + " | ".join(
                f"{v[k]['bytes_per_layer']['forward'] / MIB:,.0f}" for k in ("eager", "verl", "qwen_npu"))
            + f" | {m['lower_bound']['bytes_per_layer']['forward'] / MIB:,.0f} | "
            f"{v['qwen_npu']['ratio_to_lower_bound']['forward']:.2f} |"
        )
    out += ["", "| model, S | eager GiB/step | verl-style | qwen_npu | est. ms/step eager / verl / qwen_npu "
            "| qwen_npu vs verl |", "|---|---|---|---|---|---|"]
    for name, step in traffic.get("verl_step", {}).items():
        v = step["variants"]
        base = name.split(" ")[0]
        label = f"{_SHORT.get(base, base)} ({step['layers']} layers), {traffic['models'][name]['shape']['seq_len']}"
        out.append(
            f"| {label} | " + " | ".join(f"{v[k]['bytes_per_step'] / 1024**3:,.1f}" for k in ("eager", "verl", "qwen_npu"))
            + " | " + " / ".join(f"{v[k]['est_ms_per_step']:.0f}" for k in ("eager", "verl", "qwen_npu"))
            + f" | {v['verl']['bytes_per_step'] / v['qwen_npu']['bytes_per_step']:.2f}× |"
        )
    if traffic.get("packed"):
        out += ["", "| 7B, T = 16384 as | mode | variant | kernels fw / bw | non-matmul MiB fw + bw | of which attention "
                "| T×T tensors fw / bw | attention TFLOP | roofline ms/layer: total (matmul + attention + rest) "
                "| ÷ varlen: bytes / roofline |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row, packed in traffic["packed"].items():
            label = row.rsplit(" as ", 1)[-1].replace("x", " × ")
            for mode in ("training", "inference"):
                m = packed.get(mode)
                if m is None:
                    continue
                for variant, entry in m["variants"].items():
                    layer = entry["per_layer"]
                    kinds = [k for k in ("forward", "backward") if k in layer]
                    roof = entry["roofline_ms_per_layer"]
                    by = roof["by_category"]
                    ratio = packed["ratios"][mode].get(variant)
                    out.append(
                        f"| {label} | {mode} | {_README_LABELS[variant]} | "
                        + " / ".join(str(layer[k]["kernels"]["total"]) for k in kinds) + " | "
                        + " + ".join(f"{layer[k]['bytes']['non_matmul'] / MIB:,.0f}" for k in kinds)
                        + f" | {sum(layer[k]['bytes']['attention'] for k in kinds) / MIB:,.0f} | "
                        + " / ".join(str(entry["square_tensors"][k]["tensors"]) for k in kinds)
                        + f" | {entry['attention_flops_per_layer'] / 1e12:.2f} | {roof['total']:.2f} "
                        f"({by['matmul']:.2f} + {by['attention']:.2f} + {by['fused'] + by['vector']:.2f}) | "
                        + (f"{ratio['bytes']:.2f} / {ratio['roofline']:.2f} |" if ratio else "1 / 1 |")
                    )
    return "\n".join(out) + "\n"


_MOE_LABELS = {"transformers": "transformers default (grouped_mm)", "verl": "verl-style", "qwen_npu": "qwen_npu"}
_GMM_SHORT = {"aten._grouped_mm": "_grouped_mm", "grouped_mm_fallback": "grouped_mm_fallback",
              "qwen_npu.grouped_matmul": "qwen_npu.grouped_matmul", "npu_grouped_matmul": "npu_grouped_matmul"}


def _layer_traffic_cells(row: dict) -> str:
    """The "kernels fw / bw | non-matmul MiB fw + bw (read / written) | glue MiB" cells of a per-layer row
    (the MoE and Qwen3.5 tables)."""
    kinds = [k for k in ("forward", "backward") if k in row["kernels"]]
    return (" / ".join(str(row["kernels"][k]) for k in kinds) + " | "
            + " + ".join(f"{row['bytes'][k] / MIB:,.0f}" for k in kinds)
            + f" ({row['bytes_read']['total'] / MIB:,.0f} / {row['bytes_written']['total'] / MIB:,.0f}) | "
            f"{row['glue_bytes']['total'] / MIB:,.0f}")


def _roofline_cell(row: dict) -> str:
    """The "roofline ms (matmul + attention + rest)" cell of a per-layer row."""
    by = row["roofline_ms_by_category"]
    return (f"{row['roofline_ms']['total']:.2f} ({by['matmul']:.2f} + {by['attention']:.2f} + "
            f"{by['fused'] + by['vector']:.2f})")


def _grouped_mm_cell(counts: dict[str, int]) -> str:
    found = [f"{_GMM_SHORT[label]} {n}" for label, n in counts.items() if n]
    return ", ".join(found) or "0"


def moe_table(moe: dict) -> str:
    """The "MoE per layer" table of docs/performance.md, from ``moe_traffic.json``'s payload
    (``benchmarks/moe_traffic.py``): per model, mode and variant, the per-layer kernels, non-matmul bytes (read /
    written), glue, the gradient layout copies after the graph, Cube TFLOP (grouped matmuls), est. ms, roofline
    (matmul + attention + rest) and with the copies, and the grouped-matmul kernels.

    ``python -m benchmarks.markdown benchmarks/results/moe_traffic.json`` prints it.
    """
    out = ["| mode | variant | kernels fw / bw | non-matmul MiB fw + bw (read / written) | glue MiB "
           "| grad layout copies MiB | TFLOP (grouped mm) | est. ms | roofline ms (matmul + attention + rest) "
           "| roofline + copies ms | grouped matmuls fw; bw |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in moe["models"].values():
        for mode, rows in m["modes"].items():
            for i, (variant, row) in enumerate(rows.items()):
                kinds = [k for k in ("forward", "backward") if k in row["kernels"]]
                out.append(
                    f"| {mode if i == 0 else ''} | {_MOE_LABELS.get(variant, variant)} | {_layer_traffic_cells(row)} | "
                    f"{row['grad_layout_copies']['bytes'] / MIB:,.0f} | "
                    f"{row['flops']['total'] / 1e12:.2f} ({row['grouped_mm_flops']['total'] / 1e12:.2f}) | "
                    f"{row['est_ms']['total']:.2f} | {_roofline_cell(row)} | "
                    f"{row['with_grad_layout_copies']['roofline_ms']:.2f} | "
                    + "; ".join(_grouped_mm_cell(row["grouped_mm"][k]) for k in kinds) + " |"
                )
    return "\n".join(out) + "\n"


_Q35_KINDS = {"linear_attention": "Gated DeltaNet", "full_attention": "full attention"}
_Q35_LABELS = {"eager": "eager", "verl": "verl-style", "qwen_npu": "qwen_npu (reference kernel)",
               "qwen_npu_fla": "qwen_npu + FLA"}
_Q35_SHORT = {"npu.npu_rms_norm.default": "rms_norm", "npu.npu_swiglu.default": "swiglu",
              "npu.npu_rotary_mul.default": "rotary_mul", "npu.npu_fusion_attention.default": "fusion_attention",
              "qwen_npu.gate_up_proj.default": "gate_up_proj", "qwen_npu.rotary_mul_orthogonal.default": "rotary_mul_orthogonal",
              "npu.npu_add_rms_norm.default": "add_rms_norm"}


def _q35_fused_cell(counts: dict[str, int]) -> str:
    found = [f"{_Q35_SHORT.get(op, op.removesuffix('.default'))} {n}" for op, n in counts.items() if n]
    return ", ".join(found) or "–"


def qwen3_5_table(data: dict) -> str:
    """The "Qwen3.5 per layer" tables of docs/performance.md, from ``qwen3_5_traffic.json``'s payload
    (``benchmarks/qwen3_5_traffic.py``): per layer kind, mode and variant, the per-layer kernels, non-matmul bytes
    (read / written), glue, Cube TFLOP, est. ms, roofline (matmul + attention + rest) and the fused kernels of the
    forward; then the chunked delta rule's key ops per DeltaNet layer.

    ``python -m benchmarks.markdown benchmarks/results/qwen3_5_traffic.json`` prints them.
    """
    out = ["| layer | mode | variant | kernels fw / bw | non-matmul MiB fw + bw (read / written) | glue MiB "
           "| TFLOP | est. ms | roofline ms (matmul + attention + rest) | ÷ qwen_npu roofline | fused kernels fw |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in data["models"].values():
        for kind, entry in m["layer_kinds"].items():
            for j, (mode, rows) in enumerate(entry["modes"].items()):
                base = rows.get("qwen_npu", {}).get("roofline_ms", {}).get("total")
                for i, (variant, row) in enumerate(rows.items()):
                    ratio = f"{row['roofline_ms']['total'] / base:.2f}" if base else "–"
                    out.append(
                        f"| {_Q35_KINDS.get(kind, kind) if i == 0 and j == 0 else ''} | "
                        f"{mode if i == 0 else ''} | {_Q35_LABELS.get(variant, variant)} | {_layer_traffic_cells(row)} | "
                        f"{row['flops']['total'] / 1e12:.2f} | {row['est_ms']['total']:.2f} | {_roofline_cell(row)} | "
                        f"{ratio} | "
                        f"{_q35_fused_cell(row['fused_kernels']['forward'])} |"
                    )
    out += ["", "| DeltaNet layer, mode | variant | chunk bmm fw / bw: kernels, GFLOP | solve_triangular fw / bw: kernels, "
            "MiB, vector GFLOP | top 5 ops by roofline ms (kernels, ms) |", "|---|---|---|---|---|"]
    for m in data["models"].values():
        entry = m["layer_kinds"].get("linear_attention")
        if entry is None:
            continue
        for mode, rows in entry["modes"].items():
            for variant, row in rows.items():
                kinds = [k for k in ("forward", "backward") if k in row["kernels"]]
                bmm = " / ".join(f"{row['bmm'][k]['kernels']}, {row['bmm'][k]['flops'] / 1e9:.1f}" for k in kinds)
                solve = " / ".join(f"{row['solve_triangular'][k]['kernels']}, {row['solve_triangular'][k]['bytes'] / MIB:,.0f}, "
                                   f"{row['solve_triangular'][k]['vector_flops'] / 1e9:.1f}" for k in kinds)
                top = "; ".join(f"{t['op'].removeprefix('aten.').removesuffix('.default')} ({t['kernels']}, {t['roofline_ms']:.2f})"
                                for t in row["top_ops"][:5])
                out.append(f"| {mode} | {_Q35_LABELS.get(variant, variant)} | {bmm} | {solve} | {top} |")
    return "\n".join(out) + "\n"


_AM_LABELS = {"eager": "eager", "verl": "verl-style", "qwen_npu_none": "qwen_npu none",
              "qwen_npu_cheap": "qwen_npu cheap", "hf_checkpointing": "HF checkpointing"}


def _ms_cell(value) -> str:
    return "–" if value is None else f"{value:.2f}"


def activation_memory_table(data: dict) -> str:
    """The "Activation memory" tables of docs/performance.md, from ``activation_memory.json``'s payload
    (``benchmarks/activation_memory.py``): per layer and setting, saved-for-backward MiB per layer per 1k tokens (of
    which the layer input), against verl-style, the modelled recompute and layer ms (Atlas A2 roofline); then per
    model the largest micro-batch whose layers' activations fit the budget; then the goals.

    ``python -m benchmarks.markdown benchmarks/results/activation_memory.json`` prints them.
    """
    tokens = data["tokens"]
    out = [f"| layer | setting | MiB / layer / 1k tokens | of which layer input | saved storages | vs verl-style "
           f"| recompute ms (S={tokens}) | layer ms (S={tokens}) | recompute ÷ qwen_npu none |",
           "|---|---|---|---|---|---|---|---|---|"]
    for entry in data["layers"].values():
        rows = entry["settings"]
        verl = rows["verl"]["mib_per_1k_tokens"]
        for i, (setting, row) in enumerate(rows.items()):
            per_1k = row["mib_per_1k_tokens"]
            input_mib = row["layer_input_bytes"] / MIB * data["per_tokens"] / row["tokens"]
            layer_ms = row["layer_ms"]["total"] if row["layer_ms"] else None
            out.append(f"| {entry['label'] if i == 0 else ''} | {_AM_LABELS.get(setting, setting)} | {per_1k:.1f} | "
                       f"{input_mib:.1f} | {row['storages']} | {per_1k / verl - 1:+.0%} | {row['recompute_ms']:.2f} | "
                       f"{_ms_cell(layer_ms)} | {row['recompute_fraction']:.1%} |")
    budget = data["budget_bytes"] / 1024**3
    out += ["", f"| model (decoder layers) | setting | activation GiB per 1k tokens, all layers "
            f"| largest micro-batch in {budget:g} GiB (tokens) |", "|---|---|---|---|"]
    for model, by_setting in data["verl_step"].items():
        for i, (setting, step) in enumerate(by_setting.items()):
            per_1k = step["bytes_per_token"] * data["per_tokens"] / 1024**3
            name = f"{model} ({step['layers']})" if i == 0 else ""
            out.append(f"| {name} | {_AM_LABELS.get(setting, setting)} "
                       f"| {per_1k:.2f} | {step['tokens']:,} |")
    out += ["", "| layer | goal | qwen_npu cheap | vs verl-style | recompute ÷ layer time | holds |", "|---|---|---|---|---|---|"]
    for key, goal in data["goals"].items():
        out.append(f"| {data['layers'][key]['label']} | {goal['memory_goal']}, recompute <= 3 % | "
                   f"{goal['cheap_mib_per_1k_tokens']:.1f} MiB | {-goal['cut_vs_verl']:+.0%} | "
                   f"{goal['recompute_fraction']:.1%} | {'yes' if goal['holds'] else 'no'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # python -m benchmarks.markdown benchmarks/results/{kernel_traffic,moe_traffic,qwen3_5_traffic,activation_memory}.json
    import json
    import sys
    from pathlib import Path

    payload = json.loads(Path(sys.argv[1]).read_text())
    renderers = {"moe_traffic": moe_table, "qwen3_5_traffic": qwen3_5_table, "activation_memory": activation_memory_table}
    print(renderers.get(payload.get("kind"), readme_tables)(payload), end="")
