"""The offline API: ``LLM(config).generate(prompts, sampling_params)``, in vLLM's shape."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from corellm.config.compose import EngineConfig, load_config, read_config_file
from corellm.config.schema import apply_overrides, engine_arg_overrides
from corellm.engine.core import EngineCore
from corellm.engine.core_client import InprocClient, SyncMPClient, ThreadedInprocClient
from corellm.engine.output_processor import OutputProcessor
from corellm.engine.processor import Processor, PromptType
from corellm.errors import InvalidRequestError
from corellm.checkpoint.reader import (  # noqa: F401  (load_tokenizer: importable here too)
    load_generation_eos_ids, load_tokenizer, model_path, plain_fast_tokenizer_name,
    tokenizer_path)
from corellm.lora.request import LoRARequest
from corellm.outputs import EngineStats, RequestOutput, StepStats
from corellm.config.logits_processors import RequestChecker
from corellm.plugins.discovery import Registry, load_registry
from corellm.sampling_params import SamplingParams


def _config_eos_ids(path: str) -> list[int]:
    from corellm.checkpoint.reader import read_checkpoint_config

    cfg, _ = read_checkpoint_config(path)
    eos = cfg.get("text_config", cfg).get("eos_token_id", cfg.get("eos_token_id"))
    ids = eos if isinstance(eos, list) else [eos]
    return [int(e) for e in ids if isinstance(e, int)]


def build_config(config: EngineConfig | Mapping[str, Any] | str | Path | None,
                 model: str | None, plugins: Sequence[object]) -> tuple[EngineConfig, Registry]:
    """Validate a config (object, mapping or file) against the plugins it enables."""
    if isinstance(config, EngineConfig):
        data = None
        disable = config.plugins.disable
    else:
        data = read_config_file(config) if isinstance(config, (str, Path)) else dict(config or {})
        disable = (data.get("plugins") or {}).get("disable", []) if isinstance(
            data.get("plugins"), Mapping) else []
        if model is not None:
            data["model"] = {**(data.get("model") or {}), "path": model}
    registry = load_registry(disable=disable, plugins=plugins)
    if data is None:
        if model is not None:
            config = config.model_copy(update={"model": config.model.model_copy(
                update={"path": model})})
        return config, registry
    return load_config(data, registry=registry), registry


def with_engine_args(config: EngineConfig | Mapping[str, Any] | str | Path | None,
                     engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as a mapping with vLLM's engine arguments applied over it
    (``LLM(model=..., max_num_seqs=8, dtype="bfloat16")``: the config keys their ``corellm
    serve`` flags set); an unknown argument is a ``TypeError`` naming the closest one."""
    overrides = engine_arg_overrides(engine_args)
    if isinstance(config, EngineConfig):
        data = config.to_dict()
    else:
        data = read_config_file(config) if isinstance(config, (str, Path)) else dict(config or {})
    return apply_overrides(data, overrides)


# Whether LLM steps its in-process engine on a core thread unless told (``core_thread``);
# CORELLM_CORE_THREAD=0/1 overrides it (for a whole test run, a benchmark, the CLI).
#
# Off, by measurement (benchmarks/output_overlap.py, 2-core AMD EPYC VM, torch CPU; medians of
# 5 rounds, the three modes interleaved; the machine was shared, load averages in the output):
# * the tests' tiny Llama (output processing ~23% of the serial loop's time), 256 requests x
#   128 tokens: core thread 0.92x the serial loop's tok/s on a quiet machine (two runs, 0.917x
#   and 0.924x: the step's Python and the caller's share one GIL, and the step gets slower by
#   about the time the caller takes), 1.03-1.07x beside one busy process; the engine process
#   1.05-1.14x quiet, 0.83-1.20x beside a busy process;
# * the ~100M benchmark Llama (output processing ~1% of the time), 64 x 64 tokens: all three
#   within 1.2% on a quiet machine (thread 1.012x, process 1.010x).
# So on this CPU the thread does not pay; the engine process (engine_process=True) can, where
# output processing is a large share, at the cost of llm.engine (None) and in-process plugins.
# Where a step mostly waits for a device with the GIL released (CUDA), the thread can hide the
# caller's work: measure there (python benchmarks/output_overlap.py --model PATH) before
# turning this on.
DEFAULT_CORE_THREAD = False


def default_core_thread() -> bool:
    """``DEFAULT_CORE_THREAD``, unless the ``CORELLM_CORE_THREAD`` environment variable says
    otherwise (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``)."""
    value = os.environ.get("CORELLM_CORE_THREAD", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return DEFAULT_CORE_THREAD


def _per_prompt(name: str, value: Any, n: int, scalar: type | tuple[type, ...]) -> list[Any]:
    """One value for every prompt, or a sequence of one per prompt."""
    if isinstance(value, scalar) or not isinstance(value, Sequence):
        return [value] * n
    if len(value) != n:
        raise InvalidRequestError(name, f"got {len(value)} for {n} prompts (give one, or one "
                                  "per prompt)")
    return list(value)


def _launcher_apart(config: EngineConfig, registry: Registry) -> str | None:
    """The name of the config's core launcher when it is not the built-in ``mp``."""
    from corellm.errors import PluginError
    name = config.core_launcher.name
    try:
        entry = registry.get("core_launcher", name)
    except PluginError:               # the default, its plugin not loaded (an allow-list)
        return None if name == "mp" else name
    return None if entry.spec.name == "mp" and entry.plugin.builtin else name


class LLM:
    """Offline generation.

    ``LLM(config)`` takes an ``EngineConfig``, a dict, or a path to a YAML/TOML/JSON file;
    ``LLM(model=PATH)`` is shorthand for ``{"model": {"path": PATH}}``. With neither, the built-in
    demo model is used. vLLM's engine arguments set the config keys their ``corellm serve``
    flags set, over the config: ``LLM(model=PATH, dtype="bfloat16", max_model_len=4096,
    max_num_seqs=64, max_num_batched_tokens=2048, block_size=16, tensor_parallel_size=2,
    seed=0, enable_prefix_caching=False, quantization="int8")``
    (``corellm.config.schema.ENGINE_ARGS``); an unknown one is a ``TypeError`` naming the
    closest. ``plugins`` registers extra in-process plugin
    objects.

    The engine core runs in this process by default (``llm.engine`` is the ``EngineCore``);
    ``engine_process=True`` runs it in a child process behind the same client the server uses
    (``llm.engine`` is then None, and only entry-point plugins are available to it); a
    ``core_launcher`` other than ``mp`` (``data_parallel_backend="ray"``: a Ray actor) implies
    it.
    ``core_thread=True`` keeps it in this process but steps it on a thread of its own while
    ``generate`` runs (``ThreadedInprocClient``), so that detokenization, stop strings and
    output building here overlap the next step; between calls ``llm.engine`` is the caller's
    as before. Left out, ``DEFAULT_CORE_THREAD`` (off: measured slower on a 2-core CPU, see
    there) unless ``CORELLM_CORE_THREAD=1``.
    ``tokenizer`` is the model's tokenizer when the caller already loaded it (with
    ``load_tokenizer``, from the directory the config names): it is used instead of loading
    it again. ``skip_tokenizer_init=True`` (vLLM's option) loads none: prompts are token ids,
    outputs have token ids and empty text, stop strings and chats are refused, and a sequence
    ends at the checkpoint's end-of-sequence ids (its generation config's, a GGUF file's, else
    config.json's).
    """

    def __init__(self, config: EngineConfig | Mapping[str, Any] | str | Path | None = None, *,
                 model: str | None = None, plugins: Sequence[object] = (),
                 engine_process: bool = False, core_thread: bool | None = None,
                 tokenizer: Any = None, skip_tokenizer_init: bool = False,
                 **engine_args: Any) -> None:
        if engine_args:
            config = with_engine_args(config, engine_args)
        self.config, self.registry = build_config(config, model, plugins)
        if self.config.parallel.data_parallel_size > 1:
            from corellm.errors import ConfigError
            n = self.config.parallel.data_parallel_size
            raise ConfigError([("parallel.data_parallel_size", f"{n} replicas are served by "
                                "corellm serve, behind its router; LLM runs one engine")])
        path = model_path(self.config)       # validates the checkpoint directory
        # A launcher other than the built-in mp says where the core runs, apart from here.
        launcher = _launcher_apart(self.config, self.registry)
        why = f" (core_launcher.name {launcher!r} runs it apart)" if launcher else ""
        engine_process = engine_process or launcher is not None
        if engine_process and plugins:
            raise InvalidRequestError("plugins", "in-process plugin objects cannot reach an "
                                      f"engine process{why}; install them as entry-point "
                                      "plugins")
        if engine_process and core_thread:
            raise InvalidRequestError("core_thread", f"an engine process{why} steps on its own; "
                                      "give engine_process or core_thread, not both")
        if core_thread is None:
            core_thread = default_core_thread() and not engine_process
        self.client: InprocClient | SyncMPClient = (
            SyncMPClient(self.config, self.registry) if engine_process
            else ThreadedInprocClient(self.config, self.registry) if core_thread
            else InprocClient(self.config, self.registry))
        self.engine: EngineCore | None = getattr(self.client, "engine", None)
        try:
            self.tokenizer = tokenizer if tokenizer is not None or skip_tokenizer_init \
                else load_tokenizer(self.config.model.tokenizer or path,
                                    "model.tokenizer" if self.config.model.tokenizer
                                    else "model.path")
        except BaseException:
            self.client.shutdown()
            raise
        self.model_info = self.client.model_info
        eos_ids = load_generation_eos_ids(path)
        if self.tokenizer is None and not eos_ids:
            eos_ids = _config_eos_ids(path)     # no tokenizer to name it: config.json does
        self.processor = Processor(self.tokenizer, self.model_info, eos_ids,
                                   RequestChecker.for_config(self.config, self.registry),
                                   max_lora_rank=self.config.lora.max_lora_rank)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: int | Sequence[int] = 0,
                 user: str | None | Sequence[str | None] = None,
                 session_id: str | None | Sequence[str | None] = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generate completions; returns one RequestOutput per prompt, in input order.

        ``priority`` (lower runs first under the ``priority`` scheduler), ``user`` (a tenant)
        and ``session_id`` are scheduling attributes for the policy: one value for every
        prompt, or one per prompt. ``lora_request``: the LoRA adapter to run (an engine made
        with ``enable_lora=True``), one for every prompt or one (or None: the base model) per
        prompt.

        Every prompt is validated before any is scheduled: a bad one raises
        ``InvalidRequestError`` naming the field and leaves the engine untouched.
        """
        if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = _per_prompt("sampling_params", sampling_params, len(prompts), SamplingParams)
        priorities = _per_prompt("priority", priority, len(prompts), int)
        users = _per_prompt("user", user, len(prompts), (str, type(None)))
        sessions = _per_prompt("session_id", session_id, len(prompts), (str, type(None)))
        loras = _per_prompt("lora_request", lora_request, len(prompts),
                            (LoRARequest, type(None)))

        processed = []
        # On the engine's clock (virtual under a simulated executor), so RequestMetrics agree
        # with it; an engine process runs on the wall clock of this host.
        now = self.engine.clock.time() if self.engine is not None else None
        for i, (prompt, sp, prio, u, sid, lora) in enumerate(zip(prompts, params, priorities,
                                                                  users, sessions, loras)):
            try:
                processed.append(self.processor.process(str(next(self._ids)), prompt, sp, prio,
                                                        user=u, session_id=sid, arrival_time=now,
                                                        lora_request=lora))
            except InvalidRequestError as exc:
                if len(prompts) > 1:
                    raise InvalidRequestError(f"prompts[{i}].{exc.field}", exc.message) from exc
                raise
        order = []
        try:
            for text, core_request in processed:
                state = self.output_processor.add_request(core_request.request_id, text,
                                                          core_request)
                order.append(core_request.request_id)
                self.client.add_requests(state.core_requests)
        except BaseException:
            # Refused (a policy's error, a shut-down engine): what was added goes again.
            leftover = self.output_processor.abort_requests(order)
            try:
                self.client.abort_requests(leftover)
            except Exception:
                pass
            raise
        results = self._run(order, use_tqdm)
        return [results[rid] for rid in order]

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None,
             priority: int | Sequence[int] = 0,
             user: str | None | Sequence[str | None] = None,
             session_id: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or
        to several (a list of such lists), applying the model's chat template (or
        ``chat_template``); vLLM's ``LLM.chat``. Returns one RequestOutput per conversation.
        ``tools`` (OpenAI's function tools) are given to the template; the outputs are the
        model's text (``corellm.serving.chat_output`` reads calls and reasoning out of it, as
        the server does).
        """
        from corellm.engine.chat import render_chat

        if self.tokenizer is None:
            raise InvalidRequestError("messages", "a chat needs the tokenizer (its chat "
                                      "template), which this LLM skipped (skip_tokenizer_init)")
        if not messages or isinstance(messages[0], Mapping):
            conversations = [messages]
        else:
            conversations = list(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            field = "messages" if len(conversations) == 1 else f"messages[{i}]"
            ids = render_chat(self.tokenizer, conversation, chat_template=chat_template,
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message,
                              chat_template_kwargs=chat_template_kwargs, field=field,
                              tools=tools)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority,
                             user=user, session_id=session_id)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        from tqdm.auto import tqdm

        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm,
                   dynamic_ncols=True)
        generated = 0
        client = self.client
        try:
            # With a core thread, it steps from here on while this thread processes outputs;
            # on the way out it has stopped, with every abort sent here applied.
            with client.stepping():
                try:
                    while len(results) < len(request_ids):
                        batch = client.get_output()
                        outputs = batch.outputs
                        if not outputs and client.ran_dry(batch):
                            raise RuntimeError(
                                "engine has no unfinished requests but "
                                f"{len(request_ids) - len(results)} were never finished")
                        generated += sum(len(o.new_token_ids) for o in outputs)
                        done = self.output_processor.process_outputs(
                            outputs, batch.timestamp if self.engine is not None else None)
                        if done.reqs_to_abort:      # stop strings: free their KV blocks now
                            client.abort_requests(done.reqs_to_abort)
                        for out in done.request_outputs:
                            results[out.request_id] = out
                            bar.update(1)
                        if use_tqdm and bar.format_dict["elapsed"] > 0:
                            bar.set_postfix_str(
                                f"{generated / bar.format_dict['elapsed']:.1f} tok/s",
                                refresh=False)
                except BaseException:
                    # Interrupted or failed: nothing stays behind in the engine.
                    leftover = self.output_processor.abort_requests(
                        [rid for rid in request_ids if rid not in results])
                    try:
                        client.abort_requests(leftover)
                    except Exception:
                        pass
                    raise
        finally:
            bar.close()
        return results

    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call ``listener`` in this process with every ``StepStats`` the engine produces (in
        this process or in its engine process): the records the ``corellm_step_finished``
        hook, ``/metrics`` and ``corellm bench`` read."""
        self.client.add_stats_listener(listener)

    def get_stats(self) -> EngineStats:
        return self.client.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (e.g. after swapping weights, or to benchmark cold starts).
        Returns False, changing nothing, while requests hold KV blocks."""
        return self.client.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
