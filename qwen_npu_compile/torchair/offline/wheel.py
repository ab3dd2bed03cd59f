"""Obtain torchair's Python sources from the torch_npu wheel that pairs with the installed torch.

The wheel is downloaded (``pip download --no-deps``, with the current interpreter's pip) into a cache,
or taken from a file/folder the user names; it is never installed (an installed torch_npu without CANN
breaks ``import torch``). Only what the off-NPU check reads is extracted, after verification:

- ``torch_npu/dynamo/torchair/`` without its ``.so`` extension modules (replaced by :mod:`.stubs`),
- ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (the npu op schemas),
- ``torch_npu/op_plugin/meta/_meta_registrations.py`` (the npu ops' meta kernels).

Verification: every extracted member is read through ``zipfile`` (which checks its CRC-32) and its
sha256 must equal the one in the wheel's ``.dist-info/RECORD``; a downloaded wheel's sha256 (pip checked
it against the index) is kept beside it in ``<name>.whl.sha256`` and re-checked when the cached wheel
is reused.

Cache layout (``$QWEN_NPU_TORCHAIR_CACHE``, default ``$XDG_CACHE_HOME/qwen_npu_compile`` or
``~/.cache/qwen_npu_compile``)::

    wheels/torch_npu-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl (+ .sha256)
    extracted/torch_npu-2.13.0-<first 12 hex digits of the wheel's sha256>/torch_npu/...  (+ VERIFIED.json)
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import parse_wheel_filename
from packaging.version import InvalidVersion, Version

log = logging.getLogger("qwen_npu_compile")

ENV_CACHE = "QWEN_NPU_TORCHAIR_CACHE"
ENV_WHEEL = "QWEN_NPU_TORCH_NPU_WHEEL"

TORCHAIR_DIR = "torch_npu/dynamo/torchair/"
SCHEMAS_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
META_REGISTRATIONS = "torch_npu/op_plugin/meta/_meta_registrations.py"

#: Seconds allowed for ``pip download`` (the 2.13.0 and 2.14.0 wheels are about 43 MB each).
DOWNLOAD_TIMEOUT_S = 900

#: The torch_npu releases whose torchair, schemas and meta kernels CI checks (tools/stack_matrix.py: one per
#: stack, paired with its torch). 2.13.0 → 2.14.0 changed none of the files this package reads
#: (``npu_native_functions_by_codegen.yaml``, ``_meta_registrations.py`` and torchair's Python sources are
#: byte-identical; only torchair's CANN extension modules, replaced by stand-ins here, differ).
TESTED_TORCH_NPU = ("2.7.1", "2.9.0", "2.10.0", "2.11.0", "2.13.0", "2.14.0")


class TorchairUnavailableError(RuntimeError):
    """torchair's sources could not be obtained (no network and no usable wheel, or a bad wheel)."""


@dataclasses.dataclass(frozen=True)
class TorchairSources:
    """Verified, extracted parts of one torch_npu wheel.

    Attributes:
        torch_npu_version: the wheel's version, e.g. ``"2.13.0"`` or ``"2.13.0.post1"``.
        wheel: the wheel file they come from.
        import_root: the folder holding ``torchair/`` (import it as the top-level package ``torchair``).
        schemas_yaml: ``npu_native_functions_by_codegen.yaml``.
        meta_registrations: ``_meta_registrations.py``.
        seconds: wall time of ``obtain`` (find or download) and ``extract`` (0 when reused).
    """

    torch_npu_version: str
    wheel: Path
    import_root: Path
    schemas_yaml: Path
    meta_registrations: Path
    seconds: dict[str, float]


def paired_specifiers(torch_version: str) -> list[SpecifierSet]:
    """torch_npu versions that pair with ``torch_version``, most specific first.

    torch_npu releases carry the torch version they were built against (torch 2.13.0 → torch_npu
    2.13.0 or 2.13.0.postN). The first specifier matches the same major.minor.patch, the second any
    patch of the same major.minor (for a torch patch release without its own torch_npu).

    Raises:
        ValueError: ``torch_version`` is not a PEP 440 version.
    """
    try:
        release = Version(torch_version).release
    except InvalidVersion as exc:
        raise ValueError(f"cannot pair torch {torch_version!r} with a torch_npu release: {exc}") from exc
    major, minor, patch = (*release, 0, 0)[:3]
    return [SpecifierSet(f"=={major}.{minor}.{patch}.*"), SpecifierSet(f"=={major}.{minor}.*")]


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The cache folder: ``$QWEN_NPU_TORCHAIR_CACHE``, else ``$XDG_CACHE_HOME/qwen_npu_compile``, else
    ``~/.cache/qwen_npu_compile``."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_CACHE):
        return Path(environ[ENV_CACHE]).expanduser()
    base = Path(environ["XDG_CACHE_HOME"]).expanduser() if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "qwen_npu_compile"


def wheel_version(path: Path) -> Version | None:
    """The version of a ``torch_npu-*.whl`` file name, or None for any other file."""
    try:
        name, version, _, _ = parse_wheel_filename(path.name)
    except Exception:  # packaging.utils.InvalidWheelFilename and friends
        return None
    return version if name == "torch-npu" else None


def newest_matching(folder: Path, specifiers: list[SpecifierSet]) -> Path | None:
    """The newest ``torch_npu`` wheel in ``folder`` matching the first specifier that matches any."""
    wheels = [(wheel_version(path), path) for path in sorted(folder.glob("torch_npu-*.whl"))]
    wheels = [(version, path) for version, path in wheels if version is not None]
    for spec in specifiers:
        matching = [(version, path) for version, path in wheels if spec.contains(version, prereleases=False)]
        if matching:
            return max(matching)[1]
    return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def beyond_tested(torch_version: str) -> str | None:
    """A sentence for a torch newer than the newest torch_npu in :data:`TESTED_TORCH_NPU` (by major.minor), else None.

    Raises:
        ValueError: ``torch_version`` is not a PEP 440 version.
    """
    try:
        release = Version(torch_version).release[:2]
    except InvalidVersion as exc:
        raise ValueError(f"cannot pair torch {torch_version!r} with a torch_npu release: {exc}") from exc
    newest = max(TESTED_TORCH_NPU, key=Version)
    if release <= Version(newest).release[:2]:
        return None
    return (f"torch {torch_version} is newer than the newest torch_npu this package is tested with ({newest}; "
            f"torch_npu pins its own torch, so a torch without a torch_npu release has no torchair to convert with)")


def _no_wheel_message(torch_version: str, specifiers: list[SpecifierSet], cache: Path, why: str) -> str:
    spec = str(specifiers[0]).replace(".*", "")
    newer = beyond_tested(torch_version)
    if newer is not None:
        why = f"{newer}; {why}"
    return (
        f"torchair is needed for the off-NPU FX→GE conversion check (downstream 'torchair' without an NPU), "
        f"from the torch_npu wheel that pairs with torch {torch_version} (torch-npu{specifiers[0]}), and it "
        f"could not be obtained: {why}. Without network access: on a machine with it, run `pip download "
        f"--no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 "
        f"'torch-npu{spec}'`, copy the .whl here and set {ENV_WHEEL}=<the .whl or its folder> (or put it "
        f"in {cache / 'wheels'}). The wheel is only unpacked, never installed."
    )


def _pip_download(requirement: str, dest: Path, environ: Mapping[str, str]) -> tuple[Path | None, str]:
    """``pip download --no-deps`` one requirement into ``dest`` (pip configured by ``environ``, e.g.
    ``PIP_INDEX_URL``); returns ``(wheel, "")`` or ``(None, why)``."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), requirement]
    log.info("qwen_npu: %s", " ".join(command))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False,
                              env=dict(environ), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"`pip download {requirement}` took longer than {DOWNLOAD_TIMEOUT_S}s"
    except OSError as exc:
        return None, f"could not run pip ({exc})"
    wheels = sorted(dest.glob("torch_npu-*.whl"))
    if done.returncode == 0 and wheels:
        return wheels[-1], ""
    lines = [line.strip() for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
    return None, f"`pip download {requirement}` failed: {' '.join(errors)[:400] or f'exit status {done.returncode}'}"


def obtain_wheel(torch_version: str, environ: Mapping[str, str] | None = None) -> Path:
    """Find or download the torch_npu wheel that pairs with ``torch_version``.

    Order: ``$QWEN_NPU_TORCH_NPU_WHEEL`` (a ``.whl`` file, used as given, or a folder searched for the
    newest paired wheel), then the cache's ``wheels/`` folder, then ``pip download`` into it.

    Raises:
        TorchairUnavailableError: the named wheel is missing or not a torch_npu wheel, or nothing usable
            is cached and the download failed (the message says how to provide the wheel offline).
    """
    environ = os.environ if environ is None else environ
    specifiers = paired_specifiers(torch_version)
    cache = cache_dir(environ)
    named = environ.get(ENV_WHEEL)
    if named:
        path = Path(named).expanduser()
        if path.is_file():
            version = wheel_version(path)
            if version is None:
                raise TorchairUnavailableError(f"{ENV_WHEEL}={named!r} is not a torch_npu wheel (torch_npu-<version>-*.whl)")
            if not any(spec.contains(version, prereleases=True) for spec in specifiers):
                log.warning("qwen_npu: %s names torch_npu %s, which does not pair with torch %s (torch-npu%s); "
                            "its torchair may not work with this torch", ENV_WHEEL, version, torch_version, specifiers[0])
            return path
        if path.is_dir():
            found = newest_matching(path, specifiers)
            if found is not None:
                return found
            raise TorchairUnavailableError(_no_wheel_message(
                torch_version, specifiers, cache, f"{ENV_WHEEL}={named!r} holds no torch_npu wheel matching torch-npu{specifiers[-1]}"))
        raise TorchairUnavailableError(f"{ENV_WHEEL}={named!r} does not exist; name a torch_npu .whl file or a folder holding one")

    wheels = cache / "wheels"
    found = newest_matching(wheels, specifiers) if wheels.is_dir() else None
    if found is not None:
        _check_sidecar(found)
        return found

    whys = []
    wheels.mkdir(parents=True, exist_ok=True)
    for spec in specifiers:
        with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
            downloaded, why = _pip_download(f"torch-npu{spec}", Path(tmp), environ)
            if downloaded is None:
                whys.append(why)
                continue
            target = wheels / downloaded.name
            Path(f"{target}.sha256").write_text(sha256_of(downloaded) + "\n")
            os.replace(downloaded, target)
            return target
    raise TorchairUnavailableError(_no_wheel_message(torch_version, specifiers, cache, "; ".join(whys)))


def _check_sidecar(wheel: Path) -> None:
    sidecar = Path(f"{wheel}.sha256")
    if sidecar.is_file() and sidecar.read_text().strip() != sha256_of(wheel):
        raise TorchairUnavailableError(
            f"the cached wheel {wheel} does not match the sha256 recorded when it was downloaded "
            f"({sidecar}); delete both files to download it again"
        )


def _record_hashes(archive: zipfile.ZipFile) -> dict[str, str]:
    """``{path: urlsafe-base64 sha256}`` from the wheel's ``*.dist-info/RECORD``."""
    records = [name for name in archive.namelist() if name.endswith(".dist-info/RECORD") and name.count("/") == 1]
    if len(records) != 1:
        raise TorchairUnavailableError(f"{archive.filename}: expected one .dist-info/RECORD, found {records}")
    hashes = {}
    for line in archive.read(records[0]).decode().splitlines():
        path, _, rest = line.partition(",")
        digest = rest.split(",", 1)[0]
        if digest.startswith("sha256="):
            hashes[path] = digest[len("sha256="):]
    return hashes


def _wanted(name: str) -> bool:
    if name.startswith(TORCHAIR_DIR):
        return not name.endswith("/") and not name.endswith(".so")
    return name in (SCHEMAS_YAML, META_REGISTRATIONS)


def extract(wheel: Path, environ: Mapping[str, str] | None = None) -> tuple[Path, float]:
    """Verify and extract the wanted members of ``wheel`` into the cache (reused when already there).

    Returns:
        ``(folder holding torch_npu/, seconds spent extracting or 0.0 when reused)``.

    Raises:
        TorchairUnavailableError: not a zip, a CRC error, a member missing from RECORD or with another
            sha256, or no torchair in the wheel.
    """
    version = wheel_version(wheel)
    wheel_sha = sha256_of(wheel)
    root = cache_dir(environ) / "extracted" / f"torch_npu-{version}-{wheel_sha[:12]}"
    if (root / "VERIFIED.json").is_file():
        return root, 0.0
    start = time.perf_counter()
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".extract-", ignore_cleanup_errors=True) as tmp:
        staging = Path(tmp)
        try:
            with zipfile.ZipFile(wheel) as archive:
                hashes = _record_hashes(archive)
                members = [name for name in archive.namelist() if _wanted(name)]
                if not any(name.startswith(TORCHAIR_DIR) for name in members) or SCHEMAS_YAML not in members:
                    raise TorchairUnavailableError(f"{wheel} holds no {TORCHAIR_DIR} or no {SCHEMAS_YAML}")
                for name in members:
                    data = archive.read(name)  # checks the member's CRC-32 (zipfile.BadZipFile)
                    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                    if hashes.get(name) != digest:
                        raise TorchairUnavailableError(
                            f"{wheel}: {name} has sha256 {digest}, its RECORD says {hashes.get(name)}: the wheel is "
                            "corrupt or altered; delete it and download it again")
                    target = staging / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data)
        except zipfile.BadZipFile as exc:
            raise TorchairUnavailableError(f"{wheel} is not a valid wheel ({exc}); delete it and download it again") from exc
        (staging / "VERIFIED.json").write_text(json.dumps(
            {"wheel": wheel.name, "sha256": wheel_sha, "members": len(members), "checked": "CRC-32 and RECORD sha256"},
            indent=1))
        try:
            os.replace(staging, root)
        except OSError:
            if not (root / "VERIFIED.json").is_file():  # another process won the race: use its copy
                raise
            shutil.rmtree(staging, ignore_errors=True)
    return root, time.perf_counter() - start


def obtain_sources(torch_version: str, environ: Mapping[str, str] | None = None) -> TorchairSources:
    """:func:`obtain_wheel` then :func:`extract`; see there for the errors."""
    start = time.perf_counter()
    wheel = obtain_wheel(torch_version, environ)
    obtain_seconds = time.perf_counter() - start
    root, extract_seconds = extract(wheel, environ)
    return TorchairSources(
        torch_npu_version=str(wheel_version(wheel)),
        wheel=wheel,
        import_root=root / "torch_npu" / "dynamo",
        schemas_yaml=root / SCHEMAS_YAML,
        meta_registrations=root / META_REGISTRATIONS,
        seconds={"obtain": obtain_seconds, "extract": extract_seconds},
    )
