"""LoRA adapters in PEFT's format, read and checked against the model they are for.

An adapter is a directory as PEFT's ``save_pretrained`` writes it: ``adapter_config.json`` (``r``,
``lora_alpha``, ``use_rslora``, ``target_modules``...) and ``adapter_model.safetensors``, whose
tensors are named ``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``.lora_B.weight``
([out, r]) for each adapted module, ``<module>`` being the base checkpoint's module name (e.g.
``model.layers.0.self_attn.q_proj``). Each module's update is ``scale * B @ A`` with ``scale =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` under rsLoRA), ``r`` the module's own rank (its
``lora_A``'s rows: a ``rank_pattern`` needs nothing more).

The model side is a table of the modules an adapter may target, each with its full (unsharded)
``(in_features, out_features)``: what the worker's ``LoRAModel`` found in the model's
checkpoint routes. ``load_adapter`` reads the config and the tensors and checks them all
(shapes, rank, modules, finite weights) before returning any, raising ``LoRAError`` naming the
adapter and what is wrong, so nothing is half loaded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from corellm.lora.request import LoRAError, LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "a", ".lora_B.weight": "b"}


@dataclass
class LoRAModule:
    """One adapted module: ``a`` [r, in], ``b`` [out, r] already times the adapter's scale."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoRAAdapter:
    """An adapter's weights, read and checked (kept on the host by the worker's cache)."""

    lora: LoRARequest
    modules: dict[str, LoRAModule] = field(default_factory=dict)


def read_config(lora: LoRARequest) -> dict[str, Any]:
    """``adapter_config.json``, with what corellm does not support refused."""
    path = Path(lora.lora_path)
    if not path.is_dir():
        raise LoRAError(lora, "no such directory")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise LoRAError(lora, f"{CONFIG_FILE} is missing (not a PEFT adapter directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(lora, f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(lora, f"{CONFIG_FILE} is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(lora, f"peft_type {peft_type!r} is not LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAError(lora, f"r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(lora, f"lora_alpha must be a finite number, got {alpha!r}")
    refused = [
        ("bias", cfg.get("bias", "none") not in (None, "none"),
         "trains biases (bias != 'none')"),
        ("use_dora", bool(cfg.get("use_dora")), "is a DoRA adapter (use_dora)"),
        ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out")),
         "stores its weights transposed (fan_in_fan_out)"),
        ("modules_to_save", bool(cfg.get("modules_to_save")),
         f"replaces whole modules (modules_to_save: {cfg.get('modules_to_save')})"),
        ("alpha_pattern", bool(cfg.get("alpha_pattern")),
         "scales modules differently (alpha_pattern)"),
    ]
    for _, bad, what in refused:
        if bad:
            raise LoRAError(lora, f"it {what}, which corellm does not support")
    return cfg


def _scale(cfg: dict[str, Any], rank: int) -> float:
    alpha = float(cfg.get("lora_alpha", cfg["r"]))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _module_of(lora: LoRARequest, key: str) -> tuple[str, str]:
    """(module name, "a" or "b") of a tensor's name."""
    for suffix, which in _SUFFIXES.items():
        if key.endswith(suffix):
            name = key[:-len(suffix)]
            return (name[len(_PREFIX):] if name.startswith(_PREFIX) else name), which
    raise LoRAError(lora, f"tensor {key!r} is not a LoRA A or B weight (lora_A.weight / "
                          "lora_B.weight): corellm adapts linear layers only")


def _check_shapes(lora: LoRARequest, shapes: dict[str, dict[str, tuple[int, ...]]],
                  targets: dict[str, tuple[int, int]], max_rank: int) -> None:
    if not shapes:
        raise LoRAError(lora, f"{WEIGHTS_FILE} holds no LoRA weights")
    for module, ab in sorted(shapes.items()):
        if module not in targets:
            kinds = sorted({m.rsplit(".", 1)[-1] for m in targets})
            raise LoRAError(lora, f"targets module {module!r}, which the model does not have "
                                  f"as a linear layer (its adaptable modules: "
                                  f"{', '.join(kinds)})")
        if set(ab) != {"a", "b"}:
            missing = "lora_B" if "a" in ab else "lora_A"
            raise LoRAError(lora, f"module {module!r} has no {missing} weight")
        a, b = ab["a"], ab["b"]
        in_f, out_f = targets[module]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise LoRAError(lora, f"module {module!r}: lora_A {list(a)} and lora_B {list(b)} "
                                  "are not [r, in] and [out, r]")
        if a[0] > max_rank:
            raise LoRAError(lora, f"module {module!r} has rank {a[0]}, more than "
                                  f"max_lora_rank {max_rank}")
        if a[1] != in_f or b[0] != out_f:
            raise LoRAError(lora, f"module {module!r}: lora_A {list(a)} and lora_B {list(b)} do "
                                  f"not fit the model's [{out_f}, {in_f}] weight (an adapter "
                                  "for another base model?)")


def _weights_path(lora: LoRARequest) -> Path:
    path = Path(lora.lora_path) / WEIGHTS_FILE
    if not path.is_file():
        raise LoRAError(lora, f"{WEIGHTS_FILE} is missing")
    return path


def load_adapter(lora: LoRARequest, targets: dict[str, tuple[int, int]], max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """The adapter's weights on the host in ``dtype`` (B times the scale), every part checked
    first (``LoRAError`` naming the adapter and the fault)."""
    from safetensors.torch import load_file
    cfg = read_config(lora)
    try:
        tensors = load_file(_weights_path(lora))
    except LoRAError:
        raise
    except Exception as exc:
        raise LoRAError(lora, f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, which = _module_of(lora, key)
        parts.setdefault(module, {})[which] = t
    _check_shapes(lora, {m: {w: tuple(t.shape) for w, t in ab.items()}
                         for m, ab in parts.items()}, targets, max_rank)
    adapter = LoRAAdapter(lora)
    for module, ab in parts.items():
        a, b = ab["a"].float(), ab["b"].float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(lora, f"module {module!r} has non-finite weights")
        b = b * _scale(cfg, a.shape[0])
        adapter.modules[module] = LoRAModule(a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return adapter
