"""Turns a SchedulerOutput into input tensors and attention metadata, runs the model, samples.

Per-request state (token ids, block ids, progress) persists across steps and is updated from the
deltas in each plan; only the flat per-step arrays are rebuilt, with vectorized numpy (one Python
iteration per request, never per token).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from corellm.attention import (AttentionBuildLimits, BatchOrder, CommonAttentionMetadata,
                               KVCacheSpec)
from corellm.components import BuildContext
from corellm.config import EngineConfig
from corellm.distributed import SINGLE, ParallelContext
from corellm.deprecation import acting_plugin
from corellm.errors import CheckpointError, ConfigError, CorellmError, PluginError
from corellm.interfaces import AttentionLayerSpec, CausalLM, ModelInfo
from corellm.model_config import iter_weights
from corellm.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from corellm.platforms import Platform, StepInputs
from corellm.plugins import Registry
from corellm.setup import EngineSetup
from corellm.worker.attention_choice import predicted_attention_layers, select_attention_backend
from corellm.logits_processors import enabled_logits_processors
from corellm.worker.logits_processing import LogitsProcessorSet
from corellm.worker.request_state import CachedRequestState, sampling_metadata
from corellm.sampling import find_banned

logger = logging.getLogger(__name__)


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
        # Only the rank that samples applies logits processors (and compiles their grammars).
        self.logits_processors = LogitsProcessorSet(
            enabled_logits_processors(config, registry) if parallel.is_driver else [], ctx)
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
        processors = self.logits_processors
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                processors.remove(state)
        for new in so.scheduled_new_reqs:
            state = self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                new.num_computed_tokens, new.sampling_params, new.eos_token_id)
            processors.add(state)
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
        # A row a logits processor is not ready for (its grammar still compiling) is not
        # sampled: the request computes its last token again next step, the batch goes on.
        processors = self.logits_processors
        waiting = processors.deferred(states)
        deferred = [states[i].req_id for i in waiting]
        if waiting:
            keep = [i for i in range(len(states)) if i not in set(waiting)]
            states = [states[i] for i in keep]
            if not states:
                return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], timings=timings,
                                         deferred=deferred)
            logits = logits[torch.tensor(keep, device=logits.device)]
        # Logits processors constrain their rows in place before the sampler sees them; a
        # request one of them cannot serve ends alone (its row is sampled, then dropped).
        failed = processors.apply(logits, states)
        md = sampling_metadata(states, self.model_info.vocab_size, self.device, self.generator)
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
        logprobs = None
        if out.logprobs is not None:
            lp = out.logprobs
            logprobs = LogprobsLists(lp.token_ids.tolist(), lp.logprobs.tolist(),
                                     lp.sampled_ranks.tolist())
        if failed:
            keep = [i for i, s in enumerate(states) if s.req_id not in failed]
            states, sampled = [states[i] for i in keep], [sampled[i] for i in keep]
            if logprobs is not None:
                logprobs = LogprobsLists(*([rows[i] for i in keep] for rows in (
                    logprobs.token_ids, logprobs.logprobs, logprobs.sampled_ranks)))
        for state, token in zip(states, sampled):
            state.token_ids.append(token)
        self.logits_processors.accept(states, sampled)
        timings["sample"] = time.perf_counter() - t0
        return ModelRunnerOutput(req_ids=[s.req_id for s in states], sampled_token_ids=sampled,
                                 logprobs=logprobs, timings=timings, failed=failed,
                                 deferred=deferred)
