"""Quantized weights in a built model: keeping the quantized tensors a checkpoint gave the layers,
quantizing a float model's linear layers at load (``model.quantization: int8``), and telling the
weights' memory by type.

A layer whose weight is quantized (``corellm.layers.linear.QuantizableWeight``: the linear
layers, the vocabulary embedding and the LM head) holds it as ``qweight`` (a
``corellm.quant.QuantizedWeight``) and runs its matmul through ``ops.quantized_linear``; its
``weight`` stays a parameter of the logical shape and dtype on the meta device (what code that
asks a layer's shape reads), so the float copy takes no memory.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from corellm.quant import QuantizedWeight, quantize_int8

logger = logging.getLogger(__name__)


def _placeholder(weight: nn.Parameter) -> nn.Parameter:
    meta = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                        requires_grad=False)
    meta.__dict__.update(weight.__dict__)          # weight_loader and the other attributes
    return meta


def _adopt(model: nn.Module, found: dict[int, tuple[nn.Parameter, QuantizedWeight]]) -> None:
    """Every layer whose weight is a key of ``found`` (tied layers share one) takes its
    quantized weight, and a meta placeholder for the float one."""
    placeholders = {key: _placeholder(w) for key, (w, _) in found.items()}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None and id(weight) in found:
            module.qweight = found[id(weight)][1]
            module.weight = placeholders[id(weight)]


def finish_loading(model: nn.Module) -> int:
    """After ``load_weights``: each layer whose checkpoint tensors all came quantized keeps them
    as its ``qweight``. A layer given some parts quantized and some as floats (a merged
    projection of a file that stores one part unquantized) gets the quantized parts
    dequantized into its float weight. Returns the layers left quantized."""
    found: dict[int, tuple[nn.Parameter, QuantizedWeight]] = {}
    for name, module in model.named_modules():
        parts = module.__dict__.pop("_qparts", None)
        if not parts:
            continue
        weight = module.weight
        if sum(t.shape[0] for t in parts.values()) != weight.shape[0]:
            for offset, t in parts.items():
                weight.data[offset:offset + t.shape[0]].copy_(t.dequantize(weight.dtype))
            logger.info("%s: part of its weight came unquantized; the %s parts are dequantized "
                        "too", name, "/".join(sorted({t.qtype for t in parts.values()})))
            continue
        found[id(weight)] = (weight, QuantizedWeight(list(parts.items())))
    _adopt(model, found)
    return len(found)


def quantize_linear_layers(model: nn.Module, method: str = "int8") -> int:
    """``model.quantization: int8``: every float linear layer (``LinearBase``; not the
    vocabulary embedding or the LM head, whose rounding costs the most accuracy for the least
    memory in most models) quantized per output channel. Returns the layers quantized."""
    from corellm.layers.linear import LinearBase

    if method != "int8":
        raise ValueError(f"unknown quantization method {method!r}")
    found: dict[int, tuple[nn.Parameter, QuantizedWeight]] = {}
    for module in model.modules():
        if (isinstance(module, LinearBase) and module.qweight is None
                and module.weight.is_floating_point() and not module.weight.is_meta):
            found[id(module.weight)] = (module.weight,
                                        QuantizedWeight([(0, quantize_int8(module.weight))]))
    _adopt(model, found)
    return len(found)


def weight_memory(model: nn.Module) -> dict[str, int]:
    """Bytes the model's weights take, by type: each float dtype, each quantized format (tied
    tensors counted once; placeholders on the meta device not at all)."""
    out: Counter[str] = Counter()
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        out[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    for module in model.modules():
        q = getattr(module, "qweight", None)
        if isinstance(q, QuantizedWeight) and id(q) not in seen:
            seen.add(id(q))
            for _, part in q.parts:
                out[part.qtype] += part.nbytes
    return dict(out)


def describe_memory(memory: dict[str, int]) -> str:
    total = sum(memory.values())
    parts = ", ".join(f"{n / 2**20:.1f} MiB {k}"
                      for k, n in sorted(memory.items(), key=lambda kv: -kv[1]))
    return f"{total / 2**20:.1f} MiB ({parts})"
