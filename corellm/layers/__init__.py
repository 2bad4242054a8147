"""Building blocks shared by model plugins (normalization, rotary embeddings, attention glue,
weight-loading helpers). Model plugins compose these rather than copying them."""

from corellm.layers.attention import Attention
from corellm.layers.layers import RMSNorm, SiluAndMul, load_shard
from corellm.layers.rotary import RotaryEmbedding, get_rope

__all__ = ["Attention", "RMSNorm", "RotaryEmbedding", "SiluAndMul", "get_rope", "load_shard"]
