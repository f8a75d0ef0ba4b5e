"""The rest of the OpenAI surface through a real gateway in front of two emulated replicas: embeddings
and Responses with the real `openai` SDK, the engines' rerank and score, each classified, routed,
limited, metered and logged; previous_response_id follows its replica; bad input gets a 400 envelope.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import openai
import pytest

from gateway.response_ids import ResponseIds
from tests.support.procs import Proc, set_faults, start_emulator, start_gateway, write_tenant

MODEL = "llama-3.1-8b"
KEY, TOKENS_KEY = "sk-more-main", "sk-more-tokens"
TOKENS_PER_MIN = 400
HIDDEN_SIZE = 4096  # llama-3.1-8b's: the emulator's embedding dimension
REPLICAS = {"main-0", "main-1"}
# Rendezvous ranks hash the replicas' URLs (random ports), so a few conversations may all rank one replica
# first: the tests start conversations until both hold some (all on one after 24: a 2**-23 chance).
MAX_CONVERSATIONS = 24


@dataclass
class Stack:
    gateway: Proc
    emulators: list[Proc]

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)

    def post(self, path: str, body: object, key: str = KEY) -> tuple[int, dict[str, str], object]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.gateway.url + path, data=data, method="POST",
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, dict(resp.headers), json.loads(resp.read())
        except urllib.error.HTTPError as err:
            with err:
                return err.code, dict(err.headers), json.loads(err.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.gateway.url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def access_log(self, endpoint: str, until: Callable[[list[dict[str, object]]], bool] = bool) -> list[dict[str, object]]:
        """The access log's lines of ``endpoint``, once ``until(lines)`` holds (at most 5 s): the log is flushed
        in batches, and the stack is shared by the module's tests, so an earlier test's line may come late."""
        deadline = time.monotonic() + 5
        while True:
            lines = [json.loads(line) for line in self.gateway.log().splitlines() if line.startswith("{") and '"endpoint"' in line]
            found = [line for line in lines if line.get("endpoint") == endpoint]
            if until(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("endpoints-more")
    tenants = tmp / "tenants"
    tenants.mkdir()
    write_tenant(tenants, "main", KEY, max_concurrency=1000, rate_limits={"requests_per_min": 100000})
    write_tenant(tenants, "tokens", TOKENS_KEY, rate_limits={"requests_per_min": 1000, "tokens_per_min": TOKENS_PER_MIN})
    emulators = [start_emulator(tmp, f"emu{i}") for i in range(2)]
    config = {
        "server": {"host": "127.0.0.1", "access_log": True},
        "upstream": {"health_interval_s": 0.5},
        "tenants_dir": "tenants",
        "fleet": {"pools": [{"name": "main", "model": MODEL, "replicas": {"urls": [e.url for e in emulators]}}]},
    }
    path = tmp / "config.yaml"
    path.write_text(json.dumps(config))
    try:
        gateway = start_gateway(tmp, ["--config", str(path)])
    except Exception:
        for emulator in emulators:
            emulator.stop()
        raise
    yield Stack(gateway, emulators)
    gateway.stop()
    for emulator in emulators:
        emulator.stop()


def _tokens_metric(text: str, tenant: str, kind: str) -> float:
    found = re.search(rf'^polymorph_tokens_total\{{kind="{kind}",tenant="{tenant}"\}} (\S+)$', text, re.M)
    return float(found[1]) if found else 0.0


# --- embeddings ----------------------------------------------------------------------------------


def test_sdk_embeddings_are_unit_vectors_with_usage_and_routing_headers(stack: Stack) -> None:
    with stack.client() as client:
        raw = client.embeddings.with_raw_response.create(model=MODEL, input=["The cat sat on the mat.", "GPUs are fast."])
        again = client.embeddings.create(model=MODEL, input="The cat sat on the mat.", encoding_format="float")
        short = client.embeddings.create(model=MODEL, input="The cat sat on the mat.", dimensions=64)
    answer = raw.parse()

    assert raw.headers["x-polymorph-pool"] == "main"
    assert raw.headers["x-polymorph-replica"] in {"main-0", "main-1"}
    assert raw.headers["x-polymorph-shape"]
    assert [item.index for item in answer.data] == [0, 1]
    first = answer.data[0].embedding  # the SDK asked for base64 and decoded it
    assert len(first) == HIDDEN_SIZE
    assert sum(x * x for x in first) == pytest.approx(1.0, abs=1e-4)
    assert again.data[0].embedding == pytest.approx(first, abs=1e-6)  # deterministic in the text, float or base64
    assert answer.data[1].embedding != pytest.approx(first, abs=1e-3)
    assert len(short.data[0].embedding) == 64
    assert answer.usage.prompt_tokens > 0 and answer.usage.total_tokens == answer.usage.prompt_tokens


def test_embeddings_are_metered_and_logged_as_their_endpoint(stack: Stack) -> None:
    before = _tokens_metric(stack.metrics(), "main", "embeddings_input")
    status, _, answer = stack.post("/v1/embeddings", {"model": MODEL, "input": [[1, 2, 3, 4, 5], [6, 7, 8]]})

    assert status == 200
    assert isinstance(answer, dict) and answer["usage"]["prompt_tokens"] == 8  # token-id inputs count their ids
    assert _tokens_metric(stack.metrics(), "main", "embeddings_input") - before == 8
    logged = [line for line in stack.access_log("embeddings", until=lambda lines: any(line.get("prompt_tokens") == 8 for line in lines))
              if line.get("prompt_tokens") == 8]
    assert logged and logged[-1]["status"] == 200
    assert logged[-1]["pool"] == "main" and logged[-1]["shape"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": ""}, "input"),
        ({"model": MODEL, "input": [1, "two"]}, "input"),
        ({"model": MODEL, "input": {"text": "x"}}, "input"),
        ({"model": MODEL, "input": ["x"] * 2049}, "input"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": MODEL, "input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x"}, "model"),
    ],
)
def test_bad_embeddings_input_gets_a_400_envelope_naming_the_field(stack: Stack, body: dict[str, object], param: str) -> None:
    status, _, answer = stack.post("/v1/embeddings", body)

    assert status == 400
    assert isinstance(answer, dict)
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param


def test_a_tenants_token_limit_is_charged_the_embeddings_input(stack: Stack) -> None:
    long_input = " ".join(f"word{i}" for i in range(600))  # about 1800 tokens: more than a minute's budget
    with stack.client(TOKENS_KEY) as client:
        small = client.embeddings.create(model=MODEL, input="A short sentence to embed.")
        with pytest.raises(openai.RateLimitError) as refused:
            client.embeddings.create(model=MODEL, input=long_input)

    assert small.usage.prompt_tokens < TOKENS_PER_MIN
    assert refused.value.response.headers.get("Retry-After")
    assert "tokens per minute" in refused.value.message


# --- responses -----------------------------------------------------------------------------------


def test_sdk_responses_non_streamed_with_usage(stack: Stack) -> None:
    with stack.client() as client:
        raw = client.responses.with_raw_response.create(model=MODEL, input="Write a haiku about GPUs.", instructions="Be brief.",
                                                        max_output_tokens=12)
    response = raw.parse()

    assert raw.headers["x-polymorph-pool"] == "main"
    assert response.output_text
    assert response.usage is not None and response.usage.output_tokens == 12 and response.usage.input_tokens > 0
    metrics = stack.metrics()
    assert _tokens_metric(metrics, "main", "responses_output") >= 12
    assert any(line.get("completion_tokens") == 12
               for line in stack.access_log("responses", until=lambda lines: any(line.get("completion_tokens") == 12 for line in lines)))


def test_sdk_responses_streamed_events_end_with_usage(stack: Stack) -> None:
    with stack.client() as client:
        events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "Tell me about the sea."}],
                                              max_output_tokens=9, stream=True))

    types = [event.type for event in events]
    assert types[0] == "response.created"
    assert "response.output_text.delta" in types
    assert types[-1] in ("response.completed", "response.incomplete")
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert text and final.output_text == text
    assert final.usage is not None and final.usage.output_tokens == 9
    logged = [line for line in stack.access_log("responses", until=lambda lines: any(line.get("completion_tokens") == 9 for line in lines))
              if line.get("completion_tokens") == 9]
    assert logged and logged[-1]["stream_error"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_goes_to_the_replica_that_holds_it(stack: Stack, stream: bool) -> None:
    homes, followed = [], []
    with stack.client() as client:
        for turn in range(MAX_CONVERSATIONS):
            if turn >= 4 and set(homes) == REPLICAS:
                break
            # each conversation's own instructions steer its first turn (prefix affinity), so the turns spread over both replicas
            first = client.responses.with_raw_response.create(model=MODEL, input="Hello.", instructions=f"You are assistant number {turn}.",
                                                              max_output_tokens=4)
            homes.append(first.headers["x-polymorph-replica"])
            follow = client.responses.with_raw_response.create(model=MODEL, input="And then?", previous_response_id=first.parse().id,
                                                               max_output_tokens=4, stream=stream)
            if stream:
                list(follow.parse())
            followed.append(follow.headers["x-polymorph-replica"])

    assert set(homes) == REPLICAS  # both replicas hold conversations: the follow-ups had a choice to get wrong
    assert followed == homes


def test_another_gateway_process_finds_the_replica_holding_a_response(stack: Stack) -> None:
    """A conversation begun through one gateway continues through another (another worker or host): the
    second asks the replicas which one holds the id, continues there, and retrieves it there."""
    tmp = stack.gateway.log_path.parent
    other = start_gateway(tmp, ["--config", str(tmp / "config.yaml")], name="gateway-other")
    try:
        homes, followed, shown = [], [], []
        with stack.client() as client, openai.OpenAI(base_url=other.url + "/v1", api_key=KEY, max_retries=0, timeout=30) as elsewhere:
            for turn in range(MAX_CONVERSATIONS):
                if turn >= 4 and set(homes) == REPLICAS:
                    break
                first = client.responses.with_raw_response.create(model=MODEL, input="Hello.", instructions=f"You are helper {turn}.",
                                                                  max_output_tokens=4)
                homes.append(first.headers["x-polymorph-replica"])
                follow = elsewhere.responses.with_raw_response.create(model=MODEL, input="And then?", previous_response_id=first.parse().id,
                                                                      max_output_tokens=4)
                followed.append(follow.headers["x-polymorph-replica"])
                retrieved = elsewhere.responses.with_raw_response.retrieve(follow.parse().id)
                assert (retrieved.parse().id, retrieved.parse().usage) == (follow.parse().id, follow.parse().usage)
                shown.append(retrieved.headers["x-polymorph-replica"])
            with pytest.raises(openai.NotFoundError) as missing:
                elsewhere.responses.retrieve("resp_never_made")
    finally:
        other.stop()

    assert set(homes) == REPLICAS
    assert followed == homes and shown == homes
    assert isinstance(missing.value.body, dict) and missing.value.body["code"] == "response_not_found"


def test_a_responses_stream_that_breaks_ends_with_an_error_event(stack: Stack) -> None:
    for emulator in stack.emulators:
        set_faults(emulator.url, crash_after_tokens=3, crash_mode="cut")
    try:
        with stack.client() as client:
            events = list(client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=40, stream=True))
    finally:
        for emulator in stack.emulators:
            set_faults(emulator.url, reset=True)

    assert events[0].type == "response.created"
    assert events[-1].type == "error"
    assert "broke off" in events[-1].message  # type: ignore[union-attr]
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))  # the error event is numbered after the last one relayed
    broken = [line for line in stack.access_log("responses", until=lambda lines: any(line.get("stream_error") for line in lines))
              if line.get("stream_error")]
    assert [line["stream_error"] for line in broken] == ["upstream_disconnected"]


def test_an_engine_without_the_endpoint_answers_501_and_keeps_its_health(stack: Stack) -> None:
    """llama-server answers embeddings 501 without --embeddings: the client's answer, not a sick replica."""
    for emulator in stack.emulators:
        set_faults(emulator.url, error_rate=1.0, error_status=501)
    try:
        answers = [stack.post("/v1/embeddings", {"model": MODEL, "input": f"text {i}"})[0] for i in range(8)]
    finally:
        for emulator in stack.emulators:
            set_faults(emulator.url, reset=True)

    assert answers == [501] * 8
    healthy = re.findall(r'^polymorph_replica_healthy\{pool="main",replica="main-\d"\} (\S+)$', stack.metrics(), re.M)
    assert healthy == ["1.0", "1.0"]
    assert "polymorph_replica_ejections_total{" not in stack.metrics()


def test_response_ids_are_bounded_and_keep_the_recently_used() -> None:
    ids = ResponseIds(max_ids=2)
    ids.remember("resp_a", "main-0", "main")
    ids.remember("resp_b", "main-1", "main")
    assert ids.replica_of("resp_a") == "main-0"  # used: now the most recent
    ids.remember("resp_c", "main-1", None)

    assert ids.replica_of("resp_b") is None
    assert (ids.replica_of("resp_a"), ids.replica_of("resp_c"), len(ids)) == ("main-0", "main-1", 2)
    ids.remember("resp_a", "main-0", None)  # found again by a lookup: the owner stays
    assert ids.owned_by_another("resp_a", "tokens") and not ids.owned_by_another("resp_a", "main")
    assert not ids.owned_by_another("resp_c", "tokens")  # another process proxied it: no owner known here


def test_a_tenant_can_neither_read_nor_continue_another_tenants_response(stack: Stack) -> None:
    """Before, any valid key could GET another tenant's stored response and continue its conversation."""
    with stack.client() as owner, stack.client(TOKENS_KEY) as other:
        first = owner.responses.create(model=MODEL, input="My secret is 42.", max_output_tokens=3)
        with pytest.raises(openai.NotFoundError) as read:
            other.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as continued:
            other.responses.create(model=MODEL, input="What was my secret?", previous_response_id=first.id, max_output_tokens=3)
        assert owner.responses.retrieve(first.id).id == first.id  # the owner still can
        assert owner.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id, max_output_tokens=3).id

    assert isinstance(read.value.body, dict) and read.value.body["code"] == "response_not_found"
    assert isinstance(continued.value.body, dict) and continued.value.body["code"] == "previous_response_not_found"
    assert re.fullmatch(r"resp-[0-9a-f]{32}", first.id)  # random, as sglang's and vLLM's: not the next of a count


def test_an_authorization_scheme_in_any_case_is_bearer(stack: Stack) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):  # before, only "Bearer " was read; the others were "missing" keys
        request = urllib.request.Request(stack.gateway.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200


def test_unknown_previous_response_id_is_a_400_naming_the_field(stack: Stack) -> None:
    with stack.client() as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Go on.", previous_response_id="resp_unknown")

    body = refused.value.body
    assert isinstance(body, dict)
    assert body["code"] == "previous_response_not_found" and body["param"] == "previous_response_id"


def test_a_response_not_stored_cannot_be_continued(stack: Stack) -> None:
    with stack.client() as client:
        first = client.responses.create(model=MODEL, input="Hello.", max_output_tokens=3, store=False)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id)

    assert isinstance(refused.value.body, dict) and refused.value.body["code"] == "previous_response_not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": 42}, "input"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "stream": "yes"}, "stream"),
        ({"model": MODEL, "input": "x", "previous_response_id": 7}, "previous_response_id"),
    ],
)
def test_bad_responses_input_gets_a_400_envelope(stack: Stack, body: dict[str, object], param: str) -> None:
    status, _, answer = stack.post("/v1/responses", body)

    assert status == 400
    assert isinstance(answer, dict) and answer["error"]["param"] == param


# --- rerank and score ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_orders_documents_and_is_metered(stack: Stack, path: str) -> None:
    before = _tokens_metric(stack.metrics(), "main", "rerank_input")
    documents = ["Paris is the capital of France.", "Cats sleep a lot.", "The capital of Spain is Madrid."]
    status, headers, answer = stack.post(path, {"model": MODEL, "query": "What is the capital of France?", "documents": documents, "top_n": 2})

    assert status == 200
    assert headers["x-polymorph-pool"] == "main"
    assert isinstance(answer, dict)
    results = answer["results"]
    assert len(results) == 2 and results[0]["index"] == 0
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert _tokens_metric(stack.metrics(), "main", "rerank_input") - before == answer["usage"]["total_tokens"] > 0
    assert stack.access_log("rerank")


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_answers_one_score_per_pair(stack: Stack, path: str) -> None:
    status, _, answer = stack.post(path, {"model": MODEL, "text_1": "What is the capital of France?", "text_2": ["Paris is the capital.", "Dogs bark."]})

    assert status == 200
    assert isinstance(answer, dict)
    assert [item["index"] for item in answer["data"]] == [0, 1]
    assert answer["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"model": MODEL, "documents": ["a"]}, "query"),
        ("/v1/rerank", {"model": MODEL, "query": "q"}, "documents"),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": [1, 2]}, "documents"),
        ("/v1/score", {"model": MODEL, "text_1": "q"}, "text_2"),
        ("/v1/score", {"model": MODEL}, "text_1"),
    ],
)
def test_bad_rerank_and_score_input_gets_a_400_envelope(stack: Stack, path: str, body: dict[str, object], param: str) -> None:
    status, _, answer = stack.post(path, body)

    assert status == 400
    assert isinstance(answer, dict) and answer["error"]["param"] == param


def test_new_endpoints_refuse_unknown_models_and_keys_like_chat(stack: Stack) -> None:
    unknown, _, answer = stack.post("/v1/embeddings", {"model": "nope", "input": "x"})
    no_key, _, _ = stack.post("/v1/responses", {"model": MODEL, "input": "x"}, key="sk-wrong")

    assert unknown == 404 and isinstance(answer, dict) and answer["error"]["code"] == "model_not_found"
    assert no_key == 401


def test_openapi_lists_the_new_paths(stack: Stack) -> None:
    with urllib.request.urlopen(stack.gateway.url + "/openapi.json", timeout=10) as resp:
        document = json.loads(resp.read())

    for path in ("/v1/embeddings", "/v1/responses", "/v1/rerank", "/rerank", "/v1/score", "/score"):
        assert "post" in document["paths"][path], path
