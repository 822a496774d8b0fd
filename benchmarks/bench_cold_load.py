"""Cold load to first token of a full-size package, end to end (issue 10: <= 15 s for a 20 GB package from a warm
page cache; peak host RSS <= package + 2 GiB).

The lead's command on the GPU machine (package write ~1 min the first time, then two loads; < 8 minutes):

    python benchmarks/bench_cold_load.py --folder /tmp/ftw-cold --vram-budget 8 0 --out cold_load.json

(numba must be importable there -- the carried .site of benchmarks/device_final.sh: unpack it and put /tmp/site
first on PYTHONPATH; the measuring processes inherit it. `--repeat 2` adds a second launch per budget, with the
numba and Triton caches the first one filled: the first launch after a fresh checkout compiles the CPU kernel.)

This dev VM (2 cores, no GPU; a reduced size, same code paths but the CPU tier):

    python benchmarks/bench_cold_load.py --layers 2 --experts 16 --vocab 4096 --vram-budget 0 --out /tmp/cold.json

What it does:
1. Writes a synthetic FTW package of the qwen3-30b-a3b shape (48 layers, hidden 2048, 32/4 heads x 128, 128
   experts top-8, expert FFN 768, vocab 151,936; experts int4 group 128, dense bf16: ~18.6 GB; or with `--shape
   qwen3.6-35b-a3b` Qwen3.6-35B-A3B's: 40 layers, 30 of them Gated DeltaNet, 256 fp4 experts top-8 of width 512 and
   a shared expert, vocab 248,320 - whose GPU load warms fla-core's kernels, a phase of its own) through the FTW writer
   (`PackageWriter`: `.partial` folder, per-unit journal, fsync, manifest last, atomic rename), with the
   converter's layout and manifest (checksums included: `freetoken verify` accepts it). Weights are random but
   sane (std 0.02, norms 1): a 64 MiB pool of bf16 normals is tiled over the dense tensors and a few hundred MB of
   int4 expert blocks (`HostExpertStore.synthetic`) over the expert file. The tokenizer and chat template are
   the test fixtures' (a 384-token byte-level BPE, Qwen's template). A package already at `--folder` whose
   manifest is complete and was written for the same shape is reused, so a second run measures only the load.
2. Reads both data files once (nothing is dropped from the page cache: the target is "warm page cache").
3. For each `--vram-budget` (GiB; 0 = no cap), starts a fresh Python process that times `Engine.load(...)` -- the
   call `freetoken serve` makes, with serve's defaults (device auto: CUDA when present, context 32768, 8
   sequences) -- then the first token of a short chat (tokenize, prefill, sample) and three decode steps (the
   first records the CUDA graphs). Phases are timed by wrapping the functions that do them (package open, empty
   model, dense weights, q/k/v fusion, the expert tier with its planner probes, pinned copy, CPU-kernel compile
   and pool warm-up, tokenizer, chat template, graph recording), CUDA synchronised at each phase's end. Host RSS
   is sampled every 2 ms (PeakRSS) during the load and the first token; VRAM peaks come from torch's allocator.
4. Prints the phase table and the summary (against the targets), and writes everything to `--out` (JSON).
"""
from __future__ import annotations

import time

_T_PROCESS = time.perf_counter()        # before any heavy import: the child's "process start"

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GB, GiB, MiB = 1e9, 1 << 30, 1 << 20
TARGET_LOAD_TO_FIRST_TOKEN_S = 15.0      # issue 10
TARGET_RSS_OVER_PACKAGE = 2 * GiB        # issue 10: peak host RSS <= package + 2 GiB
DENSE_POOL_BYTES = 64 << 20              # random bf16 values tiled over every dense tensor
WRITE_CHUNK = 64 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")   # copied into the package
BESIDE_STEPS_AFTER = 8                  # --beside: the decoding conversation's steps timed after each prompt
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello, world! How are you today? Tell me about the weather in Paris."}]


# ---------------------------------------------------------------------------------------------- the package

@dataclass(frozen=True)
class PackageShape:
    """A Qwen3-MoE package; the defaults are Qwen3-30B-A3B's. `family` "qwen3_5_moe_text" is Qwen3.5/3.6-MoE's
    text model (Gated DeltaNet in 3 layers of 4, a shared expert): `QWEN36` below."""
    family: str = "qwen3_moe"
    codec: str = "int4"                   # of the experts
    linear_head_dim: int = 128            # Gated DeltaNet's key and value heads (qwen3_5_moe_text only)
    layers: int = 48
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    expert_width: int = 768
    dense_width: int = 6144               # only for mlp_only layers (none here); config.json carries it
    vocab: int = 151_936
    group: int = 128                      # int4 group size of the experts (fp4: its format's block, 32 for mxfp4)
    max_position: int = 40_960
    seed: int = 0
    expert_pool_mib: int = 256            # distinct random expert blocks, tiled over the expert file

    def config(self, *, bos: int | None, eos: int) -> dict:
        if self.family == "qwen3_5_moe_text":
            from runtime.experts.bench import CONFIGS     # Qwen3.6-35B-A3B's text config, at this shape's sizes
            return {**CONFIGS["qwen3.6-35b-a3b"], "vocab_size": self.vocab, "hidden_size": self.hidden,
                    "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                    "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                    "linear_num_key_heads": self.heads, "linear_num_value_heads": 2 * self.heads,
                    "linear_key_head_dim": self.linear_head_dim, "linear_value_head_dim": self.linear_head_dim,
                    "num_experts": self.experts, "num_experts_per_tok": self.top_k,
                    "moe_intermediate_size": self.expert_width, "shared_expert_intermediate_size": self.expert_width,
                    "max_position_embeddings": self.max_position, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                    "torch_dtype": "bfloat16", "bos_token_id": bos, "eos_token_id": eos}
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": self.vocab,
                "hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.dense_width, "moe_intermediate_size": self.expert_width,
                "num_experts": self.experts, "num_experts_per_tok": self.top_k, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": self.max_position,
                "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_scaling": None, "attention_bias": False,
                "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
                "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": bos, "eos_token_id": eos}


QWEN36 = PackageShape(family="qwen3_5_moe_text", codec="fp4", layers=40, heads=16, kv_heads=2, head_dim=256,
                      experts=256, expert_width=512, vocab=248_320, group=32, max_position=262_144)
SHAPES = {"qwen3-30b-a3b": PackageShape(), "qwen3.6-35b-a3b": QWEN36}


def dense_entries(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(unit, name, shape) of every dense tensor, in the converter's order (globals, then layer by layer; names
    sorted within a unit). The names and shapes are the engine's own model's parameters (Qwen3-MoE keeps the
    checkpoint's names), so the strict loader accepts exactly this set."""
    import torch

    from runtime.models.base import build_model

    with torch.device("meta"):
        model = build_model(config, experts=None)
    units: dict[str, list] = {"globals": []}
    units.update({f"layer.{i}": [] for i in range(int(config["num_hidden_layers"]))})
    for name, param in model.named_parameters():
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        units[f"layer.{m.group(1)}" if m else "globals"].append((name, tuple(param.shape)))
    return [(unit, name, shape) for unit, entries in units.items() for name, shape in sorted(entries)]


def _complete_manifest(folder: Path) -> dict | None:
    """The manifest of a complete package at `folder`, or None."""
    from runtime.ftw.reader import FTWError, FTWPackage

    try:
        return FTWPackage.open(folder).manifest
    except (FTWError, OSError, KeyError):
        return None


def write_package(folder: Path, shape: PackageShape, *, say=print) -> dict:
    """Write (or reuse) the synthetic package at `folder`. Returns {"path", "reused", "seconds", "nbytes"}."""
    import numpy as np
    import torch

    from runtime.experts.host_store import HostExpertStore
    from runtime.ftw.codecs import FP4_FORMATS
    from runtime.ftw.writer import (CHECKSUM, DENSE_FILE, EXPERTS_FILE, FORMAT_VERSION, PART_ALIGN, PackageWriter,
                                    align, block_digest, combine_digests, expert_block_parts)

    t0 = time.perf_counter()
    folder = Path(folder)
    existing = _complete_manifest(folder)
    if existing is not None and existing.get("source", {}).get("synthetic") == asdict(shape):
        nbytes = int(existing["dense"]["nbytes"]) + int(existing["experts"]["nbytes"])
        say(f"reusing the package at {folder} ({nbytes / GB:.2f} GB; its manifest is complete and of this shape)")
        return {"path": str(folder), "reused": True, "seconds": time.perf_counter() - t0, "nbytes": nbytes}

    # tokenizer first, into a scratch folder: its ids name the EOS tokens config.json and the manifest carry
    # (read back into memory, so the scratch folder is gone before anything can fail)
    with tempfile.TemporaryDirectory(prefix="cold-load-tok-") as scratch:
        ids = write_tokenizer(Path(scratch))
        tokenizer_files = {name: (Path(scratch) / name).read_bytes() for name in TOKENIZER_FILES
                           if (Path(scratch) / name).is_file()}
    if ids["vocab_size"] > shape.vocab:
        raise ValueError(f"--vocab {shape.vocab} is smaller than the fixture tokenizer's {ids['vocab_size']} tokens")
    config = shape.config(bos=ids["bos"], eos=ids["gen_eos"][0])

    # the layout, exactly as the converter plans it
    dense = []
    offset = 0
    for unit, name, tshape in dense_entries(config):
        nbytes = 2 * int(np.prod(tshape))
        dense.append((unit, name, tshape, offset, nbytes))
        offset = align(offset + nbytes, PART_ALIGN)
    dense_nbytes = offset
    fp4_format = "mxfp4" if shape.codec == "fp4" else ""          # (Qwen3.6's published fp4: blocks of 32)
    parts, block = expert_block_parts(codec=shape.codec, hidden=shape.hidden, intermediate=shape.expert_width,
                                      group_size=shape.group, fp4_format=fp4_format)
    layer_bytes = shape.experts * block
    experts_nbytes = shape.layers * layer_bytes
    experts_meta = {
        "file": EXPERTS_FILE, "nbytes": experts_nbytes, "codec": shape.codec,
        **({"group_size": shape.group} if shape.codec == "int4" else {}),
        "layers": list(range(shape.layers)), "num_experts": shape.experts, "hidden_size": shape.hidden,
        "intermediate_size": shape.expert_width, "activation": "silu", "has_bias": False, "block_nbytes": block,
        # (fp4: the converter's fields; mxfp4 has no per-matrix scale)
        **({"fp4_format": fp4_format, "block_size": FP4_FORMATS[fp4_format][0],
            "scale_format": FP4_FORMATS[fp4_format][1], "global_scale_op": None} if fp4_format else {}),
        "parts": [p.to_json() for p in parts],
        "layer_offsets": {str(i): i * layer_bytes for i in range(shape.layers)}}
    skeleton = {
        "format": "ftw", "format_version": FORMAT_VERSION, "checksum_algorithm": CHECKSUM, "model_type": shape.family,
        "config": config,
        "source": {"repo_id": None, "revision": None, "folder": f"synthetic-{shape.family}", "quantization": "none",
                   "quantization_spelling": None, "synthetic": asdict(shape)},
        "dense": {"file": DENSE_FILE, "nbytes": dense_nbytes,
                  "tensors": {name: {"dtype": "bfloat16", "shape": list(tshape), "offset": off, "nbytes": n,
                                     "source": name, "source_quantization": "float"}
                              for _, name, tshape, off, n in dense}},
        "experts": experts_meta}
    fingerprint = hashlib.sha256(json.dumps(skeleton, sort_keys=True).encode()).hexdigest()
    total = dense_nbytes + experts_nbytes
    say(f"writing {folder}: dense {dense_nbytes / GB:.2f} GB ({len(dense)} tensors), experts "
        f"{experts_nbytes / GB:.2f} GB ({shape.layers} layers x {shape.experts} blocks of {block} B)")

    # random material: bf16 normals (std 0.02) for the dense tensors, sane int4 blocks for the experts
    gen = torch.Generator().manual_seed(shape.seed)
    dense_pool = (torch.randn(DENSE_POOL_BYTES // 2, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8)
    dense_pool = dense_pool.numpy()
    ones = torch.ones(max([int(np.prod(s)) for _, n, s, _, _ in dense if n.endswith("norm.weight")] + [1]),
                      dtype=torch.bfloat16).view(torch.uint8).numpy()
    pool_blocks = max(1, min(shape.layers * shape.experts, (shape.expert_pool_mib * MiB) // block))
    pool = HostExpertStore.synthetic(layers=1, num_experts=pool_blocks, hidden=shape.hidden,
                                     intermediate=shape.expert_width, codec=shape.codec, group=shape.group,
                                     fp4_format=fp4_format or "mxfp4",
                                     seed=shape.seed, weight_std=0.02).layer_buffer(0)        # [P, block]
    with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1))) as hashers:
        pool_digests = list(hashers.map(block_digest, pool))

    writer = PackageWriter(folder, fingerprint=fingerprint,
                           file_sizes={DENSE_FILE: dense_nbytes, EXPERTS_FILE: experts_nbytes})
    try:
        if writer.complete:              # killed between the manifest and the rename: only the rename is left
            writer.finish(None, overwrite=True)
            return {"path": str(folder), "reused": False, "seconds": time.perf_counter() - t0, "nbytes": total}
        dense_sums = {k: v for r in writer.done.values() for k, v in r.get("dense", {}).items()}
        layer_sums = {k: v for r in writer.done.values() for k, v in r.get("experts", {}).items()}
        layer_buf = np.empty((shape.experts, block), dtype=np.uint8)
        written = 0
        units = ["globals"] + [f"layer.{i}" for i in range(shape.layers)]
        for k, unit in enumerate(units):
            if unit in writer.done:
                continue
            record = {"dense": {}, "experts": {}}
            for j, (u, name, _, off, n) in enumerate(dense):
                if u != unit:
                    continue
                digest = hashlib.new(CHECKSUM)
                src = ones if name.endswith("norm.weight") else dense_pool
                start = 0 if src is ones else (j * 7919 * 2) % len(src)   # rotated: tensors differ
                done = 0
                while done < n:
                    piece = src[start:start + min(WRITE_CHUNK, n - done)]
                    writer.write(DENSE_FILE, off + done, piece, tensor=name)
                    digest.update(piece)
                    done += len(piece)
                    start = (start + len(piece)) % len(src)
                record["dense"][name] = digest.hexdigest()
                written += n
            if unit != "globals":
                layer = int(unit.split(".")[1])
                order = (np.arange(shape.experts) + 37 * layer) % pool_blocks     # [E] pool block of each expert
                np.take(pool, order, axis=0, out=layer_buf)
                writer.write(EXPERTS_FILE, layer * layer_bytes, layer_buf, tensor=f"layer {layer} experts")
                record["experts"][str(layer)] = combine_digests(pool_digests[i] for i in order)
                written += layer_bytes
            writer.commit_unit(unit, record)
            dense_sums.update(record["dense"])
            layer_sums.update(record["experts"])
            if k % 8 == 0 or k == len(units) - 1:
                rate = written / max(1e-9, time.perf_counter() - t0) / GB
                say(f"  {unit}: {written / GB:.1f} GB written ({rate:.2f} GB/s)")
        for name, data in tokenizer_files.items():
            (writer.partial / name).write_bytes(data)
        manifest = json.loads(json.dumps(skeleton))
        for name, digest in dense_sums.items():
            manifest["dense"]["tensors"][name]["checksum"] = digest
        manifest["experts"]["layer_checksums"] = layer_sums
        manifest["tokenizer_files"] = list(tokenizer_files)
        manifest["generation_config"] = {"eos_token_id": ids["gen_eos"], "pad_token_id": ids["pad"]}
        writer.finish(manifest, overwrite=True)
    finally:
        writer.close()
    seconds = time.perf_counter() - t0
    say(f"package written in {seconds:.1f} s ({total / GB:.2f} GB, {total / seconds / GB:.2f} GB/s)")
    return {"path": str(folder), "reused": False, "seconds": seconds, "nbytes": total}


def write_tokenizer(folder: Path) -> dict:
    """The test fixtures' tokenizer (a 384-token byte-level BPE) with Qwen's special tokens and chat template, as
    tests/fixtures/tokenizer.py saves it (through transformers); written by hand into the same three files where
    transformers is not installed. Returns the token roles as ids (bos, eos, pad, gen_eos, vocab_size)."""
    from tests.fixtures import tokenizer as fixtures

    try:
        return fixtures.save_tokenizer("qwen", "qwen3.jinja", folder)
    except ImportError:
        pass
    from resources import resource_path

    tok = fixtures.train_tokenizer("qwen")
    roles = fixtures.FAMILY_ROLES["qwen"]
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": roles["bos"], "eos_token": roles["eos"], "pad_token": roles["pad"],
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1), encoding="utf-8")
    template = resource_path("chat_templates", "qwen3.jinja").read_text(encoding="utf-8")
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    ids = {name: (tok.token_to_id(t) if t else None) for name, t in roles.items() if name != "gen_eos"}
    ids["gen_eos"] = [tok.token_to_id(t) for t in roles["gen_eos"]]
    ids["vocab_size"] = tok.get_vocab_size()
    return ids


def warm_page_cache(folder: Path) -> dict:
    """Read every data file of the package once (into a small reused buffer): the page cache is then warm."""
    t0 = time.perf_counter()
    nbytes = 0
    buf = bytearray(WRITE_CHUNK)
    for name in ("dense.bin", "experts.bin"):
        with open(Path(folder) / name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                nbytes += n
    seconds = time.perf_counter() - t0
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / max(seconds, 1e-9) / GB}


# ---------------------------------------------------------------------------------------------- phase timing

@dataclass
class Phase:
    label: str
    depth: int
    start: float            # seconds from the load's start
    end: float = 0.0


class PhaseTimer:
    """Wraps named functions so every call is recorded as a phase (nested calls nest). The wrap list is data:
    a function renamed since is reported as not found, not a crash."""

    def __init__(self, *, sync=None):
        self.t0 = time.perf_counter()
        self.phases: list[Phase] = []
        self.missing: list[str] = []
        self._depth = 0
        self._sync = sync or (lambda: None)
        self._undo: list = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wrap(self, label: str, owner, attr: str, *, first_call_only: bool = False) -> None:
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if raw is None:
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        fn = raw.__func__ if kind else raw
        timer, calls = self, [0]

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            calls[0] += 1
            if first_call_only and calls[0] > 1:
                return fn(*args, **kwargs)
            phase = Phase(label, timer._depth, timer.now())
            timer.phases.append(phase)
            timer._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                timer._sync()
                timer._depth -= 1
                phase.end = timer.now()

        setattr(owner, attr, kind(timed) if kind else timed)
        self._undo.append((owner, attr, raw))

    def restore(self) -> None:
        for owner, attr, raw in reversed(self._undo):
            setattr(owner, attr, raw)
        self._undo.clear()

    def summary(self) -> list[dict]:
        """Phases merged by label (calls summed), in the order they first started."""
        merged: dict[str, dict] = {}
        for p in self.phases:
            row = merged.setdefault(p.label, {"phase": p.label, "depth": p.depth, "seconds": 0.0, "calls": 0,
                                              "first_start": p.start})
            row["seconds"] += p.end - p.start
            row["calls"] += 1
        return sorted(merged.values(), key=lambda r: r["first_start"])


def instrument(timer: PhaseTimer) -> None:
    """The load path's phases (see the module docstring)."""
    import runtime.engine as engine
    from runtime.decode_graph import DecodeGraphs
    from runtime.experts import hybrid, planner
    from runtime.experts.cpu_executor import CpuExecutor
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.resident import ResidentExperts
    from runtime.ftw.reader import FTWPackage
    from runtime.models.base import CausalLM
    from runtime.text.chat_template import ChatTemplate
    from runtime.text.tokenizer import Tokenizer

    timer.wrap("open package (manifest, file sizes)", FTWPackage, "open")
    timer.wrap("empty model on the device", engine, "build_empty_model")
    timer.wrap("dense weights to the device", engine, "load_dense_weights")
    timer.wrap("fuse q/k/v projections", CausalLM, "fuse_projections")
    timer.wrap("expert tier (hybrid_experts_factory)", hybrid, "hybrid_experts_factory")
    timer.wrap("expert tier (resident_experts_factory)", engine, "resident_experts_factory")
    timer.wrap("planner probes (VRAM, RAM, H2D and CPU bandwidth)", planner.Hardware, "probe")
    timer.wrap("experts copied into host memory (pinned_copy)", HostExpertStore, "pinned_copy")
    timer.wrap("experts dequantized onto the device (resident)", ResidentExperts, "from_store")
    timer.wrap("hybrid tier built (pool, table, CPU executor)", hybrid.HybridExperts, "__init__")
    timer.wrap("CPU expert kernel first call (numba compile or cache load)", CpuExecutor, "run", first_call_only=True)
    timer.wrap("VRAM pool warm-up (hot set copied in)", hybrid.HybridExperts, "_warm_hot_set")
    timer.wrap("VRAM pool's free slots filled", hybrid.HybridExperts, "_fill_free_slots")
    timer.wrap("tokenizer", Tokenizer, "from_dir")
    timer.wrap("chat template", ChatTemplate, "from_dir")
    timer.wrap("linear-attention GPU kernels warmed (fla-core)", engine, "_warm_up_gpu_kernels")
    timer.wrap("decode-graph runner set up", engine, "_decode_graphs")
    timer.wrap("CUDA graph recording", DecodeGraphs, "_record")


# ---------------------------------------------------------------------------------------------- the child

def run_child(args) -> int:
    """One measurement in this (fresh) process: Engine.load, then the first token and three decode steps."""
    import faulthandler
    import signal

    import torch

    # a run cut short by `timeout` (it signals the whole process group) leaves every thread's stack in the output:
    # where a stuck step waits, not only that it did
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    from runtime.engine import Engine, SamplingParams
    from runtime.experts.stats import PeakRSS, host_rss

    t_imported = time.perf_counter()
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    from runtime.models import gated_deltanet
    if args.gdn_piece is not None:
        gated_deltanet.PREFILL_PIECE_TOKENS = args.gdn_piece
    if args.graph_prompt_tails:          # a prompt's lone last token through the decode graphs (before session 33)
        import runtime.engine as engine_module
        engine_module.GRAPH_PROMPT_TAILS = True
    if args.arena != "registered":       # the prefix cache's host memory as earlier sessions' engines made it
        import runtime.engine as engine_module
        engine_module.registered_slab = lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True)
        if args.arena == "hostalloc":
            Engine._lock_ahead = lambda self, seq, hit: None
    sync = torch.cuda.synchronize if cuda else None
    timer = PhaseTimer(sync=(lambda: torch.cuda.synchronize() if torch.cuda.is_initialized() else None)
                       if cuda else None)
    # the engine's own log lines (the plan, the pinned copy, warnings), stamped with seconds since the load began
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("    [%(since_load)7.2f s] %(name)s: %(message)s"))
    handler.addFilter(lambda record: setattr(record, "since_load", timer.now()) or True)
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    package = Path(args.package)
    # serve's rule: the context setting, but never past what the model supports
    max_position = json.loads((package / "manifest.json").read_text())["config"].get("max_position_embeddings")
    context = min(args.context, int(max_position)) if max_position else args.context
    instrument(timer)
    package_bytes = sum((package / n).stat().st_size for n in ("dense.bin", "experts.bin"))
    budget = int(args.budget_gib * GiB) if args.budget_gib > 0 else None
    rss_start = host_rss()
    result: dict = {"budget_gib": args.budget_gib, "package_bytes": package_bytes, "rss_start": rss_start,
                    "gdn_piece": gated_deltanet.PREFILL_PIECE_TOKENS, "arena": args.arena,
                    "graph_prompt_tails": args.graph_prompt_tails, "imports_s": t_imported - _T_PROCESS}
    factory = None
    if args.tier != "default":
        from runtime.engine import resident_experts_factory
        from runtime.experts.hybrid import hybrid_experts_factory
        factory = {"hybrid": hybrid_experts_factory, "resident": resident_experts_factory}[args.tier]
    timer.t0 = time.perf_counter()
    with PeakRSS() as rss_load:
        engine = Engine.load(package, device=args.device, vram_budget=budget, context_length=context,
                             max_batch=args.max_batch, experts_factory=factory)
        if sync:
            sync()
    load_s = timer.now()
    result.update(load_s=load_s, rss_peak_load=rss_load.peak, rss_after_load=rss_load.end,
                  plan={k: v for k, v in engine.plan.items() if k != "experts"},
                  experts_plan=engine.plan.get("experts"))
    if cuda:
        result.update(vram_peak_allocated_load=torch.cuda.max_memory_allocated(),
                      vram_peak_reserved_load=torch.cuda.max_memory_reserved(),
                      vram_used_after_load=_device_used())
        torch.cuda.reset_peak_memory_stats()
    load_seconds = getattr(getattr(engine.model, "experts", None), "store", None)
    load_seconds = getattr(load_seconds, "load_seconds", None)
    if load_seconds:
        result["pinned_copy_seconds"] = load_seconds

    greedy = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 1, stop_token_ids=())
    steps = []
    with PeakRSS() as rss_token:
        t = timer.now()
        if engine.chat_template is not None:
            prompt = engine.tokenizer.encode(engine.chat_template.render(CHAT, add_generation_prompt=True))
        else:
            prompt = engine.tokenizer.encode(CHAT[-1]["content"])
        timer.phases.append(Phase("prompt rendered and tokenized", 0, t, timer.now()))
        rid = engine.add_request(prompt, greedy)
        tokens = 0
        # --python-profile without long prompts: the slowest decode step after the first recording (a long answer
        # crossing a graph bucket: what, by name, holds it)
        profile_decode = args.python_profile if not args.long_prompts else None
        slowest = None
        while tokens < args.decode_steps + 1:
            recorded = _record_seconds(engine)
            py_prof = cProfile.Profile() if profile_decode and tokens >= 2 else None
            t = timer.now()
            with py_prof or contextlib.nullcontext():
                events = engine.step()
                if sync:
                    sync()
            if py_prof is not None and (slowest is None or timer.now() - t > slowest[0]):
                slowest = (timer.now() - t, py_prof)
            got = sum(1 for e in events if e.request_id == rid and e.token_id is not None)
            label = ("first token (the step that returns it + sample)" if tokens == 0 else
                     "first decode step (eager + CUDA graph recording)" if tokens == 1 else "decode step (steady)")
            if got:
                timer.phases.append(Phase(label, 0, t, timer.now()))
                steps.append({"step": label, "seconds": timer.now() - t,
                              "record_seconds": _record_seconds(engine) - recorded})
            else:
                timer.phases.append(Phase("prefill step (no token yet)", 0, t, timer.now()))
            tokens += got
            if any(e.finished for e in events if e.request_id == rid):
                break
    if slowest is not None:
        _write_profile(profile_decode, slowest, "slowest decode step")
    first_token_s = next(p.end for p in timer.phases if p.label.startswith("first token"))
    timer.restore()
    result.update(prompt_tokens=len(prompt), first_token_s=first_token_s, steps=steps,
                  load_to_first_token_s=first_token_s, process_to_first_token_s=timer.t0 - _T_PROCESS + first_token_s,
                  rss_peak_first_token=rss_token.peak, rss_peak=max(rss_load.peak, rss_token.peak),
                  phases=timer.summary(), not_found=timer.missing, device=str(engine.device),
                  dtype=str(engine.dtype).replace("torch.", ""),
                  gpu=torch.cuda.get_device_name() if cuda else None, torch=torch.__version__)
    if cuda:
        result["vram_peak_allocated_first_token"] = torch.cuda.max_memory_allocated()
        result["vram_peak_reserved"] = max(result["vram_peak_reserved_load"], torch.cuda.max_memory_reserved())
        result["vram_used_after_first_token"] = _device_used()
    # more new conversations after the first one ends: does each pay a decode graph's recording at its second token
    # (the graph key holds its KV buffers' addresses), or do they land where the last one's were
    result["new_chats"] = [new_chat(engine, salted_prompt(engine, len(prompt), salt=200 + i), cuda,
                                    args.new_chat_steps if args.new_chat_steps is not None else args.decode_steps,
                                    args.profile_new_chat if i == 0 else None)
                           for i in range(args.new_chats)]
    prompts = [salted_prompt(engine, n, salt=i) for i, n in enumerate(args.long_prompts)]
    for _ in range(args.resend if prompts else 0):
        # an agent's next turn: the last conversation resent with `--resend-tokens` new tokens at its end
        prompts.append(prompts[-1] + salted_prompt(engine, args.resend_tokens, salt=len(prompts)))
    beside = None
    if args.beside and prompts:
        # a conversation decoding while the long prompts arrive: what their prefill, stores and the arena's
        # locking ahead cost a user already reading an answer (its gaps between tokens)
        beside = engine.add_request(salted_prompt(engine, 64, salt=99),
                                    SamplingParams(temperature=0.0, max_tokens=1 << 20, stop_token_ids=()))
        for _ in range(4):                  # its prefill and first steps (and CUDA graph recording) out of the way
            engine.step()
    result["long_prompts"] = []
    for i, ids in enumerate(prompts):
        profile = args.profile_tail if i == len(prompts) - 1 else None
        python_profile = args.python_profile if i == 0 else None
        row = long_prompt(engine, ids, cuda, beside=beside, profile_tail=profile, python_profile=python_profile)
        result["long_prompts"].append(row)
        print(f"    prompt of {row['tokens']:,} tokens: first token in {row['seconds']:.2f} s", flush=True)
    if beside is not None:
        engine.cancel(beside)
    result["expert_stats"] = engine.stats()["experts"]      # the tier's totals: what each side did
    Path(args.child_out).write_text(json.dumps(result, indent=1, default=str))
    return 0


def _timed_step(engine, cuda: bool) -> tuple[list, float]:
    """One engine step, its GPU work finished: (its events, its seconds)."""
    import torch

    t = time.perf_counter()
    events = engine.step()
    if cuda:
        torch.cuda.synchronize()
    return events, round(time.perf_counter() - t, 4)


def _step_profiler(cuda: bool):
    """torch.profiler over one engine step (host ops, and CUDA kernels on the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


SYNC_WARNING = "called a synchronizing CUDA operation"   # torch's warning under set_sync_debug_mode("warn")
SITE_ROOT = str(ROOT / "runtime")                        # the frames that name a wait's call site: the engine's


class SyncSites:
    """Where steps wait for the GPU, by call site (--profile-tail): under torch.cuda.set_sync_debug_mode("warn")
    torch warns at every synchronizing call (an item(), a copy to the host, a nonzero); each such warning is counted
    by its innermost frames in runtime/ (s34j: 28 stream syncs in qwen3.6's lone-token step, sites unknown). Without
    CUDA torch has no such mode: nothing is counted."""

    def __init__(self, cuda: bool):
        self.cuda, self.sites = cuda, collections.Counter()
        self._catch = warnings.catch_warnings()

    def __enter__(self):
        self._catch.__enter__()                  # (restores the filters and showwarning on exit)
        warnings.simplefilter("always")
        self._show, warnings.showwarning = warnings.showwarning, self._seen
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode("default")
        return self._catch.__exit__(*exc)

    def _seen(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(SITE_ROOT)]
        self.sites[" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(ours[-3:]))
                   or "(no frame in runtime/)"] += 1
        return None

    def table(self) -> str:
        if not self.cuda:
            return "host waits for the GPU by call site: not counted (no CUDA here)\n"
        rows = [f"| {n} | {site} |" for site, n in self.sites.most_common()]
        return ("host waits for the GPU by call site (torch.cuda.set_sync_debug_mode), innermost frame first\n"
                "| waits | where |\n|---|---|\n" + "\n".join(rows or ["| 0 | - |"]) + "\n")


def salted_prompt(engine, tokens: int, *, salt: int) -> list[int]:
    """`tokens` token ids; each salt its own first token, so no prompt is a prefix of another or of the chat's."""
    vocab = engine.tokenizer.vocab_size
    return [(7919 * i + 13 + 101 * salt) % max(2, min(vocab, 4096) - 2) + 1 for i in range(tokens)]


def new_chat(engine, ids: list[int], cuda: bool, decode_steps: int, python_profile: str | None = None) -> dict:
    """A new conversation of `decode_steps` + 1 tokens once the engine is idle: the seconds to each of its tokens
    (from the last one), and the decode graphs recorded on the way. With `python_profile` the steps up to its first
    token run under one cProfile, written there by cumulative time."""
    from runtime.engine import SamplingParams

    before = engine.stats()
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, stop_token_ids=()))
    token_seconds, waited, done = [], 0.0, False
    py_prof = cProfile.Profile() if python_profile else None
    while not done:
        profiled = py_prof is not None and not token_seconds          # the steps up to the first token
        with py_prof if profiled else contextlib.nullcontext():
            events, took = _timed_step(engine, cuda)
        waited += took
        if any(e.token_id is not None for e in events if e.request_id == rid):
            if profiled:
                _write_profile(python_profile, (waited, py_prof), "a new conversation's steps to its first token")
            token_seconds.append(round(waited, 4))
            waited = 0.0
        done = any(e.finished for e in events if e.request_id == rid)
    result = engine.result(rid)
    return {"tokens": len(ids), "token_seconds": token_seconds, "error": result and result.error,
            "graph_records": None, "graph_record_seconds": 0.0, **_graph_records(before, engine.stats())}


def _graph_records(before: dict, after: dict) -> dict:
    """The decode graphs recorded between two `engine.stats()` and their seconds ({} for an engine without)."""
    graphs, was = after.get("decode_graphs") or {}, before.get("decode_graphs") or {}
    if not graphs:
        return {}
    return {"graph_records": graphs["captures"] - was.get("captures", 0),
            "graph_record_seconds": graphs["record_seconds"] - was.get("record_seconds", 0.0)}


def _record_seconds(engine) -> float:
    """Host seconds the engine's decode graphs have spent recording so far (0 without graphs)."""
    graphs = getattr(engine, "graphs", None)          # (its counters, not engine.stats(): read at every step)
    return graphs.counters["record_seconds"] if graphs is not None else 0.0


def _write_profile(path: str, timed: tuple, what: str) -> None:
    """Python's view of timed steps (seconds, cProfile) by cumulative time, headed "`what` of N s": first-time work
    (a compile, a plan) shows by name."""
    text = io.StringIO()
    pstats.Stats(timed[1], stream=text).sort_stats("cumulative").print_stats(45)
    Path(path).write_text(f"{what} of {timed[0]:.4f} s (cProfile)\n{text.getvalue()}")


def long_prompt(engine, ids: list[int], cuda: bool, *, beside: str | None = None,
                profile_tail: str | None = None, python_profile: str | None = None) -> dict:
    """A prompt to the loaded engine, to its first token: the seconds, and the VRAM it took at its peak - the
    question an 8 GB card asks of the plan (the planner reserves a prefill chunk's activations by a rule of thumb;
    the bench's own prefill rows plan a shorter context than their prompts)."""
    import torch

    from runtime.engine import SamplingParams

    tokens = len(ids)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = engine.stats()
    stored_before = before["prefix_cache"]["store_seconds"]
    t0 = time.perf_counter()
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, stop_token_ids=()))
    done, steps = False, []        # each step's seconds: where a prompt's time goes (its chunks, its last token)
    slowest = None                  # --python-profile: the slowest step's (seconds, cProfile)
    while not done:
        prof = _step_profiler(cuda) if profile_tail else contextlib.nullcontext()
        waits = SyncSites(cuda) if profile_tail else contextlib.nullcontext()
        py_prof = cProfile.Profile() if python_profile else None
        with prof, waits, (py_prof or contextlib.nullcontext()):
            events, took = _timed_step(engine, cuda)
        steps.append(took)
        if py_prof is not None and (slowest is None or took > slowest[0]):
            slowest = (took, py_prof)
        done = any(e.finished or e.token_id is not None for e in events if e.request_id == rid)
    seconds = time.perf_counter() - t0
    if profile_tail:                # the prompt's last step (its lone last token when the model pauses before it)
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70)
        Path(profile_tail).write_text(f"step of {steps[-1]:.4f} s (profiled)\n{table}\n{waits.table()}")
    if slowest is not None:
        _write_profile(python_profile, slowest, "slowest step")
    # the decoding conversation's steps once the prompt is done: does any locking linger past it?
    after = [_timed_step(engine, cuda)[1] for _ in range(BESIDE_STEPS_AFTER if beside else 0)]
    result = engine.result(rid)                 # max_tokens=1: finished with its first token
    stats = engine.stats()
    prefix = stats["prefix_cache"]
    row = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "error": result and result.error,
           "cached_tokens": result.cached_tokens if result else None, "step_seconds": steps,
           # copies into the prefix cache's host memory inside those steps: a linear-attention prompt's snapshot
           # one token before its end (inside its TTFT), and - max_tokens being 1 here - the finished request's
           "prefix_store_seconds": prefix["store_seconds"] - stored_before, "host_arena": prefix.get("host_arena")}
    # decode steps recorded inside this prompt's steps (its last token when it goes alone) and after
    row.update(_graph_records(before, stats))
    if beside:
        row["beside_decode_after_seconds"] = after
    if cuda:
        row.update(vram_peak_allocated=torch.cuda.max_memory_allocated(),
                   vram_peak_reserved=torch.cuda.max_memory_reserved(), vram_used=_device_used())
    return row


def _device_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


# ---------------------------------------------------------------------------------------------- the report

def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def print_report(rows: list[dict]) -> None:
    for r in rows:
        budget = f"{r['budget_gib']:g} GiB" if r["budget_gib"] > 0 else "unlimited"
        plan = r.get("experts_plan") or {}
        print(f"\n== VRAM budget {budget}, run {r.get('run', 1)}: device {r['device']} ({r.get('gpu') or 'no GPU'}), "
              f"{r['dtype']}, "
              f"backend {r['plan'].get('backend')}, slots {plan.get('slots', '-')} of {plan.get('slot_total', '-')}")
        print(f"{'phase':<64} {'s':>8} {'calls':>6}")
        for p in r["phases"]:
            print(f"{'  ' * p['depth'] + p['phase']:<64} {p['seconds']:>8.2f} {p['calls']:>6}")
        top = sum(p["seconds"] for p in r["phases"] if p["depth"] == 0
                  and p["first_start"] < r["load_s"])
        print(f"{'(load: rest, untimed: model glue, state pool, plan)':<64} {r['load_s'] - top:>8.2f}")
        if r.get("pinned_copy_seconds"):
            ls = r["pinned_copy_seconds"]
            print(f"  pinned copy: allocate {ls['allocate']:.2f} s, copy {ls['copy']:.2f} s ({ls['method']}, "
                  f"{ls['threads']} threads), pin {ls['pin']:.2f} s, pinned={ls['pinned']}")
        if r["not_found"]:
            print(f"  (not timed, renamed since this benchmark was written: {', '.join(r['not_found'])})")
    print("\n| VRAM budget | run | backend | python + imports s | Engine.load s | first token s "
          "| load -> first token s | target | peak RSS GiB | package GiB | RSS - package GiB (target <= 2) | RSS after load GiB "
          "| peak VRAM GiB (torch reserved) | device used after load GiB |")
    print("|" + "---|" * 14)
    for r in rows:
        over = r["rss_peak"] - r["package_bytes"]
        ok = "ok" if r["load_to_first_token_s"] <= TARGET_LOAD_TO_FIRST_TOKEN_S else "MISSED"
        print(f"| {r['budget_gib']:g} | {r.get('run', 1)} | {r['plan'].get('backend')} | {r['imports_s']:.2f} "
              f"| {r['load_s']:.2f} | {r['first_token_s'] - r['load_s']:.2f} | {r['load_to_first_token_s']:.2f} | <= 15 s {ok} "
              f"| {_gib(r['rss_peak'])} | {_gib(r['package_bytes'])} | {over / GiB:+.2f} "
              f"{'ok' if over <= TARGET_RSS_OVER_PACKAGE else 'MISSED'} | {_gib(r['rss_after_load'])} "
              f"| {_gib(r.get('vram_peak_reserved'))} | {_gib(r.get('vram_used_after_load'))} |")
    chat_rows = [(r, i, c) for r in rows for i, c in enumerate(r.get("new_chats", []), start=2)]
    if chat_rows:
        print("\n| VRAM budget | run | conversation | prompt tokens | first token s | second token s | later tokens s "
              "| decode graphs recorded (s) | error |")
        print("|" + "---|" * 9)
        for r, i, c in chat_rows:
            ts = c["token_seconds"]
            records = "-" if c["graph_records"] is None else f"{c['graph_records']} ({c['graph_record_seconds']:.3f})"
            print(f"| {r['budget_gib']:g} | {r.get('run', 1)} | {i} | {c['tokens']} | {ts[0]:.3f} "
                  f"| {ts[1] if len(ts) > 1 else float('nan'):.3f} | {' '.join(f'{x:.3f}' for x in ts[2:]) or '-'} "
                  f"| {records} | {c['error'] or '-'} |")
    long_rows = [(r, p) for r in rows for p in r.get("long_prompts", [])]
    if long_rows:
        print("\n| VRAM budget | run | plan's VRAM GiB | prefill chunk | linear-attention piece | prompt tokens | s to first token | tok/s "
              "| peak allocated GiB | peak reserved GiB | device used GiB | from the prefix cache | error | engine steps s "
              "| of which copies to the prefix cache s | prefix cache's page-locked GiB (arena) "
              "| decode graphs recorded (s) | decoding beside: steps after, median / max s |")
        print("|" + "---|" * 18)
        for r, p in long_rows:
            planner = (r.get("experts_plan") or {}).get("planner") or r.get("experts_plan") or {}
            print(f"| {r['budget_gib']:g} | {r.get('run', 1)} | {_gib(planner.get('vram_planned'))} "
                  f"| {r['plan'].get('prefill_chunk', '-')} | {r.get('gdn_piece') or 'whole chunk'} | {p['tokens']:,} | {p['seconds']:.2f} | {p['tok_s']:,.0f} "
                  f"| {_gib(p.get('vram_peak_allocated'))} | {_gib(p.get('vram_peak_reserved'))} "
                  f"| {_gib(p.get('vram_used'))} | {p.get('cached_tokens') or 0:,} | {p['error'] or '-'} "
                  f"| {' + '.join(f'{x:.3f}' for x in p.get('step_seconds', []))} "
                  f"| {p.get('prefix_store_seconds', 0.0):.3f} | {_gib((p.get('host_arena') or {}).get('pinned_bytes'))} "
                  f"| {p.get('graph_records', '-')} ({p.get('graph_record_seconds', 0.0):.3f}) "
                  f"| {_beside(p.get('beside_decode_after_seconds'))} |")


def _beside(after: list[float] | None) -> str:
    if not after:
        return "-"
    return f"{statistics.median(after):.4f} / {max(after):.4f}"


# ---------------------------------------------------------------------------------------------- main

def parse_args(argv):
    d = PackageShape()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "freetoken-cold-load",
                    help="where the package is written (reused when complete and of the same shape)")
    ap.add_argument("--vram-budget", type=float, nargs="+", default=[8.0, 0.0], metavar="GIB",
                    help="VRAM budgets to load at, in GiB; 0 = no cap (default: 8 0)")
    ap.add_argument("--out", help="write every figure here (JSON; a folder: cold_load.json inside it)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="as `freetoken serve --device`")
    ap.add_argument("--context", type=int, default=32768, help="context length (serve's default: 32768)")
    ap.add_argument("--max-batch", type=int, default=8, help="sequences (serve's default: 8)")
    ap.add_argument("--tier", default="default", choices=["default", "hybrid", "resident"],
                    help="expert tier: the engine's default for the device (what serve does), or forced")
    ap.add_argument("--decode-steps", type=int, default=3, help="decode steps timed after the first token")
    ap.add_argument("--new-chats", type=int, default=0, metavar="N",
                    help="then N more new conversations like the first (same prompt length, --decode-steps + 1 "
                         "tokens each): their second token's wait, and the decode graphs each records")
    ap.add_argument("--long-prompts", type=int, nargs="*", default=[], metavar="TOKENS",
                    help="then prompts of these lengths to their first token, each with its VRAM peak")
    ap.add_argument("--resend", type=int, default=0, metavar="N",
                    help="then N agent turns: the last long prompt resent with --resend-tokens new tokens, each time")
    ap.add_argument("--resend-tokens", type=int, default=200, metavar="TOKENS")
    ap.add_argument("--gdn-piece", type=int, default=None, metavar="TOKENS",
                    help="linear-attention layers prefill in pieces of this many tokens (0: the whole chunk; an A/B "
                         "of models/gated_deltanet.py's PREFILL_PIECE_TOKENS)")
    ap.add_argument("--arena", default="registered", choices=["registered", "hostalloc-ahead", "hostalloc"],
                    help="the prefix cache's host memory: the engine's (slabs registered in place, locked ahead on "
                         "another thread), cudaHostAlloc'd slabs locked ahead (s34a), or locked inside the store "
                         "(s33b)")
    ap.add_argument("--graph-prompt-tails", action="store_true",
                    help="a prompt's lone last token through the decode graphs, recording there (the A/B of "
                         "engine.GRAPH_PROMPT_TAILS; the engine runs it eagerly)")
    ap.add_argument("--beside", action="store_true",
                    help="keep one conversation decoding while the long prompts run: its gaps between tokens "
                         "inside their steps, and its steps after each")
    ap.add_argument("--profile-tail", metavar="FILE",
                    help="profile the last prompt's steps (torch.profiler, CPU and CUDA) and write the table of the "
                         "last one - a prompt's final step - to FILE: where a lone-token step's time goes; on a "
                         "GPU also its waits for the GPU, by call site")
    ap.add_argument("--python-profile", metavar="FILE",
                    help="profile the first long prompt's steps (without --long-prompts: the first conversation's "
                         "decode steps after its first recording) with cProfile and write the slowest one's "
                         "functions by cumulative time to FILE: first-time work inside a step (a compile) by name")
    ap.add_argument("--new-chat-steps", type=int, metavar="N",
                    help="decode steps of each --new-chats conversation (default: --decode-steps)")
    ap.add_argument("--profile-new-chat", metavar="FILE",
                    help="with --new-chats: the second conversation's steps up to its first token (its whole "
                         "TTFT) under cProfile, by cumulative time to FILE")
    ap.add_argument("--repeat", type=int, default=1,
                    help="fresh processes per budget (the first may compile numba/Triton kernels into their caches)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES),
                    help="the package's model (qwen3.6: fp4 experts, linear attention; ~21 GB)")
    ap.add_argument("--layers", type=int, help=f"fewer layers than the shape's (default: {d.layers} for qwen3-30b)")
    ap.add_argument("--experts", type=int, help=f"experts a layer (default: the shape's, {d.experts} for qwen3-30b)")
    ap.add_argument("--vocab", type=int, help=f"vocabulary (default: the shape's, {d.vocab} for qwen3-30b)")
    ap.add_argument("--no-warm", action="store_true", help="skip the page-cache read (then the load is not 'warm')")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--package", help=argparse.SUPPRESS)
    ap.add_argument("--budget-gib", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def measure_in_subprocess(args, package: Path, budget_gib: float) -> dict:
    """One load in a fresh Python process (nothing imported, compiled or allocated before it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--package", str(package),
               "--budget-gib", str(budget_gib), "--child-out", str(out), "--device", args.device,
               "--context", str(args.context), "--max-batch", str(args.max_batch), "--tier", args.tier,
               "--decode-steps", str(args.decode_steps), "--new-chats", str(args.new_chats),
               "--long-prompts", *map(str, args.long_prompts), "--resend", str(args.resend),
               "--resend-tokens", str(args.resend_tokens), "--arena", args.arena]
        cmd += ["--beside"] * args.beside + ["--graph-prompt-tails"] * args.graph_prompt_tails
        if args.profile_tail:
            cmd += ["--profile-tail", args.profile_tail]
        if args.python_profile:
            cmd += ["--python-profile", args.python_profile]
        if args.profile_new_chat:
            cmd += ["--profile-new-chat", args.profile_new_chat]
        if args.new_chat_steps is not None:
            cmd += ["--new-chat-steps", str(args.new_chat_steps)]
        if args.gdn_piece is not None:
            cmd += ["--gdn-piece", str(args.gdn_piece)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(cmd, env=env, cwd=str(ROOT))
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"the measurement at VRAM budget {budget_gib:g} GiB failed (exit {proc.returncode}); "
                             "its output is above")
        return json.loads(out.read_text())


def report_path(text: str | None) -> Path | None:
    """Where `--out` writes: the file named, or cold_load.json inside a folder (one that exists, or a name given
    with a trailing separator). Settled before the runs: a path that cannot be written fails now, not after
    minutes of loading."""
    if not text:
        return None
    out = Path(text)
    if out.is_dir() or text.endswith(("/", os.sep)):
        out = out / "cold_load.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"--out {text}: cannot write there ({exc})") from None
    if out.is_dir():
        raise SystemExit(f"--out {text}: {out} is a folder")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    args.out = report_path(args.out)
    shape = SHAPES[args.shape]
    shape = replace(shape, **{k: v for k, v in (("layers", args.layers), ("experts", args.experts),
                                                ("vocab", args.vocab)) if v is not None})
    written = write_package(args.folder, shape)
    warm = None
    if not args.no_warm:
        warm = warm_page_cache(args.folder)
        print(f"page cache warmed: read {warm['bytes'] / GB:.2f} GB once in {warm['seconds']:.1f} s "
              f"({warm['gbps']:.2f} GB/s); nothing is dropped from it")
    rows = []
    for budget in args.vram_budget:
        for run in range(1, args.repeat + 1):
            print(f"\n-- loading at VRAM budget {budget:g} GiB in a fresh process (run {run} of {args.repeat}) --",
                  flush=True)
            rows.append({**measure_in_subprocess(args, args.folder, budget), "run": run})
    print_report(rows)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        tmp = args.out.with_name(args.out.name + ".partial")       # renamed when whole: never a half-written report
        tmp.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit.stdout.strip() or None,
            "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            "shape": asdict(shape), "package": written, "warm_read": warm, "rows": rows,
            "targets": {"load_to_first_token_s": TARGET_LOAD_TO_FIRST_TOKEN_S,
                        "rss_over_package_bytes": TARGET_RSS_OVER_PACKAGE}}, indent=1, default=str))
        os.replace(tmp, args.out)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
