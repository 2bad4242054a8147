"""Building blocks shared by model plugins (normalization, activations, rotary embeddings,
attention glue, tensor-parallel linear and embedding layers, the decoder-LM shell, building on
the meta device and weight loading). Model plugins compose these rather than copying them
(docs/plugins.md, "A model"); a model built from the parallel layers runs tensor-parallel."""

from corellm.layers.attention import Attention, bind_kv_caches
from corellm.layers.layers import ACTIVATIONS, RMSNorm, SiluAndMul, get_activation, load_shard
from corellm.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                   ParallelLMHead, QKVParallelLinear, ReplicatedLinear,
                                   RowParallelLinear, VocabParallelEmbedding)
from corellm.layers.loading import (as_tensor, load_weights, materialize, narrow_weight,
                                    weight_shape)
from corellm.layers.model import DecoderForCausalLM
from corellm.ops import REFERENCE_OPS, DeviceOps, OpsModule, bind_ops
from corellm.layers.rotary import RotaryEmbedding, get_rope

__all__ = ["ACTIVATIONS", "REFERENCE_OPS", "Attention", "ColumnParallelLinear",
           "DecoderForCausalLM", "DeviceOps", "OpsModule", "bind_ops",
           "LinearBase", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
           "RMSNorm", "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
           "VocabParallelEmbedding", "as_tensor", "bind_kv_caches", "get_activation", "get_rope",
           "load_shard", "load_weights", "materialize", "narrow_weight", "weight_shape"]
