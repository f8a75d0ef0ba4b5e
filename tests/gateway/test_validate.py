"""Request validation: every refusal is a 400 that names the offending field."""

from __future__ import annotations

import pytest

from gateway.errors import ApiError
from gateway.validate import validate_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "body, param",
    [
        ([], None),
        ({"messages": CHAT["messages"]}, "model"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": "10"}, "max_tokens"),
        ({**CHAT, "temperature": 2.5}, "temperature"),
        ({**CHAT, "top_p": True}, "top_p"),
        ({**CHAT, "n": 1000}, "n"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "stop": [1, 2]}, "stop"),
        ({**CHAT, "stream_options": []}, "stream_options"),
        # before, accepted: the first without a stream, the second's usage chunk never came
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
        # before, passed on: llama.cpp answered a malformed tool 500 (which counted against the replica), the
        # emulator 200, and llama.cpp ignored the rest
        ({**CHAT, "tools": "rm -rf"}, "tools"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({**CHAT, "tools": [{"function": {"name": "f"}}]}, "tools[0]"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
        ({**CHAT, "tool_choice": "sometimes"}, "tool_choice"),
        ({**CHAT, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({**CHAT, "response_format": "json"}, "response_format"),
        ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({**CHAT, "seed": "42"}, "seed"),
        ({**CHAT, "seed": 2**64}, "seed"),
        ({**CHAT, "user": 7}, "user"),
        ({**CHAT, "logprobs": 3}, "logprobs"),
        ({**CHAT, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({**CHAT, "logit_bias": {"50256": "-100"}}, "logit_bias"),
        ({**CHAT, "logit_bias": {"the": 5}}, "logit_bias"),
        ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages[0].tool_calls[0].function"),
        ({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
         "messages[0].tool_calls[0].function"),
        ({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls[0]"),
        ({"model": "m", "messages": [{"role": "assistant", "tool_calls": {}}]}, "messages[0].tool_calls"),
        # llama.cpp answered these 500 ("Failed to parse messages: ...")
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, "messages[0].content[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"text": "hi"}]}]}, "messages[0].content[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
    ],
)
def test_chat_errors_name_the_field(body: object, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        validate_body(body, chat=True)
    assert info.value.status == 400 and info.value.param == param
    if param:
        assert param.split("[")[0].split(".")[0] in info.value.message


def test_valid_bodies_and_pass_through_of_unknown_fields() -> None:
    assert validate_body({**CHAT, "top_k": 20, "max_tokens": 5, "stream": True}, chat=True) == ("m", True, 5)
    assert validate_body({**CHAT, "max_completion_tokens": 7}, chat=True) == ("m", False, 7)
    for prompt in ("hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert validate_body({"model": "m", "prompt": prompt}, chat=False)[0] == "m"
    with pytest.raises(ApiError, match="prompt"):
        validate_body({"model": "m", "prompt": [True]}, chat=False)


def test_the_typed_openai_fields_pass_in_every_shape_openai_gives_them() -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}], "name": "u"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    for fields in ({"tools": [tool, {"type": "custom", "custom": {"name": "x"}}], "tool_choice": "required", "parallel_tool_calls": False},
                   {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                   {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {}}}},
                   {"response_format": {"type": "json_object"}}, {"response_format": {"type": "text"}},
                   {"seed": -(2**63), "user": "u-1", "logprobs": True, "top_logprobs": 5, "logit_bias": {"50256": -100, "7": 2.5}},
                   {"tools": None, "tool_choice": None, "response_format": None, "seed": None, "user": None, "logprobs": None}):
        assert validate_body({"model": "m", "messages": messages, **fields}, chat=True)[0] == "m", fields
    assert validate_body({"model": "m", "prompt": "hi", "logprobs": 5, "seed": 2**64 - 1}, chat=False)[0] == "m"
    for logprobs in (True, 21, "5"):
        with pytest.raises(ApiError, match="'logprobs' must be an integer"):
            validate_body({"model": "m", "prompt": "hi", "logprobs": logprobs}, chat=False)
