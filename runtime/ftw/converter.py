"""Hugging Face checkpoint -> FTW package, streaming, resumable, verified.

    convert(src, out, codec="auto", group_size=64, progress=callback) -> Path

The work is planned first, from headers alone: every source tensor is located and checked
against config.json, every output byte gets its offset. Bad input therefore fails before a byte is
written. Then units run in order (global tensors, then each decoder layer: its dense tensors and
its experts), each made durable and journaled before the next (see writer.py).

Memory bound: at any time the converter holds one expert's source tensors and their packed block,
or one band of at most `chunk_bytes` source bytes of a dense tensor, plus their fp32 working copies.
Peak anonymous memory growth stays under 8 × max(one expert's source bytes, chunk_bytes) + 16 MiB,
plus 8 × one expert for each extra worker thread (tests/test_ftw_stream.py measures it).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from runtime.ftw import architectures as archs
from runtime.ftw.codecs import CODECS, FP4_FORMATS, INT4_GROUP_SIZES, int4_quantize_into
from runtime.ftw.errors import FTWError
from runtime.ftw.sources import FLOAT_DTYPES, Checkpoint, Fp4Parts, SourceWeight
from runtime.ftw.writer import (CHECKSUM, DENSE_FILE, EXPERTS_FILE, FORMAT_VERSION, PART_ALIGN, TORCH_DTYPES, Part,
                                BlockDigests, PackageWriter, WritePipeline, align, dtype_name, expert_block_parts)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "generation_config.json")
PROJS = ("gate", "up", "down")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ProgressEvent:
    stage: str            # "planning" | "resuming" | "dense" | "experts" | "finishing" | "done"
    tensor: str           # the tensor being converted (or "")
    bytes_done: int       # source bytes converted so far
    bytes_total: int      # source bytes to convert
    rate: float           # source bytes per second in this run
    eta: float | None     # seconds left, None until a rate is known

    def to_json(self) -> dict:
        return {"stage": self.stage, "tensor": self.tensor, "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total, "rate": round(self.rate, 1),
                "eta": None if self.eta is None else round(self.eta, 2)}


ProgressCallback = Callable[[ProgressEvent], None]


# ---------------------------------------------------------------- the plan

@dataclass
class DenseEntry:
    name: str                   # normalised name the package records
    source: SourceWeight
    dtype: torch.dtype          # output dtype
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class ExpertLayerSource:
    layer: int
    layout: archs.ExpertLayout
    weights: dict[tuple[str, int], SourceWeight]     # (role, expert or -1 for fused) -> weight
    offset: int = 0

    def source_bytes(self) -> int:
        return sum(sw.source_bytes for sw in self.weights.values())


@dataclass
class Plan:
    ckpt: Checkpoint
    arch: archs.Architecture
    codec: str
    group_size: int
    fp4_format: str
    fp4_global_op: str
    hidden: int
    intermediate: int
    num_experts: int
    parts: list[Part]
    block_nbytes: int
    units: list[str]                                             # "globals", "layer.0", ...
    dense: dict[str, list[DenseEntry]] = field(default_factory=dict)       # unit -> entries
    experts: dict[str, ExpertLayerSource] = field(default_factory=dict)   # unit -> layer source
    dense_nbytes: int = 0
    experts_nbytes: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)     # padding inside a block, kept zero
    part_by_name: dict[str, Part] = field(default_factory=dict)

    def unit_source_bytes(self, unit: str) -> int:
        n = sum(d.source.source_bytes for d in self.dense.get(unit, []))
        return n + (self.experts[unit].source_bytes() if unit in self.experts else 0)

    @property
    def source_bytes(self) -> int:
        return sum(self.unit_source_bytes(u) for u in self.units)


def _resolve_codec(codec: str, expert_kinds: set[str]) -> str:
    fp4_source = bool(expert_kinds) and expert_kinds <= {"mxfp4", "nvfp4"}
    if codec == "auto":
        return "fp4" if fp4_source else "int4"
    if codec not in CODECS:
        raise FTWError(f"unknown codec {codec!r}; choose one of auto, {', '.join(CODECS)}")
    if codec == "fp4" and not fp4_source:
        raise FTWError("the fp4 codec keeps MXFP4/NVFP4 experts exactly and needs such a source; this checkpoint's "
                       f"experts are {', '.join(sorted(expert_kinds)) or 'absent'}: use --codec int4 or bf16")
    return codec


def _expect_shape(sw: SourceWeight, shape: tuple[int, ...], what: str) -> None:
    if tuple(sw.shape) != tuple(shape):
        raise FTWError(f"{sw.main.file.name}: tensor {sw.main.name} has shape {list(sw.shape)} but config.json "
                       f"implies {list(shape)} ({what})")


def _find_expert_layer(ckpt: Checkpoint, arch: archs.Architecture, layer: int, names: dict[str, str],
                       num_experts: int, hidden: int, inter: int) -> ExpertLayerSource:
    """Locate a layer's experts in whichever layout the checkpoint uses, and check their shapes."""
    def get(template: str, expert: int = -1) -> SourceWeight | None:
        return ckpt.weights.get(names.get(template.format(layer=layer, expert=expert), ""))

    for layout in arch.layouts:
        if layout.kind == "per_expert":
            if get(layout.names["gate"], 0) is None:
                continue
            weights = {}
            for e in range(num_experts):
                for proj in PROJS:
                    sw = get(layout.names[proj], e)
                    if sw is None:
                        missing = layout.names[proj].format(layer=layer, expert=e)
                        raise FTWError(f"model.safetensors.index.json: missing tensor {missing} "
                                       f"(config.json says {num_experts} experts)")
                    _expect_shape(sw, (hidden, inter) if proj == "down" else (inter, hidden), "expert projection")
                    weights[(proj, e)] = sw
            return ExpertLayerSource(layer, layout, weights)
        gate_up = get(layout.names["gate_up"])
        if gate_up is None:
            continue
        down = get(layout.names["down"])
        if down is None:
            raise FTWError(f"model.safetensors.index.json: missing tensor {layout.names['down'].format(layer=layer)}")
        weights = {("gate_up", -1): gate_up, ("down", -1): down}
        if layout.kind == "fused_halves":
            _expect_shape(gate_up, (num_experts, 2 * inter, hidden), "fused gate_up [E, 2I, D]")
            _expect_shape(down, (num_experts, hidden, inter), "fused down [E, D, I]")
        else:   # fused_interleaved_transposed: (in, out) when float, (out, in) when MXFP4/NVFP4
            fp4 = gate_up.kind in ("mxfp4", "nvfp4")
            _expect_shape(gate_up, (num_experts, 2 * inter, hidden) if fp4 else (num_experts, hidden, 2 * inter),
                          "fused gate_up")
            _expect_shape(down, (num_experts, hidden, inter) if down.kind in ("mxfp4", "nvfp4")
                          else (num_experts, inter, hidden), "fused down")
            for role, width in (("gate_up_bias", 2 * inter), ("down_bias", hidden)):
                sw = get(layout.names[role])
                if sw is None:
                    raise FTWError(f"model.safetensors.index.json: missing tensor "
                                   f"{layout.names[role].format(layer=layer)}")
                _expect_shape(sw, (num_experts, width), "expert bias")
                weights[(role, -1)] = sw
        return ExpertLayerSource(layer, layout, weights)
    first = arch.layouts[0]
    key = "gate" if first.kind == "per_expert" else "gate_up"
    raise FTWError(f"model.safetensors.index.json: missing tensor {first.names[key].format(layer=layer, expert=0)} "
                   f"(config.json says layer {layer} has {num_experts} routed experts)")


def make_plan(ckpt: Checkpoint, *, codec: str = "auto", group_size: int = 64) -> Plan:
    """Locate and check every tensor, resolve the codec and fix every output offset (headers only)."""
    cfg = ckpt.text_config
    model_type = str(cfg.get("model_type") or ckpt.config.get("model_type") or "")
    arch = archs.lookup(model_type)
    if arch is None:
        raise FTWError(f"config.json: unsupported architecture {model_type!r}; FreeToken converts "
                       f"{', '.join(sorted(archs.ARCHITECTURES))}")
    if group_size not in INT4_GROUP_SIZES:
        raise FTWError(f"--group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, not {group_size}")
    try:
        hidden = int(cfg["hidden_size"])
        inter = int(cfg[arch.intermediate_key])
        num_experts = archs.num_experts(arch, cfg)
        int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise FTWError(f"config.json: missing or invalid field {e} for {model_type}") from e

    # Normalised name -> source weight; drop what a text model never runs.
    names: dict[str, str] = {}        # normalised -> logical source name
    for src_name in ckpt.weights:
        norm = archs.normalise_name(src_name)
        if norm is None:
            continue
        if norm in names:
            raise FTWError(f"{ckpt.weights[src_name].main.file.name}: tensors {names[norm]} and {src_name} "
                           f"both map to {norm}")
        names[norm] = src_name

    for norm, src_name in names.items():
        sw = ckpt.weights[src_name]
        if sw.kind == "float" and sw.main.dtype not in FLOAT_DTYPES:
            raise FTWError(f"{sw.main.file.name}: tensor {sw.main.name} is stored as {sw.main.dtype} without the "
                           "scales of a format FreeToken knows: unsupported quantization")
    layers = archs.expert_layers(arch, cfg)
    experts: dict[str, ExpertLayerSource] = {}
    consumed: set[str] = set()
    for layer in layers:
        src = _find_expert_layer(ckpt, arch, layer, names, num_experts, hidden, inter)
        experts[f"layer.{layer}"] = src
        consumed.update(sw.name for sw in src.weights.values())
    kinds = {sw.kind for src in experts.values() for key, sw in src.weights.items() if "bias" not in key[0]}
    codec = _resolve_codec(codec, kinds)
    fp4_format, global_op = "", "mul"
    if codec == "fp4":
        if len(kinds) != 1:
            raise FTWError(f"experts mix quantizations {sorted(kinds)}; convert with --codec int4")
        fp4_format = kinds.pop()
        ops = {sw.global_op for src in experts.values() for sw in src.weights.values() if sw.kind == "nvfp4"}
        global_op = ops.pop() if len(ops) == 1 else "mul"
    parts, block_nbytes = expert_block_parts(codec=codec, hidden=hidden, intermediate=inter, group_size=group_size,
                                             fp4_format=fp4_format, has_bias=arch.has_bias)

    units = ["globals"] + [f"layer.{i}" for i in range(int(cfg["num_hidden_layers"]))]
    dense: dict[str, list[DenseEntry]] = {u: [] for u in units}
    for norm in sorted(names):
        sw = ckpt.weights[names[norm]]
        if sw.name in consumed:
            continue
        if ".experts." in norm and ".shared_expert" not in norm:
            raise FTWError(f"{sw.main.file.name}: unexpected expert tensor {sw.main.name}: not a layout FreeToken "
                           f"knows for {arch.model_type}")
        m = _LAYER_RE.match(norm)
        unit = f"layer.{m.group(1)}" if m else "globals"
        if unit not in dense:
            raise FTWError(f"{sw.main.file.name}: tensor {sw.main.name} belongs to layer {m.group(1)} but config.json "
                           f"has {cfg['num_hidden_layers']} layers")
        out_dtype = sw.main.torch_dtype if sw.kind == "float" else torch.bfloat16
        dense[unit].append(DenseEntry(norm, sw, out_dtype, tuple(sw.shape)))

    _check_dense(ckpt, arch, cfg, dense, layers)
    plan = Plan(ckpt, arch, codec, group_size, fp4_format, global_op, hidden, inter, num_experts, parts,
                block_nbytes, units, dense, experts)
    plan.gaps = _block_gaps(plan)
    plan.part_by_name = {p.name: p for p in parts}
    offset = 0
    for unit in units:
        for entry in dense[unit]:
            entry.offset = offset
            offset = align(offset + entry.nbytes, PART_ALIGN)
    plan.dense_nbytes = offset
    offset = 0
    for unit in units:
        if unit in experts:
            experts[unit].offset = offset
            offset += num_experts * block_nbytes
    plan.experts_nbytes = offset
    return plan


def _check_dense(ckpt: Checkpoint, arch: archs.Architecture, cfg: dict, dense: dict[str, list[DenseEntry]],
                 layers: list[int]) -> None:
    by_name = {e.name: e for entries in dense.values() for e in entries}
    hidden, vocab = int(cfg["hidden_size"]), cfg.get("vocab_size")
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.get("tie_word_embeddings", False):
        required.append("lm_head.weight")
    for i in range(int(cfg["num_hidden_layers"])):
        required += [t.format(layer=i) for t in arch.required_per_layer]
    required += [arch.router.format(layer=i) for i in layers]
    for name in required:
        if name not in by_name:
            raise FTWError(f"model.safetensors.index.json: missing tensor {name}")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in by_name and vocab is not None and by_name[name].shape != (int(vocab), hidden):
            e = by_name[name]
            raise FTWError(f"{e.source.main.file.name}: tensor {e.source.main.name} has shape {list(e.shape)} but "
                           f"config.json implies {[int(vocab), hidden]} (vocab_size, hidden_size)")
    n_exp = archs.num_experts(arch, cfg)
    for i in layers:
        e = by_name[arch.router.format(layer=i)]
        if e.shape != (n_exp, hidden):
            raise FTWError(f"{e.source.main.file.name}: tensor {e.source.main.name} has shape {list(e.shape)} but "
                           f"config.json implies {[n_exp, hidden]} (experts, hidden_size)")


# ---------------------------------------------------------------- running it

class _Progress:
    def __init__(self, total: int, callback: ProgressCallback | None, *, every_s: float = 0.2):
        self.total, self.callback, self.every_s = total, callback, every_s
        self.done = 0
        self.start_done = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.stage = ""

    def advance(self, nbytes: int, stage: str, tensor: str, *, force: bool = False) -> None:
        self.done += nbytes
        now = time.perf_counter()
        # At most every `every_s`, but a change of stage is always reported.
        if self.callback is None or (not force and stage == self.stage and now - self.last < self.every_s):
            return
        self.last, self.stage = now, stage
        elapsed = now - self.t0
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else None
        self.callback(ProgressEvent(stage, tensor, self.done, self.total, rate, eta))


def _byte_view(buf: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    """A typed torch view over part of an output buffer (no copy)."""
    return torch.from_numpy(buf).view(dtype).reshape(tuple(shape))


def _dense_bands(entry: DenseEntry, chunk_bytes: int, fp8_block_rows: int) -> list[tuple[int, int] | None]:
    """Row bands of at most ~chunk_bytes of fp32 working copy (FP8: whole scale blocks)."""
    if len(entry.shape) < 2:
        return [None]
    row_bytes = max(math.prod(entry.shape[1:]) * 4, 1)
    rows = max(1, chunk_bytes // row_bytes)
    if entry.source.kind == "fp8":
        rows = max(fp8_block_rows, rows // fp8_block_rows * fp8_block_rows)
    if rows >= entry.shape[0]:
        return [None]
    return [(r, min(r + rows, entry.shape[0])) for r in range(0, entry.shape[0], rows)]


def _write_dense(plan: Plan, pipe: WritePipeline, entry: DenseEntry, progress: _Progress, chunk_bytes: int):
    """Queue one dense tensor's bytes band by band; returns its running digest (final after a drain)."""
    ckpt, sw = plan.ckpt, entry.source
    digest = hashlib.new(CHECKSUM)
    offset = entry.offset
    row_bytes = entry.nbytes // entry.shape[0] if len(entry.shape) >= 1 and entry.shape[0] else entry.nbytes
    for band in _dense_bands(entry, chunk_bytes, ckpt.quant.fp8_block[0]):
        nbytes = entry.nbytes if band is None else (band[1] - band[0]) * row_bytes
        slot = pipe.acquire()
        dst = slot.ensure(nbytes)
        if sw.kind == "float" and sw.main.torch_dtype == entry.dtype:
            ckpt.read_float(sw, rows=band, out=dst)                  # straight into the output buffer
        else:
            t = ckpt.read_float(sw, rows=band, key="dense")
            _byte_view(dst, entry.dtype, t.shape).copy_(t)
        pipe.submit(slot, DENSE_FILE, offset, nbytes, digest, tensor=sw.main.name)
        offset += nbytes
        progress.advance(sw.source_bytes * nbytes // max(entry.nbytes, 1), "dense", entry.name)
    return digest


def _read_expert(plan: Plan, src: ExpertLayerSource, e: int) -> dict:
    """One expert, canonical (out, in): {proj: tensor | Fp4Parts, proj_bias: tensor}. Views into scratch
    buffers, valid until the next expert is read."""
    ckpt, inter, fp4 = plan.ckpt, plan.intermediate, plan.codec == "fp4"

    def load(sw: SourceWeight, key: str, index=()):
        return ckpt.read_fp4(sw, index=index, key=key) if fp4 else ckpt.read_float(sw, index=index, key=key)

    out: dict = {}
    if src.layout.kind == "per_expert":
        for proj in PROJS:
            out[proj] = load(src.weights[(proj, e)], proj)
        return out
    gate_up, down = src.weights[("gate_up", -1)], src.weights[("down", -1)]
    gu, dn = load(gate_up, "gate_up", (e,)), load(down, "down", (e,))
    if src.layout.kind == "fused_halves":                      # [2I, D]: first half gate
        if fp4:
            out["gate"], out["up"] = gu.select_rows(slice(0, inter)), gu.select_rows(slice(inter, 2 * inter))
        else:
            out["gate"], out["up"] = gu[:inter], gu[inter:]
        out["down"] = dn
        return out
    # gpt-oss: float tensors are (in, out) with gate/up interleaved in the out columns; MXFP4/NVFP4
    # ones are stored (out, in), so canonical gate/up are a row selection of the packed bytes.
    if gate_up.kind in ("mxfp4", "nvfp4"):
        if isinstance(gu, Fp4Parts):
            out["gate"], out["up"] = gu.select_rows(slice(0, None, 2)), gu.select_rows(slice(1, None, 2))
        else:
            out["gate"], out["up"] = gu[0::2], gu[1::2]                      # [2I, D] -> [I, D]
    else:
        out["gate"], out["up"] = gu[:, 0::2].t(), gu[:, 1::2].t()            # [D, 2I] -> [I, D]
    out["down"] = dn if down.kind in ("mxfp4", "nvfp4") else dn.t()         # [I, D] -> [D, I]
    bias = ckpt.read_float(src.weights[("gate_up_bias", -1)], index=(e,), key="gate_up_bias")   # [2I], interleaved
    out["gate_bias"], out["up_bias"] = bias[0::2], bias[1::2]
    out["down_bias"] = ckpt.read_float(src.weights[("down_bias", -1)], index=(e,), key="down_bias")
    return out


def _block_gaps(plan: Plan) -> list[tuple[int, int]]:
    """Byte ranges of a block that no part covers (alignment padding): kept zero."""
    gaps, pos = [], 0
    for part in plan.parts:
        if part.offset > pos:
            gaps.append((pos, part.offset))
        pos = part.offset + part.nbytes
    if pos < plan.block_nbytes:
        gaps.append((pos, plan.block_nbytes))
    return gaps


def _encode_expert(plan: Plan, weights: dict, buf: np.ndarray, where: str) -> None:
    """Pack one canonical expert into its block buffer, each part copied (and converted) in place."""
    def view(name: str) -> torch.Tensor:
        part = plan.part_by_name[name]
        return _byte_view(buf[part.offset: part.offset + part.nbytes], TORCH_DTYPES[part.dtype], part.shape)

    packed: dict[str, torch.Tensor] = {}
    for proj in PROJS:
        w = weights[proj]
        if plan.codec in ("f32", "bf16"):
            packed[proj] = w                                      # copy_ converts dtype and layout
        elif plan.codec == "int4":
            expect = plan.part_by_name[proj].shape
            if tuple(w.shape) != (expect[0], expect[1] * 2):
                raise FTWError(f"{where}: {proj} has shape {list(w.shape)}, expected {[expect[0], expect[1] * 2]}")
            int4_quantize_into(w, plan.group_size, q=view(proj), scales=view(f"{proj}_scales"),
                               mins=view(f"{proj}_mins"), scratch=plan.ckpt.scratch, name=f"{where} {proj}")
        else:
            packed[proj], packed[f"{proj}_scales"] = w.packed, w.scales  # scales as stored bytes
            if w.global_scale is not None:
                packed[f"{proj}_global"] = w.global_scale.reshape(1)
    for name in ("gate_bias", "up_bias", "down_bias"):
        if name in weights:
            packed[name] = weights[name]
    for part in plan.parts:
        t = packed.get(part.name)
        if t is None:                                             # already written in place (int4)
            continue
        if tuple(t.shape) != part.shape:
            raise FTWError(f"{where}: {part.name} has shape {list(t.shape)}, expected {list(part.shape)}")
        region = buf[part.offset: part.offset + part.nbytes]
        # Byte-typed sources (packed nibbles, e8m0/e4m3 scales) are copied as bytes, never converted.
        # torch's strided copy beats numpy's here (30 vs 17 GiB/s for a gate/up row split, one thread).
        dtype = torch.uint8 if t.dtype == torch.uint8 else TORCH_DTYPES[part.dtype]
        _byte_view(region, dtype, part.shape).copy_(t)
    for start, end in plan.gaps:
        buf[start:end] = 0


def _read_fp4_expert_into(plan: Plan, src: ExpertLayerSource, e: int, buf: np.ndarray) -> None:
    """Per-expert FP4 sources are already laid out as our parts (packed [O, N/2], scales [O, N/block],
    the fp32 global): read each straight into its place in the block, no copy in between."""
    for proj in PROJS:
        sw = src.weights[(proj, e)]
        for role, part in (("main", proj), ("scale", f"{proj}_scales"), ("scale2", f"{proj}_global")):
            if role not in sw.parts:
                continue
            p, info = plan.part_by_name[part], sw.parts[role]
            if info.nbytes != p.nbytes:
                raise FTWError(f"{info.file.name}: tensor {info.name} {list(info.shape)} holds {info.nbytes} bytes, "
                               f"expected {p.nbytes} for {part} {list(p.shape)}")
            plan.ckpt.read(info, out=buf[p.offset: p.offset + p.nbytes])
    for start, end in plan.gaps:
        buf[start:end] = 0


def _write_experts(plan: Plan, pipe: WritePipeline, src: ExpertLayerSource, progress: _Progress,
                   workers: ThreadPoolExecutor | None) -> BlockDigests:
    """Read, pack and queue every expert of a layer; with `workers`, several experts at once (file reads
    and torch ops release the GIL). Blocks land at fixed offsets and hash into fixed slots, so the
    result does not depend on the order they finish in."""
    digests = BlockDigests(plan.num_experts)
    per_expert_src = src.source_bytes() // plan.num_experts

    direct = plan.codec == "fp4" and src.layout.kind == "per_expert"

    def one(e: int) -> str:
        where = f"layer {src.layer} expert {e}"
        if direct:
            slot = pipe.acquire()
            _read_fp4_expert_into(plan, src, e, slot.ensure(plan.block_nbytes))
        else:
            weights = _read_expert(plan, src, e)
            slot = pipe.acquire()
            _encode_expert(plan, weights, slot.ensure(plan.block_nbytes), where)
        pipe.submit(slot, EXPERTS_FILE, src.offset + e * plan.block_nbytes, plan.block_nbytes, None, tensor=where,
                    block=(digests, e))
        return where

    results = workers.map(one, range(plan.num_experts)) if workers else map(one, range(plan.num_experts))
    for where in results:                       # progress from this thread only: callbacks may touch a UI
        progress.advance(per_expert_src, "experts", where)
    return digests


def source_metadata(folder: Path) -> dict:
    """Repo id and revision when we can know them: source.json (our downloader), the hub cache path, else the folder."""
    meta = {"repo_id": None, "revision": None, "folder": folder.name}
    sj = folder / "source.json"
    if sj.is_file():
        try:
            data = json.loads(sj.read_text(encoding="utf-8"))
            meta.update({k: data.get(k) for k in ("repo_id", "revision") if data.get(k)})
        except ValueError:
            log.warning("%s: not valid JSON; ignored", sj)
    parts = folder.resolve().parts
    if meta["repo_id"] is None and len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        meta["repo_id"] = parts[-3][len("models--"):].replace("--", "/")
        meta["revision"] = meta["revision"] or parts[-1]
    if meta["revision"] is None:
        for md in sorted((folder / ".cache" / "huggingface" / "download").glob("*.metadata")):
            first = md.read_text(encoding="utf-8", errors="replace").splitlines()[:1]
            if first and re.fullmatch(r"[0-9a-f]{40}", first[0].strip()):
                meta["revision"] = first[0].strip()
                break
    return meta


def _fingerprint(plan: Plan, skeleton: dict) -> str:
    stats = []
    for path in sorted(plan.ckpt.shards):
        st = path.stat()
        stats.append([path.name, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"skeleton": skeleton, "sources": stats}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def _skeleton(plan: Plan) -> dict:
    """The manifest without checksums: everything fixed by the plan."""
    ckpt = plan.ckpt
    cfg = dict(ckpt.text_config)
    cfg["model_type"] = plan.arch.model_type
    layers = [int(u.split(".")[1]) for u in plan.units if u in plan.experts]
    experts = {
        "file": EXPERTS_FILE, "nbytes": plan.experts_nbytes, "codec": plan.codec,
        "layers": layers, "num_experts": plan.num_experts, "hidden_size": plan.hidden,
        "intermediate_size": plan.intermediate, "activation": plan.arch.activation, "has_bias": plan.arch.has_bias,
        "block_nbytes": plan.block_nbytes, "parts": [p.to_json() for p in plan.parts],
        "layer_offsets": {str(i): plan.experts[f"layer.{i}"].offset for i in layers},
    }
    if plan.codec == "int4":
        experts["group_size"] = plan.group_size
    if plan.codec == "fp4":
        block, scale_format, has_global = FP4_FORMATS[plan.fp4_format]
        experts.update({"fp4_format": plan.fp4_format, "block_size": block, "scale_format": scale_format,
                        "global_scale_op": plan.fp4_global_op if has_global else None})
    dense = {e.name: {"dtype": dtype_name(e.dtype), "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes,
                      "source": e.source.main.name, "source_quantization": e.source.kind}
             for u in plan.units for e in plan.dense[u]}
    return {
        "format": "ftw", "format_version": FORMAT_VERSION, "checksum_algorithm": CHECKSUM,
        "model_type": plan.arch.model_type, "config": cfg,
        "source": {**source_metadata(ckpt.folder), "quantization": ckpt.quant.method,
                   "quantization_spelling": ckpt.quant.spelling or None},
        "dense": {"file": DENSE_FILE, "nbytes": plan.dense_nbytes, "tensors": dense},
        "experts": experts,
    }


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    if not (src / "tokenizer.json").is_file():
        raise FTWError(f"{src}: tokenizer.json missing; FreeToken needs the model's fast tokenizer")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    if "chat_template.jinja" not in copied:
        template = None
        if (src / "chat_template.json").is_file():
            template = json.loads((src / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
        if template is None and (src / "tokenizer_config.json").is_file():
            template = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):        # [{name, template}]: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
            copied.append("chat_template.jinja")
    return copied


def resolve_codec(src: str | Path, codec: str = "auto") -> str:
    """The expert codec `convert` would use for this source (reads headers only)."""
    ckpt = Checkpoint.open(Path(src))
    try:
        return make_plan(ckpt, codec=codec).codec
    finally:
        ckpt.close()


def default_output_name(src: Path, codec: str) -> str:
    meta = source_metadata(src)
    base = (meta["repo_id"] or meta["folder"]).split("/")[-1]
    return f"{base}-{codec}"


def convert(src: str | Path, out: str | Path, *, codec: str = "auto", group_size: int = 64, overwrite: bool = False,
            progress: ProgressCallback | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
            workers: int = 0) -> Path:
    """Convert the checkpoint folder `src` into the FTW package `out`; returns `out`.

    `workers`: experts read and packed at once (0: up to 4, one per core).

    Raises FTWError for any bad input; on failure `out` is untouched and `<out>.partial` holds
    what was done (running the same call again resumes from it).
    """
    src, out = Path(src), Path(out)
    if progress:
        progress(ProgressEvent("planning", "", 0, 0, 0.0, None))
    ckpt = Checkpoint.open(src)
    try:
        plan = make_plan(ckpt, codec=codec, group_size=group_size)
        if out.exists() and not overwrite:
            raise FTWError(f"{out} already exists; remove it or pass --force to replace it")
        if not (src / "tokenizer.json").is_file():
            raise FTWError(f"{src}: tokenizer.json missing; FreeToken needs the model's fast tokenizer")
        skeleton = _skeleton(plan)
        _check_free_space(out, plan.dense_nbytes + plan.experts_nbytes)
        writer = PackageWriter(out, fingerprint=_fingerprint(plan, skeleton),
                               file_sizes={DENSE_FILE: plan.dense_nbytes, EXPERTS_FILE: plan.experts_nbytes})
        try:
            if writer.complete:
                return writer.finish(None, overwrite=overwrite)
            return _run(plan, writer, skeleton, progress=progress, chunk_bytes=chunk_bytes, overwrite=overwrite,
                        workers=workers)
        finally:
            writer.close()
    finally:
        ckpt.close()


def _check_free_space(out: Path, need: int) -> None:
    probe = out.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return
    if free < need:
        raise FTWError(f"{out}: not enough disk space: the package needs {need / 2**30:.2f} GiB, "
                       f"{free / 2**30:.2f} GiB are free")


def _run(plan: Plan, writer: PackageWriter, skeleton: dict, *, progress: ProgressCallback | None,
         chunk_bytes: int, overwrite: bool, workers: int = 0) -> Path:
    tracker = _Progress(plan.source_bytes, progress)
    dense_sums: dict[str, str] = {}
    layer_sums: dict[str, str] = {}
    if writer.resumed:
        for unit, record in writer.done.items():
            tracker.done += plan.unit_source_bytes(unit)
        tracker.start_done = tracker.done
        tracker.advance(0, "resuming", f"{len(writer.done)} of {len(plan.units)} units already converted", force=True)
    plan.ckpt.use_scratch = True
    n_workers = workers or max(1, min(4, os.cpu_count() or 1))
    pool = ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="ftw-expert") if n_workers > 1 else None
    pipe = WritePipeline(writer, extra_slots=n_workers - 1)
    try:
        for unit in plan.units:
            if unit in writer.done:
                record = writer.done[unit]
                dense_sums.update(record.get("dense", {}))
                layer_sums.update(record.get("experts", {}))
                continue
            digests = {("dense", e.name): _write_dense(plan, pipe, e, tracker, chunk_bytes) for e in plan.dense[unit]}
            if unit in plan.experts:
                digests[("experts", unit.split(".")[1])] = _write_experts(plan, pipe, plan.experts[unit], tracker,
                                                                          pool)
            pipe.drain()
            record = {"dense": {}, "experts": {}}
            for (kind, name), digest in digests.items():
                record[kind][name] = digest.hexdigest()
            writer.commit_unit(unit, record)
            dense_sums.update(record["dense"])
            layer_sums.update(record["experts"])
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        pipe.close()
    tracker.advance(0, "finishing", "", force=True)
    manifest = json.loads(json.dumps(skeleton))
    for name, digest in dense_sums.items():
        manifest["dense"]["tensors"][name]["checksum"] = digest
    manifest["experts"]["layer_checksums"] = layer_sums
    try:
        manifest["tokenizer_files"] = _copy_tokenizer(plan.ckpt.folder, writer.partial)
    except OSError as e:
        raise FTWError(f"{writer.partial}: cannot copy the tokenizer files ({e.strerror})") from e
    gen_path = plan.ckpt.folder / "generation_config.json"
    manifest["generation_config"] = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
    path = writer.finish(manifest, overwrite=overwrite)
    tracker.advance(0, "done", "", force=True)
    return path
