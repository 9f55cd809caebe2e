"""Sampling held to a grammar, at about the cost of sampling without one.

llama.cpp's grammar sampler, put in a sampler chain, filters every token of the
vocabulary at every step: 11 ms a token over Qwen2.5's 152k tokens at a JSON object's
punctuation, 25-60 ms inside a string (measured here), as much again as the 0.5B
model's own step. The model's first choice nearly always fits the grammar, so
``GrammarSampler`` samples as if there were none, asks the grammar about that one
token, and filters the whole vocabulary only when it does not fit: the scheme of
llama.cpp's own ``common_sampler``. The sample drawn is the one the filtered chain
would draw whenever the first choice fits, and a draw from the filtered chain otherwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Generator, Sequence

import llama_cpp
import numpy as np

from engines.base import SamplingParams
from engines.grammars import GrammarError
from engines.llama_batch import sampler_chain


class GrammarSampler:
    """The sampler chain of ``params``, held to ``grammar`` (GBNF, rule "root")."""

    def __init__(self, llm: llama_cpp.Llama, params: SamplingParams, grammar: str) -> None:
        vocab = llm._model.vocab
        self._n_vocab = llm.n_vocab()
        self._grammar = llama_cpp.llama_sampler_init_grammar(
            vocab, grammar.encode("utf-8"), b"root"
        )
        if not self._grammar:
            raise GrammarError("llama.cpp could not parse the grammar built for it")
        self._chain = sampler_chain(llm, params)
        self._data = (llama_cpp.llama_token_data * self._n_vocab)()
        self._view = np.ctypeslib.as_array(self._data)  # fields id, logit and p
        self._ids = np.arange(self._n_vocab, dtype=np.int32)
        self._one = (llama_cpp.llama_token_data * 1)()
        self._closed = False

    def sample(self, ctx: llama_cpp.llama_context_p, row: int = -1) -> int:
        """Sample (and accept) the next token from the logits at ``row``."""
        token = self._draw(ctx, row, filtered=False)
        if not self._fits(token):
            token = self._draw(ctx, row, filtered=True)
        llama_cpp.llama_sampler_accept(self._grammar, token)
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            llama_cpp.llama_sampler_free(self._chain)
            llama_cpp.llama_sampler_free(self._grammar)

    def _draw(self, ctx: llama_cpp.llama_context_p, row: int, filtered: bool) -> int:
        """What the chain picks from the logits at ``row`` (the grammar's filter
        first when ``filtered``); nothing is accepted yet."""
        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(ctx, row), shape=(self._n_vocab,)
        )
        # The samplers sort and cut the array in place: it is filled afresh each time.
        self._view["id"] = self._ids
        self._view["logit"] = logits
        self._view["p"] = 0.0
        candidates = llama_cpp.llama_token_data_array(
            data=self._data, size=self._n_vocab, selected=-1, sorted=False
        )
        if filtered:
            llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(candidates))
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(candidates))
        # A sampler may point ``data`` elsewhere: the pick is read through it.
        return int(candidates.data[candidates.selected].id)

    def _fits(self, token: int) -> bool:
        self._one[0] = llama_cpp.llama_token_data(token, 1.0, 0.0)
        single = llama_cpp.llama_token_data_array(data=self._one, size=1, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(single))
        return bool(np.isfinite(self._one[0].logit))


def constrained_tokens(
    llm: llama_cpp.Llama, prompt_tokens: Sequence[int], held: int, sampler: GrammarSampler
) -> Generator[int]:
    """The tokens ``sampler`` draws after the prompt, one decode per step, as
    ``Llama.generate`` yields them: the ``held`` first prompt tokens the context holds
    already are kept (all but the last, whose logits are the first sample's)."""
    try:
        keep = min(held, len(prompt_tokens) - 1)
        if keep > 0 and llm._ctx.kv_cache_seq_rm(-1, keep, -1):
            llm.n_tokens = keep
        else:
            keep = 0
            llm.reset()  # type: ignore[no-untyped-call]
        tokens = list(prompt_tokens[keep:])
        while True:
            llm.eval(tokens)
            token = sampler.sample(llm._ctx.ctx)
            yield token
            tokens = [token]
    finally:
        sampler.close()
