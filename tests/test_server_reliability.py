"""The server under abuse and at shutdown: what one request may ask for is bounded and the rest
of the server keeps answering while the largest allowed request runs; malformed input is a 400
naming the field, and every answer is the one /openapi.json documents (a seeded schemathesis
run with its conformance checks); one request cannot starve the others of seats or of the API
process; SIGTERM drains; the death of either process ends the other and leaves nothing behind;
slow clients cannot take every connection, nor flood the log, and bodies that drip cannot hold
the connections; an output constraint cannot hold the check or compile capacity past a
deadline, nor grow the server with each distinct schema; a response cannot grow past
max_output_entries.

Every test runs a live ``corellm serve`` on 127.0.0.1 and is bounded in time and request count,
but for the connection rules' and the log filter's own tests, which run in process.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import selectors
import signal
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from corellm_plugins.bench.server_process import tree_pss
from tests.test_server import MAX_MODEL_LEN, Server, _pid_alive, _post, _server_config, _wait
from tests.test_sim import make_profile

LIMITS = {"max_samples": 128, "max_generated_tokens": 128 * 64, "max_stop_strings": 64,
          "max_stop_string_chars": 256, "max_stop_token_ids": 32, "max_logprobs_total": 512,
          "max_output_entries": 32768}


def _config(llama_path, **frontend) -> dict:
    cfg = _server_config(llama_path)
    # Room for the largest allowed request (128 samples) next to other clients' requests, so the
    # scheduler never makes them wait: what is measured is the API process, not the queue.
    cfg["scheduler"] = {**cfg["scheduler"], "max_num_seqs": 160}
    cfg["kv_cache"] = {**cfg["kv_cache"], "num_blocks": 160 * (MAX_MODEL_LEN // 16) + 64}
    cfg["frontend"] = {"limits": LIMITS, **frontend}
    return cfg


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("reliability"), _config(llama_path))
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def paced_server(llama_path, tmp_path_factory):
    """The same server, its steps paced by the simulated executor (20 ms each, slept on the
    real clock), for tests that must catch a request mid-flight however fast the machine."""
    tmp = tmp_path_factory.mktemp("reliability-paced")
    cfg = _config(llama_path)
    cfg["executor"] = {"name": "sim", "clock": "real",
                       "profile": str(make_profile(llama_path, tmp / "profile.json", base=0.02))}
    srv = Server(tmp, cfg)
    yield srv
    engine_pid = srv.engine_pid
    assert srv.stop(signal.SIGTERM) == 0, "".join(srv.log[-30:])
    _wait(lambda: not _pid_alive(engine_pid), 10, "the engine process to exit")


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (engine core, resource tracker, workers)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in found:
                    found.add(k)
                    todo.append(k)
    return found


def _ipc_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("corellm-ipc-*")}


def _events(lines) -> list:
    """The ``data:`` payloads of a server-sent event stream, JSON-decoded ([DONE] kept)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# --------------------------------------------------------------------------- limits
@pytest.mark.parametrize("body, param, key", [
    ({"prompt": "x", "n": 129}, "n", "max_samples"),
    ({"prompt": ["a"] * 65, "n": 2}, "prompt", "max_samples"),
    ({"prompt": "x", "n": 128, "max_tokens": 65}, "max_tokens", "max_generated_tokens"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop", "max_stop_strings"),
    ({"prompt": "x", "stop": ["ok", "y" * 257]}, "stop", "max_stop_string_chars"),
    ({"prompt": "x", "stop_token_ids": list(range(33))}, "stop_token_ids",
     "max_stop_token_ids"),
    ({"prompt": "x", "n": 128, "max_tokens": 1, "logprobs": 5}, "logprobs",
     "max_logprobs_total"),
])
def test_limits_are_400s_naming_field_and_key(server, body, param, key):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"frontend.limits.{key}" in err["message"], err


def test_chat_limits(server):
    msgs = [{"role": "user", "content": "hi"}]
    # no max_tokens: each of n samples may fill the rest of the context, which is too much
    r = _post(server, "/v1/chat/completions", {"messages": msgs, "n": 128})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens", err
    assert "was not set" in err["message"] and "max_generated_tokens" in err["message"]
    r = _post(server, "/v1/chat/completions", {"messages": msgs, "n": 100, "logprobs": True,
                                               "top_logprobs": 10, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


@pytest.fixture(scope="module")
def default_server(llama_path, tmp_path_factory):
    """The test checkpoint served with the default configuration: default frontend.limits and
    the default scheduler (64 seats, FCFS), which the largest allowed request (128 samples)
    overfills by itself."""
    cfg = _server_config(llama_path)
    del cfg["kv_cache"]                 # sized as by default: from the platform's memory budget
    srv = Server(tmp_path_factory.mktemp("reliability-default"), cfg)
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, "".join(srv.log[-30:])


def worst_allowed(max_tokens: int = 64) -> dict:
    """The largest request the default frontend.limits allow: 128 streamed samples, 64 stop
    strings of 256 characters, 8 logprobs (1024 over 128 samples)."""
    stops = [f"{i:03d}" + "\u00e9z" * 126 + "q" for i in range(64)]
    assert all(len(s) == 256 for s in stops)
    return {"prompt": "The meaning of life", "max_tokens": max_tokens, "n": 128,
            "ignore_eos": True, "stop": stops, "logprobs": 8, "stream": True}


def _first_token_s(url: str, body: dict) -> float:
    """Seconds from sending a streamed completion to the chunk of its first token: the first
    with text, or the one that ends the sample (a token may decode to no text by itself, such as
    the first bytes of a character, and a random-weight model samples such tokens)."""
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["text"] or choice["finish_reason"] is not None:
                return time.perf_counter() - t0
    raise AssertionError("the stream ended without a token")


def test_worst_allowed_request_does_not_starve_others(default_server):
    """The largest request the default limits allow (128 samples to the end of the context, for
    64 seats) streams while /health and small requests are timed. The small request's first
    token comes at once: one client request keeps at most half the seats while others wait
    (scheduler.max_num_seqs_per_request), so the small one takes the big one's newest seat
    instead of queueing behind its other 64 samples, and the engine core runs at most two
    output batches ahead of the API process (flow control), so its output is not queued
    behind the big request's backlog. About 0.2 s on a busy 2-core AMD EPYC, against 27 s
    before. The big request is dropped once the probes are done (the scheduler's tests check
    that a request over its share is still served in full)."""
    server = default_server
    stop, done = threading.Event(), threading.Event()
    counts = {"events": 0}

    def run_worst():
        try:
            with httpx.stream("POST", server.url + "/v1/completions",
                              json=worst_allowed(MAX_MODEL_LEN - 8), timeout=600) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    counts["events"] += line.startswith("data: {")
                    if stop.is_set():
                        return                      # a client that goes away: aborted
        finally:
            done.set()

    t = threading.Thread(target=run_worst)
    t.start()
    try:
        _wait(lambda: counts["events"] > 128 or done.is_set(), 120, "the worst request to stream")
        health, first_token = [], []
        while not done.is_set() and len(first_token) < 5:
            t0 = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            health.append(time.perf_counter() - t0)
            first_token.append(_first_token_s(server.url, {"prompt": "Hi", "max_tokens": 1}))
        measured = not done.is_set()
    finally:
        stop.set()
        t.join(120)
    print(f"\nwhile the worst allowed request ran (default config): /health max "
          f"{max(health) * 1e3:.0f} ms, a 1-token completion's first token max "
          f"{max(first_token) * 1e3:.0f} ms (median {statistics.median(first_token) * 1e3:.0f}); "
          f"{len(first_token)} probes")
    # benchmarks/server_abuse.py holds the 1 s target on a quiet machine; this bound leaves room
    # for a busy one and still fails a request queued behind the big one
    assert max(first_token) < 2.0 and max(health) < 2.0, (first_token, health)
    assert measured, "the worst request ended before the probes did"


# --------------------------------------------------------------------------- malformed input
SURROGATE = "a\ud800b"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", SURROGATE]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", SURROGATE]}, "stop[1]"),
    ("/v1/completions", {"prompt": "x", "request_id": SURROGATE}, "request_id"),
    ("/v1/completions", {"prompt": "x", "model": SURROGATE}, "model"),
    ("/v1/completions", {"prompt": "x", "user": SURROGATE}, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": SURROGATE}]}]}, "messages[0].content[0].text"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
])
def test_lone_surrogates_are_400s(server, path, body, param):
    raw = json.dumps(body).encode()            # ensure_ascii: "\ud800" travels as an escape
    assert b"\\ud800" in raw
    r = _post(server, path, raw=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"], err


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
])
def test_request_id_is_bounded_because_every_chunk_echoes_it(server, path, body):
    """A client's request_id is echoed in the id of every chunk of every sample: unbounded, a
    900 KB id with n=128 streamed gigabytes back. It is bounded as user and session_id are."""
    for bad in ("", "r" * 257, "r" * 900_000):
        r = _post(server, path, {**body, "request_id": bad, "n": 2, "stream": True})
        assert r.status_code == 400, (len(bad), r.text[:200])
        err = r.json()["error"]
        assert err["param"] == "request_id" and len(r.content) < 2000, err
    longest = "r" * 256
    r = _post(server, path, {**body, "request_id": longest})
    assert r.status_code == 200 and r.json()["id"] == longest, r.text[:300]


def test_valid_surrogate_pairs_and_huge_numbers(server):
    r = _post(server, "/v1/completions", raw=json.dumps(
        {"prompt": "emoji \U0001F600", "max_tokens": 1}).encode())
    assert r.status_code == 200, r.text           # a valid pair is just a character
    r = _post(server, "/v1/completions", raw=b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "seed" and "5000 digits" in err["message"]
    for raw in (b'{"prompt": "a\xed\xa0\x80b"}',                      # a surrogate as UTF-8 bytes
                '{"prompt": "x"}'.encode("utf-16"),
                b'{"prompt": "x", "seed": ' + b"9" * 5000 + b", ",   # huge int, then broken
                b'{"seed": ' + b"9" * 5000 + b', "prompt": ' + b"[" * 100000):
        for path in ("/v1/completions", "/tokenize"):
            r = _post(server, path, raw=raw)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", \
                (path, raw[:40], r.text)
    r = _post(server, "/v1/completions", raw=b'{"prompt": "x", "temperature": NaN}')
    assert r.status_code == 400 and "NaN" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", raw=b'{"prompt": "x", "temperature": 1e999}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_non_json_content_types_are_415(server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
                   headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_json_content_type_variants_are_served(server):
    for ct in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"):
        r = httpx.post(server.url + "/v1/completions", headers={"content-type": ct},
                       content=b'{"prompt": "x", "max_tokens": 1}')
        assert r.status_code == 200, (ct, r.text)


def test_host_header_is_checked(server):
    port = server.url.rsplit(":", 1)[1]
    for host in ("127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        r = httpx.get(server.url + "/v1/models", headers={"host": host})
        assert r.status_code == 200, (host, r.text)
    for host in ("evil.example", f"attacker.example:{port}", "127.0.0.1.evil.example"):
        r = httpx.post(server.url + "/v1/completions", headers={"host": host},
                       json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed", host
    # CORS is off: no Access-Control-Allow-Origin for a foreign origin
    r = httpx.get(server.url + "/v1/models", headers={"origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_an_http10_request_without_host_is_refused(server):
    """HTTP/1.0 lets a client leave Host out; the Host check must not be skipped then."""
    import socket
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    for request in (b"GET /v1/models HTTP/1.0\r\n\r\n",
                    b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                    b"content-length: 30\r\n\r\n{\"prompt\": \"x\", \"max_tokens\": 1}"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(request)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == b"400", reply[:300]
        assert json.loads(body)["error"]["code"] == "host_not_allowed", body


def test_every_response_says_nosniff(server):
    for r in (httpx.get(server.url + "/health"), httpx.get(server.url + "/v1/models"),
              httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}),
              httpx.post(server.url + "/v1/completions", json={"prompt": 1}),
              httpx.get(server.url + "/no/such/route"),
              httpx.get(server.url + "/v1/models", headers={"host": "evil.example"})):
        assert r.headers.get("x-content-type-options") == "nosniff", (r.request.url, r.headers)


def test_openapi_describes_the_request_bodies(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def body_schema(path):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        return body["schema"]
    ref = body_schema("/v1/completions")["$ref"].rsplit("/", 1)[1]
    completion = schemas[ref]
    assert {"prompt", "max_tokens", "stop", "n"} <= set(completion["properties"])
    ref = body_schema("/v1/chat/completions")["$ref"].rsplit("/", 1)[1]
    assert "messages" in schemas[ref]["properties"]
    variants = body_schema("/tokenize")["anyOf"]
    assert [sorted(v["required"]) for v in variants] == [["prompt"], ["messages"]]
    # null means "not set" for every optional field, and is all an unknown key may hold
    props = completion["properties"]
    for name in ("n", "stream", "temperature", "stop", "stream_options", "echo"):
        assert "null" in json.dumps(props[name]), (name, props[name])
    assert "null" not in json.dumps(props["prompt"])
    assert completion["additionalProperties"] == {"type": "null"}
    # what SamplingParams checks later is stated too
    assert props["n"]["minimum"] == 1 and props["top_p"]["exclusiveMinimum"] == 0
    assert props["logit_bias"]["maxProperties"] == 0


def test_openapi_describes_the_answers(server):
    """Every route lists the statuses the server answers, never FastAPI's 422, each error with
    OpenAI's error body; the generation routes stream server-sent events."""
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "422" not in json.dumps(spec) and "HTTPValidationError" not in spec["components"]
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    body = spec["components"]["schemas"]["Error"]
    assert set(body["required"]) == {"message", "type", "param", "code"}
    statuses = {}
    for path, item in spec["paths"].items():
        for method, op in item.items():
            statuses[method.upper(), path] = sorted(op["responses"])
            for status, answer in op["responses"].items():
                if status != "200":
                    assert answer["content"] == {"application/json": {"schema": error}}
    errors = ["400", "404", "413", "415", "500", "503"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert statuses["POST", path] == ["200", *errors], path
    assert statuses["GET", "/health"] == ["200", "400", "503"]
    for path in ("/v1/models", "/version", "/metrics"):
        assert statuses["GET", path] == ["200", "400"], path       # no API key: no 401
    content = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(content) == {"application/json", "text/event-stream"}
    assert "securitySchemes" not in spec["components"]


def test_openapi_is_a_valid_openapi_document(server):
    import openapi_spec_validator

    openapi_spec_validator.validate(httpx.get(server.url + "/openapi.json").json())


def test_openapi_with_an_api_key_documents_401():
    from fastapi import FastAPI

    from corellm_plugins.frontend_openai.openapi import install

    app = FastAPI()
    app.get("/v1/models")(lambda: {})
    app.get("/health")(lambda: {})
    install(app, lambda path: path.startswith("/v1"))
    spec = app.openapi()
    assert "401" in spec["paths"]["/v1/models"]["get"]["responses"]
    assert spec["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]
    assert "401" not in spec["paths"]["/health"]["get"]["responses"]
    assert spec["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


# Checks of each answer against /openapi.json. Left out: positive_data_acceptance, as a body
# the schema allows may still be rightly refused (a prompt longer than the context, n x
# max_tokens over frontend.limits, stream_options without stream: what depends on the
# tokenizer or on several fields at once); use_after_free and ensure_resource_availability,
# as the server keeps no resources; ignored_auth, as this server has no API key;
# missing_required_header (no header parameters) and unsupported_method (it judges only the
# probes of schemathesis' coverage phase, which this run does not use).
SCHEMATHESIS_CHECKS = ("not_a_server_error", "status_code_conformance",
                       "content_type_conformance", "response_headers_conformance",
                       "response_schema_conformance", "negative_data_rejection")


def _bound_chat_generation(case):
    """A valid chat body that sets no token bound generates the rest of the context for each of
    its samples, seconds a body on this model: the completions route's default bound (16 tokens)
    keeps the run a test's length and the answers the same in shape."""
    if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
        case.body["max_completion_tokens"] = 16
    return case


def test_schemathesis_conformance(server):
    """A seeded, bounded schemathesis run over every route: valid and invalid bodies generated
    from /openapi.json; no 5xx, no hang, every answer as the schema documents it (status,
    content type, headers, body, streamed events included), every invalid body refused, and the
    server healthy and whole afterwards."""
    import schemathesis
    import schemathesis.checks
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.core.failures import FailureGroup

    checks = [getattr(schemathesis.checks, name) for name in SCHEMATHESIS_CHECKS]
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures, statuses = [], {}
    runs = [(path, "POST", mode, 60) for path in ("/v1/completions", "/v1/chat/completions",
                                                  "/tokenize", "/detokenize")
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    runs += [(path, "GET", GenerationMode.POSITIVE, 1)
             for path in ("/v1/models", "/health", "/version", "/metrics")]
    for path, method, mode, examples in runs:
        cases = schema[path][method].as_strategy(mode)
        if path == "/v1/chat/completions" and mode == GenerationMode.POSITIVE:
            cases = cases.map(_bound_chat_generation)

        @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def check(case):
            response = case.call(base_url=server.url, timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            try:
                case.validate_response(response, checks=checks)
            except FailureGroup as exc:
                failures.extend((f"{method} {path}", f.title, f.message, mode.value,
                                 case.body, response.status_code, response.text[:300])
                                for f in exc.exceptions)
        check()
    print("\nschemathesis statuses:", dict(sorted(statuses.items())))
    kinds = collections.Counter(f[:2] for f in failures)
    assert not failures, (kinds.most_common(), failures[:3])
    assert sum(statuses.values()) >= 300
    assert statuses.get(200, 0) >= 50
    assert httpx.get(server.url + "/health").status_code == 200
    m = server.metrics()
    _wait(lambda: server.metrics()["corellm:num_requests_running"] == 0, 30, "idle engine")
    m = server.metrics()
    assert m["corellm:kv_cache_blocks_free"] == m["corellm:kv_cache_blocks_total"]


def test_disconnects_are_logged_and_counted(paced_server):
    server = paced_server
    before = server.metrics().get("corellm:request_aborted_total", 0.0)
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    with pytest.raises(httpx.ReadTimeout):             # a non-streaming client that gives up
        httpx.post(server.url + "/v1/completions", timeout=0.2,
                   json={"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "n": 16})
    _wait(lambda: server.metrics().get("corellm:request_aborted_total", 0.0) >= before + 2, 20,
          "two aborts to be counted")
    text = httpx.get(server.url + "/metrics").text
    assert 'corellm:request_aborted_total{model_name="' in text
    assert 'reason="client_disconnected"' in text
    assert any("aborted (client_disconnected)" in line for line in server.log)


# --------------------------------------------------------------------------- shutdown, death
@pytest.mark.parametrize("target", ["server", "process_group"])
def test_sigterm_drains_then_ends_the_rest_with_an_error_event(llama_path, tmp_path, target):
    """16 live streams when SIGTERM arrives (20 ms steps): the short ones finish normally
    within the drain, new requests get 503 with Retry-After, the long ones end with an error
    event naming the shutdown and then [DONE]; the server and every process it started exit in
    time. The same when the signal goes to the whole process group (systemd's default
    KillMode=control-group, Ctrl-C in a terminal), engine core included."""
    drain = 2.0
    cfg = _config(llama_path, drain_timeout_s=drain)
    cfg["model"] = {**cfg["model"], "max_model_len": 512}
    # Paced by the simulated executor (20 ms a step, slept on the real clock): what a stream
    # can finish within the drain then depends on this test, not on the machine's speed (the
    # real model got fast enough to finish 480 tokens in the 2 s drain).
    cfg["executor"] = {"name": "sim", "clock": "real",
                       "profile": str(make_profile(llama_path, tmp_path / "profile.json",
                                                   base=0.02))}
    srv = Server(tmp_path, cfg, new_session=target == "process_group")
    procs = {srv.proc.pid} | _children(srv.proc.pid)
    assert srv.engine_pid in procs and len(procs) >= 3, procs    # API, engine, resource tracker
    results: dict[int, list] = {}
    started = threading.Barrier(17)

    def stream(i: int, max_tokens: int) -> None:
        body = {"prompt": f"Stream {i}", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            started.wait(30)
            results[i] = _events([first, *lines])

    # 12 that cannot finish in the drain (480 tokens each, batched with the others) and 4 that
    # can (a handful of tokens left when the signal comes)
    threads = [threading.Thread(target=stream, args=(i, 480 if i < 12 else 24))
               for i in range(16)]
    try:
        for t in threads:
            t.start()
        started.wait(60)
        t0 = time.monotonic()
        if target == "process_group":
            assert os.getpgid(srv.engine_pid) == srv.proc.pid      # the group holds the core
            os.killpg(srv.proc.pid, signal.SIGTERM)
        else:
            srv.proc.send_signal(signal.SIGTERM)
        _wait(lambda: any("draining" in line for line in srv.log), 10, "the drain to start")
        r = _post(srv, "/v1/completions", {"prompt": "late", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"].isdigit(), r.text
        assert r.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(srv.url + "/health").status_code == 503
        for t in threads:
            t.join(30)
        code = srv.proc.wait(30)
        elapsed = time.monotonic() - t0
        print(f"\nSIGTERM to exit: {elapsed:.2f} s (drain {drain} s)")
        assert code == 0, "".join(srv.log[-30:])
        assert elapsed < drain + 10
        # the engine core's exit status as reaped, whichever thread reaped it
        _wait(lambda: any("stopped (exit code" in line for line in srv.log), 10,
              "the engine core's exit status in the log")
        assert not any("exit code None" in line for line in srv.log), "".join(srv.log[-30:])
        assert any("engine core process" in line and "stopped (exit code 0)" in line
                   for line in srv.log), "".join(srv.log[-30:])
        for i, events in results.items():
            assert events[-1] == "[DONE]", (i, events[-3:])
            last = events[-2]
            if i < 12:
                assert last["error"]["code"] == "server_shutting_down", (i, last)
                assert "shutting down" in last["error"]["message"]
            else:
                assert last["choices"][0]["finish_reason"] == "length", (i, last)
        assert len(results) == 16
        _wait(lambda: not any(_pid_alive(p) for p in procs), 10, "every server process to exit")
    finally:
        srv.stop(signal.SIGKILL)
        for p in procs:
            if _pid_alive(p):
                os.kill(p, signal.SIGKILL)


def test_engine_death_exits_nonzero_and_cleans_up(llama_path, tmp_path):
    before = _ipc_dirs()
    cfg = _config(llama_path)
    # paced (20 ms steps): the stream is still running when the engine is killed, however fast
    # the machine (the tiny model makes the 200 tokens in about 0.2 s)
    cfg["executor"] = {"name": "sim", "clock": "real",
                       "profile": str(make_profile(llama_path, tmp_path / "profile.json",
                                                   base=0.02))}
    srv = Server(tmp_path, cfg)
    try:
        ours = _ipc_dirs() - before
        assert len(ours) == 1, ours
        body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(srv.engine_pid, signal.SIGKILL)
            events = _events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
        assert srv.proc.wait(30) == 1, "".join(srv.log[-30:])
        assert any("exiting with status 1" in line for line in srv.log)
        assert not (ours & _ipc_dirs()), "the IPC directory was left behind"
    finally:
        srv.stop(signal.SIGKILL)


def test_api_process_killed_engine_exits_and_cleans_up(llama_path, tmp_path):
    before = _ipc_dirs()
    srv = Server(tmp_path, _config(llama_path))
    try:
        ours = _ipc_dirs() - before
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGKILL)
        _wait(lambda: not _pid_alive(srv.engine_pid), 10, "the orphaned engine to exit")
        print(f"\nengine exit after the API process was killed: {time.monotonic() - t0:.2f} s")
        _wait(lambda: not (ours & _ipc_dirs()), 5, "the IPC directory to be removed")
    finally:
        srv.stop(signal.SIGKILL)
        if _pid_alive(srv.engine_pid):
            os.kill(srv.engine_pid, signal.SIGKILL)


def test_keep_alive_on_engine_death(llama_path, tmp_path):
    srv = Server(tmp_path, _config(llama_path, exit_on_engine_death=False))
    try:
        os.kill(srv.engine_pid, signal.SIGKILL)
        # /health pings the engine for up to health_timeout_s (5 s) before it answers 503
        # while the death is not yet noticed: httpx's default 5 s read timeout would race it.
        _wait(lambda: httpx.get(srv.url + "/health", timeout=30).status_code == 503, 20,
              "health 503")
        time.sleep(1.0)
        assert srv.proc.poll() is None
        r = _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert srv.stop(signal.SIGTERM) == 0
    finally:
        srv.stop(signal.SIGKILL)


def test_allowed_hosts_and_cors_options(llama_path, tmp_path):
    srv = Server(tmp_path, _config(llama_path, allowed_hosts=["api.example.com", "*.corp.test"],
                                   cors_allow_origins=["http://app.example.com"]))
    try:
        def status(host):
            return httpx.get(srv.url + "/v1/models", headers={"host": host}).status_code
        assert status("api.example.com") == 200 and status("a.b.corp.test:8000") == 200
        assert status("127.0.0.1") == 400 and status("corp.test.evil") == 400
        r = httpx.options(srv.url + "/v1/completions", headers={
            "host": "api.example.com", "origin": "http://app.example.com",
            "access-control-request-method": "POST"})
        assert r.headers.get("access-control-allow-origin") == "http://app.example.com"
        assert srv.stop(signal.SIGTERM) == 0
    finally:
        srv.stop(signal.SIGKILL)


# --------------------------------------------------------------------------- slow clients
# Fewer open files than the slow clients below: a common default is 1,024, 256 keeps the test
# small. Hard and soft, so the server cannot raise its way out.
FILE_LIMIT = 256
SLOW_CLIENTS = 300
HEADER_TIMEOUT_S = 10.0         # frontend.header_timeout_s's default


def _low_file_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))


def test_slow_clients_cannot_exhaust_connections(llama_path, tmp_path):
    """Slowloris against the default configuration: more connections than the server has open
    files, five in six sending a request head a line a second and never finishing it, one in six
    sending nothing. While they are open /health answers 200 within 2 s, 3 of 3 times; the log
    stays small (asyncio's 'socket.accept() out of system resource', logged in a tight loop,
    once wrote 114 MB in 30 s); and the server has closed every one of them soon after the
    header timeout."""
    srv = Server(tmp_path, _server_config(llama_path), preexec_fn=_low_file_limit)
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    sel = selectors.DefaultSelector()
    opened: list[socket.socket] = []
    closed: dict[socket.socket, float] = {}
    stop = threading.Event()

    def drip() -> None:
        """Every second: note the connections the server closed (EOF or reset, after whatever
        it answered), and send one more header line on the others."""
        line = 0
        while not stop.is_set():
            for key, _ in sel.select(timeout=0):
                sock = key.fileobj
                try:
                    if sock.recv(65536):
                        continue                            # an answer; EOF comes next
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                sel.unregister(sock)
                closed[sock] = time.monotonic()
            line += 1
            for sock in opened:
                if sock not in closed:
                    try:
                        sock.send(b"X-Slow-%d: 1\r\n" % line)
                    except BlockingIOError:
                        pass
                    except OSError:                         # reset: the server closed it
                        sel.unregister(sock)
                        closed[sock] = time.monotonic()
            stop.wait(1.0)

    dripper = threading.Thread(target=drip, daemon=True)
    log_at_start = len(srv.log)
    try:
        t_open = time.monotonic()
        for i in range(SLOW_CLIENTS):
            sock = socket.create_connection((host, int(port)), timeout=10)
            if i % 6:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            sock.setblocking(False)
            opened.append(sock)
            sel.register(sock, selectors.EVENT_READ)
        dripper.start()
        health = []
        for _ in range(3):
            time.sleep(0.5)
            t0 = time.perf_counter()
            r = httpx.get(srv.url + "/health", timeout=2.0)
            health.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        still_open = SLOW_CLIENTS - len(closed)
        assert still_open > 0, "every slow client was gone before /health was probed"
        _wait(lambda: len(closed) == SLOW_CLIENTS, HEADER_TIMEOUT_S + 15,
              "the server to close every slow connection")
        last = max(closed.values()) - t_open
        log = srv.log[log_at_start:]
        log_bytes = sum(map(len, log))
        print(f"\n{SLOW_CLIENTS} slow clients, file limit {FILE_LIMIT}: /health "
              f"{', '.join(f'{t * 1e3:.0f}' for t in health)} ms with {still_open} of them "
              f"open; all closed {last:.1f} s after the first opened; {len(log)} log lines "
              f"({log_bytes} bytes)")
        assert last < HEADER_TIMEOUT_S + 10
        assert log_bytes < 20_000, "".join(log[:40])
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        assert srv.stop(signal.SIGTERM) == 0, "".join(srv.log[-30:])
    finally:
        stop.set()
        if dripper.is_alive():
            dripper.join(5)
        for sock in opened:
            sock.close()
        srv.stop(signal.SIGKILL)


DRIP_BODY_BYTES = 200_000
BODY_TIMEOUT_S = 10.0           # frontend.body_timeout_s's default
DRIP_CONNECTIONS_MAX = 1000


def test_body_drip_cannot_lock_out_new_connections(llama_path, tmp_path):
    """Body drip against the default configuration: as many connections as the server holds
    (its start-up log says how many; open-file limit 256), each sending a complete head for a
    200,000-byte body on time and then a byte of it a second, refilled as the server closes
    them. While they run, /health from a new connection answers 200, 3 of 3 times, and a
    one-token completion is served within 15 s; the drippers are answered 408 once their body
    deadline passes (frontend.body_timeout_s, then frontend.body_min_rate); the app's handlers
    awaiting their bodies end without an error and the log stays small. Bounded: 1,000
    connections, under a minute."""
    srv = Server(tmp_path, _server_config(llama_path), preexec_fn=_low_file_limit)
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    held = next(line for line in srv.log if "holding up to " in line)
    cap = int(held.split("holding up to ", 1)[1].split()[0])
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n{" % DRIP_BODY_BYTES)
    sel = selectors.DefaultSelector()
    live: set[socket.socket] = set()
    answers: collections.Counter[str] = collections.Counter()
    stats = {"opened": 0, "closed": 0}
    filled, stop = threading.Event(), threading.Event()

    def open_one() -> None:
        if stats["opened"] >= DRIP_CONNECTIONS_MAX:
            return
        stats["opened"] += 1
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(head)
        sock.setblocking(False)
        live.add(sock)
        sel.register(sock, selectors.EVENT_READ)

    def drip() -> None:
        """Fill the cap; then every second: note the connections the server closed (after
        whatever it answered) and open one in each one's place, and send a byte of body on
        the others."""
        for _ in range(cap):
            open_one()
        filled.set()
        while not stop.is_set():
            for key, _ in sel.select(timeout=0):
                sock = key.fileobj
                try:
                    data = sock.recv(65536)
                    if data:
                        answers[data.split(b"\r\n", 1)[0].decode()] += 1
                        continue                            # an answer; EOF comes next
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                sel.unregister(sock)
                live.discard(sock)
                sock.close()
                stats["closed"] += 1
                open_one()
            for sock in list(live):
                try:
                    sock.send(b" ")
                except BlockingIOError:
                    pass
                except OSError:                             # reset: noted on the next select
                    pass
            stop.wait(1.0)

    dripper = threading.Thread(target=drip, daemon=True)
    log_at_start = len(srv.log)
    try:
        model = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        t_start = time.monotonic()
        dripper.start()
        assert filled.wait(30), "could not open the drip connections"
        time.sleep(1.0)                                     # every head in, bodies dripping
        dripping = len(live)
        assert dripping >= cap - 2 and stats["closed"] <= 2, (dripping, stats)
        health = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = httpx.get(srv.url + "/health", timeout=5.0)
            health.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            time.sleep(0.5)
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", timeout=15.0,
                       json={"model": model, "prompt": "Hi", "max_tokens": 1})
        completion = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
        _wait(lambda: answers["HTTP/1.1 408 Request Timeout"] >= cap // 2,
              BODY_TIMEOUT_S + 10, "the server to answer the drippers 408")
        timed_out = time.monotonic() - t_start
        assert httpx.get(srv.url + "/health", timeout=5.0).status_code == 200
        stop.set()
        dripper.join(10)
        log = srv.log[log_at_start:]
        log_bytes = sum(map(len, log))
        print(f"\n{cap} body drippers (file limit {FILE_LIMIT}), {stats['opened']} opened in "
              f"all: /health {', '.join(f'{t * 1e3:.0f}' for t in health)} ms, a completion "
              f"{completion * 1e3:.0f} ms with {dripping} of them open; {dict(answers)}, "
              f"half the first wave answered 408 {timed_out:.1f} s in; {len(log)} log lines "
              f"({log_bytes} bytes)")
        assert not answers.keys() - {"HTTP/1.1 408 Request Timeout"}, answers
        assert timed_out < BODY_TIMEOUT_S + 8
        assert not any("Exception in ASGI application" in line for line in log), "".join(log)
        assert log_bytes < 20_000, "".join(log[:40])
        for sock in list(live):
            sock.close()                # else the drain waits for their requests
        assert srv.stop(signal.SIGTERM) == 0, "".join(srv.log[-30:])
    finally:
        stop.set()
        if dripper.is_alive():
            dripper.join(5)
        for sock in list(live):
            sock.close()
        srv.stop(signal.SIGKILL)


async def _serve_in_process(app, **timeouts):
    """``app`` behind the server's connection rules on 127.0.0.1 (a cap of 3 connections, a
    0.5 s head deadline, ``timeouts`` for the body's): (server, its task, port) once started."""
    import asyncio

    import uvicorn

    from corellm_plugins.frontend_openai.server import _uvicorn_server

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.setblocking(False)
    config = uvicorn.Config(app, lifespan="off", log_level="warning", http="h11", ws="none",
                            timeout_keep_alive=5)
    server = _uvicorn_server(config, sock, cap=3, header_timeout_s=0.5, **timeouts)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


def test_body_rules_in_process():
    """The body rules, against a small app with short timeouts (no engine): a body trickled
    under ``body_min_rate`` past ``body_timeout_s`` is a 408 and the connection is closed, the
    app's handler awaiting the body seeing the client gone (no error of its own); a body at a
    good rate is served though it takes longer than ``body_timeout_s``; a body still arriving
    after the app has answered is cut off at its deadline without a 408 behind the answer; at
    the cap a new connection takes the place of a connection waiting for a head, then of the
    one receiving a body longest, never of a request in progress, and gets no 503."""
    import asyncio

    release = asyncio.Event()
    gone: list[str] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/wait":
            await release.wait()
        size = 0
        while scope["path"] != "/early":           # /early answers without reading the body
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.append(scope["path"])
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"%d" % size
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def reply(reader) -> bytes:
        return await asyncio.wait_for(reader.read(), 5)        # to EOF: the server closes

    def post(path: str, length: int) -> bytes:
        return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (
            path.encode(), length)

    async def trickle(reader, writer, chunk: bytes, every_s: float, total: int) -> None:
        """``chunk`` every ``every_s`` seconds, up to ``total`` bytes (cancelled once the
        server has answered)."""
        sent = 0
        while sent < total and not reader.at_eof():
            writer.write(chunk[:total - sent])
            sent += len(chunk)
            await asyncio.sleep(every_s)

    async def main() -> None:
        # A body has 1 s, then must come at 100 bytes/s.
        server, task, port = await _serve_in_process(app, body_timeout_s=1.0, body_min_rate=100)

        def connect():
            return asyncio.open_connection("127.0.0.1", port)

        async def slow(r, w) -> tuple[bytes, float]:
            """10 bytes/s of a 1,000-byte body: 408 once the 1 s has passed."""
            t0 = time.monotonic()
            w.write(post("/slow", 1000))
            dripping = asyncio.create_task(trickle(r, w, b"x", 0.1, 1000))
            answer = await reply(r)
            dripping.cancel()
            return answer, time.monotonic() - t0

        async def steady(r, w) -> bytes:
            """300 bytes/s of a 450-byte body: 1.5 s, longer than the 1 s, and served."""
            w.write(post("/steady", 450))
            dripping = asyncio.create_task(trickle(r, w, b"x" * 30, 0.1, 450))
            answer = await asyncio.wait_for(r.readuntil(b"\r\n\r\n450"), 5)
            await dripping
            return answer

        async def early(r, w) -> bytes:
            """Answered at once; the body then dripped: closed at the deadline, no 408."""
            w.write(post("/early", 1000))
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n0"), 5)
            dripping = asyncio.create_task(trickle(r, w, b"x", 0.1, 1000))
            try:
                rest = await reply(r)
            except ConnectionResetError:            # aborted with a byte of body unread
                rest = b""
            dripping.cancel()
            return head + rest

        conns = [await connect() for _ in range(3)]
        (too_slow, took), served, answered = await asyncio.gather(
            slow(*conns[0]), steady(*conns[1]), early(*conns[2]))
        assert too_slow.startswith(b"HTTP/1.1 408"), too_slow
        assert 0.9 < took < 3, took
        assert served.startswith(b"HTTP/1.1 200"), served
        assert answered.startswith(b"HTTP/1.1 200") and b"408" not in answered, answered
        await asyncio.sleep(0.1)
        assert gone == ["/slow"]                    # its handler saw the client go, and ended
        for _, w in conns:
            w.close()
        await asyncio.sleep(0.1)

        # at the cap (3): a request in progress and two bodies arriving; a new connection takes
        # the place of the older body, and then, kept alive, is the one that makes room
        busy_r, busy_w = await connect()
        busy_w.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        bodies = []
        for _ in range(2):
            r, w = await connect()
            w.write(post("/", 1000) + b"x")
            bodies.append((r, w))
            await asyncio.sleep(0.1)
        t_body = time.monotonic()
        r, w = await connect()
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\n0"), 5)).startswith(
            b"HTTP/1.1 200")
        assert await reply(bodies[0][0]) == b""
        r2, w2 = await connect()
        w2.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r2.readuntil(b"\r\n\r\n0"), 5)).startswith(
            b"HTTP/1.1 200")
        assert await reply(r) == b""                # the idle one went before the body
        assert time.monotonic() - t_body < 0.8      # and the younger body is still open
        assert not bodies[1][0].at_eof()
        assert (await reply(bodies[1][0])).startswith(b"HTTP/1.1 408")    # at its deadline
        await asyncio.sleep(0.1)
        assert gone == ["/slow", "/", "/"]          # the evicted body's handler ended too
        release.set()
        assert b"200" in await asyncio.wait_for(busy_r.readuntil(b"\r\n\r\n0"), 5)
        for _, writer in [(busy_r, busy_w), *bodies, (r, w), (r2, w2)]:
            writer.close()
        server.should_exit = True
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_connection_rules_in_process():
    """The listener's rules, against a small app with short timeouts (no engine): a head begun
    on a kept-alive connection and not finished is a 408; a connection that sends nothing is
    closed quietly; at the cap the connection waiting longest for a request makes room, and
    when every connection has a request in progress a new one gets the canned 503."""
    import asyncio

    release = asyncio.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/wait":
            await release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def reply(reader) -> bytes:
        return await asyncio.wait_for(reader.read(), 5)        # to EOF: the server closes

    async def main() -> None:
        server, task, port = await _serve_in_process(app)

        def connect():
            return asyncio.open_connection("127.0.0.1", port)

        # kept alive after a request, then half a head: 408 half a second after its first byte
        r, w = await connect()
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert (await reply(r)).startswith(b"HTTP/1.1 408")
        assert 0.4 < time.monotonic() - t0 < 3
        w.close()

        # nothing sent: closed without an answer
        r, w = await connect()
        t0 = time.monotonic()
        assert await reply(r) == b"" and 0.4 < time.monotonic() - t0 < 3
        w.close()

        # at the cap (3): two requests in progress and one connection waiting; a new connection
        # takes the waiting one's place and is served
        busy = [await connect() for _ in range(2)]
        for _, w in busy:
            w.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        idle_r, idle_w = await connect()
        idle_w.write(b"GET / HTTP/1.1\r\n")
        await asyncio.sleep(0.1)
        r, w = await connect()
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        assert await reply(idle_r) == b""
        # the three held connections all have a request in progress now: 503, at once
        w.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        r2, w2 = await connect()
        w2.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = (await reply(r2)).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: " in head, head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        release.set()
        for reader, _ in [*busy, (r, w)]:
            assert b"200" in await asyncio.wait_for(reader.readuntil(b"ok"), 5)
        for _, writer in [*busy, (r, w), (r2, w2), (idle_r, idle_w)]:
            writer.close()
        server.should_exit = True
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_repeated_log_lines_collapse():
    """Like lines (same logger, level and template) within the window log once, then a count."""
    import logging

    from corellm_plugins.frontend_openai.log_repeats import RepeatFilter

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("corellm.test.repeats")
    log.propagate = False
    handler = Keep()
    log.addHandler(handler)
    now = [0.0]
    repeats = RepeatFilter(window_s=10, clock=lambda: now[0])
    handler.addFilter(repeats)
    try:
        for port in range(1000):
            log.warning("closed the connection from 127.0.0.1:%d", port)
        log.warning("something else")
        assert records == ["closed the connection from 127.0.0.1:0", "something else"]
        now[0] = 9.0
        repeats.flush()                                    # the window has not passed
        assert len(records) == 2
        now[0] = 10.0
        repeats.flush()
        assert records[2:] == [("closed the connection from 127.0.0.1:0 "
                                "[and 999 more like it within 10 s]")]
        log.warning("closed the connection from 127.0.0.1:%d", 5)       # a new run
        log.warning("closed the connection from 127.0.0.1:%d", 6)
        now[0] = 30.0
        log.warning("closed the connection from 127.0.0.1:%d", 7)       # and the next
        assert records[3:] == ["closed the connection from 127.0.0.1:5",
                               ("closed the connection from 127.0.0.1:5 "
                                "[and 1 more like it within 10 s]"),
                               "closed the connection from 127.0.0.1:7"]
    finally:
        log.removeHandler(handler)


def test_connection_cap_follows_the_file_limit():
    """The default cap is what the open-file limit, raised to the hard limit, leaves; a
    max_connections the hard limit cannot hold is an error naming the key."""
    import subprocess
    import sys

    code = """if True:
        import resource
        from corellm.errors import CorellmError
        from corellm_plugins.frontend_openai.connections import (FILE_RESERVE, connection_cap,
                                                                 open_files)
        in_use = open_files()
        cap = connection_cap(None)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (512, 512)
        assert cap == 512 - in_use - FILE_RESERVE, (cap, in_use)
        assert connection_cap(100) == 100
        try:
            connection_cap(1000)
        except CorellmError as exc:
            assert "frontend.max_connections" in str(exc) and "512" in str(exc), exc
        else:
            raise AssertionError("no error")
    """

    def limits():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))
    out = subprocess.run([sys.executable, "-c", code], preexec_fn=limits,
                         capture_output=True, text=True, timeout=60, check=False,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------- preprocessing
# With the default frontend options: one client's bodies, as large as the body limit lets them
# be, must not hold up other clients' parsing, chat templates and tokenization.
ATTACKERS = 20
MAX_MESSAGES = 2048               # the default frontend.limits.max_messages
BODY_LIMIT = 1 << 20              # the default frontend.max_request_bytes


def _compact(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _expensive_bodies(tokenizer) -> dict[str, tuple[str, bytes]]:
    """Route and body of each kind: the issue's chat body (30,000 short messages in 1 MiB); the
    most expensive chat bodies the default limits let through to the chat template and the
    tokenizer: as many messages as max_messages allows, filling the body limit, and one message
    as long as could fit the test model's context (its longest token's characters per token),
    which is tokenized in full; and a 1 MiB /tokenize prompt, which no limit refuses (counting
    a long text's tokens is what /tokenize is for): about a second of tokenizing."""
    longest_token = max(map(len, tokenizer.get_vocab()))
    empty = len(_compact({"role": "user", "content": ""})) + 1
    per_message = (BODY_LIMIT - 1000) // MAX_MESSAGES - empty
    bodies = {
        "issue": ("/v1/chat/completions", _compact(
            {"messages": [{"role": "user", "content": "hello"}] * 30_000, "max_tokens": 1})),
        "most_messages": ("/v1/chat/completions", _compact(
            {"messages": [{"role": "user", "content": "word " * (per_message // 5)}]
             * MAX_MESSAGES, "max_tokens": 1})),
        "longest_text": ("/v1/chat/completions", _compact(
            {"messages": [{"role": "user", "content": "a b " * (
                longest_token * (MAX_MODEL_LEN - 1) // 4 - 10)}], "max_tokens": 1})),
        "tokenize": ("/tokenize", _compact(
            {"prompt": "hello world " * ((BODY_LIMIT - 100) // 12)})),
    }
    assert all(len(raw) <= BODY_LIMIT for _, raw in bodies.values())
    return bodies


def _messages(n: int, content="hi") -> list:
    return [{"role": "user", "content": content}] * n


MAX_MESSAGES_KEY = "(frontend.limits.max_messages)"
TOO_LONG = (f"characters cannot fit in this model's maximum context length of {MAX_MODEL_LEN} "
            "tokens (model.max_model_len)")


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/chat/completions", {"messages": _messages(MAX_MESSAGES + 1)}, "messages",
     MAX_MESSAGES_KEY),
    ("/v1/chat/completions", {"messages": _messages(
        1, [{"type": "text", "text": "x"}] * (MAX_MESSAGES + 1))}, "messages", MAX_MESSAGES_KEY),
    ("/tokenize", {"messages": _messages(MAX_MESSAGES + 1)}, "messages", MAX_MESSAGES_KEY),
    # within max_messages, but the template's text is too long for the context
    ("/v1/chat/completions", {"messages": _messages(MAX_MESSAGES)}, "messages", TOO_LONG),
    ("/v1/completions", {"prompt": "x" * 100_000}, "prompt", TOO_LONG),
    ("/v1/completions", {"prompt": ["ok", "x" * 100_000]}, "prompt[1]", TOO_LONG),
])
def test_preprocessing_bounds_are_400s_naming_field_and_key(default_server, path, body, param,
                                                            says):
    """Too many messages are refused before they are validated, and a text too long for the
    context before it is tokenized, each naming the field and the key."""
    r = _post(default_server, path, body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


def test_expensive_bodies_do_not_queue_other_clients(default_server, tokenizer):
    """Twenty clients send expensive bodies back to back, five of each kind above, while a
    one-token completion is timed three times: each must answer within 4 s. With a single
    tokenizer thread (FIFO), the issue's 30,000 messages validated on the event loop (0.2 s)
    and spent about a second of that thread before their 400, and the completion waited for
    every body queued before it: 22-29 s on a 2-core AMD EPYC. Now they are a 400 naming
    frontend.limits.max_messages, counted before validation; a text too long for the context is
    refused by its length before it is tokenized; the rest run cheapest first, with a thread
    kept for small jobs: 0.1-0.6 s on the same machine, shared with other test runs (load
    average 2-4). The bound leaves room for a busier machine: twenty clients sending 1 MiB
    bodies that are refused at once as malformed delayed the completion up to 1.5 s at load
    average 6-9. The attackers use http.client, whose threads wait on their sockets without
    the GIL, so the timing is the server's, not this process's."""
    import http.client
    from urllib.parse import urlsplit

    server = default_server
    bodies = _expensive_bodies(tokenizer)
    kinds = list(bodies)
    stop = threading.Event()
    answers: dict[str, list] = {k: [] for k in kinds}
    url = urlsplit(server.url)

    def attack(i: int) -> None:
        kind = kinds[i % len(kinds)]
        path, raw = bodies[kind]
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                conn.request("POST", path, body=raw,
                             headers={"content-type": "application/json"})
                r = conn.getresponse()
                data = json.loads(r.read())
                answers[kind].append((r.status, data.get("error"), time.perf_counter() - t0))
        finally:
            conn.close()

    threads = [threading.Thread(target=attack, args=(i,)) for i in range(ATTACKERS)]
    for t in threads:
        t.start()
    probes = []
    try:
        time.sleep(1.0)                   # every attacker's first body is in
        for _ in range(3):
            t0 = time.perf_counter()
            try:
                r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
                assert r.status_code == 200, r.text
                probes.append(time.perf_counter() - t0)
            except httpx.TimeoutException:
                probes.append(float("inf"))
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    print(f"\none-token completion under {ATTACKERS} expensive clients: "
          + ", ".join(f"{p * 1e3:.0f} ms" for p in probes) + "; "
          + "; ".join(f"{k}: {len(v)} answered, median "
                      f"{statistics.median(a[2] for a in v) * 1e3:.0f} ms" for k, v in
                      answers.items() if v))
    assert max(probes) < 4.0, probes
    issue = answers["issue"]
    assert issue and all(s == 400 and e["param"] == "messages"
                         and "frontend.limits.max_messages" in e["message"]
                         for s, e, _ in issue), issue[:2]
    for kind in ("most_messages", "longest_text"):
        assert answers[kind] and all(s == 400 and e["param"] == "messages"
                                     for s, e, _ in answers[kind]), answers[kind][:2]
    assert answers["tokenize"] and all(s == 200 for s, _, _ in answers["tokenize"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_recursion_in_chat_template_kwargs_names_it(default_server, path):
    """Values nested too deeply for the chat template to walk are the fault of the field that
    holds them, not of messages."""
    nested: list = []
    for _ in range(600):
        nested = [nested]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {"deep": nested}}
    if path == "/tokenize":
        del body["max_tokens"]
    r = _post(default_server, path, body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "chat_template_kwargs" and \
        err["message"].startswith("chat_template_kwargs: "), err


# --------------------------------------------------------------------------- constraints
# What structured outputs let one client do to the others: a constraint that is expensive to
# check or to compile, many distinct large constraints, and a response many times its request.
def _constraint_config(llama_path) -> dict:
    """Bounds raised out of the way and short deadlines, so that what is measured is the
    deadlines: the check processes' (1 s) and the compile processes' (2 s)."""
    cfg = _config(llama_path, limits={**LIMITS, "constraints": {
        "max_repetition": 1_000_000, "max_properties": 1_000_000, "check_timeout_s": 1.0}})
    cfg["logits_processors"] = {"compile_timeout_s": 2.0}
    return cfg


@pytest.fixture(scope="module")
def constraint_server(llama_path, tmp_path_factory):
    pytest.importorskip("xgrammar")
    srv = Server(tmp_path_factory.mktemp("reliability-constraints"),
                 _constraint_config(llama_path))
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, "".join(srv.log[-30:])


def _props(n: int, pad: int = 0) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
            **({"description": "d" * pad} if pad else {})}


@pytest.mark.parametrize("so, field, key", [
    ({"json": {"type": "string", "pattern": "[a-z]{1,10000}"}}, "structured_outputs.json",
     "max_repetition"),
    ({"regex": "([a-z]{1,100}){1,100}"}, "structured_outputs.regex", "max_repetition"),
    ({"grammar": 'root ::= [a-z]{1,5000}'}, "structured_outputs.grammar", "max_repetition"),
    ({"json": _props(3000)}, "structured_outputs.json", "max_properties"),
    (None, None, None),
])
def test_constraint_bounds_are_400s_naming_field_and_key(default_server, so, field, key):
    """Before anything parses a constraint, its shape is held to frontend.limits.constraints:
    a pattern's counted repetitions, a schema's properties, its depth, its size."""
    if field is None:                   # a schema nested 70 deep: max_depth (64)
        deep: dict = {"type": "string"}
        for _ in range(70):
            deep = {"type": "array", "items": deep}
        so, field, key = {"json": deep}, "structured_outputs.json", "max_depth"
    t0 = time.perf_counter()
    r = _post(default_server, "/v1/completions", {"prompt": "x", "max_tokens": 1,
                                                  "structured_outputs": so})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"frontend.limits.constraints.{key}" in err["message"], err
    assert time.perf_counter() - t0 < 2.0


def test_vllm_xargs_nested_too_deep_is_a_400(default_server):
    deep: list = [1]
    for _ in range(600):            # past max_depth, and past what pickles
        deep = [deep]
    r = _post(default_server, "/v1/completions", {"prompt": "x", "max_tokens": 1,
                                                  "vllm_xargs": {"a": deep}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "vllm_xargs" and "max_depth" in err["message"], err


def test_response_format_bounds_name_the_openai_field(default_server):
    r = _post(default_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "[a-z]{1,10000}"}}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"


def test_a_slow_constraint_check_is_killed_and_delays_nobody(constraint_server):
    """Two ~150-byte requests whose pattern xgrammar takes minutes to parse (the bounds raised
    out of the way here): each check runs in a check process killed at check_timeout_s (1 s),
    each request gets a 400 naming the field and the key, and meanwhile plain one-token
    completions (tokenized on other threads) are answered at once; the check processes take
    the next constraint at once."""
    srv = constraint_server
    attack = {"prompt": "x", "max_tokens": 1,
              "structured_outputs": {"json": {"type": "string", "pattern": "[a-z]{1,40000}"}}}
    answers: list = []

    def send() -> None:
        r = _post(srv, "/v1/completions", attack)
        answers.append((time.perf_counter(), r))

    attackers = [threading.Thread(target=send) for _ in range(2)]
    t0 = time.perf_counter()
    for t in attackers:
        t.start()
    time.sleep(0.2)
    plain = []
    while any(t.is_alive() for t in attackers) and len(plain) < 20:
        t1 = time.perf_counter()
        r = _post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
        plain.append(time.perf_counter() - t1)
    for t in attackers:
        t.join(60)
    print(f"\ntwo slow constraint checks: answered in "
          f"{', '.join(f'{a - t0:.1f}' for a, _ in answers)} s; {len(plain)} plain completions "
          f"meanwhile, max {max(plain, default=0) * 1e3:.0f} ms")
    for _, r in answers:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "structured_outputs.json", err
        assert "frontend.limits.constraints.check_timeout_s" in err["message"], err
    # The first check also starts the check processes (importing xgrammar); then two checks
    # of 1 s each, one after the other (both are large: one process takes those).
    assert all(a - t0 < 30 for a, _ in answers)
    assert plain and max(plain) < 3.0, plain
    r = _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 4,
                                       "structured_outputs": {"regex": "(ab|cd){2}"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in (
        "abab", "abcd", "cdab", "cdcd"), r.text


def test_slow_compiles_are_killed_and_small_constraints_keep_being_served(constraint_server):
    """Four schemas of 6,000 properties (parsed at once, compiled against the vocabulary far
    slower than compile_timeout_s: 2 s): each compile runs in a compile process killed at the
    deadline, its request a 400 naming the field and the key; one still queued behind the
    others after 3 x the deadline is a 503 to retry; none is a 500. Small constrained requests
    sent meanwhile are answered with a 200 well within 15 s (compiles are queued cheapest
    first, one compile worker kept for small ones), and the compile workers serve the next
    constraint at once."""
    srv = constraint_server
    answers: list = []

    def attack(i: int) -> None:
        so = {"json": {**_props(6000), "title": f"attack {i}"}}
        so["json"]["properties"][f"x{i}"] = {"type": "string"}   # distinct: no cache shared
        answers.append(_post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                      "structured_outputs": so}))

    attackers = [threading.Thread(target=attack, args=(i,)) for i in range(4)]
    for t in attackers:
        t.start()
    time.sleep(0.5)
    small = []
    for i in range(3):
        t1 = time.perf_counter()
        r = _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 4, "structured_outputs": {
            "choice": [f"yes{i}", f"no{i}"]}})
        small.append(time.perf_counter() - t1)
        assert r.status_code == 200, r.text
    for t in attackers:
        t.join(120)
    print(f"\nfour slow compiles: small constrained requests answered in "
          f"{', '.join(f'{s:.2f}' for s in small)} s")
    assert max(small) < 15, small
    assert len(answers) == 4, [r.text for r in answers]
    for r in answers:
        err = r.json()["error"]
        if r.status_code == 503:
            assert err["code"] == "server_busy" and r.headers["retry-after"], err
            continue
        assert r.status_code == 400, r.text
        assert err["param"] == "structured_outputs.json", err
        assert "logits_processors.compile_timeout_s" in err["message"], err
    assert any(r.status_code == 400 for r in answers), [r.text for r in answers]
    r = _post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 4, "structured_outputs": {
        "regex": "(ab|cd){2}"}})
    assert r.status_code == 200, r.text


def test_distinct_large_schemas_do_not_grow_the_server(constraint_server):
    """150 distinct schemas of 900 KB each (a description padding a small schema): every cache
    on their way is bounded by bytes and keyed by a digest of what constrains (annotations
    dropped), so the server's processes (API, engine, their check and compile processes) grow
    by under 96 MiB, measured after a first constrained request has started them."""
    srv = constraint_server
    body = {"prompt": "x", "max_tokens": 1}
    assert _post(srv, "/v1/completions", {**body, "structured_outputs": {
        "json": _props(3, pad=900_000)}}).status_code == 200
    before = tree_pss(srv.proc.pid)
    for i in range(150):
        schema = _props(3)
        schema["description"] = f"{i:04d}" + "d" * 900_000
        r = _post(srv, "/v1/completions", {**body, "structured_outputs": {"json": schema}})
        assert r.status_code == 200, r.text
    after = tree_pss(srv.proc.pid)
    print(f"\n150 distinct 900 KB schemas: the server's processes {before / 2**20:.0f} -> "
          f"{after / 2**20:.0f} MiB (PSS)")
    assert after - before < 96 << 20, (before, after)


def test_output_amplification_is_refused(server):
    """n x max_tokens x logprob width is bounded (frontend.limits.max_output_entries, 32,768
    here): a request that each other limit lets through (32 samples x 200 tokens within
    max_generated_tokens, 10 alternatives x 32 within max_logprobs_total) but whose response
    would carry 76,800 entries is a 400 naming the fields; without logprobs it is served."""
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 32, "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    r = _post(server, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 10})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "frontend.limits.max_output_entries" in \
        err["message"] and "top_logprobs" in err["message"], err
    r = _post(server, "/v1/chat/completions", {**body, "max_tokens": 2, "logprobs": True,
                                               "top_logprobs": 10})
    assert r.status_code == 200, r.text
