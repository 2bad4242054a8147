"""A sampler wrapper: bans a configured list of token ids in every request, then hands the
logits to the sampler it wraps (``default`` unless its ``delegate`` sub-section names another),
which does the sampling with its own options.

The bans travel in the metadata: each row's ``banned_token_ids`` gets the configured ids added,
and the delegate, like every sampler, must apply them. The logprobs the delegate reports are
therefore the model's, as for the stop tokens that ``min_tokens`` bans."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from pydantic import Field, NonNegativeInt

from corellm import hookimpl
from corellm.components import BuildContext, SamplerOptions, SamplerSpec, delegate_field
from corellm.errors import OptionError, PluginError
from corellm.sampling import SamplingMetadata, find_banned
from corellm.wrappers import SamplerWrapper

CORELLM_PLUGIN_API = "1.7"


class BanOptions(SamplerOptions):
    name: str = "ban_tokens"
    token_ids: list[NonNegativeInt] = Field(
        default_factory=list, description="Token ids no request may sample.")
    delegate: SamplerOptions = delegate_field("sampler")


class BanTokensSampler(SamplerWrapper):
    def __init__(self, inner, token_ids: list[int], delegate: str) -> None:
        super().__init__(inner)
        self.token_ids = sorted(set(token_ids))
        self.delegate = delegate

    def __call__(self, logits, metadata: SamplingMetadata):
        if not self.token_ids:
            return super().__call__(logits, metadata)
        core = metadata.banned_token_ids            # min_tokens' stop tokens, per row
        banned = {row: core.get(row, []) + self.token_ids for row in range(metadata.num_rows)}
        ours = dataclasses.replace(metadata, banned_token_ids=banned)
        out = super().__call__(logits, ours)
        # The model runner checks the bans it made; these are ours to check.
        hit = find_banned(out.sampled_token_ids, ours)
        if hit is not None:
            raise PluginError(f"sampler.delegate: {self.delegate} sampled token {hit[1]}, "
                              f"which sampler.token_ids bans; a sampler must apply "
                              f"SamplingMetadata.banned_token_ids (docs/plugins.md, "
                              f"'A sampler')")
        return out


def make_ban_tokens(options: BanOptions, ctx: BuildContext) -> BanTokensSampler:
    vocab = ctx.arch.vocab_size if ctx.arch is not None else None
    if vocab is not None and any(t >= vocab for t in options.token_ids):
        raise OptionError("token_ids", f"{max(options.token_ids)} is not a token id: the "
                                       f"model's vocabulary has {vocab}")
    delegate = ctx.registry.get("sampler", options.delegate.name).describe()
    return BanTokensSampler(ctx.build_delegate(options), options.token_ids, delegate)


@hookimpl
def corellm_samplers() -> Iterator[SamplerSpec]:
    yield SamplerSpec(name="ban_tokens", factory=make_ban_tokens, options=BanOptions,
                      summary="Bans token ids, then samples with the sampler it wraps.")
