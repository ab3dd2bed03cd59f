"""The human-readable output of ``check``: the results table and the GE conversion lines."""

from __future__ import annotations


def print_table(result: dict) -> None:
    """Print the human-readable summary of :func:`~qwen_npu_compile.cli.check.harness.run_check`'s result."""
    kind = "simulated" if result["simulated"] else "real"
    print()
    dynamic = ", dynamic sequence length" if result["settings"].get("dynamic") else ""
    vocab = result["model"]["config"].get("vocab_size")
    layers = f"{result['model']['layers']} layers" + (f", vocab {vocab}" if result["settings"].get("vocab_override") else "")
    print(f"qwen_npu check: {result['model']['name']} ({layers}), "
          f"{result['settings']['dtype']} {result['settings']['mode']}, attn={result['settings']['attn']}{dynamic}, "
          f"npu ops {kind}, downstream {result['settings']['downstream']}")
    found = result["versions"]
    torch_npu = found["torch_npu"] if found["torch_npu"] else "none (npu ops simulated)"
    torchair = f", torchair {found['torchair']}" if found["torchair"] else ""
    # a stack outside the tested ranges is marked where the reader looks for what ran (the import warned once)
    from qwen_npu_compile.compat import untested_mark

    print(f"  ran with torch {found['torch']}{untested_mark('torch', found['torch'])}, transformers "
          f"{found['transformers']}{untested_mark('transformers', found['transformers'])}, torch_npu {torch_npu}{torchair}")
    # a family this model has nothing of (expected 0, none fused) is named on one line, not given a row
    rows = {family: row for family, row in result["fusions"].items()
            if row["expected"] or row["fused"] or row["already_fused"]}
    absent = [family for family in result["fusions"] if family not in rows]
    width = max([12, *(len(family) + 1 for family in rows)])  # rms_norm_gated: 14 characters
    print(f"  {'family':<{width}}{'fused':>8}{'expected':>10}  status")
    for family, row in rows.items():
        got = row["fused"] + row["already_fused"]
        note = f" ({row['already_fused']} already fused)" if row["already_fused"] else ""
        print(f"  {family:<{width}}{got:>8}{row['expected']:>10}  {'ok' if got == row['expected'] else 'MISSING'}{note}")
    if absent:
        print(f"  (nothing to fuse in this model for {', '.join(absent)})")
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
    groups = refusal_groups(result["refused"])
    for (family, source, reason), count in list(groups.items())[:10]:
        print(f"  refused {family} at {source}: {reason}{f' ({count} times)' if count > 1 else ''}")
    if len(groups) > 10:
        rest = sum(list(groups.values())[10:])
        print(f"  ... {rest} more refusals at {len(groups) - 10} other places (all in --json / --dump-dir)")
    if "ge" in result:
        print_ge(result["ge"])
    for problem in result["problems"]:
        print(f"  problem: {problem}")
    print(f"verdict: {result['verdict']}")


def refusal_groups(refused: list[dict]) -> dict[tuple[str, str, str], int]:
    """``(family, source, reason)`` -> how many refusals say exactly that, in first-seen order (a disabled
    family's anchor repeats once per layer with the same source line and reason)."""
    groups: dict[tuple[str, str, str], int] = {}
    for refusal in refused:
        key = (refusal["family"], refusal["source"], refusal["reason"])
        groups[key] = groups.get(key, 0) + 1
    return groups


#: GE op types of the fused kernels, printed with the GE conversion line (torch_npu 2.13.0 torchair
#: converters of npu_rms_norm(_backward), npu_add_rms_norm, npu_swiglu(_backward), npu_rotary_mul(_backward),
#: npu_fusion_attention(_grad)).
FUSED_GE_OPS = ("RmsNorm", "RmsNormGrad", "AddRmsNorm", "SwiGlu", "SwiGluGrad", "RotaryMul", "RotaryMulGrad",
                "FlashAttentionScore", "FlashAttentionScoreGrad", "GroupedMatmul")


def print_ge(ge: dict) -> None:
    """Print the ``GE conversion:`` line (``ok`` or the blockers) and the fused GE ops per graph."""
    graphs = ", ".join(f"{graph['name']} ({graph['kind']})" for graph in ge["graphs"])
    where = f"torchair of torch_npu {ge['torch_npu']}, {ge['torchair']}"
    if not ge["failures"]:
        print(f"  GE conversion: ok ({len(ge['graphs'])} graphs: {graphs}; {where})")
    else:
        print(f"  GE conversion: {len(ge['failures'])} node(s) failed to convert or break a GE limit ({where}):")
        from qwen_npu_compile.torchair import converters as ge_converters

        cpu_only = getattr(ge_converters, "CPU_ONLY_OPS", ())
        for failure in ge["failures"]:
            note = " [only in a CPU trace: on an NPU torch_npu dispatches SDPA to its own kernels]" \
                if failure["op"] in cpu_only else ""
            print(f"    {failure['op']} at {failure['source']} ({failure['graph']}): {failure['error']}{note}")
    for graph in ge["graphs"]:
        fused = ", ".join(f"{op} {graph['ops'][op]}" for op in FUSED_GE_OPS if op in graph["ops"])
        print(f"  GE {graph['name']} ({graph['kind']}): {sum(graph['ops'].values())} ops, converted in "
              f"{graph['seconds']:.1f}s; {fused or 'no fused op'}")
