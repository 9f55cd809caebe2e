"""In-process llama.cpp backend for GGUF models (llama-cpp-python).

Each concurrency slot owns one ``Llama`` instance and one worker thread: a llama.cpp
context is not thread-safe, and generation must never run on the event loop. The
worker drives ``Llama.generate`` token by token, so it can check for cancellation
and the deadline between any two tokens.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ctypes
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import llama_cpp
import msgspec
import numpy as np
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from engines.admission import Admission
from engines.base import (
    Delta,
    EngineError,
    FinishReason,
    Message,
    Prompt,
    PromptTooLong,
    Sample,
    SamplingParams,
    Timings,
    TokenLogprob,
    TopLogprob,
)
from engines.bundled import model_file
from engines.fanout import EngineCounters, FanOutEngine, SampleDone
from engines.native_check import check_models
from engines.settings import LlamaCppSettings
from engines.stops import StopMatcher
from engines.templates import CompletionTemplate, continues

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

    def __init__(self, llm: llama_cpp.Llama, token_bytes: TokenBytes, top: int) -> None:
        self._llm = llm
        self._token_bytes = token_bytes
        self._top = top
        self._n_vocab = llm.n_vocab()

    def record(self, token: int) -> TokenLogprob:
        pointer = self._llm._ctx.get_logits_ith(-1)
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
    ) -> SampleDone:
        started = time.monotonic()
        text, add_bos, lstrip = prompt
        prompt_tokens = self._prompt_tokens(engine, text, add_bos)
        budget = min(params.max_tokens, self.context_tokens - len(prompt_tokens))
        recorder = (
            LogprobRecorder(self.llm, self.token_bytes, params.top_logprobs)
            if params.logprobs
            else None
        )
        answer = _Answer(index, lstrip, emit)
        tokens = self._sampled_tokens(prompt_tokens, params)
        decoded = self._decode(
            tokens, answer, StopMatcher(stops), recorder, budget, deadline, cancel
        )
        first_token_at = decoded.first_token_at
        timings = Timings(
            queue_s=0.0,
            first_token_s=None if first_token_at is None else first_token_at - started,
            total_s=time.monotonic() - started,
        )
        return SampleDone(
            answer.sample(decoded.finish, decoded.tokens, timings), len(prompt_tokens)
        )

    def _prompt_tokens(self, engine: str, text: str, add_bos: bool) -> list[int]:
        tokens = self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        if len(tokens) >= self.context_tokens:
            raise PromptTooLong(engine, len(tokens), self.context_tokens)
        return tokens

    def _sampled_tokens(self, prompt_tokens: list[int], params: SamplingParams) -> Generator[int]:
        """The tokens the model samples after the prompt, one decode per step."""
        llm = self.llm
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
        tokens: Generator[int],
        answer: _Answer,
        matcher: StopMatcher,
        recorder: LogprobRecorder | None,
        budget: int,
        deadline: float | None,
        cancel: threading.Event,
    ) -> _Decoded:
        """Takes tokens into ``answer`` until the budget, a stop, the deadline or
        ``cancel``; this loop runs once per token, so it keeps to local names."""
        vocab = self.llm._model.vocab
        token_bytes = self.token_bytes
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending, flush = answer.pending, answer.flush
        first_token_at: float | None = None
        count = 0
        finish: FinishReason = "length"
        matched = False
        # Each step of `tokens` decodes one token; checking before every step means
        # a cancelled or late sample computes at most one token more.
        while count < budget:
            if cancel.is_set():
                finish = "cancelled"
                break
            if deadline is not None and time.monotonic() >= deadline:
                finish = "deadline"
                break
            token = next(tokens)
            if first_token_at is None:
                first_token_at = time.monotonic()
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
        tokens.close()
        if not matched:  # text held back as a possible stop sequence was not one
            flush(matcher.flush() + decoder.decode(b"", final=True), final=True)
        return _Decoded(finish, count, first_token_at)


class _Decoded(NamedTuple):
    """How a sample's decoding ended, how many tokens it took, and when the first came."""

    finish: FinishReason
    tokens: int
    first_token_at: float | None


class _Answer:
    """One sample's text and logprobs, emitted as they become final. Text held back
    (a possible stop sequence, part of a UTF-8 character) keeps its tokens'
    logprobs in ``pending`` until it is emitted with them."""

    __slots__ = ("_emit", "_index", "_lstrip", "logprobs", "pending", "pieces")

    def __init__(self, index: int, lstrip: bool, emit: Callable[[Delta], None]) -> None:
        self._index = index
        self._lstrip = lstrip
        self._emit = emit
        self.pieces: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.pending: list[TokenLogprob] = []

    def flush(self, piece: str, final: bool = False) -> None:
        if self._lstrip and not any(self.pieces):
            # A completion template ends with "Answer:"; the model's reply starts
            # with the space after it, which is not part of the answer.
            piece = piece.lstrip()
        if piece or (final and self.pending):
            self.pieces.append(piece)
            self.logprobs.extend(self.pending)
            self._emit(Delta(self._index, piece, tuple(self.pending)))
            self.pending.clear()

    def sample(self, finish: FinishReason, tokens: int, timings: Timings) -> Sample:
        return Sample(
            index=self._index,
            text="".join(self.pieces),
            finish_reason=finish,
            completion_tokens=tokens,
            logprobs=tuple(self.logprobs),
            timings=timings,
        )


class LlamaCppEngine(FanOutEngine):
    def __init__(self, name: str, settings: LlamaCppSettings, models_dir: Path) -> None:
        self.name = name
        self.model = settings.model
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

    async def start(self) -> None:
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
            self._formatter = self._chat_formatter(self._idle[0].llm)

    async def close(self) -> None:
        # Waits for samples still running; their callers are gone or finishing.
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        for worker in self._workers:
            worker.llm.close()
        self._workers = self._idle = []

    @property
    def tokens_generated(self) -> int:
        """Tokens sampled since start, over all samples, finished or cut short."""
        return sum(worker.tokens_generated for worker in self._workers)

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

    def _render(self, prompt: Prompt) -> tuple[str, bool, bool]:
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
        text = self._formatter(messages=_chat_dicts(earlier)).prompt  # type: ignore[arg-type]
        return text + (prompt[-1].content if continuing else ""), False, False

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
                rendered = self._render(prompt)
                return worker.run(self.name, rendered, params, index, stops, deadline, cancel, emit)
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


def _chat_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]
