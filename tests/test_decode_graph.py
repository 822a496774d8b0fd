"""The static decode path (what runtime/decode_graph.py records as CUDA graphs) against the ordinary forward.

On this machine the static path runs eagerly (`capture=False`); on the GPU machine `--device cuda` records
and replays it, and the same assertions hold."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from runtime.decode_graph import DecodeGraphs, bucket_of, supports
from runtime.engine import Engine, SamplingParams
from runtime.host_arena import registered_slab
from runtime.models.base import Batch
from tests.engine_fixtures import ftw_packages, random_prompt  # noqa: F401  (session fixture)


def _engine(path, device, **kw):
    return Engine.load(path, device=device, dtype=torch.float32, **kw)


@pytest.mark.parametrize("family, doubling", [("qwen3_moe", False), ("mixtral", False), ("qwen3_next", False),
                                              ("qwen3_5_moe", False), ("qwen3_moe", True), ("qwen3_5_moe", True)])
def test_static_steps_match_the_ordinary_forward_across_buckets(family, doubling, ftw_packages, device):
    """Logits of 12 decode steps through the static path equal the ordinary forward's, while the KV length
    crosses two 8-token buckets (a new graph each) and the cache offsets advance the same way. With doubling
    buckets (8, 16, 32: what the engine uses beside the Triton decode attention) the same logits."""
    eng = _engine(ftw_packages(family), device, cuda_graphs=False)
    model = eng.model
    prompt = random_prompt(7, seed=1)
    graphs = DecodeGraphs(model, device=eng.device, bucket=8, doubling=doubling)
    ordinary = model.new_cache(device=eng.device, dtype=eng.dtype)
    static = model.new_cache(device=eng.device, dtype=eng.dtype)
    with torch.inference_mode():
        for cache in (ordinary, static):
            model(Batch.build([(prompt, cache)], device=eng.device))
        token = prompt[-1]
        for _ in range(12):
            want = model(Batch.build([([token], ordinary)], device=eng.device))            # [1, V]
            got = graphs.decode(token, static)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert static.offset == ordinary.offset
            token = int(want.argmax())
    assert ordinary.offset == 7 + 12
    assert graphs.stats()["buckets_seen"] == ([8, 16, 32] if doubling else [8, 16, 24])
    if graphs.capture:            # 3 buckets seen (8, 16, 24 - or 8, 16, 32): each recorded once, then replayed
        assert graphs.counters["captures"] == 3
        assert graphs.counters["record_seconds"] > 0
        # doubled buckets after the first are recorded without an eager run first (their step is the first
        # replay): the logits above are those replays'
        assert graphs.counters["unwarmed"] == (2 if doubling else 0)
    else:                         # nothing recorded, no recording time
        assert graphs.counters["captures"] == 0 and graphs.counters["record_seconds"] == 0.0
        assert graphs.counters["unwarmed"] == 0


def test_a_failed_unwarmed_recording_still_gives_its_steps_logits(ftw_packages, device, monkeypatch):
    """A new doubled bucket is recorded without an eager run first; when that recording fails, nothing has run
    yet, so the step runs eagerly then: the error carries the step's logits and the cache counts its token."""
    from runtime.decode_graph import GraphCaptureError

    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    eng = _engine(ftw_packages("qwen3_moe"), device, cuda_graphs=False)
    model = eng.model
    prompt = random_prompt(7, seed=2)
    graphs = DecodeGraphs(model, device=eng.device, bucket=8, doubling=True)
    ordinary = model.new_cache(device=eng.device, dtype=eng.dtype)
    static = model.new_cache(device=eng.device, dtype=eng.dtype)
    record = graphs._record

    def fails_past_the_first_bucket(caches, buckets):
        if buckets[0] > 8:
            raise RuntimeError("operation not permitted when stream is capturing (test)")
        return record(caches, buckets)

    monkeypatch.setattr(graphs, "_record", fails_past_the_first_bucket)
    with torch.inference_mode():
        for cache in (ordinary, static):
            model(Batch.build([(prompt, cache)], device=eng.device))
        token = prompt[-1]
        for step in range(2):                       # positions 7 (bucket 8, recorded) and 8 (bucket 16, fails)
            want = model(Batch.build([([token], ordinary)], device=eng.device))
            try:
                got = graphs.decode(token, static)
            except GraphCaptureError as err:
                assert step == 1
                got = err.logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert static.offset == ordinary.offset
            token = int(want.argmax())
    assert graphs.counters["failures"] == 1 and graphs.counters["unwarmed"] == 0


@pytest.mark.parametrize("graph_tails", [False, True])
def test_a_prompts_lone_last_token_runs_eagerly(ftw_packages, device, monkeypatch, graph_tails):
    """A prompt whose last token goes alone (here a chunk boundary; for a linear-attention model, the snapshot one
    token before the end) is not recorded as a decode graph: a new conversation is a new graph key, and recording
    it there would sit inside the time to first token (engine.GRAPH_PROMPT_TAILS). The tokens are the same either
    way, and only the decode steps take the graph path."""
    import runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "GRAPH_PROMPT_TAILS", graph_tails)
    path = ftw_packages("qwen3_moe")
    prompt = random_prompt(9, seed=5)                     # 8 in the first chunk, the 9th alone
    sampling = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[])
    want = _engine(path, device, cuda_graphs=False).generate(prompt, sampling).tokens
    eng = _engine(path, device, cuda_graphs=True, prefill_chunk=8)
    assert eng.generate(prompt, sampling).tokens == want
    decode_steps = len(want) - 1                          # the first token comes from the prompt's last step
    assert eng.graphs.counters["steps"] == decode_steps + (1 if graph_tails else 0)


def test_a_prompts_lone_last_token_replays_a_recording_that_exists(ftw_packages, device):
    """A second conversation lands in the first one's KV buffers (runtime/kv_buffers.py), so its prompt's lone last
    token has a recorded step's graph key: on the GPU it replays that recording (qwen3.6: 0.017 s against the eager
    tail's 0.115) and records nothing; the tokens are a plain engine's. On a CPU (nothing recorded) it runs eagerly."""
    path = ftw_packages("qwen3_moe")
    sampling = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[])
    prompts = random_prompt(9, seed=5), random_prompt(9, seed=6)          # 8 in the first chunk, the 9th alone
    plain = _engine(path, device, cuda_graphs=False, prefix_cache_bytes=0)
    want = [plain.generate(p, sampling).tokens for p in prompts]
    eng = _engine(path, device, cuda_graphs=True, prefill_chunk=8, prefix_cache_bytes=0)
    assert eng.generate(prompts[0], sampling).tokens == want[0]
    steps, captures = eng.graphs.counters["steps"], eng.graphs.counters["captures"]
    assert steps == len(want[0]) - 1                      # the first conversation's tail ran eagerly
    assert eng.generate(prompts[1], sampling).tokens == want[1]
    replayed_tail = 1 if eng.graphs.capture else 0
    assert eng.graphs.counters["steps"] - steps == len(want[1]) - 1 + replayed_tail
    assert eng.graphs.counters["captures"] == captures
    fresh, cache = DecodeGraphs(eng.model, device=eng.device), eng.model.new_cache(device=eng.device, dtype=eng.dtype)
    with torch.inference_mode():
        eng.model(Batch.build([(prompts[0], cache)], device=eng.device))
        assert fresh.decode_batch([1], [cache], replay_only=True) is None     # nothing recorded: nothing run
    assert cache.offset == 9 and fresh.counters["steps"] == 0


def test_recordings_beside_a_thread_that_page_locks_host_memory(ftw_packages, device):
    """The prefix cache's arena page-locks host memory on its own thread while the engine steps, and a step may
    record a decode graph: the driver refuses a registration inside a capture, and torch's default capture mode
    lets another thread's call invalidate the capture (vLLM #46933 hung this way). With runtime/cuda_capture.py's
    mode and lock, every recording succeeds, every registration too, and the logits stay the ordinary forward's."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    eng = _engine(ftw_packages("qwen3_moe"), device, cuda_graphs=False)
    model = eng.model
    # a new graph every second token (buckets by 2s: doubling ones, the GPU's default, would record 3 times in 16)
    graphs = DecodeGraphs(model, device=eng.device, bucket=2, doubling=False)
    ordinary = model.new_cache(device=eng.device, dtype=eng.dtype)
    static = model.new_cache(device=eng.device, dtype=eng.dtype)
    stop, locked, errors = threading.Event(), [], []

    def lock_and_release():                   # the arena's thread, as busy as it can be
        while not stop.is_set():
            try:
                locked.append(registered_slab(4 << 20).numel())     # registered, then unregistered as it dies
            except Exception as exc:          # noqa: BLE001  (reported by the assertion below)
                errors.append(exc)
                return

    locker = threading.Thread(target=lock_and_release, daemon=True)
    prompt = random_prompt(7, seed=3)
    with torch.inference_mode():
        for cache in (ordinary, static):
            model(Batch.build([(prompt, cache)], device=eng.device))
        locker.start()
        token = prompt[-1]
        try:
            for _ in range(16):
                want = model(Batch.build([([token], ordinary)], device=eng.device))
                got = graphs.decode(token, static)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                token = int(want.argmax())
        finally:
            stop.set()
            locker.join(30)
    assert errors == [] and len(locked) > 0
    assert graphs.counters["failures"] == 0 and graphs.counters["captures"] >= 8


class _Scaled:
    """Another expert tier: the model's, its output doubled (every other attribute is the real tier's)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, layer, hidden, topk_ids, topk_weights):
        return 2 * self.inner(layer, hidden, topk_ids, topk_weights)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_swapped_expert_tier_is_recorded_again_not_replayed_through_the_old_one(ftw_packages, device):
    """A recording holds the tier it was made with (its pool, tables, mailbox): after `set_experts` the static path
    gives the new tier's logits (run l: a benchmark row replayed the previous row's graph, whose CPU worker had
    stopped, and waited for it; another read the previous row's pool)."""
    eng = _engine(ftw_packages("qwen3_moe"), device, cuda_graphs=False)
    model = eng.model
    graphs = DecodeGraphs(model, device=eng.device, bucket=8)
    ordinary = model.new_cache(device=eng.device, dtype=eng.dtype)
    static = model.new_cache(device=eng.device, dtype=eng.dtype)
    prompt = random_prompt(3, seed=2)                  # positions 3..6: every step in the 8-row bucket
    with torch.inference_mode():
        for cache in (ordinary, static):
            model(Batch.build([(prompt, cache)], device=eng.device))
        token = prompt[-1]
        original = model.experts
        for step in range(4):
            if step == 2:
                model.set_experts(_Scaled(original))
            want = model(Batch.build([([token], ordinary)], device=eng.device))
            got = graphs.decode(token, static)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            token = int(want.argmax())
        if graphs.capture:            # one bucket, recorded once per tier
            assert graphs.counters["captures"] == 2
            # the recordings' note of their tier does not keep a replaced tier (and its VRAM) alive
            scaled = weakref.ref(model.experts)
            model.set_experts(original)
            graphs.decode(token, static)
            gc.collect()
            assert scaled() is None and graphs.counters["captures"] == 3


def test_engine_decodes_the_same_tokens_with_and_without_the_static_path(ftw_packages, device):
    path = ftw_packages("qwen3_moe")
    prompt = random_prompt(10, seed=3)
    sampling = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[])
    want = _engine(path, device, cuda_graphs=False).generate(prompt, sampling).tokens
    eng = _engine(path, device, cuda_graphs=True)
    assert eng.graphs is not None
    # twice: the second request decodes over the prefix cache's restored KV, through the same path
    assert eng.generate(prompt, sampling).tokens == want
    assert eng.generate(prompt, sampling).tokens == want
    assert eng.stats()["decode_graphs"]["steps"] >= 18


def test_models_the_static_path_does_not_cover_decode_as_before(ftw_packages, device):
    eng = _engine(ftw_packages("gpt_oss"), device, cuda_graphs=True)
    assert "sliding-window" in supports(eng.model) and eng.graphs is None
    assert eng.plan["decode_graphs"] is False
    # linear attention is covered when its states live in a slot pool (the engine always attaches one)
    eng = _engine(ftw_packages("qwen3_next"), device, cuda_graphs=True)
    assert supports(eng.model) is None and eng.graphs is not None
    eng.model.state_pool = None
    assert "slot pool" in supports(eng.model)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fused_qkv_projection_gives_the_same_logits(family, ftw_packages, device):
    """One GEMM over q/k/v weights laid end to end (what a GPU engine does after loading) computes what the
    three projections do; the parameters become views, so the state dict is unchanged."""
    plain = _engine(ftw_packages(family), device, cuda_graphs=False)
    fused = _engine(ftw_packages(family), device, cuda_graphs=False)
    fused.model.fuse_projections()
    attn = fused.model.model.layers[0].self_attn
    assert attn.qkv is not None and attn.k_proj.weight.data_ptr() == attn.qkv[0][attn.q_proj.weight.shape[0]:].data_ptr()
    for name, p in plain.model.state_dict().items():
        torch.testing.assert_close(fused.model.state_dict()[name], p, rtol=0, atol=0)
    prompt = random_prompt(9, seed=4)
    with torch.inference_mode():
        want = plain.model(Batch.build([(prompt, plain.model.new_cache(device=plain.device, dtype=plain.dtype))],
                                       device=plain.device), all_logits=True)
        got = fused.model(Batch.build([(prompt, fused.model.new_cache(device=fused.device, dtype=fused.dtype))],
                                      device=fused.device), all_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_doubling_buckets_record_log2_times_and_stay_inside_the_context():
    """bucket_of: by 1,024s a 32K answer crosses 32 buckets; doubled, 6 (1K .. 32K), each at least the length
    and never past the context rounded up to a bucket (the KV the plan counted)."""
    linear = {bucket_of(p) for p in range(32768)}
    doubled = {bucket_of(p, doubling=True, limit=32768) for p in range(32768)}
    assert len(linear) == 32 and sorted(doubled) == [1024, 2048, 4096, 8192, 16384, 32768]
    assert all(p < bucket_of(p, doubling=True) <= 2 * max(1024, p) for p in (0, 1023, 1024, 3000, 20000))
    assert bucket_of(20000, doubling=True) == 32768
    assert bucket_of(20000, doubling=True, limit=20000) == 20480          # the context (rounded up), not 32K
    assert bucket_of(20479, doubling=True, limit=20000) == 20480
    assert bucket_of(1500, doubling=True, limit=20000) == 2048


def test_a_sequences_context_bounds_its_doubled_bucket_past_a_leading_state_layer():
    """_kv_limit reads the context from the first KV layer, past recurrent-state layers (qwen3.6 starts with three
    Gated DeltaNet layers); without a limit a doubled bucket could pass the KV the memory plan counted."""
    from runtime.decode_graph import _kv_limit
    from runtime.kv_cache import KVCache, SequenceCache, StateCache

    kv = [KVCache(2, 8, device="cpu", dtype=torch.float32) for _ in range(2)]
    cache = SequenceCache([StateCache({"conv": torch.zeros(2, 3)}), *kv])
    assert _kv_limit(cache) is None
    cache.limit_growth(5000)
    assert _kv_limit(cache) == 5000
    assert bucket_of(3000, doubling=True, limit=_kv_limit(cache)) == 4096
    assert bucket_of(4500, doubling=True, limit=_kv_limit(cache)) == 5120       # not 4,096's double, 8,192
