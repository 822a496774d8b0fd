"""Expert compute over a pool of packed FTW blocks, on any torch device (the plain-torch reference path).

A pool is a uint8 tensor [S, nbytes]: one (layer, expert) block per slot, byte-identical to the FTW expert
file (runtime/experts/host_store.py `BlockLayout`). Two entry points:

- `pool_forward(pool, layout, spec, x, slots, weights)` for few tokens (decode): every (token, k) assignment
  gathers its slot's block, all are dequantized together and run as batched matmuls. No host sync: slots of
  -1 (experts computed elsewhere) are clamped and their weight zeroed.
- `pool_forward_grouped(...)` for many tokens (prefill): assignments grouped by slot, each used slot
  dequantized once and run over all its tokens (one host sync for the group sizes).

Shapes: T tokens, K experts per token, A = T*K assignments, S slots, D hidden, I expert width, G groups.
"""
from __future__ import annotations

import torch

from runtime.experts.interface import ExpertSpec, activate

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8,
          "float8_e4m3fn": torch.float8_e4m3fn}


def _part(blocks: torch.Tensor, layout, name: str) -> torch.Tensor:
    """blocks [A, nbytes] -> the named part, typed and shaped [A, *shape] (a view where strides allow)."""
    p = layout.parts[name]
    raw = blocks[:, p.offset:p.offset + p.nbytes]
    return raw.view(_TORCH[p.dtype]).reshape((blocks.shape[0],) + tuple(p.shape))


def _unpack(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N/2] -> codes [..., N] (uint8); low nibble is the even element."""
    return torch.stack((q & 0xF, q >> 4), dim=-1).flatten(-2)


def dequantize_blocks(blocks: torch.Tensor, layout, proj: str, dtype: torch.dtype) -> torch.Tensor:
    """One projection ("gate", "up", "down") of every block: [A, O, N] in `dtype` (math in fp32)."""
    a = blocks.shape[0]
    if layout.codec in ("f32", "bf16"):
        return _part(blocks, layout, proj).to(dtype)
    codes = _unpack(_part(blocks, layout, proj))                                  # [A, O, N]
    o, n = codes.shape[1], codes.shape[2]
    g = layout.group
    if layout.codec == "int4":
        scales = _part(blocks, layout, f"{proj}_scales").float()                  # [A, O, G]
        mins = _part(blocks, layout, f"{proj}_mins").float()
        return (codes.float() * _per_element(scales, g, n) + _per_element(mins, g, n)).to(dtype)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    vals = lut[codes.long()]                                                      # [A, O, N]
    s = _part(blocks, layout, f"{proj}_scales")
    if layout.scale_format == "e8m0":
        scale = torch.exp2(s.float() - 127.0)
    else:
        scale = s.view(torch.float8_e4m3fn).float()
    w = vals * _per_element(scale, g, n)
    gname = f"{proj}_global"
    if gname in layout.parts:
        glob = _part(blocks, layout, gname).float().view(a, 1, 1)
        w = w / glob if layout.global_op == "div" else w * glob
    return w.to(dtype)


def _per_element(s: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """Per-group values [A, O, G] -> per-element [A, O, N] (a broadcast view when groups tile the row)."""
    a, o, g = s.shape
    if g * group == n:
        return s[..., None].expand(a, o, g, group).reshape(a, o, n)
    return s.repeat_interleave(group, dim=-1)[..., :n]                              # a short last group


def _bias(blocks: torch.Tensor, layout, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    return _part(blocks, layout, name).to(dtype) if name in layout.parts else None


def blocks_forward(blocks: torch.Tensor, layout, spec: ExpertSpec, x: torch.Tensor, *,
                   h_first: torch.Tensor | None = None) -> torch.Tensor:
    """Each block b computes on its own row x[b]: blocks [A, nbytes], x [A, D] -> [A, D] (batched matmuls).
    h_first [A, r]: the first r rows of the activations, given (the finer split's rows from the CPU)."""
    dt = x.dtype
    xa = x[:, :, None]                                                            # [A, D, 1]
    g = torch.bmm(dequantize_blocks(blocks, layout, "gate", dt), xa)[..., 0]      # [A, I]
    u = torch.bmm(dequantize_blocks(blocks, layout, "up", dt), xa)[..., 0]
    gb, ub = _bias(blocks, layout, "gate_bias", dt), _bias(blocks, layout, "up_bias", dt)
    if gb is not None:
        g, u = g + gb, u + ub
    h = activate(spec, g, u)
    if h_first is not None:
        h = torch.cat([h_first.to(dt), h[:, h_first.shape[1]:]], dim=1)
    y = torch.bmm(dequantize_blocks(blocks, layout, "down", dt), h[:, :, None])[..., 0]   # [A, D]
    db = _bias(blocks, layout, "down_bias", dt)
    return y if db is None else y + db


def pool_forward(pool: torch.Tensor, layout, spec: ExpertSpec, x: torch.Tensor, slots: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """x [T, D], slots [T, K] (-1: not here), weights [T, K] -> sum_k weights * expert_slot(x) [T, D]."""
    t, k = slots.shape
    flat = slots.reshape(-1)                                                      # [A]
    valid = flat >= 0
    blocks = pool.index_select(0, flat.clamp(min=0))                              # [A, nbytes]
    xa = x.repeat_interleave(k, dim=0)                                            # [A, D]
    y = blocks_forward(blocks, layout, spec, xa)                                  # [A, D]
    w = torch.where(valid, weights.reshape(-1).to(y.dtype), torch.zeros((), dtype=y.dtype, device=y.device))
    # NaN-safe: a clamped (invalid) slot may hold any bytes; where() drops its values entirely
    y = torch.where(valid[:, None], y * w[:, None], torch.zeros((), dtype=y.dtype, device=y.device))
    return y.view(t, k, -1).sum(dim=1)


def pool_forward_grouped(pool: torch.Tensor, layout, spec: ExpertSpec, x: torch.Tensor, slots: torch.Tensor,
                         weights: torch.Tensor, *, workspace_bytes: int = 256 << 20,
                         fast: bool | None = None) -> torch.Tensor:
    """The same function for many tokens: used slots dequantized a batch at a time (as many as fit in
    `workspace_bytes` of bf16 weights) and run over each slot's tokens. `fast` (default: on a GPU with bf16
    activations and a codec the Triton dequantizer covers): one-pass Triton dequantization and torch's grouped
    GEMM over the tokens sorted by slot; else padded batched matmuls (the reference)."""
    from runtime.kernels import dequant_triton

    if fast is None:
        fast = x.is_cuda and x.dtype == torch.bfloat16
    if fast and dequant_triton.supports(layout) and hasattr(torch.nn.functional, "grouped_mm"):
        from runtime.kernels import fallback
        return fallback.run("dequant", lambda: _grouped_mm_forward(pool, layout, spec, x, slots, weights,
                                                                   workspace_bytes=workspace_bytes),
                            lambda: pool_forward_grouped(pool, layout, spec, x, slots, weights,
                                                         workspace_bytes=workspace_bytes, fast=False))
    t, k = slots.shape
    flat = slots.reshape(-1)
    order = torch.argsort(flat, stable=True)                                      # [A] grouped by slot
    sorted_slots = flat.index_select(0, order)
    uniq, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    uniq_h, counts_h = uniq.tolist(), counts.tolist()                             # host: one sync per call
    token_of = order // k                                                         # [A]
    w_sorted = weights.reshape(-1).index_select(0, order).to(x.dtype)             # [A]
    out = torch.zeros_like(x)
    per_expert = 3 * layout.hidden * layout.intermediate * x.element_size()
    batch = max(1, workspace_bytes // per_expert)
    # padded token table [U, width]: position p of slot j holds its p-th token (pads: row 0 with weight 0)
    a = flat.numel()
    gid = torch.repeat_interleave(torch.arange(len(uniq_h), device=x.device), counts)          # [A]
    first = torch.cumsum(counts, 0) - counts                                                     # [U]
    pos = torch.arange(a, device=x.device) - first.index_select(0, gid)                         # [A]
    idx_all = torch.zeros((len(uniq_h), max(counts_h)), dtype=torch.long, device=x.device)
    w_all = torch.zeros((len(uniq_h), max(counts_h)), dtype=x.dtype, device=x.device)
    idx_all[gid, pos] = token_of
    w_all[gid, pos] = w_sorted
    used = [(j, sl) for j, sl in enumerate(uniq_h) if sl >= 0]
    for b0 in range(0, len(used), batch):
        group = used[b0:b0 + batch]
        blocks = pool.index_select(0, torch.tensor([sl for _, sl in group], device=pool.device))
        gate = dequantize_blocks(blocks, layout, "gate", x.dtype)                 # [B, I, D]
        up = dequantize_blocks(blocks, layout, "up", x.dtype)
        down = dequantize_blocks(blocks, layout, "down", x.dtype)                 # [B, D, I]
        width = max(counts_h[j] for j, _ in group)
        rows = torch.tensor([j for j, _ in group], device=x.device)
        idx = idx_all.index_select(0, rows)[:, :width].contiguous()              # [B, W]
        wpad = w_all.index_select(0, rows)[:, :width]
        xs = x.index_select(0, idx.reshape(-1)).view(len(group), width, -1)       # [B, W, D]
        g = torch.bmm(xs, gate.transpose(1, 2))                                   # [B, W, I]
        u = torch.bmm(xs, up.transpose(1, 2))
        gb, ub = _bias(blocks, layout, "gate_bias", x.dtype), _bias(blocks, layout, "up_bias", x.dtype)
        if gb is not None:
            g, u = g + gb[:, None, :], u + ub[:, None, :]
        y = torch.bmm(activate(spec, g, u), down.transpose(1, 2))                 # [B, W, D]
        db = _bias(blocks, layout, "down_bias", x.dtype)
        if db is not None:
            y = y + db[:, None, :]
        out.index_add_(0, idx.reshape(-1), (y * wpad[..., None]).reshape(-1, y.shape[-1]))
    return out


# assignments (token, expert) one grouped-GEMM round takes at most: its gathered rows, both GEMMs' outputs and the
# weighted fp32 rows come to ~20 KB a row at hidden 2048 (~160 MB), whatever the chunk's length
GROUPED_BATCH_ROWS = 8192


def _grouped_mm_forward(pool: torch.Tensor, layout, spec: ExpertSpec, x: torch.Tensor, slots: torch.Tensor,
                        weights: torch.Tensor, *, workspace_bytes: int) -> torch.Tensor:
    """Assignments sorted by slot; used slots dequantized a batch at a time (Triton, one pass) into the layout
    `F.grouped_mm` takes; gate+up as one grouped GEMM, the activation, down as another; weighted scatter-add.
    A batch also ends at GROUPED_BATCH_ROWS assignments and gathers its own rows of x: a prefill chunk's VRAM then
    does not grow with its tokens here beyond the fp32 output (gathered for the whole call at once, x's rows took
    T x K x D - 512 MiB for a 16K-token chunk of qwen3-30b, top-8 - and a batch's intermediates ~20 KB a row)."""
    from runtime.kernels.dequant_triton import dequantize_experts

    t, k = slots.shape
    flat = slots.reshape(-1)                                                      # [A]
    order = torch.argsort(flat, stable=True)                                      # [A] grouped by slot
    sorted_slots = flat.index_select(0, order)
    uniq, counts = torch.unique_consecutive(sorted_slots, return_counts=True)    # [U]
    uniq_h, counts_h = uniq.tolist(), counts.tolist()                             # host: one sync per call
    token_of = order // k                                                         # [A]
    ws = weights.reshape(-1).index_select(0, order).to(torch.float32)             # [A]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)              # fp32 accumulation
    i = layout.intermediate
    per_expert = 3 * layout.hidden * i * x.element_size()
    batch, batch_rows = max(1, workspace_bytes // per_expert), GROUPED_BATCH_ROWS
    starts = [0]
    for c in counts_h:
        starts.append(starts[-1] + c)
    first = next((j for j, sl in enumerate(uniq_h) if sl >= 0), len(uniq_h))     # -1 slots sort first: skipped
    j0 = first
    while j0 < len(uniq_h):
        j1 = j0 + 1                     # at least one slot a batch, however many rows it has
        while j1 < min(j0 + batch, len(uniq_h)) and starts[j1 + 1] - starts[j0] <= batch_rows:
            j1 += 1
        a0, a1 = starts[j0], starts[j1]
        gate_up, down = dequantize_experts(pool, layout, uniq[j0:j1], dtype=x.dtype)  # [B, 2I, D], [B, D, I]
        offs = torch.cumsum(counts[j0:j1], 0).to(torch.int32)                     # [B] end row of each slot
        xs = x.index_select(0, token_of[a0:a1])                                   # [n, D] this batch's rows
        gu = torch.nn.functional.grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)          # [n, 2I]
        h = activate(spec, gu[:, :i], gu[:, i:])                                  # [n, I]
        y = torch.nn.functional.grouped_mm(h, down.transpose(1, 2), offs=offs)    # [n, D]
        out.index_add_(0, token_of[a0:a1], y * ws[a0:a1, None])              # bf16 x fp32: one fp32 product
        j0 = j1
    return out.to(x.dtype)


def _first(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t[0]
