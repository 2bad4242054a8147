"""``LoRARequest``: which adapter a request runs (light: no torch), and ``LoRAError``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request (vLLM's ``LoRARequest(lora_name, lora_int_id,
    lora_path)``): ``lora_int_id`` (>= 1) identifies the adapter's weights in the engine (its
    device slot, its prefix-cache blocks), ``lora_name`` is what the API calls it (a request's
    ``model``), ``lora_path`` its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string, got "
                             f"{self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer "
                             f">= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be a non-empty "
                             f"string, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_salt(self) -> str:
        """What keys this adapter's prefix-cache blocks apart from the base model's and every
        other adapter's."""
        return f"lora:{self.lora_int_id}:{self.lora_path}"


class LoRAError(ValueError):
    """An adapter that cannot be used with this model: the message names it and what is
    wrong."""

    def __init__(self, lora: LoRARequest, message: str) -> None:
        super().__init__(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): {message}")
        self.lora = lora
