"""Trained runs carried between machines as int8 (a lent GPU host returns at most 64 MiB, in at
most 8 files of 16 MiB; one fp16 `small` model is 20 MB): every float matrix as int8 with one
scale per row, the rest fp16, each run's weights, summary and logs xz-compressed into one tar split
into parts. Unpacked, a run directory loads like any other (fp16 weights, digests, vocab.txt);
its perplexities move by under 0.1% (docs/results.md, "small-state trade-off").

    python scripts/run_transport.py pack runs/tradeoff --out $OUT [--limit-mb 67]
    python scripts/run_transport.py unpack OUT/tradeoff.tar.* --runs runs/tradeoff
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from smallstate_lm.files import atomic_write_bytes  # noqa: E402

PACK_FORMAT = "smallstate-lm-int8/1"
PART_BYTES = 16_000_000  # under the 16 MiB a device call returns per file


class TransportError(Exception):
    """Parts that are not one archive of ours, or an entry that would land outside --runs."""


def quantize(weights: dict) -> dict:
    """Float matrices as int8 with one float32 scale per row (absmax / 127); everything else
    as fp16 or as it is. Tensors that share storage (tied embeddings) are stored once."""
    import torch

    q, seen = {}, {}
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            q[name] = {"same_as": seen[key]}
            continue
        seen[key] = name
        if t.is_floating_point() and t.dim() == 2 and t.numel() >= 4096:
            scale = t.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / 127  # (rows, 1)
            q[name] = {"int8": torch.round(t.float() / scale).to(torch.int8), "scale": scale}
        else:
            q[name] = {"raw": t.half() if t.is_floating_point() else t}
    return q


def dequantize(q: dict) -> dict:
    import torch

    out = {}
    for name, entry in q.items():
        if "int8" in entry:
            out[name] = (entry["int8"].float() * entry["scale"]).to(torch.float16)
        elif "raw" in entry:
            out[name] = entry["raw"]
    for name, entry in q.items():
        if "same_as" in entry:
            out[name] = out[entry["same_as"]]
    return out


def _pack_run(run: Path) -> list[tuple[str, bytes]]:
    """One run's archive entries: int8 weights, summary, logs (each xz-compressed)."""
    import torch

    from smallstate_lm.checkpoint import read_checkpoint

    entries = []
    if (run / "model.pt").exists():
        _, obj = read_checkpoint(run)
        packed = {"format": PACK_FORMAT, "config": obj["config"], "vocab": obj["vocab"],
                  "weights": quantize(obj["model"]), **{k: obj[k] for k in ("step", "valid_ppl") if k in obj}}
        raw = io.BytesIO()
        torch.save(packed, raw)
        entries.append((f"{run.name}/model.q8.xz", lzma.compress(raw.getvalue(), preset=6)))
    if (run / "summary.json").exists():
        entries.append((f"{run.name}/summary.json.xz", lzma.compress((run / "summary.json").read_bytes())))
    if (run / "train_log.jsonl").exists():  # every event, and one step record in ten (the rest is noise)
        lines = [x for x in (run / "train_log.jsonl").read_text().splitlines()
                 if '"event"' in x or json.loads(x).get("step", 0) % 10 == 0]
        entries.append((f"{run.name}/train_log.jsonl.xz", lzma.compress(("\n".join(lines) + "\n").encode())))
    log = run.parent / f"{run.name}.log"
    if log.exists():
        entries.append((f"{run.name}.log.xz", lzma.compress(log.read_bytes())))
    return entries


def pack(runs: Path, out: Path, limit_mb: float = 67.0, prefix: str = "tradeoff") -> list[Path]:
    """runs/<run>/model.pt (+ summary, logs) -> a tar of xz entries split into parts under `out`,
    runs in family.json's order (else by name) until `limit_mb` (those left out are named)."""
    from concurrent.futures import ThreadPoolExecutor

    runs, out = Path(runs), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    family = json.loads((runs / "family.json").read_text()) if (runs / "family.json").exists() else {}
    order = [m["name"] for m in family.get("members", [])]
    dirs = sorted((p for p in runs.iterdir() if p.is_dir()),
                  key=lambda p: (order.index(p.name) if p.name in order else len(order), p.name))
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # lzma and torch release the GIL
        packed = list(pool.map(_pack_run, dirs))
    buf, left_out = io.BytesIO(), []
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        if (runs / "family.json").exists():
            add("family.json", (runs / "family.json").read_bytes())
        logs = [e for entries in packed for e in entries if not e[0].endswith("model.q8.xz")]
        for name, data in logs:
            add(name, data)
        for run, entries in zip(dirs, packed):
            for name, data in entries:
                if not name.endswith("model.q8.xz"):
                    continue
                if buf.tell() + len(data) + 2048 > limit_mb * 1e6:
                    left_out.append(run.name)
                    continue
                add(name, data)
                print(f"{run.name}: packed ({buf.tell() / 1e6:.1f} MB so far)", flush=True)
    data = buf.getvalue()
    parts = [data[i : i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    paths = [out / f"{prefix}.tar.{i:02d}" for i in range(len(parts))]
    for path, part in zip(paths, parts):
        atomic_write_bytes(path, part)
    print(f"{len(data) / 1e6:.1f} MB in {len(parts)} parts under {out}"
          + (f"; weights left out (over --limit-mb): {', '.join(left_out)}" if left_out else ""))
    return paths


def unpack(parts: list[Path], runs: Path) -> None:
    """Parts from `pack` -> runs/<run>/model.pt (fp16 release form), vocab.txt, summary and log."""
    import torch

    from smallstate_lm.checkpoint import DIGEST_KEY, FORMAT, atomic_torch_save, tensor_digests
    from smallstate_lm.subword import vocabulary_of

    parts = sorted(Path(p) for p in parts)
    try:
        data = b"".join(p.read_bytes() for p in parts)
    except OSError as e:
        raise TransportError(f"{e.filename}: cannot read it ({e.strerror or e})") from None
    runs = Path(runs)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r")
        members = tar.getmembers()
    except tarfile.TarError as e:
        raise TransportError(f"{parts[0]}...: not the parts of one `pack` archive ({e})") from None
    for info in members:
        if info.name.startswith("/") or ".." in info.name.split("/"):
            raise TransportError(f"{parts[0]}: archive entry {info.name!r} points outside the run directory")
        body = tar.extractfile(info).read()
        dest = runs / info.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if info.name.endswith("model.q8.xz"):
            packed = torch.load(io.BytesIO(lzma.decompress(body)), weights_only=True)
            if packed.get("format") != PACK_FORMAT:
                raise TransportError(f"{info.name}: expected format {PACK_FORMAT!r}")
            weights = dequantize(packed["weights"])
            obj = {"format": FORMAT, "config": packed["config"], "vocab": packed["vocab"], "model": weights,
                   DIGEST_KEY: tensor_digests(weights), "transport": "int8 per row",
                   **{k: packed[k] for k in ("step", "valid_ppl") if k in packed}}
            atomic_torch_save(obj, dest.parent / "model.pt")
            vocabulary_of(packed["vocab"]).save(dest.parent / "vocab.txt")
        elif info.name.endswith(".xz"):
            atomic_write_bytes(dest.with_suffix(""), lzma.decompress(body))
        else:
            atomic_write_bytes(dest, body)
        print(f"unpacked {info.name}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="run directories -> int8 parts")
    p.add_argument("runs", help="folder of run directories")
    p.add_argument("--out", required=True)
    p.add_argument("--limit-mb", type=float, default=67.0, help="most megabytes in all parts together")
    p = sub.add_parser("unpack", help="parts -> run directories")
    p.add_argument("parts", nargs="+")
    p.add_argument("--runs", required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            pack(Path(args.runs), Path(args.out), args.limit_mb)
        else:
            unpack([Path(p) for p in args.parts], Path(args.runs))
    except TransportError as e:
        print(f"run_transport: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
