"""Opening an FTW package: parse the manifest, memory-map the data files on first use.

    pkg = FTWPackage.open(path)
    pkg.dense("model.embed_tokens.weight")         # torch tensor, zero-copy
    pkg.experts.block(layer, expert)               # numpy uint8 view of one 4 KiB-aligned block
    pkg.experts.dequantize(layer, expert)          # ExpertWeights in fp32 (the reference path)

Files are mapped copy-on-write: tensors handed out are writable views as torch requires, and a
stray in-place write can never reach the package on disk.
"""
from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np
import torch

from runtime.experts.interface import ExpertWeights
from runtime.ftw.codecs import fp4_dequantize, int4_dequantize
from runtime.ftw.errors import FTWError
from runtime.ftw.writer import CHECKSUM, FORMAT_VERSION, JOURNAL, MANIFEST, PARTIAL_SUFFIX, TORCH_DTYPES, Part

__all__ = ["FTWPackage", "ExpertStore", "FTWError", "FORMAT_VERSION"]


def _map(path: Path, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="c", shape=(nbytes,))


def _view(raw: np.ndarray, dtype: str, shape) -> torch.Tensor:
    """uint8 bytes -> typed tensor of `shape`, sharing memory."""
    return torch.from_numpy(raw).view(TORCH_DTYPES[dtype]).reshape(tuple(shape))


class ExpertStore:
    """The routed experts: one block per (layer, expert), laid out layer-major, expert-minor."""

    def __init__(self, path: Path, meta: dict):
        self._path = path / meta["file"]
        self._nbytes = int(meta["nbytes"])
        self._mm: np.ndarray | None = None
        self.meta = meta
        self.layers: list[int] = [int(x) for x in meta["layers"]]
        self.num_experts = int(meta["num_experts"])
        self.hidden_size = int(meta["hidden_size"])
        self.intermediate_size = int(meta["intermediate_size"])
        self.codec: str = meta["codec"]
        self.group_size: int | None = meta.get("group_size")
        self.block_size: int | None = meta.get("block_size")
        self.fp4_format: str | None = meta.get("fp4_format")
        self.scale_format: str | None = meta.get("scale_format")
        self.global_scale_op: str | None = meta.get("global_scale_op")
        self.activation: str = meta.get("activation", "silu")
        self.has_bias = bool(meta["has_bias"])
        self.block_nbytes = int(meta["block_nbytes"])
        self.parts: dict[str, Part] = {p["name"]: Part(p["name"], p["dtype"], tuple(p["shape"]), p["offset"],
                                                       p["nbytes"]) for p in meta["parts"]}
        self._layer_offset = {int(k): int(v) for k, v in meta["layer_offsets"].items()}

    @property
    def mm(self) -> np.ndarray:
        if self._mm is None:
            self._mm = _map(self._path, self._nbytes)
        return self._mm

    def layer_offset(self, layer: int) -> int:
        try:
            return self._layer_offset[layer]
        except KeyError:
            raise KeyError(f"layer {layer} has no routed experts (layers with experts: {self.layers})") from None

    def block_offset(self, layer: int, expert: int) -> int:
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        return self.layer_offset(layer) + expert * self.block_nbytes

    def block(self, layer: int, expert: int) -> np.ndarray:
        off = self.block_offset(layer, expert)
        return self.mm[off: off + self.block_nbytes]

    def tensors(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        raw = self.block(layer, expert)
        return {p.name: _view(raw[p.offset: p.offset + p.nbytes], p.dtype, p.shape) for p in self.parts.values()}

    def layer_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """Every part stacked over the layer's experts, [E, ...], as strided views of the file."""
        off = self.layer_offset(layer)
        region = torch.from_numpy(self.mm[off: off + self.num_experts * self.block_nbytes])
        region = region.view(self.num_experts, self.block_nbytes)              # [E, B]
        out = {}
        for p in self.parts.values():
            out[p.name] = region[:, p.offset: p.offset + p.nbytes].view(TORCH_DTYPES[p.dtype]).reshape(
                (self.num_experts,) + p.shape)
        return out

    def dequantize(self, layer: int, expert: int, dtype: torch.dtype = torch.float32) -> ExpertWeights:
        return dequantize_expert(self.tensors(layer, expert), codec=self.codec,
                                 group=self.block_size if self.codec == "fp4" else self.group_size,
                                 scale_format=self.scale_format, global_op=self.global_scale_op or "mul", dtype=dtype)


def dequantize_expert(t: dict[str, torch.Tensor], *, codec: str, group: int | None, scale_format: str | None = None,
                      global_op: str = "mul", dtype: torch.dtype = torch.float32) -> ExpertWeights:
    """One expert's stored tensors (named as in the FTW block: gate, gate_scales, ...) -> float weights, with the
    codecs' reference formulas: what every fast path is tested against."""
    mats = {}
    for proj in ("gate", "up", "down"):
        if codec in ("f32", "bf16"):
            w = t[proj].to(torch.float32)
        elif codec == "int4":
            w = int4_dequantize(t[proj], t[f"{proj}_scales"], t[f"{proj}_mins"], group)
        elif codec == "fp4":
            w = fp4_dequantize(t[proj], t[f"{proj}_scales"].view(torch.uint8), block_size=group,
                               scale_format=scale_format, global_scale=t.get(f"{proj}_global"), global_op=global_op)
        else:
            raise FTWError(f"unknown expert codec {codec!r}")
        mats[proj] = w.to(dtype)
    biases = {k: t[k].to(dtype) for k in ("gate_bias", "up_bias", "down_bias") if k in t}
    return ExpertWeights(**mats, **biases)


class FTWPackage:
    """A converted model. Open is cheap: the manifest is all it parses."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        self.config: dict = manifest["config"]
        self.model_type: str = manifest["model_type"]
        self.generation_config: dict = manifest.get("generation_config") or {}
        self.tokenizer_dir = path
        self._dense_meta: dict = manifest["dense"]
        self._dense_tensors: dict[str, dict] = manifest["dense"]["tensors"]
        self._dense_mm: np.ndarray | None = None
        self.experts = ExpertStore(path, manifest["experts"])

    @classmethod
    def open(cls, path: str | Path) -> "FTWPackage":
        path = Path(path)
        if path.name.endswith(PARTIAL_SUFFIX) or (path / JOURNAL).exists():
            raise FTWError(f"{path}: this conversion did not finish; run `freetoken convert` again to resume it")
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            partial = path.with_name(path.name + PARTIAL_SUFFIX)
            if partial.exists():
                raise FTWError(f"{path}: the conversion did not finish ({partial.name} holds its progress); "
                               "run `freetoken convert` again to resume it")
            raise FTWError(f"{path}: not an FTW package (no {MANIFEST})")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise FTWError(f"{manifest_path}: corrupt manifest ({e}); convert the model again") from e
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        if not isinstance(version, int) or manifest.get("format") != "ftw":
            raise FTWError(f"{manifest_path}: not an FTW manifest")
        if version > FORMAT_VERSION:
            raise FTWError(f"this model was converted by a newer FreeToken (format {version}); "
                           "update FreeToken or convert it again")
        for meta in (manifest["dense"], manifest["experts"]):
            f = path / meta["file"]
            size = f.stat().st_size if f.is_file() else -1
            if size != int(meta["nbytes"]):
                raise FTWError(f"{f}: {'missing' if size < 0 else f'{size} bytes'}, the manifest says "
                               f"{meta['nbytes']}; the package is damaged, convert the model again")
        return cls(path, manifest)

    def dense_names(self) -> list[str]:
        return list(self._dense_tensors)

    def dense(self, name: str) -> torch.Tensor:
        try:
            meta = self._dense_tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no dense tensor {name}") from None
        if self._dense_mm is None:
            self._dense_mm = _map(self.path / self._dense_meta["file"], int(self._dense_meta["nbytes"]))
        off = int(meta["offset"])
        return _view(self._dense_mm[off: off + int(meta["nbytes"])], meta["dtype"], meta["shape"])

    def release_dense(self, name: str | None = None) -> bool:
        """Hand the dense file's mapped pages back to the OS (madvise DONTNEED): those of tensor `name`, or all of
        them. The loader calls it after copying each tensor into the model: kept mapped, the pages count in this
        process's RSS for good (3.1 GB for Qwen3-30B-A3B, whose dense weights then live on the GPU; on a CPU engine
        they sat beside the model's own copy). The bytes stay in the OS page cache; a later `dense()` reads them
        again. Views handed out earlier stay valid (a clean copy-on-write page is re-read from the file when
        touched). False when nothing is mapped or the OS has no madvise (Windows)."""
        raw = getattr(self._dense_mm, "_mmap", None)
        if raw is None or not hasattr(raw, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return False
        try:
            if name is None:
                raw.madvise(mmap.MADV_DONTNEED)
            else:
                meta = self._dense_tensors[name]
                start, end = int(meta["offset"]), int(meta["offset"]) + int(meta["nbytes"])
                start -= start % mmap.PAGESIZE      # madvise wants a page-aligned start (a neighbour's page is
                if end > start:                     # re-read from the file if it is touched again)
                    raw.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError, KeyError):
            return False
        return True

    @property
    def checksum_algorithm(self) -> str:
        return self.manifest.get("checksum_algorithm", CHECKSUM)

