"""Building a model and filling it from a checkpoint: the two chores every model plugin has.

``materialize`` turns a module built on the meta device (no memory, no random init) into one
with uninitialized storage on the target device, keeping tied parameters tied. ``load_weights``
copies ``(checkpoint name, tensor)`` pairs into the parameters, including into row ranges of
fused parameters (Q/K/V into one ``qkv_proj``), and fails with a ``CheckpointError`` on any
missing, unexpected or mis-shaped weight, so a model never runs with a parameter left unset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from corellm.errors import CheckpointError
from corellm.layers.layers import load_shard


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
            new[id(t)] = (nn.Parameter(data, requires_grad=t.requires_grad)
                          if isinstance(t, nn.Parameter) else data)
        return new[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fresh(t)
    return model


Stacked = Sequence[tuple[str, str, int]]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                 stacked: Stacked = (), shard_sizes: Callable[[str], Sequence[int]] | None = None,
                 skip: Callable[[str], bool] | None = None, model_name: str = "model") -> None:
    """Copy checkpoint tensors into ``model``'s parameters, by name.

    ``stacked`` lists fused parameters as ``(checkpoint part, fused part, index)``, e.g.
    ``("q_proj", "qkv_proj", 0)``: a checkpoint name containing ``.q_proj.`` goes to the
    parameter named with ``.qkv_proj.`` instead, into the rows of shard ``index``, whose sizes
    ``shard_sizes(fused parameter name)`` gives. ``skip(name)`` drops checkpoint tensors the model
    does not need (e.g. ``rotary_emb.inv_freq``). A tied parameter may be loaded under any of
    its names. Raises ``CheckpointError`` naming the weights that are unexpected, missing or of
    the wrong shape; ``model_name`` names the model in those messages.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    fused_names = {fused for _, fused, _ in stacked}
    parts: dict[str, int] = {}
    for _, fused, idx in stacked:
        parts[fused] = max(parts.get(fused, 0), idx + 1)
    if stacked and shard_sizes is None:
        raise ValueError("load_weights: stacked parameters need shard_sizes")

    # Each tensor once (tied names share it), each fused one once per shard.
    expected: dict[tuple[int, int | None], str] = {}
    for name, param in params.items():
        fused = next((f for f in fused_names if f".{f}." in name), None)
        for idx in ([None] if fused is None else range(parts[fused])):
            expected.setdefault((id(param), idx), name if idx is None else f"{name}[shard {idx}]")
    loaded: set[tuple[int, int | None]] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if skip is not None and skip(name):
            continue
        part = next(((p, f, i) for p, f, i in stacked if f".{p}." in name), None)
        if part is not None:
            target = name.replace(f".{part[0]}.", f".{part[1]}.")
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            sizes = shard_sizes(target)                  # type: ignore[misc]
            idx = part[2]
            try:
                load_shard(param, tensor, sum(sizes[:idx]), sizes[idx])
            except ValueError as exc:
                raise CheckpointError(f"weight {name}: {exc}") from exc
            loaded.add((id(param), idx))
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        if param.shape != tensor.shape:
            raise CheckpointError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != "
                                  f"model shape {tuple(param.shape)}")
        param.data.copy_(tensor)
        loaded.add((id(param), None))
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} weight(s) this {model_name} "
                              f"model does not use, e.g. {', '.join(sorted(unexpected)[:5])}")
    missing = sorted(label for key, label in expected.items() if key not in loaded)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} weight(s) of this "
                              f"{model_name} model, e.g. {', '.join(missing[:5])}")
