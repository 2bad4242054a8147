"""Turns a SchedulerOutput into input tensors and attention metadata, runs the model, samples.

Per-request state (token ids, block ids, progress) persists across steps and is updated from the
deltas in each plan; only the flat per-step arrays are rebuilt, with vectorized numpy (one Python
iteration per request, never per token).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch

from corellm.attention import (AttentionBuildLimits, BatchOrder, CommonAttentionMetadata,
                               KVCacheSpec)
from corellm.components import AttentionOptions, BuildContext
from corellm.config import EngineConfig
from corellm.distributed import SINGLE, ParallelContext
from corellm.deprecation import acting_plugin
from corellm.errors import CheckpointError, ConfigError, CorellmError, PluginError
from corellm.interfaces import AttentionLayerSpec, CausalLM, ModelInfo
from corellm.model_config import ModelArchConfig, iter_weights
from corellm.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from corellm.platforms import Platform, StepInputs
from corellm.plugins import RegisteredComponent, Registry
from corellm.setup import EngineSetup
from corellm.sampling import SamplingMetadata, find_banned
from corellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


@dataclass
class SelectedAttention:
    entry: RegisteredComponent
    options: AttentionOptions
    why: str                     # how it was chosen, for the start-up log line
    backend: Any = None          # the instance, once made


_OLD_INTERFACE = ("It was written for an attention interface older than plugin API 1.0, "
                  "which replaced kv_cache_shape(...) with kv_cache_spec(layer, num_blocks, "
                  "block_size, dtype) -> KVCacheSpec and build_metadata(common) with "
                  "make_metadata_builder(limits) (docs/plugins.md, \"An attention backend\"; "
                  "CHANGELOG.md)")


def select_attention_backend(config: EngineConfig, registry: Registry, setup: EngineSetup,
                             ctx: BuildContext, layers: Sequence[AttentionLayerSpec] = (),
                             ) -> SelectedAttention:
    """The backend to run: the first of the setup's candidates (``EngineSetup.
    attention_candidates``: the named backend, or ``auto``'s by priority for the platform's
    device) that accepts every one of ``layers`` in the setup's dtype (the layers the
    checkpoint's config predicts, so a head size the best backend lacks falls back to the next
    one), made with ``ctx``."""
    auto = config.attention.name == "auto"
    skipped = list(setup.attention_skipped)
    device, dtype = ctx.device, ctx.dtype
    for name in setup.attention_candidates:
        entry = registry.get("attention", name)
        options = config.attention if not auto else entry.spec.options(name=name)
        why = (f"attention.name: auto -> {name} on {device}" if auto
               else f"attention.name: {name}")
        cand = SelectedAttention(entry, options, why)
        cand.backend = _make_backend(cand, ctx)
        refusal = None
        if auto and layers:
            refusal = next((r for layer in layers
                            if (r := cand.backend.supports(layer, dtype, device))), None)
        if refusal is None:
            if skipped:
                cand.why += f" (not {'; not '.join(skipped)})"
            return cand
        skipped.append(f"{name}: {refusal}")
    raise ConfigError([("attention.name", f"auto: no installed attention backend can run this "
                                          f"model on {device}"
                                          + "".join(f"; {s}" for s in skipped))])


def _make_backend(selected: SelectedAttention, ctx: BuildContext) -> Any:
    """The backend from its factory; a class still written for an attention interface older than
    plugin API 1.0 (no ``kv_cache_spec``, or a ``build_metadata`` the runner would ignore) is a PluginError
    that names the plugin and the fix."""
    owner = selected.entry.describe()
    try:
        backend = ctx.build(selected.options)
    except PluginError as exc:
        cause = exc.__cause__
        if not (isinstance(cause, TypeError) and "abstract" in str(cause)):
            raise
        raise PluginError(f"{owner}: {cause}. {_OLD_INTERFACE}") from cause
    if hasattr(backend, "build_metadata"):
        raise PluginError(f"{owner}: {type(backend).__name__} defines build_metadata(), which "
                          f"nothing calls any more. {_OLD_INTERFACE}")
    return backend


def predicted_attention_layers(arch: ModelArchConfig, parallel: ParallelContext,
                               max_model_len: int) -> list[AttentionLayerSpec]:
    """The attention layers a checkpoint's config implies for one rank (its heads, KV heads,
    head size, windows shorter than ``max_model_len``), before any model is built: what
    ``auto`` checks its candidates against. The built model's own specs are checked again."""
    tp = parallel.tp_size
    heads = max(1, arch.num_attention_heads // tp)
    kv_heads = max(1, arch.num_key_value_heads // tp)
    layers = []
    for i in range(arch.num_hidden_layers):
        window = arch.layer_sliding_window(i)
        layers.append(AttentionLayerSpec(
            i, heads, kv_heads, arch.head_dim, arch.head_dim ** -0.5,
            sliding_window=window if window is not None and window < max_model_len else None))
    return layers


class CachedRequestState:
    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "block_ids", "num_computed_tokens",
                 "params", "min_tokens_banned", "prompt_token_set")

    def __init__(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
                 block_ids: list[int], num_computed_tokens: int, params: SamplingParams,
                 eos_token_id: int | None) -> None:
        self.req_id = req_id
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens
        self.params = params
        # Tokens that would stop the request, banned while fewer than min_tokens are generated.
        banned = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            banned.append(eos_token_id)
        self.min_tokens_banned = banned if params.min_tokens > 0 else []
        # The distinct prompt token ids (sorted int64), built on first use by a request with a
        # repetition penalty; the prompt never changes while the state lives.
        self.prompt_token_set: np.ndarray | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class ModelRunner:
    """One worker's model, KV cache and sampler, on its ``platform``'s device."""

    def __init__(self, config: EngineConfig, registry: Registry, setup: EngineSetup,
                 platform: Platform, parallel: ParallelContext = SINGLE,
                 local_rank: int = 0) -> None:
        self.config = config
        self.setup = setup
        self.platform = platform
        self.device = platform.device(local_rank)
        self.dtype = setup.torch_dtype
        self.block_size = setup.block_size
        self.parallel = parallel
        self.model_entry = registry.model_for(setup.arch.architectures,
                                              config.model.implementation)
        ctx = BuildContext(config=config, registry=registry, arch=setup.arch, setup=setup,
                           device=self.device, dtype=self.dtype, platform=platform,
                           max_model_len=setup.max_model_len, parallel=parallel)
        selected = select_attention_backend(
            config, registry, setup, ctx,
            predicted_attention_layers(setup.arch, parallel, setup.max_model_len))
        self.attn_entry = selected.entry
        logger.info("attention backend %r (%s): %s", selected.entry.spec.name,
                    selected.entry.plugin.describe(), selected.why)
        ctx.attention_backend = self.attn_backend = selected.backend
        model_entry = self.model_entry
        try:
            with acting_plugin(model_entry.plugin):
                model = model_entry.spec.factory(setup.arch, ctx)
        except CheckpointError as exc:     # e.g. an unsupported activation: name the file
            raise CheckpointError(f"{setup.source}: {exc} (model {model_entry.spec.name!r} "
                                  f"of {model_entry.plugin.describe()})") from exc
        except CorellmError:
            raise
        except Exception as exc:
            raise PluginError(f"{model_entry.describe()} could not be built for "
                              f"{setup.source}: {exc!r}") from exc
        if not isinstance(model, CausalLM):
            raise TypeError(f"{model_entry.plugin.describe()}: model factory returned "
                            f"{type(model).__name__}, which does not implement CausalLM")
        # Refused layers fail here, before the weights are read.
        self.attn_layers = self._check_attention_layers(model)
        # Models that load through corellm.layers.load_weights take lazy checkpoint slices:
        # each rank then reads only its shard of every weight.
        model.load_weights(iter_weights(setup.model_path,
                                        lazy=getattr(model, "lazy_weights", False)))
        platform.prepare_model(model)         # the platform's ops (and packed weights)
        self.model: CausalLM = model.eval()
        self.limits = AttentionBuildLimits(
            block_size=self.block_size, max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            max_model_len=setup.max_model_len, device=self.device)
        self.attn_builder = self.attn_backend.make_metadata_builder(self.limits)
        self.batch_order = BatchOrder(self.attn_builder.batch_order)
        self.stepper = platform.make_stepper(self.model, self.device, self.limits)
        self.stepper.attn_builder = self.attn_builder
        self.sampler_entry = registry.get("sampler", config.sampler.name)
        self.sampler = ctx.build(config.sampler)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self._pending: tuple | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model.seed)
        self.model_info = ModelInfo(vocab_size=setup.arch.vocab_size,
                                    max_model_len=setup.max_model_len,
                                    architecture=(setup.arch.architectures or ("?",))[0])

    # ------------------------------------------------------------------ attention and KV cache
    def _check_attention_layers(self, model: CausalLM) -> list[AttentionLayerSpec]:
        """Every layer's spec, each accepted by the backend (a refusal is a config error at
        start-up naming the backend, its plugin, the layer and the reason). A window at least
        as long as the longest sequence is full attention, and is checked as such."""
        backend = self.attn_entry
        max_len = self.setup.max_model_len
        try:
            layers = model.attention_layers()
        except ValueError as exc:      # the default found no corellm.layers.Attention modules
            raise PluginError(f"model {self.model_entry.spec.name!r} of "
                              f"{self.model_entry.plugin.describe()}: {exc}") from exc
        for layer in layers:
            checked = layer
            if layer.sliding_window is not None and layer.sliding_window >= max_len:
                checked = replace(layer, sliding_window=None)
            reason = self.attn_backend.supports(checked, self.dtype, self.device)
            if reason:
                hint = ""
                if checked.sliding_window is not None and not self.attn_backend.supports(
                        replace(checked, sliding_window=None), self.dtype, self.device):
                    hint = (f"; model.max_model_len <= {checked.sliding_window} makes the "
                            "window full attention")
                raise ConfigError([("attention.name",
                                    f"{backend.spec.name!r} ({backend.plugin.describe()}) cannot "
                                    f"run layer {layer.layer_idx} of {self.setup.source} in "
                                    f"{str(self.dtype).replace('torch.', '')} on {self.device}: "
                                    f"{reason}{hint}")])
        return layers

    def kv_cache_specs(self, num_blocks: int) -> list[KVCacheSpec]:
        return [self.attn_backend.kv_cache_spec(layer, num_blocks, self.block_size, self.dtype)
                for layer in self.attn_layers]

    def kv_cache_bytes_per_block(self) -> int:
        return sum(spec.nbytes for spec in self.kv_cache_specs(1))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the pool (its size checked against free memory by the worker first), one
        tensor per layer as the backend specifies, zero-filled only where it asks."""
        zeros = self.platform.zeros
        self.kv_caches = [zeros(spec.shape, spec.dtype, self.device) if spec.zero_init
                          else torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                          for spec in self.kv_cache_specs(num_blocks)]
        self.model.bind_kv_caches(self.kv_caches)

    def warm_up(self) -> None:
        """After the KV cache is bound: the platform's warm-up (graph capture on CUDA)."""
        self.platform.warm_up(self.stepper)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward of the largest step the scheduler can plan (``max_num_batched_tokens``
        prompt tokens, in sequences of at most ``max_model_len``), over a scratch KV cache of
        just the blocks it needs, which is freed after: what a platform that sizes the KV cache
        from the memory left (``Platform.kv_cache_budget``) measures. Returns the scratch
        cache's bytes, which are part of any peak measured around it but not of the steps'."""
        total = max(1, min(self.setup.max_num_batched_tokens,
                           self.setup.max_num_seqs * self.setup.max_model_len))
        lens = []
        while sum(lens) < total:
            lens.append(min(self.setup.max_model_len, total - sum(lens)))
        bs = self.block_size
        nblocks = [-(-n // bs) for n in lens]
        self.initialize_kv_cache(sum(nblocks))
        scratch = sum(t.numel() * t.element_size() for t in self.kv_caches)
        try:
            starts = np.cumsum([0] + nblocks[:-1])
            block_table = np.zeros((len(lens), max(nblocks)), dtype=np.int64)
            for i, (s0, nb) in enumerate(zip(starts.tolist(), nblocks)):
                block_table[i, :nb] = np.arange(s0, s0 + nb)
            n_sched = np.asarray(lens, dtype=np.int64)
            cu = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(n_sched, out=cu[1:])
            req_of_token = np.repeat(np.arange(len(lens)), n_sched)
            positions = np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1][req_of_token]
            slots = block_table[req_of_token, positions // bs] * bs + positions % bs
            zeros = np.zeros(len(lens), dtype=np.int64)
            common = CommonAttentionMetadata(
                num_reqs=len(lens), num_decodes=0, num_actual_tokens=int(cu[-1]),
                query_start_loc=cu, seq_lens=n_sched, context_lens=zeros,
                block_table=block_table, slot_mapping=slots, max_seq_len=int(n_sched.max()),
                max_query_len=int(n_sched.max()), block_size=bs)
            md = self.attn_builder.build(common)
            inputs = StepInputs(np.zeros(int(cu[-1]), dtype=np.int64), positions,
                                cu[1:] - 1, md, len(lens), 0)
            self.stepper.forward(inputs)
        finally:            # release the scratch cache before the real one is allocated
            self.kv_caches = []
            self.model.bind_kv_caches([torch.empty(0, dtype=self.dtype, device=self.device)
                                       for _ in self.attn_layers])
        return scratch

    # ------------------------------------------------------------------ one step
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                new.num_computed_tokens, new.sampling_params, new.eos_token_id)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        t0 = time.perf_counter()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            self._pending = None
            return
        # The batch in the order the backend's metadata builder asks for (by default decodes
        # first, shortest context first, then prefills: similar lengths batch together).
        reqs = self.requests
        order = list(so.num_scheduled_tokens.items())
        if self.batch_order is BatchOrder.DECODES_FIRST:
            order.sort(key=lambda kv: (kv[1] != 1, reqs[kv[0]].num_computed_tokens))
        states = [reqs[rid] for rid, _ in order]
        n_sched = np.fromiter((n for _, n in order), dtype=np.int64, count=len(order))
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64,
                             count=len(states))
        num_reqs = len(states)
        not_decode = np.flatnonzero(n_sched != 1)
        num_decodes = int(not_decode[0]) if len(not_decode) else num_reqs
        total = int(n_sched.sum())
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(n_sched, out=cu[1:])

        ids: list[int] = []
        for s, start, n in zip(states, starts.tolist(), n_sched.tolist()):
            ids.extend(s.token_ids[start:start + n])
        req_of_token = np.repeat(np.arange(num_reqs), n_sched)
        positions = np.arange(total, dtype=np.int64) - cu[:-1][req_of_token] + starts[req_of_token]
        seq_lens = starts + n_sched
        bs = self.block_size
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        for i, s in enumerate(states):
            block_table[i, :len(s.block_ids)] = s.block_ids
        slot_mapping = block_table[req_of_token, positions // bs] * bs + positions % bs

        # Rows that reach the end of their known tokens sample; partial prefill chunks do not.
        num_tokens = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=num_reqs)
        samples = seq_lens == num_tokens
        sample_rows = np.flatnonzero(samples)
        logits_indices = cu[1:][sample_rows] - 1

        common = CommonAttentionMetadata(
            num_reqs=num_reqs, num_decodes=num_decodes, num_actual_tokens=total,
            query_start_loc=cu, seq_lens=seq_lens, context_lens=starts, block_table=block_table,
            slot_mapping=slot_mapping, max_seq_len=int(seq_lens.max()),
            max_query_len=int(n_sched.max()), block_size=bs)
        backend_md = self.attn_builder.build(common)
        inputs = StepInputs(np.asarray(ids, dtype=np.int64), positions, logits_indices,
                            backend_md, num_reqs, num_decodes)
        sample_states = [states[i] for i in sample_rows.tolist()]
        t1 = time.perf_counter()

        # With tensor parallelism only rank 0 gets the logits (the others get None).
        logits = self.stepper.forward(inputs)
        t2 = time.perf_counter()
        self._pending = (logits, sample_states, {"prepare_inputs": t1 - t0, "forward": t2 - t1})

    def discard_pending(self) -> None:
        """Drop the last forward's logits (ranks > 0 do not sample)."""
        self._pending = None

    def add_sampled_tokens(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Append tokens sampled elsewhere (by rank 0) to the requests' states."""
        reqs = self.requests
        for rid, token in zip(req_ids, token_ids):
            state = reqs.get(rid)
            if state is not None:
                state.token_ids.append(token)

    @torch.inference_mode()
    def sample_tokens(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self._pending is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        logits, states, timings = self._pending
        self._pending = None
        t0 = time.perf_counter()
        if not states:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], timings=timings)
        md = self._sampling_metadata(states)
        # The bans as the engine made them (a sampler may change its metadata): usually none.
        bans = ({row: list(ids) for row, ids in md.banned_token_ids.items()}
                if md.banned_token_ids else None)
        out = self.sampler(logits, md)
        sampled = self.stepper.to_host(out.sampled_token_ids)
        banned = None if bans is None else find_banned(sampled, replace(md, banned_token_ids=bans))
        if banned is not None:          # min_tokens would be broken: the plugin is at fault
            row, token = banned
            entry = self.sampler_entry
            raise PluginError(
                f"{entry.describe()} sampled token {token} for request {states[row].req_id!r}, "
                "which is banned for it (SamplingMetadata.banned_token_ids: its min_tokens is "
                "not reached); a sampler must apply banned_token_ids (docs/plugins.md, "
                "'A sampler')")
        for state, token in zip(states, sampled):
            state.token_ids.append(token)
        logprobs = None
        if out.logprobs is not None:
            lp = out.logprobs
            logprobs = LogprobsLists(lp.token_ids.tolist(), lp.logprobs.tolist(),
                                     lp.sampled_ranks.tolist())
        timings["sample"] = time.perf_counter() - t0
        return ModelRunnerOutput(req_ids=[s.req_id for s in states], sampled_token_ids=sampled,
                                 logprobs=logprobs, timings=timings)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.params for s in states]
        n = len(params)
        greedy = [p.greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        vocab = self.model_info.vocab_size
        temperature = top_k = top_p = min_p = None
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            temperature = torch.tensor([0.0 if g else p.temperature for g, p in zip(greedy, params)],
                                       dtype=torch.float32, device=self.device)
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                                     dtype=torch.int64, device=self.device)
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32,
                                     device=self.device)
            if any(p.min_p > 0.0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32,
                                     device=self.device)
            for i, (state, p, g) in enumerate(zip(states, params, greedy)):
                if p.seed is not None and not g:
                    gen = torch.Generator(device=self.device)
                    gen.manual_seed((p.seed * _SEED_MIX + state.num_output_tokens) & _U64)
                    generators[i] = gen
        banned = {i: s.min_tokens_banned for i, s in enumerate(states)
                  if s.min_tokens_banned and s.num_output_tokens < s.params.min_tokens}
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        md = SamplingMetadata(num_rows=n, all_greedy=all_greedy, all_random=all_random,
                              temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              generators=generators, generator=self.generator,
                              banned_token_ids=banned,
                              max_num_logprobs=max(wanted) if wanted else None)
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        if penalized:
            self._add_penalties(md, states, penalized)
        return md

    def _add_penalties(self, md: SamplingMetadata, states: list[CachedRequestState],
                       rows: list[int]) -> None:
        """Fill md's penalty fields; ``rows`` are the rows with a penalty (others stay neutral).

        The (row, token) pairs and output counts are rebuilt every step with vectorized numpy,
        O(output tokens + distinct prompt tokens) of the penalized rows; each request's distinct
        prompt tokens are computed once and kept in its state.
        """
        dev = self.device
        params = [s.params for s in states]

        def column(name: str, neutral: float) -> torch.Tensor | None:
            values = [getattr(p, name) for p in params]
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=dev)

        md.presence_penalties = column("presence_penalty", 0.0)
        md.frequency_penalties = column("frequency_penalty", 0.0)
        md.repetition_penalties = column("repetition_penalty", 1.0)

        # Keys row * V + token, so one np.unique both deduplicates and orders the pairs.
        vocab = self.model_info.vocab_size
        sel = [states[i] for i in rows]
        lens = np.fromiter((s.num_output_tokens for s in sel), dtype=np.int64, count=len(sel))
        out_tokens = np.fromiter(chain.from_iterable(s.token_ids[s.num_prompt_tokens:]
                                                     for s in sel),
                                 dtype=np.int64, count=int(lens.sum()))
        keys = [np.repeat(np.asarray(rows, dtype=np.int64) * vocab, lens) + out_tokens]
        rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
        if rep_rows:
            sets = []
            for i in rep_rows:
                s = states[i]
                if s.prompt_token_set is None:
                    s.prompt_token_set = np.unique(np.asarray(s.token_ids[:s.num_prompt_tokens],
                                                              dtype=np.int64))
                sets.append(s.prompt_token_set)
            plens = np.fromiter((len(t) for t in sets), dtype=np.int64, count=len(sets))
            keys.append(np.repeat(np.asarray(rep_rows, dtype=np.int64) * vocab, plens)
                        + np.concatenate(sets))
        pairs, inverse = np.unique(np.concatenate(keys), return_inverse=True)
        counts = np.bincount(inverse[:len(out_tokens)], minlength=len(pairs)).astype(np.int32)
        md.penalty_rows = torch.from_numpy(pairs // vocab).to(dev)
        md.penalty_token_ids = torch.from_numpy(pairs % vocab).to(dev)
        md.penalty_output_counts = torch.from_numpy(counts).to(dev)
