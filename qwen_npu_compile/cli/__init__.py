"""``qwen-npu-compile``: the command line (argparse and the exit status). ``check MODEL`` is the main job;
its harness is :mod:`qwen_npu_compile.cli.check` (run: ``check.harness``, parity: ``check.parity``, models:
``check.models``, output: ``check.table``).

``check`` builds a Qwen-family model (dense Qwen2/2.5/3, MoE, the Qwen3.5 / Qwen3-Next hybrids of Gated DeltaNet and
gated attention; a preset or a local Hugging Face directory), runs eager and
``torch.compile(backend="qwen_npu")`` forward (and backward in train mode) on the same random tokens,
and prints, stage by stage, then as a table: per family fused vs expected (from the config), the
error of logits and gradients against eager with the tolerance used, compile time, and a verdict.
With ``--downstream torchair`` on a host without an NPU, torchair's own FX→GE conversion runs off-NPU
(:mod:`qwen_npu_compile.torchair.offline`) and the check also fails on any node that did not convert.
Exit status 0 only when every expected fusion happened and parity holds (1: check failed,
2: bad arguments, the run would not fit in memory, or torchair could not be obtained).

``presets`` lists the presets (one line each); ``--version`` prints the version. A model that is neither a
preset nor a folder (a typo, a hub id) and a ``config.json`` that leaves the architecture to transformers'
defaults are refused in one line before torch is imported (exit status 2).

``report DIR...`` reads the dump folders of a finished run (one per rank) and prints fusions, refusals,
GE conversion failures and graphs per call site: :mod:`qwen_npu_compile.cli.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from qwen_npu_compile import __version__  # no torch
from qwen_npu_compile.cli.check.model_folder import architecture_problem  # no torch
from qwen_npu_compile.cli.check.names import preset_lines, unknown_model_message  # no torch
from qwen_npu_compile.cli.check.presets import PRESETS  # data only
from qwen_npu_compile.config import ALL_FAMILIES  # no torch

# No torch, transformers or pattern import at module level: ``--help``, argument errors and ``report`` need
# none of them and answer in a fraction of a second; ``check`` imports them in :func:`main`. The names the
# parser shows are therefore spelled here; tests/cli/test_user_messages.py keeps them equal to their sources
# (``check.harness.DTYPES``, ``config.DOWNSTREAMS``; the families: ``config.ALL_FAMILIES``).

#: ``--dtype`` choices (the keys of :data:`qwen_npu_compile.cli.check.harness.DTYPES`).
DTYPE_NAMES = ("bf16", "fp16", "fp32")
#: ``--downstream`` choices (:data:`qwen_npu_compile.config.DOWNSTREAMS`).
DOWNSTREAM_NAMES = ("torchair", "aot_eager", "eager", "inductor")


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
        description="Fuse Qwen-family subgraphs (RMSNorm, SwiGLU, RoPE, attention, MoE experts, gated RMSNorm, the "
                    "Gated DeltaNet's chunked delta rule) into Ascend NPU ops with torch.compile(backend='qwen_npu'); "
                    "without an NPU, simulated ops on the CPU.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="compile a model and check fusion counts and parity against eager",
        description="Build MODEL, run eager and qwen_npu-compiled forward (and backward), compare, print a verdict. "
                    "Exit status 0: every expected fusion happened and parity holds; 1: a fusion or parity failed; 2: bad "
                    "arguments or input (a broken model folder, a check that cannot be judged, not enough memory).",
    )
    check.add_argument("model", metavar="MODEL",
                       help=f"a preset ({', '.join(sorted(PRESETS))}; case-insensitive) or a local Hugging Face model "
                            "folder (config.json; its weights are loaded when present, else random ones)")
    check.add_argument("--layers", type=positive_int, default=None, help="decoder layers to build (default: all)")
    check.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    check.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence (default 64)")
    check.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16", help="parameter dtype (default bf16)")
    check.add_argument("--mode", choices=("train", "infer"), default="train", help="train adds the backward (default)")
    check.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attn_implementation (default sdpa)")
    check.add_argument("--fusions", default=None,
                       help=f"families to enable: all, none or a subset of {','.join(ALL_FAMILIES)} "
                            "(default: $QWEN_NPU_FUSIONS, else all)")
    check.add_argument("--downstream", choices=DOWNSTREAM_NAMES, default=None,
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
    check.add_argument("--vocab-size", type=positive_int, default=None, metavar="V",
                       help="replace the model's vocab_size (embedding and LM head rows; random weights only). No fused "
                            "op sees this dimension; a small V shortens CPU runs, where bf16 LM-head matmuls dominate "
                            "(default: the model's)")
    check.add_argument("--dump-dir", type=Path, default=None, help="write graphs, report.json and summary.json here")
    check.add_argument("--json", type=Path, default=None, dest="json_path", metavar="FILE", help="write the results as JSON")
    check.add_argument("-v", "--verbose", action="store_true", help="log every qwen_npu line")
    sub.add_parser("presets", help="list the presets check accepts (one line each)",
                   description="List the presets of check MODEL: name, model type, layers, hidden size, heads/KV heads.")
    report = sub.add_parser(
        "report",
        help="read the dump folders of a run (summary.json / report.json) and say what fused",
        description="Read every summary.json and report.json under DIR... (a run's dump_dir, one rank<N> folder per "
                    "rank) and print, per graph and in total, fusions and already-fused per family, refusals by "
                    "source line, GE conversion failures and graphs per call site. Exit status 1 when an enabled "
                    "family refused an anchor (or a graph compiled unfused), 2 for bad arguments.",
    )
    report.add_argument("dirs", metavar="DIR", nargs="+", help="dump folders (dump_dir, rank<N>, or any folder above)")
    report.add_argument("--json", default=None, dest="json_path", metavar="FILE",
                        help="also write the report as JSON to FILE ('-': print only the JSON, to stdout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``qwen-npu-compile`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from qwen_npu_compile.cli import report as run_report  # no torch

        return run_report.main(args)
    if args.command == "presets":
        print("\n".join(preset_lines()))
        return 0
    # Refusals that need no torch (a typo answers at once, not after torch's import).
    if (problem := unknown_model_message(args.model) or architecture_problem(args.model)) is not None:
        print(f"qwen-npu-compile: error: {problem}", file=sys.stderr)
        return 2
    import torch

    from qwen_npu_compile.cli.check.table import print_table
    from qwen_npu_compile.torchair.offline.wheel import TorchairUnavailableError

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.json_path is not None and (problem := json_path_problem(args.json_path)) is not None:
        print(f"qwen-npu-compile: error: --json {str(args.json_path)!r} {problem}", file=sys.stderr)
        return 2  # before the check runs: its results would be lost at the end
    try:
        with explained_kernel_fallbacks():
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
        try:
            args.json_path.parent.mkdir(parents=True, exist_ok=True)
            args.json_path.write_text(json.dumps(result, indent=2, default=str))
        except OSError as exc:  # e.g. the disk filled up during the check
            print(f"qwen-npu-compile: error: cannot write --json {str(args.json_path)!r}: {exc}", file=sys.stderr)
            return 2
        print(f"results written to {args.json_path}")
    return 0 if result["verdict"] == "PASS" else 1


def run_check(args: argparse.Namespace) -> dict:
    """:func:`qwen_npu_compile.cli.check.harness.run_check` (imported at the first call: torch and the patterns)."""
    from qwen_npu_compile.cli.check.harness import run_check as run

    return run(args)


#: transformers' warnings that the Gated DeltaNet layers (Qwen3.5, Qwen3-Next) run its PyTorch reference code
#: because GPU kernel packages are not installed: transformers 5.2x (``integrations/hub_kernels.py``, one per
#: package: ``causal_conv1d``, ``flash-linear-attention``) and earlier (``modeling_qwen3_5/next.py``, "The fast path
#: is not available ...").  5.25 adds "is either not installed or doesn't support the device of the inputs".
_KERNEL_FALLBACK = re.compile(r"is falling back to its reference PyTorch implementation because `([^`]+)` is "
                              r"(?:either )?not installed|The fast path is not available because one of the required "
                              r"library")

#: The one line ``check`` prints instead of those warnings.
KERNEL_FALLBACK_NOTE = (
    "note: transformers runs the eager Gated DeltaNet layers with its PyTorch reference code (the kernel packages "
    "flash-linear-attention / causal-conv1d are not installed or do not support this device): correct, only slower; "
    "nothing to install for check, "
    "whose compiled model computes the delta rule with qwen_npu::chunk_gated_delta_rule"
)


class _KernelFallbackFilter(logging.Filter):
    """Drops :data:`_KERNEL_FALLBACK` records; the first one prints :data:`KERNEL_FALLBACK_NOTE` to stderr."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not _KERNEL_FALLBACK.search(record.getMessage()):
            return True
        if not self.seen:
            self.seen = True
            print(KERNEL_FALLBACK_NOTE, file=sys.stderr, flush=True)
        return False


@contextlib.contextmanager
def explained_kernel_fallbacks() -> Iterator[_KernelFallbackFilter]:
    """While ``check`` runs: transformers' "install causal_conv1d / flash-linear-attention" warnings are expected
    on a host without CUDA (the eager reference of a Qwen3.5 / Qwen3-Next model) and are replaced by one line of
    ours (:data:`KERNEL_FALLBACK_NOTE`). A filter on the handlers of transformers' library logger (which does not
    propagate), removed afterwards."""
    from transformers.utils import logging as hf_logging

    handlers = hf_logging.get_logger("transformers").handlers + logging.getLogger().handlers  # configures its handler
    filt = _KernelFallbackFilter()
    for handler in handlers:
        handler.addFilter(filt)
    try:
        yield filt
    finally:
        for handler in handlers:
            handler.removeFilter(filt)


def json_path_problem(path: Path) -> str | None:
    """Why ``check --json FILE`` could not be written at the end of the check, or None: an existing folder,
    or a parent folder in which no file can be created (:func:`qwen_npu_compile.config.dump_dir_problem`'s
    probe)."""
    from qwen_npu_compile.config import dump_dir_problem

    if path.is_dir():
        return "is a folder; name a file"
    problem = dump_dir_problem(path.parent)
    if problem == "exists and is not a folder":
        return f"cannot be written: {str(path.parent)!r} is not a folder"
    return problem
