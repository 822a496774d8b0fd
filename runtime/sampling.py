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

Speed at a real vocabulary (150k): penalties touch only the ids a request has seen; filters run on
the fewest candidates that give the exact result (see filtered_candidates); the draw is one pass
(argmax of logit + Gumbel noise). benchmarks/bench_sampling.py measures it (docs/benchmarks.md).

Shapes: B rows in the batch, V vocabulary, C candidates.
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

    Penalties touch only the tokens seen (a few thousand of a 150k vocabulary), so the state is kept
    sparse: the set of ids seen in the prompt or output, and the output's counts. The generator and
    the id tensors live on the device of the first logits they meet.
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: list[int] = field(default_factory=list)
    _generator: torch.Generator | None = field(default=None, repr=False)
    _seen: set[int] | None = field(default=None, repr=False)           # ids in the prompt or output
    _seen_ids: torch.Tensor | None = field(default=None, repr=False)   # [S] the same, on the device
    _unsent: list[int] = field(default_factory=list, repr=False)       # seen since _seen_ids was built
    _counts: dict[int, int] = field(default_factory=dict, repr=False)  # output id -> times produced

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = make_generator(self.params.seed, device)
        return self._generator

    def penalty_ids(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids seen in prompt or output [S] int64, output ids [U] int64, their counts [U] float32)."""
        if self._seen is None:
            self._seen = set(int(t) for t in self.prompt_ids) | set(self.output_ids)
            self._counts = {}
            for t in self.output_ids:
                self._counts[t] = self._counts.get(t, 0) + 1
            self._seen_ids, self._unsent = None, []
        if self._seen_ids is None or self._seen_ids.device != device:
            self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long, device=device)
            self._unsent = []
        elif self._unsent:
            self._seen_ids = torch.cat([self._seen_ids, torch.tensor(self._unsent, dtype=torch.long, device=device)])
            self._unsent = []
        out_ids = torch.tensor(list(self._counts), dtype=torch.long, device=device)
        counts = torch.tensor(list(self._counts.values()), dtype=torch.float32, device=device)
        return self._seen_ids, out_ids, counts

    def observe(self, token_id: int) -> None:
        """Record a token this request produced (so penalties see it)."""
        token_id = int(token_id)
        self.output_ids.append(token_id)
        if self._seen is not None:
            self._counts[token_id] = self._counts.get(token_id, 0) + 1
            if token_id not in self._seen:
                self._seen.add(token_id)
                self._unsent.append(token_id)


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
    kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(-1, k - 1)    # [B, 1] the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (p [B, 1]; 1 keeps all)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    drop_sorted = _top_p_drop_sorted(sorted_logits, p)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _top_p_drop_sorted(sorted_logits: torch.Tensor, p: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Over logits sorted descending [B, C]: True where the mass strictly before a token already reaches p.

    `lse` [B, 1] normalises over more than these candidates (the whole vocabulary); without it, over them.
    """
    probs = sorted_logits.softmax(dim=-1) if lse is None else (sorted_logits - lse).exp()
    before = probs.cumsum(dim=-1) - probs
    return (before >= p) & (p < 1.0)              # the first token always stays: before = 0


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one (min_p [B, 1]; 0 keeps all)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _column(values: list[float], *, dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(-1)   # [B, 1]


def penalized_tempered(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """Penalties, then temperature: logits [B, V] -> float32 [B, V] (greedy rows keep temperature 1).

    The penalties are the same as apply_repetition_penalty / apply_presence_frequency over the whole
    vocabulary, applied only where they change something: at the ids each row has seen.
    """
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"expected logits [B, V] with B = {len(samplers)} rows, got {tuple(logits.shape)}")
    params = [s.params for s in samplers]
    penalised = [r for r, p in enumerate(params) if p.has_penalties]
    logits = logits.float().clone() if penalised else logits.float()     # never edit the caller's logits
    vocab, device = logits.shape[1], logits.device
    for r in penalised:
        p, row = params[r], logits[r]
        seen, out_ids, counts = samplers[r].penalty_ids(device)
        seen, keep = seen[seen < vocab], out_ids < vocab
        out_ids, counts = out_ids[keep], counts[keep]
        if p.repetition_penalty != 1.0 and seen.numel():
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and out_ids.numel():
            row[out_ids] -= p.presence_penalty + p.frequency_penalty * counts
    if any(p.temperature not in (0.0, 1.0) for p in params):
        logits = logits / _column([p.temperature if p.temperature > 0 else 1.0 for p in params],
                                  dtype=torch.float32, device=device)
    return logits


# Top-p without top-k first looks among this many of the most likely tokens: when they hold mass p (nearly
# always), the cut lies among them and a full sort of the vocabulary (~40 ms at 150k on a CPU) is avoided.
TOP_P_CANDIDATES = 1024


def filtered_candidates(logits: torch.Tensor, params: Sequence[SamplingParams]
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """top-k, top-p and min-p over a candidate set: (values [B, C], vocabulary ids [B, C] or None for all).

    The result is exactly what filtering the whole vocabulary gives, but computed on the fewest
    candidates that can hold it: the max top-k largest when every row has a top-k; for top-p, the
    TOP_P_CANDIDATES largest when they reach each row's p, else one full sort; the logits as they
    are for min-p alone. Removed values are -inf; candidates come sorted descending whenever ids are
    returned. Probabilities for top-p are those of the whole vocabulary (after top-k, as transformers).
    """
    device = logits.device
    vocab = logits.shape[-1]
    col = lambda vals, dtype=torch.float32: _column(vals, dtype=dtype, device=device)  # noqa: E731
    want_k, want_p = any(p.top_k > 0 for p in params), any(p.top_p < 1.0 for p in params)
    if not want_k and not want_p:
        values, ids = logits, None
    else:
        k = col([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)       # [B, 1]
        top_p = col([p.top_p for p in params])                                        # [B, 1]
        if all(p.top_k > 0 for p in params):
            values, ids = torch.topk(logits, min(vocab, max(p.top_k for p in params)), dim=-1)
        else:
            values, ids = torch.topk(logits, min(vocab, max(TOP_P_CANDIDATES, *(p.top_k for p in params))), dim=-1)
            mass = (values - logits.logsumexp(dim=-1, keepdim=True)).exp().sum(dim=-1, keepdim=True)
            needs_all = (k >= vocab) & (top_p < 1.0) & (mass < top_p)
            if bool(needs_all.any()):
                values, ids = torch.sort(logits, dim=-1, descending=True)
        if want_k:   # sorted: top-k keeps what is >= the k-th value (ties kept, as apply_top_k)
            kth = values.gather(-1, (k - 1).clamp(max=values.shape[-1] - 1))
            values = values.masked_fill((k < vocab) & (values < kth), float("-inf"))
        if want_p:
            # rows with top-k renormalise over what top-k kept; the others over the whole vocabulary
            lse = torch.where(k < vocab, values.logsumexp(dim=-1, keepdim=True),
                              logits.logsumexp(dim=-1, keepdim=True))
            values = values.masked_fill(_top_p_drop_sorted(values, top_p, lse), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        values = apply_min_p(values, col([p.min_p for p in params]))
    return values, ids


def _filter_groups(logits: torch.Tensor, params: Sequence[SamplingParams]):
    """Rows that truncate (top-k / top-p) and rows that keep the whole vocabulary are filtered apart, so
    that neither forces the other's candidate set: yields (rows, values [R, C], ids [R, C] or None)."""
    truncating = [r for r, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    whole = [r for r, p in enumerate(params) if not (p.top_k > 0 or p.top_p < 1.0)]
    for rows in (truncating, whole):
        if rows:
            sub = logits if len(rows) == len(params) else logits.index_select(
                0, torch.tensor(rows, device=logits.device))
            values, ids = filtered_candidates(sub, [params[r] for r in rows])
            yield rows, values, ids


def process_logits(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """Penalise, temper and filter: logits [B, V] -> float32 logits [B, V] ready for a draw (greedy rows untempered)."""
    logits = penalized_tempered(logits, samplers)
    out = torch.full_like(logits, float("-inf"))
    for rows, values, ids in _filter_groups(logits, [s.params for s in samplers]):
        index = torch.tensor(rows, device=logits.device)
        out[index] = values if ids is None else torch.full_like(logits[index], float("-inf")).scatter_(-1, ids, values)
    return out


def sample_batch(logits: torch.Tensor, samplers: Sequence[RequestSampler], *, observe: bool = True) -> torch.Tensor:
    """Pick one token per row: logits [B, V] -> token ids [B] int64 (on the logits' device).

    Greedy rows take the argmax of the penalised logits; the others draw from their filtered
    distribution with their own generator (the exponential race, argmax of p / Exp(1) noise, as vLLM
    samples; here in log space, i.e. Gumbel-max: one pass over the candidates, the same law as a
    categorical draw). With `observe`,
    each chosen token is recorded in its sampler (the penalties of the next step see it).
    """
    logits = penalized_tempered(logits, samplers)
    chosen = logits.argmax(dim=-1)                                            # [B]
    drawing = [r for r, s in enumerate(samplers) if not s.params.greedy]
    if drawing:
        sub = logits if len(drawing) == len(samplers) else logits.index_select(
            0, torch.tensor(drawing, device=logits.device))
        for rows, values, ids in _filter_groups(sub, [samplers[r].params for r in drawing]):
            for i, r in enumerate(rows):                                      # values [R, C]
                row = drawing[r]
                # argmax(p / E), E ~ Exp(1) = -log U, taken in log space: argmax(logit - log(-log U)).
                # Logits rather than probabilities: no softmax, and no subnormal floats (slow on CPUs)
                # from the far tail of a peaked distribution. -log(U) is several times faster than
                # Tensor.exponential_ on a CPU.
                uniform = torch.rand(values.shape[-1], generator=samplers[row].generator(logits.device),
                                     device=logits.device)
                pick = torch.argmax(values[i] - torch.log(-torch.log(uniform)))
                chosen[row] = pick if ids is None else ids[i, pick]
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
