"""FX graphs of a test's compiles: AOTAutograd's graphs of a function, the calls a graph makes."""

from __future__ import annotations

from torch._functorch.aot_autograd import aot_function, make_boxed_func


def aot_traced(fn):
    """``(compiled, graphs)``: ``fn`` under AOTAutograd (``aot_function``); calling ``compiled`` (and its
    backward) fills ``graphs["fw"]`` / ``graphs["bw"]`` with the GraphModules AOTAutograd hands over."""
    graphs = {}

    def record(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    return aot_function(fn, fw_compiler=record("fw"), bw_compiler=record("bw")), graphs


def call_targets(gm) -> list:
    """The targets of ``gm``'s ``call_function`` nodes, in graph order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def count_calls(graphs, op) -> int:
    """Calls of ``op`` in the GraphModules ``graphs``."""
    return sum(len(gm.graph.find_nodes(op="call_function", target=op)) for gm in graphs)
