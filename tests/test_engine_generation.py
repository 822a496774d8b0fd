"""The engine end to end on tiny FTW packages (fp32): continuous batching, prefix cache, stops, limits.

Equalities are exact (token ids), because the engine promises that batching and the prefix cache
change nothing about the output.
"""
from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine, EngineError, SamplingParams
from tests.engine_fixtures import OWN_FAMILIES, ftw_packages, random_prompt, references  # noqa: F401

GREEDY = dict(temperature=0, stop_token_ids=())
# the recurrent-state family exercises the prefix cache's no-trim path (snapshots at prompt ends)
STATE_FAMILY = "qwen3_next"


def load(ftw_packages, family, device, **options) -> Engine:
    return Engine.load(ftw_packages(family, "f32"), device=device, dtype=torch.float32, **options)


def run_all(eng: Engine) -> list:
    events = []
    while eng.has_work():
        events.extend(eng.step())
    return events


@pytest.mark.parametrize("family", [*OWN_FAMILIES, STATE_FAMILY])
def test_batched_equals_sequential(family, ftw_packages, device):
    prompts = [random_prompt(n, seed=10 + n) for n in (3, 9, 17, 26)]
    max_tokens = [12, 5, 12, 9]            # one leaves early, freeing its place
    solo = load(ftw_packages, family, device, prefix_cache_bytes=0)
    expected = [solo.generate(p, SamplingParams(max_tokens=m, **GREEDY)).tokens for p, m in zip(prompts, max_tokens)]

    # small prefill chunks so prefill and decode share steps; two requests join while others decode
    eng = load(ftw_packages, family, device, prefix_cache_bytes=0, prefill_chunk=8, max_batch=3)
    ids = [eng.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(prompts[:2], max_tokens[:2])]
    for _ in range(3):
        eng.step()
    ids += [eng.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(prompts[2:], max_tokens[2:])]
    peak = 0
    while eng.has_work():
        eng.step()
        peak = max(peak, eng.stats()["active_sequences"])
    assert peak == 3                        # max_batch holds: the fourth waited for a place
    assert [eng.result(r).tokens for r in ids] == expected
    if family == STATE_FAMILY:              # one state slot per running sequence, all given back
        assert eng.plan["state_slots"] == 3 and eng.model.state_pool.in_use == 0


def test_seeded_sampling_is_reproducible_inside_a_batch(ftw_packages, device):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, stop_token_ids=())
    prompt = random_prompt(7, seed=3)
    eng = load(ftw_packages, "qwen3_moe", device, prefix_cache_bytes=0)
    alone = eng.generate(prompt, params).tokens
    other = eng.add_request(random_prompt(12, seed=4), SamplingParams(temperature=1.0, seed=99, max_tokens=10))
    mine = eng.add_request(prompt, params)
    run_all(eng)
    assert eng.result(mine).tokens == alone
    assert eng.result(other) is not None
    different_seed = eng.generate(prompt, SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=10,
                                                         stop_token_ids=()))
    assert different_seed.tokens != alone


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", STATE_FAMILY])
def test_prefix_cache_resent_conversation_prefills_only_new_tokens(family, ftw_packages, device):
    turn1 = random_prompt(21, seed=20)
    eng = load(ftw_packages, family, device)
    plain = load(ftw_packages, family, device, prefix_cache_bytes=0)

    first = eng.generate(turn1, SamplingParams(max_tokens=6, **GREEDY))
    assert first.cached_tokens == 0
    # an agent resends the conversation: the previous prompt, the answer, and a new message
    turn2 = turn1 + first.tokens + random_prompt(7, seed=21)
    before = eng.stats()["prefill_tokens"]
    second = eng.generate(turn2, SamplingParams(max_tokens=8, **GREEDY))
    prefilled = eng.stats()["prefill_tokens"] - before
    # the cache holds every token fed so far: the prompt and the answer but its last token
    reused = len(turn1) + len(first.tokens) - 1
    assert second.cached_tokens == reused
    assert prefilled == len(turn2) - reused
    assert second.tokens == plain.generate(turn2, SamplingParams(max_tokens=8, **GREEDY)).tokens
    assert eng.stats()["prefix_cache"]["hits"] >= 1


def test_copies_into_a_prefix_cache_on_another_device_are_timed(ftw_packages):
    """A GPU engine keeps its prefix cache in host RAM and copies each finished request's cache there inside a step
    (a linear-attention prompt's snapshot inside its TTFT): the stats say how long those copies took. Here the
    "other device" is cpu:0 beside the engine's cpu, which takes the same path; a same-device cache copies nothing."""
    import torch

    eng = load(ftw_packages, STATE_FAMILY, "cpu")
    eng.generate(random_prompt(21, seed=30), SamplingParams(max_tokens=3, **GREEDY))
    assert eng.stats()["prefix_cache"]["store_seconds"] == 0.0 and eng.stats()["prefix_cache"]["entries"] >= 1
    eng.prefix_cache_device = torch.device("cpu", 0)
    eng.generate(random_prompt(21, seed=31), SamplingParams(max_tokens=3, **GREEDY))
    assert eng.stats()["prefix_cache"]["store_seconds"] > 0.0


@pytest.mark.parametrize("family", ["qwen3_moe", STATE_FAMILY])
def test_an_identical_resend_reuses_all_but_the_last_prompt_token(family, ftw_packages, device):
    """A retry or regenerate sends the very same prompt again. KV caches are cut to all but the last token;
    a recurrent state cannot be cut, so the engine keeps one from just before the prompt's last token."""
    prompt = random_prompt(19, seed=40)
    eng = load(ftw_packages, family, device)
    first = eng.generate(prompt, SamplingParams(max_tokens=5, **GREEDY))
    before = eng.stats()["prefill_tokens"]
    again = eng.generate(prompt, SamplingParams(max_tokens=5, **GREEDY))
    assert again.cached_tokens == len(prompt) - 1
    assert eng.stats()["prefill_tokens"] - before == 1
    assert again.tokens == first.tokens


def test_prefix_cache_cuts_kv_to_a_shared_prefix_and_stays_exact(ftw_packages, device):
    base = random_prompt(18, seed=30)
    eng = load(ftw_packages, "qwen3_moe", device)
    plain = load(ftw_packages, "qwen3_moe", device, prefix_cache_bytes=0)
    eng.generate(base, SamplingParams(max_tokens=4, **GREEDY))
    branch = base[:11] + random_prompt(6, seed=31)          # edits the conversation after token 11
    if branch[11] == base[11]:
        branch[11] = (branch[11] + 1) % 300
    result = eng.generate(branch, SamplingParams(max_tokens=10, **GREEDY))
    assert result.cached_tokens == 11
    assert result.tokens == plain.generate(branch, SamplingParams(max_tokens=10, **GREEDY)).tokens
    # the very same prompt again: everything but the last token comes from the cache
    again = eng.generate(branch, SamplingParams(max_tokens=10, **GREEDY))
    assert again.cached_tokens == len(branch) - 1 and again.tokens == result.tokens


def test_prefix_cache_stays_within_its_byte_budget(ftw_packages, device):
    eng = load(ftw_packages, "mixtral", device)
    eng.generate(random_prompt(10, seed=40), SamplingParams(max_tokens=3, **GREEDY))
    one_entry = eng.prefix_cache.nbytes
    assert one_entry > 0
    small = load(ftw_packages, "mixtral", device, prefix_cache_bytes=int(one_entry * 1.5))
    prompts = [random_prompt(10, seed=41 + i) for i in range(3)]
    for p in prompts:
        small.generate(p, SamplingParams(max_tokens=3, **GREEDY))
        assert small.prefix_cache.nbytes <= small.prefix_cache.max_bytes
    stats = small.prefix_cache.stats()
    assert stats["entries"] == 1 and stats["evictions"] == 2
    # the survivor is the most recent conversation
    assert small.generate(prompts[-1], SamplingParams(max_tokens=1, **GREEDY)).cached_tokens == len(prompts[-1]) - 1
    assert small.generate(prompts[0], SamplingParams(max_tokens=1, **GREEDY)).cached_tokens == 0


def test_chunked_prefill_reports_progress_and_matches_one_chunk(ftw_packages, device):
    prompt = random_prompt(20, seed=50)
    progress = []
    chunked = load(ftw_packages, "qwen3_moe", device, prefill_chunk=8)
    whole = load(ftw_packages, "qwen3_moe", device, prefill_chunk=512)
    a = chunked.generate(prompt, SamplingParams(max_tokens=6, **GREEDY), on_prefill=lambda d, t: progress.append((d, t)))
    assert progress == [(8, 20), (16, 20), (20, 20)]
    assert a.tokens == whole.generate(prompt, SamplingParams(max_tokens=6, **GREEDY)).tokens
    assert a.ttft > 0 and a.prefill_tokens_per_s > 0 and a.decode_tokens_per_s > 0


def test_cancel_between_steps(ftw_packages, device):
    eng = load(ftw_packages, "mixtral", device)
    keep = eng.add_request(random_prompt(6, seed=60), SamplingParams(max_tokens=8, **GREEDY))
    drop = eng.add_request(random_prompt(9, seed=61), SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    eng.step()
    assert eng.cancel(drop) is True
    assert eng.cancel("no-such-request") is False
    events = run_all(eng)
    ends = {e.request_id: e.finish_reason for e in events if e.finished}
    assert ends == {drop: "cancelled", keep: "length"}
    assert not any(e.request_id == drop and e.token_id is not None for e in events)
    assert len(eng.result(drop).tokens) == 2 and eng.result(keep).finish_reason == "length"
    assert eng.stats()["cancelled"] == 1 and not eng.has_work()


def test_streamed_text_equals_the_decoded_tokens(ftw_packages, device):
    eng = load(ftw_packages, "qwen3_moe", device)
    events = []
    result = eng.generate(random_prompt(8, seed=70), SamplingParams(max_tokens=20, **GREEDY), on_token=events.append)
    assert [e.token_id for e in events] == result.tokens
    assert "".join(e.text for e in events) == result.text == eng.tokenizer.decode(result.tokens)
    assert [e.finished for e in events] == [False] * 19 + [True]


def test_stop_string_ends_generation_and_is_not_shown(ftw_packages, device):
    prompt = random_prompt(8, seed=71)
    eng = load(ftw_packages, "qwen3_moe", device, prefix_cache_bytes=0)
    full = eng.generate(prompt, SamplingParams(max_tokens=24, **GREEDY)).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3
    events = []
    result = eng.generate(prompt, SamplingParams(max_tokens=24, stop=(stop, "never-seen"), **GREEDY),
                          on_token=events.append)
    assert result.finish_reason == "stop" and events[-1].stop_sequence == stop
    assert result.text == full[:full.find(stop)]
    assert len(result.tokens) < 24


def test_eos_and_stop_token_ids(ftw_packages, device):
    prompt = random_prompt(8, seed=72)
    eng = load(ftw_packages, "mixtral", device, prefix_cache_bytes=0)
    assert set(eng.eos_ids) == set(eng.package.generation_config["eos_token_id"])
    free = eng.generate(prompt, SamplingParams(max_tokens=16, **GREEDY)).tokens
    target = free[5]
    stopped = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(target,)))
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == free[:free.index(target) + 1]
    assert stopped.text == eng.tokenizer.decode(stopped.tokens[:-1])     # the stop token's text is not shown


def test_max_tokens_and_context_limits(ftw_packages, device):
    eng = load(ftw_packages, "gpt_oss", device, context_length=16)
    with pytest.raises(EngineError, match=r"20 tokens.*16"):
        eng.add_request(random_prompt(20, seed=80), SamplingParams(**GREEDY))
    with pytest.raises(EngineError, match="empty"):
        eng.add_request([], SamplingParams(**GREEDY))
    with pytest.raises(EngineError, match="vocabulary"):
        eng.add_request([1, 10_000], SamplingParams(**GREEDY))
    long_prompt = random_prompt(20, seed=80)
    rid = eng.add_request(long_prompt, SamplingParams(max_tokens=5, **GREEDY), truncate=True)
    run_all(eng)
    cut = eng.result(rid)
    assert cut.prompt_tokens == 15 and len(cut.tokens) == 1 and cut.finish_reason == "length"
    assert cut.tokens == eng.generate(long_prompt[-15:], SamplingParams(max_tokens=1, **GREEDY)).tokens
    at_context = eng.generate(random_prompt(10, seed=81), SamplingParams(max_tokens=100, **GREEDY))
    assert at_context.finish_reason == "length" and len(at_context.tokens) == 6
    assert eng.generate(random_prompt(4, seed=82), SamplingParams(max_tokens=3, **GREEDY)).tokens.__len__() == 3
    nothing = eng.generate(random_prompt(4, seed=83), SamplingParams(max_tokens=0, **GREEDY))
    assert nothing.tokens == [] and nothing.finish_reason == "length"
    with pytest.raises(EngineError, match="context_length"):
        load(ftw_packages, "gpt_oss", device, context_length=10**7)


def test_load_errors_name_the_cause(tmp_path, ftw_packages, device):
    with pytest.raises(EngineError, match="not an FTW package"):
        Engine.load(tmp_path, device=device)
    import json
    import shutil

    pkg = tmp_path / "renamed"
    shutil.copytree(ftw_packages("mixtral", "f32"), pkg)
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["model_type"] = manifest["config"]["model_type"] = "llama4_moe"
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="llama4_moe"):
        Engine.load(pkg, device=device)
    with pytest.raises(EngineError, match="max_batch"):
        Engine.load(ftw_packages("mixtral", "f32"), device=device, max_batch=0)
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no usable CUDA GPU"):
            Engine.load(ftw_packages("mixtral", "f32"), device="cuda")


def test_stats_count_what_happened(ftw_packages, device):
    eng = load(ftw_packages, "qwen3_moe", device)
    eng.generate(random_prompt(12, seed=90), SamplingParams(max_tokens=5, **GREEDY))
    s = eng.stats()
    assert s["requests"] == s["finished"] == 1
    assert s["prefill_tokens"] == 12 and s["decode_tokens"] == 4
    assert s["active_sequences"] == 0 and s["prefix_cache"]["entries"] == 1
    # on a GPU the planner places the experts (all fit: "gpu"); on the CPU they are simply resident
    assert eng.plan["backend"] == ("gpu" if device == "cuda" else "resident") and eng.plan["expert_bytes"] > 0
    # Qwen3-MoE tiny: 3 layers x 2 KV heads x 16 dims x (K and V) x 4 bytes per token, at full context
    assert eng.plan["kv_tokens"] == 2048 and eng.plan["kv_bytes"] == 3 * 2 * 2 * 16 * 4 * 2048
    assert eng.plan["expert_total"] == 2 * 8          # layer 1 is dense (mlp_only_layers)


def test_a_failing_forward_ends_its_requests_and_the_engine_lives_on(ftw_packages, device):
    from runtime.engine import resident_experts_factory

    class Flaky:
        """Experts that fail once (as a CUDA out-of-memory would) and then work."""

        def __init__(self, inner):
            self.inner, self.fail_next = inner, False

        def __call__(self, *args):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("CUDA out of memory (simulated)")
            return self.inner(*args)

    flaky = None

    def factory(package, spec, **kw):
        nonlocal flaky
        flaky = Flaky(resident_experts_factory(package, spec, **kw))
        return flaky

    eng = load(ftw_packages, "qwen3_moe", device, experts_factory=factory)
    a = eng.add_request(random_prompt(6, seed=100), SamplingParams(max_tokens=5, **GREEDY))
    eng.step()
    flaky.fail_next = True
    events = eng.step()
    assert [(e.request_id, e.finished, e.finish_reason) for e in events] == [(a, True, "error")]
    failed = eng.result(a)
    assert failed.finish_reason == "error" and "out of memory" in failed.error
    assert eng.stats()["failed"] == 1 and eng.prefix_cache.stats()["entries"] == 0   # a broken cache is not kept
    prompt = random_prompt(6, seed=101)
    assert eng.generate(prompt, SamplingParams(max_tokens=5, **GREEDY)).tokens == \
        load(ftw_packages, "qwen3_moe", device).generate(prompt, SamplingParams(max_tokens=5, **GREEDY)).tokens


@pytest.mark.parametrize("family", ["mixtral", STATE_FAMILY])
def test_prefix_cache_kept_on_another_device_is_exact(family, ftw_packages, device):
    """A GPU engine keeps its prefix cache in host RAM; "cpu:0" stands in for that other device on CPU."""
    store = "cpu:0" if device == "cpu" else "cpu"
    eng = load(ftw_packages, family, device, prefix_cache_device=store)
    assert eng.plan["prefix_cache_device"] == store
    turn1 = random_prompt(12, seed=110)
    first = eng.generate(turn1, SamplingParams(max_tokens=4, **GREEDY))
    kept = next(iter(eng.prefix_cache.entries.values()))
    assert all(getattr(layer, "keys", None) is None or layer.keys.device == torch.device("cpu") for layer in kept.layers)
    turn2 = turn1 + first.tokens + random_prompt(5, seed=111)
    second = eng.generate(turn2, SamplingParams(max_tokens=6, **GREEDY))
    assert second.cached_tokens == len(turn1) + len(first.tokens) - 1
    plain = load(ftw_packages, family, device, prefix_cache_bytes=0)
    assert second.tokens == plain.generate(turn2, SamplingParams(max_tokens=6, **GREEDY)).tokens


def test_experts_factory_seam_gets_the_plan_inputs_and_a_misfit_is_an_engine_error(ftw_packages, device):
    from runtime.engine import resident_experts_factory

    seen = {}

    def factory(package, spec, **kw):
        seen.update(kw, spec=spec)
        experts = resident_experts_factory(package, spec, **kw)
        experts.plan = {"backend": "gpu", "expert_slots": 0}       # what the planner-driven factory attaches
        return experts

    eng = load(ftw_packages, "gpt_oss", device, experts_factory=factory, context_length=512, max_batch=3,
               vram_budget=123)
    assert seen["context_length"] == 512 and seen["max_sequences"] == 3 and seen["vram_budget"] == 123
    assert seen["spec"].activation == "gpt_oss" and seen["spec"].has_bias
    assert eng.plan["backend"] == "gpu" and eng.plan["experts"]["expert_slots"] == 0
    # 256 bytes of K+V per token and layer; the sliding layer (window 8) holds at most 16 tokens
    assert eng.plan["kv_bytes"] == 256 * 16 + 256 * 512

    def too_big(package, spec, **kw):
        raise MemoryError("experts need 60 GiB, 8 GiB are free")

    with pytest.raises(EngineError, match="does not fit.*60 GiB"):
        load(ftw_packages, "gpt_oss", device, experts_factory=too_big)


@pytest.mark.parametrize("family, budget", [("qwen3_moe", 112 << 10), (STATE_FAMILY, None)])
def test_agent_turns_through_a_host_prefix_cache_reuse_its_arena_and_stay_exact(family, budget, ftw_packages):
    """An agent resends its conversation each turn, a little longer. With the prefix cache on another device (a GPU
    engine's host RAM; here cpu:0 beside the engine's cpu, the same path) each turn restores the last one's cache
    straight into its own buffers, prefills only what is new, and its copy lands in the arena. A trimmable model's
    new entry takes the memory of the entry it replaces: here the arena is one 64 KiB slab and the entries grow from 27
    to 46 KiB, so a copy made beside the old entry would not fit (torch's allocator would take it: a fallback)."""
    eng = load(ftw_packages, family, "cpu", prefix_cache_bytes=budget)
    eng.prefix_cache_device = torch.device("cpu", 0)
    plain = load(ftw_packages, family, "cpu", prefix_cache_bytes=0)
    conversation = random_prompt(30, seed=90)
    for turn in range(3):
        got = eng.generate(conversation, SamplingParams(max_tokens=4, **GREEDY))
        assert got.tokens == plain.generate(conversation, SamplingParams(max_tokens=4, **GREEDY)).tokens
        if turn:
            assert got.cached_tokens >= len(conversation) - 12     # all but this turn's new tokens (and its answer)
        arena = eng.stats()["prefix_cache"]["host_arena"]
        assert arena["fallbacks"] == 0 and arena["used_bytes"] > 0
        conversation = conversation + got.tokens + random_prompt(8, seed=91 + turn)
    if budget:
        assert arena["slabs"] == 1 and arena["pinned_bytes"] == 64 << 10


@pytest.mark.parametrize("family", ["qwen3_moe", STATE_FAMILY])
def test_a_request_has_its_stores_host_memory_locked_ahead_while_it_prefills(family, ftw_packages, monkeypatch):
    """Locking host memory inside a store ran at ~2.8 GB/s (s33b): when a request starts, the engine asks the arena
    to hold what its stores will take - the finished request's cache, and for a recurrent model also the prompt's
    snapshot - beside the entries the prefix cache keeps, locked on another thread. Its estimate is each tensor the
    store then holds (the arena packs them into slabs); a trimmable model's resend replaces its last entry, so the
    arena need hold the new one alone, while a recurrent model's older entries stay beside the new ones."""
    from runtime.host_arena import HostArena

    def tensors(cache):              # the byte size of each tensor of a stored entry, in the cache's layer order
        return [t.numel() * t.element_size() for layer in cache.layers
                for t in ([layer.keys, layer.values] if hasattr(layer, "keys") else layer.states.values())]

    asked = []
    real_prepare = HostArena.prepare
    monkeypatch.setattr(HostArena, "prepare", lambda self, n: (asked.append(n), real_prepare(self, n)))
    eng = load(ftw_packages, family, "cpu", prefix_cache_bytes=64 << 20)
    eng.prefix_cache_device = torch.device("cpu", 0)
    prompt = random_prompt(40, seed=120)
    got = eng.generate(prompt, SamplingParams(max_tokens=6, **GREEDY))
    assert len(eng.prefix_cache) == (2 if family == STATE_FAMILY else 1)
    key, finished = next(reversed(eng.prefix_cache.entries.items()))      # the finished request's entry
    fresh = eng.model.new_cache(device=eng.device, dtype=eng.dtype)
    assert fresh.stored_tensors_at(len(key)) == tensors(finished)        # the estimate, tensor by tensor
    stored = sum(cache.stored_nbytes for cache in eng.prefix_cache.entries.values())
    arena = eng.host_arena
    assert len(asked) == 1 and asked[0] >= stored
    assert arena.locked_ahead == arena.stats()["slabs"] >= 1 and arena.fallbacks == 0   # none locked in a store
    resend = prompt + got.tokens + random_prompt(8, seed=121)
    eng.generate(resend, SamplingParams(max_tokens=6, **GREEDY))
    new_entry = fresh.stored_tensors_at(len(resend) + 6)
    if family == STATE_FAMILY:                       # recurrent state: the old entries stay beside both new ones
        assert asked[1] == stored + arena.slabs_nbytes(new_entry * 2)
    else:                                            # the stored entry is dropped as covered: the new one alone
        assert asked[1] == arena.slabs_nbytes(new_entry)
        # an edited conversation shares only a prefix with that entry: it stays, beside the new one
        edited = resend[:20] + random_prompt(30, seed=122)
        kept = eng.prefix_cache.nbytes
        got = eng.generate(edited, SamplingParams(max_tokens=6, **GREEDY))
        assert got.cached_tokens == 20 and len(eng.prefix_cache) == 2
        assert asked[2] == kept + arena.slabs_nbytes(fresh.stored_tensors_at(len(edited) + 6))


def test_a_dropped_engine_takes_its_prefix_caches_host_memory_with_it(ftw_packages):
    """The service drops an engine on a model switch or unload: its prefix cache's arena (up to the whole budget,
    page-locked on a GPU) and the arena's lock-ahead thread must go with it, or every switch would leak them."""
    import gc
    import weakref

    eng = load(ftw_packages, "qwen3_moe", "cpu", prefix_cache_bytes=8 << 20)
    eng.prefix_cache_device = torch.device("cpu", 0)
    eng.generate(random_prompt(30, seed=130), SamplingParams(max_tokens=4, **GREEDY))
    arena, thread = weakref.ref(eng.host_arena), eng.host_arena._grower
    assert len(eng.prefix_cache) == 1 and thread is not None
    del eng
    gc.collect()
    thread.join(5)
    assert arena() is None and not thread.is_alive()


def test_a_full_prefix_cache_evicts_before_copying_so_the_copy_reuses_the_memory(ftw_packages):
    """Budget for one entry (48 KiB: one 32 KiB slab; an entry ~25 KiB), conversations sharing nothing: each new entry evicts the last, and
    since the engine evicts before it copies, the copy takes the evicted entry's memory instead of spilling to
    torch's allocator (s33a: 64 of a 30K entry's 96 tensors). The evicted conversation is then prefilled again."""
    eng = load(ftw_packages, "qwen3_moe", "cpu", prefix_cache_bytes=48 << 10)
    eng.prefix_cache_device = torch.device("cpu", 0)
    for seed in (100, 101, 102):
        eng.generate(random_prompt(30, seed=seed), SamplingParams(max_tokens=4, **GREEDY))
        arena = eng.stats()["prefix_cache"]["host_arena"]
        assert arena["fallbacks"] == 0 and arena["slabs"] == 1 and len(eng.prefix_cache) == 1
    assert eng.stats()["prefix_cache"]["evictions"] == 2
    again = eng.generate(random_prompt(30, seed=100), SamplingParams(max_tokens=4, **GREEDY))
    assert again.cached_tokens == 0


def test_kv_growth_stops_doubling_at_the_engines_context(ftw_packages):
    """A restored 30K conversation plus 200 tokens doubled its KV buffers to 60K tokens, VRAM no plan held (s33a):
    the engine caps the growth at its context; a single step may still ask for more than the cap."""
    from runtime.kv_cache import KVCache

    kv = KVCache(2, 4, device="cpu", dtype=torch.float32)
    kv.max_tokens = 1000
    kv.update_and_fetch(torch.zeros(2, 700, 4), torch.zeros(2, 700, 4))
    assert kv.capacity == 768                                         # 700 in steps of 256
    kv.update_and_fetch(torch.zeros(2, 100, 4), torch.zeros(2, 100, 4))
    assert kv.capacity == 1000                                        # not 1,536 (2 x 768)
    kv.update_and_fetch(torch.zeros(2, 400, 4), torch.zeros(2, 400, 4))
    assert kv.capacity == 1200                                        # past the cap only what is needed
    eng = load(ftw_packages, "qwen3_moe", "cpu", context_length=64)
    eng.add_request(random_prompt(10, seed=95), SamplingParams(max_tokens=2, **GREEDY))
    eng.step()
    (seq,) = eng.scheduler.running
    assert {layer.max_tokens for layer in seq.payload.cache.layers} == {64}
