"""Configuration of the ``qwen_npu`` backend: ``torch.compile`` options and ``QWEN_NPU_*`` env vars.

``torch.compile(model, backend="qwen_npu", options={...})`` and the environment set the same things;
options win over the environment. Every value is validated here, once, with a :class:`QwenNpuConfigError`
(a ``ValueError``) whose message is one line naming the valid choices (and the closest one, where a value is
close to one), so that nothing malformed reaches the passes.

=================  ======================  ==============================================================
option             environment variable    meaning
=================  ======================  ==============================================================
``fusions``        ``QWEN_NPU_FUSIONS``    comma-separated families, ``all`` (default) or ``none``
``dump_dir``       ``QWEN_NPU_DUMP_DIR``   where graphs and reports are written (off by default)
``downstream``     ``QWEN_NPU_DOWNSTREAM`` ``torchair``, ``aot_eager``, ``eager`` or ``inductor``
                                           (default: torchair with real torch_npu, else aot_eager)
``strict``         ``QWEN_NPU_STRICT``     raise when an enabled family refused or near-missed a match
``recompute``      ``QWEN_NPU_RECOMPUTE``  ``none`` (default: save what the backward reads) or ``cheap``
                                           (recompute the cheap fused ops: norms, rotary, SwiGLU, the
                                           gated norm; :mod:`qwen_npu_compile.handoff.recompute`)
=================  ======================  ==============================================================

torchair settings (used only when the downstream is ``torchair``; option / environment variable):

- ``torchair_mode`` / ``QWEN_NPU_TORCHAIR_MODE``: ``max-autotune`` (default: GE graph mode) or
  ``reduce-overhead`` (torchair's ACL graph capture; NPU only).
- ``torchair_dump`` / ``QWEN_NPU_TORCHAIR_DUMP``: torchair's GE graph dump, ``pbtxt``, ``txt``, ``py``
  or ``none`` (default); written to ``<dump_dir>/<graph>/torchair/``, so it needs ``dump_dir``.
- ``torchair_run_eagerly`` / ``QWEN_NPU_TORCHAIR_RUN_EAGERLY``: torchair's ``debug.run_eagerly`` (build
  the GE graph, then run the FX graph eagerly); default off on an NPU, always on off-NPU (GE cannot run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

#: Every fusion family this project knows, in pass order (a family may rewrite what a later one matches). The one
#: list of names: the registry :data:`qwen_npu_compile.patterns.FAMILIES` is built from it (each family's class in
#: its ``patterns/`` file), so this module, ``qwen-npu-compile --help`` and ``report`` need no torch.
ALL_FAMILIES: tuple[str, ...] = ("gated_delta_rule", "rms_norm_gated", "rms_norm", "moe", "swiglu", "rotary", "attention")
#: The values of option ``recompute`` / ``QWEN_NPU_RECOMPUTE``, default first (what each does:
#: :mod:`qwen_npu_compile.handoff.recompute`).
RECOMPUTE_SETTINGS: tuple[str, ...] = ("none", "cheap")
DOWNSTREAMS: tuple[str, ...] = ("torchair", "aot_eager", "eager", "inductor")

ENV_FUSIONS = "QWEN_NPU_FUSIONS"
ENV_DUMP_DIR = "QWEN_NPU_DUMP_DIR"
ENV_DOWNSTREAM = "QWEN_NPU_DOWNSTREAM"
ENV_STRICT = "QWEN_NPU_STRICT"
ENV_RECOMPUTE = "QWEN_NPU_RECOMPUTE"
ENV_TORCHAIR_MODE = "QWEN_NPU_TORCHAIR_MODE"
ENV_TORCHAIR_DUMP = "QWEN_NPU_TORCHAIR_DUMP"
ENV_TORCHAIR_RUN_EAGERLY = "QWEN_NPU_TORCHAIR_RUN_EAGERLY"
#: The environment variable that switches :func:`qwen_npu_compile.maybe_compile` on (and the verl hook).
ENV_COMPILE = "QWEN_NPU_COMPILE"

#: torchair ``CompilerConfig.mode`` values this backend accepts (torch_npu 2.13.0
#: ``torchair/configs/compiler_config.py``; "npugraph_ex" is a separate torchair backend).
TORCHAIR_MODES: tuple[str, ...] = ("max-autotune", "reduce-overhead")
#: torchair ``debug.graph_dump.type`` values (torch_npu 2.13.0 ``torchair/configs/debug_config.py``).
TORCHAIR_DUMP_TYPES: tuple[str, ...] = ("pbtxt", "txt", "py")

_OPTION_TO_ENV = {
    "fusions": ENV_FUSIONS,
    "dump_dir": ENV_DUMP_DIR,
    "downstream": ENV_DOWNSTREAM,
    "strict": ENV_STRICT,
    "recompute": ENV_RECOMPUTE,
    "torchair_mode": ENV_TORCHAIR_MODE,
    "torchair_dump": ENV_TORCHAIR_DUMP,
    "torchair_run_eagerly": ENV_TORCHAIR_RUN_EAGERLY,
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class QwenNpuConfigError(ValueError):
    """A bad ``qwen_npu`` setting: an unknown option key, a malformed option or ``QWEN_NPU_*`` value,
    ``torch.compile(mode=...)``, or torchair settings that cannot run here.

    The message is one line: where the value came from, what is wrong, the valid choices and, where a value
    is close to one of them, the closest (``did you mean 'rms_norm'?``). A ``ValueError``, so that code
    catching ``ValueError`` keeps working. Raised by :meth:`QwenNpuConfig.from_options` (``maybe_compile``,
    the Trainer callback and ``check`` call it before anything runs) and, for ``torch.compile(...,
    backend="qwen_npu")``, at the first call of the compiled model without Dynamo's wrapping
    (:func:`qwen_npu_compile.compat.through_dynamo`).
    """


def closest(value: object, choices: Iterable[str]) -> str | None:
    """The choice closest to ``value`` (case and surrounding blanks ignored; ``difflib`` ratio >= 0.6), or None."""
    close = difflib.get_close_matches(str(value).strip().lower(), list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` with :func:`closest` ``X``, or ``""`` when no choice is close."""
    match = closest(value, choices)
    return "" if match is None else f" (did you mean {match!r}?)"


@dataclasses.dataclass(frozen=True)
class QwenNpuConfig:
    """Validated settings of one ``qwen_npu`` compile.

    Attributes:
        fusions: the enabled families, a subset of :data:`ALL_FAMILIES`.
        dump_dir: folder for graph dumps and ``summary.json``; None disables dumping.
        downstream: the backend the rewritten graph is handed to; None means "choose at compile time"
            (torchair with a real torch_npu, aot_eager otherwise).
        strict: when True, a refused or near-missed match of an enabled family raises
            :class:`qwen_npu_compile.report.FusionError`.
        torchair_mode: torchair's ``CompilerConfig.mode``, one of :data:`TORCHAIR_MODES`.
        torchair_dump: torchair's GE graph dump type (one of :data:`TORCHAIR_DUMP_TYPES`) or None.
        torchair_run_eagerly: torchair's ``debug.run_eagerly``; None means "off on an NPU, on off-NPU".
        recompute: what the AOT partition recomputes in the backward instead of saving, one of
            :data:`RECOMPUTE_SETTINGS` (``"none"``: nothing; ``"cheap"``: the cheap fused ops).
    """

    fusions: frozenset[str] = frozenset(ALL_FAMILIES)
    dump_dir: Path | None = None
    downstream: str | None = None
    strict: bool = False
    torchair_mode: str = "max-autotune"
    torchair_dump: str | None = None
    torchair_run_eagerly: bool | None = None
    recompute: str = "none"

    @classmethod
    def from_options(
        cls, options: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None,
        *, dump_dir_errors: str = "raise",
    ) -> QwenNpuConfig:
        """Build the config from ``torch.compile`` options, falling back to the environment.

        Args:
            options: the ``options=`` dict given to ``torch.compile`` (may be None).
            environ: the environment to read (default ``os.environ``).
            dump_dir_errors: ``"raise"`` (default): a ``dump_dir`` that cannot be written
                (:func:`dump_dir_problem`) is a ``ValueError``; ``"defer"``: it is kept, and the first
                failing write turns dumping off with one warning (the backend inside a training run:
                dumps never stop training, :mod:`qwen_npu_compile.dump`).

        Raises:
            QwenNpuConfigError: (a ``ValueError``) an unknown option key, an unknown family, a malformed
                boolean, an unknown downstream or (``dump_dir_errors="raise"``) a dump folder that cannot be
                written; the one-line message names the valid choices and where the value came from.
            ValueError: ``dump_dir_errors`` is neither ``"raise"`` nor ``"defer"`` (a caller's bug).
        """
        if dump_dir_errors not in ("raise", "defer"):
            raise ValueError(f"dump_dir_errors must be 'raise' or 'defer', got {dump_dir_errors!r}")
        if options is not None and not isinstance(options, Mapping):
            raise QwenNpuConfigError(f"qwen_npu: options must be a dict such as {{'fusions': 'all'}}, got {options!r}")
        options = dict(options or {})
        environ = os.environ if environ is None else environ
        unknown = sorted(set(options) - set(_OPTION_TO_ENV))
        if unknown:
            hint = did_you_mean(unknown[0], _OPTION_TO_ENV) if len(unknown) == 1 else ""
            raise QwenNpuConfigError(
                f"qwen_npu: unknown option(s) {unknown}{hint}; valid options are {sorted(_OPTION_TO_ENV)}"
            )

        def pick(key: str) -> tuple[object | None, str]:
            if key in options and options[key] is not None:
                return options[key], f"option {key!r}"
            env = _OPTION_TO_ENV[key]
            if env in environ:
                return environ[env], f"environment variable {env}"
            return None, ""

        fusions_value, where = pick("fusions")
        fusions = frozenset(ALL_FAMILIES) if fusions_value is None else parse_fusions(fusions_value, where)

        dump_value, where = pick("dump_dir")
        if dump_value not in (None, "") and not isinstance(dump_value, (str, os.PathLike)):
            raise QwenNpuConfigError(f"qwen_npu: {where} must be a folder path (str or Path), got {dump_value!r}")
        dump_dir = Path(os.fspath(dump_value)).expanduser() if dump_value not in (None, "") else None
        problem = dump_dir_problem(dump_dir) if dump_dir is not None and dump_dir_errors == "raise" else None
        if problem is not None:
            raise QwenNpuConfigError(f"qwen_npu: {where} = {str(dump_dir)!r} {problem}; choose a folder you can write "
                             f"(or unset it: dumping is off by default)")

        downstream_value, where = pick("downstream")
        downstream = None
        if downstream_value not in (None, ""):
            downstream = str(downstream_value).strip().lower()
            if downstream not in DOWNSTREAMS:
                raise QwenNpuConfigError(
                    f"qwen_npu: {where} = {downstream_value!r} is not a known downstream backend"
                    f"{did_you_mean(downstream, DOWNSTREAMS)}; choose one of {list(DOWNSTREAMS)}"
                )

        strict_value, where = pick("strict")
        strict = False if strict_value is None else parse_bool(strict_value, where)

        mode_value, where = pick("torchair_mode")
        torchair_mode = "max-autotune" if mode_value in (None, "") else parse_choice(mode_value, TORCHAIR_MODES, where)

        dump_type_value, where = pick("torchair_dump")
        torchair_dump = None
        if dump_type_value not in (None, "") and str(dump_type_value).strip().lower() not in ("none", "off"):
            torchair_dump = parse_choice(dump_type_value, TORCHAIR_DUMP_TYPES, where, extra="or 'none'")
            if dump_dir is None:
                raise QwenNpuConfigError(
                    f"qwen_npu: {where} = {dump_type_value!r} needs a dump folder: set option 'dump_dir' or "
                    f"{ENV_DUMP_DIR} (torchair's graphs go to <dump_dir>/<graph>/torchair/)"
                )

        eagerly_value, where = pick("torchair_run_eagerly")
        torchair_run_eagerly = None if eagerly_value in (None, "") else parse_bool(eagerly_value, where)

        recompute_value, where = pick("recompute")
        recompute = "none" if recompute_value in (None, "") else parse_choice(recompute_value, RECOMPUTE_SETTINGS, where)
        return cls(fusions=fusions, dump_dir=dump_dir, downstream=downstream, strict=strict,
                   torchair_mode=torchair_mode, torchair_dump=torchair_dump, torchair_run_eagerly=torchair_run_eagerly,
                   recompute=recompute)


def dump_dir_problem(path: Path) -> str | None:
    """Why graph dumps cannot be written under ``path``, or None when they can.

    ``path`` need not exist: its nearest existing ancestor must be a folder in which a file can be
    created (probed with a temporary file, removed at once; permission bits alone say nothing for root,
    nor about ``/proc``, read-only mounts or a full disk).

    Returns:
        ``"exists and is not a folder"``, ``"cannot be created: <ancestor> is not a folder"`` or
        ``"cannot be written: <ancestor>: creating a file there failed (<OS error>)"``; None when writable.
    """
    if path.exists() and not path.is_dir():
        return "exists and is not a folder"
    existing = path.absolute()
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be created: {str(existing)!r} is not a folder"
    try:
        handle, probe = tempfile.mkstemp(prefix=".qwen_npu_probe_", dir=existing)
    except OSError as exc:
        return f"cannot be written: {str(existing)!r}: creating a file there failed ({exc.strerror or exc})"
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def parse_fusions(value: object, where: str = "fusions") -> frozenset[str]:
    """Parse ``"all"``, ``"none"`` or a comma-separated list (or an iterable) of family names.

    An empty list means no family; an empty string is an error (say ``none``).

    Raises:
        QwenNpuConfigError: (a ``ValueError``) an unknown family name (``all``/``none`` mixed with names
            included) or an empty string; one line, with the closest family where one is close.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("all", "none"):
            return frozenset(ALL_FAMILIES) if text == "all" else frozenset()
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise QwenNpuConfigError(
                f"qwen_npu: {where} is empty; use 'all', 'none' or a comma-separated subset of {list(ALL_FAMILIES)}"
            )
    elif isinstance(value, Iterable):
        items = [str(item).strip().lower() for item in value]
    else:
        raise QwenNpuConfigError(f"qwen_npu: {where} must be a string or a list of families, got {value!r}")
    bad = [item for item in items if item not in ALL_FAMILIES]
    if bad:
        pairs = [(item, match) for item in bad if (match := closest(item, ALL_FAMILIES)) is not None]
        if len(bad) == 1 and pairs:
            hint = f" (did you mean {pairs[0][1]!r}?)"
        else:
            hint = f" (did you mean {', '.join(f'{m!r} for {i!r}' for i, m in pairs)}?)" if pairs else ""
        raise QwenNpuConfigError(
            f"qwen_npu: {where} names unknown fusion famil{'y' if len(bad) == 1 else 'ies'} {bad}{hint}; "
            f"valid: 'all', 'none' or a comma-separated subset of {list(ALL_FAMILIES)}"
        )
    return frozenset(items)


def parse_choice(value: object, choices: tuple[str, ...], where: str, extra: str = "") -> str:
    """Parse one of ``choices`` (case-insensitive, surrounding blanks ignored).

    Raises:
        QwenNpuConfigError: (a ``ValueError``) any other value (or a non-string); the one-line message lists
            the choices, and the closest where one is close.
    """
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in choices:
        raise QwenNpuConfigError(f"qwen_npu: {where} = {value!r} is not valid{did_you_mean(value, choices)}; "
                                 f"choose one of {list(choices)}{' ' + extra if extra else ''}")
    return text


def parse_bool(value: object, where: str) -> bool:
    """Parse a boolean option or env value (``1/true/yes/on``, ``0/false/no/off``).

    Raises:
        QwenNpuConfigError: (a ``ValueError``) any other value; the closest spelling where one is close.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    hint = did_you_mean(text, sorted((_TRUE | _FALSE) - {""}))
    raise QwenNpuConfigError(f"qwen_npu: {where} = {value!r} is not a boolean{hint}; "
                             "use one of 1/true/yes/on or 0/false/no/off")
