"""What the drivers of ``tests/drivers`` and ``examples/fsdp_train.py`` hand back, checked the same way."""

from __future__ import annotations


def assert_every_layer_fused(run: dict, per_layer: dict, layers: int = 2, where: str = "") -> None:
    """``run`` (a driver's JSON result: ``compiled_layers`` and, by layer name, its ``class`` and the fusions of
    every graph it ran: the verl engine driver's ``fusions`` list, ``fsdp_train``'s ``graphs``) compiled exactly
    the ``layers`` Qwen2 decoder layers, each ran at least one qwen_npu graph, and every graph fused ``per_layer``
    (family -> count, the families it names). ``where`` names the run in a failure (a rank, a scenario)."""
    names = [f"model.layers.{i}" for i in range(layers)]
    assert run["compiled_layers"] == names, where
    assert sorted(run["layers"]) == names, where
    for name, layer in run["layers"].items():
        assert layer["class"] == "Qwen2DecoderLayer", (where, name, layer["class"])
        graphs = layer["fusions"] if "fusions" in layer else [graph["fusions"] for graph in layer["graphs"]]
        assert graphs, f"{where}: {name} ran no qwen_npu graph"
        for fusions in graphs:
            assert {family: fusions.get(family) for family in per_layer} == per_layer, (where, name, fusions)
