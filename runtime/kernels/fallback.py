"""A Triton kernel that cannot run on this machine falls back to its torch reference, once and for all.

Why: Triton compiles on first use and needs a working toolchain (a C compiler for its launcher on Linux,
triton-windows' bundled one on Windows) and a GPU it supports. A desktop user whose setup lacks one must
still get answers: the first failure of a kernel family is logged with its cause, the family is switched off
for the rest of the process, and the torch path — what every kernel is tested against — computes instead.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")
disabled: dict[str, str] = {}          # kernel family -> why it was switched off


def run(family: str, kernel: Callable[[], T], reference: Callable[[], T]) -> T:
    """kernel() unless `family` failed before; on its first failure, say why and use reference() from then on."""
    if family in disabled:
        return reference()
    try:
        return kernel()
    except torch.OutOfMemoryError:
        raise                           # a full GPU is the step's problem (the engine fails that request), not the kernel's
    except Exception as exc:            # noqa: BLE001  (a compile/launch failure: reported, answers go on)
        disabled[family] = f"{type(exc).__name__}: {exc}"
        log.warning("Triton %s kernel failed (%s); using the torch path from now on", family, disabled[family])
        return reference()
