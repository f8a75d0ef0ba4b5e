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
