"""The gateway's OpenAPI document, served at GET /openapi.json (for clients and schema-driven fuzzing)."""

from __future__ import annotations

from typing import Any

import orjson

_ERROR = {
    "description": "OpenAI-style error envelope",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}
_BEARER = [{"bearer": []}]


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(status): _ERROR for status in statuses}


_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool", "function", "developer"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}, {"type": "null"}]},
    },
}
_SAMPLING = {
    "model": {"type": "string", "minLength": 1},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 128},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "stream_options": {"type": "object"},
    "seed": {"type": "integer"},
    "user": {"type": "string"},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
}
_NAMED = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}}
_CHAT_FIELDS = {
    "tools": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}, "function": _NAMED}}},
    "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "object", "required": ["type"]}]},
    "parallel_tool_calls": {"type": "boolean"},
    "response_format": {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}, "json_schema": {"type": "object"}}},
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
}
_TIER = {"name": "x-polymorph-tier", "in": "header", "required": False, "schema": {"type": "string"}}
_ROUTED = {
    "description": "The engine's answer (JSON, or server-sent events when stream is true)",
    "headers": {name: {"schema": {"type": "string"}} for name in ("x-polymorph-pool", "x-polymorph-replica", "x-polymorph-shape")},
    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}},
}


def _completion_path(summary: str, required: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": _BEARER,
            "parameters": [_TIER],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"type": "object", "required": required, "properties": {**_SAMPLING, **extra}}}},
            },
            "responses": {"200": _ROUTED, **_errors(400, 401, 403, 404, 413, 429, 502, 503, 504)},
        }
    }


def _post(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": _BEARER,
            "parameters": [_TIER],
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {"200": _ROUTED, **_errors(400, 401, 403, 404, 413, 429, 502, 503, 504)},
        }
    }


_TEXTS = {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string", "minLength": 1}}]}
_EMBEDDINGS = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {
            "oneOf": [
                *_TEXTS["oneOf"],
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "integer"}},
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}}},
            ]
        },
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": {"type": "string"},
    },
}
_RESPONSES = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "object"}}]},
        "instructions": {"type": "string"},
        "stream": {"type": "boolean"},
        "store": {"type": "boolean"},
        "previous_response_id": {
            "type": "string",
            "minLength": 1,
            "description": "Routed to the replica that produced it; a 400 previous_response_not_found when this gateway process did not proxy it.",
        },
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "tools": {"type": "array", "items": {"type": "object"}},
    },
}
_RERANK = {
    "type": "object",
    "required": ["model", "query", "documents"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "query": {"type": "string", "minLength": 1},
        "documents": {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string", "minLength": 1}},
        "top_n": {"type": "integer", "minimum": 0},
    },
}
_SCORE = {
    "type": "object",
    "required": ["model", "text_1", "text_2"],
    "properties": {"model": {"type": "string", "minLength": 1}, "text_1": _TEXTS, "text_2": _TEXTS},
}


def _get(summary: str, content_type: str, secured: bool, *errors: int) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK", "content": {content_type: {"schema": {"type": "object" if "json" in content_type else "string"}}}}, **_errors(*errors)},
    }
    if secured:
        operation["security"] = _BEARER
    return {"get": operation}


DOCUMENT: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "Polymorph gateway", "version": "0.1.0", "description": "OpenAI-compatible, workload-aware inference gateway."},
    "servers": [{"url": "/"}],
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["message", "type", "code"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": "string", "nullable": True},
                            "code": {"type": "string"},
                        },
                    }
                },
            }
        },
    },
    "paths": {
        "/v1/chat/completions": _completion_path("Chat completion (routed by shape)", ["model", "messages"], {"messages": {"type": "array", "minItems": 1, "items": _MESSAGE}, **_CHAT_FIELDS}),
        "/v1/completions": _completion_path(
            "Text completion (routed by shape)",
            ["model", "prompt"],
            {"prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "array", "items": {"type": "integer"}}]},
             "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}},
        ),
        "/v1/embeddings": _post("Embeddings (classified by input tokens; the tenant's token limits charge the input)", _EMBEDDINGS),
        "/v1/responses": _post("Responses API, passed through to engines that implement it (JSON, or typed SSE events when stream is true)", _RESPONSES),
        "/v1/responses/{response_id}": {"get": {
            **_get("A stored response, from the replica that holds it (asked of the replicas when this process did not proxy it)",
                   "application/json", True, 401, 404)["get"],
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,200}$"}}],
        }},
        "/v1/rerank": _post("Rerank documents against a query (vLLM, sglang)", _RERANK),
        "/rerank": _post("Rerank documents against a query (vLLM)", _RERANK),
        "/v1/score": _post("Score text pairs (vLLM)", _SCORE),
        "/score": _post("Score text pairs (vLLM)", _SCORE),
        "/v1/models": _get("Models this key may use", "application/json", True, 401),
        "/v1/models/{model}": {"get": {
            **_get("One model this key may use (404 for any other)", "application/json", True, 401, 404)["get"],
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}],
        }},
        "/healthz": _get("Liveness", "application/json", False),
        "/readyz": _get("Readiness: some replica is healthy", "application/json", False, 503),
        "/metrics": _get("Prometheus metrics", "text/plain", False),
        "/admin/state": _get("Pools, replicas and config version (admin token)", "application/json", True, 401, 403),
        "/admin/decisions": _get("The control loop's decision log, newest last (admin token)", "application/json", True, 400, 401, 403),
    },
}

DOCUMENT_BYTES = orjson.dumps(DOCUMENT)
