"""Conversion throughput on synthetic checkpoints of real shapes, against the disk's own read rate.

    python benchmarks/bench_convert.py --work /scratch --json-dir results/     # defaults: a few GB per kind
    python benchmarks/bench_convert.py --kinds mxfp4 --layers 4 --work /nvme --json-dir out/

Kinds (shapes of the real models; `--layers` decoder layers of them, full embeddings):
  bf16   Qwen3-30B-A3B in bf16 (128 experts, D 2048, I 768, per-expert tensors) -> int4 experts
  mxfp4  gpt-oss-120b (128 experts, D = I = 2880, fused MXFP4 _blocks/_scales)   -> fp4 experts
  nvfp4  Qwen3-30B-A3B-NVFP4 as ModelOpt exports it (per-expert weight/weight_scale/weight_scale_2) -> fp4

For each kind: write the checkpoint (streamed, never held in memory), evict it from the page cache
(posix_fadvise DONTNEED), time a plain sequential read of its shards (the disk's rate), evict again,
time `convert` (cold), then time it again with the source in the page cache (warm: the converter's
own ceiling). Rates are GiB of source read per second. Results: one JSON file in --json-dir.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHARD_BYTES = 2 << 30
POOL_BYTES = 64 << 20

ST_ITEMSIZE = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str                 # safetensors dtype
    shape: tuple[int, ...]
    fill: str = "normal"       # normal | bytes | e8m0 | e4m3 | scalar

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_ITEMSIZE[self.dtype]


class _Pool:
    """Random bytes of each flavour, reused cyclically so writing GBs costs no RNG time."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        normal = (rng.standard_normal(POOL_BYTES // 4, dtype=np.float32) * 0.02)
        self.pools = {
            ("normal", "BF16"): (normal.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8),
            ("normal", "F32"): normal.view(np.uint8),
            ("bytes", "U8"): rng.integers(0, 256, POOL_BYTES, dtype=np.uint8),
            ("e8m0", "U8"): rng.integers(118, 126, POOL_BYTES, dtype=np.uint8),
            # e4m3 bytes 0x20..0x5f: positive normal values 2^-5..2^3, never NaN
            ("e4m3", "F8_E4M3"): rng.integers(0x20, 0x60, POOL_BYTES, dtype=np.uint8),
        }
        self.pos = 0

    def take(self, spec: Spec) -> list[np.ndarray]:
        if spec.fill == "scalar":
            value = np.array([0.0021 if spec.dtype == "F32" else 1], dtype=np.float32)
            return [value.view(np.uint8)[: spec.nbytes]]
        pool = self.pools[(spec.fill, spec.dtype)]
        out, left = [], spec.nbytes
        while left:
            self.pos %= len(pool)
            n = min(left, len(pool) - self.pos)
            out.append(pool[self.pos: self.pos + n])
            self.pos += n
            left -= n
        return out


def write_checkpoint(folder: Path, config: dict, specs: list[Spec], *, shard_bytes: int = SHARD_BYTES,
                     extra_files: dict[str, str] | None = None, seed: int = 0) -> int:
    """Stream a sharded safetensors checkpoint with an index; returns total tensor bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    pool = _Pool(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for spec in group:
            header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [off, off + spec.nbytes]}
            off += spec.nbytes
            weight_map[spec.name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            for spec in group:
                for piece in pool.take(spec):
                    fh.write(piece)
                total += spec.nbytes
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}')
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    for name, text in (extra_files or {}).items():
        (folder / name).write_text(text)
    return total


# ---------------------------------------------------------------- the real shapes

def qwen3_moe_specs(*, layers: int, quant: str = "bf16", hidden: int = 2048, inter: int = 768, experts: int = 128,
                    vocab: int = 151936, heads: int = 32, kv_heads: int = 4, head_dim: int = 128
                    ) -> tuple[dict, list[Spec], dict[str, str]]:
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
              "moe_intermediate_size": inter, "intermediate_size": 6144, "num_experts": experts,
              "num_experts_per_tok": 8, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": False, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
    extra: dict[str, str] = {}

    def linear(name: str, out_f: int, in_f: int) -> list[Spec]:
        if quant == "nvfp4":
            return [Spec(name + ".weight", "U8", (out_f, in_f // 2), "bytes"),
                    Spec(name + ".weight_scale", "F8_E4M3", (out_f, in_f // 16), "e4m3"),
                    Spec(name + ".weight_scale_2", "F32", (), "scalar"), Spec(name + ".input_scale", "F32", (), "scalar")]
        return [Spec(name + ".weight", "BF16", (out_f, in_f))]

    specs = [Spec("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [Spec(p + "input_layernorm.weight", "BF16", (hidden,)),
                  Spec(p + "post_attention_layernorm.weight", "BF16", (hidden,)),
                  Spec(p + "self_attn.q_norm.weight", "BF16", (head_dim,)),
                  Spec(p + "self_attn.k_norm.weight", "BF16", (head_dim,)),
                  Spec(p + "mlp.gate.weight", "BF16", (experts, hidden))]
        specs += linear(p + "self_attn.q_proj", heads * head_dim, hidden)
        specs += linear(p + "self_attn.k_proj", kv_heads * head_dim, hidden)
        specs += linear(p + "self_attn.v_proj", kv_heads * head_dim, hidden)
        specs += linear(p + "self_attn.o_proj", hidden, heads * head_dim)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            specs += linear(q + "gate_proj", inter, hidden) + linear(q + "up_proj", inter, hidden) + \
                linear(q + "down_proj", hidden, inter)
    specs += [Spec("model.norm.weight", "BF16", (hidden,)), Spec("lm_head.weight", "BF16", (vocab, hidden))]
    if quant == "nvfp4":
        exclude = ["lm_head", "model.layers.*.mlp.gate"]
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": exclude}
        extra["hf_quant_config.json"] = json.dumps({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": exclude}})
    return config, specs, extra


def gpt_oss_specs(*, layers: int, hidden: int = 2880, inter: int = 2880, experts: int = 128, vocab: int = 201088,
                  heads: int = 64, kv_heads: int = 8, head_dim: int = 64) -> tuple[dict, list[Spec], dict[str, str]]:
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": hidden,
              "intermediate_size": inter, "num_local_experts": experts, "num_experts_per_tok": 4,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "vocab_size": vocab, "sliding_window": 128, "tie_word_embeddings": False,
              "layer_types": ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                  "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    specs = [Spec("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [Spec(p + "input_layernorm.weight", "BF16", (hidden,)),
                  Spec(p + "post_attention_layernorm.weight", "BF16", (hidden,)),
                  Spec(p + "self_attn.sinks", "BF16", (heads,)),
                  Spec(p + "mlp.router.weight", "BF16", (experts, hidden)), Spec(p + "mlp.router.bias", "BF16", (experts,))]
        for proj, (o, n) in (("q_proj", (heads * head_dim, hidden)), ("k_proj", (kv_heads * head_dim, hidden)),
                             ("v_proj", (kv_heads * head_dim, hidden)), ("o_proj", (hidden, heads * head_dim))):
            specs += [Spec(p + f"self_attn.{proj}.weight", "BF16", (o, n)), Spec(p + f"self_attn.{proj}.bias", "BF16", (o,))]
        q = p + "mlp.experts."
        specs += [Spec(q + "gate_up_proj_blocks", "U8", (experts, 2 * inter, hidden // 32, 16), "bytes"),
                  Spec(q + "gate_up_proj_scales", "U8", (experts, 2 * inter, hidden // 32), "e8m0"),
                  Spec(q + "gate_up_proj_bias", "BF16", (experts, 2 * inter)),
                  Spec(q + "down_proj_blocks", "U8", (experts, hidden, inter // 32, 16), "bytes"),
                  Spec(q + "down_proj_scales", "U8", (experts, hidden, inter // 32), "e8m0"),
                  Spec(q + "down_proj_bias", "BF16", (experts, hidden))]
    specs += [Spec("model.norm.weight", "BF16", (hidden,)), Spec("lm_head.weight", "BF16", (vocab, hidden))]
    return config, specs, {}


KINDS = {
    "bf16": (lambda layers: qwen3_moe_specs(layers=layers), "int4", 2),
    "mxfp4": (lambda layers: gpt_oss_specs(layers=layers), "fp4", 2),
    "nvfp4": (lambda layers: qwen3_moe_specs(layers=layers, quant="nvfp4"), "fp4", 6),
}


# ---------------------------------------------------------------- measuring

def evict(paths) -> None:
    """Drop files from the page cache (clean pages only, so sync first) for a cold measurement."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(paths, chunk: int = 16 << 20) -> tuple[int, float]:
    buf = bytearray(chunk)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def sequential_write(path: Path, nbytes: int, chunk: int = 16 << 20) -> float:
    """Buffered write of nbytes then fsync, as the converter writes; returns seconds."""
    buf = np.ones(chunk, dtype=np.uint8)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(memoryview(buf)[: min(chunk, left)])
        os.fsync(fh.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def tree_files(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.rglob("*")) if p.is_file()]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "?"
    except OSError:
        return "?"


def run_kind(kind: str, layers: int, work: Path, *, keep: bool) -> dict:
    from runtime.ftw.converter import convert

    make, codec, _ = KINDS[kind]
    config, specs, extra = make(layers)
    src, out = work / f"src-{kind}", work / f"out-{kind}"
    shutil.rmtree(src, ignore_errors=True)
    t0 = time.perf_counter()
    total = write_checkpoint(src, config, specs, extra_files=extra)
    write_s = time.perf_counter() - t0
    shards = sorted(src.glob("*.safetensors"))
    evict(shards)
    nread, read_s = sequential_read(shards)
    result = {"kind": kind, "codec": codec, "layers": layers, "source_gib": total / 2**30, "tensors": len(specs),
              "write_source_s": round(write_s, 2), "disk_read_gibps": nread / 2**30 / read_s}
    for mode in ("cold", "warm"):
        shutil.rmtree(out, ignore_errors=True)
        if mode == "cold":
            evict(shards)
        else:
            sequential_read(shards)            # now in the page cache (if RAM allows)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        convert(src, out, codec=codec)
        dt = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        result[f"convert_{mode}_s"] = round(dt, 2)
        result[f"convert_{mode}_gibps"] = total / 2**30 / dt
        # CPU seconds of all threads (user + kernel): what the converter itself costs, whatever the disk does
        result[f"convert_{mode}_cpu_s"] = round(cpu, 2)
        result[f"convert_{mode}_gib_per_cpu_s"] = total / 2**30 / cpu
    out_bytes = sum(p.stat().st_size for p in tree_files(out))
    result["output_gib"] = out_bytes / 2**30
    result["disk_write_gibps"] = min(out_bytes, 2 << 30) / 2**30 / sequential_write(work / "write-probe",
                                                                                   min(out_bytes, 2 << 30))
    from runtime.ftw.reader import FTWPackage
    from runtime.ftw.verify import verify

    t0 = time.perf_counter()
    pkg = FTWPackage.open(out)
    result["open_ms"] = round((time.perf_counter() - t0) * 1000, 2)
    t0 = time.perf_counter()
    pkg.experts.block(pkg.experts.layers[-1], pkg.experts.num_experts - 1)[:4096].sum()
    result["first_block_ms"] = round((time.perf_counter() - t0) * 1000, 2)
    t0 = time.perf_counter()
    ok = verify(out).ok
    result["verify_gibps"] = out_bytes / 2**30 / (time.perf_counter() - t0)
    assert ok, "the package does not verify"
    if not keep:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="scratch folder on the disk to measure")
    parser.add_argument("--json-dir", type=Path, required=True, help="folder for bench_convert.json")
    parser.add_argument("--kinds", default="bf16,mxfp4,nvfp4")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the kind's default, a few GB)")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints and packages")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for int4 (0: all cores)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))
    args.work.mkdir(parents=True, exist_ok=True)
    args.json_dir.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
              "torch_threads": torch.get_num_threads(),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus", "commit": git_commit(),
              "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
              "results": []}
    for kind in args.kinds.split(","):
        layers = args.layers or KINDS[kind][2]
        res = run_kind(kind, layers, args.work, keep=args.keep)
        res["load_average_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        report["results"].append(res)
        print(json.dumps(res), flush=True)
    (args.json_dir / "bench_convert.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
