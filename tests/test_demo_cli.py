"""The demo model and the run/chat commands, end to end: `freetoken demo`, then `freetoken run ... --json`
in a real subprocess, checked against the engine and the model's own tokenizer and template."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.demo import DEMO_MODEL_NAME, DemoError, ensure_demo_model


def _cli(*args: str, env_home: Path, stdin: str | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "FREETOKEN_HOME": str(env_home), "OMP_NUM_THREADS": "1"}
    env.pop("FREETOKEN_MODELS_DIR", None)
    return subprocess.run([sys.executable, "-m", "ui.entry", *args], capture_output=True, text=True, env=env,
                          input=stdin, timeout=timeout)


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory) -> Path:
    """A FreeToken home where `freetoken demo` (a real subprocess) has made the demo model."""
    home = tmp_path_factory.mktemp("demo-home")
    done = _cli("demo", "--json", env_home=home)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["created"] is True and report["name"] == DEMO_MODEL_NAME
    assert Path(report["path"]) == home / "models" / DEMO_MODEL_NAME
    return home


def test_demo_is_a_qwen3_moe_ftw_package_made_once(demo_home):
    from runtime.ftw.reader import FTWPackage

    path = demo_home / "models" / DEMO_MODEL_NAME
    pkg = FTWPackage.open(path)
    assert pkg.model_type == "qwen3_moe"
    assert pkg.config["num_experts"] == 16 and pkg.experts.layers == [0, 1, 2, 3]
    assert pkg.experts.codec == "bf16"
    assert "random" in pkg.config["freetoken_demo"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (pkg.tokenizer_dir / name).is_file()
    manifest_mtime = (path / "manifest.json").stat().st_mtime_ns
    again = ensure_demo_model(demo_home / "models")
    assert again.created is False and again.path == path
    assert (path / "manifest.json").stat().st_mtime_ns == manifest_mtime


def test_demo_routing_spreads_tokens_over_every_expert(demo_home):
    """Router logits over normed hidden states (the vocabulary's embeddings as a proxy) pick every expert."""
    import torch

    from runtime.ftw.reader import FTWPackage

    pkg = FTWPackage.open(demo_home / "models" / DEMO_MODEL_NAME)
    embed = pkg.dense("model.embed_tokens.weight").float()                         # [V, D]
    k = pkg.config["num_experts_per_tok"]
    for layer in pkg.experts.layers:
        norm = pkg.dense(f"model.layers.{layer}.post_attention_layernorm.weight").float()
        router = pkg.dense(f"model.layers.{layer}.mlp.gate.weight").float()         # [E, D]
        hidden = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
        chosen = (hidden @ router.T).topk(k, dim=-1).indices.flatten()
        share = torch.bincount(chosen, minlength=router.shape[0]).float() / chosen.numel()
        uniform = 1.0 / router.shape[0]
        assert share.min() > 0.3 * uniform and share.max() < 2.5 * uniform, (layer, share)


def test_a_broken_demo_folder_is_reported_not_overwritten(tmp_path):
    broken = tmp_path / DEMO_MODEL_NAME
    broken.mkdir()
    (broken / "manifest.json").write_text("{", encoding="utf-8")
    with pytest.raises(DemoError, match="--force"):
        ensure_demo_model(tmp_path)
    assert (broken / "manifest.json").read_text(encoding="utf-8") == "{"


def test_run_json_in_a_subprocess_matches_the_engine(demo_home):
    from runtime.engine import Engine, SamplingParams
    from runtime.text.chat_template import ChatTemplate
    from runtime.text.tokenizer import Tokenizer

    done = _cli("run", DEMO_MODEL_NAME, "--prompt", "hi", "--max-tokens", "8", "--temperature", "0", "--json",
                env_home=demo_home)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    path = demo_home / "models" / DEMO_MODEL_NAME
    tok, tpl = Tokenizer.from_dir(path), ChatTemplate.from_dir(path)
    expected_prompt = tpl.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert report["prompt"] == expected_prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert report["prompt_ids"] == tok.encode(expected_prompt)
    generated = report["generated_ids"]
    assert 1 <= len(generated) <= 8 and report["stats"]["generated_tokens"] == len(generated)
    assert report["stats"]["finish_reason"] == ("length" if len(generated) == 8 else "stop")
    assert report["stats"]["prompt_tokens"] == len(report["prompt_ids"])
    assert report["sampling"]["temperature"] == 0.0
    # The same greedy request in this process gives the same tokens.
    engine = Engine.load(path, device="cpu")
    result = engine.generate(report["prompt_ids"], SamplingParams(temperature=0, max_tokens=8))
    assert result.tokens == generated
    assert report["raw_text"] == result.text


def test_run_streams_text_and_a_stats_line(demo_home, monkeypatch, capsys):
    from app.cli import main

    monkeypatch.setenv("FREETOKEN_HOME", str(demo_home))
    assert main(["run", DEMO_MODEL_NAME, "--prompt", "hello", "--max-tokens", "5", "--seed", "3"]) == 0
    first = capsys.readouterr()
    assert "prompt tokens" in first.err and "decode" in first.err and "finish:" in first.err
    assert main(["run", DEMO_MODEL_NAME, "--prompt", "hello", "--max-tokens", "5", "--seed", "3"]) == 0
    assert capsys.readouterr().out == first.out      # a seed reproduces the answer


def test_run_reports_bad_input_as_one_line(demo_home, monkeypatch, capsys):
    from app.cli import main

    monkeypatch.setenv("FREETOKEN_HOME", str(demo_home))
    assert main(["run", DEMO_MODEL_NAME, "--prompt", "", "--raw"]) == 1
    assert "run: the prompt is empty" in capsys.readouterr().err
    assert main(["run", DEMO_MODEL_NAME, "--prompt", "hi", "--top-p", "0"]) == 1
    assert "top_p" in capsys.readouterr().err
    assert main(["run", DEMO_MODEL_NAME, "--prompt", "x " * 40, "--context", "16"]) == 1
    assert "context" in capsys.readouterr().err
    assert main(["run", "no-such-model-anywhere", "--prompt", "hi"]) == 1
    assert "no-such-model-anywhere" in capsys.readouterr().err


def test_chat_keeps_history_across_turns(demo_home, monkeypatch, capsys):
    import io

    from app.cli import main

    monkeypatch.setenv("FREETOKEN_HOME", str(demo_home))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nand again\n/reset\nfresh\n/exit\n"))
    assert main(["chat", DEMO_MODEL_NAME, "--max-tokens", "3", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    stats = [line for line in err.splitlines() if "prompt tokens" in line]
    assert len(stats) == 3
    prompt_tokens = [int(line.split()[0]) for line in stats]
    # Turn 2 resends turn 1 (longer prompt, served partly from the prefix cache); /reset starts over.
    assert prompt_tokens[1] > prompt_tokens[0] > 0 and prompt_tokens[2] < prompt_tokens[1]
    assert "cached" in stats[1]
    assert "(history cleared)" in err


def test_run_on_a_hugging_face_folder_uses_its_template_and_parser(tiny_checkpoints, monkeypatch, capsys, tmp_path):
    """A gpt-oss checkpoint folder: converted on the fly, prompted through the harmony template with the
    reasoning effort asked for, and its greedy tokens are the engine's."""
    from app.cli import main
    from runtime.engine import Engine, SamplingParams

    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path / "home"))
    folder = tiny_checkpoints("gpt_oss")
    assert main(["run", str(folder), "--prompt", "hi", "--system", "Be brief.", "--reasoning-effort", "high",
                 "--max-tokens", "6", "--temperature", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_type"] == "gpt_oss"
    assert "Reasoning: high" in report["prompt"] and "# Instructions\n\nBe brief." in report["prompt"]
    assert report["prompt"].endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")
    packages = [p for p in (tmp_path / "home" / "cache").rglob("manifest.json")]
    assert len(packages) == 1                      # converted once into the cache
    engine = Engine.load(packages[0].parent, device="cpu")
    result = engine.generate(report["prompt_ids"], SamplingParams(temperature=0, max_tokens=6))
    assert result.tokens == report["generated_ids"]


def test_truncation_only_when_asked(demo_home, monkeypatch, capsys):
    import io

    from app.cli import main

    monkeypatch.setenv("FREETOKEN_HOME", str(demo_home))
    words = " ".join(f"w{i}" for i in range(60))
    assert main(["run", DEMO_MODEL_NAME, "--raw", "--prompt", words, "--context", "16", "--max-tokens", "1"]) == 1
    assert "context" in capsys.readouterr().err
    assert main(["run", DEMO_MODEL_NAME, "--raw", "--prompt", words, "--context", "16", "--max-tokens", "1",
                 "--truncate", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["prompt_ids"]) == 15 and report["truncated_tokens"] > 0
    assert words.endswith(report["prompt"]) and report["prompt"].endswith("w59")
    # Through the chat template: the frame stays whole, the start of the message goes.
    assert main(["run", DEMO_MODEL_NAME, "--prompt", words, "--context", "32", "--max-tokens", "1", "--truncate",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["prompt_ids"]) <= 31 and report["truncated_tokens"] > 0
    assert report["prompt"].startswith("<|im_start|>user\n")
    assert report["prompt"].endswith("w59<|im_end|>\n<|im_start|>assistant\n")
    # chat forgets its oldest turns instead
    monkeypatch.setattr(sys, "stdin", io.StringIO("first question here\nsecond question here\nthird one\n"))
    assert main(["chat", DEMO_MODEL_NAME, "--context", "48", "--max-tokens", "8", "--temperature", "0",
                 "--truncate"]) == 0
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if "prompt tokens" in line]) == 3
    assert re.search(r"forgot the \d+ oldest turns to fit the 48-token context", err)
