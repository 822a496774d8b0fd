"""Output parsers: the same result whether the text arrives all at once, character by character or token by
token; each family's markup recovered exactly; malformed tool calls degrade to text."""
from __future__ import annotations

import json
import random

import pytest

from runtime.text.chat_template import ChatTemplate
from runtime.text.parsers import Delta, collect, make_output_parser
from runtime.text.tokenizer import StreamDecoder, Tokenizer
from tests.fixtures.tokenizer import save_tokenizer

QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN35_PROMPT = QWEN3_PROMPT + "<think>\n"                       # Qwen3.5's generation prompt opens <think>
NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"          # enable_thinking=False closes it
HARMONY_PROMPT = "<|start|>user<|message|>hi<|end|><|start|>assistant"

WEATHER_SCHEMA = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}, "hourly": {"type": "boolean"},
    "stations": {"type": "array"}}}}}]

# (name, model_type, prompt, output, expected {"text", "reasoning", "tool_calls": [(name, arguments dict)]})
CASES = [
    ("qwen_think_then_answer", "qwen3_moe", QWEN3_PROMPT,
     "<think>\nThe user greets.\nReply kindly.\n</think>\n\nHello! 🦊 東京", 
     {"text": "Hello! 🦊 東京", "reasoning": "The user greets.\nReply kindly.", "tool_calls": []}),
    ("qwen_prompt_opened_think", "qwen3_5_moe_text", QWEN35_PROMPT,
     "Plan: call the tool.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n02134\n</parameter>\n"
     "<parameter=hourly>\ntrue\n</parameter>\n<parameter=stations>\n[\"A\", \"B\"]\n</parameter>\n</function>\n"
     "</tool_call>",
     {"text": "Checking.", "reasoning": "Plan: call the tool.",
      "tool_calls": [("get_weather", {"city": "New York", "days": 3, "zip": "02134", "hourly": True,
                                      "stations": ["A", "B"]})]}),
    ("qwen_no_think_json_calls", "qwen3_moe", NO_THINK_PROMPT,
     "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
     "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
     {"text": "Let me look.", "reasoning": "",
      "tool_calls": [("get_weather", {"city": "Paris"}), ("now", {})]}),
    ("qwen_multiline_xml_value", "qwen3_next", QWEN3_PROMPT,
     "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
     "def f():\n    return 1\n\n</parameter>\n</function>\n</tool_call>",
     {"text": "", "reasoning": "", "tool_calls": [("write_file", {"path": "a.py",
                                                                 "content": "def f():\n    return 1\n"})]}),
    ("qwen_malformed_json_is_text", "qwen3_moe", NO_THINK_PROMPT,
     "Sure <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call> done",
     {"text": "Sure <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call> done",
      "reasoning": "", "tool_calls": []}),
    ("qwen_unclosed_call_is_text", "qwen3_moe", NO_THINK_PROMPT,
     "Text then <tool_call>\n{\"name\": \"now\", \"argu",
     {"text": "Text then <tool_call>\n{\"name\": \"now\", \"argu", "reasoning": "", "tool_calls": []}),
    ("qwen_unclosed_but_complete_call", "qwen3_moe", NO_THINK_PROMPT,
     "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n",
     {"text": "", "reasoning": "", "tool_calls": [("now", {})]}),
    ("qwen_xml_without_function_is_text", "qwen3_5_moe", QWEN3_PROMPT,
     "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>",
     {"text": "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>", "reasoning": "", "tool_calls": []}),
    ("qwen_bare_function_block", "qwen3_5_moe_text", NO_THINK_PROMPT,
     "Writing it.\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\nDone.",
     {"text": "Writing it.Done.", "reasoning": "", "tool_calls": [("get_weather", {"city": "Oslo"})]}),
    ("qwen_bare_function_malformed_is_text", "qwen3_5_moe_text", NO_THINK_PROMPT,
     "See <function=broken stuff",
     {"text": "See <function=broken stuff", "reasoning": "", "tool_calls": []}),
    ("qwen_unfinished_reasoning", "qwen3_moe", QWEN35_PROMPT, "Still thinking about <tool_call> things\n",
     {"text": "", "reasoning": "Still thinking about <tool_call> things\n", "tool_calls": []}),
    ("qwen_lookalike_markers_are_text", "qwen3_moe", NO_THINK_PROMPT, "a <thin b </tool c <tool_cal",
     {"text": "a <thin b </tool c <tool_cal", "reasoning": "", "tool_calls": []}),
    ("harmony_reasoning_and_answer", "gpt_oss", HARMONY_PROMPT,
     "<|channel|>analysis<|message|>User says hi. 🦊<|end|><|start|>assistant<|channel|>final<|message|>"
     "Hello there!<|return|>",
     {"text": "Hello there!", "reasoning": "User says hi. 🦊", "tool_calls": []}),
    ("harmony_tool_call", "gpt_oss", HARMONY_PROMPT,
     "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\",\"days\":2}<|call|>",
     {"text": "", "reasoning": "Need weather.", "tool_calls": [("get_weather", {"city": "Paris", "days": 2})]}),
    ("harmony_recipient_in_role", "gpt_oss", HARMONY_PROMPT,
     "<|channel|>commentary to=functions.now<|message|>{}<|call|>",
     {"text": "", "reasoning": "", "tool_calls": [("now", {})]}),
    ("harmony_preamble_is_text", "gpt_oss", HARMONY_PROMPT,
     "<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant to=functions.now"
     "<|channel|>commentary json<|message|>{}<|call|>",
     {"text": "Looking it up.", "reasoning": "", "tool_calls": [("now", {})]}),
    ("harmony_malformed_arguments_are_text", "gpt_oss", HARMONY_PROMPT,
     "<|channel|>commentary to=functions.now <|constrain|>json<|message|>{oops<|call|>",
     {"text": "{oops", "reasoning": "", "tool_calls": []}),
    ("harmony_plain_text_model", "gpt_oss", HARMONY_PROMPT, "no channels at all " * 20,
     {"text": "no channels at all " * 20, "reasoning": "", "tool_calls": []}),
    ("harmony_short_unfinished_header", "gpt_oss", HARMONY_PROMPT, "hi",
     {"text": "hi", "reasoning": "", "tool_calls": []}),
    ("mixtral_plain", "mixtral", "<s> [INST] hi [/INST]", " Hello <think> <tool_call>{} 🦊",
     {"text": " Hello <think> <tool_call>{} 🦊", "reasoning": "", "tool_calls": []}),
]


def _parse(model_type: str, prompt: str, pieces, *, tools=None) -> tuple[dict, list[Delta]]:
    parser = make_output_parser(model_type, prompt, tools=tools)
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    return collect(deltas), deltas


def _comparable(result: dict) -> dict:
    return {"text": result["text"], "reasoning": result["reasoning"],
            "tool_calls": [(c["name"], json.loads(c["arguments"])) for c in result["tool_calls"]]}


@pytest.fixture(scope="module")
def byte_level_tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    """The fixtures' tokenizers (markers are added tokens, as in the real models), without building models."""
    out = {}
    for family, template in (("qwen", "qwen3.jinja"), ("gpt_oss", "gpt_oss.jinja"), ("mixtral", "mixtral.jinja")):
        folder = tmp_path_factory.mktemp(family)
        save_tokenizer(family, template, folder)
        out[family] = Tokenizer.from_dir(folder)
    return out


def _token_pieces(tok: Tokenizer, text: str) -> list[str]:
    """The text as the engine streams it: one StreamDecoder delta per generated token."""
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in tok.encode(text)]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("name, model_type, prompt, output, expected", CASES, ids=[c[0] for c in CASES])
def test_streaming_splits_agree_and_match_expected(byte_level_tokenizers, name, model_type, prompt, output,
                                                   expected):
    family = "gpt_oss" if model_type == "gpt_oss" else "mixtral" if model_type == "mixtral" else "qwen"
    whole, _ = _parse(model_type, prompt, [output], tools=WEATHER_SCHEMA)
    assert _comparable(whole) == expected
    by_char, _ = _parse(model_type, prompt, list(output), tools=WEATHER_SCHEMA)
    by_token, _ = _parse(model_type, prompt, _token_pieces(byte_level_tokenizers[family], output),
                         tools=WEATHER_SCHEMA)
    rng = random.Random(name)
    chunks, i = [], 0
    while i < len(output):
        step = rng.randint(1, 7)
        chunks.append(output[i:i + step])
        i += step
    by_chunk, _ = _parse(model_type, prompt, chunks, tools=WEATHER_SCHEMA)
    assert _comparable(by_char) == _comparable(by_token) == _comparable(by_chunk) == expected


def test_tool_call_deltas_carry_id_and_name_first_then_arguments():
    _, deltas = _parse("qwen3_moe", NO_THINK_PROMPT, list(CASES[2][3]))
    calls = [d for d in deltas if d.kind == "tool_call"]
    by_index: dict[int, list[Delta]] = {}
    for d in calls:
        by_index.setdefault(d.index, []).append(d)
    assert sorted(by_index) == [0, 1]
    for index, parts in by_index.items():
        assert parts[0].name is not None and parts[0].id.startswith("call_")
        assert all(p.id == parts[0].id and p.name is None for p in parts[1:])
        assert json.loads("".join(p.arguments for p in parts)) == [{"city": "Paris"}, {}][index]
    assert by_index[0][0].id != by_index[1][0].id


def test_xml_values_follow_the_tool_schema():
    output = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n"
              "<parameter=days>\n7\n</parameter>\n<parameter=hourly>\nmaybe\n</parameter>\n</function>\n</tool_call>")
    with_schema, _ = _parse("qwen3_5_moe", QWEN3_PROMPT, [output], tools=WEATHER_SCHEMA)
    # city is a string in the schema: "1984" stays text; a value that is not of its type is kept as text
    assert json.loads(with_schema["tool_calls"][0]["arguments"]) == {"city": "1984", "days": 7, "hourly": "maybe"}
    without, _ = _parse("qwen3_5_moe", QWEN3_PROMPT, [output])
    assert json.loads(without["tool_calls"][0]["arguments"]) == {"city": 1984, "days": 7, "hourly": "maybe"}


def test_feeding_after_finish_is_refused():
    parser = make_output_parser("qwen3_moe", QWEN3_PROMPT)
    parser.feed("hi")
    parser.finish()
    assert parser.finish() == []
    with pytest.raises(RuntimeError, match="finished"):
        parser.feed("more")


def _assistant_suffix(tpl: ChatTemplate, messages: list[dict], end: str) -> tuple[str, str]:
    """(generation prompt, what the model would have written): the template's own rendering of the last turn."""
    prompt = tpl.render(messages[:-1], add_generation_prompt=True)
    full = tpl.render(messages, add_generation_prompt=False)
    assert full.startswith(prompt)
    output = full[len(prompt):]
    assert output.endswith(end)
    return prompt, output[:-len(end)]


@pytest.mark.parametrize("template, model_type, end", [
    ("qwen3.jinja", "qwen3_moe", "<|im_end|>\n"), ("qwen3_5.jinja", "qwen3_5_moe_text", "<|im_end|>\n"),
    ("gpt_oss.jinja", "gpt_oss", "<|call|>")])
def test_parsers_invert_the_families_templates(template, model_type, end):
    """What a template writes for an assistant turn with reasoning and a tool call parses back to that turn."""
    from resources import resource_path

    tpl = ChatTemplate.from_string(resource_path("chat_templates", template).read_text(encoding="utf-8"))
    arguments = {"city": "São Paulo", "days": 3, "stations": ["A", "B"]}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "" if model_type == "gpt_oss" else "Let me check.",
                 "reasoning_content": "The user wants weather.",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}]
    prompt, output = _assistant_suffix(tpl, messages, end)
    result, _ = _parse(model_type, prompt, list(output), tools=WEATHER_SCHEMA)
    assert result["reasoning"] == "The user wants weather."
    assert result["text"] == ("" if model_type == "gpt_oss" else "Let me check.")
    assert [(c["name"], json.loads(c["arguments"])) for c in result["tool_calls"]] == [("get_weather", arguments)]
