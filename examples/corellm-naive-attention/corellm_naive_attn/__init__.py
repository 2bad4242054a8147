"""A naive attention backend for corellm, packaged as an out-of-tree plugin.

Once the package is installed, corellm registers the attention backend ``naive`` (select it with
``attention: {name: naive}``). It attends one request at a time with an explicit matmul and
softmax: slow, but short enough to read in one sitting. The code is in ``backend.py``, which the
factory imports, so discovering the plugin does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from corellm import hookimpl
from corellm.components import AttentionBackendSpec, AttentionOptions, BuildContext

__version__ = "0.1.0"

BACKEND_NAME = "naive"


class NaiveAttentionOptions(AttentionOptions):
    compute_dtype: Literal["float32", "model"] = Field(
        "float32", description="dtype of the scores, softmax and weighted sum: float32, or the "
                               "model's dtype (less temporary memory with bfloat16, less exact).")


def _make(options: AttentionOptions, ctx: BuildContext):
    from corellm_naive_attn.backend import NaiveAttentionBackend  # imports torch

    assert isinstance(options, NaiveAttentionOptions)
    return NaiveAttentionBackend(options.compute_dtype)


@hookimpl
def corellm_attention_backends() -> Iterator[AttentionBackendSpec]:
    yield AttentionBackendSpec(name=BACKEND_NAME, factory=_make, options=NaiveAttentionOptions,
                               summary="Paged KV cache, one request at a time (reference code).")
