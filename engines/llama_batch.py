"""Several sequences of one prompt in one llama.cpp context, decoded as one batch.

A model instance decoding one sequence leaves most of each step's time in reading
the weights; the same step for k sequences reads them once. The prompt is decoded
once, into sequence 0, and shared with sequences 1..k-1 (in a unified KV cache a
copied sequence points at the same cells, so the prompt is held once too); then each
step decodes one token of every sequence still running.

This module holds the llama.cpp side only (the context, its batch, the samplers); what
the tokens mean, stops and streaming, is the engine's (engines/llama_cpp.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp

from engines.base import SamplingParams

# The cache grows in steps of this many cells (llama.cpp pads to 256 anyway).
_CELLS = 256


class BatchDecodeFailed(RuntimeError):
    """llama.cpp refused a batch (no room in the KV cache, or a fatal error)."""


class BatchContext:
    """A llama.cpp context of up to ``sequences`` sequences over ``llm``'s weights.

    Its own context, beside the one ``llm`` decodes single samples in: that one keeps
    its settings, its prefix cache and its speed. The KV cache is unified (one pool
    of cells for every sequence), so the shared prompt takes its cells once and a
    sequence that ends early leaves its cells to the others. It is sized to the
    largest batch asked of it so far and only grows.
    """

    def __init__(self, llm: llama_cpp.Llama, sequences: int) -> None:
        self._llm = llm
        self.sequences = min(sequences, llama_cpp.llama_max_parallel_sequences())
        self._n_batch = llm.n_batch
        self._ctx: llama_cpp.llama_context_p | None = None
        self._cells = 0
        # The prompt whose cells sequence 0 still holds from the last batch: a loop's
        # next round, or the next request with the same prompt, decodes only what
        # differs (as Llama.generate does with its own context).
        self._held: list[int] = []
        # One token per sequence per step, or a chunk of the prompt: each token
        # belongs to one sequence (the prompt is copied to the others after).
        self._batch = llama_cpp.llama_batch_init(max(self._n_batch, self.sequences), 0, 1)

    @property
    def ctx(self) -> llama_cpp.llama_context_p:
        if self._ctx is None:
            raise RuntimeError("the batch context has not been sized yet")
        return self._ctx

    def reserve(self, cells: int) -> None:
        """Make room for ``cells`` KV cells in all: the prompt once, plus every token
        decoded of every sequence."""
        if self._ctx is None or cells > self._cells:
            self._free_context()
            size = max(cells, 2 * self._cells)
            size = -(-size // _CELLS) * _CELLS
            params = llama_cpp.llama_context_params.from_buffer_copy(self._llm.context_params)
            params.n_ctx = size
            params.n_seq_max = self.sequences
            params.kv_unified = True
            ctx = llama_cpp.llama_init_from_model(self._llm._model.model, params)
            if ctx is None:
                raise BatchDecodeFailed(f"llama.cpp could not make a context of {size} cells")
            self._ctx, self._cells = ctx, size
            self._held = []

    def prefill(self, tokens: Sequence[int], copies: int) -> int:
        """Decode the prompt into sequence 0 (what it does not hold already), share it
        with sequences 1..copies-1, and return the batch row whose logits predict the
        first token."""
        batch, ctx = self._batch, self.ctx
        start = self._keep_prefix(tokens)
        self._held = []  # until the prompt is whole again
        last = 0
        for offset in range(start, len(tokens), self._n_batch):
            chunk = tokens[offset : offset + self._n_batch]
            for i, token in enumerate(chunk):
                self._put(i, token, offset + i, 0, offset + i == len(tokens) - 1)
            batch.n_tokens = len(chunk)
            self._decode()
            last = len(chunk) - 1
        self._held = list(tokens)
        memory = llama_cpp.llama_get_memory(ctx)
        for seq in range(1, copies):
            llama_cpp.llama_memory_seq_cp(memory, 0, seq, -1, -1)
        return last

    def held(self, tokens: Sequence[int]) -> int:
        """How many of the first ``tokens`` sequence 0 holds, and ``prefill`` need not
        decode again."""
        common = 0
        for held, token in zip(self._held, tokens, strict=False):
            if held != token:
                break
            common += 1
        # The last prompt token is decoded again: its logits are the first sample's.
        return max(0, min(common, len(tokens) - 1))

    def _keep_prefix(self, tokens: Sequence[int]) -> int:
        """Empty the cache but for the longest start of ``tokens`` sequence 0 holds;
        how many tokens that is."""
        memory = llama_cpp.llama_get_memory(self.ctx)
        common = self.held(tokens)
        if common > 0 and llama_cpp.llama_memory_seq_rm(memory, -1, common, -1):
            for seq in range(1, self.sequences):
                llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
            return common
        llama_cpp.llama_memory_clear(memory, True)
        return 0

    def step(self, tokens: Sequence[tuple[int, int, int]]) -> None:
        """Decode one ``(token, position, sequence)`` per running sequence; the logits
        of the i-th are then at row i."""
        for i, (token, pos, seq) in enumerate(tokens):
            self._put(i, token, pos, seq, True)
        self._batch.n_tokens = len(tokens)
        self._decode()

    def drop(self, seq: int, prompt_tokens: int) -> None:
        """Free the cells of what sequence ``seq`` generated; it takes no further part.
        The prompt's cells stay (shared, and held for the next batch)."""
        memory = llama_cpp.llama_get_memory(self.ctx)
        llama_cpp.llama_memory_seq_rm(memory, seq, prompt_tokens, -1)

    def close(self) -> None:
        self._free_context()
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None

    def _put(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch = self._batch
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    def _decode(self) -> None:
        status = llama_cpp.llama_decode(self.ctx, self._batch)
        if status != 0:
            raise BatchDecodeFailed(f"llama_decode returned {status}")

    def _free_context(self) -> None:
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx, self._cells = None, 0


class SequenceSampler:
    """One sequence's sampler chain, the same chain ``Llama.generate`` builds for the
    same settings (so one seed gives one sample whichever path decodes it)."""

    def __init__(self, llm: llama_cpp.Llama, params: SamplingParams) -> None:
        self._chain: llama_cpp.llama_sampler_p | None = sampler_chain(llm, params)

    def sample(self, ctx: llama_cpp.llama_context_p, row: int) -> int:
        """Sample (and accept) the next token from the logits at batch ``row``."""
        return int(llama_cpp.llama_sampler_sample(self._chain, ctx, row))

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)  # frees its links too
            self._chain = None


def sampler_chain(llm: llama_cpp.Llama, params: SamplingParams) -> llama_cpp.llama_sampler_p:
    """The sampler chain ``Llama.generate`` builds for ``params`` (the caller frees it)."""
    chain: llama_cpp.llama_sampler_p = llama_cpp.llama_sampler_chain_init(
        llama_cpp.llama_sampler_chain_default_params()
    )
    links = [
        llama_cpp.llama_sampler_init_penalties(
            llm.n_vocab(),
            llm.last_n_tokens_size,
            1.0,
            params.frequency_penalty,
            params.presence_penalty,
        )
    ]
    seed = llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed
    if params.temperature == 0:
        links.append(llama_cpp.llama_sampler_init_greedy())
    else:
        links += [
            # OpenAI semantics: only temperature and top_p shape sampling.
            llama_cpp.llama_sampler_init_top_k(0),
            llama_cpp.llama_sampler_init_typical(1.0, 1),
            llama_cpp.llama_sampler_init_top_p(params.top_p, 1),
            llama_cpp.llama_sampler_init_min_p(0.0, 1),
            llama_cpp.llama_sampler_init_temp(params.temperature),
            llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF),
        ]
    for link in links:
        llama_cpp.llama_sampler_chain_add(chain, link)
    return chain


def logits_row(ctx: llama_cpp.llama_context_p, row: int) -> ctypes._Pointer[ctypes.c_float]:
    """The logits the last decode left at batch ``row``."""
    pointer: ctypes._Pointer[ctypes.c_float] = llama_cpp.llama_get_logits_ith(ctx, row)
    return pointer
