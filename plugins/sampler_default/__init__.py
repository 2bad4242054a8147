"""The default sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.
Fully vectorized over the batch; the only per-row work is filling seeded rows' noise."""

from __future__ import annotations

from collections.abc import Iterator

from corellm import hookimpl
from corellm.components import BuildContext, SamplerOptions, SamplerSpec


def _make(options: SamplerOptions, ctx: BuildContext):
    from corellm_plugins.sampler_default.sampler import DefaultSampler
    return DefaultSampler(ctx.platform.ops if ctx.platform is not None else None)


@hookimpl
def corellm_samplers() -> Iterator[SamplerSpec]:
    yield SamplerSpec(name="default", factory=_make,
                      summary="Greedy / temperature / top-k / top-p / min-p, seeds, logprobs.")
