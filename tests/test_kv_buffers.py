"""A finished conversation's KV buffers go to the next one (runtime/kv_buffers.py), so that its decode steps find the
graph recorded for the last one: the pool's own rules on plain caches, then through the engine - the same tokens,
the same graph key, and never a buffer the prefix cache still holds."""
from __future__ import annotations

import pytest
import torch

import runtime.decode_graph as decode_graph
from runtime.engine import Engine, SamplingParams
from runtime.kv_buffers import KVBufferPool
from runtime.kv_cache import KVCache, SequenceCache, StateCache
from tests.engine_fixtures import ftw_packages, random_prompt  # noqa: F401  (session fixture)


def _cache(tokens: int) -> SequenceCache:
    """A KV layer, a recurrent one and a sliding-window KV layer, `tokens` rows written (random: leftovers show)."""
    layers = [KVCache(2, 8, device="cpu", dtype=torch.float32), StateCache({"s": torch.ones(3)}),
              KVCache(2, 8, device="cpu", dtype=torch.float32, window=64)]
    for layer in (layers[0], layers[2]):
        if tokens:
            layer.update_and_fetch(torch.randn(2, tokens, 8), torch.randn(2, tokens, 8))
    return SequenceCache(layers)


def _ptrs(cache: SequenceCache) -> list[int]:
    return [t.data_ptr() for layer in cache.layers if isinstance(layer, KVCache) for t in (layer.keys, layer.values)]


def test_the_next_cache_gets_the_last_ones_buffers_zeroed_layer_by_layer():
    pool = KVBufferPool(max_tokens=4096)
    done = _cache(300)
    done.layers[0].reserve(1024)
    first_keys, first_values = done.layers[0].keys, done.layers[0].values
    pool.give(done)
    fresh = _cache(0)
    assert pool.take(fresh, tokens=76)
    assert fresh.layers[0].keys is first_keys and fresh.layers[0].values is first_values   # layer 0 to layer 0
    assert fresh.layers[0].capacity == 1024 and fresh.layers[0].offset == 0
    assert not fresh.layers[0].keys.any() and not fresh.layers[0].values.any()          # nothing of the last one left
    assert fresh.layers[2].capacity == 0                  # a sliding-window layer is never pooled
    assert fresh.layers[1].states["s"].sum() == 3         # a recurrent layer untouched
    assert pool.stats() == {"reused": 1, "sets": 0, "tokens": 0}
    assert not pool.take(_cache(0), tokens=76)            # one set, one taker


def test_a_cache_that_holds_tokens_already_is_not_given_buffers():
    pool = KVBufferPool(max_tokens=4096)
    pool.give(_cache(300))
    busy = _cache(5)
    before = _ptrs(busy)
    assert not pool.take(busy, tokens=10) and _ptrs(busy) == before and pool.stats()["sets"] == 1


def test_the_most_recent_set_that_fits_the_prompt_without_waste_is_taken():
    pool = KVBufferPool(max_tokens=1 << 20)
    small_old, big, small_new = _cache(100), _cache(5000), _cache(100)     # 256, 5,120 and 256 rows
    for cache in (small_old, big, small_new):
        pool.give(cache)
    assert not pool.take(_cache(0), tokens=400)           # too big a set for 400 tokens (> one bucket and > 2x), the
    assert pool.stats()["sets"] == 3                      # small ones too small: nothing taken, nothing lost
    wanted = _cache(0)
    pool.take(wanted, tokens=4000)                        # only the big set holds a 4,000-token prompt
    assert _ptrs(wanted)[:2] == _ptrs(big)[:2]
    short = _cache(0)
    pool.take(short, tokens=50)                           # both small ones do: the newer
    assert _ptrs(short)[:2] == _ptrs(small_new)[:2]
    longer = _cache(0)
    assert not pool.take(longer, tokens=9000) and longer.layers[0].capacity == 0    # none has room: it grows itself


def test_kept_buffers_never_hold_more_rows_than_one_context():
    pool = KVBufferPool(max_tokens=1024)
    sets = [_cache(200) for _ in range(5)]                # 256 rows of capacity each
    for cache in sets:
        pool.give(cache)
    assert pool.stats()["sets"] == 4 and pool.tokens == 1024       # the oldest went back to the allocator
    pool.give(_cache(2000))                                          # larger than the context: not kept at all
    assert pool.stats()["sets"] == 4
    newest = _cache(0)
    pool.take(newest, tokens=10)
    assert _ptrs(newest)[:2] == _ptrs(sets[-1])[:2]
    pool.clear()
    assert pool.stats()["sets"] == 0 and not pool.take(_cache(0), tokens=10)


def _layouts(monkeypatch) -> list[tuple]:
    """Every sequence layout the decode-graph runner computes (its graph key's addresses), in order."""
    seen: list[tuple] = []
    real = decode_graph._layout

    def spy(cache, bucket):
        out = real(cache, bucket)
        seen.append(out)
        return out

    monkeypatch.setattr(decode_graph, "_layout", spy)
    return seen


@pytest.mark.parametrize("family,prefix_cache", [("qwen3_moe", "off"), ("qwen3_next", "off"),
                                                  ("qwen3_moe", "host"), ("qwen3_next", "host")])
def test_a_second_conversation_decodes_with_the_first_ones_graph_key(family, prefix_cache, ftw_packages, device,
                                                                     monkeypatch):
    """Two short conversations, one after the other, with the prefix cache off or in host memory (a GPU engine's
    default: it takes a copy; both leave the buffers free): the second one's decode steps have exactly the first
    one's graph key - the same KV buffers, the same state slot - its tokens are what a fresh engine gives, and on
    the GPU it replays the first one's recording instead of making one (s37d: 0.150 s at its second token, against
    0.013)."""
    if prefix_cache == "host" and device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda): a CPU engine's prefix cache holds the buffers themselves")
    cache_args = {"prefix_cache_bytes": 0} if prefix_cache == "off" else {"prefix_cache_device": "cpu"}
    path = ftw_packages(family)
    sampling = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[])
    first, second = random_prompt(11, seed=21), random_prompt(9, seed=22)
    want = Engine.load(path, device=device, dtype=torch.float32, prefix_cache_bytes=0,
                       cuda_graphs=False).generate(second, sampling).tokens
    eng = Engine.load(path, device=device, dtype=torch.float32, cuda_graphs=True, **cache_args)
    seen = _layouts(monkeypatch)
    eng.generate(first, sampling)
    first_keys = set(seen)
    captures = eng.graphs.counters["captures"]
    assert len(first_keys) == 1 and eng.stats()["kv_buffers"] == {"reused": 0, "sets": 1,
                                                   "tokens": decode_graph.BUCKET}   # what its decode reserved
    seen.clear()
    assert eng.generate(second, sampling).tokens == want
    # 6 tokens: the first from the prompt, 5 decode steps; on the GPU a prompt that pauses before its last token
    # (a linear-attention model's snapshot, kept by the prefix cache) replays that token through the same graph
    replayed_tail = int(eng.graphs.capture and family == "qwen3_next" and prefix_cache == "host")
    assert set(seen) == first_keys and len(seen) == 5 + replayed_tail
    assert eng.stats()["kv_buffers"]["reused"] == 1
    if eng.graphs.capture:
        assert captures == 1 and eng.graphs.counters["captures"] == 1


def test_buffers_the_prefix_cache_holds_are_never_handed_on(ftw_packages, device):
    """Where the prefix cache keeps a finished conversation's own buffers (an engine whose prefix cache lives on its
    device, as on this CPU), they are not pooled: a pool that took them would zero the stored conversation, and its
    resend would answer from zeros."""
    path = ftw_packages("qwen3_moe")
    sampling = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[])
    chat, other = random_prompt(12, seed=31), random_prompt(10, seed=32)
    eng = Engine.load(path, device=device, dtype=torch.float32, prefix_cache_device=device)
    assert eng.prefix_cache_device == eng.device
    answer = eng.generate(chat, sampling).tokens
    eng.generate(other, sampling)
    resent = eng.generate(chat + answer + [7], sampling)
    fresh = Engine.load(path, device=device, dtype=torch.float32, prefix_cache_bytes=0)
    assert resent.cached_tokens > 0 and eng.stats()["kv_buffers"] == {"reused": 0, "sets": 0, "tokens": 0}
    assert resent.tokens == fresh.generate(chat + answer + [7], sampling).tokens


def test_spare_buffers_go_back_to_the_allocator_while_another_sequence_runs(ftw_packages, device):
    """A conversation that ends while another one decodes does not keep its buffers: the running one may grow into
    that memory (the plan counts one context's KV, not a pool beside it). Once nothing runs, the last one's stay."""
    eng = Engine.load(ftw_packages("qwen3_moe"), device=device, dtype=torch.float32, prefix_cache_bytes=0)
    short = eng.add_request(random_prompt(8, seed=41), SamplingParams(temperature=0.0, max_tokens=2, stop_token_ids=[]))
    eng.add_request(random_prompt(8, seed=42), SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[]))
    finished: set[str] = set()
    while short not in finished:
        finished |= {e.request_id for e in eng.step() if e.finished}
    assert eng.stats()["kv_buffers"]["sets"] == 1         # kept when it ended...
    eng.step()
    assert eng.stats()["kv_buffers"]["sets"] == 0         # ...and given back at the next step, the other running
    capacity = 0                                          # the other one's rows: 256 on the CPU, a graph bucket on
    while eng.has_work():                                 # the GPU (its decode graphs reserve 1,024)
        capacity = max([capacity] + [max(layer.capacity for layer in s.payload.cache.layers)
                                     for s in eng.scheduler.running])
        eng.step()
    assert capacity in (256, decode_graph.BUCKET)
    assert eng.stats()["kv_buffers"] == {"reused": 0, "sets": 1, "tokens": capacity}   # idle: the last one's kept
