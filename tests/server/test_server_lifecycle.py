"""A real server's lifecycle: an API key, clients that go away mid-answer (their slot is freed at once, in
a scheduler with a single slot), and SIGTERM (requests in flight finish, new ones get a 503, exit 0)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serve_support import error_of, start_server

pytestmark = pytest.mark.slow

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COUNTING = "Count from one to five hundred: 1, 2, 3, 4, 5, 6, 7,"
LONG = 1000  # tokens: a request that would hold the only slot for minutes if it were not cancelled


@pytest.fixture(scope="module")
def server(served_corpus, tmp_path_factory):
    """One slot in the batch scheduler: a request not cancelled would block every other."""
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    process = start_server(served_corpus, log, "--api-key", KEY, env={"CACHEBLEND_BATCH_MAX_REQUESTS": "1"})
    yield process
    process.kill()  # the SIGTERM test has normally stopped it already


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return server.health()["model"]


def completion(model_id: str, max_tokens: int, stream: bool) -> dict:
    return {
        "model": model_id,
        "prompt": COUNTING,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def scheduler(server) -> dict:
    return server.health()["scheduler"]


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_api_key_is_required(server, model_id):
    missing = httpx.get(f"{server.url}/models")
    assert missing.status_code == 401 and error_of(missing)["code"] == "invalid_api_key"
    wrong = httpx.get(f"{server.url}/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert httpx.get(f"{server.url}/models", headers=AUTH).json()["data"][0]["id"] == model_id
    assert httpx.get(f"{server.root}/health").status_code == 200  # health checks need no key


def test_clients_that_go_away_free_their_slot(server, model_id):
    before = scheduler(server)
    url = f"{server.url}/completions"
    with httpx.Client(headers=AUTH, timeout=120) as first, httpx.Client(headers=AUTH, timeout=120) as second:
        with first.stream("POST", url, json=completion(model_id, LONG, True)) as running:
            lines = running.iter_lines()
            received = [line for line, _ in zip(lines, range(6), strict=False)]  # a few tokens in
            assert all(line.startswith("data: ") or line == "" for line in received)
            # a second stream waits for the only slot; its client gives up while it waits
            with second.stream("POST", url, json=completion(model_id, LONG, True)):
                wait_until(lambda: scheduler(server)["waiting"] == 1)
            wait_until(lambda: scheduler(server)["cancelled"] == before["cancelled"] + 1)
            assert scheduler(server)["active"] == 1  # the first is still generating
        # the first client closed its stream mid-answer: its row leaves the batch at once
        wait_until(lambda: scheduler(server)["cancelled"] == before["cancelled"] + 2, timeout=30)
    after = scheduler(server)
    assert after["active"] == after["waiting"] == 0 and after["completed"] == before["completed"]
    assert after["decode_steps"] - before["decode_steps"] < LONG / 2  # far from the 1000 tokens asked for

    # a client without streaming that times out is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=completion(model_id, LONG, False), headers=AUTH, timeout=3)
    wait_until(lambda: scheduler(server)["cancelled"] == before["cancelled"] + 3, timeout=30)

    # the slot is free: a short request is answered at once
    started = time.monotonic()
    answer = httpx.post(url, json=completion(model_id, 8, False), headers=AUTH, timeout=120).json()
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] <= 8
    assert time.monotonic() - started < 60
    assert scheduler(server)["completed"] == before["completed"] + 1


def test_sigterm_drains_requests_in_flight_then_exits(server, model_id):
    lines: list[str] = []

    def stream() -> None:
        body = completion(model_id, 48, True)
        with httpx.stream(
            "POST", f"{server.url}/completions", json=body, headers=AUTH, timeout=300
        ) as response:
            lines.extend(response.iter_lines())

    client = threading.Thread(target=stream)
    client.start()
    wait_until(lambda: len([line for line in lines if line.startswith("data: {")]) >= 3)
    server.process.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining" in server.log_text())

    late = httpx.post(
        f"{server.url}/completions", json=completion(model_id, 4, False), headers=AUTH, timeout=30
    )
    assert late.status_code == 503
    assert error_of(late) | {"message": ""} == {
        "message": "",
        "type": "service_unavailable_error",
        "param": None,
        "code": "draining",
    }
    health = httpx.get(f"{server.root}/health", timeout=30)
    assert health.status_code == 503 and health.json() == {"status": "draining"}

    client.join(timeout=300)
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert [line for line in lines if line][-1] == "data: [DONE]"  # the answer was finished
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.process.wait(timeout=120) == 0
    log = server.log_text()
    assert "drained: no request in flight" in log and "Finished server process" in log
