"""The offline API: ``LLM(config).generate(prompts, sampling_params)``, in vLLM's shape."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from corellm.config import EngineConfig, load_config, read_config_file
from corellm.engine.core import EngineCore
from corellm.engine.processor import Processor, PromptType, RequestCollector
from corellm.errors import CheckpointError, InvalidRequestError
from corellm.model_config import checkpoint_dir, load_generation_eos_ids
from corellm.outputs import EngineStats, RequestOutput
from corellm.plugins import Registry, load_registry
from corellm.sampling_params import SamplingParams
from corellm.worker.worker import model_path

_U63 = (1 << 63) - 1


def load_tokenizer(path: str, key: str = "model.tokenizer") -> Any:
    from transformers import AutoTokenizer
    checkpoint_dir(path, key=key)       # a local directory: nothing is fetched from a hub
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{key}: cannot load a tokenizer from {path!r}: {exc}") from exc


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


class LLM:
    """Offline generation.

    ``LLM(config)`` takes an ``EngineConfig``, a dict, or a path to a YAML/TOML/JSON file;
    ``LLM(model=PATH)`` is shorthand for ``{"model": {"path": PATH}}``. With neither, the built-in
    demo model is used. ``plugins`` registers extra in-process plugin objects.
    """

    def __init__(self, config: EngineConfig | Mapping[str, Any] | str | Path | None = None, *,
                 model: str | None = None, plugins: Sequence[object] = ()) -> None:
        self.config, self.registry = build_config(config, model, plugins)
        path = model_path(self.config)
        self.engine = EngineCore(self.config, self.registry)   # validates the checkpoint
        try:
            self.tokenizer = load_tokenizer(
                self.config.model.tokenizer or path,
                "model.tokenizer" if self.config.model.tokenizer else "model.path")
        except BaseException:
            self.engine.shutdown()
            raise
        self.processor = Processor(self.tokenizer, self.engine.model_info,
                                   load_generation_eos_ids(path))
        self._ids = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Generate completions; returns one RequestOutput per prompt, in input order.

        Every prompt is validated before any is scheduled: a bad one raises
        ``InvalidRequestError`` naming the field and leaves the engine untouched.
        """
        if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise InvalidRequestError("sampling_params", f"got {len(params)} for "
                                      f"{len(prompts)} prompts (give one, or one per prompt)")
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(prompts):
            raise InvalidRequestError("priority", f"got {len(priorities)} for {len(prompts)} prompts")

        collectors: list[RequestCollector] = []
        core_requests = []
        for i, (prompt, sp, prio) in enumerate(zip(prompts, params, priorities)):
            rid = str(next(self._ids))
            try:
                text, first = self.processor.process(rid, prompt, sp, prio)
            except InvalidRequestError as exc:
                if len(prompts) > 1:
                    raise InvalidRequestError(f"prompts[{i}].{exc.field}", exc.message) from exc
                raise
            collectors.append(RequestCollector(rid, text, first.prompt_token_ids, first.sampling_params,
                                               self.tokenizer, first.arrival_time))
            for j in range(sp.n):   # n samples: n engine requests
                child_params = first.sampling_params
                if sp.n > 1:
                    # Sample 0 keeps the seed (same as n=1); others derive distinct seeds.
                    seed = sp.seed if sp.seed is None or j == 0 else hash((sp.seed, j)) & _U63
                    child_params = dataclasses.replace(child_params, n=1, seed=seed)
                core_requests.append((len(collectors) - 1, j, dataclasses.replace(
                    first, request_id=f"{rid}#{j}", sampling_params=child_params)))
        owner = {}
        for ci, j, req in core_requests:
            self.engine.add_request(req)
            owner[req.request_id] = (ci, j)
        self._run(owner, collectors, use_tqdm)
        return [c.result() for c in collectors]

    def _run(self, owner: dict[str, tuple[int, int]], collectors: list[RequestCollector],
             use_tqdm: bool) -> None:
        from tqdm.auto import tqdm

        pending = set(owner)
        bar = tqdm(total=len(collectors), desc="Generating", unit="req", disable=not use_tqdm,
                   dynamic_ncols=True)
        generated = 0
        try:
            while pending:
                outputs = self.engine.step()
                if not outputs and not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine has no unfinished requests but "
                                       f"{len(pending)} were never finished")
                for out in outputs:
                    if out.request_id not in owner:
                        continue
                    ci, j = owner[out.request_id]
                    generated += len(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
                    if collectors[ci].add(j, out):
                        bar.update(1)
                if use_tqdm and bar.format_dict["elapsed"] > 0:
                    bar.set_postfix_str(f"{generated / bar.format_dict['elapsed']:.1f} tok/s",
                                        refresh=False)
        except BaseException:
            # Interrupted or failed: nothing stays behind in the engine.
            self.engine.abort_requests(list(pending))
            raise
        finally:
            bar.close()

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (e.g. after swapping weights, or to benchmark cold starts).
        Returns False, changing nothing, while requests hold KV blocks."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
