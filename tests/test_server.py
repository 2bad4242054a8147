"""The OpenAI-compatible server, tested through the official ``openai`` client against a live
``corellm serve`` process on 127.0.0.1 (engine core in its own process)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import engine_config
from tests.test_sim import make_profile

MAX_MODEL_LEN = 256
READY = re.compile(r"serving '(?P<model>[^']+)' on (?P<url>http://\S+) \(engine core pid "
                   r"(?P<pid>\d+)\)")


class Server:
    """``python -m corellm serve`` in a subprocess; its log is collected in ``self.log``."""

    def __init__(self, tmp: Path, config: dict, *args: str, env: dict | None = None,
                 new_session: bool = False, preexec_fn=None) -> None:
        cfg = tmp / "server.json"
        cfg.write_text(json.dumps(config))
        # new_session: the server leads a process group of its own, which a test can signal
        # whole (os.killpg), as a terminal's Ctrl-C or systemd's KillMode=control-group does.
        # preexec_fn: runs in the child before the server starts (e.g. to lower its limits).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "corellm", "serve", "--config", str(cfg), "--port", "0",
             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})}, start_new_session=new_session,
            preexec_fn=preexec_fn)  # noqa: PLW1509 - a test's own limits, before any thread
        self.log: list[str] = []
        ready = threading.Event()
        self.url = self.model = ""
        self.engine_pid = 0

        def read() -> None:
            for line in self.proc.stdout:
                self.log.append(line)
                m = READY.search(line)
                if m:
                    self.url, self.model = m["url"], m["model"]
                    self.engine_pid = int(m["pid"])
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(180) or not self.url:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log))

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"),
                             max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line.startswith("corellm:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _server_config(path) -> dict:
    return engine_config(path, model={"max_model_len": MAX_MODEL_LEN},
                         scheduler={"max_num_seqs": 64})


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("server"), _server_config(llama_path))
    yield srv
    engine_pid = srv.engine_pid
    code = srv.stop(signal.SIGINT)
    # Clean shutdown on SIGINT: exit code 0, the engine process gone too.
    assert code == 0, "".join(srv.log[-30:])
    _wait(lambda: not _pid_alive(engine_pid), 10, "the engine process to exit")


@pytest.fixture(scope="module")
def paced_server(llama_path, tmp_path_factory):
    """The same server, its steps paced by the simulated executor (20 ms each, slept on the
    real clock): a request a test must catch mid-flight is then still running, however fast the
    machine (the tiny model makes its 248 tokens in under 0.2 s on a fast CPU)."""
    tmp = tmp_path_factory.mktemp("paced")
    config = _server_config(llama_path)
    config["executor"] = {"name": "sim", "clock": "real",
                          "profile": str(make_profile(llama_path, tmp / "profile.json",
                                                      base=0.02))}
    srv = Server(tmp, config)
    yield srv
    engine_pid = srv.engine_pid
    assert srv.stop(signal.SIGINT) == 0, "".join(srv.log[-30:])
    _wait(lambda: not _pid_alive(engine_pid), 10, "the engine process to exit")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def offline(llama_path):
    from corellm import LLM
    llm = LLM(_server_config(llama_path))
    yield llm
    llm.shutdown()


def _pool_whole(server: Server) -> bool:
    m = server.metrics()
    return (m["corellm:num_requests_running"] == 0 and m["corellm:num_requests_waiting"] == 0
            and m["corellm:kv_cache_blocks_free"] == m["corellm:kv_cache_blocks_total"])


# --------------------------------------------------------------------------- endpoints
def test_models_version_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(server.url + "/health").status_code == 200
    from corellm import __version__
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_completion_equals_offline_greedy(server, client, offline):
    from corellm import SamplingParams
    prompts = ["The meaning of life is", "def fibonacci(n):", "Once upon a time"]
    expected = offline.generate(prompts, SamplingParams(max_tokens=24, temperature=0),
                                use_tqdm=False)
    for prompt, exp in zip(prompts, expected):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=24,
                                      temperature=0)
        assert r.choices[0].text == exp.outputs[0].text
        assert r.choices[0].finish_reason == exp.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert r.usage.completion_tokens == len(exp.outputs[0].token_ids)
        stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=24,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == exp.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] \
            == exp.outputs[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens \
            == len(exp.outputs[0].token_ids)


def test_completion_prompt_forms(server, client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=8,
                                       temperature=0)
    by_text = client.completions.create(model=server.model, prompt="Once upon a time",
                                        max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = client.completions.create(model=server.model, prompt=["Once upon a time", "Hello"],
                                     max_tokens=8, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text
    # the model name may be left out (vLLM does the same)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == server.model


def test_chat_completion_and_stream(server, client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=server.model, messages=messages,
                                       max_completion_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    # the prompt is the tokenizer's chat template, rendered and tokenized
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    stream = client.chat.completions.create(model=server.model, messages=messages,
                                            max_completion_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # max_tokens (deprecated name) is honoured too
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_n2(server, client):
    r = client.completions.create(model=server.model, prompt="Hello", max_tokens=10, n=2,
                                  temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].text != r.choices[1].text          # distinct samples
    assert r.usage.completion_tokens == 20
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2,
        temperature=1.0, seed=11, stream=True, extra_body={"ignore_eos": True})
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream
                if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_seed_reproducibility(server, client):
    def sample(seed):
        return client.completions.create(model=server.model, prompt="Hello", max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_stop_strings(server, client):
    full = client.completions.create(model=server.model, prompt="The meaning of life is",
                                     max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    r = client.completions.create(model=server.model, prompt="The meaning of life is",
                                  max_tokens=40, temperature=0, stop=[stop, "\x00never"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40               # finished early, in the core too
    chunks = list(client.completions.create(
        model=server.model, prompt="The meaning of life is", max_tokens=40, temperature=0,
        stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    _wait(lambda: _pool_whole(server), 10, "the stopped requests' blocks to return")


def test_logprobs(server, client):
    r = client.completions.create(model=server.model, prompt="Hello", max_tokens=5,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) >= 3
        assert chosen == pytest.approx(max(top.values()))     # greedy picks the best
    r = client.chat.completions.create(model=server.model,
                                       messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_engine_side_fields(server, client):
    """Penalties, top_k/min_p, priority, user, session_id: accepted and applied by the engine."""
    base = dict(model=server.model, prompt="Hello", max_tokens=24, temperature=0)
    plain = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0]
    penalized = client.completions.create(
        **base, frequency_penalty=2.0, presence_penalty=2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.5}).choices[0]
    assert penalized.text != plain.text
    r = client.completions.create(**base, user="tenant-a",
                                  extra_body={"ignore_eos": True, "priority": -5, "top_k": 1,
                                              "min_p": 0.1, "session_id": "chat-1"})
    assert r.choices[0].text == plain.text                  # top_k=1 is greedy


# --------------------------------------------------------------------------- bad input
def _post(server, path, body=None, raw=None, headers=None):
    if raw is not None:                       # raw bytes still claim to be JSON unless told
        headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, json=body, content=raw, headers=headers, timeout=60)


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),            # wrong type
    ({"max_tokens": 3}, 400, "prompt"),                                     # missing field
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),                 # max_tokens < 1
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "max_token": 3}, 400, "max_token"),                   # unknown field
    ({"prompt": "word " * 400}, 400, "prompt"),                            # > max_model_len
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),     # prompt + output
    ({"prompt": [1, 2, 10 ** 6]}, 400, "prompt"),                          # token id range
    ({"prompt": "x", "model": "gpt-17"}, 404, "model"),                    # unknown model
    ({"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),          # not implemented
])
def test_bad_completion_requests(server, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 3}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
])
def test_bad_chat_requests(server, body, param):
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_json_and_oversized_body(server, client):
    r = _post(server, "/v1/completions", raw=b'{"prompt": "x", ', headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", raw=b'[1, 2]')
    assert r.status_code == 400 and "object" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"prompt": "x" * (2 << 20)})
    assert r.status_code == 413
    assert "max_request_bytes" in r.json()["error"]["message"]
    # ...and the server keeps serving
    assert client.completions.create(model=server.model, prompt="ok", max_tokens=2).choices


def test_openai_client_raises_on_bad_input(server, client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=server.model, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                "content": "x"}])


# --------------------------------------------------------------------------- disconnects, load
def test_client_disconnect_aborts_and_frees_blocks(paced_server):
    server = paced_server
    before = server.metrics()["corellm:generation_tokens_total"]
    body = {"prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                break
        assert server.metrics()["corellm:num_requests_running"] == 1
    # the connection is closed mid-stream: the request is aborted and its blocks return
    _wait(lambda: _pool_whole(server), 20, "the aborted request's blocks to return")
    generated = server.metrics()["corellm:generation_tokens_total"] - before
    assert generated < MAX_MODEL_LEN - 8, "the request ran to completion for nobody"

    # same for a non-streaming request: the handler is cancelled when the client leaves
    before = server.metrics()["corellm:generation_tokens_total"]
    # (248 steps of 20 ms: far more than the 0.15 s we wait)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.15,
                   json={"prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True,
                         "n": 32})
    _wait(lambda: _pool_whole(server), 20, "the abandoned request's blocks to return")
    assert server.metrics()["corellm:generation_tokens_total"] - before < 32 * (MAX_MODEL_LEN - 8)


def test_load_64_concurrent_streams(server):
    import random

    rng = random.Random(0)
    jobs = [(f"request {i}: " + " ".join(rng.choice(["alpha", "beta", "gamma", "delta"])
                                         for _ in range(rng.randint(1, 20))),
             rng.randint(1, 24)) for i in range(320)]

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=300,
                                    http_client=openai.DefaultAsyncHttpxClient(
                                        limits=httpx.Limits(max_connections=64)))
        gate = asyncio.Semaphore(64)

        async def one(prompt, n_tokens):
            async with gate:
                stream = await client.completions.create(
                    model=server.model, prompt=prompt, max_tokens=n_tokens, temperature=0.8,
                    stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
                texts, usage, reason = [], None, None
                async for chunk in stream:
                    if chunk.choices:
                        texts.append(chunk.choices[0].text)
                        reason = chunk.choices[0].finish_reason or reason
                    if chunk.usage:
                        usage = chunk.usage
                return usage.completion_tokens, reason

        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(p, n) for p, n in jobs)), timeout=600)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [r[0] for r in results] == [n for _, n in jobs]
    assert all(reason == "length" for _, reason in results)
    _wait(lambda: _pool_whole(server), 20, "the KV pool to be whole after the load")


# --------------------------------------------------------------------------- /metrics: one stream
def _samples(text: str) -> dict[str, float]:
    """{sample name: value} of /metrics (one model, so names are unique but for buckets)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if "le" not in s.labels}


# /metrics name -> the EngineStats field it must equal
_ENGINE_FIELDS = {
    "corellm:num_requests_running": "num_running_reqs",
    "corellm:num_requests_waiting": "num_waiting_reqs",
    "corellm:kv_cache_blocks_total": "kv_blocks_total",
    "corellm:kv_cache_blocks_free": "kv_blocks_free",
    "corellm:prefix_cache_blocks": "kv_blocks_cached",
    "corellm:prefix_cache_queries_total": "prefix_cache_queries",
    "corellm:prefix_cache_hits_total": "prefix_cache_hits",
    "corellm:num_preemptions_total": "num_preemptions",
    "corellm:prompt_tokens_total": "num_prompt_tokens",
    "corellm:generation_tokens_total": "num_generation_tokens",
    "corellm:engine_steps_total": "num_steps",
}


def _assert_metrics_equal_stats(m: dict[str, float], stats) -> None:
    for name, field in _ENGINE_FIELDS.items():
        assert m[name] == getattr(stats, field), (name, m[name], stats)
    used = stats.kv_blocks_total - stats.kv_blocks_free
    assert m["corellm:kv_cache_usage_perc"] == pytest.approx(used / stats.kv_blocks_total)


def _run_in_process_app(llama_path, scenario, health_timeout_s: float = 5.0,
                        max_model_len: int = MAX_MODEL_LEN, executor: dict | None = None,
                        **scheduler):
    """``await scenario(engine, http, scrape, calls)`` against the server's app, in this process
    (an ``AsyncLLM`` with its engine core in a child process, the app over ASGI), so the test
    can see which utility calls (``calls``: method names) the engine client makes."""
    from corellm.engine.async_llm import AsyncLLM
    from corellm_plugins.frontend_openai.options import OpenAIServerOptions
    from corellm_plugins.frontend_openai.app import build_app

    async def main():
        engine = await AsyncLLM.create(engine_config(
            llama_path, model={"max_model_len": max_model_len}, scheduler=scheduler,
            **({"executor": executor} if executor else {})))
        calls: list[str] = []
        real = engine.client.call_utility_async

        async def spy(method, *args, **kw):
            calls.append(method)
            return await real(method, *args, **kw)
        engine.client.call_utility_async = spy
        app = build_app(engine, OpenAIServerOptions(health_timeout_s=health_timeout_s), "m")
        try:
            # what serve() does once the app is built
            engine.finished_callbacks.append(app.state.metrics.observe_finished)
            await app.state.metrics.start()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://127.0.0.1", timeout=60) as http:
                async def scrape() -> dict[str, float]:
                    r = await http.get("/metrics")
                    assert r.status_code == 200
                    return _samples(r.text)
                await scenario(engine, http, scrape, calls)
        finally:
            app.state.serving.close()
            await engine.shutdown()

    asyncio.run(main())


def test_metrics_come_from_the_step_stream_not_from_get_stats(llama_path):
    """A scrape asks the engine nothing of its state (one ping for liveness): the gauges and
    counters are the StepStats stream's, equal to the engine's own get_stats(); the
    tokens-per-step histogram has one observation per step."""

    async def scenario(engine, http, scrape, calls):
        assert calls == ["get_stats"]            # the one seed at start-up
        calls.clear()
        fresh = await scrape()                   # nothing run yet: the seed's values
        assert calls == ["ping"]
        assert fresh["corellm:engine_alive"] == 1
        _assert_metrics_equal_stats(fresh, await engine.get_stats())
        assert fresh["corellm:iteration_tokens_total_count"] == 0
        assert fresh["corellm:kv_cache_blocks_total"] == 256

        jobs = [("Hello", 5, 1), ("The meaning of life is", 12, 1), ("one two", 1, 1),
                ("alpha beta gamma", 7, 2)]
        rs = await asyncio.gather(*(http.post("/v1/completions", json={
            "prompt": p, "max_tokens": k, "n": n, "ignore_eos": True}) for p, k, n in jobs))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]

        calls.clear()
        m = await scrape()
        m2 = await scrape()
        assert calls == ["ping", "ping"]         # no get_stats: the records are the state
        stats = await engine.get_stats()         # the engine's own answer
        assert stats.num_steps > 0 and stats.num_generation_tokens == sum(
            k * n for _, k, n in jobs)
        for sample in (m, m2):
            _assert_metrics_equal_stats(sample, stats)
            assert sample["corellm:engine_alive"] == 1
        # one observation per step; together they are every token the model computed: the
        # prefills and one decode per generated token but each sample's last
        assert m["corellm:iteration_tokens_total_count"] == stats.num_steps
        samples = sum(n for *_, n in jobs)
        assert m["corellm:iteration_tokens_total_sum"] == \
            stats.num_prefill_tokens + stats.num_generation_tokens - samples
        assert engine.latest_stats is not None and engine.latest_stats.step == stats.num_steps
        assert engine.latest_stats.scheduler.num_generation_tokens == \
            stats.num_generation_tokens

        # a stuck engine loop (its ping unanswered): not alive, and no stale gauges
        async def stuck(method, *args, **kw):
            calls.append(method)
            raise TimeoutError("no answer")
        good, engine.client.call_utility_async = engine.client.call_utility_async, stuck
        m = await scrape()
        assert m["corellm:engine_alive"] == 0 and "corellm:num_requests_running" not in m
        engine.client.call_utility_async = good
        assert (await scrape())["corellm:engine_alive"] == 1
        assert calls == ["ping", "ping", "get_stats", "ping", "ping"]   # get_stats: ours

    _run_in_process_app(llama_path, scenario)


def test_metrics_abort_of_a_waiting_request_is_an_event_record(llama_path, tmp_path):
    """One sample runs, one waits (max_num_seqs 1); aborting both is followed by no step, so
    only the engine's "event" record brings the gauges back to 0. The running sample must still
    be running at the first scrape, so the steps are paced by the simulated executor (20 ms a
    step on the real clock: 10 s to the longest context): the model itself runs its 504 steps in
    well under a second on a fast CPU, and did finish before the scrape there."""
    from corellm.sampling_params import SamplingParams
    max_model_len = 512

    async def scenario(engine, http, scrape, calls):
        stream = await engine.add_request(
            "Hello", SamplingParams(n=2, max_tokens=max_model_len - 8, ignore_eos=True))
        await stream.__anext__()
        m = await scrape()
        assert (m["corellm:num_requests_running"], m["corellm:num_requests_waiting"]) == (1, 1)
        stream.close("client_disconnected")          # one ABORT for both samples
        deadline = time.monotonic() + 20
        while True:
            m = await scrape()
            if m["corellm:num_requests_running"] == m["corellm:num_requests_waiting"] == 0:
                break
            assert time.monotonic() < deadline, m
            await asyncio.sleep(0.05)
        event = engine.latest_stats
        assert event.kind == "event" and event.num_scheduled_tokens == 0
        assert sorted(f.finish_reason for f in event.finished) == ["abort", "abort"]
        assert any(f.first_scheduled_time == 0.0 for f in event.finished)   # the waiting one
        assert m["corellm:engine_steps_total"] == event.step
        stats = await engine.get_stats()
        _assert_metrics_equal_stats(m, stats)
        assert m["corellm:kv_cache_blocks_free"] == m["corellm:kv_cache_blocks_total"]
        assert calls.count("get_stats") == 2          # the seed and ours: never a scrape's

    paced = {"name": "sim", "clock": "real",
             "profile": str(make_profile(llama_path, tmp_path / "profile.json", base=0.02))}
    _run_in_process_app(llama_path, scenario, max_model_len=max_model_len, executor=paced,
                        max_num_seqs=1)


# --------------------------------------------------------------------------- /metrics: bytes sent
def _response_bytes(text: str) -> dict[tuple[str, str], float]:
    """{(stream label, "count" or "sum"): value} of ``corellm:response_bytes`` in /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.labels["stream"], s.name.rsplit("_", 1)[1]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "corellm:response_bytes"
            for s in family.samples if s.name.endswith(("_count", "_sum"))}


def test_metrics_response_bytes_are_the_bytes_the_client_received(server):
    """One ``corellm:response_bytes`` observation per completions response, of exactly the
    body bytes the client read: a stream's events and [DONE] (stream="true"), a JSON answer or
    error whole (stream="false"). Observed as the stream's last byte is written, so a scrape
    sent once the client has read it already shows it."""
    def scrape() -> dict[tuple[str, str], float]:
        return _response_bytes(httpx.get(server.url + "/metrics", timeout=30).text)

    before = scrape()
    assert set(before) == {(s, k) for s in ("true", "false") for k in ("count", "sum")}
    comp = {"prompt": "Héllo", "max_tokens": 6, "n": 2, "logprobs": 3}
    chat = {"messages": [{"role": "user", "content": "Héllo"}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 3}
    streamed = []
    for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
        with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                          timeout=60) as r:
            assert r.status_code == 200
            raw = b"".join(r.iter_raw())
        assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: ") > 3, raw
        streamed.append(len(raw))
    whole = []
    for path, body, status in (("/v1/completions", comp, 200),
                               ("/v1/chat/completions", chat, 200),
                               ("/v1/completions", {**comp, "model": "gpt-17"}, 404)):
        r = _post(server, path, body)
        assert r.status_code == status, r.text
        whole.append(len(r.content))
    after = scrape()
    grown = {key: after[key] - before[key] for key in before}
    assert grown == {("true", "count"): 2, ("true", "sum"): sum(streamed),
                     ("false", "count"): 3, ("false", "sum"): sum(whole)}, (streamed, whole)


def test_metrics_response_bytes_of_an_event_stream_as_written():
    """An event stream counts the encoded bytes Starlette sends: every event, the error event
    and [DONE] included; a client gone mid-stream counts what was sent until then, whether the
    server says so by a disconnect message (ASGI 2.3, uvicorn) or by a send that raises (2.4).
    vLLM's naming has no such metric: nothing is counted there."""
    from fastapi.responses import JSONResponse
    from prometheus_client import generate_latest
    from starlette.requests import ClientDisconnect

    from corellm_plugins.frontend_openai.errors import APIError
    from corellm_plugins.frontend_openai.metrics import EngineMetrics
    from corellm_plugins.frontend_openai.streaming import _sse, _sse_data

    class Engine:                       # what EngineMetrics asks of an AsyncLLM here
        def add_stats_listener(self, listener) -> None:
            pass

    metrics = EngineMetrics(Engine(), "m")

    def observed(stream: str) -> tuple[float, float]:
        labels = {"model_name": "m", "stream": stream}
        get = metrics.registry.get_sample_value
        return (get("corellm:response_bytes_count", labels),
                get("corellm:response_bytes_sum", labels))

    async def serve(response, spec: str, receive, fail_at: int | None = None) -> list[bytes]:
        """``response`` over ASGI; its body messages, the one numbered ``fail_at`` raising."""
        bodies: list[bytes] = []

        async def send(message) -> None:
            if message["type"] == "http.response.body":
                if len(bodies) == fail_at:
                    raise OSError("connection reset")
                bodies.append(message["body"])
        await response({"type": "http", "asgi": {"spec_version": spec}}, receive, send)
        return bodies

    async def never() -> dict:
        await asyncio.Event().wait()
        return {}

    async def main() -> None:
        async def failing():
            yield _sse_data({"text": "héllo ✓"})
            raise APIError(400, "too many")

        response = metrics.count_response(_sse(failing(), []))
        bodies = await serve(response, "2.3", never)
        sent = b"".join(bodies)
        assert sent.startswith(b'data: {"text": "h\xc3\xa9llo \xe2\x9c\x93"}\n\n')
        assert b"too many" in sent and sent.endswith(b"data: [DONE]\n\n")
        assert observed("true") == (1, len(sent))

        gone = asyncio.Event()

        async def endless():
            for i in range(2):
                yield _sse_data({"i": i})
            gone.set()                  # both events sent: the client leaves
            await asyncio.Event().wait()

        async def disconnect() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        response = metrics.count_response(_sse(endless(), []))
        bodies = await serve(response, "2.3", disconnect)
        assert len(bodies) == 2 and observed("true") == (2, len(sent) + len(b"".join(bodies)))
        response = metrics.count_response(_sse(endless(), []))
        with pytest.raises(ClientDisconnect):
            await serve(response, "2.4", never, fail_at=1)
        assert observed("true") == (3, len(sent) + 2 * len(_sse_data({"i": 0})) +
                                    len(_sse_data({"i": 1})))

        assert observed("false") == (0, 0)
        response = metrics.count_response(JSONResponse({"text": "héllo"}))
        assert observed("false") == (1, len(response.body))

        vllm = EngineMetrics(Engine(), "m", "vllm", max_model_len=64)
        assert b"response_bytes" not in generate_latest(vllm.registry)
        response = vllm.count_response(_sse(endless(), []))
        assert response.on_sent is None

    asyncio.run(main())


# --------------------------------------------------------------------------- auth, faults
@pytest.fixture
def fragile_server(llama_path, tmp_path):
    # Stays up after the engine dies (exiting is the default: tests/test_server_reliability.py)
    config = {**_server_config(llama_path), "frontend": {"exit_on_engine_death": False}}
    # Paced by the simulated executor (20 ms a step on the real clock), so the requests the
    # test kills the engine under are still running then, however fast the machine.
    config["executor"] = {"name": "sim", "clock": "real",
                          "profile": str(make_profile(llama_path, tmp_path / "profile.json",
                                                      base=0.02))}
    srv = Server(tmp_path, config, "--api-key", "sekret")
    yield srv
    srv.stop(signal.SIGKILL)
    if srv.engine_pid and _pid_alive(srv.engine_pid):
        os.kill(srv.engine_pid, signal.SIGKILL)


def test_api_key_then_engine_death(fragile_server):
    srv = fragile_server
    body = {"prompt": "Hello", "max_tokens": 4}
    assert _post(srv, "/v1/completions", body).status_code == 401
    bad = _post(srv, "/v1/completions", body, headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        srv.client(api_key="wrong").models.list()
    good = srv.client(api_key="sekret")
    assert good.completions.create(model=srv.model, prompt="Hi", max_tokens=2).choices
    assert httpx.get(srv.url + "/health").status_code == 200      # not under /v1: no key
    assert "corellm:num_requests_running" in httpx.get(srv.url + "/metrics").text

    # Kill the engine while one streaming and one non-streaming request are in flight.
    long = dict(model=srv.model, prompt="Hello", max_tokens=MAX_MODEL_LEN - 8,
                extra_body={"ignore_eos": True, "n": 8})
    stream = good.completions.create(**long, stream=True)
    first = next(iter(stream))
    assert first.choices
    outcome = {}

    def blocking():
        try:
            good.completions.create(**long)
            outcome["result"] = "completed"
        except openai.APIStatusError as exc:
            outcome["result"] = exc.status_code
    t = threading.Thread(target=blocking)
    t.start()

    def both_in_the_engine() -> bool:          # the stream's 8 samples and the blocking 8
        m = srv.metrics()
        return m["corellm:num_requests_running"] + m["corellm:num_requests_waiting"] == 16
    _wait(both_in_the_engine, 20, "the blocking request to reach the engine")
    os.kill(srv.engine_pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine"):
        for _ in stream:
            pass
    t.join(30)
    assert not t.is_alive() and outcome["result"] == 500
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
    with pytest.raises(openai.APIStatusError) as info:
        good.completions.create(model=srv.model, prompt="Hi", max_tokens=2)
    assert info.value.status_code == 503
    assert "corellm:engine_alive" in httpx.get(srv.url + "/metrics").text
    assert srv.proc.poll() is None                                # still answering
    assert any("exited with code" in line for line in srv.log), "".join(srv.log[-20:])
    assert srv.stop(signal.SIGTERM) == 0


def test_engine_exits_when_server_is_killed(llama_path, tmp_path):
    srv = Server(tmp_path, _server_config(llama_path))
    try:
        engine_pid = srv.engine_pid
        assert _pid_alive(engine_pid)
        srv.proc.send_signal(signal.SIGKILL)        # no chance to clean up...
        srv.proc.wait(10)
        # ...but the engine notices its parent is gone and exits: no orphan
        _wait(lambda: not _pid_alive(engine_pid), 10, "the orphaned engine to exit")
    finally:
        srv.stop(signal.SIGKILL)
        if _pid_alive(srv.engine_pid):
            os.kill(srv.engine_pid, signal.SIGKILL)


# --------------------------------------------------------------------------- review regressions
@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "top_k": 2 ** 63, "temperature": 1}, 400, "top_k"),
    ({"prompt": "x", "seed": 2 ** 70}, 400, "seed"),
    ({"prompt": "x", "priority": 2 ** 70}, 400, "priority"),
    ({"prompt": "x", "user": "u" * 300}, 400, "user"),
    ({"prompt": "x", "session_id": ""}, 400, "session_id"),
    ({"prompt": "x", "n": 10 ** 6}, 400, "n"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
])
def test_values_that_must_not_reach_the_engine(server, client, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200        # engine unharmed


def test_huge_top_k_is_clamped_not_fatal(server, client):
    r = client.completions.create(model=server.model, prompt="x", max_tokens=3,
                                  temperature=1.0, extra_body={"top_k": 10 ** 9})
    assert r.usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_client_request_ids_never_collide(server, client):
    """A client-chosen request_id is echoed, not used as the engine's id: ids that would
    collide with another request's sample ids (x#1 vs x with n=2) both succeed."""
    a = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "request_id": "x#1"})
    b = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "request_id": "x",
                                          "n": 2})
    c = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "request_id": "x"})
    assert [r.status_code for r in (a, b, c)] == [200, 200, 200]
    assert b.json()["id"] == "x"
    assert httpx.get(server.url + "/health").status_code == 200


def test_nulls_nesting_templates_and_odd_tokens(server):
    ok = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": None,
        "presence_penalty": None, "logprobs": None})
    assert ok.status_code == 200, ok.text
    deep = b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    r = _post(server, "/v1/completions", raw=deep)
    assert r.status_code in (400, 413) and "error" in r.json()
    r = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"chat_template": "{{ 'PWN' }}"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_sigterm_with_a_live_stream(llama_path, tmp_path):
    srv = Server(tmp_path, _server_config(llama_path), "--api-key", "key")
    try:
        # a non-ASCII bearer token is a 401, not a crash
        r = _post(srv, "/v1/completions", {"prompt": "x"},
                  headers={"Authorization": "Bearer \u00e9t\u00e9".encode()})
        assert r.status_code == 401
        body = {"prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer key"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            srv.proc.send_signal(signal.SIGTERM)
            for _ in lines:        # the stream ends (cut or finished); it does not hang
                pass
        assert srv.proc.wait(60) == 0
        _wait(lambda: not _pid_alive(srv.engine_pid), 10, "the engine process to exit")
    finally:
        srv.stop(signal.SIGKILL)


def test_port_in_use_is_reported_before_loading(llama_path, tmp_path):
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(_server_config(llama_path)))
    try:
        r = subprocess.run([sys.executable, "-m", "corellm", "serve", "--config", str(cfg),
                            "--port", str(taken.getsockname()[1])],
                           capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert r.returncode == 2
    assert "frontend.port: cannot listen" in r.stderr
    assert "engine core process started" not in r.stderr       # nothing was loaded


# --------------------------------------------------------------------------- structured outputs
SHIRT = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
         "required": ["color"], "additionalProperties": False}


def test_structured_outputs_through_the_openai_client(client):
    """response_format (json_schema, json_object) on chat, vLLM's structured_outputs on both
    routes; whatever the random weights, the text obeys."""
    import jsonschema

    pytest.importorskip("xgrammar")
    messages = [{"role": "user", "content": "Pick a color."}]
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "shirt", "schema": SHIRT, "strict": True}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), SHIRT)
    assert chat.choices[0].finish_reason == "stop"
    choice = client.completions.create(
        model=client.models.list().data[0].id, prompt="Answer:", max_tokens=10, temperature=0.7,
        seed=2, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta")
    regex = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].message.content)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
])
def test_a_constraint_the_server_refuses_is_a_400_naming_the_field(client, body, param):
    import openai

    pytest.importorskip("xgrammar")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=5,
            messages=[{"role": "user", "content": "hi"}], extra_body=body)
    assert info.value.body["param"] == param, info.value.body
