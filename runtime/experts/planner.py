"""The memory planner: where dense weights, KV cache, recurrent states and experts live.

Placement is data decided once at load (style item 6): `plan_memory` takes the model's shape (from its
config alone, no weights), the machine (`Hardware`) and the user's choices (context, sequences, a VRAM
cap, an experts-on-CPU override) and returns a `Plan`. The engine follows the plan; the library's fit
badge calls the same function, so the badge and the real load agree.

Backends: "gpu" (every expert fits in the VRAM budget), "hybrid" (a slot pool caches hot experts in
VRAM, misses run on the CPU over the memory-mapped package), "cpu" (no usable GPU) and "does_not_fit"
(with the shortfall in bytes and which memory is short).

Sizes: L layers, E experts per layer, K experts per token, D hidden, I expert FFN width.
"""
from __future__ import annotations

import math
import platform
import sys
from dataclasses import asdict, dataclass, field

from runtime.experts.estimate import decode_range

GiB = 1024 ** 3
MiB = 1024 ** 2
BLOCK_ALIGN = 4096                   # every (layer, expert) block in an FTW expert file is 4 KiB-aligned
PART_ALIGN = 64                      # parts inside a block start on a cache line

# Named margins (why each exists):
VRAM_SAFETY_FRACTION = 0.05           # allocator fragmentation and other processes' growth
VRAM_SAFETY_MIN = 512 * MiB           # CUDA context, cuBLAS workspaces, Triton's autotune buffers
HOST_RESERVE = 2 * GiB                # the OS, the app itself and Python's heap stay out of the plan
# A GPU engine's prefix cache keeps resent conversations' KV in host RAM (an agent's next turn restores it instead
# of prefilling it again): up to 4 GiB (~40K tokens of qwen3-30b), but only out of the RAM the plan leaves - on a
# machine whose RAM the experts fill, cached conversations would push the experts' pages out and slow every step.
# Less than the floor is not worth its pages (it would hold a few thousand tokens of one conversation)
PREFIX_CACHE_HOST_BYTES = 4 * GiB
PREFIX_CACHE_MIN_BYTES = 256 * MiB
PINNED_RESERVE = 256 * MiB            # of the pinnable share, left to the tier's small page-locked buffers (mailbox,
                                      # step log, decode staging), which torch's host allocator rounds up, and to
                                      # the CUDA runtime: experts that took the whole share would fail their load
PREFILL_CHUNK_TOKENS = 16384          # prefill runs in chunks this long on a GPU (the streaming unit: each
                                      # expert byte streamed over PCIe serves 16K tokens; issue 10 asks 4-16K).
                                      # 16K since session 29: a 16K prompt 1.83x faster than in 8K chunks (s31c),
                                      # decode with the smaller pool within run-to-run spread (s31d)
ACTIVATION_BYTES_PER_TOKEN_PER_D = 24  # a chunk's hidden, residual, norm, attention and MoE buffers (bf16)
LIVE_BYTES_PER_TOKEN_PER_D = 6        # what stays alive across a layer's mixer: the residual, its norm, the output
# A linear-attention (Gated DeltaNet) layer runs a prefill chunk in pieces of this many tokens (a multiple of its 64-
# token blocks; models/gated_deltanet.py): its transients - the conv's input, transposed history and two fp32 sums,
# then fla's intermediates - are ~50 x hidden bytes a token for qwen3.6, twice the rest of a layer's: run whole, a
# 16K chunk took ~1.2 GiB more peak VRAM than an 8K one (s32b) and a real 8 GiB load peaked at 8.45 GiB. In 4K
# pieces it peaked at 7.08 GiB for +2.3 % prefill time; 2K pieces, the same peak for +5.5 % (s32d)
LINEAR_PREFILL_PIECE_TOKENS = 4096
MIN_PREFILL_CHUNK = 1024              # the shortest chunk a tight VRAM budget prefills in before giving up streaming
STAGING_RING_LAYERS = 2               # layers of blocks in prefill's double buffers - the device's stream
                                      # buffers and a mapped store's pinned staging ring (staging.py): one layer
                                      # filled while the other is read
DECODE_SCRATCH_TOKENS = 4             # zero-copy decode: calls of up to 4 tokens copy their missed blocks into
                                      # VRAM scratch (top_k blocks per token) before computing them


def _align(n: int, to: int = BLOCK_ALIGN) -> int:
    return (n + to - 1) // to * to


def _fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= 0.1 * GiB else f"{n / MiB:.0f} MiB"


def _fmt_tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


DENSE_INT8_CODECS = ("int4", "fp4")   # expert codecs whose packages a GPU engine runs with int8 dense weights


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model, read from its config.json (no weights)."""
    model_type: str
    num_layers: int
    moe_layers: int                   # layers with routed experts
    num_experts: int                  # E per MoE layer
    top_k: int                        # K
    hidden_size: int                  # D
    expert_intermediate: int          # I
    codec: str                        # "bf16" | "int4" | "fp4": how expert blocks are stored
    expert_block_bytes: int           # one (layer, expert) block on disk, 4 KiB-aligned
    dense_params: int                 # everything that is not a routed expert
    full_attention_layers: int
    sliding_attention_layers: int
    sliding_window: int               # 0 when no layer slides
    kv_bytes_per_token_per_layer: int  # K and V of one token in one attention layer (bf16)
    linear_attention_layers: int
    linear_state_bytes: int           # one sequence's recurrent + conv state over all linear layers
    linear_prefill_bytes_per_token: int = 0   # a linear-attention layer's prefill transients a token (its peak stage)
    dense_bytes_per_param: int = 2    # dense weights run in bf16...
    dense_nbytes: int = 0             # ...unless measured as loaded (int8 projections: models/quantized.py)
    dense_int8: bool = False          # the projections and LM head in int8 (what a decode step reads: 1 byte each)
    input_embed_params: int = 0       # an untied input embedding table: a token reads one row of it, not all

    @property
    def dense_read_bytes(self) -> int:
        """Dense bytes one decode step reads: every dense weight but the input embedding table (kept in bf16 when
        the projections are int8; `dense_nbytes`, when the engine measured it, counts it so too)."""
        return max(0, self.dense_bytes - self.input_embed_params * self.dense_bytes_per_param)

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.num_experts

    @property
    def experts_bytes(self) -> int:
        return self.total_experts * self.expert_block_bytes

    @property
    def dense_bytes(self) -> int:
        return self.dense_nbytes or self.dense_params * self.dense_bytes_per_param

    @property
    def layer_experts_bytes(self) -> int:
        return self.num_experts * self.expert_block_bytes

    def prefill_workspace_bytes(self, chunk: int) -> int:
        """Activations for a prefill chunk of `chunk` tokens: a layer's hidden, residual, norm, attention and MoE
        buffers, or, in a linear-attention layer, what stays alive beside the mixer plus one piece's transients -
        whichever is larger (the two never coexist)."""
        d = self.hidden_size
        # (a model without linear layers has no piece transients: the rule alone is the larger)
        linear = chunk * d * LIVE_BYTES_PER_TOKEN_PER_D \
            + min(chunk, LINEAR_PREFILL_PIECE_TOKENS) * self.linear_prefill_bytes_per_token
        return max(chunk * d * ACTIVATION_BYTES_PER_TOKEN_PER_D, linear)

    def kv_bytes(self, tokens: int, sequences: int) -> int:
        """KV cache for a pool of `tokens` positions shared by up to `sequences` sequences.

        Full-attention layers keep every token; sliding layers keep at most the window per sequence."""
        full = self.full_attention_layers * tokens
        sliding = self.sliding_attention_layers * min(tokens, self.sliding_window * sequences)
        return (full + sliding) * self.kv_bytes_per_token_per_layer

    @classmethod
    def from_config(cls, config: dict, *, codec: str = "int4", group_size: int = 64, block_size: int = 32,
                    block_nbytes: int | None = None, dense_int8: bool = False) -> "ModelShape":
        """Read a Hugging Face config.json (text config for VLMs). `block_nbytes` is the package's real
        expert block size when a converted package is at hand; otherwise it is computed from the codec.
        `dense_int8`: the dense weights as a GPU engine loads them for quantized experts (models/quantized.py:
        everything but the input embeddings in int8; an estimate, the engine counts its real bytes)."""
        cfg = dict(config.get("text_config") or config)
        model_type = str(cfg.get("model_type") or config.get("model_type") or "unknown")
        try:
            layers = int(cfg["num_hidden_layers"])
            d = int(cfg["hidden_size"])
            experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            top_k = int(cfg["num_experts_per_tok"])
            vocab = int(cfg["vocab_size"])
            heads = int(cfg["num_attention_heads"])
        except KeyError as exc:
            raise ValueError(f"config.json lacks the field {exc.args[0]!r} that the memory planner needs") from None
        if experts <= 0:
            raise ValueError(f"config.json of {model_type!r} names no routed experts (num_experts / num_local_experts)")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or d // heads)
        # Mixtral and gpt-oss name the expert width `intermediate_size`; the Qwen families `moe_intermediate_size`.
        i_exp = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        i_dense = int(cfg.get("intermediate_size") or i_exp)

        # Which layers have routed experts (Qwen3-MoE: decoder_sparse_step and mlp_only_layers).
        step = int(cfg.get("decoder_sparse_step") or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        moe_ids = [i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0]
        dense_mlp_layers = layers - len(moe_ids)

        layer_types = list(cfg.get("layer_types") or [])
        if not layer_types and "full_attention_interval" in cfg:
            interval = int(cfg["full_attention_interval"])
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if not layer_types:
            layer_types = ["full_attention"] * layers
        n_linear = sum(t == "linear_attention" for t in layer_types)
        n_sliding = sum(t == "sliding_attention" for t in layer_types)
        n_full = layers - n_linear - n_sliding
        window = int(cfg.get("sliding_window") or 0) if n_sliding else 0

        gated_q = model_type.startswith(("qwen3_next", "qwen3_5"))   # q_proj also yields the output gate
        attn = d * heads * head_dim * (2 if gated_q else 1) + 2 * d * kv_heads * head_dim + heads * head_dim * d

        linear_params, state, linear_prefill = 0, 0, 0
        if n_linear:
            nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
            dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
            kernel = int(cfg.get("linear_conv_kernel_dim") or 4)
            conv_dim = 2 * nk * dk + nv * dv
            linear_params = d * (conv_dim + nv * dv + 2 * nv) + conv_dim * kernel + nv * dv * d
            # recurrent state [n_v, d_k, d_v] in fp32, conv state [C, kernel - 1] in bf16, per layer
            state = n_linear * (nv * dk * dv * 4 + conv_dim * (kernel - 1) * 2)
            # GatedDeltaNet.forward's two peaks a token: the conv (its input and transposed history in bf16, two
            # fp32 sums: 12 C) beside z (2 V); the rule (the conv's output 2 C, z, q and k expanded to the value
            # heads, v, fla's w, u, chunk states, new v and output: ~22 V at d_k = d_v)
            value = nv * dv
            linear_prefill = max(12 * conv_dim + 2 * value, 2 * conv_dim + 22 * value)

        shared_i = int(cfg.get("shared_expert_intermediate_size") or 0)
        per_moe_layer = experts * d + (3 * d * shared_i + d if shared_i else 0)
        embed = vocab * d * (1 if cfg.get("tie_word_embeddings") else 2)
        dense_params = (embed + (n_full + n_sliding) * attn + n_linear * linear_params
                        + len(moe_ids) * per_moe_layer + dense_mlp_layers * 3 * d * i_dense)

        if block_nbytes is None:
            block_nbytes = expert_block_bytes(codec, d, i_exp, group_size=group_size, block_size=block_size,
                                              has_bias=model_type == "gpt_oss")
        input_embed = vocab * d
        dense_nbytes = 2 * input_embed + (dense_params - input_embed) if dense_int8 else 0
        return cls(model_type=model_type, num_layers=layers, moe_layers=len(moe_ids), num_experts=experts,
                   top_k=top_k, hidden_size=d, expert_intermediate=i_exp, codec=codec,
                   expert_block_bytes=int(block_nbytes), dense_params=dense_params, dense_nbytes=dense_nbytes,
                   dense_int8=bool(dense_int8), input_embed_params=0 if cfg.get("tie_word_embeddings") else vocab * d,
                   full_attention_layers=n_full, sliding_attention_layers=n_sliding, sliding_window=window,
                   kv_bytes_per_token_per_layer=2 * kv_heads * head_dim * 2,
                   linear_attention_layers=n_linear, linear_state_bytes=state,
                   linear_prefill_bytes_per_token=linear_prefill)


def expert_block_bytes(codec: str, d: int, i: int, *, group_size: int = 64, block_size: int = 32,
                       has_bias: bool = False) -> int:
    """Bytes of one (layer, expert) block as the FTW writer lays it out (runtime/ftw/writer.py, kept torch-free
    here for the library's quick estimates; a test checks the two agree): gate [I, D], up [I, D], down [D, I]
    each followed by its scales, every part 64-byte aligned, the block 4 KiB-aligned."""
    parts: list[int] = []
    for rows, cols in ((i, d), (i, d), (d, i)):
        if codec in ("bf16", "f32"):
            parts.append(rows * cols * (2 if codec == "bf16" else 4))
        elif codec == "int4":
            groups = math.ceil(cols / group_size)
            parts += [rows * cols // 2, rows * groups * 2, rows * groups * 2]      # codes, fp16 scales, fp16 mins
        elif codec == "fp4":
            parts += [rows * cols // 2, rows * (cols // block_size)]              # codes, one scale byte per block
            if block_size == 16:
                parts.append(4)                                                    # NVFP4's per-matrix fp32 scale
        else:
            raise ValueError(f"unknown expert codec {codec!r} (expected bf16, int4 or fp4)")
    if has_bias:
        parts += [4 * i, 4 * i, 4 * d]
    return _align(sum(_align(n, PART_ALIGN) for n in parts))


@dataclass(frozen=True)
class Hardware:
    """The machine as the planner sees it. Bytes and GB/s; measured by `probe()`, or given for an estimate."""
    vram_free: int = 0
    vram_total: int = 0
    ram_total: int = 0
    ram_available: int = 0
    pinnable: int = 0                 # host memory that may be page-locked (about half the RAM on Windows)
    h2d_gbps: float = 0.0             # pinned host -> device copy bandwidth
    cpu_gbps: float = 0.0             # the CPU expert kernel's weight-read bandwidth
    vram_gbps: float = 0.0            # the GPU's peak memory bandwidth (NVML: bus width x memory clock); 0 unknown
    has_cuda: bool = False
    gpu_name: str = ""
    os_name: str = ""                 # "Windows" | "Linux" | "Darwin"

    @staticmethod
    def pinnable_for(os_name: str, ram_total: int) -> int:
        """Windows lets a process page-lock about half of physical memory; Linux and macOS nearly all of it."""
        if os_name == "Windows":
            return ram_total // 2
        return max(0, ram_total - HOST_RESERVE)

    @classmethod
    def probe(cls, *, device: str = "auto", measure: bool = True, counted_in_plan: int = 0) -> "Hardware":
        """Measure this machine. `measure=False` skips the bandwidth runs (a second or so) for quick estimates.

        `counted_in_plan`: bytes this process already holds on the GPU that the plan counts itself -- at load,
        the dense weights, which the engine places before the expert tier plans (`plan_memory` puts them in its
        fixed cost). They and torch's cached, unused blocks are added back to the free VRAM; otherwise the
        dense weights were subtracted twice and an 8 GB card fell back to the CPU where hybrid fits."""
        import psutil

        vm = psutil.virtual_memory()
        os_name = platform.system()
        vram_free = vram_total = 0
        has_cuda, name, vram_gbps = False, "", 0.0
        if device != "cpu":
            try:
                import torch
                has_cuda = bool(torch.cuda.is_available())
                if has_cuda:
                    vram_free, vram_total = (int(x) for x in torch.cuda.mem_get_info())
                    name = torch.cuda.get_device_name()
                    vram_gbps = vram_peak_gbps()
                    if counted_in_plan:
                        cached = int(torch.cuda.memory_reserved()) - int(torch.cuda.memory_allocated())
                        vram_free = min(vram_total, vram_free + int(counted_in_plan) + max(0, cached))
            except (ImportError, RuntimeError) as exc:   # a broken driver reads as "no GPU", and says so
                print(f"freetoken: GPU not usable ({exc}); planning for the CPU", file=sys.stderr)
                has_cuda = False
        h2d = measure_h2d_gbps() if (measure and has_cuda) else 0.0
        cpu = measure_cpu_gbps() if measure else 0.0
        return cls(vram_free=vram_free, vram_total=vram_total, ram_total=int(vm.total),
                   ram_available=int(vm.available), pinnable=cls.pinnable_for(os_name, int(vm.total)),
                   h2d_gbps=h2d, cpu_gbps=cpu, vram_gbps=vram_gbps, has_cuda=has_cuda, gpu_name=name,
                   os_name=os_name)


def memory_bus_gbps(bus_bits: int | None, memory_clock_mhz: int | None) -> float:
    """Peak memory bandwidth from NVML's readings: bus width x memory clock x 2 (NVML's memory clock is half the
    data rate); 0 when either is unknown."""
    return bus_bits / 8 * memory_clock_mhz * 1e6 * 2 / 1e9 if bus_bits and memory_clock_mhz else 0.0


def vram_peak_gbps(props=None) -> float:
    """Peak memory bandwidth of the CUDA device with torch properties `props` (None: the current device), from
    NVML (`memory_bus_gbps`), the device found by its PCI
    address (CUDA_VISIBLE_DEVICES renumbers devices, NVML does not). 0 when NVML cannot tell: the decode estimate
    then assumes a default."""
    try:
        import pynvml as nvml   # nvidia-ml-py

        if props is None:
            import torch
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
        nvml.nvmlInit()
        try:
            bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            handle = nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            bits = nvml.nvmlDeviceGetMemoryBusWidth(handle)
            mhz = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)
        finally:
            nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001  (no NVML library, an old driver, a device NVML does not list; only an estimate)
        return 0.0
    return memory_bus_gbps(bits, mhz)


def measure_h2d_gbps(*, nbytes: int = 256 * MiB, repeats: int = 5) -> float:
    """Pinned host -> device bandwidth in GB/s (median of `repeats` copies, timed with CUDA events).

    The source is page-locked in place and unlocked when the probe returns (HostBuffer): from torch's pinned
    allocator it stayed cached, locked, for the life of the process. It is filled with a constant, not random
    bytes (a DMA does not care; `random_` over 256 MiB took most of a second of every load)."""
    import torch

    from runtime.experts.host_store import HostBuffer

    host = HostBuffer(nbytes)
    host.touch()                       # fault every page in before it is locked
    host.pin()
    src = host.tensor()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)   # warm-up: first copy maps the pages
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def measure_cpu_gbps(*, nbytes: int = 256 * MiB, repeats: int = 5) -> float:
    """Memory read bandwidth the CPU reaches in GB/s: a multi-threaded reduction over a buffer larger than
    the caches (what a bandwidth-bound expert kernel can hope for at best). It runs on a thread of its own:
    torch's OpenMP pool belongs to the thread that first runs a parallel op and lives as long as it, and kept
    by the loading thread its every-core pool would sit beside the CPU-share worker's (experts/openmp.py)."""
    import threading
    import time

    import torch

    times: list[float] = []
    failed: list[BaseException] = []

    def probe() -> None:
        try:
            buf = torch.ones(nbytes // 4, dtype=torch.float32)
            buf.sum()
            for _ in range(repeats):
                t0 = time.perf_counter()
                buf.sum()
                times.append(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001  (raised again on the caller's thread, below)
            failed.append(exc)

    thread = threading.Thread(target=probe, name="cpu-bandwidth-probe")
    thread.start()
    thread.join()
    if failed:                  # e.g. no memory for the probe's buffer: the caller sees the real error
        raise failed[0]
    return nbytes / sorted(times)[len(times) // 2] / 1e9


@dataclass
class Plan:
    """Where everything lives. Bytes unless named otherwise; `to_dict()` is what the UI and `serve` show."""
    backend: str                          # "gpu" | "hybrid" | "cpu" | "does_not_fit"
    model_type: str
    codec: str
    vram_budget: int                      # what the plan may use on the GPU (0 without one)
    vram_planned: int                     # what it does use
    dense_bytes: int
    dense_on: str                         # "cuda" | "cpu"
    kv_tokens: int
    kv_bytes: int
    state_slots: int
    state_bytes: int
    workspace_bytes: int                  # activations for one prefill chunk
    stream_buffer_bytes: int              # double buffer for prefill expert streaming + decode scratch (hybrid)
    expert_block_bytes: int
    expert_total: int                     # L x E
    expert_slots: int                     # slots in the VRAM pool
    pool_bytes: int
    cpu_experts_per_layer: float          # experts per layer that stay off the GPU (average)
    experts_bytes: int                    # the whole expert file
    host_bytes: int                       # host RAM the plan uses (experts resident in RAM + CPU-side pools)
    experts_pinned: bool                  # experts copied once into page-locked RAM (else mapped + staged)
    staging_ring_bytes: int               # pinned ring the mapped experts are staged through
    experts_in_ram_bytes: int
    experts_on_disk_bytes: int            # the cold tail left to the page cache over the mapped file
    shortfall_bytes: int = 0              # does_not_fit: what is missing
    short_of: str = ""                    # "vram" | "ram" | ""
    # batch 1, uniform routing: (slow end, fast end) of the calibrated estimate (experts/estimate.py, the library's
    # fit badge's own); (0, 0) when the CPU's bandwidth is unknown
    estimated_decode_tok_s: tuple[float, float] = (0.0, 0.0)
    prefill_streaming: bool = True        # hybrid: prompt chunks stream layers of experts to the GPU (False: no
                                          # room for the buffers; their experts run on the CPU instead)
    prefill_chunk: int = PREFILL_CHUNK_TOKENS   # prompt tokens a step: the workspace above is sized for it
    # where not all of them fit the pinnable share: the first this many MoE layers' experts are copied into
    # page-locked RAM (zero-copy decode reads them; the others' misses all run on the CPU), the rest stay mapped
    experts_pinned_layers: int = 0
    # host RAM the plan leaves to the engine's prefix cache (resent conversations' KV), at most
    # PREFIX_CACHE_HOST_BYTES; 0: none (RAM is short)
    prefix_cache_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def summary_lines(self) -> list[str]:
        lines = [f"backend: {self.backend}" + (f" (short of {_fmt_bytes(self.shortfall_bytes)} of "
                                               f"{self.short_of.upper()})" if self.backend == "does_not_fit" else "")]
        if self.vram_budget:
            lines.append(f"VRAM: {_fmt_bytes(self.vram_planned)} planned of a {_fmt_bytes(self.vram_budget)} budget")
        lines.append(f"dense weights on {self.dense_on}: {_fmt_bytes(self.dense_bytes)}")
        lines.append(f"expert slots {self.expert_slots:,} of {self.expert_total:,} — {_fmt_bytes(self.pool_bytes)}")
        lines.append(f"KV {_fmt_tokens(self.kv_tokens)} tokens — {_fmt_bytes(self.kv_bytes)}")
        if self.state_slots:
            lines.append(f"{self.state_slots} state slots — {_fmt_bytes(self.state_bytes)}")
        if self.stream_buffer_bytes:
            lines.append(f"expert stream buffers (prefill, decode) — {_fmt_bytes(self.stream_buffer_bytes)}")
        if self.backend != "gpu":
            where = "pinned RAM" if self.experts_pinned else \
                (f"{self.experts_pinned_layers} layers in pinned RAM, the rest " if self.experts_pinned_layers else "") \
                + f"mapped file, {_fmt_bytes(self.staging_ring_bytes)} pinned staging ring"
            lines.append(f"experts in host memory: {_fmt_bytes(self.experts_in_ram_bytes)} ({where})"
                         + (f", {_fmt_bytes(self.experts_on_disk_bytes)} left on disk" if self.experts_on_disk_bytes else ""))
        if self.backend == "hybrid":
            lines.append(f"experts per layer on the CPU: {self.cpu_experts_per_layer:.1f}")
        slow, fast = self.estimated_decode_tok_s
        if fast:
            lines.append(f"estimated decode: {slow:.0f}–{fast:.0f} tok/s at batch 1 (uniform routing)")
        if self.backend != "does_not_fit":
            lines.append(f"prefix cache (resent conversations): up to {_fmt_bytes(self.prefix_cache_bytes)} of host RAM"
                         if self.prefix_cache_bytes else "prefix cache: off (no host RAM left for it)")
        lines.extend(self.notes)
        return lines

    def to_dict(self) -> dict:
        return asdict(self)


def plan_memory(shape: ModelShape, hw: Hardware, *, context_length: int = 8192, max_sequences: int = 1,
                vram_budget: int | None = None, cpu_experts_per_layer: int | None = None,
                state_slots: int | None = None, prefill_chunk: int = PREFILL_CHUNK_TOKENS) -> Plan:
    """Place a model on a machine. See the module docstring; every decision is recorded in the plan's notes.

    `vram_budget` caps the GPU memory used (a user setting); `cpu_experts_per_layer` keeps that many experts
    of every layer off the GPU (a power-user override); `state_slots` defaults to three per sequence (one live
    state and two prefix-cache snapshots) for models with linear attention."""
    if context_length <= 0 or max_sequences <= 0:
        raise ValueError(f"context_length and max_sequences must be positive (got {context_length}, {max_sequences})")
    if cpu_experts_per_layer is not None and not 0 <= cpu_experts_per_layer <= shape.num_experts:
        raise ValueError(f"cpu_experts_per_layer must be between 0 and {shape.num_experts} "
                         f"(got {cpu_experts_per_layer})")
    notes: list[str] = []
    if state_slots is None:
        state_slots = 3 * max_sequences if shape.linear_attention_layers else 0
    kv = shape.kv_bytes(context_length, max_sequences)
    states = state_slots * shape.linear_state_bytes
    chunk = min(prefill_chunk, context_length)
    workspace = shape.prefill_workspace_bytes(chunk)
    fixed_gpu = shape.dense_bytes + kv + states + workspace

    budget = 0
    if hw.has_cuda:
        usable = hw.vram_free - max(VRAM_SAFETY_MIN, int(VRAM_SAFETY_FRACTION * hw.vram_total))
        budget = max(0, usable if vram_budget is None else min(usable, vram_budget))
        if vram_budget is not None and vram_budget < usable:
            notes.append(f"VRAM capped by the user at {_fmt_bytes(vram_budget)}")
    else:
        notes.append("no usable GPU: running on the CPU only")

    max_slots = shape.total_experts - (cpu_experts_per_layer or 0) * shape.moe_layers
    base = dict(model_type=shape.model_type, codec=shape.codec, vram_budget=budget, dense_bytes=shape.dense_bytes,
                kv_tokens=context_length, kv_bytes=kv, state_slots=state_slots, state_bytes=states,
                workspace_bytes=workspace, expert_block_bytes=shape.expert_block_bytes,
                expert_total=shape.total_experts, experts_bytes=shape.experts_bytes)

    base["prefill_chunk"] = chunk

    # 1. Everything on the GPU.
    if hw.has_cuda and cpu_experts_per_layer in (None, 0) and fixed_gpu + shape.experts_bytes <= budget:
        plan = Plan(backend="gpu", vram_planned=fixed_gpu + shape.experts_bytes, dense_on="cuda",
                    stream_buffer_bytes=0, expert_slots=shape.total_experts, pool_bytes=shape.experts_bytes,
                    cpu_experts_per_layer=0.0, host_bytes=0, experts_pinned=False, staging_ring_bytes=0,
                    experts_in_ram_bytes=0, experts_on_disk_bytes=0,
                    prefix_cache_bytes=_prefix_cache_budget(hw, host_bytes=0, notes=notes), notes=notes, **base)
        plan.estimated_decode_tok_s = decode_range(shape, plan, hw)
        return plan

    # 2. Hybrid: dense, KV, states and a slot pool on the GPU; every expert in host memory.
    scratch = DECODE_SCRATCH_TOKENS * shape.top_k * shape.expert_block_bytes
    ring = STAGING_RING_LAYERS * shape.layer_experts_bytes
    gpu_ok, streaming = False, True
    if hw.has_cuda:
        # where the dense part and two layers of stream buffers do not fit, first prefill in shorter chunks
        # (less activation workspace; streaming still moves each expert byte for >= MIN_PREFILL_CHUNK tokens),
        # then without streaming (prompts' experts on the CPU: slow prefill, but decode still reads its misses
        # over PCIe from a GPU holding the dense weights - far faster than the CPU-only plan)
        shorter = [c for c in (chunk >> i for i in range(8)) if c >= min(chunk, MIN_PREFILL_CHUNK)]
        for streams, c in [(True, c) for c in shorter] + [(False, c) for c in shorter]:
            need = fixed_gpu + shape.prefill_workspace_bytes(c) - workspace \
                + (ring + scratch + shape.expert_block_bytes * shape.top_k if streams else scratch)
            if need <= budget:
                gpu_ok, streaming = True, streams
                break
        if gpu_ok and c != chunk:
            notes.append(f"prompts prefill in chunks of {c:,} tokens (not {chunk:,}) to fit the VRAM budget")
            fixed_gpu += shape.prefill_workspace_bytes(c) - workspace
            chunk, workspace = c, shape.prefill_workspace_bytes(c)
            base["workspace_bytes"] = workspace
        if gpu_ok and not streaming:
            notes.append(f"no room for the prefill stream buffers ({_fmt_bytes(ring)}): prompts' experts run on the "
                         f"CPU (slow prefill); a shorter context or a larger VRAM budget makes room")
    base["prefill_chunk"] = chunk
    stream = ring + scratch if streaming else scratch
    if hw.has_cuda and not gpu_ok:
        notes.append(f"dense weights, KV and buffers ({_fmt_bytes(fixed_gpu + stream)}) exceed the VRAM budget "
                     f"({_fmt_bytes(budget)}): falling back to the CPU")
    host = _place_host(shape, hw, gpu_used=gpu_ok, cpu_side=0 if gpu_ok else fixed_gpu, notes=notes)
    if gpu_ok:
        slots = min(max_slots, (budget - fixed_gpu - stream) // shape.expert_block_bytes)
        if cpu_experts_per_layer:
            notes.append(f"user override: {cpu_experts_per_layer} experts per layer stay on the CPU")
        pool = slots * shape.expert_block_bytes
        plan = Plan(backend="hybrid", vram_planned=fixed_gpu + stream + pool, dense_on="cuda",
                    stream_buffer_bytes=stream, expert_slots=int(slots), pool_bytes=int(pool),
                    prefill_streaming=streaming,
                    cpu_experts_per_layer=(shape.total_experts - slots) / shape.moe_layers,
                    notes=notes, **host, **base)
    else:
        plan = Plan(backend="cpu", vram_planned=0, dense_on="cpu", stream_buffer_bytes=0, expert_slots=0,
                    pool_bytes=0, cpu_experts_per_layer=float(shape.num_experts), notes=notes, **host, **base)
    if host["shortfall_bytes"]:
        plan.backend, plan.short_of = "does_not_fit", "ram"
        plan.shortfall_bytes = host["shortfall_bytes"]
        plan.notes.append(f"host RAM is {_fmt_bytes(plan.shortfall_bytes)} short of what must stay resident")
    else:
        plan.prefix_cache_bytes = _prefix_cache_budget(hw, host_bytes=plan.host_bytes, notes=plan.notes)
    plan.estimated_decode_tok_s = decode_range(shape, plan, hw)
    return plan


def _prefix_cache_budget(hw: Hardware, *, host_bytes: int, notes: list[str]) -> int:
    """Host RAM for the engine's prefix cache: what the plan leaves (after its own host bytes and HOST_RESERVE), at
    most PREFIX_CACHE_HOST_BYTES, none under PREFIX_CACHE_MIN_BYTES; a note when it is less than the most."""
    left = max(0, hw.ram_available - HOST_RESERVE - host_bytes)
    budget = min(PREFIX_CACHE_HOST_BYTES, left)
    if budget < PREFIX_CACHE_MIN_BYTES:
        budget = 0
    if budget < PREFIX_CACHE_HOST_BYTES:
        notes.append(f"host RAM leaves {_fmt_bytes(budget)} for the prefix cache (of {_fmt_bytes(PREFIX_CACHE_HOST_BYTES)}"
                     "): a resent long conversation may be prefilled again" if budget else
                     "host RAM leaves no room for the prefix cache: a resent conversation is prefilled again")
    return int(budget)


def _place_host(shape: ModelShape, hw: Hardware, *, gpu_used: bool, cpu_side: int, notes: list[str]) -> dict:
    """Host side: experts pinned when they fit in the pinnable share, else mapped and staged through a
    pinned ring; the cold tail stays on disk when RAM is short. A page is counted once: a pinned copy
    replaces the page cache over the mapped file (the mapping is dropped after the copy), never both."""
    ram = max(0, hw.ram_available - HOST_RESERVE)
    # Pinning only pays when a GPU reads the experts; it needs the pinnable share to hold all of them.
    # (the reserve comes off the OS's page-lock limit, not off RAM: where RAM is the tighter bound - Linux, whose
    # limit is nominal - a plan that pinned everything before still does)
    lockable = min(max(0, hw.pinnable - PINNED_RESERVE), ram)
    pinned = gpu_used and shape.experts_bytes <= lockable
    ring = STAGING_RING_LAYERS * shape.layer_experts_bytes if gpu_used and not pinned else 0
    must_stay = cpu_side + ring        # dense weights, KV and states on the CPU backend; the staging ring
    # At least one layer's experts must be resident at a time, or every step thrashes the disk.
    shortfall = max(0, must_stay + shape.layer_experts_bytes - ram)
    in_ram = min(shape.experts_bytes, max(0, ram - must_stay))
    # Short of it, as many whole layers as fit beside the ring (all of them resident): the GPU reads those layers'
    # misses in place, the CPU computes every miss of the others. A pinned layer's copy replaces its mapped pages
    # (released after the copy), so RAM still counts each page once
    pinned_layers = 0
    if ring and in_ram == shape.experts_bytes and shape.layer_experts_bytes:
        pinned_layers = int(min(shape.moe_layers - 1, max(0, lockable - ring) // shape.layer_experts_bytes))
    if ring and in_ram == shape.experts_bytes:
        share = _fmt_bytes(min(hw.pinnable, ram))
        if pinned_layers:
            notes.append(f"experts ({_fmt_bytes(shape.experts_bytes)}) exceed the pinnable share ({share}): "
                         f"{pinned_layers} of {shape.moe_layers} layers are pinned, and the CPU computes every miss of "
                         "the other layers (decode a little slower than with all of them pinned)")
        else:
            notes.append(f"experts ({_fmt_bytes(shape.experts_bytes)}) exceed the pinnable share ({share}): staged "
                         "through a pinned ring, and decode reads misses through the host (slower than from pinned RAM)")
    on_disk = shape.experts_bytes - in_ram
    if on_disk and not shortfall:
        notes.append(f"host RAM holds {_fmt_bytes(in_ram)} of {_fmt_bytes(shape.experts_bytes)} of experts: "
                     f"the cold tail is read from disk (slower)")
    return dict(host_bytes=in_ram + must_stay, experts_pinned=pinned, staging_ring_bytes=ring,
                experts_pinned_layers=shape.moe_layers if pinned else pinned_layers,
                experts_in_ram_bytes=in_ram, experts_on_disk_bytes=on_disk, shortfall_bytes=shortfall)
