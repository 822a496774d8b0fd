"""Declarative, strict weight loading: a package's dense tensors into a family's model.

The family's model declares the mapping (`weight_renames`: checkpoint name -> our parameter name,
`ignored_weights`: names we deliberately skip); this module applies it and refuses, naming the
tensor, anything missing, extra or mis-shaped, so a wrong conversion never runs silently.
Routed experts are not parameters of the model: the expert tier holds them (runtime/experts/).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from runtime.models.base import CausalLM, build_model


class WeightLoadError(ValueError):
    """A checkpoint's tensors do not match the model (the message names every offending tensor)."""


class DenseSource(Protocol):
    """What loading reads: FTWPackage satisfies it."""

    def dense_names(self) -> list[str]: ...

    def dense(self, name: str) -> torch.Tensor: ...


@dataclass
class LoadReport:
    loaded: dict[str, str] = field(default_factory=dict)    # our parameter -> checkpoint tensor
    ignored: list[str] = field(default_factory=list)        # checkpoint tensors skipped on purpose
    nbytes: int = 0


def build_empty_model(config: dict, *, experts, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
    """The family's model with uninitialised parameters on `device` (no time spent on random init)."""
    with torch.device("meta"):
        model = build_model(config, experts=experts)
    # cast on meta (free), then allocate once in `dtype`: allocating in the default fp32 and casting after held
    # 3x the weights at once (9.3 GB of VRAM for Qwen3-30B-A3B's 3.1 GB of bf16 dense weights)
    model = model.to(dtype).to_empty(device=device)
    # buffers computed from the config (rotary frequencies) were lost on meta: rebuild them in fp32
    for module in model.modules():
        init = getattr(module, "init_buffers", None)
        if callable(init):
            init(device=device)
    return model.eval()


def _max_report(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def load_dense_weights(model: CausalLM, source: DenseSource, *,
                       progress: Callable[[int, int], None] | None = None) -> LoadReport:
    """Copy every dense tensor of `source` into `model`; WeightLoadError on any mismatch."""
    params = dict(model.named_parameters())                       # tied weights appear once
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    report = LoadReport()
    extra, misshaped = [], []
    names = list(source.dense_names())
    release = getattr(source, "release_dense", None)       # FTWPackage: hands mapped pages back to the OS
    for i, name in enumerate(names):
        target = model.checkpoint_to_param(name)
        if target is None or target in aliases:
            report.ignored.append(name)
            continue
        param = params.get(target)
        if param is None:
            extra.append(name)
            continue
        if target in report.loaded:
            raise WeightLoadError(f"checkpoint tensors {report.loaded[target]!r} and {name!r} both map to {target!r}")
        tensor = source.dense(name)
        if tuple(tensor.shape) != tuple(param.shape):
            misshaped.append(f"{name} {tuple(tensor.shape)} (expected {tuple(param.shape)})")
            continue
        with torch.no_grad():
            param.copy_(tensor)          # one copy, casting on the way (no temporary on the device)
        del tensor
        if callable(release):
            release(name)                # copied: its mapped pages need not count in this process's RSS
        report.loaded[target] = name
        report.nbytes += param.numel() * param.element_size()
        if progress:
            progress(i + 1, len(names))
    if callable(release):
        release()                        # and whatever else was touched (tensors skipped or refused)
    missing = sorted(set(params) - set(report.loaded))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_max_report(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_max_report(extra)}")
    if misshaped:
        problems.append(f"wrong shapes: {_max_report(misshaped)}")
    if problems:
        raise WeightLoadError(f"{type(model).__module__.rsplit('.', 1)[-1]} weights do not match the checkpoint; "
                              + "; ".join(problems))
    return report
