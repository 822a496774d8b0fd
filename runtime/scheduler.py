"""Continuous batching, in plain Python: which sequences run in the next step, and how many tokens each.

Every sequence is "feed tokens[computed:]": while prefilling that is the rest of its prompt, while
decoding it is the one token sampled last step. A step runs every decoding sequence (one token each)
plus prefill chunks from the sequences still reading their prompt, up to a token budget, so a long
prompt never stalls the others for long and a new request joins at the next step. Sequences are
admitted first come, first served, up to `max_batch` at once; a finished one leaves and frees its
place. No torch here: the engine owns caches and the model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sequence:
    """The scheduler's view of one request."""
    request_id: str
    tokens: list[int]                     # prompt, then every sampled token
    prompt_len: int
    computed: int = 0                     # tokens already in the cache
    finished: bool = False
    # feed the prompt's last token in a step of its own, so the state just before it can be kept (a
    # recurrent state cannot be rewound: that snapshot is what lets an identical resend reuse the prompt)
    pause_before_last: bool = False
    payload: Any = field(default=None, repr=False)   # the engine's per-request state

    @property
    def pending(self) -> int:
        """Tokens waiting to be fed to the model."""
        return len(self.tokens) - self.computed

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8                    # sequences running at once
    prefill_chunk: int = 512              # most prompt tokens one sequence feeds in a step
    step_token_budget: int = 1024         # most tokens in one step (decode tokens count one each)

    def __post_init__(self):
        for name in ("max_batch", "prefill_chunk", "step_token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None):
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into the running set while there is room; returns the newcomers."""
        admitted = []
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to feed) for the next step: every decoder, then prefill chunks within budget."""
        budget = self.config.step_token_budget
        work: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if not seq.finished and not seq.prefilling and seq.pending > 0:
                work.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if seq.finished or not seq.prefilling:
                continue
            n = min(seq.pending, self.config.prefill_chunk, budget)
            if n <= 0 and not work:
                n = min(seq.pending, self.config.prefill_chunk)   # always make progress
            if n <= 0:
                break
            if seq.pause_before_last and n > 1 and seq.computed + n == seq.prompt_len:
                n -= 1
            work.append((seq, n))
            budget -= n
        return work

    def remove(self, seq: Sequence) -> None:
        """A finished or cancelled sequence leaves (waiting or running)."""
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
