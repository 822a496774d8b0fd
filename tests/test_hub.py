"""Hub search and browse through the real HfApi client against the local hub-compatible server."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from app.hub import HubBrowser, HubError, quantization_of, support_check
from tests.hub_server import HubServer

_HEADER = b'{"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}'
FAKE_ST = len(_HEADER).to_bytes(8, "little") + _HEADER + b"\0" * 4    # a well-formed one-tensor safetensors file


@pytest.fixture
def hub(tiny_checkpoints, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)    # only the local server is reached
    with HubServer() as server:
        server.add_folder("tiny/qwen3-moe", tiny_checkpoints("qwen3_moe"), downloads=500,
                          card={"license": "apache-2.0", "base_model": "Qwen/Qwen3-30B-A3B"})
        server.add_config_only("openai/gpt-oss-20b", {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                                                      "quantization_config": {"quant_method": "mxfp4"}},
                               extra_files={"model-00001-of-00001.safetensors": FAKE_ST}, downloads=900,
                               tags=["license:apache-2.0"])
        server.add_config_only("nvidia/Qwen3.6-35B-A3B-NVFP4",
                               {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                "text_config": {"model_type": "qwen3_5_moe_text"},
                                "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}},
                               extra_files={"model.safetensors": FAKE_ST}, downloads=700)
        server.add_config_only("meta/llama-3-8b", {"model_type": "llama"}, downloads=10_000,
                               extra_files={"model.safetensors": FAKE_ST})
        server.add_config_only("deepseek-ai/DeepSeek-V3", {"model_type": "deepseek_v3"}, downloads=800,
                               extra_files={"model.safetensors": FAKE_ST})
        server.add_config_only("someone/qwen3-moe-awq", {"model_type": "qwen3_moe",
                                                         "quantization_config": {"quant_method": "awq"}},
                               extra_files={"model.safetensors": FAKE_ST}, downloads=50)
        server.add_config_only("someone/qwen3-moe-gguf", {"model_type": "qwen3_moe"},
                               extra_files={"qwen3-moe-q4.gguf": b"GGUF"}, downloads=40)
        server.add_folder("org/gated-moe", tiny_checkpoints("qwen3_moe"), gated=True, downloads=1)
        yield server


def test_search_keeps_moe_models_with_support_verdicts(hub):
    browser = HubBrowser(endpoint=hub.url)
    found = browser.search(limit=50, safetensors_only=False)
    repos = [m.repo for m in found]
    assert "meta/llama-3-8b" not in repos                     # not a MoE
    assert sum(1 for m, p, _ in hub.requests if p == "/api/models") >= 3   # pages followed by their Link header
    assert repos[:3] == ["openai/gpt-oss-20b", "deepseek-ai/DeepSeek-V3", "nvidia/Qwen3.6-35B-A3B-NVFP4"]
    by_repo = {m.repo: m for m in found}
    assert by_repo["openai/gpt-oss-20b"].supported and by_repo["openai/gpt-oss-20b"].quantization == "mxfp4"
    assert by_repo["openai/gpt-oss-20b"].licence == "apache-2.0"
    assert by_repo["nvidia/Qwen3.6-35B-A3B-NVFP4"].supported
    assert by_repo["nvidia/Qwen3.6-35B-A3B-NVFP4"].quantization == "nvfp4"
    assert not by_repo["deepseek-ai/DeepSeek-V3"].supported and "deepseek_v3" in by_repo["deepseek-ai/DeepSeek-V3"].reason
    assert "awq" in by_repo["someone/qwen3-moe-awq"].reason
    assert not by_repo["someone/qwen3-moe-gguf"].supported and "safetensors" in by_repo["someone/qwen3-moe-gguf"].reason
    tiny = by_repo["tiny/qwen3-moe"]
    assert tiny.supported and tiny.params and tiny.params > 100_000 and tiny.licence == "apache-2.0"
    assert "tiny/qwen3-moe" in tiny.line() and "ok" in tiny.line()


def test_search_filters_by_query_architecture_and_quantization(hub):
    browser = HubBrowser(endpoint=hub.url)
    assert [m.repo for m in browser.search("qwen3-moe", safetensors_only=False)] == [
        "tiny/qwen3-moe", "someone/qwen3-moe-awq", "someone/qwen3-moe-gguf"]
    assert [m.repo for m in browser.search("qwen3-moe")] == ["tiny/qwen3-moe", "someone/qwen3-moe-awq"]
    assert [m.repo for m in browser.search(model_types=["gpt_oss"])] == ["openai/gpt-oss-20b"]
    assert [m.repo for m in browser.search(quantization="nvfp4")] == ["nvidia/Qwen3.6-35B-A3B-NVFP4"]
    supported = browser.search(supported_only=True, limit=2)
    assert [m.repo for m in supported] == ["openai/gpt-oss-20b", "nvidia/Qwen3.6-35B-A3B-NVFP4"]
    assert [m.repo for m in browser.search(author="someone", safetensors_only=False)] == [
        "someone/qwen3-moe-awq", "someone/qwen3-moe-gguf"]
    with pytest.raises(ValueError, match="quantization"):
        browser.search(quantization="q4_k_m")


def test_details_give_files_sizes_and_download_size_by_pattern(hub, tiny_checkpoints):
    src = tiny_checkpoints("qwen3_moe")
    details = HubBrowser(endpoint=hub.url).details("tiny/qwen3-moe")
    assert details.revision == hub.repos["tiny/qwen3-moe"].sha
    assert details.supported and details.config["model_type"] == "qwen3_moe"
    assert details.card["base_model"] == "Qwen/Qwen3-30B-A3B"
    sizes = {f.path: f.size for f in details.files}
    assert sizes == {p.name: p.stat().st_size for p in src.iterdir()}
    assert all(f.sha256 for f in details.files if f.path.endswith(".safetensors"))
    weights = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert details.download_size(["*.safetensors"]) == weights
    assert details.download_size() == sum(sizes.values())


def test_errors_are_told_in_words(hub, monkeypatch):
    browser = HubBrowser(endpoint=hub.url)
    with pytest.raises(HubError, match="gated"):
        browser.details("org/gated-moe")
    assert HubBrowser(endpoint=hub.url, token=hub.token).details("org/gated-moe").gated
    with pytest.raises(HubError, match="not found"):
        browser.details("nobody/nothing")
    with socket.socket() as s:                                # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    # huggingface_hub retries a refused connection with growing sleeps (15 s in all); skip the waiting
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)
    with pytest.raises(HubError, match="cannot reach"):
        HubBrowser(endpoint=closed).search("x")


def test_quantization_and_support_rules_without_a_server():
    assert quantization_of({"model_type": "qwen3_moe"}) == "none"
    assert quantization_of({"quantization_config": {"quant_method": "compressed-tensors",
                                                    "config_groups": {"g": {"format": "nvfp4-pack-quantized"}}}}) == "nvfp4"
    assert quantization_of({"quantization_config": {"quant_method": "fp8"}}) == "fp8"
    ok, reason = support_check({"model_type": "qwen3_moe", "quantization_config": {"quant_method": "fp8",
                                                                                   "weight_block_size": [128, 128]}},
                               has_safetensors=True)
    assert ok, reason
    assert support_check(None, has_safetensors=True) == (False, "no config.json (not a transformers checkpoint)")


def test_models_search_and_show_commands_use_the_endpoint_setting(hub, capsys):
    from app.cli import main
    from app.settings import Settings

    settings = Settings()
    settings.set("hf_endpoint", hub.url)                     # the mirror setting
    settings.save()
    assert main(["models", "search", "qwen3", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [m["repo"] for m in found] == ["nvidia/Qwen3.6-35B-A3B-NVFP4", "tiny/qwen3-moe"]   # supported only
    assert main(["models", "search", "qwen3", "--all"]) == 0
    out = capsys.readouterr().out
    assert "someone/qwen3-moe-awq" in out and "awq" in out
    assert main(["models", "show", "tiny/qwen3-moe"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_moe" in out and "runs it" in out and "apache-2.0" in out
    assert main(["models", "show", "nobody/nothing"]) == 1
    assert "not found" in capsys.readouterr().err


def test_the_stock_hf_hub_download_reads_the_servers_headers_as_the_hubs(hub, tiny_checkpoints, tmp_path):
    """huggingface_hub's own download path (HEAD for ETag/X-Linked-*/X-Repo-Commit, then GET) against the server:
    its cache names blobs by the etag, so an LFS file must land under its sha256 and a git file under its sha1."""
    import hashlib

    from huggingface_hub import hf_hub_download

    src = tiny_checkpoints("qwen3_moe")
    shard = sorted(p.name for p in src.glob("*.safetensors"))[0]
    path = Path(hf_hub_download("tiny/qwen3-moe", shard, endpoint=hub.url, cache_dir=tmp_path))
    assert path.read_bytes() == (src / shard).read_bytes()
    assert path.resolve().name == hashlib.sha256((src / shard).read_bytes()).hexdigest()
    assert path.parent.name == hub.repos["tiny/qwen3-moe"].sha            # snapshots/<X-Repo-Commit>/
    cfg = Path(hf_hub_download("tiny/qwen3-moe", "config.json", endpoint=hub.url, cache_dir=tmp_path))
    data = (src / "config.json").read_bytes()
    assert cfg.resolve().name == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
