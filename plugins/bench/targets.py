"""What a benchmark run measures, how, and what it returns.

``Target`` names what a run measures (an in-process engine from a config, a running server, or a
server started here), ``RunOptions`` how, and ``RunResult`` what one run of one workload against
one target recorded, with ``COUNTERS``, the engine counters under one name whichever target
reported them. ``prepare_configs`` reads every target's config and validates it before the
first run. Also the model a target's config names: its tokenizer directory, context length and
the token ids random prompts are drawn from.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .metrics import (DEFAULT_PERCENTILES, LATENCY_METRICS, RequestRecord,
                      by_priority, by_tenant, summarize, vllm_request_lists)


# Engine counters under one name per quantity, whichever target reported them:
# name -> (EngineStats attribute, Prometheus counter without the "corellm:" prefix).
COUNTERS: dict[str, tuple[str, str | None]] = {
    "num_preemptions": ("num_preemptions", "num_preemptions_total"),
    "prefix_cache_queries": ("prefix_cache_queries", "prefix_cache_queries_total"),
    "prefix_cache_hits": ("prefix_cache_hits", "prefix_cache_hits_total"),
    "prompt_tokens": ("num_prompt_tokens", "prompt_tokens_total"),
    "generation_tokens": ("num_generation_tokens", "generation_tokens_total"),
    "engine_steps": ("num_steps", "engine_steps_total"),
    "prefill_tokens": ("num_prefill_tokens", None),
}


# ----------------------------------------------------------------------------- targets
@dataclass
class Target:
    """What a run measures. ``config``: a config file path (or a dict) for an in-process
    engine, or for the server started here when ``start_server``; ``url``: a running server.
    ``source``: the file a dict ``config`` was read from before ``--set`` or ``--sweep``
    changed it, named in its errors (``named``)."""

    label: str
    config: str | Path | Mapping[str, Any] | None = None
    url: str | None = None
    start_server: bool = False
    source: str | None = None

    def __post_init__(self) -> None:
        if self.url is not None and (self.config is not None or self.start_server):
            raise ValueError(f"target {self.label!r}: give a url or a config, not both")

    @property
    def kind(self) -> str:
        if self.url is not None:
            return "server"
        return "started-server" if self.start_server else "engine"

    @property
    def config_file(self) -> str | None:
        """The file this target's config comes from: the path it was given, or ``source``;
        None for a dict given as it is, the default config and a server."""
        if self.config is None or isinstance(self.config, Mapping):
            return self.source
        return str(self.config)

    def named(self) -> str:
        """The target as its errors name it: ``target 'b' (b.yaml)``, ``target 'demo' (the
        default config)``, ``target 'x'`` for a config given as a dict."""
        where = self.config_file or ("the default config" if self.config is None and
                                     self.url is None else None)
        return f"target {self.label!r}" + (f" ({where})" if where else "")

    def describe(self) -> dict[str, Any]:
        """The target for result files: its label, kind and the config it ran with."""
        out: dict[str, Any] = {"label": self.label, "kind": self.kind, "url": self.url}
        if isinstance(self.config, Mapping):
            out.update(config_file=None, config=dict(self.config))
        elif self.config is not None:
            from corellm.config import read_config_file
            out.update(config_file=str(self.config), config=read_config_file(self.config))
        else:
            out.update(config_file=None, config=None if self.url else {})
        return out


def parse_target(text: str, kind: str) -> tuple[str | None, str]:
    """``NAME=VALUE`` -> (NAME, VALUE); a bare VALUE -> (None, VALUE). For configs an existing
    file named with '=' stays whole; for URLs the label is what precedes '=' before '://'."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        return None, text
    if kind == "url" and "://" in name:
        return None, text
    if kind == "config" and Path(text).exists():
        return None, text
    return name, value


def default_label(value: str, kind: str) -> str:
    if kind == "url":
        return re.sub(r"^[a-z]+://", "", value).rstrip("/")
    return Path(value).stem


def unique_labels(labels: Sequence[str]) -> list[str]:
    """Labels made distinct (``a``, ``a-2``) so every column of a table names one target."""
    seen: collections.Counter[str] = collections.Counter()
    out = []
    for label in labels:
        seen[label] += 1
        out.append(label if seen[label] == 1 else f"{label}-{seen[label]}")
    return out


@dataclass
class RunOptions:
    temperature: float = 0.0
    warmup_requests: int = 1           # untimed requests sent at once before each run
    warmup_output_len: int = 16
    max_concurrency: int | None = None
    request_timeout: float = 600.0     # seconds per server request
    server_timeout: float = 300.0      # seconds for a started server to become ready
    progress: bool = True              # a tqdm bar on stderr per run
    server_log: str | None = None      # where a started server's output goes
    keep_outputs: bool = False         # keep each request's output ids (offline) / text (server)


@dataclass
class RunResult:
    """One run of one workload against one target."""

    target: str
    repeat: int
    seed: int | None
    records: list[RequestRecord]
    duration: float                                   # run start to last response, seconds
    counters: dict[str, float] | None = None          # engine counters over the run (deltas)
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self, *, goodput: Mapping[str, float] | None = None,
                percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                metrics: Sequence[str] = LATENCY_METRICS) -> dict[str, Any]:
        """vLLM-named aggregates, with the engine's own preemption and prefix-cache counts
        (over the whole run) where the target reported them."""
        return self._with_counters(summarize(self.records, self.duration, goodput=goodput,
                                             percentiles=percentiles, metrics=metrics))

    def _with_counters(self, summary: dict[str, Any]) -> dict[str, Any]:
        out = dict(summary)
        c = self.counters or {}
        if "num_preemptions" in c:
            out["num_preemptions"] = int(c["num_preemptions"])
        if c.get("prefix_cache_queries"):
            out["prefix_cache_hit_rate"] = c["prefix_cache_hits"] / c["prefix_cache_queries"]
        return out

    def to_json(self, *, goodput: Mapping[str, float] | None = None,
                percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                metrics: Sequence[str] = LATENCY_METRICS,
                detailed: bool = True) -> dict[str, Any]:
        """The run's summary, per class too; with ``detailed``, also every request's record
        and vLLM's per-request lists (what a saved result or a plot needs, and most of the
        cost of a large run's report)."""
        kw = dict(goodput=goodput, percentiles=percentiles, metrics=metrics)
        overall = summarize(self.records, self.duration, **kw)

        def per_class(groups: Mapping[str, list[RequestRecord]]) -> dict[str, Any]:
            # One class holding every request (in the same order) has the run's summary.
            if len(groups) == 1 and len(next(iter(groups.values()))) == len(self.records):
                return {k: dict(overall) for k in groups}
            return {k: summarize(v, self.duration, **kw) for k, v in groups.items()}

        out: dict[str, Any] = {"target": self.target, "repeat": self.repeat, "seed": self.seed,
                               **self._with_counters(overall)}
        out["engine_counters"] = self.counters
        out["per_priority"] = per_class(by_priority(self.records))
        out["per_tenant"] = per_class(by_tenant(self.records))
        out["info"] = self.info
        if detailed:
            out.update(vllm_request_lists(self.records))
            out["requests"] = [r.to_json() for r in self.records]
        return out


# --------------------------------------------------------------- the model a config names
def config_data(config: str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    """A target's config as a dict: a copy of a mapping, a file read, or {} (the default)."""
    from corellm.config import read_config_file

    if isinstance(config, Mapping):
        return dict(config)
    return read_config_file(config) if config is not None else {}


def prepare_configs(targets: Sequence[Target], overrides: Sequence[tuple[str, Any]] = (), *,
                    validate: bool = True) -> list[Target]:
    """The targets with their configs read, ``overrides`` (``--set``, parsed) applied (a dict
    from then on, its file kept as ``source``) and, with ``validate``, each validated as its
    engine will validate it, before anything runs: a misspelt key in the last config stops the
    benchmark at once, not after every other target's runs. Every problem of every target is
    reported in one ``ConfigError``, each at ``target 'b' (b.yaml): key.path``. A running server
    (``--url``) has no config here and is left as it is, or refused when there are overrides.
    ``validate=False`` for a sweep, which validates each of its points instead (a base config
    may be valid only with the swept key set), but still reads every file here."""
    from corellm.config import apply_overrides, load_config
    from corellm.errors import ConfigError

    if overrides:
        urls = [t.label for t in targets if t.url is not None]
        if urls:
            raise ConfigError([("--set", f"target {urls[0]!r} is a running server (--url), "
                                         "whose config cannot be changed from here")])
    out: list[Target] = []
    problems: list[tuple[str, str]] = []
    for target in targets:
        if target.url is not None:
            out.append(target)
            continue
        where = target.named()          # before --set makes the default config a dict
        try:
            data = config_data(target.config)
            if overrides:
                data = apply_overrides(data, list(overrides))
                target = Target(target.label, config=data, start_server=target.start_server,
                                source=target.config_file)
            if validate:
                load_config(data)
        except ConfigError as exc:
            problems += [(f"{where}: {path}" if path else where, msg)
                         for path, msg in exc.problems]
        out.append(target)
    if problems:
        raise ConfigError(problems)
    return out


def config_model_dir(config: str | Path | Mapping[str, Any] | None, *,
                     tokenizer: bool = True) -> Path:
    """The tokenizer (or, ``tokenizer=False``, checkpoint) a config names: a directory or a GGUF
    file; without one, the default model's (``corellm.checkpoint.demo.default_model``: the random
    demo is built only when it is the model that runs)."""
    model = config_data(config).get("model") or {}
    path = (tokenizer and model.get("tokenizer")) or model.get("path")
    if path:
        return Path(path)
    from corellm.checkpoint.demo import default_model
    return default_model()[0]


def config_max_model_len(config: str | Path | Mapping[str, Any] | None) -> int | None:
    """The context a config's engine will have: ``model.max_model_len``, else the checkpoint's
    ``max_position_embeddings``; None when neither says."""
    model = config_data(config).get("model") or {}
    if model.get("max_model_len"):
        return int(model["max_model_len"])
    cfg_file = config_model_dir(config, tokenizer=False) / "config.json"
    if not cfg_file.exists():
        return None
    cfg = json.loads(cfg_file.read_text())
    value = cfg.get("text_config", cfg).get("max_position_embeddings")
    return int(value) if value else None


# Tokenizers loaded here, by directory: an in-process engine target of the same model is
# given the one that drew its prompts instead of loading it again.
_tokenizers: dict[str, Any] = {}
_token_spaces: set[str] = set()        # directories prompt_token_space was asked about


def loaded_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of ``model_dir`` if ``prompt_token_space`` was asked for it (loaded now if
    it was not yet: once per directory, whatever the number of targets and repeats), else
    None."""
    if str(model_dir) in _tokenizers or str(model_dir) in _token_spaces:
        return _load_tokenizer(str(model_dir))
    return None


def _load_tokenizer(model_dir: str) -> Any:
    from corellm.engine.llm import load_tokenizer

    tok = _tokenizers.get(model_dir)
    if tok is None:
        tok = _tokenizers[model_dir] = load_tokenizer(model_dir)
    return tok


class LazyTokenizer:
    """The tokenizer of ``model_dir``, loaded (through transformers) at its first use: a run
    that draws its prompts as token ids against targets that need no tokenizer (the simulator)
    never pays the second transformers takes to import."""

    def __init__(self, model_dir: str | Path) -> None:
        self._model_dir = str(model_dir)

    def load(self) -> Any:
        """The tokenizer itself (loaded now if it was not yet)."""
        return _load_tokenizer(self._model_dir)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):        # copy and pickle probe before __init__ ran
            raise AttributeError(name)
        return getattr(_load_tokenizer(self._model_dir), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _load_tokenizer(self._model_dir)(*args, **kwargs)

    def __len__(self) -> int:
        return len(_load_tokenizer(self._model_dir))


def _plain_token_space(model_dir: str | Path) -> tuple[int, set[int]] | None:
    """``len(tokenizer)`` and its bos/eos/pad ids read with the Rust ``tokenizers`` library
    alone, for a tokenizer that transformers loads as that library's file plus the special
    tokens its ``tokenizer_config.json`` names (what ``load_tokenizer`` loads directly); None
    for any other kind, which is loaded whole."""
    from corellm.engine.llm import plain_fast_tokenizer_name
    from corellm.checkpoint.reader import tokenizer_path

    local = tokenizer_path(str(model_dir))
    if not plain_fast_tokenizer_name(local) or (local / "special_tokens_map.json").exists():
        return None
    from tokenizers import Tokenizer

    cfg = json.loads((local / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(local / "tokenizer.json"))
    special = set()
    for key in ("bos_token", "eos_token", "pad_token"):
        token = cfg.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token is None:
            continue
        if not isinstance(token, str):
            return None
        tid = tok.token_to_id(token)
        if tid is None:             # transformers would add it, with an id of its own
            return None
        special.add(tid)
    return tok.get_vocab_size(with_added_tokens=True), special


def prompt_token_space(model_dir: str | Path) -> tuple[Any, int, set[int]]:
    """The tokenizer, the vocabulary to draw random prompts from (what both the model and its
    tokenizer know) and the ids to leave out (bos/eos/pad would change the meaning of a random
    prompt for no benchmark benefit). The tokenizer is a ``LazyTokenizer`` where the other two
    could be read without it."""
    _token_spaces.add(str(model_dir))
    plain = None if str(model_dir) in _tokenizers else _plain_token_space(model_dir)
    if plain is None:
        tok = _load_tokenizer(str(model_dir))
        vocab = len(tok)
        special = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} - {None}
    else:
        tok = LazyTokenizer(model_dir)
        vocab, special = plain
    cfg_file = Path(model_dir) / "config.json"
    if cfg_file.exists():
        cfg = json.loads(cfg_file.read_text())
        vocab = min(vocab, cfg.get("text_config", cfg).get("vocab_size", vocab))
    return tok, vocab, special
