"""The API over another family's format: gpt-oss (harmony channels), on its tiny fixture with the real engine.

The Qwen format is covered by test_api_openai/test_api_anthropic; here the same API shapes must come out
of gpt-oss's analysis channel (reasoning) and `commentary to=functions.X` messages (tool calls).
"""
from __future__ import annotations

import json

import anthropic
import openai
import pytest
import torch

from tests.api_fixtures import live_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    torch.set_num_threads(1)
    with live_server(tiny_checkpoints("gpt_oss"), context_length=4096) as (service, srv):
        yield service, srv


def test_gpt_oss_tool_call_and_reasoning_in_openai_shape(server):
    client = openai.OpenAI(base_url=server[1].url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="gpt-oss-20b", tools=[WEATHER], max_tokens=300,
                                       messages=[{"role": "user", "content": "Weather? [[script:harmony_weather]]"}])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "The user wants the weather; call the tool."
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(
        model="m", max_tokens=300, stream=True, messages=[{"role": "user", "content": "[[script:harmony_answer]]"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert text == "It is 4." and reasoning == "Simple arithmetic."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_gpt_oss_in_anthropic_and_responses_shape(server):
    an = anthropic.Anthropic(base_url=server[1].url, api_key="x", max_retries=0)
    m = an.messages.create(model="claude-x", max_tokens=300, tools=[{
        "name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        messages=[{"role": "user", "content": "[[script:harmony_weather]]"}])
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[1].input == {"city": "Paris"}
    oa = openai.OpenAI(base_url=server[1].url + "/v1", api_key="x", max_retries=0)
    r = oa.responses.create(model="m", input="[[script:harmony_answer]]", reasoning={"effort": "low"})
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output_text == "It is 4."
