"""Keep a trace bank in the repository as xz shards, so that banking it can span sessions.

A bank of 200 worked answers takes the large model about 5 hours on 2 cores, longer
than a working session, and bench/out/ is not kept. `pack` writes the runs a bank holds
beyond its shards into one new shard, named by the runs it holds (0071-0140.jsonl.xz);
`unpack` joins the shards back into a bank that `satisfice evaluator bank --resume`
goes on from. Shards are never rewritten, so each commit adds only its new runs.

    .venv/bin/python bench/bank_shards.py pack bench/out/bank_qwen_gsm8k.jsonl bench/banks/gsm8k
    .venv/bin/python bench/bank_shards.py unpack bench/banks/gsm8k bench/out/bank_qwen_gsm8k.jsonl
"""

from __future__ import annotations

import argparse
import lzma
import sys
from collections.abc import Sequence
from pathlib import Path


def shards(folder: Path) -> list[Path]:
    """The shards in run order: their names start with their first run's number."""
    return sorted(folder.glob("*.jsonl.xz"))


def shard_lines(folder: Path) -> list[bytes]:
    return [
        line
        for path in shards(folder)
        for line in lzma.decompress(path.read_bytes()).splitlines(keepends=True)
    ]


def pack(bank: Path, folder: Path) -> str:
    kept = shard_lines(folder)
    # A cut-off last line is a run still being written: it waits for the next pack.
    lines = [line for line in bank.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")]
    if lines[: len(kept)] != kept:
        raise ValueError(f"{bank} does not begin with the {len(kept)} runs of {folder}")
    new = lines[len(kept) :]
    if not new:
        return f"{bank}: no runs beyond the {len(kept)} in {folder}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{len(kept) + 1:04d}-{len(lines):04d}.jsonl.xz"
    # xz rather than gzip: a worked answer's run is 410 kB of JSON, 135 kB gzipped,
    # 90 kB in xz; 200 of them are the repository's largest data.
    path.write_bytes(lzma.compress(b"".join(new), preset=9))
    return f"wrote {path}: runs {len(kept) + 1} to {len(lines)}"


def unpack(folder: Path, bank: Path) -> str:
    lines = shard_lines(folder)
    if not lines:
        raise ValueError(f"{folder}: no shards")
    bank.parent.mkdir(parents=True, exist_ok=True)
    bank.write_bytes(b"".join(lines))
    return f"wrote {bank}: {len(lines)} runs from {len(shards(folder))} shards"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packed = commands.add_parser("pack", help="a new shard of the bank's runs beyond the shards")
    packed.add_argument("bank", type=Path)
    packed.add_argument("folder", type=Path)
    unpacked = commands.add_parser("unpack", help="join the shards into a bank")
    unpacked.add_argument("folder", type=Path)
    unpacked.add_argument("bank", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            print(pack(args.bank, args.folder))
        else:
            print(unpack(args.folder, args.bank))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
