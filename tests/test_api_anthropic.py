"""The official `anthropic` SDK against a live server over the real engine on the tiny Qwen3-MoE fixture."""
from __future__ import annotations

import anthropic
import httpx
import pytest
import torch

from tests.api_fixtures import live_server

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                            "required": ["city"]}}
OPENAI_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints("qwen3_moe")


@pytest.fixture(scope="module")
def server(ckpt):
    torch.set_num_threads(1)
    with live_server(ckpt, api_key="sk-local-test") as (service, srv):
        yield service, srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[1].url, api_key="sk-local-test", max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def hf_len(tok, messages, tools=None, **kwargs) -> int:
    return len(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                       return_dict=False, **kwargs))


def test_messages_non_stream(client, hf_tokenizer):
    m = client.messages.create(model="claude-local-sonnet", max_tokens=9, system="You are terse.",
                               messages=[{"role": "user", "content": "Hello there"}], extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == "claude-local-sonnet"
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 9
    assert m.usage.input_tokens == hf_len(hf_tokenizer, [{"role": "system", "content": "You are terse."},
                                                         {"role": "user", "content": "Hello there"}])
    assert [b.type for b in m.content] in (["text"], ["thinking", "text"], ["thinking"])


def test_messages_stream_equals_non_stream(client):
    kwargs = dict(model="claude-x", max_tokens=9, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Tell me"}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "message_delta" in events
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.usage.output_tokens == whole.usage.output_tokens == 9
    # the second run reads most of its prompt from the engine's prefix cache: counted apart, same total
    assert final.usage.cache_read_input_tokens > 0
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_tool_use_then_tool_result_round_trip(client, hf_tokenizer):
    user = {"role": "user", "content": "Weather in Paris? [[script:weather]]"}
    m = client.messages.create(model="claude-x", max_tokens=300, tools=[WEATHER], messages=[user])
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    thinking, call = m.content
    assert thinking.thinking == "The user asks about the weather, so I call the tool." and thinking.signature
    assert call.name == "get_weather" and call.input == {"city": "Paris", "unit": "celsius"}
    assert call.id

    history = [user, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "21 degrees"}]},
                                            {"type": "text", "text": "And now?"}]}]
    count = client.messages.count_tokens(model="claude-x", tools=[WEATHER], messages=history)
    hf_history = [
        {"role": "user", "content": user["content"]},
        {"role": "assistant", "content": "", "reasoning_content": thinking.thinking, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.input}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
        {"role": "user", "content": "And now?"}]
    assert count.input_tokens == hf_len(hf_tokenizer, hf_history, tools=[OPENAI_WEATHER])
    answer = client.messages.create(model="claude-x", max_tokens=300, tools=[WEATHER],
                                    messages=history[:2] + [{"role": "user", "content": [
                                        {"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees"},
                                        {"type": "text", "text": "[[script:answer]]"}]}])
    assert answer.stop_reason == "end_turn"
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text == "It is sunny in Paris, 21 degrees."


def test_tool_use_streams_input_json_deltas(client):
    with client.messages.stream(model="claude-x", max_tokens=300, tools=[WEATHER],
                                messages=[{"role": "user", "content": "[[script:weather]]"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "signature_delta", "input_json_delta"}
    assert final.stop_reason == "tool_use" and final.content[1].input == {"city": "Paris", "unit": "celsius"}
    stops = [e for e in events if e.type == "content_block_stop"]
    assert [e.index for e in stops] == [0, 1]


def test_thinking_blocks(client):
    m = client.messages.create(model="claude-x", max_tokens=300, thinking={"type": "enabled", "budget_tokens": 1024},
                               messages=[{"role": "user", "content": "2+2? [[script:think]]"}])
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Let me think about this carefully."
    assert m.content[1].text == "The answer is 4."
    assert m.stop_reason == "end_turn"


def test_count_tokens_uses_the_real_template(client, hf_tokenizer):
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc"},
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "list files"}]},
                {"role": "system", "content": "Reminder: be careful."}]
    n = client.messages.count_tokens(model="claude-x", system=system, tools=[WEATHER], messages=messages)
    expected = hf_len(hf_tokenizer, [{"role": "system", "content": "You are Claude Code.\n\nReminder: be careful."},
                                     {"role": "user", "content": "list files"}], tools=[OPENAI_WEATHER])
    assert n.input_tokens == expected       # billing header stripped, system message merged, tools counted


def test_beta_query_and_bearer_auth(server):
    url = server[1].url
    body = {"model": "claude-x", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": "u"}, "context_management": {"edits": []}, "output_config": {"effort": "low"}}
    r = httpx.post(f"{url}/v1/messages?beta=true", json=body, headers={
        "Authorization": "Bearer sk-local-test", "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2
    assert httpx.head(f"{url}/").status_code == 200
    listing = httpx.get(f"{url}/v1/models", headers={"x-api-key": "sk-local-test", "anthropic-version": "2023-06-01"})
    data = listing.json()
    assert data["has_more"] is False and data["data"][0]["type"] == "model"
    assert data["first_id"] == data["last_id"] == data["data"][0]["id"]


def test_errors_come_in_anthropic_shape(server):
    url = server[1].url
    bad_key = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad_key.messages.create(model="c", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"x-api-key": "sk-local-test",
                                                                        "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/messages", json={"model": "c", "messages": "hi", "max_tokens": "many"},
                   headers={"x-api-key": "sk-local-test"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "max_tokens" in r.json()["error"]["message"] and "messages" in r.json()["error"]["message"]


def test_stop_sequence_is_reported(client):
    m = client.messages.create(model="claude-x", max_tokens=100, stop_sequences=["never", "three"],
                               messages=[{"role": "user", "content": "[[script:stopword]]"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "three"
    assert m.content[-1].text == "one two "
    plain = client.messages.create(model="claude-x", max_tokens=100, stop_sequences=["absent"],
                                   messages=[{"role": "user", "content": "[[script:answer]]"}])
    assert plain.stop_reason == "end_turn" and plain.stop_sequence is None
