"""Qwen3.5 / Qwen3.6 MoE (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B): Qwen3-Next's architecture with the
Gated DeltaNet projection stored as four tensors, top-k always renormalised, every layer MoE, and
MRoPE that equals plain RoPE on text. The model itself is `runtime/models/qwen3_next.py`."""
from __future__ import annotations

from typing import ClassVar

from runtime.models import qwen3_next
from runtime.models.qwen3_next import QWEN3_5, Variant


class Config(qwen3_next.Config):
    VARIANT: ClassVar[Variant] = QWEN3_5


class Model(qwen3_next.Model):
    pass
