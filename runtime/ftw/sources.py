"""Reading Hugging Face checkpoints: safetensors shards, their index, and quantized tensor groups.

Shards are read with our own header parser and positioned reads rather than a memory map: each
read lands in a fresh buffer of exactly the bytes asked for, so the converter's anonymous memory
stays bounded by what it holds (the page cache is the kernel's to reclaim), every contiguous slice
of a tensor (one expert of a fused [E, ...] tensor, a band of rows) is one read, and a truncated or
corrupt file is reported by name with the tensor that needed the missing bytes.

A *logical weight* is what a module's `.weight` means once dequantized; a quantized checkpoint
spells it as several tensors (FP8: `weight` + `weight_scale_inv`; NVFP4 ModelOpt: `weight` +
`weight_scale` + `weight_scale_2`; NVFP4 compressed-tensors: `weight_packed` + `weight_scale` +
`weight_global_scale`; MXFP4: `<name>_blocks` + `<name>_scales`). `SourceWeight` groups them.
"""
from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runtime.ftw.errors import FTWError

MAX_HEADER_BYTES = 100 << 20

# safetensors dtype -> (torch dtype, bytes per element)
ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1), "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1), "I16": (torch.int16, 2), "I32": (torch.int32, 4), "I64": (torch.int64, 8),
    "BOOL": (torch.bool, 1), "U16": (torch.uint16, 2), "U32": (torch.uint32, 4), "U64": (torch.uint64, 8),
}
if hasattr(torch, "float8_e8m0fnu"):
    ST_DTYPES["F8_E8M0"] = (torch.float8_e8m0fnu, 1)
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str                 # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    start: int                 # absolute byte offset in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return ST_DTYPES[self.dtype][0]


class Shard:
    """One safetensors file: header parsed and checked at open, data read on demand."""

    def __init__(self, path: Path, *, expected_tensor: str = "?"):
        self.path = path
        self._lock = threading.Lock()
        try:
            self._fh = open(path, "rb", buffering=0)
        except OSError as e:
            raise FTWError(f"{path.name}: cannot open the shard that holds tensor {expected_tensor} ({e.strerror})") from e
        size = os.fstat(self._fh.fileno()).st_size
        where = f"{path.name} (tensor {expected_tensor})"
        head = self._fh.read(8)
        if len(head) < 8:
            raise FTWError(f"{where}: the file is truncated ({size} bytes, no safetensors header); download it again")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER_BYTES or hlen + 8 > size:
            raise FTWError(f"{where}: corrupt safetensors header (claims {hlen} header bytes in a "
                           f"{size}-byte file); download it again")
        try:
            header = json.loads(self._fh.read(hlen).decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:
            raise FTWError(f"{where}: corrupt safetensors header ({e}); download it again") from e
        base = 8 + hlen
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (a, b) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError) as e:
                raise FTWError(f"{path.name}: corrupt safetensors header entry for tensor {name}") from e
            if dtype not in ST_DTYPES:
                raise FTWError(f"{path.name}: tensor {name} has dtype {dtype}, which FreeToken cannot read")
            if b - a != math.prod(shape) * ST_DTYPES[dtype][1] or a < 0:
                raise FTWError(f"{path.name}: corrupt safetensors header: tensor {name} {list(shape)} {dtype} "
                               f"does not match its byte range {a}..{b}")
            if base + b > size:
                raise FTWError(f"{path.name} is truncated: tensor {name} needs bytes up to {base + b} but the "
                               f"file has {size}; download it again")
            self.tensors[name] = TensorInfo(name, path, dtype, shape, base + a, b - a)

    def read_bytes(self, info: TensorInfo, offset: int, nbytes: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """nbytes from `offset` within the tensor's data, into `out` (uint8, reused) or a fresh array."""
        buf = np.empty(nbytes, dtype=np.uint8) if out is None else out[:nbytes]
        view = memoryview(buf)
        got = 0
        if hasattr(os, "preadv"):               # positioned: worker threads read one shard at once
            fd = self._fh.fileno()
            while got < nbytes:
                n = os.preadv(fd, [view[got:]], info.start + offset + got)
                if not n:
                    raise FTWError(f"{self.path.name}: tensor {info.name} ends early (file truncated while "
                                   f"converting?); download it again")
                got += n
            return buf
        with self._lock:
            self._fh.seek(info.start + offset)
            while got < nbytes:
                n = self._fh.readinto(view[got:])
                if not n:
                    raise FTWError(f"{self.path.name}: tensor {info.name} ends early (file truncated while "
                                   f"converting?); download it again")
                got += n
        return buf

    def close(self) -> None:
        self._fh.close()


class Scratch:
    """Reusable read buffers by name. Fresh large allocations cost a page fault per 4 KiB (measured: a
    copy into new memory runs at a twentieth of the speed of one into memory already touched), so the
    converter reads every tensor into a buffer it reuses. A buffer is valid until its name is reused."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, nbytes: int) -> np.ndarray:
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self._bufs[key] = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


def read_tensor(shard: Shard, info: TensorInfo, *, index: tuple[int, ...] = (),
                rows: tuple[int, int] | None = None, out: np.ndarray | None = None) -> torch.Tensor:
    """A contiguous slice of a tensor: fix the leading dims to `index`, then take `rows` of the next dim."""
    shape = list(info.shape)
    item = ST_DTYPES[info.dtype][1]
    offset = 0
    for i in index:
        inner = math.prod(shape[1:]) * item
        offset += i * inner
        shape = shape[1:]
    if rows is not None and shape:
        r0, r1 = rows
        row_bytes = math.prod(shape[1:]) * item
        offset += r0 * row_bytes
        shape = [r1 - r0] + shape[1:]
    nbytes = math.prod(shape) * item
    raw = shard.read_bytes(info, offset, nbytes, out=out)
    return torch.from_numpy(raw).view(info.torch_dtype).reshape(shape)


# ---------------------------------------------------------------- quantization of a checkpoint

QUANT_NONE, QUANT_FP8, QUANT_MXFP4, QUANT_NVFP4 = "none", "fp8", "mxfp4", "nvfp4"


@dataclass(frozen=True)
class Quantization:
    method: str                                  # none | fp8 | mxfp4 | nvfp4
    spelling: str = ""                           # modelopt | compressed-tensors (nvfp4)
    fp8_block: tuple[int, int] = (128, 128)
    excluded: tuple[str, ...] = ()               # modules the source left unquantized (informational)


def detect_quantization(folder: Path, config: dict) -> Quantization:
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    hf_quant = folder / "hf_quant_config.json"
    if not qc and hf_quant.exists():
        q = json.loads(hf_quant.read_text(encoding="utf-8")).get("quantization", {})
        qc = {"quant_method": "modelopt", "quant_algo": q.get("quant_algo"),
              "exclude_modules": q.get("exclude_modules", [])}
    if not qc:
        return Quantization(QUANT_NONE)
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        block = tuple(qc.get("weight_block_size") or (128, 128))
        if len(block) != 2:
            raise FTWError(f"config.json: FP8 quantization_config.weight_block_size {block} is not 2-D; "
                           "only block-scaled FP8 (e.g. 128x128) is supported")
        return Quantization(QUANT_FP8, fp8_block=(int(block[0]), int(block[1])),
                            excluded=tuple(qc.get("modules_to_not_convert") or ()))
    if method == "mxfp4":
        return Quantization(QUANT_MXFP4, excluded=tuple(qc.get("modules_to_not_convert") or ()))
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return Quantization(QUANT_NVFP4, "modelopt", excluded=tuple(qc.get("exclude_modules") or ()))
        raise FTWError(f"config.json: unsupported quantization: ModelOpt quant_algo {algo or '?'}; FreeToken "
                       "converts bf16/fp16/fp32, block FP8, MXFP4 and NVFP4 checkpoints")
    if method == "compressed-tensors":
        fmts = {str(qc.get("format", ""))}
        for group in (qc.get("config_groups") or {}).values():
            fmts.add(str(group.get("format", "")))
        fmts.discard("")
        if fmts == {"nvfp4-pack-quantized"}:
            return Quantization(QUANT_NVFP4, "compressed-tensors", excluded=tuple(qc.get("ignore") or ()))
        raise FTWError(f"config.json: unsupported quantization: compressed-tensors format {sorted(fmts)}; "
                       "FreeToken converts its nvfp4-pack-quantized format only")
    raise FTWError(f"config.json: unsupported quantization {method or qc!r} (quantization_config.quant_method); "
                   "FreeToken converts bf16/fp16/fp32, block FP8, MXFP4 and NVFP4 checkpoints")


# ---------------------------------------------------------------- logical weights

@dataclass
class Fp4Parts:
    """FP4 matrix as stored: packed [R, N/2] uint8, scales [R, N/block] (uint8 bytes), optional global."""
    packed: torch.Tensor
    scales: torch.Tensor
    fmt: str                                     # "mxfp4" | "nvfp4"
    global_scale: torch.Tensor | None = None     # fp32 scalar (nvfp4)
    global_op: str = "mul"                       # "mul" (ModelOpt weight_scale_2) | "div" (compressed-tensors)

    def select_rows(self, rows) -> "Fp4Parts":
        """A row selection as strided views: the bytes move once, straight into the output block."""
        return Fp4Parts(self.packed[rows], self.scales[rows], self.fmt, self.global_scale, self.global_op)


@dataclass
class SourceWeight:
    """One logical weight and the checkpoint tensors that spell it."""
    name: str                                    # logical name, e.g. "...q_proj.weight"
    kind: str                                    # float | fp8 | nvfp4 | mxfp4
    parts: dict[str, TensorInfo] = field(default_factory=dict)   # role -> tensor (main, scale, scale2)
    global_op: str = "mul"

    @property
    def main(self) -> TensorInfo:
        return self.parts["main"]

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized shape."""
        s = self.main.shape
        if self.kind == "nvfp4":
            return s[:-1] + (s[-1] * 2,)
        if self.kind == "mxfp4":                  # [..., R, N/32, 16]
            return s[:-2] + (s[-2] * s[-1] * 2,)
        return s

    @property
    def source_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())


def group_logical_weights(tensors: dict[str, TensorInfo]) -> dict[str, SourceWeight]:
    """Group raw tensors into logical weights; companions (scales) never appear on their own."""
    out: dict[str, SourceWeight] = {}
    consumed: set[str] = set()
    for name, info in tensors.items():
        if name.endswith("_blocks") and name[:-7] + "_scales" in tensors:
            base = name[:-7]
            out[base] = SourceWeight(base, "mxfp4", {"main": info, "scale": tensors[base + "_scales"]})
            consumed.update((name, base + "_scales"))
        elif name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            parts = {"main": info}
            for role, suffix in (("scale", "_scale"), ("scale2", "_global_scale")):
                if base + suffix not in tensors:
                    raise FTWError(f"{info.file.name}: NVFP4 tensor {name} has no {base + suffix}")
                parts[role] = tensors[base + suffix]
            out[base] = SourceWeight(base, "nvfp4", parts, global_op="div")
            consumed.update(p.name for p in parts.values())
        elif name.endswith(".weight_scale_inv"):
            base = name[: -len("_scale_inv")]
            if base not in tensors:
                raise FTWError(f"{info.file.name}: FP8 scale {name} has no weight {base}")
            out[base] = SourceWeight(base, "fp8", {"main": tensors[base], "scale": info})
            consumed.update((name, base))
        elif name.endswith(".weight_scale_2"):
            base = name[: -len("_scale_2")]
            if base not in tensors or base + "_scale" not in tensors:
                raise FTWError(f"{info.file.name}: NVFP4 scale {name} lacks {base} or {base}_scale")
            out[base] = SourceWeight(base, "nvfp4", {"main": tensors[base], "scale": tensors[base + "_scale"],
                                                     "scale2": info}, global_op="mul")
            consumed.update((name, base, base + "_scale"))
    for name, info in tensors.items():
        if name in consumed:
            continue
        if name.endswith(".weight_scale") and name[: -len("_scale")] in tensors:
            continue   # a per-tensor-scaled weight's scale without a scale_2: caught below as unsupported
        out[name] = SourceWeight(name, "float", {"main": info})
    for sw in out.values():
        if sw.kind == "float" and sw.main.dtype not in FLOAT_DTYPES and sw.name + "_scale" in tensors:
            raise FTWError(f"{sw.main.file.name}: tensor {sw.name} is {sw.main.dtype} with a per-tensor scale; "
                           "this quantization is not supported")
        _check_quantized(sw)
    return out


# kind -> role -> dtypes the published formats use
QUANT_DTYPES = {
    "fp8": {"main": ("F8_E4M3",), "scale": ("F32", "BF16", "F16")},
    "mxfp4": {"main": ("U8",), "scale": ("U8", "F8_E8M0")},
    "nvfp4": {"main": ("U8",), "scale": ("F8_E4M3", "U8"), "scale2": ("F32",)},
}


def _check_quantized(sw: SourceWeight) -> None:
    """Dtypes and shapes of a quantized weight's tensors agree with each other and with the format."""
    if sw.kind == "float":
        return
    for role, info in sw.parts.items():
        if info.dtype not in QUANT_DTYPES[sw.kind][role]:
            raise FTWError(f"{info.file.name}: tensor {info.name} is {info.dtype}; {sw.kind} stores it as "
                           f"{' or '.join(QUANT_DTYPES[sw.kind][role])}")
    main, scale = sw.parts["main"], sw.parts["scale"]
    if sw.kind == "mxfp4":
        ok = main.shape[-1] == 16 and scale.shape == main.shape[:-1]
    elif sw.kind == "nvfp4":
        ok = scale.shape[:-1] == main.shape[:-1] and scale.shape[-1] * 8 == main.shape[-1]
    else:
        ok = len(scale.shape) == len(main.shape)
    if not ok:
        raise FTWError(f"{scale.file.name}: scale {scale.name} {list(scale.shape)} does not fit weight "
                       f"{main.name} {list(main.shape)} ({sw.kind})")


# ---------------------------------------------------------------- the checkpoint

@dataclass
class Checkpoint:
    folder: Path
    config: dict                  # config.json as saved (may be a VLM config)
    text_config: dict             # the language model's config
    quant: Quantization
    tensors: dict[str, TensorInfo]
    weights: dict[str, SourceWeight]
    shards: dict[Path, Shard]
    use_scratch: bool = False          # set by the converter: reads then reuse buffers by key, per thread
    _local: threading.local = field(default_factory=threading.local, repr=False)

    @property
    def scratch(self) -> Scratch | None:
        """This thread's reusable buffers (each converter worker thread has its own)."""
        if not self.use_scratch:
            return None
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = Scratch()
        return scratch

    @classmethod
    def open(cls, folder: str | os.PathLike) -> "Checkpoint":
        folder = Path(folder)
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FTWError(f"{folder}: no config.json; is this a Hugging Face model folder?")
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise FTWError(f"{cfg_path}: not valid JSON ({e})") from e
        text_config = dict(config.get("text_config") or config)
        if "text_config" in config:
            for key in ("tie_word_embeddings",):
                if key not in text_config and key in config:
                    text_config[key] = config[key]
        quant = detect_quantization(folder, config)
        shard_of = _shard_map(folder)
        shards: dict[Path, Shard] = {}
        tensors: dict[str, TensorInfo] = {}
        for path, expected in shard_of.items():
            # Without an index (one model.safetensors) nothing is expected in advance: name no tensor.
            shard = Shard(path, expected_tensor=expected[0] if expected else "?")
            shards[path] = shard
            for name in expected:
                if name not in shard.tensors:
                    raise FTWError(f"{path.name}: missing tensor {name} (the index lists it in this shard)")
            tensors.update(shard.tensors)
        return cls(folder, config, text_config, quant, tensors, group_logical_weights(tensors), shards)

    def read(self, info: TensorInfo, *, index: tuple[int, ...] = (), rows: tuple[int, int] | None = None,
             key: str = "", out: np.ndarray | None = None) -> torch.Tensor:
        """Read (a slice of) a tensor; with `key`, into the scratch buffer of that name (see Scratch)."""
        if out is None and key and self.scratch is not None:
            out = self.scratch.get(key, _slice_nbytes(info, index, rows))
        return read_tensor(self.shards[info.file], info, index=index, rows=rows, out=out)

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    # ---- dequantization of logical weights

    def read_float(self, sw: SourceWeight, *, index: tuple[int, ...] = (), rows: tuple[int, int] | None = None,
                   key: str = "", out: np.ndarray | None = None) -> torch.Tensor:
        """The logical weight (or a slice of it), dequantized to fp32 where quantized; float sources keep
        dtype (read into `out` when given)."""
        if sw.kind == "float":
            return self.read(sw.main, index=index, rows=rows, key=key, out=out)
        if sw.kind == "fp8":
            return self._read_fp8(sw, index=index, rows=rows, key=key)
        parts = self.read_fp4(sw, index=index, rows=rows, key=key)
        from runtime.ftw.codecs import FP4_FORMATS, fp4_dequantize
        block, scale_format, _ = FP4_FORMATS[parts.fmt]
        return fp4_dequantize(parts.packed, parts.scales, block_size=block, scale_format=scale_format,
                              global_scale=parts.global_scale, global_op=parts.global_op)

    def _read_fp8(self, sw: SourceWeight, *, index, rows, key: str = "") -> torch.Tensor:
        bo, bi = self.quant.fp8_block
        w = self.read(sw.main, index=index, rows=rows, key=key and key + ".w").to(torch.float32)   # [R, N]
        scale_info = sw.parts["scale"]
        r0 = rows[0] if rows else 0
        r1 = rows[1] if rows else sw.main.shape[len(index)]
        if rows and (r0 % bo):
            raise ValueError("FP8 row bands must start on a scale block")
        srows = (r0 // bo, -(-r1 // bo))
        s = self.read(scale_info, index=index, rows=srows).to(torch.float32)  # [R/bo, N/bi]
        n = w.shape[-1]
        if s.shape[-1] != -(-n // bi) or s.shape[-2] != srows[1] - srows[0]:
            raise FTWError(f"{scale_info.file.name}: FP8 scale {scale_info.name} {list(scale_info.shape)} does not "
                           f"cover weight {sw.main.name} {list(sw.main.shape)} in {bo}x{bi} blocks")
        s = s.repeat_interleave(bo, dim=-2)[: r1 - r0].repeat_interleave(bi, dim=-1)[..., :n]
        return w * s

    def read_fp4(self, sw: SourceWeight, *, index: tuple[int, ...] = (), rows: tuple[int, int] | None = None,
                 key: str = "") -> Fp4Parts:
        """An FP4 weight's stored parts, untouched: packed [R, N/2], scales [R, N/block] as uint8."""
        packed = self.read(sw.main, index=index, rows=rows, key=key and key + ".w")
        scales = self.read(sw.parts["scale"], index=index, rows=rows, key=key and key + ".s")
        if sw.kind == "mxfp4":                      # [R, N/32, 16] -> [R, N/2]
            return Fp4Parts(packed.reshape(packed.shape[0], -1), scales.view(torch.uint8), "mxfp4")
        g_info = sw.parts["scale2"]
        # A per-matrix scale is a scalar, or one per expert for a fused [E, ...] weight.
        per_expert = bool(index) and math.prod(g_info.shape) > 1 and g_info.shape[0] == sw.main.shape[0]
        g = self.read(g_info, index=index[:1] if per_expert else ())
        if g.numel() != 1:
            raise FTWError(f"{g_info.file.name}: NVFP4 global scale {g_info.name} has shape {list(g_info.shape)}; "
                           f"expected one value for {sw.main.name}")
        g = g.to(torch.float32).reshape(())
        return Fp4Parts(packed, scales.view(torch.uint8), "nvfp4", g, sw.global_op)


def _slice_nbytes(info: TensorInfo, index: tuple[int, ...], rows: tuple[int, int] | None) -> int:
    shape = list(info.shape[len(index):])
    if rows is not None and shape:
        shape[0] = rows[1] - rows[0]
    return math.prod(shape) * ST_DTYPES[info.dtype][1]


def _shard_map(folder: Path) -> dict[Path, list[str]]:
    """shard path -> tensor names the index puts in it (or every shard's names, without an index)."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as e:
            raise FTWError(f"{index_path.name}: not a valid safetensors index ({e})") from e
        by_file: dict[Path, list[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(folder / fname, []).append(name)
        for path, names in by_file.items():
            if not path.is_file():
                raise FTWError(f"{path.name}: shard missing from {folder} (it holds tensor {names[0]}); "
                               "download it again")
        return by_file
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FTWError(f"{folder}: no safetensors files (FreeToken converts safetensors checkpoints only)")
    return {f: [] for f in files}
