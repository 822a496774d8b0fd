"""Tokenizer: ids and text as transformers gives them; StreamDecoder never emits half a character."""
from __future__ import annotations

import json

import pytest

from runtime.text.tokenizer import REPLACEMENT_CHAR, StreamDecoder, Tokenizer, TokenizerError
from tests.fixtures.tokenizer import save_tokenizer

SAMPLES = ["Hello, world! How are you today?", "東京は雨です。大阪は晴れ。", "Emoji: 🦊🚀✨👩‍👩‍👧 café naïve Ωμέγα",
           "def add(a, b):\n    return a + b\n", "  leading and trailing spaces  ", "<|im_start|>user\nhi<|im_end|>",
           "mixed 中文 and العربية and 😀 end"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen-tok")
    save_tokenizer("qwen", "qwen3.jinja", folder)
    return folder


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral-tok")
    save_tokenizer("mixtral", "mixtral.jinja", folder)
    return folder


def test_ids_and_text_match_transformers(qwen_dir, mixtral_dir):
    from transformers import AutoTokenizer

    for folder in (qwen_dir, mixtral_dir):
        hf = AutoTokenizer.from_pretrained(folder)
        tok = Tokenizer.from_dir(folder)
        for text in SAMPLES:
            ids = tok.encode(text)
            assert ids == hf.encode(text, add_special_tokens=False)
            assert tok.encode(text, add_special_tokens=True) == hf.encode(text)
            assert tok.decode(ids) == hf.decode(ids)
            assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_come_from_tokenizer_config(qwen_dir, mixtral_dir):
    qwen = Tokenizer.from_dir(qwen_dir)
    assert qwen.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert qwen.eos_token_id == qwen.token_to_id("<|im_end|>") and qwen.bos_token_id is None
    assert "<think>" in qwen.added_tokens.values()
    mixtral = Tokenizer.from_dir(mixtral_dir)
    assert (mixtral.bos_token_id, mixtral.eos_token_id) == (mixtral.token_to_id("<s>"), mixtral.token_to_id("</s>"))
    assert mixtral.vocab_size == 384


def test_stream_decoder_holds_back_split_characters(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    text = "Fox 🦊 rocket 🚀 sparkle ✨ family 👩‍👩‍👧 Tokyo 東京 rain 雨"
    ids = tok.encode(text)
    # The tiny BPE does not know these characters: several of them span more than one token.
    splits = [i for i in ids if REPLACEMENT_CHAR in tok.decode([i])]
    assert len(splits) >= 4
    decoder = StreamDecoder(tok)
    deltas = [decoder.push(i) for i in ids]
    assert decoder.flush() == ""
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert deltas.count("") >= 3                 # tokens that completed no character emitted nothing
    for d in deltas:                             # every delta is whole characters: it re-encodes as valid UTF-8
        d.encode("utf-8")


def test_stream_decoder_flush_shows_an_unfinished_character(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    ids = tok.encode("ok ✨")
    decoder = StreamDecoder(tok)
    out = "".join(decoder.push(i) for i in ids[:-1])   # stop one token short of the sparkle's last byte
    assert REPLACEMENT_CHAR not in out and out.startswith("ok")
    assert decoder.flush().endswith(REPLACEMENT_CHAR)
    assert decoder.flush() == ""


def test_stream_decoder_keeps_special_tokens_unless_asked(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    ids = tok.encode("<think>\nhm\n</think>\n\nHi<|im_end|>")
    assert StreamDecoder(tok).push_many(ids) == "<think>\nhm\n</think>\n\nHi<|im_end|>"
    assert StreamDecoder(tok, skip_special_tokens=True).push_many(ids) == "\nhm\n\n\nHi"


def test_stream_decoder_with_a_metaspace_decoder(tmp_path):
    """SentencePiece-style tokens ("▁word") change their text with what precedes them; the window handles it."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *byte_tokens], show_progress=False)
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    text = "the lazy fox 🦊 jumps"
    ids = tok.encode(text)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)      # the emoji went to byte fallback
    decoder = StreamDecoder(tok)
    deltas = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_missing_or_broken_tokenizer_files_are_named(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{\"not\": \"a tokenizer\"}", encoding="utf-8")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_tokens_declared_only_in_tokenizer_config_are_added(qwen_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((qwen_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    base = Tokenizer.from_dir(tmp_path).vocab_size
    config["added_tokens_decoder"] = {str(base): {"content": "<|tool_marker|>", "special": True}}
    config["bos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.token_to_id("<|tool_marker|>") == base
    assert tok.encode("a<|tool_marker|>b")[1] == base
    assert tok.special_tokens["bos_token"] == "<|endoftext|>"
