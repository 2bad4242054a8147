"""A vLLM user's habits on the OpenAI server: vLLM's ``/tokenize`` and ``/detokenize`` routes,
and ``frontend.metrics_prefix: vllm`` for vLLM's Grafana dashboard. Live servers, as in
``tests/test_server.py`` (one per module and prefix)."""

from __future__ import annotations

import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import engine_config
from tests.test_server import MAX_MODEL_LEN, Server

KEY = "vllm-habits"

# Every series vLLM's Grafana dashboard queries (the PromQL "expr" of each panel target), from
# github.com/vllm-project/vllm examples/observability/prometheus_grafana/grafana.json, read at
# commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9 (formerly
# examples/online_serving/prometheus_grafana/grafana.json); plus the "Time Per Output Token
# (TPOT)" panel of the later revision rendered on docs.vllm.ai
# (examples/observability/prometheus_grafana, page dated 2026-09-23), which adds
# vllm:request_time_per_output_token_seconds_*. All filter on {model_name="$model_name"}.
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
# Metric families vLLM's PrometheusStatLogger defines (vllm/v1/metrics/loggers.py, current main;
# the commit of the copy read was not given by the index, an older one read alongside is
# 005a810bc40faa25b8870fbc8559c3462581eee3) that corellm exposes with metrics_prefix: vllm.
VLLM_FAMILIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
    "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:iteration_tokens_total",
}
# The default names (docs/server.md, "Metrics"): unchanged by this work.
CORELLM_FAMILIES = {
    "corellm:engine_alive", "corellm:num_requests_running", "corellm:num_requests_waiting",
    "corellm:kv_cache_usage_perc", "corellm:kv_cache_blocks_total", "corellm:kv_cache_blocks_free",
    "corellm:prefix_cache_blocks", "corellm:prefix_cache_queries", "corellm:prefix_cache_hits",
    "corellm:num_preemptions", "corellm:prompt_tokens", "corellm:generation_tokens",
    "corellm:engine_steps", "corellm:request_success", "corellm:time_to_first_token_seconds",
    "corellm:time_per_output_token_seconds", "corellm:e2e_request_latency_seconds",
    "corellm:request_queue_time_seconds", "corellm:request_aborted",
    "corellm:iteration_tokens_total",     # from the StepStats stream
    "corellm:response_bytes",             # observed as responses are written
}


def _config(path, **frontend) -> dict:
    return engine_config(path, model={"max_model_len": MAX_MODEL_LEN},
                         scheduler={"max_num_seqs": 64}, frontend=frontend)


def _stop(srv: Server) -> None:
    assert srv.stop(signal.SIGINT) == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def vserver(llama_path, tmp_path_factory):
    """metrics_prefix: vllm, and an API key (which /tokenize and /detokenize require)."""
    srv = Server(tmp_path_factory.mktemp("vllm"), _config(llama_path, metrics_prefix="vllm",
                                                          api_key=KEY))
    yield srv
    _stop(srv)


@pytest.fixture(scope="module")
def dserver(llama_path, tmp_path_factory):
    """The default prefix, no API key."""
    srv = Server(tmp_path_factory.mktemp("default"), _config(llama_path))
    yield srv
    _stop(srv)


def _post(srv: Server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def _ok(srv: Server, path: str, body: dict) -> dict:
    r = _post(srv, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _scrape(srv: Server) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of every sample on /metrics."""
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _families(srv: Server) -> set[str]:
    """Metric names on /metrics, less prometheus-client's ``*_created`` timestamps (which the
    text parser reports as families of their own; vLLM's /metrics has them too)."""
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return {family.name for family in text_string_to_metric_families(text)
            if not family.name.endswith("_created")}


def _value(samples: dict[tuple, float], name: str, default: float | None = None,
           **labels: str) -> float:
    found = [v for (n, ls), v in samples.items()
             if n == name and all(dict(ls).get(k) == want for k, want in labels.items())]
    if not found and default is not None:
        return default
    assert len(found) == 1, (name, labels, found)
    return found[0]


def _le(buckets: list[float], x: float) -> str:
    """The ``le`` label of the bucket an observation ``x`` first falls into."""
    return str(float(next(b for b in buckets if x <= b)))


# --------------------------------------------------------------------------- /tokenize
@pytest.mark.parametrize("text", ["Hello world", "The meaning of life is", "naïve café, 東京 🙂",
                                  "  spaces\tand\nnewlines  ", ""])
def test_tokenize_prompt_is_the_tokenizer(vserver, tokenizer, text):
    r = _ok(vserver, "/tokenize", {"prompt": text, "model": vserver.model})
    ids = tokenizer.encode(text)
    assert r == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                 "token_strs": None}
    r = _ok(vserver, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                   "return_token_strs": True})
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert r["tokens"] == ids and r["count"] == len(ids)
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    # ...and back: /detokenize is the tokenizer's decode, and round-trips the text
    back = _ok(vserver, "/detokenize", {"tokens": r["tokens"], "model": vserver.model})
    assert back == {"prompt": tokenizer.decode(ids)}
    assert back["prompt"] == text


def test_tokenize_counts_what_generation_sees(vserver):
    client = vserver.client(api_key=KEY)
    prompt = "Once upon a time"
    count = _ok(vserver, "/tokenize", {"prompt": prompt})["count"]
    r = client.completions.create(model=vserver.model, prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens == count
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    count = _ok(vserver, "/tokenize", {"messages": messages})["count"]
    r = client.chat.completions.create(model=vserver.model, messages=messages, max_tokens=2)
    assert r.usage.prompt_tokens == count


def test_detokenize_any_ids(vserver, tokenizer):
    ids = [0, 1, 5, tokenizer.eos_token_id, 300, len(tokenizer) - 1]     # special tokens kept
    assert _ok(vserver, "/detokenize", {"tokens": ids}) == {"prompt": tokenizer.decode(ids)}
    assert _ok(vserver, "/detokenize", {"tokens": []}) == {"prompt": ""}


@pytest.mark.parametrize("options", [
    {},
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"chat_template_kwargs": {"unused_by_the_template": 1}, "return_token_strs": True},
])
def test_tokenize_chat_is_the_chat_template(vserver, tokenizer, options):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something."},
                {"role": "assistant", "content": "Well, "}]
    r = _ok(vserver, "/tokenize", {"messages": messages, **options})
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=options.get("add_generation_prompt", True),
        continue_final_message=options.get("continue_final_message", False),
        **options.get("chat_template_kwargs", {}))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert r["tokens"] == ids and r["count"] == len(ids)
    assert r["max_model_len"] == MAX_MODEL_LEN
    assert r["token_strs"] == (tokenizer.convert_ids_to_tokens(ids)
                               if options.get("return_token_strs") else None)
    if options.get("continue_final_message"):
        assert _ok(vserver, "/detokenize", {"tokens": ids})["prompt"].endswith("Well, ")


_CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [1, 2, 10 ** 6]}, 400, "tokens"),        # id out of range
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2 ** 70]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "two"]}, 400, "tokens.1"),            # wrong type
    ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
    ("/detokenize", {}, 400, "tokens"),                                  # missing field
    ("/detokenize", {"tokens": [1], "model": "gpt-17"}, 404, "model"),   # unknown model
    ("/detokenize", {"tokens": [1], "token": [1]}, 400, "token"),        # unknown field
    ("/tokenize", {}, 400, "prompt"),                                    # neither form
    ("/tokenize", {"model": "x"}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("/tokenize", {"messages": _CHAT, "model": "gpt-17"}, 404, "model"),
    ("/tokenize", {"prompt": ["x", "y"]}, 400, "prompt"),                # one string only
    ("/tokenize", {"prompt": "x", "add_special_token": False}, 400, "add_special_token"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
    # An unknown key is named whole, even one that looks like a union member's tag.
    ("/tokenize", {"messages": _CHAT, "a[0]": 1}, 400, "a[0]"),
    ("/tokenize", {"prompt": "x", "str": 1}, 400, "str"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/tokenize", {"messages": _CHAT, "continue_final_message": True}, 400,
     "continue_final_message"),                    # and add_generation_prompt (true by default)
    ("/tokenize", {"messages": _CHAT, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": _CHAT, "chat_template_kwargs": {"chat_template": "{{ 'PWN' }}"}},
     400, "chat_template_kwargs"),
    ("/tokenize", {"messages": _CHAT, "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
])
def test_bad_tokenizer_requests(vserver, path, body, status, param):
    r = _post(vserver, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert httpx.get(vserver.url + "/health").status_code == 200


def test_tokenizer_routes_need_the_api_key(vserver):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        for key in (None, "wrong"):
            r = _post(vserver, path, body, key=key)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert _post(vserver, path, body).status_code == 200
    assert httpx.get(vserver.url + "/metrics").status_code == 200         # stays open


# --------------------------------------------------------------------------- /metrics
def test_vllm_dashboard_series_after_one_completion(vserver, tokenizer):
    prompt, n_out = "The meaning of life is", 6
    n_prompt = len(tokenizer.encode(prompt))
    before = _scrape(vserver)
    r = vserver.client(api_key=KEY).completions.create(
        model=vserver.model, prompt=prompt, max_tokens=n_out, temperature=0,
        extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == n_out and r.choices[0].finish_reason == "length"
    after = _scrape(vserver)

    # Every series the dashboard queries is there, with vLLM's labels.
    present = {name for name, _ in after}
    missing = [s for s in DASHBOARD_SERIES if s not in present]
    assert not missing, missing
    for name, labels in after:
        assert name.startswith("vllm:"), name                 # nothing else on /metrics
        assert dict(labels)["model_name"] == vserver.model and dict(labels)["engine"] == "0"
    assert _families(vserver) == VLLM_FAMILIES

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    # Counters moved by exactly this request.
    assert delta("vllm:prompt_tokens_total") == n_prompt
    assert delta("vllm:generation_tokens_total") == n_out
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    for h in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds",
              "request_time_per_output_token_seconds", "request_prompt_tokens",
              "request_generation_tokens", "request_max_num_generation_tokens"):
        assert delta(f"vllm:{h}_count") == 1, h
        assert delta(f"vllm:{h}_bucket", le="+Inf") == 1, h
    assert delta("vllm:request_prompt_tokens_sum") == n_prompt
    assert delta("vllm:request_generation_tokens_sum") == n_out
    assert delta("vllm:request_max_num_generation_tokens_sum") == n_out
    # token-count histograms use 1-2-5 buckets up to max_model_len, like vLLM's
    buckets = [m * 10 ** e for e in range(4) for m in (1, 2, 5) if m * 10 ** e <= MAX_MODEL_LEN]
    les = {le for name, ls in after if name == "vllm:request_prompt_tokens_bucket"
           for k, le in ls if k == "le"}
    assert les == {str(float(b)) for b in buckets} | {"+Inf"}
    assert delta("vllm:request_prompt_tokens_bucket", le=_le(buckets, n_prompt)) == 1
    assert delta("vllm:request_generation_tokens_bucket", le=_le(buckets, n_out)) == 1
    assert delta("vllm:request_generation_tokens_bucket", le=_le(buckets, n_out - 1)) == 0

    # The timings are one request's timestamps, split the way vLLM splits them.
    queue, prefill, decode, inference, ttft, e2e, tpot = (delta(f"vllm:{h}_sum") for h in (
        "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "request_inference_time_seconds",
        "time_to_first_token_seconds", "e2e_request_latency_seconds",
        "request_time_per_output_token_seconds"))
    assert min(queue, prefill, decode, inference, ttft, e2e, tpot) >= 0
    assert decode > 0
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert ttft == pytest.approx(queue + prefill, abs=1e-6)
    assert tpot == pytest.approx(decode / (n_out - 1), rel=1e-6)
    # Inter-token gaps: one per token arrival after the first; together they are the decode.
    assert 1 <= delta("vllm:inter_token_latency_seconds_count") <= n_out - 1
    assert delta("vllm:inter_token_latency_seconds_sum") == pytest.approx(decode, abs=1e-6)
    assert e2e >= max(ttft, queue + inference) - 1e-6

    # Tokens per engine step, from the engine's StepStats records: the prompt in one step,
    # then one decode step per token but the last; vLLM's buckets up to max_num_batched_tokens.
    assert delta("vllm:iteration_tokens_total_count") == n_out
    assert delta("vllm:iteration_tokens_total_sum") == n_prompt + n_out - 1
    les = {le for name, ls in after if name == "vllm:iteration_tokens_total_bucket"
           for k, le in ls if k == "le"}
    assert les == {str(float(b)) for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)} | \
        {"+Inf"}

    # The gauges read the engine: idle again, and its KV pool whole.
    assert _value(after, "vllm:num_requests_running") == 0
    assert _value(after, "vllm:num_requests_waiting") == 0
    assert _value(after, "vllm:kv_cache_usage_perc") == 0


def test_default_prefix_names_unchanged(dserver):
    client = dserver.client()
    before = _scrape(dserver)
    client.completions.create(model=dserver.model, prompt="Hello", max_tokens=3,
                              extra_body={"ignore_eos": True})
    after = _scrape(dserver)
    assert _families(dserver) == CORELLM_FAMILIES
    assert not any(name.startswith("vllm:") for name, _ in after)
    for name, labels in after:
        assert set(dict(labels)) <= {"model_name", "finished_reason", "reason", "stream",
                                     "le"}, \
            (name, labels)
    for name, moved in (("corellm:generation_tokens_total", 3),
                        ("corellm:e2e_request_latency_seconds_count", 1),
                        ("corellm:request_success_total", 1)):
        assert _value(after, name) - _value(before, name, default=0) == moved, name
    # no key on this server: the tokenizer routes are open, like /v1
    assert _post(dserver, "/tokenize", {"prompt": "x"}, key=None).status_code == 200


def test_metrics_prefix_option():
    from pydantic import ValidationError

    from corellm_plugins.frontend_openai.metrics import EngineMetrics
    from corellm_plugins.frontend_openai.options import OpenAIServerOptions

    assert OpenAIServerOptions().metrics_prefix == "corellm"
    assert OpenAIServerOptions(metrics_prefix="vllm").metrics_prefix == "vllm"
    with pytest.raises(ValidationError, match="metrics_prefix"):
        OpenAIServerOptions(metrics_prefix="prometheus")
    with pytest.raises(ValueError, match="prefix"):
        EngineMetrics(None, "m", prefix="prometheus")
