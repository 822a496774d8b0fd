"""Unit tests of the engine's parts: scheduler, prefix cache, KV cache, rotary, attention, strict loading."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kv_cache import KVCache, SequenceCache, StateCache
from runtime.loading import WeightLoadError, build_empty_model, load_dense_weights
from runtime.models.base import ModelConfig, UnsupportedModelError, build_model
from runtime.models.blocks import attend, rope_frequencies
from runtime.prefix_cache import PrefixCache
from runtime.scheduler import Scheduler, SchedulerConfig, Sequence

# ---------------------------------------------------------------------------------------------- scheduler


def seq(rid: str, prompt_len: int, computed: int = 0) -> Sequence:
    return Sequence(rid, list(range(prompt_len)), prompt_len, computed=computed)


def test_scheduler_admits_up_to_max_batch_in_arrival_order():
    s = Scheduler(SchedulerConfig(max_batch=2, prefill_chunk=4, step_token_budget=100))
    a, b, c = seq("a", 3), seq("b", 3), seq("c", 3)
    for x in (a, b, c):
        s.add(x)
    assert s.admit() == [a, b] and list(s.waiting) == [c]
    s.remove(a)
    assert s.admit() == [c] and s.running == [b, c]


def test_scheduler_runs_decoders_first_then_chunks_prefill_within_budget():
    s = Scheduler(SchedulerConfig(max_batch=4, prefill_chunk=5, step_token_budget=8))
    decoding = seq("d", 4, computed=4)
    decoding.tokens.append(99)                      # one sampled token waiting to be fed
    long_prompt, other = seq("p", 12), seq("q", 6)
    for x in (long_prompt, decoding, other):
        s.add(x)
    s.admit()
    work = s.schedule()
    assert [(w.request_id, n) for w, n in work] == [("d", 1), ("p", 5), ("q", 2)]


def test_scheduler_always_makes_progress_with_a_tiny_budget():
    s = Scheduler(SchedulerConfig(max_batch=2, prefill_chunk=3, step_token_budget=1))
    s.add(seq("p", 10))
    s.admit()
    assert [(w.request_id, n) for w, n in s.schedule()] == [("p", 1)]
    with pytest.raises(ValueError, match="max_batch"):
        SchedulerConfig(max_batch=0)

# ----------------------------------------------------------------------------------------- KV and state


def test_kv_cache_grows_trims_copies_and_loads():
    cache = KVCache(2, 4, device="cpu", dtype=torch.float32)
    k1, v1 = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    keys, values = cache.update_and_fetch(k1, v1)
    assert keys.shape == (2, 5, 4) and torch.equal(keys, k1) and cache.offset == 5
    k2 = torch.randn(2, 300, 4)                      # past the first growth step
    keys, _ = cache.update_and_fetch(k2, k2)
    assert cache.offset == 305 and cache.capacity >= 305 and torch.equal(keys[:, :5], k1)
    copy = cache.copy()
    assert copy.nbytes == 2 * 2 * 305 * 4 * 4 and torch.equal(copy.keys, keys)
    assert cache.trim(300) == 300 and cache.offset == 5
    cache.update_and_fetch(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    assert torch.equal(copy.keys[:, 5], k2[:, 0])   # the copy is independent
    fresh = KVCache(2, 4, device="cpu", dtype=torch.float32)
    fresh.load(copy, 7)
    assert fresh.offset == 7 and torch.equal(fresh.keys[:, :7], copy.keys[:, :7])


@pytest.mark.parametrize("chunks", [[1] * 40, [13, 1, 1, 9, 1, 20, 1, 1], [30, 30]])
def test_windowed_kv_cache_keeps_what_the_window_sees(chunks):
    window = 8
    gen = torch.Generator().manual_seed(len(chunks))
    full = KVCache(2, 4, device="cpu", dtype=torch.float32)
    windowed = KVCache(2, 4, device="cpu", dtype=torch.float32, window=window)
    for t in chunks:
        k, v = torch.randn(2, t, 4, generator=gen), torch.randn(2, t, 4, generator=gen)
        all_keys, all_values = full.update_and_fetch(k, v)
        keys, values = windowed.update_and_fetch(k, v)
        s = keys.shape[1]
        # what it returns is the tail of the full history, covering every new query's window
        assert torch.equal(keys, all_keys[:, -s:]) and torch.equal(values, all_values[:, -s:])
        assert s >= min(full.offset, window - 1 + t)
        assert windowed.offset == full.offset and windowed.stored <= 2 * window + t
        q = torch.randn(4, t, 4, generator=gen)
        assert torch.allclose(attend(q, keys, values, scale=0.5, sliding_window=window),
                              attend(q, all_keys, all_values, scale=0.5, sliding_window=window), atol=1e-6)
    assert not windowed.trimmable and windowed.trim(3) == 0
    restored = KVCache(2, 4, device="cpu", dtype=torch.float32, window=window)
    restored.load(windowed.copy())
    assert restored.offset == windowed.offset and torch.equal(restored.keys[:, :restored.stored],
                                                               windowed.keys[:, :windowed.stored])
    with pytest.raises(ValueError, match="cannot be cut"):
        restored.load(windowed, windowed.offset - 1)


def test_sequence_cache_with_recurrent_state_refuses_to_trim():
    state = StateCache({"recurrent": torch.ones(2, 2)}, offset=4)
    kv = KVCache(1, 2, device="cpu", dtype=torch.float32)
    kv.update_and_fetch(torch.ones(1, 4, 2), torch.ones(1, 4, 2))
    seq_cache = SequenceCache([kv, state])
    assert not seq_cache.trimmable and seq_cache.trim(2) == 0 and seq_cache.offset == 4
    copy = seq_cache.copy()
    state.states["recurrent"].add_(1)
    assert torch.equal(copy.layers[1].states["recurrent"], torch.ones(2, 2))
    with pytest.raises(ValueError, match="cannot be cut"):
        StateCache().load(copy.layers[1], 3)

# ------------------------------------------------------------------------------------------- prefix cache


class FakeCache:
    def __init__(self, nbytes: int, trimmable: bool = True):
        self.nbytes, self.trimmable = nbytes, trimmable


def test_prefix_cache_longest_match_leaves_one_token():
    pc = PrefixCache(1000)
    pc.insert([1, 2, 3, 4, 5], FakeCache(100))
    assert pc.lookup([1, 2, 3, 9]).length == 3
    assert pc.lookup([1, 2, 3, 4, 5]).length == 4       # the last prompt token is always computed
    assert pc.lookup([7, 8]) is None
    assert pc.stats()["hits"] == 2 and pc.stats()["misses"] == 1


def test_prefix_cache_recurrent_entries_match_only_whole():
    pc = PrefixCache(1000)
    pc.insert([1, 2, 3], FakeCache(100, trimmable=False))
    assert pc.lookup([1, 2, 4, 5]) is None
    assert pc.lookup([1, 2, 3]) is None                 # nothing left to compute
    assert pc.lookup([1, 2, 3, 4]).length == 3


def test_prefix_cache_is_a_byte_bounded_lru():
    pc = PrefixCache(250)
    pc.insert([1], FakeCache(100))
    pc.insert([2], FakeCache(100))
    pc.lookup([1, 0])                                   # touch [1]: [2] is now the oldest
    pc.insert([3], FakeCache(100))
    assert set(pc.entries) == {(1,), (3,)} and pc.nbytes == 200 and pc.evictions == 1
    assert pc.insert([4], FakeCache(300)) is False      # larger than the whole budget
    pc.insert([1, 5, 6], FakeCache(120))                # supersedes the trimmable [1]
    assert (1,) not in pc.entries and pc.nbytes <= 250


def test_kept_after_room_counts_a_dropped_entry_once_even_when_it_is_the_oldest():
    """The covered entry is dropped, then the least recently used of the others: counting the covered one again
    among the oldest predicted less kept than make_room leaves (the arena then locked too little ahead)."""
    pc = PrefixCache(max_bytes=100)
    for key, size in ((1, 40), (2, 20), (3, 30)):
        pc.insert([key], FakeCache(size))
    covered = pc.entries[(1,)]
    assert pc.kept_after_room(55, dropping=covered) == 30     # 1 dropped, then 2 evicted: 3 stays
    pc._drop((1,))
    pc.make_room(55)
    assert pc.nbytes == 30


def test_kept_after_room_says_what_make_room_would_leave_without_evicting():
    """The engine locks host memory ahead for the prefix cache's next store: what the entries will still hold once
    it fits (the covered entry dropped first, then the oldest) plus the store itself - not the bytes held now."""
    pc = PrefixCache(max_bytes=100)
    for key, size in ((1, 30), (2, 30), (3, 30)):
        pc.insert([key], FakeCache(size))
    assert pc.kept_after_room(10) == 90                     # fits beside them
    assert pc.kept_after_room(30) == 60                     # the oldest goes
    assert pc.kept_after_room(30, dropping=pc.entries[(3,)]) == 60   # a covered entry's room is enough
    assert pc.kept_after_room(100) == 0
    assert len(pc) == 3 and pc.nbytes == 90 and pc.evictions == 0   # nothing was evicted
    pc.make_room(30)
    assert pc.nbytes == 60

# ----------------------------------------------------------------------------------------- rotary, attention


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    None,
])
def test_rope_frequencies_match_transformers(scaling):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 150000.0, "rope_type": "default", **(scaling or {})}
    cfg = GptOssConfig(head_dim=64, hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                       rope_parameters=params)
    ours, factor = rope_frequencies(64, 150000.0, scaling, 131072)
    if scaling is None:
        expected = 1.0 / (150000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
        ref_factor = 1.0
    else:
        expected, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    assert torch.allclose(ours, expected, rtol=1e-6) and factor == pytest.approx(ref_factor)


def naive_attention(q, k, v, *, window=None, sinks=None):
    """Position-by-position reference: q [H, T, hd] over k/v [Hkv, S, hd], queries at the last T positions."""
    h, t, hd = q.shape
    hkv, s, _ = k.shape
    out = torch.zeros_like(q)
    for head in range(h):
        kv = head // (h // hkv)
        for i in range(t):
            p = s - t + i
            keys = [j for j in range(s) if j <= p and (window is None or p - j < window)]
            logits = torch.stack([q[head, i] @ k[kv, j] / hd ** 0.5 for j in keys])
            if sinks is not None:
                logits = torch.cat([logits, sinks[head:head + 1]])
            probs = torch.softmax(logits, 0)[:len(keys)]
            out[head, i] = sum(pr * v[kv, j] for pr, j in zip(probs, keys))
    return out


@pytest.mark.parametrize("t,s,window,use_sinks", [(5, 5, None, False), (3, 11, 4, False), (1, 9, 4, True),
                                                  (6, 6, 3, True), (1, 7, None, False),
                                                  # a later chunk (S > T): the lower-right causal path
                                                  (3, 11, None, False), (4, 6, 10, False), (4, 9, 9, False)])
def test_attend_matches_naive_reference(t, s, window, use_sinks):
    gen = torch.Generator().manual_seed(t * 100 + s)
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((4, t, 8), (2, s, 8), (2, s, 8)))
    sinks = torch.randn(4, generator=gen) if use_sinks else None
    ours = attend(q, k, v, scale=8 ** -0.5, sliding_window=window, sinks=sinks)
    assert torch.allclose(ours, naive_attention(q, k, v, window=window, sinks=sinks), atol=1e-5)


@pytest.mark.parametrize("t,s", [(64, 64), (48, 200), (1, 33)])
def test_attend_on_the_device_matches_fp32(device, t, s):
    """The GPU paths (flash for a first chunk, lower-right flash for a later one, GQA expanded) against fp32 on
    the CPU: bf16 within its rounding. On CI's CPU this is the same comparison through the CPU paths."""
    gen = torch.Generator().manual_seed(t + s)
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((8, t, 64), (2, s, 64), (2, s, 64)))
    want = attend(q, k, v, scale=64 ** -0.5)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    got = attend(*(x.to(device, dtype) for x in (q, k, v)), scale=64 ** -0.5).float().cpu()
    assert torch.allclose(got, want, atol=3e-2 if device == "cuda" else 1e-5)

@pytest.mark.parametrize("budget_heads,calls", [(8, 2), (2, 8), (1, 16), (0, 16)])
def test_gqa_through_a_one_kv_head_call_copies_a_bounded_group_at_a_time(monkeypatch, budget_heads, calls):
    """A later chunk on a GPU: torch's lower-right flash call takes one kv head per query head, so K and V are copied
    to the query heads a group at a time under a byte budget (the largest divisor of the group that fits; one head
    when none does) - the same attention as GQA, with at most `budget` bytes of copies alive."""
    from torch.nn.attention.bias import causal_lower_right

    from runtime.models import blocks

    gen = torch.Generator().manual_seed(7)
    t, s, hd = 5, 40, 8
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((16, t, hd), (2, s, hd), (2, s, hd)))
    per_head = 2 * s * hd * k.element_size()
    seen = []

    class F:       # blocks' view of torch.nn.functional, spied (torch's own stays as it is: CausalBias checks it)
        @staticmethod
        def scaled_dot_product_attention(q_, k_, v_, **kw):
            assert k_.shape[1] == q_.shape[1]                 # one kv head per query head
            seen.append(k_.shape[1])
            return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, **kw)

    monkeypatch.setattr(blocks, "F", F)
    got = blocks._attend_expanded(q, k, v, causal_lower_right(t, s), scale=hd ** -0.5, budget=budget_heads * per_head)
    assert len(seen) == calls and all(m * per_head <= max(budget_heads, 1) * per_head for m in seen)
    assert torch.allclose(got, naive_attention(q, k, v), atol=1e-5)


# ------------------------------------------------------------------------------------------- config, loading


def test_unknown_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match=r"'deepseek_v3'.*qwen3_moe"):
        build_model({"model_type": "deepseek_v3"}, experts=None)


def test_config_refuses_impossible_shapes():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf({"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 3,
                             "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_hf({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})


class DictSource:
    def __init__(self, tensors):
        self.tensors = tensors

    def dense_names(self):
        return list(self.tensors)

    def dense(self, name):
        return self.tensors[name]


def test_strict_loading_names_missing_extra_and_misshaped_tensors(tiny_checkpoints):
    from tests.engine_fixtures import SafetensorsSource

    src = SafetensorsSource(tiny_checkpoints("mixtral"))
    tensors = {n: src.dense(n) for n in src.dense_names()}
    model = build_empty_model(src.config, experts=None, device="cpu", dtype=torch.float32)
    report = load_dense_weights(model, DictSource(tensors))
    # the declarative rename: Mixtral's router lives under block_sparse_moe in the checkpoint
    assert report.loaded["model.layers.1.mlp.gate.weight"] == "model.layers.1.block_sparse_moe.gate.weight"

    broken = dict(tensors)
    del broken["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_dense_weights(model, DictSource(broken))
    broken = dict(tensors, **{"model.layers.0.self_attn.extra.weight": torch.zeros(2)})
    with pytest.raises(WeightLoadError, match=r"unexpected tensors: model\.layers\.0\.self_attn\.extra\.weight"):
        load_dense_weights(model, DictSource(broken))
    broken = dict(tensors, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(WeightLoadError, match=r"wrong shapes: model\.norm\.weight \(3,\) \(expected \(64,\)\)"):
        load_dense_weights(model, DictSource(broken))


def test_common_prefix_len():
    from runtime.prefix_cache import common_prefix_len

    assert common_prefix_len((1, 2, 3), [1, 2, 4, 5]) == 2
    assert common_prefix_len((1, 2), [1, 2, 3]) == 2
    assert common_prefix_len((), [1]) == 0 and common_prefix_len((7,), [8]) == 0
    long = list(range(100_000))
    assert common_prefix_len(tuple(long), long[:99_999] + [-1]) == 99_999


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_attention_in_query_blocks_equals_one_block(window, monkeypatch):
    import runtime.models.blocks as blocks

    gen = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(4, 9, 8, generator=gen), torch.randn(2, 14, 8, generator=gen), torch.randn(2, 14, 8, generator=gen)
    sinks = torch.randn(4, generator=gen)
    whole = attend(q, k, v, scale=8 ** -0.5, sliding_window=window, sinks=sinks)
    monkeypatch.setattr(blocks, "SCORE_BUDGET_BYTES", 4 * 14 * 4 * 2)      # two queries per block
    assert torch.allclose(attend(q, k, v, scale=8 ** -0.5, sliding_window=window, sinks=sinks), whole, atol=1e-6)
    assert torch.allclose(whole, naive_attention(q, k, v, window=window, sinks=sinks), atol=1e-5)


def test_sliding_window_configs_bound_the_kv_cache():
    mixtral = build_model({"model_type": "mixtral", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2,
                           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 8,
                           "num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": 4}, experts=None)
    cache = mixtral.new_cache(device="cpu", dtype=torch.float32)
    assert [layer.window for layer in cache.layers] == [4, 4] and not cache.trimmable
    qwen = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, moe_intermediate_size=8, num_experts=2, num_experts_per_tok=1,
                sliding_window=4096)
    assert build_model(qwen, experts=None).kv_window(0) is None          # use_sliding_window is off
    assert build_model(dict(qwen, use_sliding_window=True), experts=None).kv_window(0) == 4096


def test_the_prefix_cache_keeps_going_in_ordinary_memory_when_page_locking_is_refused(monkeypatch, caplog):
    """A GPU engine's prefix cache copies conversations into page-locked host memory; where the OS has none left
    (Windows locks about half the RAM, and a plan may give all of it to the experts) it falls back to ordinary
    memory - said once, not tried again per copy - instead of failing the request that saves the prefix."""
    from runtime import kv_cache

    tries = []
    real_empty = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        tries.append(pin_memory)
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*shape, **kw)

    monkeypatch.setattr(kv_cache, "_pin_refused", False)
    monkeypatch.setattr(kv_cache.torch, "empty", empty)
    with caplog.at_level("WARNING"):
        a = kv_cache.host_buffer((2, 3), torch.float16)
        b = kv_cache.host_buffer((4,), torch.float32)
    assert a.shape == (2, 3) and a.dtype == torch.float16 and b.shape == (4,) and not a.is_pinned()
    assert tries == [True, False, False]                # refused once, then not tried again
    assert caplog.text.count("could not page-lock host memory for the prefix cache") == 1


def test_a_gpu_engine_turns_on_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch, caplog):
    """Long prompts' transients left 0.6-1.3 GiB reserved past what was allocated (s32e); expandable segments took it
    to 0.3-0.6 (s33a, on an H100 host). The engine asks for them itself - but a user's own allocator settings win, and
    a torch without the setting only logs. (This machine has no CUDA: the setter is recorded, not run.)"""
    import runtime.engine as engine_module

    calls, old_calls = [], []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", old_calls.append)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    engine_module._use_expandable_segments()
    assert calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    engine_module._use_expandable_segments()
    assert calls == ["expandable_segments:True"] and old_calls == []   # the user's setting stands; no deprecated call
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    engine_module._use_expandable_segments()                         # a torch before the per-accelerator setter
    assert old_calls == ["expandable_segments:True"]

    def refuse(_):
        raise RuntimeError("unknown allocator option")

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", refuse)
    with caplog.at_level("INFO"):
        engine_module._use_expandable_segments()
    assert "could not turn on expandable CUDA segments" in caplog.text


def test_the_cudnn_threshold_switch_takes_a_count_and_says_when_it_is_not_one(caplog):
    import runtime.models.blocks as blocks

    assert blocks._min_queries(None) == 2 and blocks._min_queries("4096") == 4096 and blocks._min_queries("0") == 1
    assert blocks._min_queries("lots") == 2 and "not a number of queries" in caplog.text


def test_a_single_querys_attention_leaves_cudnn_out_and_longer_chunks_keep_torchs_choice(monkeypatch):
    """cuDNN's SDPA spent 5-11 ms of host time a call on a lone token, whose GPU work is microseconds (s34j, s35b):
    `attend` runs a single query with that backend left out (a CUDA device here stands for one: this machine has no
    GPU, and the flags are torch's own), while a chunk of several queries and an A/B run that asks to keep cuDNN
    (FREETOKEN_SDPA_CUDNN=1) keep torch's choice. The answer is the same either way."""
    import runtime.models.blocks as blocks

    seen = []
    real = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())       # the flag as the call sees it
        return real(*args, **kwargs)

    monkeypatch.setattr(blocks.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(blocks, "SINGLE_QUERY_DEVICES", ("cpu",))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        torch.manual_seed(0)
        q1, q4 = torch.randn(8, 1, 16), torch.randn(8, 4, 16)
        keys, values = torch.randn(2, 40, 16), torch.randn(2, 40, 16)
        lone = blocks.attend(q1, keys, values, scale=0.25)
        chunk = blocks.attend(q4, keys[:, :4], values[:, :4], scale=0.25)     # a prompt's first chunk
        assert seen == [False, True]                            # left out for one query only
        assert torch.backends.cuda.cudnn_sdp_enabled()          # and restored after it
        monkeypatch.setattr(blocks, "SINGLE_QUERY_WITHOUT_CUDNN", False)
        kept = blocks.attend(q1, keys, values, scale=0.25)
        assert seen[-1] is True
        torch.testing.assert_close(kept, lone, rtol=0, atol=0)
        assert chunk.shape == (8, 4, 16)
        # the A/B's threshold (FREETOKEN_SDPA_CUDNN_MIN_QUERIES): a first chunk of 4 queries under 5 leaves it out
        monkeypatch.setattr(blocks, "SINGLE_QUERY_WITHOUT_CUDNN", True)
        monkeypatch.setattr(blocks, "CUDNN_MIN_QUERIES", 5)
        again = blocks.attend(q4, keys[:, :4], values[:, :4], scale=0.25)
        assert seen[-1] is False and torch.backends.cuda.cudnn_sdp_enabled()
        torch.testing.assert_close(again, chunk, rtol=0, atol=0)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
