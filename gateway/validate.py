"""Check an OpenAI request body before it costs anything: every 400 names the offending field.

Only what the gateway relies on, or what an engine would reject with a worse message, is checked;
unknown fields pass through untouched, since engines accept extensions such as ``top_k``.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import ApiError

_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer"})
_MAX_TOKENS_LIMIT = 10_000_000

# field -> (low, high, integer?) for the numeric knobs shared by both endpoints
_RANGES: dict[str, tuple[float, float, bool]] = {
    "max_tokens": (1, _MAX_TOKENS_LIMIT, True),
    "max_completion_tokens": (1, _MAX_TOKENS_LIMIT, True),
    "n": (1, 128, True),
    "best_of": (1, 128, True),
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "top_logprobs": (0, 20, True),
    "seed": (-(2**63), 2**64 - 1, True),  # vLLM's bound: the engines' generators take a 64-bit seed
}
_TOOL_CHOICES = frozenset({"none", "auto", "required"})


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, "invalid_value" if "must be" in message else "invalid_request", param)


def validate_body(body: Any, chat: bool) -> tuple[str, bool, int | None]:
    """Return (model, stream, max_tokens) of a valid body, or raise ApiError(400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' is required and must be a non-empty string.")
    if chat:
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", "'stream' must be a boolean.")
    for name, (low, high, integer) in _RANGES.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            kind = "an integer" if integer else "a number"
            raise _bad(name, f"'{name}' must be {kind}, not {type(value).__name__}.")
        if not low <= value <= high:  # integer bounds written out: a seed's 2**64 - 1 is not 1.84467e+19
            bounds = f"{int(low)} and {int(high)}" if integer else f"{low:g} and {high:g}"
            raise _bad(name, f"'{name}' must be between {bounds}; got {value}.")
    if body.get("best_of") is not None and body["best_of"] < (body.get("n") or 1):
        raise _bad("best_of", "'best_of' must be greater than or equal to 'n'.")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise _bad("stop", "'stop' must be a string or a list of strings.")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "'stream_options' must be an object.")
    if options is not None and not stream:  # as OpenAI answers it
        raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true.")
    if options is not None and not isinstance(options.get("include_usage", False), bool):  # "true" as a string was ignored
        raise _bad("stream_options.include_usage", "'stream_options.include_usage' must be a boolean.")
    _check_openai_fields(body, chat)
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    return model, stream, max_tokens


def _check_openai_fields(body: dict[str, Any], chat: bool) -> None:
    """The typed fields an engine would otherwise answer badly: llama.cpp with a 500 for ``tools`` it cannot
    parse, or by ignoring a ``response_format`` or ``logit_bias`` of the wrong type; the emulator not at all.
    Only their shape is checked: a tool ``type`` or ``response_format`` type OpenAI adds later passes."""
    logprobs = body.get("logprobs")
    if chat and logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs", "'logprobs' must be a boolean (the number of them is 'top_logprobs').")
    if not chat and logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20):
        raise _bad("logprobs", f"'logprobs' must be an integer between 0 and 20; got {logprobs!r}.")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "'user' must be a string.")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise _bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean.")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias", "'logit_bias' must be an object of token ids to numbers.")
        for token, value in bias.items():
            if not token.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise _bad("logit_bias", f"'logit_bias' must map token ids to numbers between -100 and 100; got {token!r}: {value!r}.")
    if chat:
        _check_tools(body.get("tools"))
        _check_tool_choice(body.get("tool_choice"))
        _check_response_format(body.get("response_format"))


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _bad("tools", "'tools' must be an array of tools.")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise _bad(f"tools[{i}]", f"'tools[{i}]' must be an object with a 'type'.")
        if tool["type"] != "function":
            continue
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad(f"tools[{i}].function", f"'tools[{i}].function' must be an object with a non-empty 'name'.")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters", f"'tools[{i}].function.parameters' must be a JSON Schema object.")


def _check_tool_choice(choice: Any) -> None:
    if choice is None or (isinstance(choice, str) and choice in _TOOL_CHOICES):
        return
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        function = choice.get("function")
        if choice["type"] != "function" or (isinstance(function, dict) and isinstance(function.get("name"), str)):
            return
    raise _bad("tool_choice", f"'tool_choice' must be one of {sorted(_TOOL_CHOICES)} or an object naming a function.")


def _check_response_format(fmt: Any) -> None:
    if fmt is None:
        return
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _bad("response_format", "'response_format' must be an object with a 'type' (text, json_object or json_schema).")
    if fmt["type"] == "json_schema" and not isinstance(fmt.get("json_schema"), dict):
        raise _bad("response_format.json_schema", "'response_format.json_schema' must be an object holding the schema.")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' is required and must be a non-empty array.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", f"'messages[{i}]' must be an object.")
        role = message.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of {sorted(_ROLES)}.")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise _bad(f"messages[{i}].name", f"'messages[{i}].name' must be a string.")
        _check_tool_calls(i, message.get("tool_calls"))
        content = message.get("content")
        if content is None:
            if role == "assistant" or "tool_calls" in message or "function_call" in message:
                continue
            raise _bad(f"messages[{i}].content", f"'messages[{i}].content' is required.")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
            raise _bad(f"messages[{i}].content", f"'messages[{i}].content' must be a string or an array of content parts.")
        for j, part in enumerate(content):
            if not isinstance(part.get("type"), str) or (part["type"] == "text" and not isinstance(part.get("text"), str)):
                raise _bad(f"messages[{i}].content[{j}]", f"'messages[{i}].content[{j}]' must have a 'type', and a text part its 'text' string.")


def _check_tool_calls(i: int, calls: Any) -> None:
    """An assistant message's ``tool_calls``, as OpenAI's wire types have them (``arguments`` a JSON string)."""
    if calls is None:
        return
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(where, f"'{where}' must be an array of tool calls.")
    for j, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("type"), str):
            raise _bad(f"{where}[{j}]", f"'{where}[{j}]' must be an object with a 'type'.")
        function = call.get("function")
        if call["type"] == "function" and (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                                           or not isinstance(function.get("arguments"), str)):
            raise _bad(f"{where}[{j}].function", f"'{where}[{j}].function' must be an object with a 'name' and 'arguments' (a JSON string).")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return
        if isinstance(first, list) and all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt
        ):
            return
    raise _bad("prompt", "'prompt' is required and must be a string, an array of strings, or token ids.")
