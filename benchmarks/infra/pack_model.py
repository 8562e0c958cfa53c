"""Move a model folder to the GPU machine in chunks (the device tool carries at most 64 MiB a call).

    python -m benchmarks.infra.pack_model pack MODEL_DIR [--out .gpu] [--extra FILE ...]
    python -m benchmarks.infra.pack_model pack --files FILE [FILE ...] [--out .gpu] [--extra FILE ...]
        -> .gpu/m0 .. .gpu/mN, each at most 58 MiB (the .gpu folder must be git-ignored)
    on the GPU machine, one call per chunk (carry [".gpu/mK"]):
        mkdir -p /tmp/mstage && cp -n .gpu/mK/* /tmp/mstage/
    then, once:
        python3 -m benchmarks.infra.pack_model unpack /tmp/models/NAME [--stage /tmp/mstage]

``*.safetensors`` files travel as two byte planes: the high bytes of the bf16/fp16 words (sign
and exponent, which compress to ~40% with zlib) and the low bytes raw; every other file raw. That
is ~70% of the original size (Qwen2.5-Coder-0.5B-Instruct: 1.26 GB in 15 chunks instead of 21).
Every file is checked against its sha256 when unpacked. ``--extra`` files (a haystack text)
travel in the last chunk and are unpacked next to the model. ``--files`` packs single files
instead of a folder's (a GGUF, which is smaller than its bf16 conversion: Qwen2.5-Coder-1.5B is
1.12 GB in 19 chunks as GGUF; ``benchmarks/infra/gpu_stage_model.sh`` converts it on the GPU machine).
Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import zlib

CHUNK = 58 * 1024 * 1024


def pack(model_dir: pathlib.Path | None, out: pathlib.Path, extra: list[pathlib.Path],
         files_only: list[pathlib.Path] = (), chunk: int | None = None) -> int:
    """Pack the files of ``model_dir`` (or the single files ``files_only``), then ``extra``,
    into ``out/m0 .. out/mN``; return N + 1. ``mN`` also holds the manifest."""
    if (model_dir is None) == (not files_only):
        raise SystemExit("pack: give either a model folder or --files")
    chosen = list(files_only) if model_dir is None else sorted(p for p in model_dir.iterdir() if p.is_file())
    chosen += list(extra)
    names = [f.name for f in chosen]
    if len(set(names)) != len(names):
        raise SystemExit(f"pack: two files with one name: {sorted(n for n in names if names.count(n) > 1)}")
    blob = bytearray()
    files = []
    for f in chosen:
        data = f.read_bytes()
        entry = {"name": f.name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        if f.suffix == ".safetensors" and len(data) % 2 == 0:
            high = zlib.compress(data[1::2], 6)
            entry.update(kind="planes", high=[len(blob), len(high)], low=[len(blob) + len(high), len(data) // 2])
            blob += high
            blob += data[0::2]
        else:
            entry.update(kind="raw", raw=[len(blob), len(data)])
            blob += data
        files.append(entry)
    for old in out.glob("m[0-9]*"):
        shutil.rmtree(old)
    chunk = chunk or CHUNK
    chunks = (len(blob) + chunk - 1) // chunk
    for i in range(chunks):
        d = out / f"m{i}"
        d.mkdir(parents=True)
        (d / f"model.part{i:03d}").write_bytes(blob[i * chunk:(i + 1) * chunk])
    # The manifest travels with the last chunk, usually the smallest, so no folder passes CHUNK.
    (out / f"m{chunks - 1}" / "manifest.json").write_text(json.dumps({"chunks": chunks, "files": files}))
    return chunks


def unpack(stage: pathlib.Path, dest: pathlib.Path) -> list[str]:
    if not (stage / "manifest.json").is_file():
        raise SystemExit(f"{stage}/manifest.json missing: the last chunk was not copied")
    manifest = json.loads((stage / "manifest.json").read_text())
    parts = [stage / f"model.part{i:03d}" for i in range(manifest["chunks"])]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise SystemExit(f"{stage}: {len(missing)} of {len(parts)} chunks missing: {', '.join(missing)}")
    blob = memoryview(b"".join(p.read_bytes() for p in parts))  # slices below copy nothing
    dest.mkdir(parents=True, exist_ok=True)
    for e in manifest["files"]:
        if e["kind"] == "raw":
            off, n = e["raw"]
            data = blob[off:off + n]
            if len(data) != n:
                raise SystemExit(f"{e['name']}: truncated (a chunk is missing or damaged)")
        else:
            buf = bytearray(e["size"])
            (high, n_high), (low, n_low) = e["high"], e["low"]
            try:
                buf[1::2] = zlib.decompress(blob[high:high + n_high])
                buf[0::2] = blob[low:low + n_low]
            except (zlib.error, ValueError) as err:
                raise SystemExit(f"{e['name']}: cannot rebuild ({err}): a chunk is missing or damaged") from None
            data = buf
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            raise SystemExit(f"{e['name']}: sha256 mismatch (a chunk is missing or damaged)")
        (dest / e["name"]).write_bytes(data)
    return [e["name"] for e in manifest["files"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("model_dir", type=pathlib.Path, nargs="?", default=None)
    p.add_argument("--files", type=pathlib.Path, nargs="+", default=[],
                   help="pack these single files (e.g. a GGUF) instead of a model folder")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(".gpu"))
    p.add_argument("--extra", type=pathlib.Path, nargs="*", default=[])
    p.add_argument("--chunk-mib", type=int, default=None,
                   help=f"chunk size (default {CHUNK >> 20}): a device call carries the working tree "
                        "too, 64 MiB in all")
    u = sub.add_parser("unpack")
    u.add_argument("dest", type=pathlib.Path)
    u.add_argument("--stage", type=pathlib.Path, default=pathlib.Path("/tmp/mstage"))
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        chunk = CHUNK if args.chunk_mib is None else args.chunk_mib << 20
        print(f"{pack(args.model_dir, args.out, args.extra, args.files, chunk)} chunks in {args.out}/m*")
    else:
        print("unpacked:", ", ".join(unpack(args.stage, args.dest)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
