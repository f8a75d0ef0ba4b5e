"""The emulated sglang server: an aiohttp app around ``EngineDriver``.

OpenAI routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/v1/embeddings``,
``/v1/responses``), the rerank and score routes vLLM serves (``/v1/rerank``, ``/rerank``,
``/v1/score``, ``/score``; sglang serves ``/v1/rerank``), sglang's native ones
(``/generate``, ``/health``, ``/server_info``, ``/model_info`` and their older ``/get_*`` names,
``/metrics``) and the emulator's own (``/_emulator/faults``, ``/_emulator/stats``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from fleet.emulator.driver import EngineDriver, TokenStream
from fleet.emulator.faults import FaultPlan, FaultSpec, RequestFault
from fleet.emulator.generation import (
    BadRequest,
    DomainPredictor,
    Generation,
    parse_chat,
    parse_completion,
    parse_embeddings,
    parse_generate,
    parse_rerank,
    parse_responses,
    parse_score,
    text_prefix_hash_ids,
)
from fleet.emulator.metrics import render_metrics
from fleet.emulator.responses import GenerateRenderer, OpenAIRenderer, ResponsesRenderer, embeddings_body, error_body, rerank_body, score_body
from kernels.catalog import get_gpu, get_model
from kernels.compiler.gates import launch_violation
from kernels.config import EngineConfig
from kernels.engine import Engine
from kernels.perf import PerfModel

_CRASH_EXIT_CODE = 17
_JSON = "application/json"
_MAX_STORED_RESPONSES = 10_000  # Responses ids kept for follow-ups (previous_response_id), oldest out first


@dataclass(frozen=True, slots=True)
class EmulatorSettings:
    """What one emulated replica serves and how."""

    model: str
    gpu: str
    config: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = None  # default: the catalog model's name
    speed: float = 1.0  # engine seconds per wall second
    faults: FaultSpec = field(default_factory=FaultSpec)
    embedding_dimensions: int | None = None  # default: the model's hidden size
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters it answers to as vLLM does: (name, path)


class EmulatorState:
    """Everything the handlers share: the driver, the fault plan, model facts."""

    def __init__(self, settings: EmulatorSettings) -> None:
        model = get_model(settings.model)
        gpu = get_gpu(settings.gpu)
        refused = launch_violation(model, settings.config)
        if refused is not None:  # as sglang refuses it (before, the emulator served it)
            raise ValueError(f"sglang would not start {model.name} so: {refused}")
        perf = PerfModel(model, gpu, settings.config)
        if perf.kv_capacity_tokens <= 0:
            raise ValueError(f"{model.name} does not fit on {gpu.name} with this configuration (no room for KV cache)")
        self.settings = settings
        self.model = model
        self.gpu = gpu
        self.perf = perf
        self.served_model_name = settings.served_model_name or model.name
        self.adapters = dict(settings.adapters)
        self.max_context = model.max_context
        self.driver = EngineDriver([Engine(perf, perf.config) for _ in range(perf.config.dp)], settings.speed)
        self.faults = FaultPlan(settings.faults)
        self.driver.slowdown = settings.faults.slowdown
        self.domains = DomainPredictor()
        self.ids = itertools.count(1)
        self.id_prefix = f"{os.getpid():x}"
        self.embedding_dimensions = settings.embedding_dimensions or model.hidden_size
        # Responses this replica stored: id -> the tokens of the conversation so far (which a follow-up
        # naming it as previous_response_id carries in its prompt) and the response object, which
        # GET /v1/responses/{id} answers, as vLLM's does
        self.stored_responses: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        # Set by the server once it listens; closes the listening socket for a while.
        self.refuse_connections: Callable[[float], Coroutine[Any, Any, None]] | None = None

    def new_req_id(self, prefix: str) -> str:
        if prefix == "resp":  # a stored response's id is the key to it: random, as vLLM's and sglang's uuids are
            return f"resp-{secrets.token_hex(16)}"
        return f"{prefix}-{self.id_prefix}{next(self.ids):08x}"

    def store_response(self, response_id: str, context_tokens: int, response: bytes) -> None:
        self.stored_responses[response_id] = (context_tokens, response)
        if len(self.stored_responses) > _MAX_STORED_RESPONSES:
            self.stored_responses.popitem(last=False)

    def set_faults(self, spec: FaultSpec) -> None:
        self.faults.replace_spec(spec)
        self.driver.slowdown = spec.slowdown


STATE = web.AppKey("emulator_state", EmulatorState)


def _json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=_JSON)


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    return web.Response(body=error_body(message, status, param), status=status, content_type=_JSON)


async def _read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


async def _hang(duration_s: float) -> None:
    if duration_s < 0:
        await asyncio.Event().wait()  # until the client leaves (the handler is cancelled)
    await asyncio.sleep(duration_s)


def _crash(request: web.Request, mode: str) -> None:
    if mode == "exit":
        os._exit(_CRASH_EXIT_CODE)
    if request.transport is not None:
        request.transport.abort()
    raise asyncio.CancelledError  # the connection is gone: stop the handler without a reply


# --- inference -----------------------------------------------------------------------------------
Parser = Callable[[dict[str, Any], int, DomainPredictor], Generation]


async def _serve(request: web.Request, parse: Parser, id_prefix: str) -> web.StreamResponse:
    state = request.app[STATE]
    fault = state.faults.on_request()
    if fault.hang_s:
        await _hang(fault.hang_s)
    if fault.error_status is not None:
        return _error(f"emulated fault: HTTP {fault.error_status}", fault.error_status)
    try:
        body = await _read_json(request)
        generation = parse(body, state.max_context, state.domains)
    except BadRequest as exc:
        return _error(str(exc), 400, exc.param)
    name = _answering_name(state, body)
    if name is None:
        return _error(f"The model `{str(body.get('model'))[:200]}` does not exist.", 404, "model")
    # Tokenisation, scheduling and detokenisation cost a real server this much per request; the
    # performance model charges the same to TTFT, so the emulator and the predictions agree.
    await asyncio.sleep(state.perf.request_overhead_s * state.driver.slowdown / state.settings.speed)
    req_id = state.new_req_id(id_prefix)
    max_new = generation.max_tokens or generation.output_tokens
    stream = state.driver.submit(req_id, generation.prompt_tokens, generation.output_tokens, generation.domain,
                                 generation.prefix_hash_ids, max_new)
    if stream is None:
        return _error(f"request needs {generation.prompt_tokens + generation.output_tokens} tokens of KV cache, "
                      f"more than this replica holds", 400, "max_tokens")
    try:
        if generation.kind == "generate":
            return await _answer_generate(request, generation, stream, fault)
        if generation.kind == "responses":
            return await _answer_responses(request, ResponsesRenderer(generation, req_id, name, int(time.time()), body), stream, fault)
        renderer = OpenAIRenderer(generation, req_id, name, int(time.time()))
        if generation.stream:
            return await _stream_openai(request, renderer, stream, fault)
        await _wait_all(request, stream, fault)
        return web.Response(body=renderer.full(stream.num_cached_tokens), content_type=_JSON)
    finally:
        if not stream.is_finished:
            state.driver.abort(req_id)


def _answering_name(state: EmulatorState, body: dict[str, Any]) -> str | None:
    """The model id the response reports: the adapter the request names, else the served model. None: a model
    this replica does not serve, which only a replica that loads adapters refuses (vLLM's 404); one without
    adapters answers any name, as it always has (tests and tools name the emulated model loosely)."""
    asked = body.get("model")
    if isinstance(asked, str) and asked in state.adapters:
        return asked
    if state.adapters and asked is not None and asked != state.served_model_name:
        return None
    return state.served_model_name


async def _next_tokens(request: web.Request, stream: TokenStream, num_sent: int, fault: RequestFault,
                       stalled: list[bool]) -> int:
    """Wait for tokens past ``num_sent``; returns how many may be sent now (applying stall and crash faults)."""
    while stream.num_ready <= num_sent and not stream.is_finished:
        await stream.wait()
    ready = stream.num_ready
    if fault.crash_after_tokens is not None and ready >= fault.crash_after_tokens:
        if num_sent >= fault.crash_after_tokens:
            _crash(request, fault.crash_mode)
        ready = fault.crash_after_tokens
    if fault.stall_after_tokens is not None and not stalled[0] and ready >= fault.stall_after_tokens:
        if num_sent >= fault.stall_after_tokens:
            stalled[0] = True
            await _hang(fault.stall_s)
        else:
            ready = fault.stall_after_tokens
    return ready


async def _wait_all(request: web.Request, stream: TokenStream, fault: RequestFault) -> None:
    num_done, stalled = 0, [False]
    while not (stream.is_finished and num_done >= stream.num_ready):
        num_done = await _next_tokens(request, stream, num_done, fault, stalled)


async def _stream_openai(request: web.Request, renderer: OpenAIRenderer, stream: TokenStream,
                         fault: RequestFault) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    num_sent, stalled = 0, [False]
    try:
        await response.write(renderer.first_chunk())
        while not (stream.is_finished and num_sent >= stream.num_ready):
            ready = await _next_tokens(request, stream, num_sent, fault, stalled)
            if ready > num_sent:
                await response.write(renderer.text_chunk(num_sent, ready))
                num_sent = ready
        await response.write(renderer.last_chunks(stream.num_cached_tokens, renderer.generation.include_usage))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the caller aborts the request
    return response


async def _answer_generate(request: web.Request, generation: Generation, stream: TokenStream,
                           fault: RequestFault) -> web.StreamResponse:
    renderer = GenerateRenderer(generation, stream.req_id)
    if not generation.stream:
        await _wait_all(request, stream, fault)
        return web.Response(body=renderer.full(stream.num_cached_tokens, time.monotonic() - stream.submitted_at),
                            content_type=_JSON)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    num_sent, stalled = 0, [False]
    try:
        while not (stream.is_finished and num_sent >= stream.num_ready):
            ready = await _next_tokens(request, stream, num_sent, fault, stalled)
            if ready > num_sent:
                num_sent = ready
                finished = stream.is_finished and num_sent >= stream.num_ready
                latency_s = time.monotonic() - stream.submitted_at
                await response.write(renderer.chunk(num_sent, stream.num_cached_tokens, finished, latency_s))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response


async def _answer_responses(request: web.Request, renderer: ResponsesRenderer, stream: TokenStream, fault: RequestFault) -> web.StreamResponse:
    generation = renderer.generation
    if not generation.stream:
        await _wait_all(request, stream, fault)
        answer: web.StreamResponse = web.Response(body=renderer.full(stream.num_cached_tokens), content_type=_JSON)
    else:
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await answer.prepare(request)
        num_sent, stalled = 0, [False]
        try:
            await answer.write(renderer.first_events())
            while not (stream.is_finished and num_sent >= stream.num_ready):
                ready = await _next_tokens(request, stream, num_sent, fault, stalled)
                if ready > num_sent:
                    await answer.write(renderer.delta(num_sent, ready))
                    num_sent = ready
            await answer.write(renderer.last_events(stream.num_cached_tokens))
            await answer.write_eof()
        except ConnectionResetError:
            return answer  # the client left before the end: nothing was stored
    if renderer.body.get("store") is not False:
        request.app[STATE].store_response(renderer.req_id, generation.prompt_tokens + generation.output_tokens,
                                          renderer.full(stream.num_cached_tokens))
    return answer


async def responses(request: web.Request) -> web.StreamResponse:
    """The Responses API, stateless but for the ids it stored, so a follow-up continues its conversation."""
    state = request.app[STATE]
    try:
        body = await _read_json(request)
    except BadRequest as exc:
        return _error(str(exc), 400, exc.param)
    previous = body.get("previous_response_id")
    context_tokens = 0
    if previous is not None:
        found = state.stored_responses.get(previous) if isinstance(previous, str) else None
        if found is None:
            return _error(f"Previous response with id {str(previous)[:200]!r} not found.", 400, "previous_response_id")
        context_tokens = found[0]
    return await _serve(request, lambda b, m, d: parse_responses(b, m, d, context_tokens), "resp")


async def retrieve_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{response_id}``: a stored response, or vLLM's 404 for one this replica does not hold."""
    found = request.app[STATE].stored_responses.get(request.match_info["response_id"])
    if found is None:
        return _error(f"Response with id {request.match_info['response_id'][:200]!r} not found.", 404)
    return web.Response(body=found[1], content_type=_JSON)


# --- pooling: embeddings, rerank, score -----------------------------------------------------------
Render = Callable[[str], bytes]  # the answer's body, given the request id


async def _serve_pooling(request: web.Request, id_prefix: str, parse: Callable[[dict[str, Any], EmulatorState], tuple[int, str, Render]]) -> web.StreamResponse:
    """A request that is all prefill: its input is scheduled on the engine (one output token stands for
    the pooled result), so it takes the time the performance model gives that prompt under the load."""
    state = request.app[STATE]
    fault = state.faults.on_request()
    if fault.hang_s:
        await _hang(fault.hang_s)
    if fault.error_status is not None:
        return _error(f"emulated fault: HTTP {fault.error_status}", fault.error_status)
    try:
        prompt_tokens, text, render = parse(await _read_json(request), state)
    except BadRequest as exc:
        return _error(str(exc), 400, exc.param)
    await asyncio.sleep(state.perf.request_overhead_s * state.driver.slowdown / state.settings.speed)
    req_id = state.new_req_id(id_prefix)
    stream = state.driver.submit(req_id, prompt_tokens, 1, "chat", text_prefix_hash_ids(text), 1)
    if stream is None:
        return _error(f"the input needs {prompt_tokens} tokens of KV cache, more than this replica holds", 400, "input")
    try:
        await _wait_all(request, stream, fault)
    finally:
        if not stream.is_finished:
            state.driver.abort(req_id)
    return web.Response(body=render(req_id), content_type=_JSON)


def _embeddings_request(body: dict[str, Any], state: EmulatorState) -> tuple[int, str, Render]:
    pooling = parse_embeddings(body)
    dimensions = body.get("dimensions")
    if dimensions is None:
        dimensions = state.embedding_dimensions
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= state.embedding_dimensions:
        raise BadRequest(f"'dimensions' must be an integer between 1 and {state.embedding_dimensions}", "dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    if max(pooling.item_tokens) > state.max_context:
        raise BadRequest(f"an input is longer than this model's maximum context length of {state.max_context} tokens", "input")
    return pooling.prompt_tokens, "\n".join(pooling.texts), lambda _: embeddings_body(pooling, state.served_model_name, dimensions, encoding == "base64")


def _rerank_request(body: dict[str, Any], state: EmulatorState) -> tuple[int, str, Render]:
    query, documents = parse_rerank(body)
    top_n = body.get("top_n") or 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise BadRequest("'top_n' must be a non-negative integer", "top_n")
    tokens = query.prompt_tokens * len(documents.texts) + documents.prompt_tokens  # each document is scored with the query
    return tokens, "\n".join(query.texts), lambda req_id: rerank_body(req_id, query, documents, state.served_model_name, top_n, body.get("return_documents", True) is not False)


def _score_request(body: dict[str, Any], state: EmulatorState) -> tuple[int, str, Render]:
    first, second = parse_score(body)
    if len(first.texts) != 1 and len(first.texts) != len(second.texts):
        raise BadRequest("the two sides must have the same number of items, or the first exactly one", "text_1")
    tokens = first.prompt_tokens * (len(second.texts) if len(first.texts) == 1 else 1) + second.prompt_tokens
    return tokens, "\n".join(first.texts), lambda req_id: score_body(req_id, first, second, state.served_model_name, int(time.time()))


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _serve_pooling(request, "embd", _embeddings_request)


async def rerank(request: web.Request) -> web.StreamResponse:
    return await _serve_pooling(request, "rerank", _rerank_request)


async def score(request: web.Request) -> web.StreamResponse:
    return await _serve_pooling(request, "score", _score_request)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_chat, "chatcmpl")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion, "cmpl")


async def generate(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_generate, "gen")


# --- information ---------------------------------------------------------------------------------
async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = state.served_model_name
    adapters = [{"id": adapter, "object": "model", "created": 0, "owned_by": "vllm", "root": path, "parent": name}
                for adapter, path in state.adapters.items()]  # as vLLM lists its LoRA modules
    return _json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": 0, "owned_by": "sglang", "root": name,
        "max_model_len": state.max_context,
    }, *adapters]})


async def health(request: web.Request) -> web.Response:
    status = request.app[STATE].faults.spec.health_status
    return web.Response(status=status)


def _server_info(state: EmulatorState) -> dict[str, Any]:
    config = state.perf.config
    stats = state.driver.engine_stats()
    info: dict[str, Any] = {f"{k}_size" if k in ("tp", "dp", "ep") else k: v for k, v in config.to_dict().items()}
    info.update(
        model_path=state.model.name,
        served_model_name=state.served_model_name,
        context_length=state.max_context,
        max_total_num_tokens=stats.kv_capacity_tokens,
        max_running_requests=state.driver.engines[0].limits.max_running_requests,
        version="emulated",
        emulated=True,
        gpu=state.gpu.name,
        speed=state.driver.speed,
        internal_states=[{"num_running_reqs": stats.num_running, "num_queue_reqs": stats.num_waiting,
                          "token_usage": stats.token_usage, "gen_throughput": stats.gen_throughput_tok_s}],
    )
    return info


async def server_info(request: web.Request) -> web.Response:
    return _json_response(_server_info(request.app[STATE]))


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return _json_response({"model_path": state.model.name, "tokenizer_path": state.model.name, "is_generation": True,
                           "served_model_name": state.served_model_name, "max_context_length": state.max_context})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    driver = state.driver
    text = render_metrics(state.served_model_name, driver.engine_stats(), driver.ttft_s, driver.e2e_s)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


# --- the emulator's own controls -----------------------------------------------------------------
async def get_faults(request: web.Request) -> web.Response:
    return _json_response(request.app[STATE].faults.spec.to_dict())


async def post_faults(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        spec = FaultSpec.from_dict(await _read_json(request), base=state.faults.spec)
    except ValueError as exc:
        return _error(str(exc), 400)
    state.set_faults(spec)
    if spec.refuse_connections_s and state.refuse_connections is not None:
        asyncio.get_running_loop().create_task(state.refuse_connections(spec.refuse_connections_s))
    return _json_response(spec.to_dict())


async def emulator_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    driver = state.driver
    if request.query.get("reset_timing"):
        driver.reset_timing()
    stats = driver.engine_stats()
    body = {name: getattr(stats, name) for name in type(stats).__slots__}
    body.update(timing=driver.timing_stats().to_dict(), last_abort_at=driver.last_abort_at,
                num_requests=state.faults.num_requests)
    return _json_response(body)


def build_app(settings: EmulatorSettings) -> web.Application:
    """The emulated replica as an aiohttp app (its engine loop starts and stops with the app)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    state = EmulatorState(settings)
    app[STATE] = state

    async def start_driver(_: web.Application) -> None:
        state.driver.start()

    async def stop_driver(_: web.Application) -> None:
        await state.driver.stop()

    app.on_startup.append(start_driver)
    app.on_cleanup.append(stop_driver)
    routes = [
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.post("/v1/embeddings", embeddings),
        web.post("/v1/responses", responses),
        web.get("/v1/responses/{response_id}", retrieve_response),
        web.post("/v1/rerank", rerank),
        web.post("/rerank", rerank),
        web.post("/v1/score", score),
        web.post("/score", score),
        web.get("/v1/models", models),
        web.post("/generate", generate),
        web.get("/health", health),
        web.get("/health_generate", health),
        web.get("/metrics", metrics),
        web.get("/_emulator/faults", get_faults),
        web.post("/_emulator/faults", post_faults),
        web.get("/_emulator/stats", emulator_stats),
    ]
    for path in ("/server_info", "/get_server_info"):
        routes.append(web.get(path, server_info))
    for path in ("/model_info", "/get_model_info"):
        routes.append(web.get(path, model_info))
    app.add_routes(routes)
    return app
