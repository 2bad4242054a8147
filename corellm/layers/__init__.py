"""Building blocks shared by model plugins (normalization, activations, rotary embeddings,
attention glue, the decoder-LM shell, building on the meta device and weight loading). Model
plugins compose these rather than copying them (docs/plugins.md, "A model")."""

from corellm.layers.attention import Attention, bind_kv_caches
from corellm.layers.layers import ACTIVATIONS, RMSNorm, SiluAndMul, get_activation, load_shard
from corellm.layers.loading import load_weights, materialize
from corellm.layers.model import DecoderForCausalLM
from corellm.layers.rotary import RotaryEmbedding, get_rope

__all__ = ["ACTIVATIONS", "Attention", "DecoderForCausalLM", "RMSNorm", "RotaryEmbedding",
           "SiluAndMul", "bind_kv_caches", "get_activation", "get_rope", "load_shard",
           "load_weights", "materialize"]
