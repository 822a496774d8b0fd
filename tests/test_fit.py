"""Fit estimates: the planner decides placement (no second formula); the speed is a calibrated range."""
from __future__ import annotations

import pytest

from app.catalog import find_entry, load_catalog
from app.fit import CPU, GPU, HYBRID, NO_FIT, UNKNOWN, CostModel, Machine, estimate, fit_catalog
from app.hardware import probe
from runtime.experts.planner import Hardware, ModelShape, plan_memory

GiB = 1024 ** 3


def machine(*, vram_gib: float = 12, ram_gib: float = 64, cuda: bool = True, cpu_gbps: float = 40.0) -> Machine:
    hw = Hardware(vram_free=int(vram_gib * GiB) if cuda else 0, vram_total=int((vram_gib + 0.5) * GiB) if cuda else 0,
                  ram_total=int(ram_gib * GiB), ram_available=int((ram_gib - 2) * GiB),
                  pinnable=Hardware.pinnable_for("Linux", int(ram_gib * GiB)), h2d_gbps=25.6 if cuda else 0.0,
                  cpu_gbps=cpu_gbps, has_cuda=cuda, os_name="Linux")
    return Machine(hardware=hw, gpu_gbps=500.0, gpu_tflops=40.0, cpu_cores=8, cpu_read_gbps=cpu_gbps)


def fit(entry_id: str, m: Machine, context: int = 32768, **kw):
    entry = find_entry(entry_id)
    return estimate(entry.config(), codec=entry.codec, machine=m, context_length=context, id=entry.id, **kw)


@pytest.mark.parametrize("entry", load_catalog(), ids=lambda e: e.id)
def test_placement_is_the_planners(entry):
    m = machine()
    result = estimate(entry.config(), codec=entry.codec, machine=m, context_length=16384)
    # a GPU engine keeps a quantized model's dense weights in int8: the estimate plans with the same bytes
    shape = ModelShape.from_config(entry.config(), codec=entry.codec, dense_int8=entry.codec in ("int4", "fp4"))
    plan = plan_memory(shape, m.hardware, context_length=16384)
    assert result.verdict == plan.backend
    assert result.plan == plan.to_dict()
    assert result.experts_cached_pct == pytest.approx(100 * plan.expert_slots / plan.expert_total)
    assert result.shortfall_bytes == plan.shortfall_bytes


def test_kv_cache_at_the_chosen_context_leaves_less_vram_for_experts():
    short = fit("qwen3-30b-a3b-instruct-2507", machine(), context=4096)
    long = fit("qwen3-30b-a3b-instruct-2507", machine(), context=32768)
    assert short.verdict == long.verdict == HYBRID
    assert long.plan["kv_bytes"] == pytest.approx(8 * short.plan["kv_bytes"], rel=1e-9)
    assert long.experts_cached_pct < short.experts_cached_pct
    assert long.decode_tok_s[1] < short.decode_tok_s[1]
    assert "Hybrid" in short.badge and f"{short.experts_cached_pct:.0f}%" in short.badge
    # past what VRAM can hold next to the dense weights, the KV cache pushes the model to the CPU
    assert fit("qwen3-30b-a3b-instruct-2507", machine(), context=131072).verdict == CPU


def test_more_vram_means_more_experts_cached_and_faster_decode():
    fits = [fit("qwen3-30b-a3b-instruct-2507", machine(vram_gib=v)) for v in (8, 12, 16, 24)]
    cached = [f.experts_cached_pct for f in fits]
    fast = [f.decode_tok_s[1] for f in fits]
    assert cached == sorted(cached) and cached[0] < cached[-1]
    assert fast == sorted(fast) and fast[0] < fast[-1]
    for f in fits:
        lo, hi = f.decode_tok_s
        assert 0 < lo <= hi
        assert "estimate" in f.speed_text


def test_a_big_gpu_runs_everything_on_it():
    small = fit("gpt-oss-20b", machine(vram_gib=12))
    big = fit("gpt-oss-20b", machine(vram_gib=140))
    assert big.verdict == GPU and big.badge == "Runs fully on the GPU" and big.experts_cached_pct == 100
    assert big.decode_tok_s[0] > small.decode_tok_s[0] and big.decode_tok_s[1] >= small.decode_tok_s[1]


def test_does_not_fit_names_what_is_missing():
    result = fit("qwen3-235b-a22b-instruct-2507", machine(vram_gib=12, ram_gib=16))
    assert result.verdict == NO_FIT and result.short_of == "ram" and result.shortfall_bytes > 0
    assert f"{result.shortfall_bytes / 1e9:.1f} GB more RAM" in result.badge
    assert result.decode_tok_s is None and result.speed_text == ""


def test_experts_read_from_disk_slow_decode_down():
    ample = fit("qwen3-next-80b-a3b-instruct", machine(vram_gib=12, ram_gib=128))
    short = fit("qwen3-next-80b-a3b-instruct", machine(vram_gib=12, ram_gib=40))
    assert ample.plan["experts_on_disk_bytes"] == 0 < short.plan["experts_on_disk_bytes"]
    assert "read from disk" in short.badge
    assert short.decode_tok_s[1] < ample.decode_tok_s[1]


def test_layers_past_the_pinnable_share_slow_the_decode_estimate_down():
    """A Windows PC locks about half its RAM: qwen3-30b's experts outgrow it at 24 GB, the plan pins only some
    layers, and the estimate gives the others' misses to the CPU alone - slower than the same PC pinning all."""
    import dataclasses

    def pc(os_name):
        m = machine(vram_gib=8, ram_gib=24)
        return dataclasses.replace(m, hardware=dataclasses.replace(
            m.hardware, pinnable=Hardware.pinnable_for(os_name, m.hardware.ram_total)))

    qwen = "qwen3-30b-a3b-instruct-2507"
    win, lin = fit(qwen, pc("Windows"), context=8192), fit(qwen, pc("Linux"), context=8192)
    assert win.verdict == lin.verdict == HYBRID and win.plan["expert_slots"] == lin.plan["expert_slots"]
    assert 0 < win.plan["experts_pinned_layers"] < 48 == lin.plan["experts_pinned_layers"]
    assert win.decode_tok_s[0] < lin.decode_tok_s[0] and win.decode_tok_s[1] < lin.decode_tok_s[1]


def test_cost_model_efficiencies_bound_the_range():
    m = machine()
    wide = fit("qwen3-30b-a3b-instruct-2507", m, cost=CostModel(cpu_share_efficiency=(0.01, 1.0),
                                                                 h2d_efficiency=(0.5, 1.0)))
    narrow = fit("qwen3-30b-a3b-instruct-2507", m, cost=CostModel(cpu_share_efficiency=(0.3, 0.3),
                                                                   h2d_efficiency=(0.8, 0.8),
                                                                   gpu_bandwidth_efficiency=(0.6, 0.6)))
    assert wide.verdict == HYBRID
    assert wide.decode_tok_s[0] < narrow.decode_tok_s[0] <= narrow.decode_tok_s[1] < wide.decode_tok_s[1]


def test_a_gpu_plan_reads_misses_over_pcie_and_a_cpu_plan_on_the_cpu_kernel():
    """A hybrid plan's misses come over PCIe with a small CPU share beside (the kernel's own efficiency does not
    move it); a CPU-only plan's come from the CPU kernel alone (the share's efficiency does not move it)."""
    gpu, cpu = machine(), machine(cuda=False)
    qwen = "qwen3-30b-a3b-instruct-2507"
    base, fast_kernel, fast_share = CostModel(), CostModel(cpu_kernel_efficiency=(0.6, 0.6)), \
        CostModel(cpu_share_efficiency=(0.6, 0.6))
    assert fit(qwen, gpu).verdict == HYBRID and fit(qwen, cpu).verdict == CPU
    assert fit(qwen, gpu, cost=fast_kernel).decode_tok_s == fit(qwen, gpu, cost=base).decode_tok_s
    assert fit(qwen, gpu, cost=fast_share).decode_tok_s[0] > fit(qwen, gpu, cost=base).decode_tok_s[0]
    assert fit(qwen, cpu, cost=fast_share).decode_tok_s == fit(qwen, cpu, cost=base).decode_tok_s
    assert fit(qwen, cpu, cost=fast_kernel).decode_tok_s[0] > fit(qwen, cpu, cost=base).decode_tok_s[0]


def test_this_machine_without_a_gpu_gets_cpu_only_badges(tmp_path):
    report = probe(tmp_path)
    fits = fit_catalog(report, context_length=8192, cpu_read_gbps=10.0)
    assert [f.id for f in fits] == [e.id for e in load_catalog()]
    if report.cpu_only:
        assert {f.verdict for f in fits} <= {CPU, NO_FIT}
        for f in fits:
            if f.verdict == CPU:
                assert f.badge.startswith("CPU only") and f.decode_tok_s[0] <= f.decode_tok_s[1]
                assert f.prefill_tok_s[0] > 0


def test_a_config_the_planner_cannot_read_is_unknown_not_a_crash():
    result = estimate({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                       "vocab_size": 10, "num_experts_per_tok": 1}, codec="int4", machine=machine(), context_length=4096)
    assert result.verdict == UNKNOWN and "cannot estimate" in result.badge


def test_prefill_on_a_narrow_pcie_link_is_bound_by_streaming_experts():
    wide = machine(vram_gib=12)
    narrow_hw = wide.hardware.__class__(**{**wide.hardware.__dict__, "h2d_gbps": 3.2})   # gen3 x4
    narrow = Machine(hardware=narrow_hw, gpu_gbps=wide.gpu_gbps, gpu_tflops=wide.gpu_tflops, cpu_cores=8,
                     cpu_read_gbps=wide.cpu_read_gbps)
    fast = fit("qwen3-next-80b-a3b-instruct", wide)
    slow = fit("qwen3-next-80b-a3b-instruct", narrow)
    assert fast.verdict == slow.verdict == HYBRID
    assert slow.prefill_tok_s[1] < fast.prefill_tok_s[1]
    # the stream of uncached experts per prefill chunk over 3.2 GB/s x streaming efficiency is the bound
    streamed = slow.plan["experts_bytes"] - slow.plan["pool_bytes"]
    chunk = slow.plan["prefill_chunk"]                                  # the planner's streaming unit
    from runtime.experts.planner import PREFILL_CHUNK_TOKENS
    assert chunk == min(PREFILL_CHUNK_TOKENS, slow.context_length)
    assert slow.prefill_tok_s[1] == pytest.approx(chunk / (streamed / (3.2e9 * CostModel().prefill_stream_efficiency[1])))


def test_a_family_the_catalog_cannot_count_gets_placement_without_speed():
    config = {**find_entry("qwen3-30b-a3b-instruct-2507").config(), "model_type": "olmoe"}
    result = estimate(config, codec="int4", machine=machine(), context_length=4096)
    assert result.verdict == HYBRID and result.badge.startswith("Hybrid")
    assert result.decode_tok_s is None and "no speed estimate" in result.notes[-1]


def test_a_plan_without_stream_buffers_prefills_on_the_cores():
    """Where VRAM holds the dense weights and KV but not the prefill stream buffers, the plan stays hybrid (decode
    from the GPU) and the prefill estimate is the cores' expert compute, far below a streaming plan's."""
    qwen = "qwen3-30b-a3b-instruct-2507"
    tight = fit(qwen, machine(vram_gib=3.25), context=4096)      # (int8 dense weights: 1.7 GiB, the KV, no buffers)
    roomy = fit(qwen, machine(vram_gib=8), context=4096)
    assert tight.verdict == roomy.verdict == HYBRID
    assert tight.plan["prefill_streaming"] is False and roomy.plan["prefill_streaming"] is True
    assert tight.prefill_tok_s[1] < roomy.prefill_tok_s[0] / 3
    assert tight.decode_tok_s[0] > fit(qwen, machine(vram_gib=3.25, cuda=False), context=4096).decode_tok_s[1]


def test_the_speed_estimate_reads_int8_dense_weights_at_one_byte_each(monkeypatch):
    """All in VRAM, a decode step is the dense weights plus the active experts: with the projections and LM head in
    int8 (what the engine runs) the estimate is faster than the same plan read in bf16."""
    import dataclasses

    import runtime.experts.planner as planner
    entry = find_entry("qwen3-30b-a3b-instruct-2507")
    int8 = fit(entry.id, machine(vram_gib=48), context=8192)
    real = planner.ModelShape.from_config.__func__

    def bf16_dense(cls, config, **kw):
        shape = real(cls, config, **kw)
        return dataclasses.replace(shape, dense_int8=False, dense_nbytes=0)
    monkeypatch.setattr(planner.ModelShape, "from_config", classmethod(bf16_dense))
    bf16 = fit(entry.id, machine(vram_gib=48), context=8192)
    assert int8.verdict == bf16.verdict == "gpu"
    assert int8.decode_tok_s[1] > 1.2 * bf16.decode_tok_s[1]


def test_a_quantized_model_is_planned_with_int8_dense_weights_on_a_gpu():
    """The engine keeps a quantized model's dense weights in int8 on a GPU (runtime/models/quantized.py): the
    estimate counts those bytes (Qwen3-30B-A3B: ~1.8 GB, not 3.1), so more experts fit the same VRAM."""
    entry = find_entry("qwen3-30b-a3b-instruct-2507")
    bf16 = ModelShape.from_config(entry.config(), codec=entry.codec)
    int8 = ModelShape.from_config(entry.config(), codec=entry.codec, dense_int8=True)
    assert 0.55 < int8.dense_bytes / bf16.dense_bytes < 0.62
    result = fit(entry.id, machine(vram_gib=8), context=8192)
    assert result.plan["dense_bytes"] == int8.dense_bytes
    slots_bf16 = plan_memory(bf16, machine(vram_gib=8).hardware, context_length=8192).expert_slots
    assert result.plan["expert_slots"] > slots_bf16 + 400


# Measured decode rows (tok/s at batch 1, uniform routing, 8K context, int8 dense) on the GPU machine's hosts, each
# with the rates its runs printed: the H200 host of session 14 (~88 GB/s CPU read, PCIe link estimate 51.2 GB/s;
# docs/benchmarks.md "fourteenth pass", earlier passes for all in VRAM) and the H100 hosts of sessions 25-30 (read
# probe ~101 GB/s, pinned PCIe 55.1 GB/s; "twenty-fifth", "twenty-seventh" and "thirtieth" passes, all experts
# pinned). The cost model is fitted to bracket them; a change to the model that no longer does needs a refit
# (docs/library.md).
HOSTS = {"h200": dict(vram_gib=141, vram_gbps=4800.0, h2d_gbps=51.2, cpu_gbps=88.0),
         "h100": dict(vram_gib=80, vram_gbps=3352.0, h2d_gbps=55.1, cpu_gbps=101.3)}
MEASURED_DECODE = [("h200", "qwen3-30b-a3b-instruct-2507", 4, (70.3, 82.8)),
                   ("h200", "qwen3-30b-a3b-instruct-2507", 8, (84.5, 98.0)),
                   ("h200", "qwen3-30b-a3b-instruct-2507", None, (272.0, 301.2)),
                   ("h200", "qwen3.6-35b-a3b", 8, (93.4, 98.0)),
                   ("h100", "qwen3-30b-a3b-instruct-2507", 8, (108.8, 110.9)),
                   ("h100", "qwen3.6-35b-a3b", 8, (106.3, 106.3))]


@pytest.mark.parametrize("host, entry_id, budget_gib, measured", MEASURED_DECODE)
def test_the_decode_estimate_brackets_what_the_gpu_machine_measured(host, entry_id, budget_gib, measured):
    h = HOSTS[host]
    hw = Hardware(vram_free=(h["vram_gib"] - 2) * GiB, vram_total=h["vram_gib"] * GiB, ram_total=128 * GiB,
                  ram_available=120 * GiB, pinnable=Hardware.pinnable_for("Linux", 128 * GiB), h2d_gbps=h["h2d_gbps"],
                  cpu_gbps=h["cpu_gbps"], vram_gbps=h["vram_gbps"], has_cuda=True, os_name="Linux")
    gpu = Machine(hardware=hw, gpu_gbps=h["vram_gbps"], gpu_tflops=990.0, cpu_cores=16, cpu_read_gbps=h["cpu_gbps"])
    result = fit(entry_id, gpu, context=8192, vram_budget=None if budget_gib is None else budget_gib * GiB)
    slow, fast = result.decode_tok_s
    assert slow <= measured[0] and measured[1] <= fast, (result.decode_tok_s, measured)
    assert fast < 1.5 * measured[1]                     # and the range says something
    # one estimate: the plan the load prints carries the badge's range
    assert tuple(result.plan["estimated_decode_tok_s"]) == pytest.approx(result.decode_tok_s)


# Measured prefill rows (a 16K prompt, tok/s) on the H100 hosts, qwen3-30b-a3b at 8 GiB: in the 8K chunks an 8K-context
# plan streams in (s25b, s25d, s27c, s30a, s31c: 16,653-18,366), and in the 16K chunks of a 32K-context one (s31c:
# 30,397; docs/benchmarks.md "twenty-ninth pass").
MEASURED_PREFILL = [(8192, (16653.0, 18366.0)), (32768, (30397.0, 30397.0))]


@pytest.mark.parametrize("context, measured", MEASURED_PREFILL)
def test_the_prefill_estimate_brackets_what_the_gpu_machine_measured(context, measured):
    h = HOSTS["h100"]
    hw = Hardware(vram_free=(h["vram_gib"] - 2) * GiB, vram_total=h["vram_gib"] * GiB, ram_total=128 * GiB,
                  ram_available=120 * GiB, pinnable=Hardware.pinnable_for("Linux", 128 * GiB), h2d_gbps=h["h2d_gbps"],
                  cpu_gbps=h["cpu_gbps"], vram_gbps=h["vram_gbps"], has_cuda=True, os_name="Linux")
    gpu = Machine(hardware=hw, gpu_gbps=h["vram_gbps"], gpu_tflops=989.0, cpu_cores=16, cpu_read_gbps=h["cpu_gbps"])
    result = fit("qwen3-30b-a3b-instruct-2507", gpu, context=context, vram_budget=8 * GiB)
    assert result.plan["prefill_chunk"] == min(context, 16384)
    slow, fast = result.prefill_tok_s
    assert slow <= measured[0] and measured[1] <= fast, (result.prefill_tok_s, measured)
    assert fast < 1.5 * measured[1]
