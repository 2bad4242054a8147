"""The configuration's shape: ``EngineConfig`` and the core's own sections (``model``,
``parallel``, ``plugins``), typed over each plugin section's base options, plus reading config
files and applying ``--set KEY=VALUE`` overrides.

No plugin is consulted here. ``corellm.config.load_config`` composes a config with the selected
plugins' options models (it needs the registry) and re-exports everything public in this module.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator

from corellm.errors import ConfigError
from corellm.specs import (AttentionOptions, ComponentOptions, CoreLauncherOptions, DType,
                           ExecutorOptions, FrontendOptions, KVCacheOptions, PlatformOptions,
                           SamplerOptions,
                           SchedulerOptions)

# Keys of the model section that moved to the platform section in 0.4 and were removed in 0.6:
# old key -> the platform option that replaced it (refused naming it).
REMOVED_MODEL_KEYS: dict[str, str] = {
    "device": "name", "cpu_weight_packing": "weight_packing", "cpu_fused_ops": "fused_ops"}


class ModelConfig(BaseModel):
    """The ``model`` section (owned by the core: the model plugin is chosen by the checkpoint)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        None, description="Hugging Face checkpoint directory (config.json + safetensors). "
                          "Absent: the built-in demo model.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: model.path.")
    dtype: DType = Field("auto", description="Weights and activations dtype; auto = the "
                                             "checkpoint's, float32 for float16 on CPU.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output; default: the checkpoint's "
                                "max_position_embeddings.")
    seed: int = Field(0, description="Seed of the random stream of unseeded sampling.")
    quantization: Literal["gguf", "none", "int8"] | None = Field(
        None, description="How linear layers keep their weights: gguf = in the GGUF file's "
                          "quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; other types "
                          "dequantized), none = dequantized to model.dtype, int8 = weight-only "
                          "int8 per output channel, quantized at load. Absent: gguf for a GGUF "
                          "file, none otherwise.")
    implementation: str | None = Field(
        None, description="The model implementation to run: a model (ModelSpec) name from "
                          "`corellm plugins`, qualified as distribution:name when two share "
                          "it. Absent: the one implementing the checkpoint's architecture (an "
                          "installed plugin over a built-in one).")

    @field_validator("path", "tokenizer")
    @classmethod
    def _expand_user(cls, value: str | None) -> str | None:
        return None if value is None else os.path.expanduser(value)


class ParallelConfig(BaseModel):
    """The ``parallel`` section (owned by the core: the executor, the model factory and the
    sharded layers all read it, through the workers'
    ``corellm.platforms.distributed.ParallelContext``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks the model is sharded across (attention heads, MLP, "
                             "vocabulary); needs an executor that runs that many workers.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto = nccl on CUDA, gloo on CPU.")
    init_method: str = Field(
        "tcp://127.0.0.1:0",
        description="Rendezvous of the ranks: tcp://HOST:PORT (port 0 = a free one) for the "
                    "workers an executor spawns on this machine, or env:// for processes "
                    "started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), on one "
                    "machine or many.")
    timeout_s: float = Field(
        60.0, gt=0, description="A collective (or the rendezvous) waiting longer than this "
                                "fails the step instead of hanging.")
    data_parallel_size: int = Field(
        1, ge=1, description="Engine replicas behind one server (corellm serve), each with the "
                             "whole model (and its own tensor_parallel_size ranks); the server "
                             "routes each request to one.")
    cpu_affinity: list[int] | None = Field(
        None, description="The CPUs the engine-core process (and its workers) may use; a "
                          "data-parallel server gives each CPU replica its share of its own.")
    device_ids: list[int] | None = Field(
        None, description="The devices of this machine an engine-core process and its ranks "
                          "use (indices into those this process sees; rank r on the r-th), on "
                          "a platform with a device per rank; a data-parallel server gives "
                          "each replica on this machine its own tensor_parallel_size of them. "
                          "Applied where a core process starts (the mp core launcher).")

    @field_validator("device_ids")
    @classmethod
    def _check_device_ids(cls, value: list[int] | None, info: Any) -> list[int] | None:
        size = info.data.get("tensor_parallel_size", 1)
        if value is not None and (len(value) != size or len(set(value)) != len(value)
                                  or min(value) < 0):
            raise ValueError(f"expected {size} distinct device indices (one per rank of "
                             f"tensor_parallel_size {size}), got {value}")
        return value

    @field_validator("init_method")
    @classmethod
    def _check_init_method(cls, value: str) -> str:
        if value != "env://" and not re.fullmatch(r"tcp://[^:/]+:\d+", value):
            raise ValueError("expected tcp://HOST:PORT or env://")
        return value

    @property
    def external_launcher(self) -> bool:
        """The ranks are processes some launcher (torchrun) started, not the executor."""
        return self.init_method == "env://"


class PluginsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    disable: list[str] = Field(default_factory=list,
                               description="Plugins not to load: entry-point names, or "
                                           "distribution:entry_point for one distribution's.")


class LogitsProcessorsConfig(BaseModel):
    """The ``logits_processors`` section (owned by the core: several processors may be on at
    once, each constraining only the requests that ask for it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable: list[str] | None = Field(
        None, description="Logits processors to use, by name (`corellm plugins` lists them; "
                          "distribution:name picks one of two). Absent: every available one. "
                          "[] turns them all off (requests asking for structured outputs are "
                          "then refused).")
    compile_timeout_s: float = Field(
        10.0, gt=0, description="A request whose constraint (a structured-output grammar) is "
                                "not compiled against the vocabulary this long after it reached "
                                "the worker ends with an error naming the constraint (a 400 "
                                "from the server); the compile runs in a child process, killed "
                                "then.")
    cache_bytes: int = Field(
        64 << 20, ge=0, description="Compiled constraints kept for reuse, bounded by their "
                                     "size in bytes (keys included).")


class LoRAConfig(BaseModel):
    """The ``lora`` section (owned by the core: the scheduler, the workers and the front end all
    read it): serving LoRA adapters over the base model (``docs/lora.md``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable: bool = Field(False, description="Serve LoRA adapters (vLLM's --enable-lora): every "
                                            "linear layer gets max_loras adapter slots.")
    max_loras: int = Field(1, ge=1, description="Adapters on the device at once: the distinct "
                                                "adapters one step can mix.")
    max_lora_rank: int = Field(16, ge=1, description="The largest adapter rank accepted (the "
                                                     "slots' width).")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters kept in host memory, least recently used evicted; "
                                "default: max_loras.")
    modules: dict[str, str] = Field(
        default_factory=dict, description="Adapters served from the start, name -> PEFT "
                                          "directory (vLLM's --lora-modules name=path).")

    @field_validator("max_cpu_loras")
    @classmethod
    def _at_least_max_loras(cls, value: int | None, info: Any) -> int | None:
        max_loras = info.data.get("max_loras", 1)
        if value is not None and value < max_loras:
            raise ValueError(f"must be at least max_loras ({max_loras})")
        return value

    @field_validator("modules")
    @classmethod
    def _modules_need_enable(cls, value: dict[str, str], info: Any) -> dict[str, str]:
        if value and not info.data.get("enable"):
            raise ValueError("serving adapters needs lora.enable: true (--enable-lora)")
        return value

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


class EngineConfig(BaseModel):
    """The whole engine configuration. Build it with ``load_config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    # Resolved when the config is loaded: ``auto`` never survives load_config.
    platform: SerializeAsAny[PlatformOptions] = Field(default_factory=PlatformOptions)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    scheduler: SerializeAsAny[SchedulerOptions] = Field(default_factory=SchedulerOptions)
    kv_cache: SerializeAsAny[KVCacheOptions] = Field(default_factory=KVCacheOptions)
    attention: SerializeAsAny[AttentionOptions] = Field(default_factory=AttentionOptions)
    executor: SerializeAsAny[ExecutorOptions] = Field(default_factory=ExecutorOptions)
    sampler: SerializeAsAny[SamplerOptions] = Field(default_factory=SamplerOptions)
    frontend: SerializeAsAny[FrontendOptions] | None = None
    core_launcher: SerializeAsAny[CoreLauncherOptions] = Field(
        default_factory=CoreLauncherOptions)
    logits_processors: LogitsProcessorsConfig = Field(default_factory=LogitsProcessorsConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)

    def to_dict(self) -> dict[str, Any]:
        # serialize_as_any: a wrapper's delegate is declared as the section's base options but
        # holds the delegate's own options object, whose fields belong in the dump.
        return self.model_dump(mode="json", exclude_none=True, serialize_as_any=True)


PLUGIN_SECTIONS: dict[str, type[ComponentOptions]] = {
    "platform": PlatformOptions,
    "scheduler": SchedulerOptions, "kv_cache": KVCacheOptions, "attention": AttentionOptions,
    "executor": ExecutorOptions, "sampler": SamplerOptions, "frontend": FrontendOptions,
    "core_launcher": CoreLauncherOptions,
}
SECTIONS = ["model", "platform", "parallel", *(s for s in PLUGIN_SECTIONS if s != "platform"),
            "logits_processors", "lora", "plugins"]


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML, TOML or JSON file into a dict, with errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([("", f"config file {str(path)!r} does not exist")])
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError([("", f"cannot parse: {exc}")], source=str(path)) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"top level must be a mapping, got {type(data).__name__}")],
                          source=str(path))
    return data


_RADIX_INT = re.compile(r"[-+]?(0[0-9_]+|0[xXoObB][0-9a-fA-F_]+)")


def parse_override(text: str) -> tuple[str, Any]:
    """``"scheduler.max_num_seqs=32"`` -> ``("scheduler.max_num_seqs", 32)``.

    The value is read as YAML, as in a config file: ``32`` is an int, ``true`` a bool, ``null``
    None, ``[a, b]`` a list; quote it (``'"32"'``) to keep a string.
    """
    key, eq, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not eq or not key or any(not p for p in parts):
        raise ConfigError([("--set", f"{text!r}: expected KEY=VALUE with a dotted key, e.g. "
                                     "scheduler.max_num_seqs=32")])
    try:
        # YAML 1.1 reads 010 as 8 and 0x10 as 16; on a command line that is a trap: keep such
        # values as text (an int option then reads "010" as 10).
        value = raw.strip() if _RADIX_INT.fullmatch(raw.strip()) else (
            yaml.safe_load(raw) if raw.strip() else "")
    except yaml.YAMLError as exc:
        raise ConfigError([(key, f"--set value {raw!r} is not valid YAML: {exc}")]) from None
    return key, value


# vLLM's engine arguments for the common settings (``LLM(max_num_seqs=...)`` offline, the same
# names as flags of ``corellm serve``: ``--max-num-seqs``), each mapped onto the config key it
# sets. name -> (config key, type, help)
ENGINE_ARGS: dict[str, tuple[str, type, str]] = {
    "max_model_len": ("model.max_model_len", int,
                      "longest prompt + output (default: the checkpoint's)"),
    "max_num_seqs": ("scheduler.max_num_seqs", int, "most requests running at once"),
    "max_num_batched_tokens": ("scheduler.max_num_batched_tokens", int,
                               "token budget of one step"),
    "block_size": ("kv_cache.block_size", int, "tokens per KV block"),
    "tensor_parallel_size": ("parallel.tensor_parallel_size", int,
                             "ranks the model is sharded across (with executor.name: multiproc)"),
    "distributed_executor_backend": ("executor.name", str,
                                     "what runs the ranks: mp (multiproc), ray, uni (uniproc), "
                                     "or any executor plugin's name"),
    "data_parallel_size": ("parallel.data_parallel_size", int,
                           "engine replicas behind one server (corellm serve)"),
    "data_parallel_backend": ("core_launcher.name", str,
                              "where each engine core (replica) runs: mp (a process here), ray "
                              "(a Ray actor in a cluster), or any core launcher plugin's name"),
    "seed": ("model.seed", int, "seed of the random stream of unseeded sampling"),
    "quantization": ("model.quantization", str,
                     "gguf (a GGUF file's blocks, its default), none (dequantize) or int8 "
                     "(weight-only, quantized at load)"),
    "async_scheduling": ("scheduler.async_scheduling", bool,
                         "overlap steps: plan step N+1 while step N runs"),
    "enable_lora": ("lora.enable", bool, "serve LoRA adapters"),
    "max_loras": ("lora.max_loras", int, "adapters on the device at once"),
    "max_lora_rank": ("lora.max_lora_rank", int, "the largest adapter rank accepted"),
    "max_cpu_loras": ("lora.max_cpu_loras", int, "adapters kept in host memory"),
}
# vLLM's dtype spellings -> corellm's.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16",
                 "fp32": "float32"}
# vLLM's executor backend spellings -> corellm's executor names.
EXECUTOR_ALIASES = {"mp": "multiproc", "uni": "uniproc"}
DTYPES = ("auto", "float32", "bfloat16", "float16", *DTYPE_ALIASES)


def engine_arg_overrides(args: Mapping[str, Any], what: str = "LLM()") -> list[tuple[str, Any]]:
    """(config key, value) for vLLM's engine arguments (``ENGINE_ARGS``, ``dtype``,
    ``enable_prefix_caching``); an unknown name is a ``TypeError`` naming the closest known
    one, as Python's for an unexpected keyword argument."""
    import difflib

    known = [*ENGINE_ARGS, "dtype", "enable_prefix_caching"]
    overrides: list[tuple[str, Any]] = []
    for name, value in args.items():
        if value is None and name in known:
            continue                        # vLLM's "the default"
        if name == "dtype":
            overrides.append(("model.dtype", DTYPE_ALIASES.get(value, value)))
        elif name == "distributed_executor_backend":
            overrides.append(("executor.name", EXECUTOR_ALIASES.get(value, value)))
        elif name == "enable_prefix_caching":
            overrides.append(("kv_cache.enable_prefix_caching", value))
        elif name in ENGINE_ARGS:
            overrides.append((ENGINE_ARGS[name][0], value))
        else:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else \
                f" (engine arguments: {', '.join(sorted(known))}; any config key: the config)"
            raise TypeError(f"{what} got an unexpected keyword argument {name!r}{hint}")
    return overrides


def apply_overrides(data: Mapping[str, Any], overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of ``data`` with each dotted key set, in order (later ones win). Intermediate
    sections are created; the result is validated by ``load_config`` like any file."""
    out = _deep_copy(data)
    for key, value in overrides:
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError([(".".join(parts[:i + 1]),
                                    f"is {child!r}, not a section, so {key} cannot be set")])
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def did_you_mean(key: str, choices: list[str], template: str = "; did you mean {}?") -> str:
    """``"; did you mean X?"`` (or ``template`` filled with X) for the closest of ``choices`` to
    a misspelt ``key``, or ``""``. Config keys and the command line's flags use it alike."""
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    return template.format(close[0]) if close else ""
