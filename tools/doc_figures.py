"""Measure the times and counts the README and docs/ quote, and write them to ``docs/figures.json``.

Every figure in the user docs that depends on the machine (how long a ``check`` takes, what it prints, the
test suite's time) or on the code (how many pattern variants exist) or on the package registry (how large
the CUDA build of torch is) comes from this script's last run; the docs cite the entry next to the figure
(``docs/figures.json``: ``checks.qwen2.5-0.5b-2-layers``). Each entry records the machine it ran on (cores,
CPU model, memory), the load average before and after, and the versions.

Usage::

    python tools/doc_figures.py                      # the README's check commands, the variant count, the PyPI sizes
    python tools/doc_figures.py --only checks        # a subset: checks, variants, pypi, suite
    python tools/doc_figures.py --slow               # also all 24 layers of qwen2.5-0.5b, and 2 with the full vocab (minutes)
    python tools/doc_figures.py --only checks --checks qwen2.5-0.5b-2-layers   # one check
    python tools/doc_figures.py --suite              # also the whole test suite (the README's command; 15-20 min on 2 cores)

Entries not measured in a run keep their previous values (the file is merged, entry by entry). Run it
inside the README's venv (``.venv``), on an otherwise idle machine: the load average is recorded because
times on a shared machine are upper bounds. Standard library only, except ``packaging`` (a pip dependency)
for the PyPI part.

Raises nothing on a failed measurement: the entry records ``exit`` and the tail of stderr, and the script
exits 1 at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "figures.json"
#: ``qwen-npu-compile`` in a process that reports its own peak RSS (``ru_maxrss``) on its last stderr line
CLI = [sys.executable, "-c",
       "import resource, sys\n"
       "from qwen_npu_compile import cli\n"
       "try:\n    status = cli.main(sys.argv[1:])\nexcept SystemExit as exc:\n    status = exc.code\n"
       "sys.stdout.flush()\n"
       "print('DOC_FIGURES_MAXRSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
       "sys.exit(status)"]

#: The ``check`` commands the README and docs/check.md show, by the key the docs cite.
CHECKS = {
    "qwen2.5-0.5b-2-layers": ["check", "qwen2.5-0.5b", "--layers", "2", "--vocab-size", "4096"],
    "qwen3.5-0.8b-4-layers": ["check", "qwen3.5-0.8b", "--layers", "4", "--vocab-size", "4096"],
}
#: ``--slow``: minutes on a laptop-class CPU
SLOW_CHECKS = {
    "qwen2.5-0.5b-all-layers": ["check", "qwen2.5-0.5b"],
    "qwen2.5-0.5b-2-layers-full-vocab": ["check", "qwen2.5-0.5b", "--layers", "2"],
}
#: the README's test command
SUITE = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile"]

#: The CUDA build PyPI serves for the README's pin (Linux x86_64, CPython 3.11).
PYPI_TORCH = ("torch", "2.13.0")
PYPI_TAG = "cp311"
PYPI_SIMPLE = "https://pypi.org/simple/{name}/"
#: which of torch's requirements belong to its CUDA build (the rest, sympy, networkx, ..., a CPU build needs too)
CUDA_PREFIXES = ("nvidia-", "cuda-", "triton")


def machine() -> dict:
    """Cores, CPU model, its bf16 instructions, memory, OS and Python of this host."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or "?")
    mem = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal")), 0)
    flags = next((line.split(":", 1)[1].split() for line in _read("/proc/cpuinfo").splitlines()
                  if line.startswith("flags")), [])
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "mem_total_gib": round(mem / 2**20, 1),
            # bf16 matmuls on a CPU: fast with AVX512-BF16 / AMX, slow with AVX2 only (check's LM head)
            "cpu_bf16": [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags] or ["none (avx2 only)" if "avx2" in flags else "none"],
            "platform": platform.platform(), "python": platform.python_version()}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages (``os.getloadavg``)."""
    return [round(x, 2) for x in os.getloadavg()]


def versions() -> dict:
    """torch and transformers of the interpreter that runs the checks (a subprocess: this script imports neither)."""
    code = "import torch, transformers, json; print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}


def timed(argv: list[str], timeout: float) -> dict:
    """Run ``argv`` in the repository root (no ``QWEN_NPU_*`` variables): exit status, wall seconds, load average
    before and after, stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_NPU_")}
    before = loadavg()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    seconds = time.perf_counter() - start
    return {"command": " ".join(argv), "exit": proc.returncode, "seconds": round(seconds, 1),
            "loadavg_before": before, "loadavg_after": loadavg(), "stdout": out, "stderr": err}


def run_check(name: str, args: list[str], timeout: float) -> dict:
    """One ``qwen-npu-compile check``: its time, peak memory, exit status, progress lines and printed table."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = timed(CLI + args, timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    err = result.pop("stderr")
    out = result.pop("stdout")
    rss = [line for line in err.splitlines() if line.startswith("DOC_FIGURES_MAXRSS_KIB ")]
    err = "\n".join(line for line in err.splitlines() if not line.startswith("DOC_FIGURES_MAXRSS_KIB "))
    # check's stage lines (stdout): "[i/n] what ..." and "      done in N.Ns"
    progress = [line for line in out.splitlines() if re.match(r"^\[\d+/\d+\] |^ +done in ", line)]
    result.update({
        "command": "qwen-npu-compile " + " ".join(args),
        "cpu_seconds": round((after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime), 1),
        "peak_rss_gib": round(int(rss[-1].split()[1]) / 2**20, 2) if rss else None,
        "progress_lines": len(progress),
        "progress": progress,
        "stages": sum(1 for line in progress if line.startswith("[")),
        "output": [line for line in out.strip("\n").splitlines() if line not in progress and line.strip()],
        "stderr": err.splitlines()[-20:],
    })
    verdict = next((line for line in result["output"] if line.startswith("verdict:")), None)
    result["verdict"] = verdict.split(":", 1)[1].strip() if verdict else None
    print(f"[doc_figures] {name}: {result['verdict']} in {result['seconds']} s "
          f"(load {result['loadavg_before'][0]} -> {result['loadavg_after'][0]}, {result['progress_lines']} progress lines)",
          file=sys.stderr, flush=True)
    return result


_VARIANTS = """
import json
from qwen_npu_compile import patterns
import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback, as a MoE model's import does)
counts = {name: sum(1 for _ in family().iter_variants()) for name, family in patterns.FAMILIES.items()}
print(json.dumps(counts))
"""


def variants() -> dict:
    """Pattern variants per family, as a process that has imported transformers' MoE integration sees them."""
    done = subprocess.run([sys.executable, "-c", _VARIANTS], capture_output=True, text=True, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        return {"exit": done.returncode, "error": done.stderr[-2000:]}
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    return {"per_family": counts, "total": sum(counts.values()),
            "note": "patterns.FAMILIES[name]().iter_variants() in a fresh process after importing "
                    "transformers.integrations.moe (moe's fp32/fp16 pair needs transformers' grouped_mm_fallback op); "
                    "gated_delta_rule has none: its op is put in place while Dynamo traces"}


def _simple(name: str) -> dict:
    """PEP 691 JSON of PyPI's simple index for ``name`` (files with their ``size``, PEP 700)."""
    request = urllib.request.Request(PYPI_SIMPLE.format(name=name), headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def _wheel(name: str, version: str, files: list[dict]) -> dict | None:
    """The Linux x86_64 wheel of ``name==version`` pip would take for CPython 3.11 (tag match, then any manylinux,
    then a pure-Python wheel)."""
    stem = re.sub(r"[-_.]+", "_", name).lower()
    wheels = [f for f in files if f["filename"].endswith(".whl")
              and re.sub(r"[-_.]+", "_", f["filename"].split("-")[0]).lower() == stem
              and f["filename"].split("-")[1] == version and not f.get("yanked")]
    linux = [f for f in wheels if "x86_64" in f["filename"] and ("manylinux" in f["filename"] or "linux" in f["filename"])]
    exact = [f for f in linux if f"-{PYPI_TAG}-" in f["filename"]] or [f for f in linux if "-py3-" in f["filename"]
                                                                        or "-abi3-" in f["filename"]]
    pure = [f for f in wheels if f["filename"].endswith("-none-any.whl")]
    return (exact or linux or pure or [None])[0]


def _metadata(wheel: dict) -> str:
    """A wheel's METADATA: PEP 658's ``.metadata`` file where the index serves one, else read from the wheel itself
    (only small wheels, such as the ``cuda-toolkit`` metapackage; a large one without metadata reads as empty)."""
    import urllib.error

    try:  # the index may serve it without announcing it (``core-metadata``)
        with urllib.request.urlopen(wheel["url"] + ".metadata", timeout=120) as response:
            return response.read().decode()
    except urllib.error.HTTPError:
        pass
    if wheel["size"] > 10 * 2**20:
        return ""
    import io
    import zipfile

    with urllib.request.urlopen(wheel["url"], timeout=120) as response:
        archive = zipfile.ZipFile(io.BytesIO(response.read()))
    name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    return archive.read(name).decode()


def pypi_cuda_build() -> dict:
    """Sizes of the CUDA build of torch 2.13.0 that PyPI serves for Linux x86_64 and of the CUDA wheels it pulls in.

    Resolves torch's ``Requires-Dist`` (from the wheel's PEP 658 metadata) for Linux, CPython 3.11, following
    the CUDA packages (:data:`CUDA_PREFIXES`) and their own requirements, each at the newest version its
    specifier admits; sizes from PyPI's JSON simple index (PEP 691/700), nothing downloaded but metadata.
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    name, version = PYPI_TORCH
    env = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64",
           "python_version": "3.11", "python_full_version": "3.11.7", "implementation_name": "cpython",
           "os_name": "posix", "platform_python_implementation": "CPython"}
    torch_wheel = _wheel(name, version, _simple(name)["files"])
    sizes: dict[str, dict] = {}
    queue: list[tuple[str, str, list[str], dict]] = [(name, version, [], torch_wheel)]
    while queue:
        pkg, ver, extras, wheel = queue.pop()
        metadata = _metadata(wheel)
        for line in metadata.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if not req.name.lower().startswith(CUDA_PREFIXES):
                continue
            if req.marker and not any(req.marker.evaluate({**env, "extra": extra}) for extra in extras or [""]):
                continue
            key = req.name.lower()
            if key in sizes:
                continue
            files = _simple(req.name)["files"]
            candidates = sorted({f["filename"].split("-")[1] for f in files if f["filename"].endswith(".whl")},
                                key=Version, reverse=True)
            chosen = next((v for v in candidates if req.specifier.contains(v, prereleases=False)), None)
            found = _wheel(req.name, chosen, files) if chosen else None
            sizes[key] = {"version": chosen, "file": found["filename"] if found else None,
                          "bytes": found["size"] if found else 0}
            if found:
                queue.append((req.name, chosen, sorted(req.extras), found))
    cuda = sum(entry["bytes"] for entry in sizes.values())
    return {"torch": {"version": version, "file": torch_wheel["filename"], "bytes": torch_wheel["size"]},
            "cuda_packages": dict(sorted(sizes.items())), "cuda_packages_bytes": cuda,
            "total_bytes": torch_wheel["size"] + cuda,
            "source": "PyPI JSON simple index (PEP 691/700 sizes) and the wheels' PEP 658 metadata; Linux x86_64, "
                      "CPython 3.11; wheel sizes (download), not installed sizes"}


def suite(timeout: float) -> dict:
    """The README's test command: wall time and CPU time (user + system of every process it ran)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = timed(SUITE, timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = result.pop("stdout")
    result.pop("stderr")
    result["cpu_minutes"] = round(((after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)) / 60, 1)
    result["minutes"] = round(result["seconds"] / 60, 1)
    result["summary"] = next((line for line in reversed(out.splitlines()) if " passed" in line or " failed" in line), None)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="figures file, merged entry by entry (default %(default)s)")
    parser.add_argument("--only", default="checks,variants,pypi", help="comma-separated parts: checks, variants, pypi, suite")
    parser.add_argument("--slow", action="store_true", help="also the full-size checks (%s)" % ", ".join(SLOW_CHECKS))
    parser.add_argument("--checks", default="", help="only these checks (comma-separated keys of CHECKS / SLOW_CHECKS)")
    parser.add_argument("--suite", action="store_true", help="also the whole test suite (the README's command)")
    args = parser.parse_args(argv)
    parts = {p for p in args.only.split(",") if p} | ({"suite"} if args.suite else set())
    unknown = parts - {"checks", "variants", "pypi", "suite"}
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from checks, variants, pypi, suite")
    out = Path(args.out)
    figures = json.loads(out.read_text()) if out.exists() else {}
    stamp = {"measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
             "versions": versions()}
    failed = []
    if "checks" in parts:
        checks = figures.setdefault("checks", {})
        selected = {**CHECKS, **(SLOW_CHECKS if args.slow else {})}
        if args.checks:
            wanted = [n for n in args.checks.split(",") if n]
            unknown_checks = sorted(set(wanted) - set(CHECKS) - set(SLOW_CHECKS))
            if unknown_checks:
                parser.error(f"unknown check(s) {unknown_checks}; known: {', '.join([*CHECKS, *SLOW_CHECKS])}")
            selected = {n: {**CHECKS, **SLOW_CHECKS}[n] for n in wanted}
        for name, check_args in selected.items():
            checks[name] = {**run_check(name, check_args, timeout=3600), **stamp}
            if checks[name]["exit"] != 0:
                failed.append(name)
    if "variants" in parts:
        figures["variants"] = {**variants(), **stamp}
    if "pypi" in parts:
        try:
            figures["pypi_cuda_build"] = {**pypi_cuda_build(), "measured": stamp["measured"]}
        except OSError as exc:  # no network: keep the previous entry
            print(f"[doc_figures] PyPI not reachable ({exc}); pypi_cuda_build left as it was", file=sys.stderr)
            failed.append("pypi")
    if "suite" in parts:
        figures["suite"] = {**suite(timeout=4 * 3600), **stamp}
        if figures["suite"]["exit"] != 0:
            failed.append("suite")
    out.write_text(json.dumps(figures, indent=2, ensure_ascii=False) + "\n")
    print(f"[doc_figures] wrote {out}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
