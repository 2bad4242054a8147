"""Multi-LoRA: many PEFT adapters over one base model, mixed in one batch (``docs/lora.md``).

* ``request``: ``LoRARequest`` (vLLM's) and ``LoRAError``: plain data, no torch (the API
  process and the plan carry them).
* ``adapter``: reading and checking a PEFT adapter directory against the model.
* ``slots``: the scheduler's view of the device's ``max_loras`` adapter slots.
* ``model``: a worker's per-layer slots, host cache and the step's tokens per adapter.

The layers' arithmetic is a platform op (``DeviceOps.lora_linear``). ``corellm.lora`` is the
public face of ``request``: its names are read from there when first asked for, so importing
one module of this folder runs no other."""

from typing import TYPE_CHECKING

from corellm._imports import facade

if TYPE_CHECKING:
    from corellm.lora.request import *  # noqa: F403

__getattr__ = facade(__name__, "request", ("request", "adapter", "slots", "model"))
