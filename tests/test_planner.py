"""The memory planner: its decisions on real model shapes and its bookkeeping against transformers' own models."""
from __future__ import annotations

import dataclasses
import json

import pytest

from runtime.experts.estimate import CostModel, decode_range
from runtime.experts.planner import (DECODE_SCRATCH_TOKENS, GiB, HOST_RESERVE, PINNED_RESERVE,
                                     PREFIX_CACHE_HOST_BYTES, PREFIX_CACHE_MIN_BYTES, STAGING_RING_LAYERS,
                                     Hardware, ModelShape,
                                     expert_block_bytes, plan_memory)

# The real configs' fields the planner reads (Qwen3-30B-A3B and Qwen3.6-35B-A3B, from their config.json).
QWEN3_30B = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_experts": 128,
             "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
             "vocab_size": 151936, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
QWEN36 = {"model_type": "qwen3_5_moe", "text_config": {
    "model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "hidden_size": 2048, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "vocab_size": 248320, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False}}
GPT_OSS_20B = {"model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "num_local_experts": 32,
               "num_experts_per_tok": 4, "intermediate_size": 2880, "vocab_size": 201088,
               "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 12}


def gpu(vram_gib: float, *, ram_gib: float = 64, os_name: str = "Linux", h2d: float = 25.0, cpu: float = 60.0):
    ram = int(ram_gib * GiB)
    return Hardware(vram_free=int(vram_gib * GiB), vram_total=int(vram_gib * GiB), ram_total=ram, ram_available=ram,
                    pinnable=Hardware.pinnable_for(os_name, ram), h2d_gbps=h2d, cpu_gbps=cpu, has_cuda=True,
                    os_name=os_name)


# The bare links: every efficiency 1, no per-layer cost - the plan's figure before session 29; the byte accounting of
# the calibrated estimate checked against the formula written out
LINKS_ONLY = dataclasses.replace(CostModel(), cpu_kernel_efficiency=(1.0, 1.0), cpu_share_efficiency=(1.0, 1.0),
                                 h2d_efficiency=(1.0, 1.0), gpu_bandwidth_efficiency=(1.0, 1.0),
                                 decode_layer_overhead_s=(0.0, 0.0), linear_layer_overhead_s=(0.0, 0.0))


def test_shape_of_real_configs():
    q3 = ModelShape.from_config(QWEN3_30B, codec="int4")
    assert (q3.moe_layers, q3.num_experts, q3.total_experts, q3.top_k) == (48, 128, 6144, 8)
    assert q3.expert_block_bytes % 4096 == 0
    # 3 * 768 * 2048 int4 codes + fp16 scale and min per 64-group, rounded up to 4 KiB
    assert q3.expert_block_bytes == expert_block_bytes("int4", 2048, 768) == 2654208
    assert 1.4e9 < q3.dense_params < 1.7e9          # Qwen3-30B-A3B: ~30.5B total, ~29B of it routed experts
    assert q3.full_attention_layers == 48 and q3.linear_attention_layers == 0
    q36 = ModelShape.from_config(QWEN36, codec="fp4")
    assert (q36.moe_layers, q36.total_experts) == (40, 10240)
    assert (q36.full_attention_layers, q36.linear_attention_layers) == (10, 30)
    # 30 layers of a [32, 128, 128] fp32 recurrent state = 60 MiB, plus the conv states
    assert 60 * 2 ** 20 < q36.linear_state_bytes < 62 * 2 ** 20


def test_block_bytes_match_the_ftw_writer():
    from runtime.ftw.writer import expert_block_parts

    for codec, fmt, group in (("int4", "", 32), ("int4", "", 64), ("int4", "", 128), ("fp4", "mxfp4", 32),
                              ("fp4", "nvfp4", 16), ("bf16", "", 64)):
        for d, i, bias in ((2048, 768, False), (2880, 2880, True), (64, 32, False)):
            _, nbytes = expert_block_parts(codec=codec, hidden=d, intermediate=i, group_size=group, fp4_format=fmt,
                                           has_bias=bias)
            assert expert_block_bytes(codec, d, i, group_size=group, block_size=group, has_bias=bias) == nbytes


def test_dense_params_match_transformers_models():
    """The planner's non-expert parameter count agrees with transformers' models within 1.5% (norms and
    small biases are left out on purpose) and its expert count exactly."""
    import transformers

    from tests.fixtures.checkpoints import FAMILIES

    for name, fam in FAMILIES.items():
        cfg = getattr(transformers, fam.config_class)(**fam.config)
        model = getattr(transformers, fam.model_class)(cfg)
        dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
        shape = ModelShape.from_config(cfg.to_dict(), codec="bf16")
        assert abs(shape.dense_params - dense) / dense < 0.015, name
        weights = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "bias" not in n)
        assert shape.total_experts * 3 * shape.hidden_size * shape.expert_intermediate == weights, name


def test_everything_on_gpu_when_it_fits():
    shape = ModelShape.from_config(QWEN3_30B, codec="int4")
    plan = plan_memory(shape, gpu(80), context_length=32768)
    assert plan.backend == "gpu" and plan.dense_on == "cuda"
    assert plan.expert_slots == plan.expert_total == 6144
    assert plan.vram_planned <= plan.vram_budget
    assert plan.host_bytes == 0 and plan.stream_buffer_bytes == 0


def test_hybrid_fills_the_budget_with_slots():
    shape = ModelShape.from_config(QWEN3_30B, codec="int4")
    plan = plan_memory(shape, gpu(8.5), context_length=8192)
    assert plan.backend == "hybrid"
    fixed = plan.dense_bytes + plan.kv_bytes + plan.workspace_bytes + plan.stream_buffer_bytes
    assert plan.expert_slots == (plan.vram_budget - fixed) // shape.expert_block_bytes
    assert 0 < plan.expert_slots < shape.total_experts
    assert plan.vram_budget - plan.vram_planned < shape.expert_block_bytes   # no slot left on the table
    # prefill's double buffer and zero-copy decode's scratch for a call's missed blocks
    assert plan.stream_buffer_bytes == (STAGING_RING_LAYERS * shape.layer_experts_bytes
                                        + DECODE_SCRATCH_TOKENS * shape.top_k * shape.expert_block_bytes)
    assert plan.experts_pinned and plan.experts_in_ram_bytes == shape.experts_bytes
    assert plan.cpu_experts_per_layer == pytest.approx((6144 - plan.expert_slots) / 48)
    lines = plan.summary_lines()
    assert any(line.startswith(f"expert slots {plan.expert_slots:,} of 6,144") for line in lines)
    assert json.loads(json.dumps(plan.to_dict()))["backend"] == "hybrid"


def test_kv_at_the_chosen_context():
    shape = ModelShape.from_config(QWEN3_30B, codec="int4")
    small = plan_memory(shape, gpu(12), context_length=4096)
    large = plan_memory(shape, gpu(12), context_length=32768)
    per_token = 48 * 2 * 4 * 128 * 2           # layers x (K, V) x kv heads x head_dim x bf16
    assert small.kv_bytes == 4096 * per_token and large.kv_bytes == 32768 * per_token
    assert large.expert_slots < small.expert_slots     # the KV comes out of the pool
    # gpt-oss: sliding layers keep at most the window per sequence
    oss = ModelShape.from_config(GPT_OSS_20B, codec="fp4")
    per = 2 * 8 * 64 * 2
    assert oss.kv_bytes(65536, 2) == (12 * 65536 + 12 * 128 * 2) * per
    # Qwen3.6: only the 10 full-attention layers hold KV; the state slots hold the linear layers
    q36 = ModelShape.from_config(QWEN36, codec="fp4")
    plan = plan_memory(q36, gpu(24), context_length=8192, max_sequences=8)
    assert plan.kv_bytes == 10 * 8192 * 2 * 2 * 256 * 2
    assert plan.state_slots == 24 and plan.state_bytes == 24 * q36.linear_state_bytes
    assert any(line.startswith("24 state slots") for line in plan.summary_lines())


def test_user_vram_cap_and_cpu_override():
    shape = ModelShape.from_config(QWEN3_30B, codec="int4")
    free = plan_memory(shape, gpu(24))
    capped = plan_memory(shape, gpu(24), vram_budget=8 * GiB)
    assert capped.vram_budget == 8 * GiB and capped.vram_planned <= 8 * GiB
    assert capped.expert_slots < free.expert_slots
    assert any("capped" in note for note in capped.notes)
    # A cap above what is free does not raise the budget.
    assert plan_memory(shape, gpu(6), vram_budget=100 * GiB).vram_budget < 6 * GiB
    # The override keeps 100 experts of each layer on the CPU even though all would fit on an 80 GB card.
    over = plan_memory(shape, gpu(80), cpu_experts_per_layer=100)
    assert over.backend == "hybrid" and over.expert_slots == 48 * 28
    assert over.cpu_experts_per_layer == 100
    with pytest.raises(ValueError, match="cpu_experts_per_layer"):
        plan_memory(shape, gpu(8), cpu_experts_per_layer=129)


def test_cpu_only_without_gpu():
    shape = ModelShape.from_config(QWEN3_30B, codec="int4")
    hw = Hardware(ram_total=64 * GiB, ram_available=60 * GiB, pinnable=62 * GiB, cpu_gbps=50.0)
    plan = plan_memory(shape, hw, context_length=8192)
    assert plan.backend == "cpu" and plan.dense_on == "cpu" and plan.vram_planned == 0
    assert plan.expert_slots == 0 and not plan.experts_pinned and plan.staging_ring_bytes == 0
    assert plan.host_bytes == shape.experts_bytes + plan.dense_bytes + plan.kv_bytes + plan.workspace_bytes
    assert any("CPU only" in note for note in plan.notes)
    # the plan carries the calibrated estimate; over the bare links it is every active expert and the dense weights a
    # token reads (all but the input embedding table) from RAM at 50 GB/s
    assert plan.estimated_decode_tok_s == decode_range(shape, plan, hw)
    slow, fast = plan.estimated_decode_tok_s
    links = decode_range(shape, plan, hw, cost=LINKS_ONLY)
    assert 0 < slow < fast < links[0] == pytest.approx(links[1])
    assert links[0] == pytest.approx(50e9 / (48 * 8 * shape.expert_block_bytes + shape.dense_read_bytes))
    assert shape.dense_read_bytes == (shape.dense_params - QWEN3_30B["vocab_size"] * QWEN3_30B["hidden_size"]) * 2


def test_gpu_too_small_for_dense_falls_back_to_cpu():
    shape = ModelShape.from_config(QWEN36, codec="fp4")
    plan = plan_memory(shape, gpu(4), context_length=8192)
    assert plan.backend == "cpu" and plan.dense_on == "cpu"
    assert any("falling back to the CPU" in note for note in plan.notes)


def test_windows_pinnable_rule():
    """On Windows only about half the RAM can be page-locked: experts that exceed it are staged through a
    pinned ring from the mapped file, and the host total counts each page once."""
    shape = ModelShape.from_config(QWEN3_30B, codec="int4")      # ~13.9 GiB of experts
    assert Hardware.pinnable_for("Windows", 24 * GiB) == 12 * GiB
    win = plan_memory(shape, gpu(8, ram_gib=24, os_name="Windows"))
    lin = plan_memory(shape, gpu(8, ram_gib=24, os_name="Linux"))
    assert not win.experts_pinned and win.staging_ring_bytes == STAGING_RING_LAYERS * shape.layer_experts_bytes
    # as many whole layers as fit the pinnable share beside the ring are pinned; the rest stay mapped
    fit = (12 * GiB - PINNED_RESERVE - win.staging_ring_bytes) // shape.layer_experts_bytes
    assert 0 < win.experts_pinned_layers == fit < shape.moe_layers
    assert any("pinnable" in note and f"{fit} of 48 layers are pinned" in note for note in win.notes)
    assert any(f"{fit} layers in pinned RAM" in line for line in win.summary_lines())
    assert lin.experts_pinned and lin.staging_ring_bytes == 0 and lin.experts_pinned_layers == 48
    # the estimate counts the unpinned layers' misses as the CPU's alone (the same slots on both)
    assert win.expert_slots == lin.expert_slots
    miss = (1 - lin.expert_slots / shape.total_experts) * shape.top_k * shape.expert_block_bytes
    both, cpu = 25.0 + 60.0, 60.0
    def bare(plan, os_name):            # the links alone (VRAM reads taken as free)
        return decode_range(shape, plan, gpu(8, ram_gib=24, os_name=os_name), gpu_gbps=1e9, cost=LINKS_ONLY)[1]
    assert bare(lin, "Linux") == pytest.approx(1e9 / (48 * miss / both), rel=1e-4)
    assert bare(win, "Windows") == pytest.approx(1e9 / (fit * miss / both + (48 - fit) * miss / cpu), rel=1e-4)
    assert win.estimated_decode_tok_s[1] < lin.estimated_decode_tok_s[1]
    # never the page cache and a pinned copy together
    assert lin.host_bytes == shape.experts_bytes
    assert win.host_bytes == shape.experts_bytes + win.staging_ring_bytes
    assert win.host_bytes <= 24 * GiB - HOST_RESERVE
    # the share keeps a reserve for the tier's small page-locked buffers: experts that would fill it are not pinned
    at = lambda pinnable: plan_memory(shape, dataclasses.replace(gpu(8, ram_gib=64), pinnable=pinnable))  # noqa: E731
    assert not at(shape.experts_bytes + PINNED_RESERVE // 2).experts_pinned
    assert at(shape.experts_bytes + PINNED_RESERVE).experts_pinned
    # ...taken off the page-lock limit, not off RAM: experts that just fit the RAM the plan may use stay pinned
    tight = dataclasses.replace(gpu(8, ram_gib=64), ram_available=shape.experts_bytes + HOST_RESERVE)
    assert plan_memory(shape, tight).experts_pinned


def test_short_ram_leaves_cold_tail_on_disk_and_too_little_does_not_fit():
    shape = ModelShape.from_config(QWEN3_30B, codec="int4")
    tail = plan_memory(shape, gpu(8, ram_gib=12))
    assert tail.backend == "hybrid" and tail.experts_on_disk_bytes > 0
    assert tail.experts_in_ram_bytes + tail.experts_on_disk_bytes == shape.experts_bytes
    assert any("disk" in note for note in tail.notes)
    hw = Hardware(ram_total=4 * GiB, ram_available=3 * GiB, pinnable=2 * GiB, cpu_gbps=20.0)
    plan = plan_memory(shape, hw)
    assert plan.backend == "does_not_fit" and plan.short_of == "ram"
    need = plan.dense_bytes + plan.kv_bytes + plan.workspace_bytes + shape.layer_experts_bytes
    assert plan.shortfall_bytes == need - (3 * GiB - HOST_RESERVE)
    assert "short of" in plan.summary_lines()[0]


def test_the_prefix_cache_gets_the_host_ram_the_plan_leaves():
    """A GPU engine keeps resent conversations' KV in host RAM: the plan gives that cache what its own host bytes
    leave (up to 4 GiB), less on a machine the experts nearly fill, none where what is left is not worth its pages,
    and says so; an all-in-VRAM plan leaves the RAM to it."""
    shape = ModelShape.from_config(QWEN3_30B, codec="int4")
    roomy = plan_memory(shape, gpu(8, ram_gib=64))
    assert roomy.backend == "hybrid" and roomy.prefix_cache_bytes == PREFIX_CACHE_HOST_BYTES
    assert "prefix cache (resent conversations): up to 4.00 GiB of host RAM" in roomy.summary_lines()
    assert not any("prefix cache (of" in note for note in roomy.notes)
    assert plan_memory(shape, gpu(80, ram_gib=16)).prefix_cache_bytes == PREFIX_CACHE_HOST_BYTES   # all in VRAM
    # RAM that holds the plan's host bytes and 1.5 GiB more: the cache gets exactly that 1.5 GiB
    ram = roomy.host_bytes + HOST_RESERVE + 3 * GiB // 2
    tight = plan_memory(shape, dataclasses.replace(gpu(8, ram_gib=64), ram_total=ram, ram_available=ram))
    assert tight.backend == "hybrid" and tight.host_bytes == roomy.host_bytes
    assert tight.prefix_cache_bytes == 3 * GiB // 2
    assert any("leaves 1.50 GiB for the prefix cache" in note for note in tight.notes)
    ram = roomy.host_bytes + HOST_RESERVE + PREFIX_CACHE_MIN_BYTES - 1
    full = plan_memory(shape, dataclasses.replace(gpu(8, ram_gib=64), ram_total=ram, ram_available=ram))
    assert full.prefix_cache_bytes == 0 and "prefix cache: off (no host RAM left for it)" in full.summary_lines()
    # a cold tail on disk already: nothing is left for conversations
    assert plan_memory(shape, gpu(8, ram_gib=12)).prefix_cache_bytes == 0


def test_bad_config_names_the_field():
    broken = {k: v for k, v in QWEN3_30B.items() if k != "num_experts_per_tok"}
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelShape.from_config(broken)
    with pytest.raises(ValueError, match="codec"):
        ModelShape.from_config(QWEN3_30B, codec="int3")
    with pytest.raises(ValueError, match="context_length"):
        plan_memory(ModelShape.from_config(QWEN3_30B), gpu(8), context_length=0)


def test_without_room_for_the_stream_buffers_the_dense_weights_stay_on_the_gpu():
    """A 4 GiB budget at a 4K context: dense weights + KV + workspace fit, two layers of prefill stream buffers do
    not. The plan keeps the GPU (decode reads misses over PCIe into the small decode scratch) with streaming off
    and says so, instead of falling back to the CPU; a context that leaves no room even for that falls back."""
    from runtime.experts.planner import DECODE_SCRATCH_TOKENS, STAGING_RING_LAYERS

    shape = ModelShape.from_config(QWEN3_30B, codec="int4")
    budget = 4 * GiB
    plan = plan_memory(shape, gpu(80), context_length=4096, vram_budget=budget)
    scratch = DECODE_SCRATCH_TOKENS * shape.top_k * shape.expert_block_bytes
    fixed = plan.dense_bytes + plan.kv_bytes + plan.workspace_bytes
    assert fixed + scratch + STAGING_RING_LAYERS * shape.layer_experts_bytes > budget   # the premise
    assert plan.backend == "hybrid" and plan.dense_on == "cuda" and not plan.prefill_streaming
    assert plan.stream_buffer_bytes == scratch and plan.vram_planned <= budget
    assert plan.expert_slots == (budget - fixed - scratch) // shape.expert_block_bytes
    assert any("prefill stream buffers" in note for note in plan.notes)
    roomy = plan_memory(shape, gpu(80), context_length=4096, vram_budget=6 * GiB)
    assert roomy.backend == "hybrid" and roomy.prefill_streaming
    tight = plan_memory(shape, gpu(80), context_length=16384, vram_budget=budget)
    assert tight.backend == "cpu" and tight.dense_on == "cpu"


def test_a_plan_without_streaming_builds_a_tier_that_never_streams(monkeypatch):
    """hybrid_experts_factory turns the plan's `prefill_streaming=False` into a stream threshold no call reaches
    (a long prompt's layer calls then take the host-driven path, their experts on the CPU); a plan with streaming
    keeps the computed threshold."""
    import dataclasses

    import torch

    from runtime.experts import planner
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import NEVER_STREAM, hybrid_experts_factory
    from runtime.experts.interface import ExpertSpec

    store = HostExpertStore.synthetic(layers=2, num_experts=8, hidden=64, intermediate=64, codec="int4")

    class Package:
        config = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "intermediate_size": 128}
        experts = store

    monkeypatch.setattr(HostExpertStore, "from_ftw", staticmethod(lambda experts: experts))
    real = planner.plan_memory
    for streaming in (False, True):
        monkeypatch.setattr(planner, "plan_memory", lambda *a, s=streaming, **k: dataclasses.replace(
            real(*a, **k), backend="hybrid", prefill_streaming=s))
        tier = hybrid_experts_factory(Package(), ExpertSpec(), device="cpu", dtype=torch.float32, slots=4,
                                      hardware=gpu(8))
        assert (tier.stream_threshold == NEVER_STREAM) == (not streaming)
        assert tier.stream_threshold < 10 ** 6 or not streaming


def test_a_tight_budget_prefills_in_shorter_chunks_before_it_gives_up_streaming():
    """Where the default 8K-token chunk's workspace is what does not fit, the plan halves the chunk (down to
    MIN_PREFILL_CHUNK) and keeps streaming; the chunk is the longest that fits, its workspace is what the plan
    counts, and a note says so. Only when no chunk fits with the stream buffers does streaming go."""
    from runtime.experts.planner import ACTIVATION_BYTES_PER_TOKEN_PER_D, MIN_PREFILL_CHUNK

    shape = ModelShape.from_config(QWEN3_30B, codec="int4")
    per_token = shape.hidden_size * ACTIVATION_BYTES_PER_TOKEN_PER_D
    plan = plan_memory(shape, gpu(80), context_length=8192, vram_budget=int(4.5 * GiB))
    assert plan.backend == "hybrid" and plan.prefill_streaming
    assert MIN_PREFILL_CHUNK <= plan.prefill_chunk < 8192 and plan.workspace_bytes == plan.prefill_chunk * per_token
    assert plan.vram_planned <= plan.vram_budget
    assert plan.vram_planned - plan.pool_bytes + plan.prefill_chunk * per_token > plan.vram_budget   # twice: no
    assert any(f"chunks of {plan.prefill_chunk:,} tokens" in note for note in plan.notes)
    roomy = plan_memory(shape, gpu(80), context_length=8192, vram_budget=8 * GiB)
    assert roomy.prefill_chunk == 8192 and roomy.prefill_streaming
    tight = plan_memory(shape, gpu(80), context_length=8192, vram_budget=4 * GiB)
    assert tight.backend == "hybrid" and not tight.prefill_streaming and tight.prefill_chunk < 8192


def test_a_linear_attention_models_workspace_covers_one_piece_of_its_mixer():
    """Gated DeltaNet layers prefill a chunk in pieces (models/gated_deltanet.py); their transients per token are
    twice the rest of a layer's, so a short chunk reserves the piece's transients beside what stays alive, a long
    chunk the larger of that and the attention/MoE rule. A model without linear attention keeps the rule."""
    from runtime.experts.planner import (ACTIVATION_BYTES_PER_TOKEN_PER_D, LINEAR_PREFILL_PIECE_TOKENS,
                                         LIVE_BYTES_PER_TOKEN_PER_D)

    q36, q3 = ModelShape.from_config(QWEN36, codec="fp4"), ModelShape.from_config(QWEN3_30B, codec="int4")
    d = q36.hidden_size
    conv, value = 2 * 16 * 128 + 32 * 128, 32 * 128                   # QWEN36's key/value heads x head dims
    assert q36.linear_prefill_bytes_per_token == max(12 * conv + 2 * value, 2 * conv + 22 * value) > 40 * d
    assert q3.linear_prefill_bytes_per_token == 0
    piece = LINEAR_PREFILL_PIECE_TOKENS
    assert q36.prefill_workspace_bytes(piece) == piece * (d * LIVE_BYTES_PER_TOKEN_PER_D
                                                          + q36.linear_prefill_bytes_per_token)
    assert q36.prefill_workspace_bytes(piece) > piece * d * ACTIVATION_BYTES_PER_TOKEN_PER_D
    assert q36.prefill_workspace_bytes(16384) == 16384 * d * ACTIVATION_BYTES_PER_TOKEN_PER_D   # the rule wins
    assert q3.prefill_workspace_bytes(piece) == piece * q3.hidden_size * ACTIVATION_BYTES_PER_TOKEN_PER_D
    plan = plan_memory(q36, gpu(80), context_length=piece, vram_budget=8 * GiB)
    assert plan.prefill_chunk == piece and plan.workspace_bytes == q36.prefill_workspace_bytes(piece)


def test_the_plan_prints_its_decode_estimate_as_the_calibrated_range():
    """The load's plan shows a range a real step reaches (experts/estimate.py), not the bare links' bound that read
    393 tok/s for a qwen3.6 plan decoding at ~106 (session 29)."""
    shape = ModelShape.from_config(QWEN36, codec="fp4", dense_int8=True)
    hw = dataclasses.replace(gpu(8), vram_gbps=1000.0)
    plan = plan_memory(shape, hw, context_length=8192)
    slow, fast = plan.estimated_decode_tok_s
    assert f"estimated decode: {slow:.0f}–{fast:.0f} tok/s at batch 1 (uniform routing)" in plan.summary_lines()
    bound = decode_range(shape, plan, hw, gpu_gbps=1e9, cost=LINKS_ONLY)[1]
    assert 0 < slow < fast < 0.8 * bound
    # the VRAM bandwidth counts: the same plan on a slower card is estimated slower at its slow end
    assert decode_range(shape, plan, dataclasses.replace(hw, vram_gbps=200.0))[0] < slow
    # no CPU bandwidth measured (a quick estimate): no figure, no line
    quick = plan_memory(shape, dataclasses.replace(hw, cpu_gbps=0.0), context_length=8192)
    assert quick.estimated_decode_tok_s == (0.0, 0.0)
    assert not any(line.startswith("estimated decode") for line in quick.summary_lines())


def test_vram_peak_bandwidth_comes_from_nvml_by_pci_address(monkeypatch):
    """NVML is found by the CUDA device's PCI address (CUDA_VISIBLE_DEVICES renumbers devices, NVML does not); its
    bus width x memory clock x 2 is the peak. This machine has no NVIDIA driver: a stand-in module answers here, the
    GPU machine's load prints the real figure in its plan."""
    import sys
    import types

    from runtime.experts.planner import vram_peak_gbps

    calls = []
    fake = types.SimpleNamespace(
        NVML_CLOCK_MEM=2, nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByPciBusId=lambda bus: calls.append(bus) or "handle",
        nvmlDeviceGetMemoryBusWidth=lambda h: 5120, nvmlDeviceGetMaxClockInfo=lambda h, kind: 2619 if kind == 2 else 0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1b, pci_device_id=0)
    assert vram_peak_gbps(props) == pytest.approx(5120 / 8 * 2619e6 * 2 / 1e9)       # an H100 SXM: ~3,352 GB/s
    assert calls == ["init", "00000000:1b:00.0", "shutdown"]

    def no_driver():
        raise RuntimeError("NVML Shared Library Not Found")
    monkeypatch.setattr(fake, "nvmlInit", no_driver)
    assert vram_peak_gbps(props) == 0.0
