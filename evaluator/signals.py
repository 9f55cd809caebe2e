"""Confidence signals: what one round's samples say about a candidate answer.

Three families, each usable on its own:

* agreement across the k samples: the vote share, and Adaptive-Consistency's posterior
  that the current majority stays the majority (Aggarwal et al. 2023, arXiv 2305.11860,
  the method's "Beta Stopping Criteria"; its code: Pranjal2041/AdaptiveConsistency,
  ``adaptive_consistency/stopping_criterias.py``, ``BetaStoppingCriteria``);
* token confidence from logprobs as DeepConf defines it (Fu et al. 2025, arXiv
  2508.15260: "Token Confidence", "Average Trace Confidence", "Group Confidence",
  "Bottom 10% Group Confidence", "Lowest Group Confidence", "Tail Confidence"; its code:
  facebookresearch/deepconf, ``helper.py`` and ``analysis_offline.py``);
* answer probes mid-reasoning (Dynasor-CoT, arXiv 2412.20993, code hao-ai-lab/Dynasor
  ``dynasor/cot.py``; DEER, arXiv 2504.15895): only the pure half here, reading a
  probe's answer and deciding whether the last m probes agree. Sending probes to an
  engine belongs to the loop.

Where a paper's prose and its code differ in a detail, the code is followed and the
comment says so.

Everything here is a pure function of its inputs; ``Signals`` gathers them for one
candidate answer in one round, and ``Signals.features`` lays them out for the calibrator.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Annotated, Literal, Protocol, get_args

import msgspec

from evaluator.answers import AnswerKind, extract

# --- inputs ----------------------------------------------------------------------------
# Protocols rather than engines.base types, so that a stored run (evaluator.runs) and a
# live engines.base.Sample both qualify without converting one into the other.


class Alternative(Protocol):
    @property
    def logprob(self) -> float: ...


class Token(Protocol):
    @property
    def logprob(self) -> float: ...

    @property
    def top(self) -> Sequence[Alternative]: ...


class Trace(Protocol):
    @property
    def text(self) -> str: ...

    @property
    def logprobs(self) -> Sequence[Token]: ...


class SignalSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the signals are computed. A calibrator is only valid with the settings it was
    fitted with, so its file carries them."""

    # DeepConf's group window and tail are 2048 tokens each, sized for long reasoning
    # traces; our answers run to tens or hundreds of tokens.
    group_window: Annotated[int, msgspec.Meta(ge=1)] = 16
    tail_tokens: Annotated[int, msgspec.Meta(ge=1)] = 32
    # "Bottom 10% group confidence": the mean of this share of the lowest groups.
    bottom_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.1
    # Token confidence averages the top-k alternatives' log-probs. Its scale grows with
    # k, so k is fixed here rather than taken from whatever the engine returned; ask the
    # engine for at least this many (SamplingParams.top_logprobs).
    top_k: Annotated[int, msgspec.Meta(ge=1)] = 5
    # Dynasor-CoT stops when this many consecutive probes agree (its "mid" effort is 3).
    probe_agreement: Annotated[int, msgspec.Meta(ge=1)] = 3
    # Dynasor-CoT discards a probe whose text hesitates. Its list also has "no", which
    # here is a yes/no answer, so it is left out; words match whole, not as substrings
    # (Dynasor's substring test would count "know" or "nothing" as "no").
    hesitation_words: tuple[str, ...] = ("wait", "hold", "but", "okay", "hmm")


DEFAULT_SETTINGS = SignalSettings()


# --- agreement -------------------------------------------------------------------------


def majority(answers: Iterable[str | None]) -> str | None:
    """The most frequent answer; ties go to the one seen first; None when none answered.

    A sample with no extractable answer is not a competing answer, so it never wins.
    """
    counts = Counter(answer for answer in answers if answer is not None)
    # most_common keeps first-seen order among equal counts.
    return counts.most_common(1)[0][0] if counts else None


def votes(answers: Sequence[str | None], candidate: str | None) -> tuple[int, int]:
    """(samples giving ``candidate``, samples giving the most frequent other answer)."""
    counts = Counter(answer for answer in answers if answer is not None)
    own = counts.pop(candidate, 0) if candidate is not None else 0
    return own, max(counts.values(), default=0)


def vote_share(answers: Sequence[str | None], candidate: str | None) -> float:
    """Share of all k samples, answered or not, that gave ``candidate``."""
    if not answers:
        raise ValueError("vote share of no samples")
    return votes(answers, candidate)[0] / len(answers)


def beta_majority_probability(leader: int, runner_up: int) -> float:
    """Adaptive-Consistency's Beta stopping criterion (arXiv 2305.11860).

    With ``leader`` = v1 and ``runner_up`` = v2 votes for the two most frequent answers
    and a uniform prior, the paper models p1 / (p1 + p2) as Beta(v1 + 1, v2 + 1) and stops
    when P(p1 > p2) = ∫_0.5^1 x^v1 (1-x)^v2 dx / B(v1 + 1, v2 + 1) exceeds a threshold
    (0.95 in the paper). Its code integrates numerically (scipy quad); for whole counts
    the integral has a closed form, 1 - I_0.5(v1 + 1, v2 + 1) = P(Binomial(v1 + v2 + 1,
    1/2) <= v1), which is computed here exactly in integers.
    """
    if leader < 0 or runner_up < 0:
        raise ValueError("vote counts cannot be negative")
    n = leader + runner_up + 1
    return sum(math.comb(n, j) for j in range(leader + 1)) / (1 << n)


# The paper's C_thresh: it stops sampling once the majority is this likely to stay.
BETA_STOP_THRESHOLD = 0.95


def beta_stop(answers: Sequence[str | None], threshold: float = BETA_STOP_THRESHOLD) -> bool:
    """Adaptive-Consistency's own decision over the answers so far, as its code makes
    it (``prob >= conf_thresh``); never with no answer at all."""
    leader = majority(answers)
    return leader is not None and beta_majority_probability(*votes(answers, leader)) >= threshold


# --- token confidence ------------------------------------------------------------------


def token_confidence(token: Token, top_k: int) -> float | None:
    """DeepConf's C_i = -(1/k) Σ_{j<=k} log P_i(j) over the k most likely tokens.

    High when the distribution is peaked. None when the backend gave no alternatives:
    the chosen token alone cannot stand in, since -log P of one token runs the other way
    (a peaked distribution gives it a value near 0). Non-finite log-probs (a server's
    null) are left out.
    """
    best = sorted((a.logprob for a in token.top if math.isfinite(a.logprob)), reverse=True)
    best = best[:top_k]
    return -sum(best) / len(best) if best else None


def group_confidences(confidences: Sequence[float], window: int) -> list[float]:
    """Means over every full window of ``window`` consecutive tokens (DeepConf's C_G,
    overlapping sliding windows); a trace shorter than one window is one group, as in
    DeepConf's code."""
    if not confidences:
        return []
    if len(confidences) <= window:
        return [sum(confidences) / len(confidences)]
    means = []
    total = sum(confidences[:window])
    means.append(total / window)
    for end in range(window, len(confidences)):
        total += confidences[end] - confidences[end - window]
        means.append(total / window)
    return means


class LowConfidenceWatch:
    """DeepConf's online filter for one trace: fed its tokens in order, it says when
    the mean token confidence over the last full window falls below the cut-off (the
    trace is then stopped). Tokens without alternatives have no confidence and do not
    fill the window."""

    def __init__(self, cutoff: float, settings: SignalSettings = DEFAULT_SETTINGS) -> None:
        self._cutoff = cutoff
        self._top_k = settings.top_k
        self._window = settings.group_window
        self._recent: list[float] = []
        self._total = 0.0

    def feed(self, token: Token) -> bool:
        confidence = token_confidence(token, self._top_k)
        if confidence is None:
            return False
        recent = self._recent
        recent.append(confidence)
        self._total += confidence
        if len(recent) > self._window:
            self._total -= recent[-self._window - 1]
        return len(recent) >= self._window and self._total / self._window < self._cutoff


class TraceConfidence(msgspec.Struct, frozen=True, kw_only=True):
    """DeepConf's trace-level measures for one sample; None where the logprobs lack them."""

    mean_logprob: float | None  # mean log-prob of the chosen tokens
    mean_confidence: float | None  # C_avg: mean token confidence ("self-certainty")
    lowest_group: float | None  # C_least: the lowest group confidence
    bottom_group: float | None  # mean of the lowest ``bottom_fraction`` of groups
    tail: float | None  # C_tail: mean token confidence of the last ``tail_tokens``


def trace_confidence(
    tokens: Sequence[Token], settings: SignalSettings = DEFAULT_SETTINGS
) -> TraceConfidence:
    chosen = [t.logprob for t in tokens if math.isfinite(t.logprob)]
    per_token = [c for c in (token_confidence(t, settings.top_k) for t in tokens) if c is not None]
    mean_logprob = sum(chosen) / len(chosen) if chosen else None
    if not per_token:
        return TraceConfidence(
            mean_logprob=mean_logprob,
            mean_confidence=None,
            lowest_group=None,
            bottom_group=None,
            tail=None,
        )
    groups = sorted(group_confidences(per_token, settings.group_window))
    # As DeepConf's code: at least one group, else the floor of the share.
    bottom = groups[: max(1, int(len(groups) * settings.bottom_fraction))]
    tail = per_token[-settings.tail_tokens :]
    return TraceConfidence(
        mean_logprob=mean_logprob,
        mean_confidence=sum(per_token) / len(per_token),
        lowest_group=groups[0],
        bottom_group=sum(bottom) / len(bottom),
        tail=sum(tail) / len(tail),
    )


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


# --- probes ----------------------------------------------------------------------------

# Dynasor-CoT appends "... Oh, I suddenly got the answer to the whole problem, **Final
# Answer**\n\n\\[ \\boxed{" to the reasoning so far. Our answers are not all boxed
# maths, so the probe ends on the "answer:" marker that every extractor in
# evaluator.answers reads instead.
PROBE_SUFFIX = "... Oh, I suddenly got the answer to the whole problem. Final answer:"
# Dynasor's probes generate at most 20 tokens; an answer fits on one line.
PROBE_MAX_TOKENS = 20
PROBE_STOP = ("\n",)


def probe_prompt(reasoning: str, suffix: str = PROBE_SUFFIX) -> str:
    """The text to continue for a probe: the reasoning so far, cut short by ``suffix``."""
    return reasoning + suffix


class Probe(msgspec.Struct, frozen=True, kw_only=True):
    """One probe's answer and what it cost, so that the loop can count it."""

    answer: str | None
    certain: bool  # the probe's text does not hesitate
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # the suffix, or more if re-read
    completion_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def read_probe(
    kind: AnswerKind,
    continuation: str,
    *,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    settings: SignalSettings = DEFAULT_SETTINGS,
) -> Probe:
    """A probe from the engine's continuation of ``probe_prompt(...)``."""
    line = continuation.split("\n", 1)[0]
    # The marker that ended the prompt is put back, so extraction reads "answer: <line>"
    # by the same rules as a full answer.
    answer = extract(kind, line) if kind == "text" else extract(kind, "Final answer:" + line)
    return Probe(
        answer=answer,
        certain=not hesitates(line, settings.hesitation_words),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


def hesitates(text: str, words: Sequence[str]) -> bool:
    if not words:
        return False
    pattern = r"\b(?:" + "|".join(re.escape(w) for w in words) + r")\b"
    return re.search(pattern, text, re.IGNORECASE) is not None


def probe_streak(probes: Sequence[Probe], candidate: str | None = None) -> int:
    """How many of the latest probes, counting back, are certain and give the same
    answer (``candidate``, or else the last probe's). An unanswered probe ends it."""
    if not probes:
        return 0
    target = probes[-1].answer if candidate is None else candidate
    streak = 0
    for probe in reversed(probes):
        if target is None or probe.answer != target or not probe.certain:
            break
        streak += 1
    return streak


def probes_agree(probes: Sequence[Probe], m: int) -> bool:
    """Dynasor-CoT's certainty: the last ``m`` probes all answered, none hesitated, and
    all gave the same answer."""
    if m < 1:
        raise ValueError("m must be at least 1")
    return probe_streak(probes) >= m


def probe_tokens(probes: Iterable[Probe]) -> int:
    return sum(probe.tokens for probe in probes)


# --- one candidate, one round ----------------------------------------------------------

FeatureName = Literal[
    "vote_share",
    "majority_probability",
    "mean_logprob",
    "mean_confidence",
    "lowest_group_confidence",
    "bottom_group_confidence",
    "tail_confidence",
    # What the question asks for (free text is the baseline): how often a tiny model
    # is right differs far more between kinds than any signal within one.
    "kind_choice",
    "kind_yesno",
    "kind_number",
    "probe_streak",
]
FEATURES: tuple[FeatureName, ...] = get_args(FeatureName)
# What `satisfice evaluator fit` uses unless told: what stored runs carry (no probes).
DEFAULT_FEATURES: tuple[FeatureName, ...] = FEATURES[:-1]


class MissingSignal(ValueError):
    """A feature was asked for that these signals could not compute."""


class Signals(msgspec.Struct, frozen=True, kw_only=True):
    """The signals for one candidate answer after one round; None where the inputs
    (logprobs, alternatives, probes) were not there to compute it."""

    answer: str | None
    kind: AnswerKind
    samples: int  # k
    votes: int  # samples that gave ``answer``
    runner_up: int  # samples that gave the most frequent other answer
    vote_share: float
    # Adaptive-Consistency: P(answer stays ahead of the runner-up); 0 when no sample
    # answered at all, since there is then no answer to stay ahead.
    majority_probability: float
    mean_logprob: float | None = None
    mean_confidence: float | None = None
    lowest_group_confidence: float | None = None
    bottom_group_confidence: float | None = None
    tail_confidence: float | None = None
    probe_streak: int | None = None
    probe_tokens: int = 0

    def features(self, names: Sequence[str] = FEATURES) -> list[float]:
        """The named signals in the given order, as the calibrator reads them."""
        row = []
        for name in names:
            if name not in FEATURES:
                raise MissingSignal(f"unknown signal {name!r}; known: {', '.join(FEATURES)}")
            if name.startswith("kind_"):
                row.append(float(self.kind == name.removeprefix("kind_")))
                continue
            value = getattr(self, name)
            if value is None:
                raise MissingSignal(f"signal {name!r} is missing: {_WHY_MISSING[name]}")
            row.append(float(value))
        return row


_NEEDS_TOP = "the samples' logprobs have no top alternatives"
_WHY_MISSING: dict[str, str] = {
    "mean_logprob": "the samples have no logprobs",
    "mean_confidence": _NEEDS_TOP,
    "lowest_group_confidence": _NEEDS_TOP,
    "bottom_group_confidence": _NEEDS_TOP,
    "tail_confidence": _NEEDS_TOP,
    "probe_streak": "no probes were made",
}


def compute_signals(
    kind: AnswerKind,
    samples: Sequence[Trace],
    *,
    candidate: str | None = None,
    answers: Sequence[str | None] | None = None,
    probes: Sequence[Probe] | None = None,
    settings: SignalSettings = DEFAULT_SETTINGS,
) -> Signals:
    """Signals for ``candidate`` (default: the majority answer) over ``samples``.

    ``answers`` may pass the samples' already-extracted answers, in order. DeepConf
    scores each trace; a candidate gets the mean over the samples that gave it, or over
    all samples when none did (no sample answered, or a candidate from elsewhere).
    """
    if not samples:
        raise ValueError("signals of no samples")
    if answers is None:
        answers = [extract(kind, sample.text) for sample in samples]
    elif len(answers) != len(samples):
        raise ValueError(f"{len(answers)} answers for {len(samples)} samples")
    if candidate is None:
        candidate = majority(answers)
    own, other = votes(answers, candidate)
    behind = [s for s, a in zip(samples, answers, strict=True) if a == candidate]
    traces = [trace_confidence(s.logprobs, settings) for s in (behind or samples) if s.logprobs]
    return Signals(
        answer=candidate,
        kind=kind,
        samples=len(samples),
        votes=own,
        runner_up=other,
        vote_share=own / len(samples),
        majority_probability=0.0 if candidate is None else beta_majority_probability(own, other),
        mean_logprob=_mean(t.mean_logprob for t in traces),
        mean_confidence=_mean(t.mean_confidence for t in traces),
        lowest_group_confidence=_mean(t.lowest_group for t in traces),
        bottom_group_confidence=_mean(t.bottom_group for t in traces),
        tail_confidence=_mean(t.tail for t in traces),
        probe_streak=None if probes is None else probe_streak(probes, candidate),
        probe_tokens=0 if probes is None else probe_tokens(probes),
    )
