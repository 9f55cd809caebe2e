"""In-process llama.cpp backend for GGUF models (llama-cpp-python).

Each concurrency slot owns one ``Llama`` instance and one worker thread: a llama.cpp
context is not thread-safe, and generation must never run on the event loop. The
worker drives ``Llama.generate`` token by token, so it can check for cancellation
and the deadline between any two tokens.

A request with tools or a response format (engines/structured.py) shows its tools
through the chat template, samples under a grammar when its form must be held to
(engines/constrained.py) and has its tool calls read out of the text as it streams
(engines/tool_calls.py).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ctypes
import json
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import llama_cpp
import msgspec
import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from engines.admission import Admission
from engines.base import (
    Delta,
    EngineError,
    EngineOverloaded,
    Feature,
    FinishReason,
    Generation,
    Message,
    Prompt,
    PromptTooLong,
    Sample,
    SamplingParams,
    Timings,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
)
from engines.bundled import model_file
from engines.constrained import GrammarSampler, constrained_tokens
from engines.fanout import EngineCounters, FanOutEngine, SampleDone, expired
from engines.gathering import Gathering, Group, Member
from engines.grammars import GrammarError, check_grammar
from engines.llama_batch import BatchContext, BatchDecodeFailed, SequenceSampler, logits_row
from engines.llama_logs import route_to_logging
from engines.llama_prefill import PrefillSpeed, interruptible, past
from engines.native_check import check_models
from engines.settings import LlamaCppSettings
from engines.stops import StopMatcher
from engines.structured import PLAIN, InvalidShape, Shape, shape_of
from engines.templates import CompletionTemplate, continues
from engines.tool_calls import CallParser, renders_tool_calls

# With verbose=False, llama-cpp-python points the process's stdout and stderr at
# /dev/null while a model loads and then restores what it found. Two loads at once
# interleave: the later one finds /dev/null and restores it, and every log line after
# is lost. The file descriptors are the process's, so the lock is too.
_LOADING = threading.Lock()


class TokenBytes:
    """The bytes of each token, memoised (llama-cpp-python's ``token_to_piece``
    returns its whole fixed-size buffer, NUL padding included)."""

    def __init__(self, llm: llama_cpp.Llama) -> None:
        self._vocab = llm._model.vocab
        self._memo: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        piece = self._memo.get(token)
        if piece is None:
            size = 64
            while True:
                buffer = ctypes.create_string_buffer(size)
                written = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, size, 0, False)
                if written >= 0:
                    break
                size = -written  # too small: llama.cpp says how much it needs
            piece = self._memo[token] = buffer.raw[:written]
        return piece


class LogprobRecorder:
    """Log-probabilities of each chosen token, read from the context's live logits.

    ``logits_all=True`` would keep a logits row per position (3-20x slower and GBs
    for a 262k vocabulary). The last position's logits are already in the context
    after every decode, so one log-sum-exp over them per token gives the same numbers.
    """

    def __init__(
        self,
        llm: llama_cpp.Llama,
        token_bytes: TokenBytes,
        top: int,
        ctx: llama_cpp.llama_context_p | None = None,
    ) -> None:
        self._ctx = llm._ctx.ctx if ctx is None else ctx  # a batch's context, or llm's own
        self._token_bytes = token_bytes
        self._top = top
        self._n_vocab = llm.n_vocab()

    def record(self, token: int, row: int = -1) -> TokenLogprob:
        """``token``'s logprob under the logits at batch ``row`` of the last decode."""
        pointer = logits_row(self._ctx, row)
        logits = np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))
        peak = logits.max()
        log_total = float(peak + np.log(np.exp(logits - peak).sum()))
        top: tuple[TopLogprob, ...] = ()
        if self._top:
            best = np.argpartition(logits, -self._top)[-self._top :]
            best = best[np.argsort(logits[best])[::-1]]
            top = tuple(TopLogprob(self._piece(int(t)), float(logits[t]) - log_total) for t in best)
        return TokenLogprob(self._piece(token), float(logits[token]) - log_total, top)

    def _piece(self, token: int) -> str:
        return self._token_bytes(token).decode("utf-8", "replace")


class _Worker:
    """One llama.cpp model instance and the blocking loop that samples from it."""

    def __init__(self, path: Path, settings: LlamaCppSettings) -> None:
        with _LOADING:
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=settings.context_tokens,
                n_threads=settings.threads,
                n_threads_batch=settings.threads,
                verbose=False,
            )
        self.context_tokens = settings.context_tokens
        self.token_bytes = TokenBytes(self.llm)
        self.tokens_generated = 0  # read by the engine for its token counter
        self.batched_samples = 0  # samples decoded beside others, read the same way
        # Samples that ended before their prompt was read: refused at once (it could not
        # be read in time), or stopped while it was read (the deadline, a cancel).
        self.prompts_refused = 0
        self.prompts_stopped = 0
        self.prefill = PrefillSpeed()
        self._batch_sequences = settings.batch_sequences
        self._batch: BatchContext | None = None  # made at the first batch

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
        self.llm.close()

    def run_batch(
        self, engine: str, prompt: tuple[str, bool, bool], samples: Sequence[BatchSample]
    ) -> None:
        """Decode ``samples`` of one prompt together: the prompt once, then one token of
        every running sample per step; each sample ends on its own (its EOS, stops,
        max_tokens, deadline or cancel) and hands over its SampleDone at once."""
        started = time.monotonic()
        text, add_bos, lstrip = prompt
        prompt_tokens = self._prompt_tokens(engine, text, add_bos)
        room = self.context_tokens - len(prompt_tokens)
        if self._batch is None:
            self._batch = BatchContext(self.llm, self._batch_sequences)
        batch = self._batch
        if len(samples) > batch.sequences:
            raise EngineError(engine, f"a batch holds at most {batch.sequences} samples")
        budgets = [min(s.params.max_tokens, room) for s in samples]
        batch.reserve(len(prompt_tokens) + sum(budgets))
        self.batched_samples += len(samples)
        sequences = [
            _Sequence(self, batch, seq, sample, budget, lstrip, started, len(prompt_tokens))
            for seq, (sample, budget) in enumerate(zip(samples, budgets, strict=True))
        ]
        try:
            running = [s for s in sequences if s.goes_on()]
            first_row = None
            if running:
                first_row = self._read_prompt(batch, prompt_tokens, running, len(sequences))
            if first_row is None:  # nothing to sample: no sample goes on, or none was read
                return
            for sequence in running:
                sequence.row = first_row
            while running:
                running = [s for s in running if s.take() and s.goes_on()]
                if running:
                    batch.step([s.next_input() for s in running])
                    for row, sequence in enumerate(running):
                        sequence.row = row
        finally:
            for sequence in sequences:
                sequence.close()

    def _read_prompt(
        self,
        batch: BatchContext,
        prompt_tokens: list[int],
        running: list[_Sequence],
        copies: int,
    ) -> int | None:
        """The prompt read into the batch for ``running`` (and copied to ``copies``
        sequences): the row whose logits predict the first token, or None when it was
        not read and every sample has ended (refused for the deadline, or stopped)."""
        unread = len(prompt_tokens) - batch.held(prompt_tokens)
        deadlines = [s.deadline for s in running]
        latest = None if None in deadlines else max(d for d in deadlines if d is not None)
        if self.prefill.cannot_read(unread, latest):
            self.prompts_refused += len(running)
            for sequence in running:
                sequence.unread()
            return None
        reading = time.monotonic()
        try:
            with interruptible(batch.ctx, lambda: all(s.stopped() for s in running)):
                row = batch.prefill(prompt_tokens, copies)
        except BatchDecodeFailed:
            if not all(s.stopped() for s in running):
                raise  # llama.cpp failed for a reason of its own
            self.prompts_stopped += len(running)
            for sequence in running:
                sequence.unread()
            return None
        self.prefill.note(unread, time.monotonic() - reading)
        return row

    def run(
        self,
        engine: str,
        prompt: tuple[str, bool, bool],
        params: SamplingParams,
        index: int,
        stops: tuple[str, ...],
        deadline: float | None,
        cancel: threading.Event,
        emit: Callable[[Delta], None],
        shape: Shape = PLAIN,
    ) -> SampleDone:
        started = time.monotonic()
        text, add_bos, lstrip = prompt
        prompt_tokens = self._prompt_tokens(engine, text, add_bos)
        budget = min(params.max_tokens, self.context_tokens - len(prompt_tokens))
        calls = CallParser(shape.names, bare=shape.grammar is None) if shape.names else None
        answer = _Answer(index, lstrip, emit, calls)
        unread = len(prompt_tokens) - self._held(prompt_tokens)
        if self.prefill.cannot_read(unread, deadline):
            self.prompts_refused += 1
            return _unread(answer, "deadline", started, len(prompt_tokens))
        tokens = self._sampled_tokens(prompt_tokens, params, shape.grammar)
        reading = time.monotonic()
        try:
            # The first step reads the prompt, then samples the first token.
            with interruptible(self.llm._ctx.ctx, lambda: cancel.is_set() or past(deadline)):
                first = next(tokens)
        except RuntimeError:
            tokens.close()
            if not (cancel.is_set() or past(deadline)):
                raise  # llama.cpp failed for a reason of its own
            self.prompts_stopped += 1
            finish: FinishReason = "cancelled" if cancel.is_set() else "deadline"
            return _unread(answer, finish, started, len(prompt_tokens))
        first_token_at = time.monotonic()
        self.prefill.note(unread, first_token_at - reading)
        recorder = (
            LogprobRecorder(self.llm, self.token_bytes, params.top_logprobs)
            if params.logprobs
            else None
        )
        decoded = self._decode(
            first, tokens, answer, StopMatcher(stops), recorder, budget, deadline, cancel
        )
        timings = Timings(
            queue_s=0.0,
            first_token_s=first_token_at - started,
            total_s=time.monotonic() - started,
        )
        return SampleDone(
            answer.sample(decoded.finish, decoded.tokens, timings), len(prompt_tokens)
        )

    def _held(self, prompt_tokens: list[int]) -> int:
        """How many of the prompt's first tokens the context holds from the last prompt
        (``Llama.generate`` reads only the rest)."""
        held = self.llm.input_ids[: min(self.llm.n_tokens, len(prompt_tokens))]
        differ = np.flatnonzero(held != np.asarray(prompt_tokens[: len(held)]))
        return int(differ[0]) if len(differ) else len(held)

    def _prompt_tokens(self, engine: str, text: str, add_bos: bool) -> list[int]:
        tokens = self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        if len(tokens) >= self.context_tokens:
            raise PromptTooLong(engine, len(tokens), self.context_tokens)
        return tokens

    def _sampled_tokens(
        self, prompt_tokens: list[int], params: SamplingParams, grammar: str | None
    ) -> Generator[int]:
        """The tokens the model samples after the prompt, one decode per step, held to
        ``grammar`` (GBNF) when there is one."""
        llm = self.llm
        if grammar is not None:  # a sampler of its own, built per sample: it holds state
            sampler = GrammarSampler(llm, params, grammar)
            return constrained_tokens(llm, prompt_tokens, self._held(prompt_tokens), sampler)
        llm.set_seed(llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed)
        return llm.generate(
            prompt_tokens,
            temp=params.temperature,
            top_p=params.top_p,
            top_k=0,  # OpenAI semantics: only temperature and top_p shape sampling
            min_p=0.0,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
        )

    def _decode(
        self,
        token: int,
        tokens: Generator[int],
        answer: _Answer,
        matcher: StopMatcher,
        recorder: LogprobRecorder | None,
        budget: int,
        deadline: float | None,
        cancel: threading.Event,
    ) -> _Decoded:
        """Takes ``token``, then the tokens after it, into ``answer`` until the budget,
        a stop, the deadline or ``cancel``; this loop runs once per token, so it keeps to
        local names."""
        vocab = self.llm._model.vocab
        token_bytes = self.token_bytes
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending, flush = answer.pending, answer.flush
        count = 0
        finish: FinishReason = "length"
        matched = False
        # Each step of `tokens` decodes one token; checking before every step means
        # a cancelled or late sample computes at most one token more.
        while True:
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                finish = "stop"
                break
            count += 1
            self.tokens_generated += 1
            if recorder is not None:
                pending.append(recorder.record(token))
            safe, matched = matcher.feed(decoder.decode(token_bytes(token)))
            flush(safe)
            if matched:
                finish = "stop"
                break
            if count >= budget:
                break
            if cancel.is_set():
                finish = "cancelled"
                break
            if deadline is not None and time.monotonic() >= deadline:
                finish = "deadline"
                break
            token = next(tokens)
        tokens.close()
        if not matched:  # text held back as a possible stop sequence was not one
            flush(matcher.flush() + decoder.decode(b"", final=True), final=True)
        else:
            answer.settle()
        return _Decoded(finish, count)


class _Decoded(NamedTuple):
    """How a sample's decoding ended and how many tokens it took."""

    finish: FinishReason
    tokens: int


def _unread(
    answer: _Answer, finish: FinishReason, started: float, prompt_tokens: int
) -> SampleDone:
    """The empty sample of a prompt not read: refused for the deadline, or stopped."""
    seconds = time.monotonic() - started
    timings = Timings(queue_s=0.0, first_token_s=None, total_s=seconds)
    return SampleDone(answer.sample(finish, 0, timings), prompt_tokens)


class BatchSample(NamedTuple):
    """One sample of a batch: its parameters and stops, its own deadline and cancel,
    where its deltas go and where its SampleDone goes (both called on the worker's
    thread)."""

    sample_index: int  # in its own request (tuple has an ``index`` already)
    params: SamplingParams
    stops: tuple[str, ...]
    deadline: float | None
    cancel: threading.Event
    emit: Callable[[Delta], None]
    finish: Callable[[SampleDone], None]


class _Sequence:
    """One sequence of a batched decode: its sampler, its text so far, and why it
    ended. ``take`` and ``goes_on`` run once per token: they mirror ``_decode``."""

    def __init__(
        self,
        worker: _Worker,
        batch: BatchContext,
        seq: int,
        sample: BatchSample,
        budget: int,
        lstrip: bool,
        started: float,
        prompt_tokens: int,
    ) -> None:
        params = sample.params
        self._worker = worker
        self._batch = batch
        self._seq = seq
        self._sample = sample
        self._budget = budget
        self._started = started
        self._prompt_tokens = prompt_tokens
        self._sampler = SequenceSampler(worker.llm, params)
        self._vocab = worker.llm._model.vocab
        self._recorder = (
            LogprobRecorder(worker.llm, worker.token_bytes, params.top_logprobs, batch.ctx)
            if params.logprobs
            else None
        )
        self._answer = _Answer(sample.sample_index, lstrip, sample.emit)
        self._matcher = StopMatcher(sample.stops)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._first_token_at: float | None = None
        self._token = -1
        self.count = 0
        self.row = -1  # where the last decode left this sequence's logits

    def take(self) -> bool:
        """Sample the next token into the answer; False when it ended the sample."""
        token = self._token = self._sampler.sample(self._batch.ctx, self.row)
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()
        if llama_cpp.llama_vocab_is_eog(self._vocab, token):
            return self._end("stop")
        self.count += 1
        self._worker.tokens_generated += 1
        answer = self._answer
        if self._recorder is not None:
            answer.pending.append(self._recorder.record(token, self.row))
        safe, matched = self._matcher.feed(self._decoder.decode(self._worker.token_bytes(token)))
        answer.flush(safe)
        return not matched or self._end("stop", matched=True)

    def goes_on(self) -> bool:
        """Whether another token is wanted: within the budget, before the deadline,
        not cancelled; checked before each decode, so a cancelled or late sample
        computes at most one token more."""
        if self.count >= self._budget:
            return self._end("length")
        if self._sample.cancel.is_set():
            return self._end("cancelled")
        deadline = self._sample.deadline
        if deadline is not None and time.monotonic() >= deadline:
            return self._end("deadline")
        return True

    @property
    def deadline(self) -> float | None:
        return self._sample.deadline

    def stopped(self) -> bool:
        """Cancelled or past its deadline: nothing more is wanted of it."""
        return self._sample.cancel.is_set() or past(self._sample.deadline)

    def unread(self) -> None:
        """End the sample before its prompt was read: it was cancelled, or the deadline
        came (or would come) first."""
        self._end("cancelled" if self._sample.cancel.is_set() else "deadline")

    def next_input(self) -> tuple[int, int, int]:
        """The last token, where it goes in the sequence, and the sequence."""
        return self._token, self._prompt_tokens + self.count - 1, self._seq

    def close(self) -> None:
        self._sampler.close()

    def _end(self, finish: FinishReason, matched: bool = False) -> bool:
        if not matched:  # text held back as a possible stop sequence was not one
            tail = self._matcher.flush() + self._decoder.decode(b"", final=True)
            self._answer.flush(tail, final=True)
        self._batch.drop(self._seq, self._prompt_tokens)
        first = self._first_token_at
        timings = Timings(
            queue_s=0.0,
            first_token_s=None if first is None else first - self._started,
            total_s=time.monotonic() - self._started,
        )
        sample = self._answer.sample(finish, self.count, timings)
        self._sample.finish(SampleDone(sample, self._prompt_tokens))
        return False


class _Answer:
    """One sample's text, tool calls and logprobs, emitted as they become final. Text
    held back (a possible stop sequence, part of a UTF-8 character, what may be the
    start of a tool call's markup) keeps its tokens' logprobs in ``pending`` until it
    is emitted with them; the tokens of a call go out with its parts."""

    __slots__ = ("_calls", "_emit", "_index", "_lstrip", "logprobs", "pending", "pieces")

    def __init__(
        self,
        index: int,
        lstrip: bool,
        emit: Callable[[Delta], None],
        calls: CallParser | None = None,
    ) -> None:
        self._index = index
        self._lstrip = lstrip
        self._emit = emit
        self._calls = calls  # None: the request offers no tools, all is text
        self.pieces: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.pending: list[TokenLogprob] = []

    def flush(self, piece: str, final: bool = False) -> None:
        if self._lstrip and not any(self.pieces):
            # A completion template ends with "Answer:"; the model's reply starts
            # with the space after it, which is not part of the answer.
            piece = piece.lstrip()
        parts: tuple[ToolCallDelta, ...] = ()
        if self._calls is not None:
            piece, parts = self._calls.feed(piece)
            if final:
                tail, last = self._calls.finish()
                piece, parts = piece + tail, parts + last
        if piece or parts or (final and self.pending):
            self.pieces.append(piece)
            self.logprobs.extend(self.pending)
            self._emit(Delta(self._index, piece, tuple(self.pending), parts))
            self.pending.clear()

    def settle(self) -> None:
        """A stop sequence ended the sample: what the call parser holds is final. (The
        logprobs still pending are the stop sequence's, which is not emitted.)"""
        if self._calls is None:
            return
        piece, parts = self._calls.finish()
        if piece or parts:
            self.pieces.append(piece)
            self._emit(Delta(self._index, piece, (), parts))

    def sample(self, finish: FinishReason, tokens: int, timings: Timings) -> Sample:
        calls = () if self._calls is None else self._calls.calls
        if calls and finish == "stop":  # the model ended its turn with its calls
            finish = "tool_calls"
        return Sample(
            index=self._index,
            text="".join(self.pieces),
            finish_reason=finish,
            completion_tokens=tokens,
            logprobs=tuple(self.logprobs),
            tool_calls=calls,
            timings=timings,
        )


class LlamaCppEngine(FanOutEngine):
    def __init__(self, name: str, settings: LlamaCppSettings, models_dir: Path) -> None:
        self.name = name
        self.model = settings.model
        # JSON answers are held to their grammar whatever the model; tools are added at
        # start, when the model's chat template shows it writes their calls.
        self.features: frozenset[Feature] = frozenset({"json_object", "json_schema"})
        self.timeout_s = settings.timeout_s
        self._settings = settings
        self._models_dir = models_dir
        self._admission = Admission(
            name, settings.concurrency, settings.queue_size, settings.retry_after_s
        )
        self.counters = EngineCounters()
        self._executor = ThreadPoolExecutor(
            settings.concurrency, thread_name_prefix=name, initializer=_yield_to_event_loop
        )
        self._workers: list[_Worker] = []
        self._idle: list[_Worker] = []
        self._formatter: Jinja2ChatFormatter | None = None
        template = settings.template
        self._completion = template if isinstance(template, CompletionTemplate) else None
        self._gathering = Gathering(settings.batch_sequences, self._serve)

    async def start(self) -> None:
        route_to_logging()
        loop = asyncio.get_running_loop()
        path = await loop.run_in_executor(self._executor, model_file, self.model, self._models_dir)
        # A library this host cannot run would kill this process at its first token:
        # a child process generates with this model first (LlamaCppUnusable says what
        # to do otherwise), so an engine that starts has a model that generates here.
        # Not a warm-up token in this process as well: one at start made every later
        # streamed first token through the gateway 13-15 ms slower (docs/benchmarks.md).
        await check_models([path], self._settings.threads)
        loads = [
            loop.run_in_executor(self._executor, _Worker, path, self._settings)
            for _ in range(self._settings.concurrency)
        ]
        self._workers = list(await asyncio.gather(*loads))
        self._idle = list(self._workers)
        if self._completion is None:
            llm = self._idle[0].llm
            formatter = self._formatter = self._chat_formatter(llm)
            # Rendering a probe conversation takes a few ms of Jinja: off the event loop.
            if await loop.run_in_executor(self._executor, _writes_tool_calls, formatter):
                self.features |= {"tools"}

    async def close(self) -> None:
        # Waits for samples still running; their callers are gone or finishing.
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        for worker in self._workers:
            worker.close()
        self._workers = self._idle = []

    @property
    def tokens_generated(self) -> int:
        """Tokens sampled since start, over all samples, finished or cut short."""
        return sum(worker.tokens_generated for worker in self._workers)

    @property
    def batched_samples(self) -> int:
        """Samples decoded in a batch with others of their prompt since start."""
        return sum(worker.batched_samples for worker in self._workers)

    @property
    def prompts_refused(self) -> int:
        """Samples refused at once: their prompt could not be read before the deadline."""
        return sum(worker.prompts_refused for worker in self._workers)

    @property
    def prompts_stopped(self) -> int:
        """Samples stopped while their prompt was read: the deadline came, or a cancel."""
        return sum(worker.prompts_stopped for worker in self._workers)

    @property
    def busy_slots(self) -> int:
        """Slots whose worker is still generating (a cancelled one until it stops)."""
        return len(self._workers) - len(self._idle)

    def _chat_formatter(self, llm: llama_cpp.Llama) -> Jinja2ChatFormatter:
        source = llm.metadata.get("tokenizer.chat_template")
        if source is None:
            raise EngineError(
                self.name,
                f"model {self.model!r} has no chat template; configure a completion template",
            )
        eos, bos = llm.token_eos(), llm.token_bos()
        return Jinja2ChatFormatter(
            template=source,
            eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
            bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
        )

    def _shape(self, params: SamplingParams, worker: _Worker) -> Shape:
        """How ``params`` ask for the answer, its grammar checked by llama.cpp (on the
        worker's thread: building it is CPU work, if brief)."""
        shape = shape_of(params, self.name)
        if shape.grammar is not None:
            try:
                check_grammar(worker.llm._model.vocab, shape.grammar)
            except GrammarError as exc:
                param = "tools" if shape.names else "response_format"
                raise InvalidShape(self.name, param, str(exc)) from None
        return shape

    def _render(self, prompt: Prompt, shape: Shape = PLAIN) -> tuple[str, bool, bool]:
        """The prompt text, whether the tokenizer must add BOS (chat templates write
        their own) and whether to strip the space a completion template leaves."""
        if isinstance(prompt, str):
            return prompt, True, False
        # A conversation ending in an assistant turn continues it: the text goes on
        # from its last character, spaces and all.
        continuing = continues(prompt)
        if self._completion is not None:
            return self._completion.render(prompt), True, not continuing
        if self._formatter is None:
            raise EngineError(self.name, "engine is not started")
        earlier = prompt[:-1] if continuing else prompt
        text = self._formatter(
            messages=_chat_dicts(earlier),  # type: ignore[arg-type]
            tools=shape.tools,  # type: ignore[arg-type]
        ).prompt
        return text + (prompt[-1].content if continuing else ""), False, False

    def stream(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None = None
    ) -> AsyncGenerator[Delta | Generation]:
        # A batch shares one rendered prompt and samples without a grammar: requests
        # with tools or a response format take a slot per sample.
        plain = params.tools is None and params.response_format is None
        if self._settings.batch_samples and plain:
            return self._gathered(prompt, params, deadline)
        return super().stream(prompt, params, deadline)

    async def _gathered(
        self, prompt: Prompt, params: SamplingParams, deadline: float | None
    ) -> AsyncGenerator[Delta | Generation]:
        """``stream`` with batching on: the request's samples join the samples of the
        same prompt asked for in this turn of the event loop, and each group of them
        is decoded as one batch in one slot."""
        deadline = self._deadline(deadline)
        merged: asyncio.Queue[Delta | SampleDone | Exception] = asyncio.Queue()
        joined = time.monotonic()
        members = []
        for index in range(params.n):
            # Seeded requests stay reproducible while their n samples still differ.
            seed = None if params.seed is None else params.seed + index
            own = msgspec.structs.replace(params, n=1, seed=seed)
            member = Member(index, own, deadline, merged, joined)
            members.append((self._gathering.join(prompt, member), member))
        try:
            async with contextlib.aclosing(self._merged(merged, params.n)) as items:
                async for item in items:
                    yield item
        finally:
            for group, member in members:
                self._gathering.leave(group, member)

    async def _serve(self, group: Group) -> None:
        """Decode one group in one slot: alone, as the single path does, or as a batch."""
        members = group.members
        deadlines = [m.deadline for m in members]
        latest = None if None in deadlines else max(d for d in deadlines if d is not None)
        try:
            admitted = await self._admit(latest)
        except EngineOverloaded as exc:
            for member in members:
                member.hand(exc)
            return
        admitted_at = time.monotonic()
        if not admitted:
            for member in members:
                member.hand(expired(member.index, admitted_at - member.joined))
            return
        group.submitted = True
        worker = self._idle.pop()
        loop = asyncio.get_running_loop()
        samples = [self._batch_sample(m, admitted_at, loop) for m in members]

        def work() -> None:
            rendered = self._render(group.prompt)
            if len(samples) > 1:
                worker.run_batch(self.name, rendered, samples)
                return
            one = samples[0]
            done = worker.run(
                self.name,
                rendered,
                one.params,
                one.sample_index,
                one.stops,
                one.deadline,
                one.cancel,
                one.emit,
            )
            one.finish(done)

        def release(finished: asyncio.Future[None]) -> None:
            self._idle.append(worker)
            self._admission.release()
            if not finished.cancelled():
                finished.exception()  # read below, or nobody is left to; don't warn

        future = loop.run_in_executor(self._executor, work)
        future.add_done_callback(release)
        try:
            # Shielded: the slot is free when the worker is, not when this task is.
            await asyncio.shield(future)
        except Exception as exc:  # handed to every sample still waiting
            for member in members:
                if not member.finished:
                    member.hand(exc)

    def _batch_sample(
        self, member: Member, admitted_at: float, loop: asyncio.AbstractEventLoop
    ) -> BatchSample:
        """What the worker needs of one member; what it hands back goes to the
        member's stream on the event loop, the SampleDone with the time it queued."""
        queue_s = admitted_at - member.joined

        def hand(item: Delta | SampleDone) -> None:
            if isinstance(item, SampleDone):
                timings = msgspec.structs.replace(item.sample.timings, queue_s=queue_s)
                sample = msgspec.structs.replace(item.sample, timings=timings)
                item = SampleDone(sample, item.prompt_tokens)
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
                loop.call_soon_threadsafe(member.hand, item)

        stops = member.params.stop + (self._completion.stop if self._completion else ())
        return BatchSample(
            member.index, member.params, stops, member.deadline, member.cancel, hand, hand
        )

    async def _sample(
        self,
        prompt: Prompt,
        params: SamplingParams,
        index: int,
        deadline: float | None,
        queue_s: float,
    ) -> AsyncGenerator[Delta | SampleDone]:
        worker = self._idle.pop()
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta | None] = asyncio.Queue()
        cancel = threading.Event()
        stops = params.stop + (self._completion.stop if self._completion else ())

        def emit(delta: Delta | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
                loop.call_soon_threadsafe(deltas.put_nowait, delta)

        def work() -> SampleDone:
            try:
                shape = self._shape(params, worker)
                rendered = self._render(prompt, shape)
                return worker.run(
                    self.name, rendered, params, index, stops, deadline, cancel, emit, shape
                )
            finally:
                emit(None)

        # The slot is free when the worker thread is, which for a cancelled sample is
        # a token after this generator is gone.
        def release(finished: asyncio.Future[SampleDone]) -> None:
            self._idle.append(worker)
            self._admission.release()
            if not finished.cancelled():
                finished.exception()  # a cancelled caller never reads it; don't warn

        future = loop.run_in_executor(self._executor, work)
        future.add_done_callback(release)
        try:
            while (delta := await deltas.get()) is not None:
                yield delta
            done = await future
        finally:
            cancel.set()
        timings = msgspec.structs.replace(done.sample.timings, queue_s=queue_s)
        yield SampleDone(msgspec.structs.replace(done.sample, timings=timings), done.prompt_tokens)


def _yield_to_event_loop() -> None:
    """Run this worker thread, and the llama.cpp threads it starts, at a lower priority.

    llama.cpp's threads keep every core busy while they decode; at equal priority the
    event loop waits for a scheduler tick to hand over a token or answer a request.
    The threads llama.cpp starts from this one inherit its nice value.
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)


def _writes_tool_calls(formatter: Jinja2ChatFormatter) -> bool:
    """Whether the model's chat template shows tools and writes calls in the markup
    engines.tool_calls reads (Qwen2.5's does; SmolLM2's has no tools)."""

    def render(messages: Sequence[dict[str, Any]], tools: list[Any] | None) -> str:
        return formatter(messages=messages, tools=tools).prompt  # type: ignore[arg-type]

    return renders_tool_calls(render)


def _chat_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [_chat_dict(m) for m in messages]


def _chat_dict(message: Message) -> dict[str, Any]:
    """A turn as chat templates read it (OpenAI's shape, as Hugging Face passes it)."""
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _arguments(text: str) -> Any:
    """A call's arguments as templates write them: Qwen's passes them through
    ``tojson``, which would quote JSON text a second time; the object it encodes is
    written once. Text that is no JSON stays text."""
    try:
        return json.loads(text)
    except ValueError:
        return text
