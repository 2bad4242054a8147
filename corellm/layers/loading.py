"""Building a model and filling it from a checkpoint: the two chores every model plugin has.

``materialize`` turns a module built on the meta device (no memory, no random init) into one
with uninitialized storage on the target device, keeping tied parameters tied. ``load_weights``
copies ``(checkpoint name, tensor)`` pairs into the parameters, including into parts of fused
parameters (Q/K/V into one ``qkv_proj``), and fails with a ``CheckpointError`` on any missing,
unexpected or mis-shaped weight, so a model never runs with a parameter left unset. A parameter
with a ``weight_loader`` attribute (every parameter of ``corellm.layers.linear``'s sharded
layers) loads itself: ``param.weight_loader(param, loaded, shard_id)`` copies its rank's slice.

The checkpoint tensors may be lazy safetensors slices (``iter_weights(path, lazy=True)``, what
the model runner passes to a model whose ``lazy_weights`` is True): ``weight_shape`` and
``narrow_weight`` read a shard of one without reading the rest from disk, ``as_tensor`` reads
it whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from corellm.errors import CheckpointError
from corellm.quant import QuantizedTensor


def materialize(model: nn.Module, device: torch.device | str,
                dtype: torch.dtype) -> nn.Module:
    """Give every parameter and buffer of ``model`` fresh, uninitialized storage on ``device``,
    floating-point ones in ``dtype``. A tensor shared by several modules (tied embeddings) gets
    one new tensor, still shared. Returns ``model``.

    (``Module.to_empty()`` and ``_apply`` untie shared parameters, and ``to_empty`` goes through
    ``torch._refs``, whose first use imports sympy: 0.4 s of start-up.)
    """
    new: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in new:
            data = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                               device=device)
            if isinstance(t, nn.Parameter):
                param = nn.Parameter(data, requires_grad=t.requires_grad)
                param.__dict__.update(t.__dict__)       # weight_loader and other attributes
                new[id(t)] = param
            else:
                new[id(t)] = data
        return new[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fresh(t)
    return model


def weight_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor, quantized tensor or lazy safetensors slice."""
    if isinstance(loaded, (torch.Tensor, QuantizedTensor)):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_weight(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded[..., start:start + size, ...]`` along ``dim`` as a tensor; from a lazy slice only
    that part is read; a quantized tensor stays quantized."""
    if isinstance(loaded, (torch.Tensor, QuantizedTensor)):
        return loaded.narrow(dim, start, size)
    index = (slice(None),) * dim + (slice(start, start + size),)
    return loaded[index]


def as_tensor(loaded: Any) -> torch.Tensor:
    """A checkpoint tensor, a lazy slice read whole, or a quantized tensor dequantized."""
    if isinstance(loaded, QuantizedTensor):
        return loaded.dequantize()
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


Stacked = Sequence[tuple[str, str, Any]]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]], *,
                 stacked: Stacked = (), shard_sizes: Callable[[str], Sequence[int]] | None = None,
                 skip: Callable[[str], bool] | None = None, model_name: str = "model") -> None:
    """Copy checkpoint tensors into ``model``'s parameters, by name.

    ``stacked`` lists fused parameters as ``(checkpoint part, fused part, shard_id)``, e.g.
    ``("q_proj", "qkv_proj", "q")``: a checkpoint name containing ``.q_proj.`` goes to the
    parameter named with ``.qkv_proj.`` instead, as its part ``shard_id``. A parameter with a
    ``weight_loader`` attribute gets ``weight_loader(param, tensor, shard_id)`` (``shard_id``
    None for an unfused one) and copies its own slice; otherwise the tensor is copied whole, or,
    for a fused parameter without one, into the rows of part ``shard_id`` (an int) whose sizes
    ``shard_sizes(fused parameter name)`` gives. A quantized checkpoint tensor
    (``corellm.quant.QuantizedTensor``) goes as it is to a parameter marked ``takes_quantized``
    (the weights of ``corellm.layers``' linear and embedding layers, which keep it quantized) and
    dequantized to any other. ``skip(name)`` drops checkpoint tensors the
    model does not need (e.g. ``rotary_emb.inv_freq``). A tied parameter may be loaded under any
    of its names. Raises ``CheckpointError`` naming the weights that are unexpected, missing or
    of the wrong shape; ``model_name`` names the model in those messages.

    The routes taken are kept as ``model.weight_routes``: checkpoint name -> (parameter name,
    shard_id, the checkpoint tensor's full shape). LoRA adapters, named by the checkpoint's
    modules, find their layers (and the part of a fused one) through them: any model loaded
    here takes adapters with no code of its own.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    parts: dict[str, list[Any]] = {}
    for _, fused, shard in stacked:
        parts.setdefault(fused, [])
        if shard not in parts[fused]:
            parts[fused].append(shard)

    # Each tensor once (tied names share it), each fused one once per part.
    expected: dict[tuple[int, Any], str] = {}
    for name, param in params.items():
        fused = next((f for f in parts if f".{f}." in name), None)
        for shard in ([None] if fused is None else parts[fused]):
            expected.setdefault((id(param), shard),
                                name if shard is None else f"{name}[{shard}]")
    loaded: set[tuple[int, Any]] = set()
    routes: dict[str, tuple[str, Any, tuple[int, ...]]] = {}
    unexpected: list[str] = []
    for name, tensor in weights:
        if skip is not None and skip(name):
            continue
        part = next(((p, f, i) for p, f, i in stacked if f".{p}." in name), None)
        target, shard = (name, None) if part is None else (
            name.replace(f".{part[0]}.", f".{part[1]}."), part[2])
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", None)
        if isinstance(tensor, QuantizedTensor) and not getattr(param, "takes_quantized", False):
            tensor = tensor.dequantize()
        try:
            if loader is not None:
                loader(param, tensor, shard)
            elif shard is not None:
                if shard_sizes is None:
                    raise ValueError("fused parameters without a weight_loader need "
                                     "shard_sizes")
                sizes = shard_sizes(target)
                load_shard(param, as_tensor(tensor), sum(sizes[:shard]), sizes[shard])
            else:
                shape = weight_shape(tensor)
                if tuple(param.shape) != shape:
                    raise ValueError(f"checkpoint shape {shape} != model shape "
                                     f"{tuple(param.shape)}")
                param.data.copy_(as_tensor(tensor))
        except ValueError as exc:
            raise CheckpointError(f"weight {name}: {exc}") from exc
        loaded.add((id(param), shard))
        routes[name] = (target, shard, tuple(weight_shape(tensor)))
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} weight(s) this {model_name} "
                              f"model does not use, e.g. {', '.join(sorted(unexpected)[:5])}")
    missing = sorted(label for key, label in expected.items() if key not in loaded)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} weight(s) of this "
                              f"{model_name} model, e.g. {', '.join(missing[:5])}")
    model.weight_routes = routes


def load_shard(param: torch.Tensor, loaded: torch.Tensor, offset: int, size: int) -> None:
    """Copy a checkpoint tensor into rows [offset, offset + size) of a fused parameter."""
    if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit rows {offset}:{offset + size} "
                         f"of a parameter of shape {tuple(param.shape)}")
    param.data[offset:offset + size].copy_(loaded)
