"""Linear and embedding layers that shard themselves across tensor-parallel ranks.

A model built from these gets tensor parallelism for nothing: each layer reads the worker's
``ParallelContext`` (``BuildContext.parallel``), allocates only its rank's share, and every
parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies its rank's
slice out of a full checkpoint tensor, so the generic ``corellm.layers.load_weights`` fills a
sharded model from an ordinary checkpoint (and, given lazy safetensors slices, reads only that
slice from disk). With one rank every layer is an ordinary ``F.linear`` / ``F.embedding`` with
the same arithmetic as ``nn.Linear`` / ``nn.Embedding``.

* ``ColumnParallelLinear``: output features split; the output stays split (no communication).
* ``MergedColumnParallelLinear``: several column-parallel projections in one matmul (gate|up).
* ``QKVParallelLinear``: Q, K and V heads split; KV heads replicated when there are fewer of
  them than ranks.
* ``RowParallelLinear``: input features split; one all-reduce of the output.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocabulary rows split (padded to a multiple
  of the ranks); the embedding all-reduces, the head gathers logits on rank 0 only.

The pattern (each parameter owns its loader) follows nano-vllm's ``layers/linear.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from corellm.platforms.distributed import SINGLE, ParallelContext, divide, kv_head_split
from corellm.layers.loading import narrow_weight, weight_shape
from corellm.ops import OpsModule
from corellm.quant import QuantizedTensor, QuantizedWeight


def _check(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"{what}: checkpoint slice of shape {tuple(loaded.shape)} does not fit "
                         f"the parameter's {tuple(param.shape)}")


def _param(*shape: int) -> nn.Parameter:
    # Built on the meta device by the model factories, then materialized (no random init).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class QuantizableWeight:
    """Mixin of the layers whose weight may stay quantized (``corellm.quant``): a checkpoint
    tensor that comes as a ``QuantizedTensor`` is kept as a part (its row range) instead of
    being copied into the float weight; ``corellm.layers.quantize.finish_loading`` then makes
    the parts the layer's ``qweight`` and drops the float weight."""

    qweight: QuantizedWeight | None = None

    def _store(self, param: nn.Parameter, offset: int, t: Any, what: str) -> None:
        rows = weight_shape(t)[0]
        _check(param.data[offset:offset + rows], t, what)
        if isinstance(t, QuantizedTensor):
            if param is not getattr(self, "weight", None):
                raise ValueError(f"{what}: a {t.qtype} tensor for a parameter other than the "
                                 "weight")
            self.__dict__.setdefault("_qparts", {})[offset] = t
        else:
            param.data[offset:offset + rows].copy_(t)


class LinearBase(QuantizableWeight, OpsModule, nn.Module):
    """``y = x @ weight.T (+ bias)`` on this rank's ``weight`` [out, in]; ``linear`` is the one
    matmul, run by the platform's ``ops.linear`` (the CPU platform's packed-weight GEMMs).
    ``local_output``: the forward is that matmul alone (no collective after it), so a platform
    may fuse the layers around it (``ops.linear_normed``, ``ops.linear_silu_mul``).

    ``output_part(shard_id)`` and ``input_part()`` say which rows and columns of a full
    checkpoint tensor this rank holds, and where: the weight loaders' slicing, which LoRA
    adapters' B and A are sliced by too. ``lora``: the layer's LoRA slots
    (``corellm.lora.LoRALayer``) when the engine serves adapters; ``linear`` then adds the
    step's adapters' products (``ops.lora_linear``)."""

    lora: Any = None

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.tp_rank, self.tp_size = parallel.tp_rank, parallel.tp_size
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        self.weight.takes_quantized = True
        if bias:
            self.bias = _param(out_features)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.qweight is not None:
            y = self.ops.quantized_linear(self, x, bias)
        else:
            y = self.ops.linear(self, x, bias)
        lora = self.lora
        if lora is not None and lora.batch.groups:
            y = self.ops.lora_linear(y, x, lora)
        return y

    @property
    def lora_active(self) -> bool:
        """Adapters run in this step's products: the layer's matmul is then not fused with
        the layers around it (their fused kernels know nothing of the adapters)."""
        return self.lora is not None and bool(self.lora.batch.groups)

    def output_part(self, shard_id: Any = None) -> tuple[int, int, int]:
        """``(offset, start, size)``: this rank holds rows ``[start, start + size)`` of the full
        checkpoint tensor of part ``shard_id`` at rows ``[offset, offset + size)`` of its
        weight. Every row, for a layer whose output is not split."""
        return 0, 0, self.out_features

    def input_part(self) -> tuple[int, int]:
        """``(start, size)``: the columns of the full checkpoint tensor this rank holds. Every
        column, for a layer whose input is not split."""
        return 0, self.in_features

    @property
    def local_output(self) -> bool:
        """The forward is the matmul alone: a column-parallel or replicated layer whose class
        keeps that forward (a subclass with its own forward, or a row-parallel layer's
        all-reduce, is not)."""
        return type(self).forward in (ColumnParallelLinear.forward, ReplicatedLinear.forward)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__(in_features, out_features, bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        t = narrow_weight(loaded, 0, 0, weight_shape(loaded)[0])
        self._store(param, 0, t, "replicated linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays split (feed it to a row-parallel
    layer, or gather it)."""


    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__(in_features, divide(out_features, parallel.tp_size, "output features"),
                         bias, parallel)

    def output_part(self, shard_id: Any = None) -> tuple[int, int, int]:
        return 0, self.tp_rank * self.out_features, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _, start, size = self.output_part()
        t = narrow_weight(loaded, 0, start, size)
        self._store(param, 0, t, "column-parallel linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul, e.g. gate and up:
    checkpoint tensor ``shard_id`` (its index in ``output_sizes``) fills its rank's rows of its
    part."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 parallel: ParallelContext = SINGLE) -> None:
        self.output_sizes = [divide(s, parallel.tp_size, "output features")
                             for s in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, parallel)

    def output_part(self, shard_id: Any = None) -> tuple[int, int, int]:
        if shard_id is None:
            raise ValueError("a merged projection loads one part at a time (shard_id)")
        size = self.output_sizes[shard_id]
        return sum(self.output_sizes[:shard_id]), self.tp_rank * size, size

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        offset, start, size = self.output_part(shard_id)
        t = narrow_weight(loaded, 0, start, size)
        self._store(param, offset, t, f"part {shard_id} of a merged linear")


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul, attention heads split across ranks: rank r holds
    query heads [r*H/tp, (r+1)*H/tp) and its KV heads, or, with fewer KV heads than ranks, the
    KV head its query heads read (each replicated on tp/Hkv ranks). ``shard_id``: "q", "k",
    "v"."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, parallel: ParallelContext = SINGLE) -> None:
        tp = parallel.tp_size
        self.head_size = head_size
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads, self.kv_replicas = kv_head_split(num_kv_heads, tp)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, parallel)

    def output_part(self, shard_id: Any = None) -> tuple[int, int, int]:
        if shard_id == "q":
            offset, size, index = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, index = self.kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return offset, index * size, size

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        offset, start, size = self.output_part(shard_id)
        t = narrow_weight(loaded, 0, start, size)
        self._store(param, offset, t, f"{shard_id} of a QKV projection")


class RowParallelLinear(LinearBase):
    """Input features split across ranks (the input is a column-parallel layer's split output);
    the partial products are summed by one all-reduce, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__(divide(in_features, parallel.tp_size, "input features"), out_features,
                         bias, parallel)

    def input_part(self) -> tuple[int, int]:
        return self.tp_rank * self.in_features, self.in_features

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if param.dim() == 1:            # the bias: whole on every rank
            t = narrow_weight(loaded, 0, 0, weight_shape(loaded)[0])
        else:
            start, size = self.input_part()
            t = narrow_weight(loaded, 1, start, size)
        self._store(param, 0, t, "row-parallel linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.linear(x, self.bias)
        out = self.parallel.all_reduce(self.linear(x, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(QuantizableWeight, OpsModule, nn.Module):
    """Vocabulary rows split across ranks, each holding ``ceil(V / tp)`` (rows past V are
    zero); a token outside a rank's rows embeds to zero there, and one all-reduce sums the
    ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.tp_rank, self.tp_size = parallel.tp_rank, parallel.tp_size
        self.num_embeddings = num_embeddings
        self.rows = -(-num_embeddings // self.tp_size)
        self.start = self.tp_rank * self.rows
        self.end = min(self.start + self.rows, num_embeddings)
        self.weight = _param(self.rows, embedding_dim)
        self.weight.weight_loader = self.weight_loader
        self.weight.takes_quantized = True

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        shape = weight_shape(loaded)
        if shape[0] != self.num_embeddings or tuple(shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"vocabulary weight: checkpoint shape {tuple(shape)} != "
                             f"({self.num_embeddings}, {param.shape[1]})")
        n = max(0, self.end - self.start)
        t = narrow_weight(loaded, 0, self.start, n)
        self._store(param, 0, t, "vocabulary weight")
        if isinstance(t, QuantizedTensor) and n < self.rows:     # padding rows: zero blocks
            pad = QuantizedTensor(t.data.new_zeros(self.rows - n, t.data.shape[1]), t.qtype,
                                  t.cols)
            self._store(param, n, pad, "vocabulary weight")
        elif not isinstance(t, QuantizedTensor):
            param.data[n:].zero_()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:          # the rows looked up, dequantized
            return self.qweight.embed(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._embed(input_ids)
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(inside, input_ids - self.start, 0)
        out = self._embed(local) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over a vocabulary split like ``VocabParallelEmbedding`` (so the
    two can share one weight): each rank computes its rows' logits, and rank 0 alone gathers
    them (only rank 0 samples); other ranks return None."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__(num_embeddings, embedding_dim, parallel)
        if bias:
            self.bias = _param(self.rows)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if param.dim() == 1:
            n = max(0, self.end - self.start)
            param.data[:n].copy_(narrow_weight(loaded, 0, self.start, n))
            param.data[n:].zero_()
        else:
            super().weight_loader(param, loaded, shard_id)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.qweight is not None:
            return self.ops.quantized_linear(self, x, bias)
        return self.ops.linear(self, x, bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:   # type: ignore[override]
        logits = self.linear(hidden, self.bias)
        if self.tp_size == 1:
            return logits
        full = self.parallel.gather_last_dim(logits)
        return None if full is None else full[..., :self.num_embeddings]
