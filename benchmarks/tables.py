"""Per-layer tables: one decoder layer's kernels, bytes, FLOPs and modelled time, as graph(L=2) - graph(L=1).

The traffic benchmarks capture each variant with 1 and 2 decoder layers (:mod:`benchmarks.capture`), count each
graph op by op (:func:`benchmarks.cost_model.graph_counts`) and subtract: what the 1-layer graph has beyond one
layer is the once-per-forward work (position ids, causal mask, rotary cos/sin), reported apart (``per_forward``).

Units: kernels (counts), bytes (read + written by non-matmul kernels; matmuls' bytes enter their roofline only),
FLOPs (Cube), ``est_ms`` (non-matmul bytes / the Atlas A2 HBM bandwidth, milliseconds: a memory-traffic floor) and
``roofline_ms`` (the sum of the kernels' roofline times, milliseconds), per graph kind (forward, backward) and in
total; the figures are :data:`benchmarks.cost_model.BANDWIDTH` and :data:`benchmarks.cost_model.PEAK` (the CANN
developer guide's Atlas A2 table).

:func:`per_layer_splits` makes the tables of every traffic benchmark (:mod:`benchmarks.traffic`, whose dense rows
add the per-forward tables and their own columns, :mod:`benchmarks.moe_traffic`, :mod:`benchmarks.qwen3_5_traffic`);
:func:`layer_row` and :func:`row_line` are the MoE and Qwen3.5 rows' common fields and progress line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

from .common import MIB
from .cost_model import BANDWIDTH, CATEGORIES, graph_counts

_NUMERIC = ("kernels", "bytes_read", "bytes_written", "glue_kernels", "glue_bytes", "flops", "roofline_ps")


def subtract(big: dict[str, dict], small: dict[str, dict]) -> dict[str, dict]:
    """Op-by-op ``big - small`` (zero rows dropped)."""
    out = {}
    for name in sorted(set(big) | set(small)):
        a, b = big.get(name), small.get(name)
        category = (a or b)["category"]
        row = {"category": category}
        for key in _NUMERIC:
            row[key] = (a[key] if a else 0) - (b[key] if b else 0)
        if any(row[key] for key in _NUMERIC):
            out[name] = row
    return out


def summarize(table: dict[str, dict]) -> dict:
    """Totals of a per-op table: kernels by category, non-matmul bytes split attention / rest, glue."""
    kernels = Counter()
    bytes_by = Counter()
    glue = Counter()
    for row in table.values():
        kernels[row["category"]] += row["kernels"]
        moved = row["bytes_read"] + row["bytes_written"]
        bytes_by[row["category"]] += moved
        glue["kernels"] += row["glue_kernels"]
        glue["bytes"] += row["glue_bytes"]
    non_matmul = bytes_by["attention"] + bytes_by["fused"] + bytes_by["vector"]
    roofline = Counter()
    flops = Counter()
    for row in table.values():
        roofline[row["category"]] += row.get("roofline_ps", 0)
        flops[row["category"]] += row.get("flops", 0)
    return {
        "flops": {"total": sum(flops.values()), "matmul": flops["matmul"], "attention": flops["attention"]},
        "roofline_ms": {"total": sum(roofline.values()) * 1e-9, **{c: roofline[c] * 1e-9 for c in CATEGORIES}},
        "kernels": {"total": sum(kernels.values()), **{c: kernels[c] for c in CATEGORIES}},
        "bytes": {
            "non_matmul": non_matmul,
            "attention": bytes_by["attention"],
            "vector_and_fused": bytes_by["fused"] + bytes_by["vector"],
            "glue": glue["bytes"],
        },
        "glue_kernels": glue["kernels"],
    }


def has_negative(table: dict[str, dict]) -> list[str]:
    """Ops whose per-layer difference went negative (the layer split is then not clean)."""
    return [name for name, row in table.items() if any(row[key] < 0 for key in _NUMERIC)]

def graph_kinds(inference: bool) -> tuple[str, ...]:
    """The graphs of a mode: the forward (inference), or the forward and the backward (training)."""
    return ("forward",) if inference else ("forward", "backward")


def est_ms(num_bytes: float) -> float:
    """Milliseconds to move ``num_bytes`` at the HBM bandwidth (:data:`benchmarks.cost_model.BANDWIDTH`)."""
    return num_bytes / BANDWIDTH["bytes_per_second"] * 1e3


# ----------------------------------------------------------------------------------------------------
# the per-layer split


def per_kind(kinds: Sequence[str], fn) -> dict:
    """``{kind: fn(kind), ..., "total": sum}`` over the graph kinds (forward, backward)."""
    values = {kind: fn(kind) for kind in kinds}
    return {**values, "total": sum(values.values())}


def capture_verl(variant) -> tuple[bool]:
    """What a Dynamo capture is shared by: verl's patches on or off."""
    return (variant.verl,)


def capture_verl_deltanet(variant) -> tuple[bool, bool]:
    """:func:`capture_verl` for models with a Gated DeltaNet: also whether its delta rule is substituted by
    ``qwen_npu::chunk_gated_delta_rule`` while Dynamo traces (the ``gated_delta_rule`` family,
    :mod:`qwen_npu_compile.substitutions.deltanet`), which a capture fixes for all its variants."""
    return variant.verl, "gated_delta_rule" in variant.families


def per_layer_splits(build, variants: Sequence, inference: bool, counts=graph_counts, where: str = "",
                     key=capture_verl) -> Iterator[tuple]:
    """The per-layer tables of the traffic benchmarks: per group of variants sharing a capture (``key``:
    :func:`capture_verl`), ``build(1, group)`` and ``build(2, group)`` (captures of
    :func:`benchmarks.capture.capture_layers`); per variant, each graph kind's table (``counts``) of 2 layers minus
    that of 1.

    Yields:
        ``(variant, captures of 1 layer, of 2 layers, {kind: per-layer table}, capture seconds)``, grouped by ``key``.

    Raises:
        RuntimeError: a per-layer table went negative (the message names ``where`` before the graph kind).
    """
    kinds = graph_kinds(inference)
    for shared in dict.fromkeys(key(v) for v in variants):
        group = [v for v in variants if key(v) == shared]
        one, two = build(1, group), build(2, group)
        for variant in group:
            g1, g2 = one[variant.name], two[variant.name]
            layer = {}
            for kind in kinds:
                layer[kind] = subtract(counts(g2[kind]), counts(g1[kind]))
                bad = has_negative(layer[kind])
                if bad:
                    raise RuntimeError(f"{variant.name} {where}{kind}: per-layer split went negative for {bad}")
            yield variant, g1, g2, layer, one["seconds"] + two["seconds"]


# ----------------------------------------------------------------------------------------------------
# the MoE and Qwen3.5 rows


def layer_row(variant, g1: dict, g2: dict, layer: dict[str, dict], seconds: float,
              after: dict[str, dict] | None = None) -> dict:
    """The fields every per-layer row has (description, families, fusions, kernels, bytes read / written /
    non-matmul / glue, FLOPs, est. and roofline ms per graph kind, roofline by category, capture seconds, the
    per-op tables), each followed by the benchmark's own fields ``after[field]``.

    Args:
        variant: a :class:`~benchmarks.capture.LayerVariant`.
        g1: its capture of 1 layer; g2: of 2 layers (their ``fusions``).
        layer: per graph kind, the per-layer table (:func:`per_layer_splits`).
        seconds: the capture time.
        after: the benchmark's own fields, by the common field they follow.
    """
    kinds = tuple(layer)
    sums = {k: summarize(layer[k]) for k in kinds}
    fields = {
        "description": variant.description,
        "families": list(variant.families),
        "fusions_per_layer": {f: n - g1["fusions"].get(f, 0) for f, n in g2["fusions"].items()
                              if n or g1["fusions"].get(f)},
        "kernels": per_kind(kinds, lambda k: sums[k]["kernels"]["total"]),
        "bytes_read": per_kind(kinds, lambda k: sum(r["bytes_read"] for r in layer[k].values())),
        "bytes_written": per_kind(kinds, lambda k: sum(r["bytes_written"] for r in layer[k].values())),
        "bytes": per_kind(kinds, lambda k: sums[k]["bytes"]["non_matmul"]),
        "glue_bytes": per_kind(kinds, lambda k: sums[k]["bytes"]["glue"]),
        "flops": per_kind(kinds, lambda k: sums[k]["flops"]["total"]),
        "est_ms": per_kind(kinds, lambda k: est_ms(sums[k]["bytes"]["non_matmul"])),
        "roofline_ms": per_kind(kinds, lambda k: sums[k]["roofline_ms"]["total"]),
        "roofline_ms_by_category": {c: sum(sums[k]["roofline_ms"][c] for k in kinds) for c in CATEGORIES},
        "capture_seconds": round(seconds, 2),
        "by_op": layer,
    }
    row = {}
    for key, value in fields.items():
        row[key] = value
        row.update((after or {}).get(key, {}))
    return row


def row_line(row: dict) -> str:
    """A per-layer row's progress line: ``kernels 9 / 14, 3 + 5 MiB non-matmul (glue 0), 0.12 TFLOP, est 0.01 ms,
    roofline 0.05 ms``."""
    kinds = [k for k in ("forward", "backward") if k in row["kernels"]]
    kernels = " / ".join(str(row["kernels"][k]) for k in kinds)
    mib = " + ".join(f"{row['bytes'][k] / MIB:,.0f}" for k in kinds)
    return (f"kernels {kernels}, {mib} MiB non-matmul (glue {row['glue_bytes']['total'] / MIB:,.0f}), "
            f"{row['flops']['total'] / 1e12:.2f} TFLOP, est {row['est_ms']['total']:.2f} ms, "
            f"roofline {row['roofline_ms']['total']:.2f} ms")
