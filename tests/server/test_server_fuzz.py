"""``serve`` under generated input: Schemathesis draws requests for every route from the server's own OpenAPI
schema (``/openapi.json``), ones that fit it and ones that break it (wrong types, missing or out-of-range
fields), and sends them to a real server process on loopback. No response may be a 5xx; every 4xx is an
OpenAI error body, naming the field it refuses when the body has fields; a streamed answer carries no error
event; and a user message whose ``content`` is null is refused with a 400."""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from serve_support import error_of, post, start_server

pytestmark = pytest.mark.slow

# requests per operation and mode: at least 500 in all, most on the two generation routes
EXAMPLES = {
    ("POST", "positive"): 150,
    ("POST", "negative"): 100,
    ("GET", "positive"): 40,  # a route without parameters has one request to give
    ("GET", "negative"): 40,  # only /v1/models/{model_id} has a parameter to break
}
MIN_REQUESTS = 500
# fields the server refuses with "unsupported" whatever their value: dropped from some requests (below)
REFUSED_FIELDS = (
    *("n", "presence_penalty", "frequency_penalty", "logit_bias", "tools", "functions"),
    *("logprobs", "top_logprobs", "echo", "suffix", "best_of"),
)


@pytest.fixture(scope="module")
def server(served_corpus, tmp_path_factory):
    # answers of at most 2 tokens where a request names no max_tokens: the fuzz is about input, and the
    # model runs on CPU
    env = {"CACHEBLEND_MAX_TOKENS": "2"}
    process = start_server(served_corpus, tmp_path_factory.mktemp("logs") / "serve.log", env=env)
    yield process
    assert process.stop() == 0, process.log_text()[-3000:]


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return server.health()["model"]


def steer(body: Any, model: str) -> None:
    """Point three in four generated bodies at the served model, so that they get past the model check
    (a random name is a 404 before anything else is read) to the prompt, the sampling and the engine, with
    at most 2 new tokens; and strip half of those of the fields refused whatever their value, fill in
    message content and leave out tool roles, so that generation runs on what remains. The rest go as
    drawn. Decided by a checksum of the body, so a run is reproducible."""
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return
    draw = zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 4
    if draw == 0:
        return
    body["model"] = model
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int) and body[name] > 2:
            body[name] = 2
    if draw == 1:
        return
    for name in REFUSED_FIELDS:
        body.pop(name, None)
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            message.pop("tool_calls", None)
            if message.get("role") in ("tool", "function"):
                message["role"] = "user"
            if message.get("content") is None:
                message["content"] = ""
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][:1] or ""


def field_of(param: str) -> str:
    """The top-level field an error's ``param`` names: ``messages`` of ``messages[0].content`` or
    ``messages.0.role``."""
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def body_fields(openapi: dict[str, Any], path: str, method: str) -> set[str]:
    """The top-level fields of an operation's JSON body in the OpenAPI schema (none without a body)."""
    body = openapi["paths"][path][method.lower()].get("requestBody", {})
    ref = body.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
    return set(openapi["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {}).get("properties", {}))


def check_response(label: str, body: Any, response, fields: set[str]) -> None:
    """What every response must be: below 500; a 4xx an OpenAI error body naming a field of the request
    (or of the schema, for a missing one) where the body has fields; a stream free of error events."""
    assert response.status_code < 500, (label, body, response.text[:500])
    if response.status_code >= 400:
        error = error_of(response)
        assert error["type"] == "invalid_request_error", (label, body, error)
        if isinstance(body, dict) and response.status_code in (400, 422) and error["code"] != "invalid_json":
            assert error["param"] and field_of(error["param"]) in fields | set(body), (label, body, error)
        if label.startswith("GET /v1/models/"):
            assert error["param"] == "model" or error["message"].startswith("unknown path"), error
        return
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):  # lists of values
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (label, body, response.text[-500:])
        assert not any("error" in json.loads(event) for event in events[:-1]), (label, body, events)
    else:
        assert isinstance(response.json(), dict), (label, body, response.text[:500])


def fuzz(operation, mode: GenerationMode, send: Callable[[Any], None]) -> None:
    """``send`` each request Schemathesis draws for ``operation`` in ``mode``."""

    @settings(
        max_examples=EXAMPLES[operation.method.upper(), mode.value],
        deadline=None,
        database=None,
        derandomize=True,  # the same requests every run: CI does not turn red by chance
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        send(case)

    run()


def test_generated_requests_never_get_a_5xx_and_4xx_are_openai_errors(server, model_id):
    schema = schemathesis.openapi.from_url(f"{server.root}/openapi.json")
    counts: Counter[tuple[str, str, int]] = Counter()

    def send(label: str, fields: set[str], mode: GenerationMode, case) -> None:
        steer(case.body, model_id)
        response = case.call(base_url=server.root, timeout=120)
        counts[label, mode.value, response.status_code] += 1
        check_response(label, case.body, response, fields)

    for result in schema.get_all_operations():
        operation = result.ok()
        fields = body_fields(schema.raw_schema, operation.path, operation.method)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz(operation, mode, partial(send, operation.label, fields, mode))
            except Unsatisfiable:  # nothing to break: no body, and any string is a valid path parameter
                assert mode is GenerationMode.NEGATIVE and not fields, operation.label
    total = sum(counts.values())
    summary = "\n".join(f"{key}: {count}" for key, count in sorted(counts.items()))
    print(f"{total} requests\n{summary}")  # shown with -s, or when the test fails
    assert total >= MIN_REQUESTS, summary
    routes = {label for label, _, _ in counts}
    expected = {"/health", "/v1/models", "/v1/models/{model_id}", "/v1/chat/completions", "/v1/completions"}
    assert {label.split(" ", 1)[1] for label in routes} == expected, summary
    # the generation routes were fuzzed past their validation: some requests were answered
    for route in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert sum(n for (label, _, status), n in counts.items() if label == route and status == 200), summary
    assert server.health()["status"] == "ok"  # and the server is still up


@pytest.mark.parametrize("message", [{"role": "user", "content": None}, {"role": "user"}])
def test_a_user_message_without_content_is_refused(server, model_id, message):
    body = {"model": model_id, "messages": [{"role": "system", "content": "Be brief."}, message]}
    response = post(server, "/chat/completions", body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "messages[1].content",
        "invalid_value",
    )
    assert "messages[1].content is missing or null" in error["message"]
