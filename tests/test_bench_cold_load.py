"""The cold load (issue 10), at tiny sizes.

benchmarks/bench_cold_load.py: its package is a real FTW package (the checksums verify, the strict loader takes it,
the engine answers from it), a complete package is reused, a killed write resumes, and the benchmark runs end to
end. Then what the benchmark found in the load path, each test failing on the old code: the empty model allocated
once in its dtype, the dense file's pages released as they are copied, the all-in-VRAM pool filled from the file
without mapping it, the H2D probe leaving nothing locked (GPU), the dense weights counted once by the load-time
plan."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import bench_cold_load as bench
from tests.engine_fixtures import ftw_packages  # noqa: F401  (fixture)

TINY = bench.PackageShape(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2,
                          expert_width=128, dense_width=256, vocab=512, group=64, max_position=2048,
                          expert_pool_mib=1)


def test_written_package_verifies_loads_and_answers(tmp_path, monkeypatch):
    import tempfile

    import torch

    from runtime.engine import Engine, SamplingParams
    from runtime.ftw.verify import verify

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "pkg"
    info = bench.write_package(out, TINY, say=lambda *_: None)
    assert not info["reused"]
    assert not list(scratch.glob("cold-load-tok-*"))            # the tokenizer's scratch folder is gone
    assert set(json.loads((out / "manifest.json").read_text())["tokenizer_files"]) == set(bench.TOKENIZER_FILES)
    assert not out.with_name("pkg.partial").exists()          # written through the writer's atomic finish
    report = verify(out)
    assert report.ok, report.bad                                # every dense tensor and expert layer hashes right
    assert report.nbytes == info["nbytes"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["experts"]["group_size"] == 64 and manifest["experts"]["codec"] == "int4"
    assert manifest["experts"]["block_nbytes"] % 4096 == 0

    engine = Engine.load(out, device="cpu", context_length=256, max_batch=1)
    # the dense weights are sane: norms at 1, projections with std ~0.02 (not zeros, not the same tensor twice)
    params = dict(engine.model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones_like(params["model.norm.weight"]))
    q0, q1 = params["model.layers.0.self_attn.q_proj.weight"], params["model.layers.1.self_attn.q_proj.weight"]
    assert 0.015 < float(q0.detach().float().std()) < 0.025 and not torch.equal(q0, q1)
    expert = engine.package.experts.dequantize(1, 3)
    assert 0.01 < float(expert.gate.std()) < 0.04 and torch.isfinite(expert.down).all()

    prompt = engine.tokenizer.encode(engine.chat_template.render(bench.CHAT, add_generation_prompt=True))
    result = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=()))
    assert len(result.tokens) == 3 and all(0 <= t < TINY.vocab for t in result.tokens)


def test_the_qwen36_shape_writes_a_linear_attention_package_that_answers(tmp_path):
    """`--shape qwen3.6-35b-a3b` at a tiny size: Qwen3.5/3.6-MoE's text model (Gated DeltaNet layers, a shared
    expert, fp4 experts) written through the same writer, verified, loaded by the strict loader, answering."""
    from runtime.engine import Engine, SamplingParams
    from runtime.ftw.verify import verify
    from runtime.models.gated_deltanet import GatedDeltaNet

    tiny = replace(bench.QWEN36, layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, linear_head_dim=32,
                   experts=8, top_k=2, expert_width=64, vocab=512, max_position=2048, expert_pool_mib=1)
    out = tmp_path / "pkg"
    info = bench.write_package(out, tiny, say=lambda *_: None)
    assert verify(out).ok and not info["reused"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_type"] == "qwen3_5_moe_text" and manifest["experts"]["codec"] == "fp4"
    assert manifest["experts"]["block_size"] == 32 and "group_size" not in manifest["experts"]   # as converted
    engine = Engine.load(out, device="cpu", context_length=256, max_batch=1)
    assert sum(isinstance(m, GatedDeltaNet) for m in engine.model.modules()) == 3      # 3 layers of 4
    assert any("shared_expert" in name for name, _ in engine.model.named_parameters())
    prompt = engine.tokenizer.encode(engine.chat_template.render(bench.CHAT, add_generation_prompt=True))
    result = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=()))
    assert len(result.tokens) == 3 and all(0 <= t < tiny.vocab for t in result.tokens)
    assert bench.SHAPES["qwen3.6-35b-a3b"] == bench.QWEN36 and bench.SHAPES["qwen3-30b-a3b"] == bench.PackageShape()


def test_complete_package_is_reused_and_another_shape_is_rewritten(tmp_path):
    out = tmp_path / "pkg"
    bench.write_package(out, TINY, say=lambda *_: None)
    stamp = (out / "experts.bin").stat().st_mtime_ns
    again = bench.write_package(out, TINY, say=lambda *_: None)
    assert again["reused"] and (out / "experts.bin").stat().st_mtime_ns == stamp
    other = bench.write_package(out, replace(TINY, experts=4), say=lambda *_: None)
    assert not other["reused"]
    assert json.loads((out / "manifest.json").read_text())["experts"]["num_experts"] == 4


def test_an_interrupted_write_is_not_taken_for_a_package(tmp_path):
    import subprocess
    import sys

    from runtime.ftw.reader import FTWError, FTWPackage
    from runtime.ftw.verify import verify
    from runtime.ftw.writer import EXIT_AFTER_UNITS_ENV

    out = tmp_path / "pkg"
    # a separate process writes and is killed after two committed units (the writer's own test hook)
    code = ("import dataclasses, sys; from benchmarks import bench_cold_load as b; "
            f"b.write_package(sys.argv[1], b.PackageShape(**{dataclasses.asdict(TINY)!r}), say=lambda *_: None)")
    killed = subprocess.run([sys.executable, "-c", code, str(out)], cwd=bench.ROOT,
                            env={**os.environ, EXIT_AFTER_UNITS_ENV: "2"}, timeout=120)
    assert killed.returncode == 75
    with pytest.raises(FTWError):
        FTWPackage.open(out)
    info = bench.write_package(out, TINY, say=lambda *_: None)     # resumes from the journal
    assert not info["reused"] and verify(out).ok


def test_benchmark_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "cold.json"
    assert bench.main(["--folder", str(tmp_path / "pkg"), "--layers", "1", "--experts", "8", "--vocab", "1024",
                       "--vram-budget", "0", "--device", "cpu", "--decode-steps", "2", "--out", str(out),
                       "--long-prompts", "40", "--resend", "2", "--resend-tokens", "5"]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    phases = {p["phase"]: p for p in row["phases"]}
    assert row["not_found"] == []                        # every wrapped function still exists under its name
    for name in ("open package (manifest, file sizes)", "dense weights to the device", "tokenizer",
                 "first token (the step that returns it + sample)", "decode step (steady)"):
        assert phases[name]["seconds"] > 0, name
    assert 0 < row["load_s"] < row["load_to_first_token_s"]
    assert row["rss_peak"] >= row["rss_after_load"] > 0
    assert row["package_bytes"] == report["package"]["nbytes"]
    assert report["warm_read"]["bytes"] == row["package_bytes"]
    # the long prompt, then two agent turns: each resends the last conversation with 5 new tokens, and the prefix
    # cache serves all of it but the new tokens
    assert [p["tokens"] for p in row["long_prompts"]] == [40, 45, 50]
    assert [p["cached_tokens"] for p in row["long_prompts"]] == [0, 40, 45]
    assert all(p["error"] is None and len(p["step_seconds"]) >= 1 for p in row["long_prompts"])
    printed = capsys.readouterr().out
    assert "| VRAM budget |" in printed and "dense weights to the device" in printed
    assert "| from the prefix cache |" in printed and "| 45 |" in printed


def test_benchmark_times_new_conversations_token_by_token(tmp_path, capsys):
    """--new-chats: conversations after the first, each timed to every token (the second is where a decode graph
    is recorded on a GPU); without CUDA there are no graphs to count. --profile-new-chat lists the functions of the
    second conversation's steps up to its first token, headed by their seconds."""
    out, functions = tmp_path / "cold.json", tmp_path / "chat.txt"
    assert bench.main(["--folder", str(tmp_path / "pkg"), "--layers", "1", "--experts", "8", "--vocab", "1024",
                       "--vram-budget", "0", "--device", "cpu", "--decode-steps", "3", "--out", str(out),
                       "--new-chats", "2", "--new-chat-steps", "2", "--profile-new-chat", str(functions)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    chats = row["new_chats"]
    listed = functions.read_text()
    assert listed.startswith(f"a new conversation's steps to its first token of {chats[0]['token_seconds'][0]:.4f} s")
    assert "cumulative" in listed and "(step)" in listed
    assert len(chats) == 2 and all(c["tokens"] == row["prompt_tokens"] and c["error"] is None for c in chats)
    assert all(len(c["token_seconds"]) == 3 and all(t > 0 for t in c["token_seconds"]) for c in chats)
    assert all(c["graph_records"] is None for c in chats)          # a CPU engine records no decode graphs
    printed = capsys.readouterr().out
    table = printed.split("| decode graphs recorded (s) | error |")[1]
    assert "| 0 | 1 | 2 |" in table and "| 0 | 1 | 3 |" in table and "| - | - |" in table
    assert len(row["steps"]) == 4                                  # the first conversation: --decode-steps 3
    # the expert tier's own stats (a hybrid tier's: each side's totals, whether the split stream was on)
    assert row["expert_stats"]["backend"] == row["plan"]["backend"] == "resident"


def test_benchmark_times_a_conversation_decoding_beside_the_long_prompts(tmp_path, capsys):
    out = tmp_path / "cold.json"
    assert bench.main(["--folder", str(tmp_path / "pkg"), "--layers", "1", "--experts", "8", "--vocab", "1024",
                       "--vram-budget", "0", "--device", "cpu", "--decode-steps", "1", "--out", str(out),
                       "--long-prompts", "40", "--resend", "1", "--resend-tokens", "5", "--beside"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # the decoding conversation shares the steps but not the prefix cache: the resend is still served from it
    assert [p["cached_tokens"] for p in row["long_prompts"]] == [0, 40]
    for p in row["long_prompts"]:
        assert p["error"] is None
        after = p["beside_decode_after_seconds"]
        assert len(after) == bench.BESIDE_STEPS_AFTER and all(s > 0 for s in after)
    printed = capsys.readouterr().out
    assert "| decoding beside: steps after, median / max s |" in printed
    assert " / " in printed.split("| decoding beside: steps after, median / max s |")[1]


def test_benchmark_profiles_the_last_prompts_final_step_and_the_first_prompts_slowest(tmp_path):
    """--profile-tail writes torch.profiler's table of the last prompt's final step (its lone last token when the
    model pauses before it), with that step's measured seconds at its head; --python-profile the functions of the
    first prompt's slowest step (first-time work such as a compile shows there by name)."""
    table, functions = tmp_path / "tail.txt", tmp_path / "slowest.txt"
    assert bench.main(["--folder", str(tmp_path / "pkg"), "--layers", "1", "--experts", "8", "--vocab", "1024",
                       "--vram-budget", "0", "--device", "cpu", "--decode-steps", "1", "--out", str(tmp_path / "o.json"),
                       "--long-prompts", "40", "--resend", "1", "--resend-tokens", "5",
                       "--profile-tail", str(table), "--python-profile", str(functions)]) == 0
    text = table.read_text()
    (row,) = json.loads((tmp_path / "o.json").read_text())["rows"]
    last_step = row["long_prompts"][-1]["step_seconds"][-1]
    assert text.startswith(f"step of {last_step:.4f} s (profiled)")
    assert "aten::" in text and "CPU total" in text
    assert text.endswith("host waits for the GPU by call site: not counted (no CUDA here)\n")
    slowest = max(row["long_prompts"][0]["step_seconds"])
    listed = functions.read_text()
    assert listed.startswith(f"slowest step of {slowest:.4f} s (cProfile)")
    assert "cumulative" in listed and "(step)" in listed       # the engine's step, named in the listing


def _waits_here(n: int) -> None:
    for _ in range(n):
        warnings.warn("called a synchronizing CUDA operation")    # torch's text under its sync debug mode


def _waits_there() -> None:
    _waits_here(1)


def test_sync_sites_counts_each_wait_by_its_innermost_frames_and_lets_other_warnings_through(monkeypatch):
    """The waits table of --profile-tail on a GPU: torch's sync debug mode warns at each synchronizing call, and
    SyncSites counts them by the innermost frames under SITE_ROOT (this file's here, runtime/ in a real run). This
    machine has no CUDA: the warnings are raised by hand, as torch raises them."""
    monkeypatch.setattr(bench, "SITE_ROOT", str(Path(__file__).resolve()))
    with pytest.warns(UserWarning, match="something else"):
        with bench.SyncSites(cuda=False) as sites:
            _waits_here(3)
            _waits_there()
            warnings.warn("something else")                 # not a wait: shown as usual
    assert sum(sites.sites.values()) == 4
    (here,) = [site for site in sites.sites
               if site.startswith("test_bench_cold_load.py") and "_waits_there" not in site]
    assert "_waits_here" in here and sites.sites[here] == 3
    (there,) = [site for site in sites.sites if "_waits_there" in site]
    assert there.index("_waits_here") < there.index("_waits_there") and sites.sites[there] == 1   # innermost first
    sites.cuda = True                                       # (the table a GPU run writes)
    table = sites.table()
    assert "| 3 | " + here + " |" in table and "| 1 | " + there + " |" in table


# ---------------------------------------------------------------------------------- the load path's memory

def _mapped_rss(path) -> int:
    """Bytes of `path` this process has resident through its mappings (Linux /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            head = line.split()
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):          # a mapping's header (the path is optional)
                inside = len(head) >= 6 and head[5] == str(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_empty_model_is_allocated_once_in_the_asked_dtype():
    """A bf16 model on the device was first allocated in fp32, then cast: 3x its weights at once (9.3 GB of VRAM
    for Qwen3-30B-A3B's 3.1 GB), more than an 8 GB card holds. Count every real allocation while it is built."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from runtime.loading import build_empty_model

    class Allocations(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    Allocations.nbytes += t.numel() * t.element_size()
            return out

    config = TINY.config(bos=None, eos=1)
    with Allocations():
        model = build_empty_model(config, experts=None, device="cpu", dtype=torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope.inv_freq.dtype == torch.float32             # rebuilt in fp32 as before
    assert weights <= Allocations.nbytes <= weights * 1.05 + 65536


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_dense_file_pages_are_released_after_loading(tmp_path):
    """Once the dense weights are copied into the model, the mapped dense.bin must not stay in the RSS (3.1 GB for
    Qwen3-30B-A3B, on top of its copy on the GPU or in the model's own tensors), nor pile up while they load."""
    import torch

    from runtime.ftw.reader import FTWPackage
    from runtime.loading import build_empty_model, load_dense_weights

    out = tmp_path / "pkg"
    bench.write_package(out, replace(TINY, vocab=8192), say=lambda *_: None)     # ~4 MiB of embeddings
    package = FTWPackage.open(out)
    dense = out / "dense.bin"
    model = build_empty_model(package.config, experts=None, device="cpu", dtype=torch.float32)
    # each tensor's pages go as soon as it is copied, so the mapping never holds more than about one tensor
    # (plus pages the kernel maps around each fault) while the rest loads, rather than the whole file at the end
    mapped_before_each = []
    read = package.dense
    package.dense = lambda name: (mapped_before_each.append(_mapped_rss(dense)), read(name))[1]
    load_dense_weights(model, package)
    assert len(mapped_before_each) == len(package.dense_names())
    assert max(mapped_before_each) <= 512 * 1024, "copied tensors stayed mapped while the rest loaded"
    assert _mapped_rss(dense) < 64 * 1024, "the dense file's pages stayed mapped after loading"
    # the loaded weights are right, and the package can still be read after the release
    assert torch.equal(model.lm_head.weight, package.dense("lm_head.weight").float())
    assert _mapped_rss(dense) >= package.dense("lm_head.weight").numel() * 2 * 0.9    # (the check can see pages)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
@pytest.mark.parametrize("threads, chunk", [(1, 1 << 20), (3, 12288)])
def test_experts_copied_to_the_device_pool_from_the_file_without_mapping_it(tmp_path, threads, chunk):
    """The all-in-VRAM load: every block lands in its slot (slot i = block i of the file), read from the file in
    parallel chunks; the expert file's pages are never mapped into this process (they used to stay in the RSS
    for good: the whole expert file, 15 GB for Qwen3-30B-A3B, although every expert lives on the GPU)."""
    import numpy as np
    import torch

    from runtime.experts.host_store import HostExpertStore
    from runtime.ftw.reader import FTWPackage

    out = tmp_path / "pkg"
    bench.write_package(out, replace(TINY, layers=3), say=lambda *_: None)
    package = FTWPackage.open(out)
    store = HostExpertStore.from_ftw(package.experts)
    pool = torch.zeros((len(store.layers) * store.num_experts, store.block_nbytes), dtype=torch.uint8)
    info = store.copy_to_device(pool, threads=threads, chunk_bytes=chunk)
    assert info["threads"] == threads
    assert np.array_equal(pool.numpy().reshape(-1), np.fromfile(out / "experts.bin", dtype=np.uint8))
    assert _mapped_rss(out / "experts.bin") == 0


def test_copy_to_device_refuses_a_wrong_pool_and_names_a_truncated_file(tmp_path):
    import torch

    from runtime.experts.host_store import ExpertStoreError, HostExpertStore
    from runtime.ftw.reader import FTWPackage

    out = tmp_path / "pkg"
    bench.write_package(out, TINY, say=lambda *_: None)
    store = HostExpertStore.from_ftw(FTWPackage.open(out).experts)
    with pytest.raises(ExpertStoreError, match="destination"):
        store.copy_to_device(torch.zeros((3, store.block_nbytes), dtype=torch.uint8))
    full = (out / "experts.bin").stat().st_size
    os.truncate(out / "experts.bin", full - 5000)
    pool = torch.zeros((len(store.layers) * store.num_experts, store.block_nbytes), dtype=torch.uint8)
    with pytest.raises(ExpertStoreError, match="experts.bin.*ends at byte"):
        store.copy_to_device(pool, threads=2, chunk_bytes=8192)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_tier_holding_every_expert_fills_its_pool_from_the_file(tmp_path):
    """HybridExperts with every expert pinned in the pool (what the planner builds when the experts fit in VRAM)
    warms up through copy_to_device: all resident, the pool equals the file, nothing of it stays mapped, and a
    call computes what the reference computes."""
    import numpy as np
    import torch

    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec, expert_forward
    from runtime.ftw.reader import FTWPackage

    out = tmp_path / "pkg"
    bench.write_package(out, TINY, say=lambda *_: None)
    store = HostExpertStore.from_ftw(FTWPackage.open(out).experts)
    every = tuple((layer, e) for layer in store.layers for e in range(store.num_experts))
    tier = HybridExperts(store, ExpertSpec(), device="cpu", dtype=torch.float32,
                         options=HybridOptions(slots=len(every), hot_set=every, top_k=TINY.top_k))
    assert tier._all_resident
    assert np.array_equal(tier.cache.pool.numpy().reshape(-1), np.fromfile(out / "experts.bin", dtype=np.uint8))
    assert _mapped_rss(out / "experts.bin") == 0
    x = torch.randn(3, TINY.hidden)
    ids = torch.tensor([[0, 5], [7, 2], [3, 3]])
    w = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.3, 0.7]])
    want = torch.stack([sum(w[t, k] * expert_forward(ExpertSpec(), store.dequantize(1, int(ids[t, k])), x[t:t + 1])[0]
                            for k in range(2)) for t in range(3)])
    torch.testing.assert_close(tier(1, x, ids, w), want, rtol=1e-4, atol=1e-5)


def test_h2d_probe_leaves_no_page_locked_memory_behind(device):
    """The planner's H2D probe (run at every GPU load) page-locked 256 MiB through torch's caching host allocator,
    which keeps it locked for the life of the process, and filled it with random bytes (most of a second)."""
    if device != "cuda":
        pytest.skip("needs CUDA: run with --device cuda on the GPU machine")
    import torch

    from runtime.experts.planner import measure_h2d_gbps

    def pinned_by_torch() -> int:       # bytes torch's pinned allocator holds, cached blocks included
        stats = torch.cuda.host_memory_stats()
        return next(stats[k] for k in ("allocated_bytes.current", "reserved_bytes.current",
                                       "allocated_bytes.all.current") if k in stats)

    before = pinned_by_torch()
    assert measure_h2d_gbps(nbytes=64 << 20, repeats=3) > 1.0
    assert pinned_by_torch() == before


def test_package_without_transformers_gets_the_same_tokenizer(tmp_path, monkeypatch):
    """The GPU machine may lack transformers (a test-only dependency): the tokenizer files are then written by hand,
    and the engine reads the same tokens, EOS ids and chat template from them."""
    from runtime.engine import Engine
    from tests.fixtures import tokenizer as fixtures

    with_hf = bench.write_tokenizer(tmp_path / "hf")

    def no_transformers(*_args, **_kwargs):
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(fixtures, "save_tokenizer", no_transformers)
    assert bench.write_tokenizer(tmp_path / "by-hand") == with_hf
    bench.write_package(tmp_path / "pkg", TINY, say=lambda *_: None)
    engine = Engine.load(tmp_path / "pkg", device="cpu", context_length=256, max_batch=1)
    assert engine.eos_ids == tuple(with_hf["gen_eos"])
    text = engine.chat_template.render(bench.CHAT, add_generation_prompt=True)
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text


def test_load_time_probe_does_not_count_the_dense_weights_twice(monkeypatch):
    """At load the engine puts the dense weights on the GPU first, then the expert tier probes the free VRAM and
    plans -- and the plan adds the dense weights to its fixed cost. Probed as they were, they were subtracted
    twice: an 8 GiB card with Qwen3-30B-A3B at 8K context fell back to the CPU although hybrid fits."""
    import torch

    from runtime.experts.planner import GiB, Hardware, ModelShape, plan_memory

    config = bench.PackageShape().config(bos=None, eos=1)
    shape = ModelShape.from_config(config, codec="int4", group_size=128)
    total, before_load = 8 * GiB, int(7.6 * GiB)               # the card; free before the model arrives
    dense = shape.dense_bytes
    cached = 150 << 20                                         # torch holds freed q/k/v blocks after fusing them
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (before_load - dense - cached, total))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in 8 GiB card")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: dense + cached)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: dense)

    as_before = Hardware.probe(device="cuda", measure=False)
    at_load = Hardware.probe(device="cuda", measure=False, counted_in_plan=dense)
    assert at_load.vram_free == before_load
    assert as_before.vram_free == before_load - dense - cached
    wrong = plan_memory(shape, as_before, context_length=8192, max_sequences=1)
    right = plan_memory(shape, at_load, context_length=8192, max_sequences=1)
    # what the engine did: CPU-only (since the planner keeps a GPU plan without prefill streaming where only the
    # stream buffers do not fit: that, with next to no slots)
    assert wrong.backend == "cpu" or (not wrong.prefill_streaming and wrong.expert_slots < 100)
    assert right.backend == "hybrid" and right.prefill_streaming and right.expert_slots > 500
    assert right.vram_planned <= before_load                    # and it does fit what was free


def test_engine_tells_the_expert_tier_what_it_placed_on_the_device(ftw_packages, device):
    from runtime.engine import Engine, resident_experts_factory

    seen = {}

    def factory(package, spec, **kw):
        seen.update(kw)
        return resident_experts_factory(package, spec, **kw)

    eng = Engine.load(ftw_packages("qwen3_moe", "int4"), device=device, experts_factory=factory)
    assert seen["dense_bytes_on_device"] == (eng.plan["dense_bytes"] if device == "cuda" else 0)


def test_a_failing_bulk_load_falls_back_to_block_copies(tmp_path, monkeypatch, caplog):
    import numpy as np
    import torch

    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.hybrid import HybridExperts, HybridOptions
    from runtime.experts.interface import ExpertSpec
    from runtime.ftw.reader import FTWPackage

    out = tmp_path / "pkg"
    bench.write_package(out, TINY, say=lambda *_: None)
    store = HostExpertStore.from_ftw(FTWPackage.open(out).experts)

    def broken(self, dst, **_kw):
        dst[0].fill_(7)                                  # half-done work is overwritten by the fallback
        raise RuntimeError("CUDA error: invalid argument")

    monkeypatch.setattr(HostExpertStore, "copy_to_device", broken)
    every = tuple((layer, e) for layer in store.layers for e in range(store.num_experts))
    tier = HybridExperts(store, ExpertSpec(), device="cpu", dtype=torch.float32,
                         options=HybridOptions(slots=len(every), hot_set=every, top_k=TINY.top_k))
    assert "bulk expert load failed" in caplog.text and tier._all_resident
    assert np.array_equal(tier.cache.pool.numpy().reshape(-1), np.fromfile(out / "experts.bin", dtype=np.uint8))
