"""Engine throughput on a random-weight Qwen3-MoE: prefill tokens/s and decode tokens/s by batch size.

    python benchmarks/bench_engine.py [--device cpu|cuda] [--threads 1] [--size small|mid|a3b]
                                      [--experts looped|grouped|auto] [--codec f32|bf16|int4]

(a3b: Qwen3-30B-A3B's layer shapes, 2 layers, bf16 checkpoint; use --codec bf16 on the GPU machine)

Builds the checkpoint with transformers (random weights, real structure), converts it with the real FTW
converter (f32 experts), loads it with Engine.load and drives it through add_request/step as the server
does. Prints a Markdown table. Decode rows: B sequences decoding together, tokens/s summed over them.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIZES = {
    # a tiny-but-not-trivial model that fits the 2-core CI VM
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4, intermediate_size=1024),
    "mid": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                moe_intermediate_size=384, num_experts=32, num_experts_per_tok=8, intermediate_size=2048),
    # Qwen3-30B-A3B's layer shapes with fewer layers (for the GPU machine)
    "a3b": dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, intermediate_size=6144),
}


def build(root: Path, size: str) -> Path:
    import transformers

    from tests.fixtures.checkpoints import VOCAB
    from tests.fixtures.tokenizer import save_tokenizer

    out = root / f"qwen3-moe-{size}"
    ids = save_tokenizer("qwen", "qwen3.jinja", out)
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, max_position_embeddings=8192, rms_norm_eps=1e-6,
                                         norm_topk_prob=True, eos_token_id=ids["gen_eos"][0], **SIZES[size])
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16 if size == "a3b" else torch.float32)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="200MB")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", default="small", choices=SIZES)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--experts", default="auto", choices=["auto", "looped", "grouped"])
    ap.add_argument("--codec", default="f32", choices=["f32", "bf16", "int4"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from runtime.engine import Engine, SamplingParams
    from runtime.experts.resident import ResidentExperts
    from runtime.ftw.converter import convert

    def factory(package, spec, *, device, dtype, progress=None, **_):
        grouped = None if args.experts == "auto" else args.experts == "grouped"
        return ResidentExperts.from_store(package.experts, spec, device=device, dtype=dtype, grouped=grouped)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build(Path(tmp), args.size)
        pkg = convert(ckpt, Path(tmp) / "pkg", codec=args.codec)
        eng = Engine.load(pkg, device=args.device, max_batch=max(int(b) for b in args.batches.split(",")),
                          prefix_cache_bytes=0, experts_factory=factory)
        gen = torch.Generator().manual_seed(0)
        prompt = lambda n: torch.randint(0, 370, (n,), generator=gen).tolist()   # noqa: E731
        greedy = SamplingParams(temperature=0, max_tokens=args.decode, stop_token_ids=())
        eng.generate(prompt(16), SamplingParams(temperature=0, max_tokens=4, stop_token_ids=()))   # warm-up
        sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)

        print(f"engine on {eng.device}, {eng.dtype}, {args.threads} thread(s), size {args.size} "
              f"({SIZES[args.size]}), experts {eng.model.experts.stats()}\n")
        print("| phase | batch | tokens | seconds | tokens/s | ms/step (median) |\n|---|---|---|---|---|---|")
        prefills = [eng.generate(prompt(args.prompt), SamplingParams(temperature=0, max_tokens=1,
                                                                     stop_token_ids=())) for _ in range(3)]
        tps = statistics.median(r.prefill_tokens_per_s for r in prefills)
        print(f"| prefill | 1 | {args.prompt} | {args.prompt / tps:.3f} | {tps:.0f} | |")
        for batch in (int(b) for b in args.batches.split(",")):
            for _ in range(batch):
                eng.add_request(prompt(32), greedy)
            while eng.stats()["active_sequences"] < batch or any(s.prefilling for s in eng.scheduler.running):
                eng.step()
            steps, tokens = [], 0
            while eng.has_work():
                sync()
                t0 = time.perf_counter()
                events = eng.step()
                sync()
                steps.append(time.perf_counter() - t0)
                tokens += sum(e.token_id is not None for e in events)
            total = sum(steps)
            print(f"| decode | {batch} | {tokens} | {total:.3f} | {tokens / total:.1f} | "
                  f"{1000 * statistics.median(steps):.1f} |")


if __name__ == "__main__":
    main()
