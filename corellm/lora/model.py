"""A worker's LoRA state: every adaptable linear layer's device slots, the adapters kept on the
host, and the step's tokens per adapter.

``LoRAModel(model, ...)`` finds the layers an adapter may target through the model's checkpoint
routes (``model.weight_routes``, kept by ``corellm.layers.load_weights``): a checkpoint weight
``<module>.weight`` routed to a core linear layer (``LinearBase``), whole or as part
``shard_id`` of a fused one (q/k/v of a QKV projection, gate/up), makes ``<module>`` adaptable,
with the full tensor's shape. Each such layer gets a ``LoRALayer``: for its P parts (q, k, v of
a QKV projection; gate, up; one for an unfused layer), ``a`` [max_loras, P, R, in] (each slot's
A) and ``b[p]`` [max_loras, R, out_p] (its B transposed, for part p's output columns
``spans[p]``), R ``max_lora_rank``, zero past an adapter's own rank and for a part it does not
adapt; this rank's slice of each
adapter's A and B is cut by the layer's own ``input_part`` / ``output_part`` (the weight loaders'
slicing), so tensor-parallel shards need nothing more.

The scheduler decides which adapter each slot holds (``corellm.lora.LoRASlots``) and the plan
says what to load (``SchedulerOutput.lora_loads``); ``load`` fills a slot from the host cache
(``max_cpu_loras`` adapters, least recently used evicted), reading the adapter's files on a
miss. Before each forward the model runner gives ``set_step`` the slot of every token (-1: the
base model), which becomes the shared ``LoRABatch``: ``groups``, one ``(slot, token indices)``
per adapter present, and ``slots``, every token's; every layer's ``linear`` reads it
(``ops.lora_linear``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from corellm.lora.adapter import LoRAAdapter, load_adapter
from corellm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRABatch:
    """The step's adapters: ``groups`` = [(slot, token indices or None for every token)], empty
    when no token of the step runs an adapter; ``slots`` [T] int64, each token's slot (-1: the
    base model); ``cache``: what a platform's ``lora_linear`` derives from them once per step
    (the CPU platform's per-token slot mask), cleared with each step."""

    __slots__ = ("groups", "slots", "cache")

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.slots: torch.Tensor | None = None
        self.cache: dict[Any, Any] = {}


class LoRALayer:
    """One linear layer's adapter slots (``layer.lora``); ``kernel``: what a platform's
    ``lora_linear`` prepares for it (set on first use)."""

    kernel: Any = None

    def __init__(self, layer: nn.Module, parts: list[Any], max_loras: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device) -> None:
        self.layer, self.batch, self.max_rank = layer, batch, max_rank
        self.parts = {shard: i for i, shard in enumerate(parts)}
        self.spans = [layer.output_part(shard)[::2] for shard in parts]   # (offset, size)
        self.a = torch.zeros(max_loras, len(parts), max_rank, layer.in_features, dtype=dtype,
                             device=device)
        self.b = [torch.zeros(max_loras, max_rank, n, dtype=dtype, device=device)
                  for _, n in self.spans]

    def set(self, slot: int, weights: dict[Any, Any]) -> None:
        """Slot ``slot`` := the adapter's parts ``weights`` (shard_id -> ``LoRAModule``, full
        checkpoint-shaped); zero where it has none."""
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        start, size = self.layer.input_part()
        for shard, module in weights.items():
            p, r = self.parts[shard], module.rank
            _, row, n = self.layer.output_part(shard)
            self.a[slot, p, :r].copy_(module.a[:, start:start + size])
            self.b[p][slot, :r].copy_(module.b[row:row + n].T)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, *self.b))


class LoRAModel:
    """A worker's adapters over ``model`` (see the module's docstring)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        from corellm.layers.linear import LinearBase
        routes = getattr(model, "weight_routes", None)
        if routes is None:
            raise ValueError(f"{type(model).__name__} does not load its weights through "
                             "corellm.layers.load_weights, so LoRA adapters cannot find its "
                             "layers")
        modules = dict(model.named_modules())
        # checkpoint module -> (layer name, shard_id); and its full (in, out)
        self.routes: dict[str, tuple[str, Any]] = {}
        self.targets: dict[str, tuple[int, int]] = {}
        parts: dict[str, list[Any]] = {}
        for name, (param, shard, shape) in routes.items():
            if not (name.endswith(".weight") and param.endswith(".weight") and len(shape) == 2):
                continue
            layer_name = param[:-len(".weight")]
            if not isinstance(modules.get(layer_name), LinearBase):
                continue
            module = name[:-len(".weight")]
            self.routes[module] = (layer_name, shard)
            self.targets[module] = (int(shape[1]), int(shape[0]))
            if shard not in parts.setdefault(layer_name, []):
                parts[layer_name].append(shard)
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALayer] = {}
        for layer_name, shards in parts.items():
            layer = modules[layer_name]
            layer.lora = self.layers[layer_name] = LoRALayer(
                layer, shards, max_loras, max_rank, self.batch, dtype, device)
        self.slots: list[LoRARequest | None] = [None] * max_loras
        self.max_cpu_loras = max_cpu_loras
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._device = device
        logger.info("LoRA: %d adaptable layers, %d slots of rank %d (%.1f MiB)",
                    len(self.layers), max_loras, max_rank,
                    sum(x.nbytes for x in self.layers.values()) / 2**20)

    def adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """``lora``'s weights from the host cache, read (and checked) on a miss."""
        found = self.host.get(lora.lora_int_id)
        if found is not None and found.lora == lora:
            self.host.move_to_end(lora.lora_int_id)
            return found
        adapter = load_adapter(lora, self.targets, self.max_rank, self.dtype)
        self.host[lora.lora_int_id] = adapter
        self.host.move_to_end(lora.lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def load(self, loads: dict[int, LoRARequest]) -> None:
        """Fill the slots the plan assigned: ``loads`` slot -> adapter."""
        for slot, lora in loads.items():
            if self.slots[slot] == lora:
                continue
            try:
                adapter = self.adapter(lora)
            except Exception as exc:            # changed on disk since it was checked
                for layer in self.layers.values():
                    layer.set(slot, {})
                self.slots[slot] = None
                raise RuntimeError(f"LoRA adapter {lora.lora_name!r} could not be loaded into "
                                   f"slot {slot}: {exc}") from exc
            per_layer: dict[str, dict[Any, Any]] = {}
            for module, weights in adapter.modules.items():
                layer_name, shard = self.routes[module]
                per_layer.setdefault(layer_name, {})[shard] = weights
            for layer_name, layer in self.layers.items():
                layer.set(slot, per_layer.get(layer_name, {}))
            self.slots[slot] = lora

    def check_slot(self, slot: int, request_id: str) -> None:
        """A request may run on ``slot`` only if the slot holds an adapter (a load that failed
        leaves it empty: no request then runs with another adapter's weights)."""
        if slot >= 0 and self.slots[slot] is None:
            raise RuntimeError(f"request {request_id!r} runs on LoRA slot {slot}, which holds "
                               "no adapter (its load failed)")

    def set_step(self, token_slots: np.ndarray | None) -> bool:
        """The step's slot per token (-1: the base model; None: no token runs an adapter).
        Returns whether any does."""
        batch = self.batch
        groups = batch.groups
        groups.clear()
        batch.cache.clear()
        batch.slots = None
        if token_slots is None or not len(token_slots):
            return False
        used = np.unique(token_slots)
        used = used[used >= 0]
        if not len(used):
            return False
        batch.slots = torch.from_numpy(token_slots).to(self._device)
        if len(used) == 1 and (token_slots == used[0]).all():
            groups.append((int(used[0]), None))
            return True
        for slot in used.tolist():
            idx = torch.from_numpy(np.flatnonzero(token_slots == slot)).to(self._device)
            groups.append((slot, idx))
        return True
