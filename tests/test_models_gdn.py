"""Qwen3-Next and Qwen3.5-MoE end to end against transformers (fp32, CPU, tiny fixtures): logits,
greedy generation, batched == sequential, prefix-cached == uncached, pooled state slots."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.experts.interface import ExpertWeights
from runtime.experts.resident import ResidentExperts
from runtime.loading import build_empty_model, load_dense_weights
from runtime.models.base import Batch
from runtime.models.gated_deltanet import chunked_gated_delta_rule, recurrent_gated_delta_rule
from runtime.models.linear_state import SlotStateCache, StatePoolFull
from tests.engine_fixtures import SafetensorsSource, teacher_forced_sampling
from tests.fixtures.checkpoints import load_reference

FAMILIES = ["qwen3_next", "qwen3_5_moe"]
TOL = 1e-4
VOCAB = 384


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_LOADED: dict = {}


class QwenExperts:
    """The fixture's per-expert tensors (`mlp.experts.E.{gate,up,down}_proj`) as an ExpertStore-shaped
    source, read straight from safetensors so a converter bug and a model bug fail different tests."""

    def __init__(self, src: SafetensorsSource):
        self.tensors = src.tensors
        self.num_experts = int(src.config["num_experts"])
        self.layers = sorted({int(n.split(".")[2]) for n in src.tensors if ".mlp.experts." in n})

    def dequantize(self, layer: int, expert: int, dtype=torch.float32) -> ExpertWeights:
        name = f"model.layers.{layer}.mlp.experts.{expert}.{{}}_proj.weight"
        return ExpertWeights(*(self.tensors[name.format(role)].to(dtype) for role in ("gate", "up", "down")))


def loaded(tiny_checkpoints, family: str, device: str):
    """(our model on `device`, transformers' model on the CPU, eos ids) on the same fixture weights,
    built once per run."""
    if (family, device) not in _LOADED:
        path = tiny_checkpoints(family)
        src = SafetensorsSource(path)
        model = build_empty_model(src.config, experts=None, device=device, dtype=torch.float32)
        load_dense_weights(model, src)
        model.set_experts(ResidentExperts.from_store(QwenExperts(src), model.expert_spec(), device=device,
                                                     dtype=torch.float32))
        eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
        _LOADED[family, device] = (model, load_reference(path), set(eos if isinstance(eos, list) else [eos]))
    return _LOADED[family, device]


def new_cache(model):
    return model.new_cache(device=model.lm_head.weight.device, dtype=torch.float32)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, chunks: list[tuple[list[int], object]], *, all_logits: bool = False) -> torch.Tensor:
    """Logits on the CPU for one forward over a ragged batch on the model's device."""
    with torch.no_grad():
        return model(Batch.build(chunks, device=model.lm_head.weight.device), all_logits=all_logits).cpu()


def greedy(model, tokens: list[int], n: int, *, eos=frozenset(), cache=None, done: int = 0) -> list[int]:
    """Prefill what the cache has not seen, then n greedy tokens (stopping at EOS like transformers)."""
    cache = cache or new_cache(model)
    logits = run(model, [(tokens[done:], cache)])
    out = []
    for _ in range(n):
        nxt = int(logits[0].argmax())
        out.append(nxt)
        if nxt in eos:
            break
        logits = run(model, [([nxt], cache)])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_checkpoints, family, device):
    model, ref, _ = loaded(tiny_checkpoints, family, device)
    ids = prompt(80, seed=1)                      # longer than one 64-token GDN chunk
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]                                 # [T, V]
    ours = run(model, [(ids, new_cache(model))], all_logits=True)
    assert expected.std() > 0.1                   # the fixture's logits are not flat
    assert (ours - expected).abs().max().item() <= TOL
    # chunked prefill: the same prompt fed in pieces through the caches gives the same logits
    cache = new_cache(model)
    pieces = [run(model, [(ids[lo:lo + 30], cache)], all_logits=True) for lo in range(0, 80, 30)]
    assert (torch.cat(pieces) - expected).abs().max().item() <= TOL
    assert cache.offset == 80 and cache.layers[0].offset == 80 and cache.layers[3].offset == 80


@pytest.mark.parametrize("family", FAMILIES)
def test_linear_layers_in_prefill_pieces_match_transformers(tiny_checkpoints, family, device, monkeypatch):
    """A chunk longer than the Gated DeltaNet piece (4K tokens on a real model, 64 here) runs each linear layer a
    piece at a time while the rest of the model sees the whole chunk: transformers' logits all the same."""
    from runtime.models import gated_deltanet

    model, ref, _ = loaded(tiny_checkpoints, family, device)
    ids = prompt(150, seed=21)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    calls = []
    monkeypatch.setattr(gated_deltanet, "PREFILL_PIECE_TOKENS", 64)
    monkeypatch.setattr(gated_deltanet.GatedDeltaNet, "_forward", lambda self, x, c, r, f=gated_deltanet.GatedDeltaNet.
                        _forward: calls.append(x.shape[1]) or f(self, x, c, r))
    ours = run(model, [(ids, new_cache(model))], all_logits=True)
    assert (ours - expected).abs().max().item() <= TOL
    assert calls and set(calls) == {64, 22}                   # every linear layer in pieces of 64, 64 and 22


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(tiny_checkpoints, family, device):
    model, ref, eos = loaded(tiny_checkpoints, family, device)
    ids = prompt(12, seed=2)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    ours = greedy(model, ids, 32, eos=eos)
    assert len(theirs) >= 8                       # a real continuation, not an immediate EOS
    assert ours == theirs


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_sequential(tiny_checkpoints, family, device):
    """Sequences of different lengths prefill together, decode together, and one joins mid-way
    (a prefill chunk in the same batch as decode tokens): each gets what it gets alone."""
    model, _, _ = loaded(tiny_checkpoints, family, device)
    prompts = [prompt(5, 3), prompt(40, 4), prompt(70, 5)]
    late = prompt(23, 6)
    steps = 6
    alone = [greedy(model, p, steps) for p in prompts]
    alone_late = greedy(model, late, steps - 2)

    caches = [new_cache(model) for _ in prompts]
    late_cache = new_cache(model)
    logits = run(model, list(zip(prompts, caches)))                                   # [3, V]
    got = [[int(t)] for t in logits.argmax(-1)]
    late_got: list[int] = []
    for step in range(1, steps):
        chunks = [([seq[-1]], cache) for seq, cache in zip(got, caches)]
        if step == 2:
            chunks.append((late, late_cache))                                         # joins as a prefill
        elif step > 2:
            chunks.append(([late_got[-1]], late_cache))
        logits = run(model, chunks)
        for seq, row in zip(got, logits[:3]):
            seq.append(int(row.argmax()))
        if step >= 2:
            late_got.append(int(logits[3].argmax()))
    assert got == alone
    assert late_got == alone_late
    assert len({tuple(s) for s in got}) == 3      # the sequences really differ
    for cache in caches + [late_cache]:           # states are compact: nothing larger hides behind them
        for layer in cache.layers[:3]:
            for t in layer.states.values():
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cached_equals_uncached(tiny_checkpoints, family, device):
    """A stored copy of the caches after a prompt, loaded into a fresh sequence, continues exactly."""
    model, _, _ = loaded(tiny_checkpoints, family, device)
    first, follow_up = prompt(50, 7), prompt(20, 8)
    cache = new_cache(model)
    run(model, [(first, cache)])
    stored = cache.copy()                                                  # what the prefix cache keeps
    run(model, [(prompt(9, 9), cache)])                                    # the original sequence moves on
    assert stored.offset == 50

    fresh = new_cache(model)
    fresh.load(stored)
    resumed = run(model, [(follow_up, fresh)], all_logits=True)
    full = run(model, [(first + follow_up, new_cache(model))], all_logits=True)
    assert torch.equal(resumed, full[50:]) or (resumed - full[50:]).abs().max().item() <= 1e-5
    again = new_cache(model)
    again.load(stored)
    assert greedy(model, first + follow_up, 10, cache=again, done=50) == greedy(model, first + follow_up, 10)
    with pytest.raises(ValueError, match="cannot be cut"):               # recurrent state restores only whole
        new_cache(model).load(stored, 30)


@pytest.mark.parametrize("family", FAMILIES)
def test_pooled_state_slots_give_the_same_results(tiny_checkpoints, family, device):
    model, _, _ = loaded(tiny_checkpoints, family, device)
    ids = [prompt(30, 10), prompt(7, 11)]
    plain = [greedy(model, p, 5) for p in ids]
    pool = model.attach_state_pool(2, device=device, dtype=torch.float32)
    try:
        caches = [new_cache(model) for _ in ids]
        assert pool.in_use == 2 and isinstance(caches[0].layers[0], SlotStateCache)
        assert not isinstance(caches[0].layers[3], SlotStateCache)            # the attention layer keeps a KV cache
        with pytest.raises(StatePoolFull):
            new_cache(model)
        pooled = [greedy(model, p, 5, cache=c) for p, c in zip(ids, caches)]   # two sequences, two slots
        assert pooled == plain
        stored = caches[0].detach()                                            # slot-free copy for the prefix cache
        caches[0].release()
        caches[0].release()                                                    # idempotent: the slot is freed once
        assert pool.in_use == 1
        reuse = new_cache(model)             # a reused slot starts clean
        assert greedy(model, ids[1], 5, cache=reuse) == plain[1]
        reuse.release()
        hit = new_cache(model)
        hit.load(stored)
        assert hit.offset == stored.offset == 30 + 5      # greedy() feeds back every token it picks
        assert all(layer.slot == hit.layers[0].slot for layer in hit.layers if isinstance(layer, SlotStateCache))
    finally:
        model.state_pool = None


# ------------------------------------------------------------------ through the FTW package and the engine

_ENGINE_PACKAGES: dict = {}


def package(tiny_checkpoints, tmp_path_factory, family: str):
    """The fixture converted by the real converter with the lossless f32 codec (once per run)."""
    from runtime.ftw.converter import convert

    if family not in _ENGINE_PACKAGES:
        _ENGINE_PACKAGES[family] = convert(tiny_checkpoints(family), tmp_path_factory.mktemp(f"ftw-{family}"),
                                           codec="f32", overwrite=True)
    return _ENGINE_PACKAGES[family]


def engine(path, device: str, *, dtype: torch.dtype = torch.float32, **options):
    from runtime.engine import Engine

    return Engine.load(path, device=device, dtype=dtype, **options)


def drain(eng) -> None:
    while eng.has_work():
        eng.step()


def greedy_params(n: int):
    from runtime.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_over_ftw_matches_transformers(tiny_checkpoints, tmp_path_factory, family, device):
    _, ref, _ = loaded(tiny_checkpoints, family, device)
    eng = engine(package(tiny_checkpoints, tmp_path_factory, family), device, prefill_chunk=32, prefix_cache_bytes=0)
    ids = prompt(70, seed=12)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    ours = run(eng.model, [(ids, new_cache(eng.model))], all_logits=True)
    assert (ours - expected).abs().max().item() <= TOL          # f32 codec: the package is lossless
    short = prompt(12, seed=2)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([short]), max_new_tokens=32, do_sample=False)[0, len(short):].tolist()
    result = eng.generate(short, greedy_params(32))
    assert result.tokens == theirs and len(theirs) >= 8
    # a prompt longer than the prefill chunk: chunked prefill through the engine, still transformers' tokens
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert eng.generate(ids, greedy_params(8)).tokens == theirs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pooled", [False, True])
def test_engine_batched_equals_sequential(tiny_checkpoints, tmp_path_factory, family, pooled, device):
    """Continuous batching over recurrent state: requests of different lengths decode together, one
    joins late, and each gets its one-at-a-time tokens; with a reserved slot pool (fewer slots than
    requests) every slot comes back when its sequence ends."""
    path = package(tiny_checkpoints, tmp_path_factory, family)
    prompts = [prompt(6, 20), prompt(45, 21), prompt(17, 22), prompt(30, 23)]
    solo = engine(path, device, prefix_cache_bytes=0)
    alone = [solo.generate(p, greedy_params(10)).tokens for p in prompts]

    eng = engine(path, device, prefix_cache_bytes=0, max_batch=3, prefill_chunk=16)
    pool = eng.model.state_pool                  # the engine reserves max_batch slots...
    assert pool is not None and pool.capacity == 3
    assert (eng.plan["state_slots"], eng.plan["state_bytes"]) == (3, pool.nbytes)
    if not pooled:
        eng.model.state_pool = None              # ...without them every sequence owns its state tensors
    gathered = []                                # batch sizes of the pool's one-gather decode path
    if pooled:
        gather = pool.gather
        pool.gather = lambda layer, slots: gathered.append(len(slots)) or gather(layer, slots)
    rids = [eng.add_request(p, greedy_params(10)) for p in prompts[:3]]
    eng.step()
    eng.step()
    rids.append(eng.add_request(prompts[3], greedy_params(10)))                 # joins between steps
    drain(eng)
    assert [eng.result(r).tokens for r in rids] == alone
    assert len({tuple(t) for t in alone}) == 4
    if pooled:
        assert pool.in_use == 0 and max(gathered) == 3      # three sequences decoded in one call per layer


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pooled", [False, True])
def test_engine_prefix_cache_is_exact(tiny_checkpoints, tmp_path_factory, family, pooled, device):
    """A coding agent resends the whole conversation: the second turn prefills only what is new and
    produces exactly what an engine without a prefix cache produces (also when the restored state
    enters a reserved slot)."""
    path = package(tiny_checkpoints, tmp_path_factory, family)
    cached = engine(path, device, prefill_chunk=16, max_batch=1)
    pool = cached.model.state_pool
    if not pooled:
        cached.model.state_pool = None
    plain = engine(path, device, prefix_cache_bytes=0, prefill_chunk=16)
    turn1 = prompt(40, 30)
    first = cached.generate(turn1, greedy_params(12))
    assert first.tokens == plain.generate(turn1, greedy_params(12)).tokens
    turn2 = turn1 + first.tokens + prompt(9, 31)
    second = cached.generate(turn2, greedy_params(12))
    assert second.cached_tokens >= len(turn1)                                   # the state was restored...
    assert second.tokens == plain.generate(turn2, greedy_params(12)).tokens     # ...exactly
    assert cached.generate(turn1, greedy_params(12)).tokens == first.tokens     # the same prompt again
    if pooled:
        assert pool.in_use == 0                                                 # every sequence gave its slot back


def test_config_spellings_and_bad_configs():
    """Hub Qwen3.5 configs nest the text model under text_config with MRoPE rope_parameters; older
    Qwen3-Next configs give full_attention_interval instead of layer_types. Bad ones name the field."""
    from runtime.models import qwen3_5_moe, qwen3_next

    text = dict(model_type="qwen3_5_moe_text", vocab_size=100, hidden_size=64, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8, shared_expert_intermediate_size=8, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    vlm = {"model_type": "qwen3_5_moe", "tie_word_embeddings": True, "text_config": text, "vision_config": {}}
    c = qwen3_5_moe.Config.from_hf(vlm)
    assert (c.rope_theta, c.partial_rotary_factor, c.rope_scaling, c.tie_word_embeddings) == (1e7, 0.25, None, True)
    assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert all(c.is_moe_layer(i) for i in range(8))                  # Qwen3.5: every layer routes
    old = dict(text, model_type="qwen3_next", full_attention_interval=2, mlp_only_layers=[1], intermediate_size=16)
    n = qwen3_next.Config.from_hf(old)
    assert n.layer_types[:4] == ["linear_attention", "full_attention"] * 2 and not n.is_moe_layer(1)
    with pytest.raises(ValueError, match="layer_types"):
        qwen3_next.Config.from_hf(dict(old, layer_types=["linear_attention", "sliding_attention"] * 4))
    with pytest.raises(ValueError, match="layer_types lists 3 layers"):
        qwen3_next.Config.from_hf(dict(old, layer_types=["linear_attention"] * 3))
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        qwen3_next.Config.from_hf(dict(old, linear_num_value_heads=0))


def hub_layout_qwen3_5(src_dir, out_dir):
    """Re-save the Qwen3.5 fixture the way the hub ships Qwen3.5/3.6: a VLM config.json with the text
    model under text_config, tensors under `model.language_model.`, experts fused per layer
    (gate_up_proj [E, 2I, D], first half gate; down_proj [E, D, I]), plus mtp.* and visual tensors."""
    import shutil

    from safetensors.torch import save_file

    src = SafetensorsSource(src_dir)
    config = json.loads((src_dir / "config.json").read_text())
    tensors, experts = {}, {}
    for name, t in src.tensors.items():
        parts = name.split(".")
        if ".mlp.experts." in name:               # model.layers.L.mlp.experts.E.role_proj.weight
            experts.setdefault(int(parts[2]), {}).setdefault(int(parts[5]), {})[parts[6]] = t
        else:
            tensors[name.replace("model.", "model.language_model.", 1)] = t.clone()
    for layer, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        prefix = f"model.language_model.layers.{layer}.mlp.experts."
        tensors[prefix + "gate_up_proj"] = torch.stack([torch.cat([w["gate_proj"], w["up_proj"]]) for w in order])
        tensors[prefix + "down_proj"] = torch.stack([w["down_proj"] for w in order])
    tensors["mtp.fc.weight"] = torch.randn(8, 8)                 # multi-token prediction head: not ours to run
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 8)
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model-00001-of-00001.safetensors"))
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in tensors}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))   # hub checkpoints ship one
    vlm = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "tie_word_embeddings": False, "text_config": config, "vision_config": {"depth": 1}}
    (out_dir / "config.json").write_text(json.dumps(vlm))
    for f in src_dir.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def test_qwen3_5_hub_layout_converts_and_matches(tiny_checkpoints, tmp_path, device):
    from runtime.ftw.converter import convert

    source = tiny_checkpoints("qwen3_5_moe")
    _, ref, _ = loaded(tiny_checkpoints, "qwen3_5_moe", device)
    hub = hub_layout_qwen3_5(source, tmp_path / "hub")
    eng = engine(convert(hub, tmp_path / "pkg", codec="f32"), device, prefix_cache_bytes=0)
    assert eng.model_type in ("qwen3_5_moe", "qwen3_5_moe_text")
    ids = prompt(30, seed=40)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    ours = run(eng.model, [(ids, new_cache(eng.model))], all_logits=True)
    assert (ours - expected).abs().max().item() <= TOL


def test_wrong_checkpoint_tensors_are_named(tiny_checkpoints):
    """Strict loading names what is missing, extra or mis-shaped in a GDN layer's tensors."""
    from runtime.loading import WeightLoadError

    src = SafetensorsSource(tiny_checkpoints("qwen3_next"))
    del src.tensors["model.layers.1.linear_attn.in_proj_ba.weight"]
    src.tensors["model.layers.0.linear_attn.A_log"] = torch.zeros(3)
    model = build_empty_model(src.config, experts=None, device="cpu", dtype=torch.float32)
    with pytest.raises(WeightLoadError) as err:
        load_dense_weights(model, src)
    assert "model.layers.1.linear_attn.in_proj_ba.weight" in str(err.value)
    assert "model.layers.0.linear_attn.A_log (3,)" in str(err.value)
    # a Qwen3.5 checkpoint (separate projections) labelled qwen3_next: both spellings are reported
    src35 = SafetensorsSource(tiny_checkpoints("qwen3_5_moe"))
    model = build_empty_model(dict(src35.config, model_type="qwen3_next"), experts=None, device="cpu",
                              dtype=torch.float32)
    with pytest.raises(WeightLoadError, match=r"missing tensors: .*in_proj_qkvz.*unexpected tensors: .*in_proj_"):
        load_dense_weights(model, src35)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_in_bf16_stays_within_its_bound(tiny_checkpoints, tmp_path_factory, family, device):
    """bf16 activations (the GPU default; fla-core's kernels on CUDA when installed) against transformers
    in fp32. Measured on the CPU: max 0.24, mean 0.011 on logits of scale ~1.6 — the same as Qwen3-MoE's
    and Mixtral's bf16 compute (0.29 / 0.010, 0.17 / 0.004), so the GDN path adds no error of its own."""
    _, ref, _ = loaded(tiny_checkpoints, family, device)
    eng_bf16 = engine(package(tiny_checkpoints, tmp_path_factory, family), device, dtype=torch.bfloat16,
                      prefix_cache_bytes=0)
    ids = prompt(70, seed=12)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    cache = eng_bf16.model.new_cache(device=device, dtype=torch.bfloat16)
    ours = torch.cat([run(eng_bf16.model, [(ids[lo:lo + 16], cache)], all_logits=True) for lo in range(0, 70, 16)])
    err = (ours.float() - expected).abs()
    assert err.max().item() <= 0.5 and err.mean().item() <= 0.03
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9
    assert cache.layers[0].states["recurrent"].dtype == torch.float32          # the state stays fp32
    assert cache.layers[0].states["conv"].dtype == torch.bfloat16


def test_fla_path_through_the_engine(tiny_checkpoints, tmp_path_factory, monkeypatch):
    """The route a CUDA machine with fla-core takes (bf16: chunk kernel for prefill, fused recurrent
    kernel for batched decode), run here through stand-ins with fla's keyword API that compute with our
    torch forms: the glue must hand fla what it expects, and the engine's logits must stay those of the torch path.
    The glue rounds the normalised q and k to bf16 before the chunked kernel (as fla's own l2norm does), which the
    torch path keeps in fp32, so logits are compared within bf16's bound, the fla run fed the torch run's tokens."""
    from runtime.models import gated_deltanet as gdn_mod

    path = package(tiny_checkpoints, tmp_path_factory, "qwen3_next")
    prompts = [prompt(37, 50), prompt(5, 51), prompt(20, 52)]
    steps, forced = teacher_forced_sampling(monkeypatch)

    def batched(eng):
        rids = [eng.add_request(p, greedy_params(6)) for p in prompts]
        drain(eng)
        return [eng.result(r).tokens for r in rids]

    expected = batched(engine(path, "cpu", dtype=torch.bfloat16, prefix_cache_bytes=0, max_batch=3))
    reference, steps[:] = list(steps), []
    forced.extend(chosen for _, chosen in reference)

    calls = []

    def stand_in(form):
        def kernel(*, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
            B, T, H, dk = q.shape
            assert k.shape == q.shape and v.shape[:3] == (B, T, H)            # key heads already expanded
            assert q.dtype == v.dtype == beta.dtype == torch.bfloat16 and g.dtype == torch.float32
            assert initial_state.dtype == torch.float32 and initial_state.shape == (B, H, dk, v.shape[-1])
            assert output_final_state and scale == dk ** -0.5
            # the one-token kernel normalises q and k itself; the chunked one gets them normalised (fla's own
            # l2norm there compiles a variant per size bucket: gated_deltanet.fla_gated_delta_rule)
            assert use_qk_l2norm_in_kernel == (form == "recurrent")
            if form == "chunk":
                for t in (q, k):
                    assert (t.float().norm(dim=-1) - 1).abs().max() <= 1e-2          # unit rows, in bf16
            calls.append((form, B, T))
            rule = recurrent_gated_delta_rule if form == "recurrent" else chunked_gated_delta_rule
            return rule(q, k, v, g, beta, initial_state=initial_state)
        return kernel

    monkeypatch.setattr(gdn_mod, "fla_kernels", lambda: (stand_in("chunk"), stand_in("recurrent")))
    monkeypatch.setattr(gdn_mod, "fla_usable", lambda x: x.dtype == torch.bfloat16)
    assert batched(engine(path, "cpu", dtype=torch.bfloat16, prefix_cache_bytes=0, max_batch=3)) == expected
    assert len(steps) == len(reference)
    for (got, _), (want, _) in zip(steps, reference):
        err = (got - want).abs()
        assert err.max().item() <= 0.5 and err.mean().item() <= 0.03         # bf16's bound (the test above)
    assert ("chunk", 1, 37) in calls and any(form == "recurrent" and B == 3 for form, B, _ in calls)
