"""The built-in demo model: a small Qwen3-MoE with RANDOM weights, made locally, so that everything works
end to end with no internet (`freetoken run`, `serve`, the app). It writes gibberish; its name says so.

    ensure_demo_model(models_dir) -> DemoModel(path, created)

It is built the way a real model arrives: a Hugging Face checkpoint folder in the Qwen3-MoE layout
(config.json, generation_config.json, safetensors written directly -- transformers is test-only),
a byte-level BPE tokenizer trained here by `tokenizers` with Qwen's special tokens, and the Qwen3
chat template; then the real FTW converter turns it into a package in the models folder. Creating it
is idempotent (an existing, readable package is left alone) and takes a few seconds.

Weights are deterministic (one seed) and drawn at scales that keep routing spread over all experts:
hidden states leave RMSNorm with unit RMS, so a router row drawn N(0, 1/D) gives logits of standard
deviation ~1 and every expert wins some tokens (tests/test_demo_cli.py checks the spread).
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEMO_MODEL_NAME = "freetoken-demo-random"

# Qwen's special tokens, in Qwen's order, so the template and the parsers see what a real Qwen model uses.
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                       "<tool_response>", "</tool_response>", "<think>", "</think>")

# Text the demo tokenizer learns its merges from: a little English, code and JSON, so prompts tokenize
# into a sensible number of tokens. It says nothing about what the model will write (random weights).
TRAINING_TEXT = """\
FreeToken runs large mixture-of-experts language models on an ordinary PC. The experts live in host
memory, the hot ones are cached on the graphics card, and the misses run on the processor.
This is the demo model. Its weights are random, so it writes gibberish; it exists so that you can try
the command line, the local API and the desktop app without downloading anything.
Hello! How are you today? I am fine, thank you. What is the weather like in Paris, Tokyo or Lagos?
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
user assistant system tool reasoning think answer question explain write code list summary
0 1 2 3 4 5 6 7 8 9 10 42 100 2026 3.14159
"""


class DemoError(RuntimeError):
    """The demo model could not be made; the message says why."""


@dataclass(frozen=True)
class DemoSpec:
    """Sizes of the demo model: small enough to build and run in seconds, an MoE in every decoder layer."""

    vocab_target: int = 1024          # BPE vocabulary to train (specials included)
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    num_experts: int = 16
    experts_per_token: int = 4
    moe_intermediate_size: int = 128
    # Long enough for a coding agent's first turn (Claude Code sends ~50K tokens with this small vocabulary).
    max_position_embeddings: int = 131072
    rope_theta: float = 1_000_000.0
    seed: int = 20261130


@dataclass(frozen=True)
class DemoModel:
    path: Path         # the FTW package
    created: bool      # False when it was already there


ProgressFn = Callable[[str], None]


def demo_model_path(models_dir: Path) -> Path:
    return Path(models_dir) / DEMO_MODEL_NAME


def ensure_demo_model(models_dir: Path | None = None, *, force: bool = False, spec: DemoSpec | None = None,
                      progress: ProgressFn | None = None) -> DemoModel:
    """Create the demo package in `models_dir` (default: the user's models folder) unless it is there."""
    from runtime.ftw.errors import FTWError
    from runtime.ftw.reader import FTWPackage

    if models_dir is None:
        from app.paths import user_paths
        from app.settings import Settings

        models_dir = user_paths(Settings().get("models_dir") or None).models
    models_dir = Path(models_dir)
    path = demo_model_path(models_dir)
    say = progress or (lambda message: None)
    if path.exists() and not force:
        try:
            FTWPackage.open(path)
        except FTWError as exc:
            raise DemoError(f"{path} exists but is not a readable FTW package ({exc}); "
                            "run `freetoken demo --force` to rebuild it") from exc
        return DemoModel(path=path, created=False)
    if path.exists():
        shutil.rmtree(path)
    models_dir.mkdir(parents=True, exist_ok=True)
    spec = spec or DemoSpec()
    with tempfile.TemporaryDirectory(prefix="freetoken-demo-") as tmp:
        source = Path(tmp) / DEMO_MODEL_NAME
        say("writing a random-weight Qwen3-MoE checkpoint")
        write_demo_checkpoint(source, spec)
        say("converting it to FTW")
        convert_demo(source, path)
    say(f"ready: {path}")
    return DemoModel(path=path, created=True)


# bf16 experts: exact, and the package loads in a fraction of a second (every CLI, API and UI test that uses
# the demo pays the load); the int4 and fp4 codecs have their own tests in the FTW suite.
DEMO_CODEC = "bf16"


def convert_demo(source: Path, out: Path) -> Path:
    """The real converter, as `freetoken convert --codec bf16` runs it."""
    from runtime.ftw.converter import convert
    from runtime.ftw.errors import FTWError

    try:
        return convert(source, out, codec=DEMO_CODEC)
    except FTWError as exc:
        raise DemoError(f"converting the demo model failed: {exc}") from exc


# ---- the checkpoint ---------------------------------------------------------------------------------------


def train_demo_tokenizer(spec: DemoSpec):
    """A byte-level BPE (any text round-trips) with Qwen's special tokens after the learned vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_target - len(QWEN_SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True) * 8, trainer=trainer)
    tok.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    return tok


def _write_tokenizer(out: Path, spec: DemoSpec) -> dict[str, int]:
    from resources import resource_path

    tok = train_demo_tokenizer(spec)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings, "errors": "replace", "split_special_tokens": False,
        "added_tokens_decoder": {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                               "single_word": False, "special": True} for t in QWEN_SPECIAL_TOKENS},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    template = resource_path("chat_templates", "qwen3.jinja").read_text(encoding="utf-8")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return {"vocab": tok.get_vocab_size(), "eos": ids["<|im_end|>"], "pad": ids["<|endoftext|>"]}


def demo_config(spec: DemoSpec, *, vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """config.json as Qwen3-MoE checkpoints write it."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": spec.hidden_size, "intermediate_size": 4 * spec.hidden_size,
        "moe_intermediate_size": spec.moe_intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "num_experts": spec.num_experts, "num_experts_per_tok": spec.experts_per_token, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": spec.num_layers, "initializer_range": 0.02, "use_cache": True,
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "bos_token_id": pad_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "freetoken_demo": "random weights: this model writes gibberish",
    }


def demo_tensors(spec: DemoSpec, vocab_size: int) -> dict:
    """Every tensor of the checkpoint, bf16, named as Qwen3-MoE checkpoints name them (per-expert keys)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    d, h, kv, hd, e, i = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.num_experts,
                          spec.moe_intermediate_size)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)

    def near_one(n: int) -> torch.Tensor:   # norm weights: around 1, not exactly, like a trained model
        return (1.0 + 0.05 * torch.randn(n, generator=gen)).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab_size, d, std=1.0),
               "model.norm.weight": near_one(d),
               "lm_head.weight": normal(vocab_size, d, std=1.0 / math.sqrt(d))}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": near_one(d),
            p + "post_attention_layernorm.weight": near_one(d),
            p + "self_attn.q_proj.weight": normal(h * hd, d, std=1.0 / math.sqrt(d)),
            p + "self_attn.k_proj.weight": normal(kv * hd, d, std=1.0 / math.sqrt(d)),
            p + "self_attn.v_proj.weight": normal(kv * hd, d, std=1.0 / math.sqrt(d)),
            p + "self_attn.o_proj.weight": normal(d, h * hd, std=0.5 / math.sqrt(h * hd)),
            p + "self_attn.q_norm.weight": near_one(hd),
            p + "self_attn.k_norm.weight": near_one(hd),
            # Router rows N(0, 1/D): logits of std ~1 over unit-RMS hidden states, so tokens spread.
            p + "mlp.gate.weight": normal(e, d, std=1.0 / math.sqrt(d)),
        })
        for expert in range(e):
            q = f"{p}mlp.experts.{expert}."
            tensors[q + "gate_proj.weight"] = normal(i, d, std=1.0 / math.sqrt(d))
            tensors[q + "up_proj.weight"] = normal(i, d, std=1.0 / math.sqrt(d))
            tensors[q + "down_proj.weight"] = normal(d, i, std=0.5 / math.sqrt(i))
    return tensors


def write_demo_checkpoint(out: Path, spec: DemoSpec | None = None) -> Path:
    """Write the Hugging Face checkpoint folder of the demo model into `out` (created; must not exist)."""
    spec = spec or DemoSpec()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=False)
    ids = _write_tokenizer(out, spec)
    vocab_size = 64 * math.ceil(ids["vocab"] / 64)    # padded like real checkpoints; extra rows never sampled
    config = demo_config(spec, vocab_size=vocab_size, eos_id=ids["eos"], pad_id=ids["pad"])
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": ids["pad"], "eos_token_id": [ids["eos"], ids["pad"]], "pad_token_id": ids["pad"],
                  "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    _save_sharded(demo_tensors(spec, vocab_size), out, shards=2)
    return out


def _save_sharded(tensors: dict, out: Path, *, shards: int) -> None:
    """Shards plus model.safetensors.index.json, as hub checkpoints ship (layers split by position)."""
    from safetensors.torch import save_file

    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[k * per:(k + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
