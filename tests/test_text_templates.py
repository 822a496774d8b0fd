"""Chat templates render byte-identically to transformers' apply_chat_template, and encode to the same ids.

The oracle is transformers itself on the tiny fixtures' tokenizer folders (each saved with our shipped
template for its family), over conversations that exercise every branch a family's template has:
system/developer prompts, tool definitions, tool calls, tool results, reasoning, thinking switches,
reasoning effort.
"""
from __future__ import annotations

import json

import pytest

from runtime.text.chat_template import ChatTemplate, ChatTemplateError, decode_tool_arguments
from runtime.text.tokenizer import Tokenizer

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "description": "Forecast days", "default": 1},
        "hourly": {"type": "boolean"},
        "stations": {"type": "array", "items": {"type": "string"}},
        "bbox": {"type": "array", "items": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        "note": {"type": "string", "nullable": True},
        "extra": {"type": "object", "properties": {"source": {"type": "string"}}, "required": ["source"]},
    }}}}
TIME_TOOL = {"type": "function", "function": {"name": "now", "description": "The time now, in ISO 8601.",
                                               "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

QWEN_CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi 🦊, 東京の天気は?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}],
    "history_with_reasoning": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n6"},
        {"role": "user", "content": "Thanks"}],
    "tools_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need two tools.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "stations": ["A", "B"]}}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "call_2", "content": "2026-11-30T00:00:00Z"}],
    "tools_then_answer": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Old reasoning.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "hot"},
        {"role": "assistant", "content": "It is hot.", "reasoning_content": "Done."},
        {"role": "user", "content": "Great"}],
    "tool_call_last": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "cold"}],
    "none_values_dropped": [{"role": "user", "content": "x", "name": None},
                            {"role": "assistant", "content": "y", "tool_calls": None, "reasoning": "r"},
                            {"role": "user", "content": "z"}],
}

GPT_OSS_CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi 🦊"}],
    "developer": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
    "system_as_developer": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    "tools_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "I should call get_weather.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ],
    "tools_then_final": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Call the tool.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "thinking": "Report it."},
        {"role": "user", "content": "Thanks"}],
}

MIXTRAL_CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi 🦊"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
               {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}],
}


def _pair(tiny_checkpoints, family):
    """(folder, transformers' tokenizer for the ids, ChatTemplate, Tokenizer).

    AutoTokenizer is the oracle. One exception, for the ids only: for `qwen3_5_moe` transformers 5 swaps
    in `Qwen3_5Tokenizer`, which rebuilds the pre-tokenizer and normalizer from code (Qwen3.5's regex, NFC)
    instead of reading tokenizer.json. On a real Qwen3.5 checkpoint the two agree; our fixture's
    tokenizer.json is a plain byte-level BPE, so there the oracle for ids is transformers' tokenizer.json
    loader. The template text is still compared with AutoTokenizer's.
    """
    import json as _json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = tiny_checkpoints(family)
    auto = AutoTokenizer.from_pretrained(folder)
    pipeline = _json.loads(auto.backend_tokenizer.to_str())
    on_disk = _json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    rebuilt = (pipeline["pre_tokenizer"], pipeline["normalizer"]) != (on_disk["pre_tokenizer"], on_disk["normalizer"])
    assert rebuilt == (family == "qwen3_5_moe")   # the exception stays an exception
    ids_oracle = PreTrainedTokenizerFast.from_pretrained(folder) if rebuilt else auto
    return folder, (auto, ids_oracle), ChatTemplate.from_dir(folder), Tokenizer.from_dir(folder)


def _assert_same(hf, tpl, tok, messages, **kwargs):
    text_oracle, ids_oracle = hf
    expected = text_oracle.apply_chat_template(messages, tokenize=False, **kwargs)
    ours = tpl.render(messages, **{"add_generation_prompt": False, **kwargs})
    assert ours == expected
    assert ids_oracle.apply_chat_template(messages, tokenize=False, **kwargs) == expected
    expected_ids = ids_oracle.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert tok.encode(ours) == expected_ids
    return ours


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_qwen_templates_match_transformers(tiny_checkpoints, family):
    _, hf, tpl, tok = _pair(tiny_checkpoints, family)
    rendered = []
    for name, messages in QWEN_CONVERSATIONS.items():
        for tools in (None, TOOLS):
            for thinking in (None, True, False):
                extra = {} if thinking is None else {"enable_thinking": thinking}
                rendered.append(_assert_same(hf, tpl, tok, messages, tools=tools, add_generation_prompt=True, **extra))
            _assert_same(hf, tpl, tok, messages, tools=tools, add_generation_prompt=False)
    joined = "".join(rendered)
    assert "<tool_call>" in joined and "<tool_response>" in joined and "Need two tools." in joined
    if family != "qwen3_moe":   # the fixtures give both hybrid families Qwen3.5's XML function format
        assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in joined
        assert '<parameter=stations>\n["A", "B"]\n</parameter>' in joined
        assert tpl.render(QWEN_CONVERSATIONS["plain"]).endswith("<|im_start|>assistant\n<think>\n")
    else:
        assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2' in joined
        # Qwen3's template also takes arguments as a JSON string (as OpenAI clients send them), verbatim.
        as_string = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]}]
        assert '"arguments": {"city":"Rome"}}' in _assert_same(hf, tpl, tok, as_string)
        assert tpl.render(QWEN_CONVERSATIONS["plain"]).endswith("<|im_start|>assistant\n")
    assert tpl.render(QWEN_CONVERSATIONS["plain"], enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_gpt_oss_harmony_template_matches_transformers(tiny_checkpoints):
    _, hf, tpl, tok = _pair(tiny_checkpoints, "gpt_oss")
    for name, messages in GPT_OSS_CONVERSATIONS.items():
        for tools in (None, TOOLS):
            for effort in (None, "low", "high"):
                extra = {} if effort is None else {"reasoning_effort": effort}
                _assert_same(hf, tpl, tok, messages, tools=tools, add_generation_prompt=True, **extra)
    final_turn = GPT_OSS_CONVERSATIONS["developer"] + [{"role": "assistant", "content": "Bonjour", "thinking": "fr"}]
    text = _assert_same(hf, tpl, tok, final_turn, add_generation_prompt=False)
    assert text.endswith("<|start|>assistant<|channel|>analysis<|message|>fr<|end|>"
                         "<|start|>assistant<|channel|>final<|message|>Bonjour<|return|>")
    text = _assert_same(hf, tpl, tok, GPT_OSS_CONVERSATIONS["plain"], add_generation_prompt=True,
                        builtin_tools=["browser", "python"], model_identity="You are a test model.",
                        reasoning_effort="high")
    assert "You are a test model.\n" in text and "namespace browser {" in text and "Reasoning: high" in text
    text = tpl.render(GPT_OSS_CONVERSATIONS["tools_round_trip"], tools=TOOLS)
    # Tools as a TypeScript-like namespace, the call on the commentary channel, the result from functions.NAME.
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert 'unit?: "celsius" | "fahrenheit", // default: celsius' in text
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>' in text
    assert text.endswith("<|start|>assistant")


def test_mixtral_template_matches_transformers_and_refuses_bad_order(tiny_checkpoints):
    _, hf, tpl, tok = _pair(tiny_checkpoints, "mixtral")
    for messages in MIXTRAL_CONVERSATIONS.values():
        text = _assert_same(hf, tpl, tok, messages, add_generation_prompt=True)
        assert text.startswith("<s>")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="alternate user/assistant"):
        tpl.render(bad)
    with pytest.raises(Exception, match="alternate user/assistant"):
        hf[0].apply_chat_template(bad, tokenize=False)


# Templates that use each piece of transformers' environment, checked against transformers itself.
ENVIRONMENT_TEMPLATES = {
    "generation_tag": "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                    "{% continue %}X{% endfor %}",
    "tojson_args": "{{ messages | tojson(indent=2, sort_keys=True) }}|{{ tools | tojson(separators=(',', ':')) }}"
                   "|{{ '<é>' | tojson }}|{{ messages[0] | tojson(ensure_ascii=True) }}",
    "namespace_and_dict": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                          "{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}",
    "trim_and_lstrip": "  {% if true %}\n  A\n  {% endif %}\n{% for m in messages %}\n  {{ m.role }}\n{% endfor %}",
    "special_tokens_and_kwargs": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ custom_flag }}|"
                                 "{{ add_generation_prompt }}|{{ documents | tojson }}",
    "reasoning_aliases": "{% for m in messages %}{{ m.thinking }}/{{ m.reasoning_content }}/"
                         "{{ m.reasoning is defined }};{% endfor %}",
    "strftime": "{{ strftime_now('%Y') }}",
}


@pytest.mark.parametrize("name", sorted(ENVIRONMENT_TEMPLATES))
def test_environment_matches_transformers(tiny_checkpoints, name):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_checkpoints("gpt_oss"))
    source = ENVIRONMENT_TEMPLATES[name]
    messages = [{"role": "user", "content": "héllo", "reasoning": "why"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c", "thinking": "t"}]
    kwargs = dict(tools=[TIME_TOOL], documents=[{"title": "T", "text": "doc"}], add_generation_prompt=True,
                  custom_flag=True)
    expected = hf.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)
    tpl = ChatTemplate.from_string(source, special_tokens=ChatTemplate.from_dir(tiny_checkpoints("gpt_oss")).special_tokens)
    assert tpl.render(messages, **kwargs) == expected


def test_sandbox_refuses_underscore_namespace_and_unsafe_access():
    tpl = ChatTemplate.from_string("{% set ns = namespace(_secret=1) %}{{ ns._secret }}")
    with pytest.raises(ChatTemplateError, match="underscore"):
        tpl.render([{"role": "user", "content": "x"}])
    tpl = ChatTemplate.from_string("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        tpl.render([{"role": "user", "content": "x"}])
    tpl = ChatTemplate.from_string("{{ messages.append(1) }}")   # immutable sandbox
    with pytest.raises(ChatTemplateError):
        tpl.render([{"role": "user", "content": "x"}])


def test_template_sources_and_selection(tmp_path):
    """chat_template.jinja wins; tokenizer_config's string or named list; tool_use picked when tools are passed."""
    folder = tmp_path / "tok"
    folder.mkdir()
    config = {"eos_token": {"content": "</s>", "__type": "AddedToken"}, "bos_token": "<s>",
              "chat_template": [{"name": "default", "template": "D{{ eos_token }}"},
                                {"name": "tool_use", "template": "T{{ tools | length }}"}]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tpl = ChatTemplate.from_dir(folder)
    messages = [{"role": "user", "content": "x"}]
    assert tpl.render(messages) == "D</s>"
    assert tpl.render(messages, tools=[TIME_TOOL]) == "T1"
    assert tpl.render(messages, template_name="tool_use", tools=[]) == "T0"
    config["chat_template"] = "S{{ bos_token }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    assert ChatTemplate.from_dir(folder).render(messages) == "S<s>"
    (folder / "chat_template.jinja").write_text("J{{ messages[0].content }}", encoding="utf-8")
    assert ChatTemplate.from_dir(folder).render(messages) == "Jx"


def test_bad_templates_and_inputs_get_clear_errors(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "x"}])
    tpl = ChatTemplate.from_string("{{ messages[0].content }}")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        tpl.render([])
    with pytest.raises(ChatTemplateError, match="message 0"):
        tpl.render(["not a dict"])
    with pytest.raises(ChatTemplateError, match="tool 0"):
        tpl.render([{"role": "user", "content": "x"}], tools=["get_weather"])
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        ChatTemplate.from_dir(tmp_path)


def test_json_string_arguments_are_decoded_for_templates_that_need_dicts(tiny_checkpoints):
    _, hf, tpl, tok = _pair(tiny_checkpoints, "qwen3_5_moe")
    as_dicts = QWEN_CONVERSATIONS["tool_call_last"]
    as_strings = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in as_dicts]
    with pytest.raises(ChatTemplateError):          # the published template iterates the arguments
        tpl.render(as_strings)
    decoded = decode_tool_arguments(as_strings)
    assert decoded == as_dicts and isinstance(as_strings[1]["tool_calls"][0]["function"]["arguments"], str)
    assert tpl.render(decoded) == hf[0].apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=True)
    untouched = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}]
    assert decode_tool_arguments(untouched) == untouched


def test_content_parts_render_as_transformers_renders_them(tiny_checkpoints):
    """OpenAI-style content lists: Qwen3.5's template reads the text parts itself."""
    _, hf, tpl, tok = _pair(tiny_checkpoints, "qwen3_5_moe")
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two."}]}]
    text = _assert_same(hf, tpl, tok, messages, add_generation_prompt=True)
    assert "Part one. Two." in text and "Be brief." in text
