"""Without an explicit experts factory the engine lets the planner place experts on a GPU."""
from __future__ import annotations

import torch

from runtime.engine import default_experts_factory, resident_experts_factory
from runtime.experts.hybrid import hybrid_experts_factory
from tests.engine_fixtures import ftw_packages  # noqa: F401  (session fixture)


def test_gpu_loads_go_through_the_planner_and_cpu_loads_stay_resident():
    assert default_experts_factory(torch.device("cuda")) is hybrid_experts_factory
    assert default_experts_factory(torch.device("cuda:0")) is hybrid_experts_factory
    assert default_experts_factory(torch.device("cpu")) is resident_experts_factory


def test_a_gpu_plan_keeps_quantized_experts_packed_in_a_pool_that_holds_them_all(ftw_packages):
    """When every expert fits, int4 experts stay packed (the plan reserved packed bytes, bf16 would need ~4x):
    the pool holds all of them, every layer is resident (sync-free), and greedy decoding matches the
    engine with every expert dequantized."""
    import functools

    from runtime.engine import Engine, SamplingParams
    from runtime.experts.hybrid import HybridExperts
    from runtime.experts.planner import GiB, Hardware

    path = ftw_packages("qwen3_moe", "int4")
    prompt = [3, 17, 42, 5, 99, 7, 64, 12]
    sampling = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[])
    want = Engine.load(path, device="cpu").generate(prompt, sampling).tokens
    hw = Hardware(vram_free=8 * GiB, vram_total=8 * GiB, ram_total=16 * GiB, ram_available=16 * GiB,
                  pinnable=8 * GiB, h2d_gbps=20.0, cpu_gbps=10.0, has_cuda=True)
    eng = Engine.load(path, device="cpu", experts_factory=functools.partial(hybrid_experts_factory, hardware=hw))
    experts = eng.model.experts
    assert isinstance(experts, HybridExperts) and experts.planned["backend"] == "gpu"
    # the planner's own lines travel with the engine's plan, for the app's console
    assert eng.plan["experts"]["planner"]["summary_lines"][0] == "backend: gpu"
    assert experts.options.slots == len(experts.store.layers) * experts.store.num_experts
    assert all(experts.cache.layer_resident(layer) for layer in experts.store.layers)
    assert eng.generate(prompt, sampling).tokens == want
    assert experts.counters.total.cpu_experts == 0 and experts.counters.total.misses == 0


def test_the_engine_prefills_in_the_shorter_chunk_a_tight_plan_asks_for(ftw_packages, monkeypatch):
    """A plan that could only fit a shorter prefill chunk's workspace (a tight VRAM budget) sets the engine's
    chunk, unless the caller chose one; greedy answers do not depend on the chunk."""
    import dataclasses
    import functools

    from runtime.engine import Engine, SamplingParams
    from runtime.experts import planner

    path = ftw_packages("qwen3_moe", "int4")
    real = planner.plan_memory
    monkeypatch.setattr(planner, "plan_memory", lambda *a, **k: dataclasses.replace(real(*a, **k), prefill_chunk=3))
    factory = functools.partial(hybrid_experts_factory, slots=6)
    tight = Engine.load(path, device="cpu", experts_factory=factory)
    chosen = Engine.load(path, device="cpu", experts_factory=factory, prefill_chunk=5)
    assert tight.plan["prefill_chunk"] == 3 and tight.scheduler.config.prefill_chunk == 3
    assert chosen.plan["prefill_chunk"] == 5 and chosen.scheduler.config.prefill_chunk == 5
    prompt, greedy = [3, 17, 42, 5, 99, 7, 64, 12], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[])
    assert tight.generate(prompt, greedy).tokens == chosen.generate(prompt, greedy).tokens


def test_a_load_whose_misses_run_on_the_cpu_shows_the_kernels_compiling_as_a_stage(ftw_packages):
    """The CPU kernels compile at the first load on a machine (about a minute): the load's progress names that
    step, between the experts' start and end, instead of sitting at "experts 0%"; a plan with every expert in
    VRAM runs nothing on the CPU and shows no such stage."""
    import functools

    from runtime.engine import Engine
    from runtime.experts.hybrid import KERNELS_STAGE
    from runtime.experts.planner import GiB, Hardware

    path = ftw_packages("qwen3_moe", "int4")
    seen: list[tuple[int, int, str]] = []
    Engine.load(path, device="cpu", experts_factory=functools.partial(hybrid_experts_factory, slots=6),
                progress=lambda done, total, stage: seen.append((done, total, stage)))
    kernels = [i for i, (_, _, stage) in enumerate(seen) if stage == KERNELS_STAGE]
    assert [seen[i][:2] for i in kernels] == [(0, 1), (1, 1)]
    experts_done = seen.index((1, 1, "experts"))
    assert kernels[-1] < experts_done
    seen.clear()
    hw = Hardware(vram_free=8 * GiB, vram_total=8 * GiB, ram_total=16 * GiB, ram_available=16 * GiB,
                  pinnable=8 * GiB, h2d_gbps=20.0, cpu_gbps=10.0, has_cuda=True)
    Engine.load(path, device="cpu", experts_factory=functools.partial(hybrid_experts_factory, hardware=hw),
                progress=lambda done, total, stage: seen.append((done, total, stage)))
    assert (1, 1, "experts") in seen and all(stage != KERNELS_STAGE for _, _, stage in seen)


def test_the_prefix_cache_takes_no_more_host_ram_than_the_plan_leaves(ftw_packages):
    """The engine's prefix cache lives in host RAM (a GPU engine's conversations, or a CPU engine's): its budget is
    at most what the planner left beside the experts, so a machine whose RAM they fill caches less instead of
    pushing the experts' pages out; a caller's own size wins, and without a planner the default stands."""
    import functools

    from runtime.engine import DEFAULT_PREFIX_CACHE_BYTES, Engine
    from runtime.experts.planner import HOST_RESERVE, MiB, GiB, Hardware

    path = ftw_packages("qwen3_moe", "int4")

    def load(ram: int, **kw):
        hw = Hardware(vram_free=8 * GiB, vram_total=8 * GiB, ram_total=ram, ram_available=ram, pinnable=ram // 2,
                      h2d_gbps=20.0, cpu_gbps=10.0, has_cuda=True)
        return Engine.load(path, device="cpu", experts_factory=functools.partial(hybrid_experts_factory, hardware=hw),
                           **kw)

    tight = load(HOST_RESERVE + 512 * MiB)
    assert tight.plan["experts"]["planner"]["prefix_cache_bytes"] == 512 * MiB
    assert tight.prefix_cache.max_bytes == tight.plan["prefix_cache_bytes"] == 512 * MiB
    assert load(64 * GiB).prefix_cache.max_bytes == DEFAULT_PREFIX_CACHE_BYTES     # the device's own cap
    assert load(HOST_RESERVE + 512 * MiB, prefix_cache_bytes=3 * MiB).prefix_cache.max_bytes == 3 * MiB
    assert Engine.load(path, device="cpu").prefix_cache.max_bytes == DEFAULT_PREFIX_CACHE_BYTES   # no planner


def test_a_gpu_load_of_a_linear_attention_model_warms_its_prefill_kernels_as_a_stage(ftw_packages, device):
    """On a GPU the load compiles the linear-attention prefill kernels as a progress stage of its own (a fresh
    machine's first prompt no longer waits for them), and the engine then answers; a CPU load has no such stage
    (nothing compiles there). `--device cuda` runs the GPU side on the GPU machine."""
    from runtime.engine import GPU_KERNELS_STAGE, Engine, SamplingParams

    cuda = torch.device(device).type == "cuda"
    seen: list[tuple[int, int, str]] = []
    eng = Engine.load(ftw_packages("qwen3_next", "f32"), device=device,
                      dtype=torch.bfloat16 if cuda else torch.float32,
                      progress=lambda done, total, stage: seen.append((done, total, stage)))
    stages = [(done, total) for done, total, stage in seen if stage == GPU_KERNELS_STAGE]
    assert stages == ([(0, 1), (1, 1)] if cuda else [])
    out = eng.generate([3, 17, 42, 5, 99, 7, 64, 12] * 9, SamplingParams(temperature=0.0, max_tokens=3,
                                                                         stop_token_ids=[]))
    assert len(out.tokens) == 3


def test_a_plan_pinned_in_part_pins_most_of_the_pool_to_the_layers_the_gpu_cannot_read(ftw_packages, monkeypatch):
    """A store pinned in part: every miss of an unpinned layer runs on the CPU alone, so the factory pins 3/4 of
    the pool to those layers' experts (whole layers, in order, without routing statistics) instead of half of it to
    the statistics' hottest; a fully pinned plan keeps the old rule. Greedy answers do not depend on it."""
    import dataclasses
    import functools

    from runtime.engine import Engine, SamplingParams
    from runtime.experts import planner
    from runtime.experts.hybrid import COSTLY_HOT_SHARE

    path = ftw_packages("qwen3_moe", "int4")
    real = planner.plan_memory
    prompt, greedy = [3, 17, 42, 5, 99, 7, 64, 12], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[])
    whole = Engine.load(path, device="cpu", experts_factory=functools.partial(hybrid_experts_factory, slots=6))
    experts = whole.model.experts
    layers, per_layer = experts.store.layers, experts.store.num_experts
    assert len(layers) >= 2 and experts.cache.directory.pinned == set()    # no statistics: nothing pinned
    monkeypatch.setattr(planner, "plan_memory", lambda *a, **k: dataclasses.replace(
        real(*a, **k), experts_pinned=False, experts_pinned_layers=1))
    part = Engine.load(path, device="cpu", experts_factory=functools.partial(hybrid_experts_factory, slots=6))
    costly = [(layer, e) for layer in layers[1:] for e in range(per_layer)]
    assert part.model.experts.cache.directory.pinned == set(costly[:int(6 * COSTLY_HOT_SHARE)])
    # the console says so, beside the planner's own lines
    assert f"expert slots: {int(6 * COSTLY_HOT_SHARE)} of 6 hold the experts of the {len(layers) - 1} layers not in " \
        "pinned RAM (their misses would run on the CPU alone)" in part.plan["experts"]["planner"]["summary_lines"]
    assert part.generate(prompt, greedy).tokens == whole.generate(prompt, greedy).tokens
