"""The drift canary (``python tools/stack_matrix.py newest``), kept out of CI: an upstream release must not block a
landing (``.ci/run`` does not run it).

It resolves the registry's newest final releases of torch, transformers, flash-linear-attention, fla-core and verl,
builds them in one venv (torch through the wheelhouse of :mod:`stack_matrix`, the pip cap lifted), runs the whole
``stack_compat`` selection, ``check qwen2.5-0.5b`` and ``check qwen3.5-0.8b`` (2 and 4 layers, vocab 4096) and the
simulated Ascend host's Qwen3.5 test, prints one dated row (``newest as of DATE: torch X, transformers Y, FLA Z,
verl W: ok`` or what broke) and with ``--write`` puts it first in its own section of ``docs/supported-stacks.md``
(one row per date). verl is resolved, not installed: its base requirements are compared with the stack, and a pin
that excludes it is noted in the row. Exit status 0 ok, 1 something broke, 2 the releases could not be resolved.
Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from stack_matrix import (
    MARKER,
    PROTOBUF_PIN,
    PYTEST_PIN,
    ROOT,
    TABLE_PAGE,
    XDIST_PIN,
    install_from_wheelhouse,
    junit_cases,
    log,
    pip,
    remove_in_background,
    wait_for_removals,
    wheel_env,
)

#: What the canary resolves, in the order of its row: the registry's newest final release of each; torch_npu
#: too, not installed (it needs CANN): where it does not pair with the newest torch, the wheel-contract cases and
#: the stand-in torch_npu of the simulated Ascend host read its wheel (``QWEN_NPU_TORCH_NPU_WHEEL``), as the
#: matrix's stack ahead of Ascend does
NEWEST_PACKAGES = ("torch", "transformers", "flash-linear-attention", "fla-core", "verl", "torch-npu")
#: where the canary reads a package's releases (PyPI's JSON API; ``$QWEN_NPU_PYPI_JSON`` for a mirror that serves it)
PYPI_JSON = os.environ.get("QWEN_NPU_PYPI_JSON", "https://pypi.org/pypi")
#: the canary's rows live between these markers of :data:`TABLE_PAGE`, apart from the support table, which
#: only CI's measurements may change (``table --check``)
CANARY_BEGIN = "<!-- newest-canary:begin (rows written by tools/stack_matrix.py newest; newest first, one per date) -->"
CANARY_END = "<!-- newest-canary:end -->"
CANARY_ROW_PREFIX = "- newest as of "
#: the models the canary checks: a dense Qwen2.5 and the hybrid Qwen3.5 (Gated DeltaNet), as the README runs them
CANARY_CHECKS = (("qwen2.5-0.5b", "--layers", "2", "--vocab-size", "4096"),
                 ("qwen3.5-0.8b", "--layers", "4", "--vocab-size", "4096"))
#: the simulated Ascend host's Qwen3.5 test (tools/ascend_host_check.sh runs the whole folder)
CANARY_ASCEND_TEST = "tests/ascend_host/test_gated_delta_rule_npu.py"

_FINAL_RELEASE = re.compile(r"^(\d+(?:\.\d+)*)(?:\.post(\d+))?$")


def release_key(version: str) -> tuple[tuple[int, ...], int] | None:
    """A sort key of a final release (``2.15.0``, ``0.9.1.post1``), None for anything else (a pre-release, a dev
    build, a local version): the canary tracks what ``pip install NAME`` gives, which skips pre-releases."""
    match = _FINAL_RELEASE.match(version.strip())
    if match is None:
        return None
    release = tuple(int(part) for part in match.group(1).split("."))
    while len(release) > 1 and release[-1] == 0:  # 2.15 == 2.15.0
        release = release[:-1]
    return release, int(match.group(2) or 0)


def newest_release(pypi_json: dict) -> str:
    """The newest final release in a PyPI JSON API answer (``/pypi/NAME/json``) with at least one file not yanked.

    Raises:
        ValueError: there is none.
    """
    candidates = []
    for version, files in (pypi_json.get("releases") or {}).items():
        key = release_key(version)
        if key is not None and any(not f.get("yanked", False) for f in files):
            candidates.append((key, version))
    if not candidates:
        name = (pypi_json.get("info") or {}).get("name", "?")
        raise ValueError(f"{name}: no final release with an unyanked file")
    return max(candidates)[1]


def parse_pip_index_versions(text: str) -> str:
    """The newest version in ``pip index versions NAME``'s output (its first line: ``NAME (VERSION)``).

    Raises:
        ValueError: the output has no such line.
    """
    for line in text.splitlines():
        match = re.match(r"^\s*\S+ \(([^)]+)\)\s*$", line)
        if match:
            return match.group(1)
    raise ValueError(f"no 'NAME (VERSION)' line in pip index versions' output: {text.strip()[:200]!r}")


def _resolve_one(name: str) -> tuple[str, dict]:
    """``(newest version, its PyPI JSON answer or {})``: PyPI's JSON API, else ``pip index versions`` (which asks
    the indexes pip is configured with)."""
    import urllib.request
    try:
        with urllib.request.urlopen(f"{PYPI_JSON}/{name}/json", timeout=60) as answer:
            data = json.load(answer)
        return newest_release(data), data
    except (OSError, ValueError) as exc:
        log(f"newest: {PYPI_JSON}/{name}/json failed ({exc}); asking pip index versions")
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True,
                          env=dict(os.environ, PIP_CONSTRAINT=os.devnull))
    return parse_pip_index_versions(proc.stdout), {}


def base_requirements(pypi_json: dict, packages: tuple[str, ...] = ("torch", "transformers")) -> list[str]:
    """The requirements of a release (``info.requires_dist``) on ``packages`` outside any extra
    (``'transformers!=5.6.0,<5.11,>=5.5.3'``): what ``pip install NAME`` holds the stack to."""
    found = []
    for requirement in (pypi_json.get("info") or {}).get("requires_dist") or []:
        spec, _, marker = requirement.partition(";")
        if "extra" in marker:
            continue
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)", spec)
        if match and match.group(1).lower().replace("_", "-") in packages:
            found.append(spec.strip().replace(" ", ""))
    return found


def render_canary_row(day: str, versions: dict[str, str], problems: list[str], notes: list[str] = ()) -> str:
    """One row of the canary's section: ``- newest as of DAY: torch X, transformers Y, FLA Z (fla-core Z'), verl W:
    ok`` (or ``broke: ...`` with each problem), notes after it."""
    fla = versions.get("flash-linear-attention", "?")
    core = versions.get("fla-core", "?")
    fla_text = f"FLA {fla}" + (f" (fla-core {core})" if core != fla else "")
    head = (f"{CANARY_ROW_PREFIX}{day}: torch {versions.get('torch', '?')}, transformers "
            f"{versions.get('transformers', '?')}, {fla_text}, verl {versions.get('verl', '?')}")
    verdict = "ok" if not problems else "broke: " + "; ".join(problems)
    row = f"{head}: {verdict}"
    if notes:
        row += " (" + "; ".join(notes) + ")"
    return row


def insert_canary_row(page: str, row: str) -> str:
    """``page`` with ``row`` first in the canary's section; a row of the same date is replaced (one row per date).

    Raises:
        ValueError: the page has no canary markers.
    """
    begin, end = page.find(CANARY_BEGIN), page.find(CANARY_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no canary section ({CANARY_BEGIN!r} ... {CANARY_END!r})")
    day = row[len(CANARY_ROW_PREFIX):].split(":", 1)[0]
    body = page[begin + len(CANARY_BEGIN):end]
    rows = [line for line in body.splitlines() if line.startswith(CANARY_ROW_PREFIX)
            and line[len(CANARY_ROW_PREFIX):].split(":", 1)[0] != day]
    return page[:begin] + "\n".join([CANARY_BEGIN, row, *rows, ""]) + page[end:]


def _tail_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def newest(args: argparse.Namespace) -> int:
    """``newest``: resolve, build and check the newest releases; write one dated row (module docstring). Exit 1 when
    something broke, 2 when the stack could not be resolved or built (CI never runs this: an upstream release must
    not block a landing)."""
    day = date.today().isoformat()
    versions, answers = {}, {}
    pins = dict(item.partition("=")[::2] for item in args.pin)
    unknown = sorted(set(pins) - set(NEWEST_PACKAGES))
    if unknown or not all(pins.values()):
        raise SystemExit(f"--pin {args.pin}: expected NAME=VERSION with NAME one of {', '.join(NEWEST_PACKAGES)}")
    try:
        for name in NEWEST_PACKAGES:
            if pins.get(name):
                versions[name], answers[name] = pins[name], {}
            else:
                versions[name], answers[name] = _resolve_one(name)
    except (ValueError, OSError) as exc:
        log(f"newest: could not resolve the newest releases: {exc}")
        return 2
    log("newest: " + ", ".join(f"{name} {version}" for name, version in versions.items()))
    if args.resolve_only:
        return 0
    problems: list[str] = []
    notes: list[str] = []
    # verl is not installed: its own requirements (ray, and its extras' torch 2.11 / transformers 5.9 pins) would
    # hold the stack back; its base pins say whether a verl user can have this stack at all
    held = [spec for spec in base_requirements(answers.get("verl", {}))
            if not _admits(spec, versions)]
    if held:
        notes.append(f"verl {versions['verl']} requires {', '.join(held)}")
    workdir = Path(tempfile.mkdtemp(prefix="qwen_npu_newest_"))
    lifted = dict(os.environ, PIP_CONSTRAINT=os.devnull)  # the newest torch may lie beyond a host's cap
    try:
        subprocess.run([sys.executable, "-m", "venv", str(workdir / "venv")], check=True)
        python = workdir / "venv" / "bin" / "python"
        requirements = [f"{name}=={versions[name]}" for name in NEWEST_PACKAGES if name not in ("verl", "torch-npu")]
        # accelerate (its newest, unpinned): the Trainer case of the compatibility suite skips without it
        install_from_wheelhouse(python, Path(args.wheelhouse),
                                 [*requirements, "accelerate", PYTEST_PIN, XDIST_PIN, PROTOBUF_PIN], env=lifted)
        pip(python, "install", "-q", "--no-deps", "-e", str(ROOT), env=lifted)
    except subprocess.CalledProcessError as exc:
        problems.append(f"install failed ({exc})")
    test_env = None
    if not problems and _minor(versions["torch-npu"]) != _minor(versions["torch"]):
        notes.append(f"no torch_npu for torch {'.'.join(map(str, _minor(versions['torch'])))}: the wheel contracts "
                     f"and the simulated Ascend host read torch_npu {versions['torch-npu']}'s wheel")
        try:
            test_env = wheel_env(python, versions["torch-npu"])
        except subprocess.CalledProcessError as exc:
            problems.append(f"torch_npu {versions['torch-npu']}'s wheel could not be obtained "
                            f"({exc.stderr.strip()[-160:]})")
    if not problems:
        problems += _canary_checks(python, workdir, test_env)
    if not args.keep:
        remove_in_background(workdir)
    row = render_canary_row(day, versions, problems, notes)
    print(row, flush=True)
    if args.write:
        TABLE_PAGE.write_text(insert_canary_row(TABLE_PAGE.read_text(), row))
        log(f"newest: wrote the row into {TABLE_PAGE.relative_to(ROOT)}")
    wait_for_removals()  # the venv (~6 GB) takes a minute or more to delete; the row is out already
    return 1 if problems else 0


def _admits(spec: str, versions: dict[str, str]) -> bool:
    """Whether a requirement like ``transformers!=5.6.0,<5.11,>=5.5.3`` admits the resolved version of its package
    (comparison operators on final releases; anything else counts as admitted)."""
    name, clauses = re.match(r"^([A-Za-z0-9_.\-]+)(.*)$", spec).groups()
    have = release_key(versions.get(name.lower().replace("_", "-"), ""))
    if have is None:
        return True
    for clause in filter(None, clauses.split(",")):
        match = re.match(r"^(==|!=|<=|>=|<|>|~=)([0-9.]+)(\.\*)?$", clause.strip())
        if match is None:
            continue
        op, text, wildcard = match.groups()
        other = release_key(text)
        if other is None:
            continue
        if wildcard or op == "~=":
            # ==5.0.* and ~=5.20 (>=5.20, ==5.*) compare a release prefix, zeros included
            written = tuple(int(part) for part in text.split("."))
            prefix = written[:-1] if op == "~=" else written
            padded = have[0] + (0,) * max(0, len(prefix) - len(have[0]))
            inside = padded[:len(prefix)] == prefix and (op != "~=" or have >= other)
            ok = not inside if op == "!=" else inside
        else:
            ok = {"==": have == other, "!=": have != other, "<=": have <= other, ">=": have >= other,
                  "<": have < other, ">": have > other}[op]
        if not ok:
            return False
    return True


def _minor(version: str) -> tuple[int, ...]:
    """``(major, minor)`` of a version (``2.10.0.post7`` → ``(2, 10)``)."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def _canary_checks(python: Path, workdir: Path, test_env: dict[str, str] | None = None) -> list[str]:
    """The canary's checks in the built environment (``test_env``: the environment of the compatibility suite and the
    simulated Ascend host, which read a torch_npu wheel); one line per problem."""
    problems = []
    junit = workdir / "junit.xml"
    log(f"newest: pytest -m {MARKER!r}")
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-m", MARKER, "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "worksteal", "-o", "junit_family=xunit1", f"--junitxml={junit}"], cwd=ROOT,
                          env=test_env)
    cases = junit_cases(junit) if junit.exists() else []
    bad = [case["id"] for case in cases if case["outcome"] in ("failed", "error")]
    passed = sum(case["outcome"] == "passed" for case in cases)
    if proc.returncode != 0 or not passed:
        problems.append(f"stack_compat {passed}/{len(cases)} passed (exit {proc.returncode}"
                        + (f"; failed: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}" if bad else "") + ")")
    for check in CANARY_CHECKS:
        log(f"newest: qwen-npu-compile check {' '.join(check)}")
        proc = subprocess.run([str(python), "-m", "qwen_npu_compile", "check", *check], cwd=ROOT,
                              capture_output=True, text=True)
        print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
        if proc.returncode != 0:
            problems.append(f"check {check[0]} exit {proc.returncode} ({_tail_line(proc.stdout + proc.stderr)})")
    log(f"newest: the simulated Ascend host's {CANARY_ASCEND_TEST}")
    # the stand-in torch_npu reads the npu op schemas from the same wheel as the wheel-contract cases
    env = dict(test_env or os.environ, PYTHONPATH=str(ROOT / "tests" / "ascend_host" / "stand_in"))
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", CANARY_ASCEND_TEST], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", flush=True)
    if proc.returncode != 0:
        problems.append(f"simulated Ascend host Qwen3.5 test exit {proc.returncode} "
                        f"({_tail_line(proc.stdout) or _tail_line(proc.stderr)})")
    return problems
