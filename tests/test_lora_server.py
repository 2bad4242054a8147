"""Multi-LoRA through the OpenAI server, with the official ``openai`` client: the adapter chosen
by ``model``, ``/v1/models`` listing adapters under their base, vLLM's load and unload routes
(behind the API key, only from the allowed directories), 404 after an unload."""

from __future__ import annotations

import httpx
import openai
import pytest

from corellm import LLM, LoRARequest, SamplingParams
from tests.conftest import engine_config
from tests.test_lora import make_adapter
from tests.test_server import Server

pytest.importorskip("peft")

KEY = "lora-test-key"


@pytest.fixture(scope="module")
def adapters(llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-srv")
    allowed = root / "allowed"
    sql = make_adapter(llama_path, allowed / "sql", 8, 16, ["q_proj", "v_proj"], False, seed=21)
    chat = make_adapter(llama_path, allowed / "chat", 4, 8, ["gate_proj", "down_proj"], False,
                        seed=22)
    outside = make_adapter(llama_path, root / "outside", 4, 8, ["q_proj"], False, seed=23)
    return root, allowed, sql, chat, outside


def _config(llama_path, adapters) -> dict:
    _, allowed, sql, _, _ = adapters
    cfg = engine_config(llama_path, model={"max_model_len": 256})
    cfg["lora"] = {"enable": True, "max_loras": 2, "max_lora_rank": 8,
                   "modules": {"sql": str(sql)}}
    cfg["frontend"] = {"name": "openai", "api_key": KEY, "allow_runtime_lora_updating": True,
                       "allowed_lora_paths": [str(allowed)]}
    return cfg


@pytest.fixture(scope="module")
def server(llama_path, adapters, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("lora-server"), _config(llama_path, adapters))
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


def _offline(llama_path, adapters, prompt: list[int], lora: LoRARequest | None) -> str:
    llm = LLM(_config(llama_path, adapters) | {"frontend": None})
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0),
                       lora_request=lora, use_tqdm=False)
    return out[0].outputs[0].text


def _post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_adapters_through_the_openai_client(server, adapters, llama_path):
    root, allowed, sql, chat, outside = adapters
    client = server.client(api_key=KEY)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {server.model, "sql"}
    assert cards["sql"].model_extra["parent"] == server.model
    assert cards[server.model].model_extra["parent"] is None

    prompt = [5, 17, 300, 42, 7, 99]
    base = client.completions.create(model=server.model, prompt=prompt, max_tokens=8,
                                     temperature=0).choices[0].text
    with_sql = client.completions.create(model="sql", prompt=prompt, max_tokens=8,
                                         temperature=0).choices[0].text
    assert base == _offline(llama_path, adapters, prompt, None)
    assert with_sql == _offline(llama_path, adapters, prompt,
                                LoRARequest("sql", 1, str(sql)))
    assert with_sql != base

    # load at run time: key required, inside the allowed directory only, names unique
    body = {"lora_name": "chat", "lora_path": str(chat)}
    assert _post(server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    r = _post(server, "/v1/load_lora_adapter",
              {"lora_name": "evil", "lora_path": str(allowed / ".." / "outside")})
    assert r.status_code == 400 and "not under a directory" in r.text, r.text
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(chat)})
    assert r.status_code == 400 and "already served" in r.text, r.text
    r = httpx.post(server.url + "/v1/load_lora_adapter", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}",
                            "content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.text, r.text
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "missing",
                                                "lora_path": str(allowed / "nope")})
    assert r.status_code == 400 and "no such directory" in r.text, r.text
    r = _post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {server.model, "sql", "chat"}
    chat_text = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0).choices[0].message.content
    assert isinstance(chat_text, str)
    stream = client.completions.create(model="chat", prompt=prompt, max_tokens=8,
                                       temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in stream)
    assert streamed == _offline(llama_path, adapters, prompt, LoRARequest("chat", 2, str(chat)))

    # unload while a request runs on the adapter: the name goes, the request finishes with it
    long = client.completions.create(model="chat", prompt=prompt, max_tokens=24, temperature=0,
                                     stream=True)
    first = next(iter(long)).choices[0].text            # it is running
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert r.status_code == 200, r.text
    rest = "".join(c.choices[0].text for c in long)
    chat_lora = LoRARequest("chat", 2, str(chat))
    llm = LLM(_config(llama_path, adapters) | {"frontend": None})
    want = llm.generate({"prompt_token_ids": prompt},
                        SamplingParams(max_tokens=24, temperature=0), lora_request=chat_lora,
                        use_tqdm=False)[0].outputs[0].text
    llm.shutdown()
    assert first + rest == want
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt=prompt, max_tokens=4)
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert r.status_code == 404
    assert {m.id for m in client.models.list().data} == {server.model, "sql"}
    # the engine is whole, and /metrics has vLLM's lora_requests_info
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'corellm:lora_requests_info{max_lora="2"' in metrics, metrics[-2000:]
    assert "corellm:lora_requests_running" in metrics


def test_a_bad_lora_module_stops_the_server_naming_it(llama_path, adapters, tmp_path):
    cfg = _config(llama_path, adapters)
    cfg["lora"]["modules"] = {"broken": str(tmp_path / "nothing-here")}
    with pytest.raises(RuntimeError, match="lora.modules.broken"):
        Server(tmp_path, cfg)


def test_lora_modules_flag_forms():
    from corellm.cli.commands import _lora_modules
    from corellm.errors import ConfigError
    assert _lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == {"a": "/x", "b": "/y"}
    for bad in ("noequals", "=/x", '{"name": "c"}'):
        with pytest.raises(ConfigError, match="--lora-modules"):
            _lora_modules([bad])


def test_runtime_loading_is_off_unless_allowed(llama_path, adapters, monkeypatch):
    """Without frontend.allow_runtime_lora_updating (or vLLM's environment variable) the routes
    answer 404; the variable turns them on as vLLM reads it."""
    from types import SimpleNamespace

    from corellm.config import load_config
    from corellm_plugins.frontend_openai.errors import APIError
    from corellm_plugins.frontend_openai.lora import LoRAAdapters, runtime_updating_allowed
    _, allowed, _, chat, _ = adapters
    config = load_config({"model": {"path": str(llama_path)}, "lora": {"enable": True}})
    engine = SimpleNamespace(config=config, processor=SimpleNamespace(check_lora=lambda _: None))
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    off = LoRAAdapters(engine, "base", [str(allowed)], runtime_updating_allowed(False))
    with pytest.raises(APIError) as exc:
        off.load({"lora_name": "chat", "lora_path": str(chat)})
    assert exc.value.status == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    on = LoRAAdapters(engine, "base", [str(allowed)], runtime_updating_allowed(False))
    assert "added" in on.load({"lora_name": "chat", "lora_path": str(chat)})
    assert on.resolve("chat").lora_path == str(chat.resolve())
    # a directory inside the allowed one whose files link outside it
    linked = allowed / "linked"
    linked.mkdir()
    outside = adapters[4]
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (linked / f).symlink_to(outside / f)
    with pytest.raises(APIError, match="not under a directory"):
        on.load({"lora_name": "linked", "lora_path": str(linked)})
