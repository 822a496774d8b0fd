"""The official `openai` SDK against a live server over the real engine on the tiny Qwen3-MoE fixture.

Oracles that a wrong server would fail: prompt token counts from transformers' own
`apply_chat_template`; generated text equal to the engine run directly (greedy); tool calls, reasoning
and custom tool input equal to what the scripted model wrote; streams equal to their non-streamed twin.
"""
from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.api_fixtures import live_server

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints("qwen3_moe")


@pytest.fixture(scope="module")
def server(ckpt):
    torch.set_num_threads(1)
    with live_server(ckpt) as (service, srv):
        yield service, srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def direct_engine(ckpt):
    """The same model driven directly, without the server: what HTTP must reproduce."""
    from runtime.engine import Engine
    from tests.engine_fixtures import SafetensorsSource

    return Engine.from_package(SafetensorsSource(ckpt), device="cpu", context_length=2048)


def hf_prompt_len(tok, messages, tools=None) -> int:
    return len(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))


def direct_greedy(engine, hf_tok, messages, max_tokens) -> str:
    from runtime.engine import SamplingParams

    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return engine.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens)).text


def test_models_lists_the_loaded_model(client, ckpt):
    ids = [m.id for m in client.models.list().data]
    assert ids == [ckpt.name]                                     # the engine's model id: the folder name
    assert client.models.retrieve("gpt-4o").id == ckpt.name      # any id names the loaded model


def test_chat_non_stream_matches_direct_engine(client, hf_tokenizer, direct_engine):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, how are you?"}]
    r = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "gpt-4o"
    assert choice.message.role == "assistant"
    assert choice.message.content == direct_greedy(direct_engine, hf_tokenizer, messages, 12)
    assert r.usage.prompt_tokens == hf_prompt_len(hf_tokenizer, messages)
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_equals_non_stream_and_reports_usage(client):
    messages = [{"role": "user", "content": "The quick brown fox"}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_system_messages_inside_messages_are_merged(client, hf_tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    merged = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert r.usage.prompt_tokens == hf_prompt_len(hf_tokenizer, merged)


def test_chat_tool_call_with_reasoning(client, hf_tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris? [[script:weather]]"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL], max_tokens=200)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "The user asks about the weather, so I call the tool."
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].type == "function"
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert msg.tool_calls[0].id.startswith("call_")
    assert r.usage.prompt_tokens == hf_prompt_len(hf_tokenizer, messages, tools=[WEATHER_TOOL])

    # the round trip: the call and its result go back and render with the model's own template
    call = msg.tool_calls[0]
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    r2 = client.chat.completions.create(model="m", messages=history, tools=[WEATHER_TOOL], max_tokens=1)
    hf_history = messages + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    assert r2.usage.prompt_tokens == hf_prompt_len(hf_tokenizer, hf_history, tools=[WEATHER_TOOL])


def test_chat_tool_calls_stream_in_openai_delta_shape(client):
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "[[script:two_calls]]"}], tools=[WEATHER_TOOL],
        max_tokens=200, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.index not in calls:     # the first delta of a call carries its id, type and name
                assert tc.id and tc.type == "function" and tc.function.name == "get_weather"
                calls[tc.index] = {"id": tc.id, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert sorted(calls) == [0, 1] and calls[0]["id"] != calls[1]["id"]
    assert [json.loads(c["arguments"])["city"] for _, c in sorted(calls.items())] == ["Paris", "Tokyo"]


def test_stop_string_ends_the_answer(client):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "[[script:stopword]]"}],
                                       max_tokens=100, stop=["STOP"])
    assert r.choices[0].message.content == "one two three "
    assert r.choices[0].finish_reason == "stop"


def test_completions_raw_prompt_matches_direct_engine(client, direct_engine):
    from runtime.engine import SamplingParams

    prompt = "def add(a, b):"
    r = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
    ids = direct_engine.tokenizer.encode(prompt)
    assert r.object == "text_completion"
    assert r.choices[0].text == direct_engine.generate(ids, SamplingParams(temperature=0, max_tokens=8)).text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_responses_function_call_and_reasoning(client):
    r = client.responses.create(model="gpt-5-codex", instructions="You are a helpful agent.",
                                input="Weather? [[script:weather]]",
                                tools=[{"type": "function", "name": "get_weather", "description": "weather",
                                        "parameters": WEATHER_TOOL["function"]["parameters"]},
                                       {"type": "web_search"}])       # hosted: ignored, never an error
    assert r.status == "completed" and r.id.startswith("resp_")
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "The user asks about the weather, so I call the tool."
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_responses_custom_tool_answered_with_custom_tool_call(client):
    r = client.responses.create(model="m", input="Add a file [[script:patch]]",
                                tools=[{"type": "custom", "name": "apply_patch", "description": "Apply a patch"}])
    assert [item.type for item in r.output] == ["custom_tool_call"]
    assert r.output[0].name == "apply_patch"
    assert r.output[0].input == "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch"


def test_responses_stream_events_in_order(client):
    events = list(client.responses.create(model="m", input="[[script:weather]]", stream=True,
                                          tools=[{"type": "function", "name": "get_weather",
                                                  "parameters": WEATHER_TOOL["function"]["parameters"]}]))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.done" in types
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris", "unit": "celsius"}
    final = events[-1].response
    assert final.status == "completed" and final.usage.output_tokens > 0
    assert json.loads(final.output[1].arguments) == {"city": "Paris", "unit": "celsius"}


def test_responses_accepts_a_codex_history(client):
    # (greedy: a sampled answer from the random-weight model ended within 4 tokens once in CI and read "completed")
    r = client.responses.create(model="m", max_output_tokens=4, temperature=0, input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add a file"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "patching"}]},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
        {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": '{"cmd": ["ls"]}'},
        {"type": "function_call_output", "call_id": "c2", "output": "a.txt"},
    ], tools=[{"type": "custom", "name": "apply_patch"}, {"type": "function", "name": "shell", "parameters": {}}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4


def test_unsupported_options_are_refused_clearly(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
    assert err.value.body["param"] == "response_format" and "constrained decoding" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in err.value.body["message"]


def test_responses_stream_helper_accumulates_text_and_reasoning(client):
    """The SDK's own accumulator checks item and content indexes of every delta against what was added."""
    with client.responses.stream(model="m", input="2+2? [[script:think]]") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) == "The answer is 4."
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Let me think about this carefully."
    assert final.output[1].status == "completed" and final.output[1].content[0].annotations == []


def test_a_resent_conversation_reports_prefix_cache_reads(client):
    messages = [{"role": "system", "content": "You are a coding agent with a long system prompt. " * 8},
                {"role": "user", "content": "First question"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    turn2 = messages + [{"role": "assistant", "content": first.choices[0].message.content or "ok"},
                        {"role": "user", "content": "Second question"}]
    second = client.chat.completions.create(model="m", messages=turn2, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1        # the whole first prompt came from the cache
    assert cached < second.usage.prompt_tokens
