"""The LoRA adapters a server serves by name (vLLM's multi-LoRA API).

A request's ``model`` picks the base model (the served model name) or an adapter; ``/v1/models``
lists the adapters with the base model as their ``parent``. Adapters come from ``lora.modules``
(checked at start-up: a bad one stops the server naming it) and, when runtime updating is
allowed (``frontend.allow_runtime_lora_updating``, or vLLM's environment variable
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), from ``POST /v1/load_lora_adapter`` — only from
directories under ``frontend.allowed_lora_paths`` (the path resolved first, so no ``..`` or link
leads out) — and ``POST /v1/unload_lora_adapter``. Each adapter gets its own ``lora_int_id``
(never reused), so its prefix-cache blocks and device slot are its own. Unloading removes the
name: new requests for it get 404, while requests already running keep their adapter (they hold
its slot) and finish.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

from corellm.errors import ConfigError, InvalidRequestError
from corellm.lora.request import LoRARequest

from .errors import APIError

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(option: bool) -> bool:
    return option or os.environ.get(RUNTIME_ENV, "").strip().lower() in ("true", "1")


class LoRAAdapters:
    def __init__(self, engine: Any, base_name: str, allowed_paths: list[str],
                 runtime: bool) -> None:
        self.engine = engine
        self.base_name = base_name
        self.enabled = engine.config.lora.enable
        self.runtime = runtime and self.enabled
        self.allowed = [Path(p).expanduser().resolve() for p in allowed_paths]
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for name, path in engine.config.lora.modules.items():
            try:
                self._add(name, path)
            except (InvalidRequestError, ValueError) as exc:
                message = exc.message if isinstance(exc, InvalidRequestError) else str(exc)
                raise ConfigError([(f"lora.modules.{name}", message)]) from None

    def _add(self, name: str, path: str) -> LoRARequest:
        lora = LoRARequest(name, next(self._ids), str(Path(path).expanduser()))
        self.engine.processor.check_lora(lora)     # its files, rank, modules and shapes
        self.by_name[name] = lora
        return lora

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.base_name:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            served = ", ".join(f"`{n}`" for n in [self.base_name, *self.by_name])
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{served}.", param="model", code="model_not_found")
        return lora

    def cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models``' entries: the base model, then each adapter with it as ``parent``."""
        base = {"id": self.base_name, "object": "model", "created": created,
                "owned_by": "corellm", "root": self.base_name, "parent": None,
                "max_model_len": max_model_len}
        return [base, *({**base, "id": name, "root": lora.lora_path, "parent": self.base_name}
                        for name, lora in self.by_name.items())]

    # ------------------------------------------------------------------ run time
    def _check_runtime(self) -> None:
        if not self.runtime:
            raise APIError(404, "loading and unloading LoRA adapters at run time is off (set "
                                "frontend.allow_runtime_lora_updating, or "
                                f"{RUNTIME_ENV}=True, with lora.enable)",
                           code="not_found")

    def load(self, body: Any) -> str:
        """``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``."""
        self._check_runtime()
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if name == self.base_name or name in self.by_name:
            raise APIError(400, f"lora_name: the adapter `{name}` is already served (unload it "
                                "first)", param="lora_name")
        resolved = Path(path).expanduser().resolve()
        # The directory and the files in it, each resolved: a link inside an allowed
        # directory leads nowhere else either.
        from corellm.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
        for where in (resolved, *((resolved / f).resolve() for f in (CONFIG_FILE, WEIGHTS_FILE)
                                  if (resolved / f).exists())):
            if not any(where == root or root in where.parents for root in self.allowed):
                roots = ", ".join(str(r) for r in self.allowed) or \
                    "none (frontend.allowed_lora_paths is empty)"
                raise APIError(400, f"lora_path: {path!r} is not under a directory adapters "
                                    f"may be loaded from: {roots}", param="lora_path")
        try:
            self._add(name, str(resolved))
        except InvalidRequestError as exc:
            raise APIError(400, f"lora_path: {exc.message}", param="lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: Any) -> str:
        """``POST /v1/unload_lora_adapter`` ``{"lora_name"}``."""
        self._check_runtime()
        name = _field(body, "lora_name")
        if self.by_name.pop(name, None) is None:
            raise APIError(404, f"lora_name: no adapter `{name}` is served", param="lora_name",
                           code="model_not_found")
        return f"Success: LoRA adapter '{name}' removed successfully."


def _field(body: Any, key: str) -> str:
    value = body.get(key) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise APIError(400, f"{key}: a non-empty string is required", param=key)
    return value
