"""Choosing the next token: penalties, temperature, top-k, top-p, min-p, seeded sampling; and stop strings.

A batch of sequences decodes together and every row has its own options, so the processors work on
`[B, V]` logits with per-row parameters (tensors of shape `[B, 1]`), and every request owns its own
`torch.Generator` so that a seed reproduces the same tokens whatever else shares the batch.

Order, as in transformers' generate and vLLM: penalties on the raw logits, then temperature, then
top-k, top-p and min-p on the tempered distribution, then a draw. Conventions:
- repetition_penalty (CTRL / transformers): over the prompt *and* the output, a seen token's logit is
  divided by the penalty when positive and multiplied by it when negative.
- presence_penalty / frequency_penalty (OpenAI): over the output only,
  `logit -= presence * (count > 0) + frequency * count`.
- temperature 0 is greedy: the argmax of the penalised logits, no draw, no randomness.
- top_k 0 and top_p 1 switch those filters off; min_p keeps tokens whose probability is at least
  `min_p` times the most likely token's (a ratio, so it does not matter whether it comes before or
  after the other filters).

Shapes: B rows in the batch, V vocabulary.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (the Engine contract in docs/contracts.md)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None   # None: the model's EOS ids from generation_config

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 0:
            problems.append(f"max_tokens must be >= 0, got {self.max_tokens}")
        if isinstance(self.stop, str):   # a lone string would otherwise be taken as one stop per character
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            problems.append(f"stop strings must be non-empty strings, got {self.stop!r}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator of its own for one request; without a seed, a fresh random one."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed) if seed is not None else secrets.randbits(63))
    return gen


@dataclass
class RequestSampler:
    """The sampling state of one request: its parameters, its generator and the tokens it has seen.

    The generator and the count tensors are created on the device of the first logits they meet.
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: list[int] = field(default_factory=list)
    _generator: torch.Generator | None = field(default=None, repr=False)
    _output_counts: torch.Tensor | None = field(default=None, repr=False)   # [V] int32, output tokens
    _seen: torch.Tensor | None = field(default=None, repr=False)            # [V] bool, prompt + output

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = make_generator(self.params.seed, device)
        return self._generator

    def _ensure_counts(self, vocab: int, device: torch.device) -> None:
        if self._output_counts is not None and self._output_counts.device == device \
                and self._output_counts.shape[0] == vocab:
            return
        counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt = torch.tensor([t for t in self.prompt_ids if 0 <= t < vocab], dtype=torch.long, device=device)
        out = torch.tensor([t for t in self.output_ids if 0 <= t < vocab], dtype=torch.long, device=device)
        seen[prompt] = True
        seen[out] = True
        counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        self._output_counts, self._seen = counts, seen

    def counts(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts [V] int32, seen in prompt or output [V] bool)."""
        self._ensure_counts(vocab, device)
        return self._output_counts, self._seen

    def observe(self, token_id: int) -> None:
        """Record a token this request produced (so penalties see it)."""
        self.output_ids.append(int(token_id))
        if self._output_counts is not None and 0 <= token_id < self._output_counts.shape[0]:
            self._output_counts[token_id] += 1
            self._seen[token_id] = True


# ---- the processors: each takes logits [B, V] and per-row parameters [B, 1] --------------------------------


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [B, V], seen [B, V] bool, penalty [B, 1] -> logits with seen tokens made less likely."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """logits [B, V], counts [B, V] of output tokens, presence/frequency [B, 1]."""
    counts = counts.to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k [B, 1] int64; 0 keeps all). Ties at the k-th value are kept."""
    vocab = logits.shape[-1]
    k = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
    kth = torch.sort(logits, dim=-1, descending=True).values.gather(-1, k - 1)   # [B, 1] the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (p [B, 1]; 1 keeps all)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs          # probability mass strictly before each token
    drop_sorted = (before >= p) & (p < 1.0)        # the first token always stays: before = 0
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one (min_p [B, 1]; 0 keeps all)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _column(values: list[float], *, dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(-1)   # [B, 1]


def process_logits(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """Penalise, temper and filter: logits [B, V] -> float32 logits [B, V] ready for a draw (greedy rows untempered)."""
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"expected logits [B, V] with B = {len(samplers)} rows, got {tuple(logits.shape)}")
    logits = logits.float()
    batch, vocab = logits.shape
    device = logits.device
    params = [s.params for s in samplers]
    col = lambda vals, dtype=torch.float32: _column(vals, dtype=dtype, device=device)  # noqa: E731

    if any(p.has_penalties for p in params):
        counts, seen = zip(*(s.counts(vocab, device) for s in samplers))
        counts, seen = torch.stack(counts), torch.stack(seen)                    # [B, V]
        logits = apply_repetition_penalty(logits, seen, col([p.repetition_penalty for p in params]))
        logits = apply_presence_frequency(logits, counts, col([p.presence_penalty for p in params]),
                                          col([p.frequency_penalty for p in params]))

    # Greedy rows keep temperature 1 here; their argmax does not depend on the filters below.
    temps = col([p.temperature if p.temperature > 0 else 1.0 for p in params])
    logits = logits / temps
    if any(p.top_k > 0 for p in params):
        logits = apply_top_k(logits, col([p.top_k for p in params], torch.long))
    if any(p.top_p < 1.0 for p in params):
        logits = apply_top_p(logits, col([p.top_p for p in params]))
    if any(p.min_p > 0.0 for p in params):
        logits = apply_min_p(logits, col([p.min_p for p in params]))
    return logits


def sample_batch(logits: torch.Tensor, samplers: Sequence[RequestSampler], *, observe: bool = True) -> torch.Tensor:
    """Pick one token per row: logits [B, V] -> token ids [B] int64 (on the logits' device).

    Greedy rows take the argmax; the others draw with their own generator. With `observe`, each
    chosen token is recorded in its sampler (the penalties of the next step see it).
    """
    processed = process_logits(logits, samplers)
    chosen = processed.argmax(dim=-1)                                        # [B]
    for row, sampler in enumerate(samplers):
        if sampler.params.greedy:
            continue
        probs = processed[row].softmax(dim=-1)                               # [V]
        chosen[row] = torch.multinomial(probs, 1, generator=sampler.generator(processed.device))[0]
    if observe:
        for sampler, token in zip(samplers, chosen.tolist()):
            sampler.observe(token)
    return chosen


class StopMatcher:
    """Finds stop strings in streamed text, even when one spans several tokens.

    `push(text)` returns the text that is safe to show and whether a stop string was met. Text that
    might be the start of a stop string is held back until the next push decides it; on a stop, the
    text before it is released and the stop string and everything after it are dropped.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self._held + text
        hits = [(buffer.find(s), s) for s in self.stops if s in buffer]
        if hits:
            index, stop = min(hits, key=lambda hit: hit[0])
            self._held, self.stopped, self.matched = "", True, stop
            return buffer[:index], True
        hold = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold], False

    def flush(self) -> str:
        """At the end of generation: release what was held back (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
