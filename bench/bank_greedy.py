"""Bank one greedy answer of an engine of the embedded default config per banked question.

The trace bank (bench/banks/arc_challenge, bench/banks/gsm8k) holds only the large
model's samples at temperature 0.7. What a request routed small is answered with is the
small engine's greedy pass, and what a shadow check compares the loop's answer against
(`large_route`) is that too. This banks it, for the same questions asked the same way:
each question's prompt as the trace bank holds it (ARC-Challenge "the letter only", at
most 16 tokens; GSM8K as a user asks it, at most 384 tokens, a loop round's budget), one
pass at temperature 0 through the project's own llama.cpp engine (engines.create_engine
on the embedded default's `small`, or `--engine large`), with the chosen tokens' logprobs
and their top 5 alternatives (read from the live logits: no extra decode).

    .venv/bin/python bench/bank_greedy.py [--engine small] [--sources arc_challenge gsm8k]
        [--limit N] [--held-out-first] [--threads 1] [--timeout-s 3600]

One file per source, `bench/banks/greedy_<engine>/<source>.jsonl.xz`, one record per
question in the trace bank's order. A record is an `evaluator.runs.Run` with one sample
(so `read_runs` reads it after `xz -d`), plus what the run cost::

    {"id": "gsm8k-17", "kind": "number", "answers": ["18"], "prompt": "...",
     "source": "gsm8k", "engine": "small", "model": "qwen2.5-coder-0.5b-instruct",
     "max_tokens": 384, "samples": [{"text": "...", "completion_tokens": 212,
     "finish_reason": "stop", "seconds": 9.8, "prompt_tokens": 71,
     "logprobs": [["To", -0.01, [["To", -0.01], ...]], ...]}]}

Each record is appended as an xz stream of its own as soon as it is known, so a run that
stops keeps what it banked and the next one goes on after it (a torn last stream is cut
off); a record the engine's deadline cut off (`finish_reason: deadline`, a machine too
loaded for the timeout) is banked again, and the last record of a question is its
answer. A source banked whole is rewritten as one stream (a tenth of the size).
"""

from __future__ import annotations

import argparse
import asyncio
import lzma
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec

from engines import Engine, create_engine
from engines.base import Generation, Message, SamplingParams
from evaluator.runs import Run, split_by_source, take_per_source
from gateway.config import load_config

ROOT = Path(__file__).resolve().parent.parent
BANKS = ROOT / "bench" / "banks"
# A source's prompts are asked with the trace bank's own caps (Makefile, default-calibrator).
MAX_TOKENS = {"arc_challenge": 16, "gsm8k": 384}
TOP_LOGPROBS = 5
# bench/split_runs.py's split of each source's first 240 (Makefile, default-calibrator).
SPLIT_PER_SOURCE = 240


class GreedySample(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    completion_tokens: int
    finish_reason: str
    seconds: float
    prompt_tokens: int
    logprobs: tuple[tuple[str, float, tuple[tuple[str, float], ...]], ...] = ()


class GreedyRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    kind: str
    answers: list[str]
    prompt: str
    source: str
    engine: str
    model: str
    max_tokens: int
    samples: tuple[GreedySample, ...]


def bank_runs(source: str, banks: Path = BANKS) -> list[Run]:
    """The trace bank's runs of ``source``, in bank order (their shards joined)."""
    decoder = msgspec.json.Decoder(Run)
    runs = []
    for shard in sorted((banks / source).glob("*.jsonl.xz")):
        for line in lzma.decompress(shard.read_bytes()).splitlines():
            if line.strip():
                runs.append(decoder.decode(line))
    if not runs:
        raise SystemExit(f"no trace bank shards under {banks / source}")
    return runs


def xz_streams(data: bytes) -> Iterator[tuple[bytes, int]]:
    """Each whole xz stream's text in ``data`` with the offset just past it; a torn last
    stream (a run stopped mid-write) is left out."""
    offset = 0
    while offset < len(data):
        decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        try:
            text = decompressor.decompress(data[offset:])
        except lzma.LZMAError:
            return
        if not decompressor.eof:
            return
        offset = len(data) - len(decompressor.unused_data)
        yield text, offset
        # xz pads streams to 4 bytes with zeros; a stream ends where the padding does.
        while offset < len(data) and data[offset] == 0:
            offset += 1


def read_greedy(path: Path, *, repair: bool = False) -> list[GreedyRecord]:
    """The records a greedy bank holds. With ``repair``, a torn tail is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    decoder = msgspec.json.Decoder(GreedyRecord)
    records: list[GreedyRecord] = []
    end = 0
    for text, offset in xz_streams(data):
        records.extend(decoder.decode(line) for line in text.splitlines() if line.strip())
        end = offset
    if repair and end < len(data):
        print(f"{path}: cut off a torn tail of {len(data) - end} bytes", file=sys.stderr)
        with path.open("r+b") as out:
            out.truncate(end)
    return records


def record_of(run: Run, generation: Generation, engine: str, max_tokens: int) -> GreedyRecord:
    sample = generation.samples[0]
    return GreedyRecord(
        id=run.id,
        kind=run.kind,
        answers=run.answers,
        prompt=run.prompt,
        source=run.source,
        engine=engine,
        model=generation.model,
        max_tokens=max_tokens,
        samples=(
            GreedySample(
                text=sample.text,
                completion_tokens=sample.completion_tokens,
                finish_reason=sample.finish_reason,
                seconds=round(sample.timings.total_s, 3),
                prompt_tokens=generation.prompt_tokens,
                logprobs=tuple(
                    (
                        t.token,
                        round(t.logprob, 4),
                        tuple((a.token, round(a.logprob, 4)) for a in t.top),
                    )
                    for t in sample.logprobs
                ),
            ),
        ),
    )


def latest(records: Sequence[GreedyRecord]) -> dict[str, GreedyRecord]:
    """Each question's last record: a question banked again (its answer was cut off by
    the engine's deadline) is read as its last try."""
    return {record.id: record for record in records}


def unfinished(record: GreedyRecord) -> bool:
    """Cut off by a deadline: what the engine answers given the time, not its answer."""
    return record.samples[0].finish_reason == "deadline"


def compact(path: Path, order: Sequence[str]) -> None:
    """One xz stream for the whole file, each question's last record in ``order``,
    written aside and moved over it."""
    records = latest(read_greedy(path))
    encoder = msgspec.json.Encoder()
    text = b"".join(encoder.encode(records[i]) + b"\n" for i in order if i in records)
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(lzma.compress(text, preset=9))
    os.replace(temporary, path)


def held_out_first(runs: Sequence[Run]) -> list[Run]:
    """The runs no shipped default was fitted on first (the held-out half of the first
    240 as bench/split_runs.py splits them, and any past those), then the fitting half."""
    fitting, _ = split_by_source(take_per_source(runs, SPLIT_PER_SOURCE), 0.5, 0)
    fitted = {run.id for run in fitting}
    return sorted(runs, key=lambda run: run.id in fitted)


async def bank_source(
    engine: Engine,
    source: str,
    out_dir: Path,
    limit: int | None,
    max_tokens: int | None,
    held_out: bool = False,
) -> None:
    runs = bank_runs(source)[:limit]
    path = out_dir / f"{source}.jsonl.xz"
    banked = latest(read_greedy(path, repair=True))
    done = {i for i, record in banked.items() if not unfinished(record)}
    todo = [run for run in (held_out_first(runs) if held_out else runs) if run.id not in done]
    cap = max_tokens or MAX_TOKENS.get(source, 384)
    print(f"{source}: {len(done)} banked, {len(todo)} to go ({cap} tokens at most)", flush=True)
    if todo:
        params = SamplingParams(
            max_tokens=cap, temperature=0.0, logprobs=True, top_logprobs=TOP_LOGPROBS
        )
        encoder = msgspec.json.Encoder()
        started = time.perf_counter()
        await engine.start()
        try:
            for number, run in enumerate(todo, start=1):
                generation = await engine.generate((Message("user", run.prompt),), params)
                line = encoder.encode(record_of(run, generation, engine.name, cap)) + b"\n"
                with path.open("ab") as out:
                    out.write(lzma.compress(line, preset=1))
                    out.flush()
                    os.fsync(out.fileno())
                if number % 25 == 0 or number == len(todo):
                    seconds = time.perf_counter() - started
                    print(
                        f"{source}: {len(done) + number}/{len(runs)} "
                        f"({seconds:.0f} s, {seconds / number:.2f} s a question)",
                        flush=True,
                    )
        finally:
            await engine.close()
    banked = latest(read_greedy(path))
    if all(run.id in banked and not unfinished(banked[run.id]) for run in runs):
        compact(path, [run.id for run in runs])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="small", help="an engine of the embedded default")
    parser.add_argument("--sources", nargs="+", default=list(MAX_TOKENS))
    parser.add_argument("--limit", type=int, help="each source's first N questions only")
    parser.add_argument("--max-tokens", type=int, help="default: the trace bank's cap per source")
    parser.add_argument("--out", type=Path, help="default: bench/banks/greedy_<engine>")
    parser.add_argument(
        "--threads",
        type=int,
        help="llama.cpp threads, in place of the config's: on a machine other work shares, "
        "one thread is not held up waiting for a second that was descheduled",
    )
    parser.add_argument(
        "--held-out-first",
        action="store_true",
        help="bank the questions no shipped default was fitted on before the others",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=3600.0,
        help="the engine's per-request timeout, in place of the config's (a loaded machine "
        "would cut worked answers off at the serving timeout; such a record is banked again)",
    )
    args = parser.parse_args(argv)
    out_dir = args.out or BANKS / f"greedy_{args.engine}"
    out_dir.mkdir(parents=True, exist_ok=True)
    config = load_config()
    if args.engine not in config.engines:
        parser.error(
            f"no engine {args.engine!r} in the default config: {', '.join(config.engines)}"
        )
    models_dir = Path(config.models_dir).expanduser()
    settings = msgspec.structs.replace(config.engines[args.engine], timeout_s=args.timeout_s)
    if args.threads is not None:
        settings = msgspec.structs.replace(settings, threads=args.threads)
    for source in args.sources:
        # A fresh engine per source: each asyncio.run has a loop of its own.
        engine = create_engine(args.engine, settings, models_dir)
        asyncio.run(
            bank_source(engine, source, out_dir, args.limit, args.max_tokens, args.held_out_first)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
