"""Turns a SchedulerOutput into input tensors and attention metadata, runs the model, samples.

Each running request keeps a row of the persistent batch (``input_batch.InputBatch``: token ids,
block table, progress and sampling parameters in fixed-size arrays) from its first step to its
finish or preemption; each plan changes only what it names (a row filled for a new request, a
block appended to a row, the progress of the scheduled rows), and each step gathers its inputs
from the rows with vectorized numpy (one Python pass over the plan's requests to find their rows,
never one over tokens or block ids). The sampler's tensors are reused while the rows that sample
stay the same requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from dataclasses import replace

import numpy as np
import torch

from corellm.attention import (AttentionBuildLimits, BatchOrder, CommonAttentionMetadata,
                               KVCacheSpec)
from corellm.components import BuildContext
from corellm.config.compose import EngineConfig
from corellm.platforms.distributed import SINGLE, ParallelContext
from corellm.plugins.deprecation import acting_plugin
from corellm.errors import CheckpointError, ConfigError, CorellmError, PluginError
from corellm.interfaces import AttentionLayerSpec, CausalLM, ModelInfo
from corellm.checkpoint.reader import iter_weights
from corellm.layers.quantize import (describe_memory, finish_loading, quantize_linear_layers,
                                     weight_memory)
from corellm.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from corellm.platforms.interface import Platform, StepInputs
from corellm.plugins.discovery import Registry
from corellm.config.setup import EngineSetup
from corellm.worker.attention_choice import predicted_attention_layers, select_attention_backend
from corellm.config.logits_processors import enabled_logits_processors
from corellm.worker.input_batch import InputBatch
from corellm.worker.logits_processing import LogitsProcessorSet
from corellm.worker.request_state import CachedRequestState
from corellm.sampling import SamplingMetadata, find_banned

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
                                        lazy=getattr(model, "lazy_weights", False),
                                        quantized=setup.quantization == "gguf"))
        finish_loading(model)
        if setup.quantization == "int8":
            quantize_linear_layers(model, "int8")
        self.weight_memory = weight_memory(model)
        logger.info("weights (%s): %s", setup.quantization if setup.quantization != "none"
                    else "not quantized", describe_memory(self.weight_memory))
        platform.prepare_model(model)         # the platform's ops (and packed weights)
        self.model: CausalLM = model.eval()
        self.lora = self._make_lora(config) if config.lora.enable else None
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
                                    architecture=(setup.arch.architectures or ("?",))[0],
                                    lora_targets=None if self.lora is None
                                    else dict(self.lora.targets))
        self.batch = InputBatch(setup.max_num_seqs, setup.max_model_len, self.block_size,
                                setup.arch.vocab_size, self.device)

    def _make_lora(self, config: EngineConfig) -> Any:
        """The model's LoRA slots (``corellm.lora.model.LoRAModel``), or a ConfigError naming
        the model plugin that cannot take adapters."""
        from corellm.lora.model import LoRAModel
        lora = config.lora
        try:
            return LoRAModel(self.model, lora.max_loras, lora.max_lora_rank, lora.cpu_loras,
                             self.dtype, self.device)
        except ValueError as exc:
            raise ConfigError([("lora.enable", f"model {self.model_entry.spec.name!r} of "
                                f"{self.model_entry.plugin.describe()}: {exc}")]) from exc

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

    def release(self) -> None:
        """Drop what this runner holds on its device: the model and its weights, the KV cache,
        the stepper (a platform's captured graphs), the attention builder's and the batch's
        buffers. It runs no step after this."""
        self.requests.clear()
        self.kv_caches = []
        self._pending = None
        self.stepper = self.attn_builder = None     # type: ignore[assignment]
        self.batch = self.model = None              # type: ignore[assignment]

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
    def _drop(self, state: CachedRequestState) -> None:
        self.logits_processors.remove(state)
        self.batch.remove(state)

    def _update_states(self, so: SchedulerOutput) -> None:
        reqs, batch = self.requests, self.batch
        for ids in (so.finished_req_ids, so.preempted_req_ids):
            for req_id in ids:
                state = reqs.pop(req_id, None)
                if state is not None:
                    self._drop(state)
        if so.lora_loads:
            self.lora.load(so.lora_loads)
        for new in so.scheduled_new_reqs:
            if new.lora_slot >= 0:
                self.lora.check_slot(new.lora_slot, new.req_id)
            old = reqs.pop(new.req_id, None)
            if old is not None:         # held already (not dropped first): the plan wins
                self._drop(old)
            state = reqs[new.req_id] = CachedRequestState(
                new.req_id, new.token_ids, new.num_prompt_tokens, new.block_ids,
                new.num_computed_tokens, new.sampling_params, new.eos_token_id, new.lora_slot)
            batch.add(state)
            self.logits_processors.add(state)
        row_of = batch.row_of
        for cached in so.scheduled_cached_reqs:       # the running requests given new blocks
            if cached.new_block_ids:
                batch.append_blocks(row_of[cached.req_id], cached.new_block_ids)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        t0 = time.perf_counter()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            self._pending = None
            return
        # The batch in the order the backend's metadata builder asks for (by default decodes
        # first, shortest context first, then prefills: similar lengths batch together).
        batch = self.batch
        scheduled = so.num_scheduled_tokens
        n_sched = np.fromiter(scheduled.values(), dtype=np.int64, count=len(scheduled))
        rows = batch.rows_of(scheduled)
        # Every scheduled request's context, from the plan (same order as the tokens).
        batch.num_computed[rows] = np.fromiter(map(so.num_computed_tokens.__getitem__, scheduled),
                                               dtype=np.int64, count=len(scheduled))
        step = batch.prepare(rows, n_sched, self.batch_order is BatchOrder.DECODES_FIRST)
        common = step.common
        backend_md = self.attn_builder.build(common)
        lora = self.lora is not None and self.lora.set_step(batch.token_lora_slots(step))
        inputs = StepInputs(step.input_ids, step.positions, step.logits_indices, backend_md,
                            common.num_reqs, common.num_decodes, lora)
        t1 = time.perf_counter()

        # With tensor parallelism only rank 0 gets the logits (the others get None).
        logits = self.stepper.forward(inputs)
        t2 = time.perf_counter()
        self._pending = (logits, step.sample_rows,
                         {"prepare_inputs": t1 - t0, "forward": t2 - t1})

    def discard_pending(self) -> None:
        """Drop the last forward's logits (ranks > 0 do not sample)."""
        self._pending = None

    def add_sampled_tokens(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Append tokens sampled elsewhere (by rank 0) to the requests' rows."""
        row_of = self.batch.row_of
        if all(rid in row_of for rid in req_ids):
            rows, tokens = self.batch.rows_of(req_ids), token_ids
        else:
            held = [(row_of[rid], t) for rid, t in zip(req_ids, token_ids) if rid in row_of]
            rows = np.fromiter((r for r, _ in held), dtype=np.int64, count=len(held))
            tokens = [t for _, t in held]
        self.batch.append_tokens(rows, tokens)

    @torch.inference_mode()
    def sample_tokens(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Sample the rows the last forward pass computed: logits processors constrain theirs,
        the sampler samples, the tokens join the batch."""
        if self._pending is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        logits, rows, timings = self._pending
        self._pending = None
        t0 = time.perf_counter()
        states, rows, logits, deferred = self._ready_rows(logits, rows)
        if not len(rows):
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], timings=timings,
                                     deferred=deferred)
        # Logits processors constrain their rows in place before the sampler sees them; a
        # request one of them cannot serve ends alone (its row is sampled, then dropped).
        failed = self.logits_processors.apply(logits, states) if states is not None else {}
        md = self.batch.sampling_metadata(rows, self.generator)
        # The bans as the engine made them (a sampler may change its metadata): usually none.
        bans = md.banned_token_ids and {row: list(ids) for row, ids in
                                        md.banned_token_ids.items()}
        out = self.sampler(logits, md)
        sampled = self.stepper.to_host(out.sampled_token_ids)
        if bans:
            self._check_bans(sampled, replace(md, banned_token_ids=bans), rows)
        lp = out.logprobs
        logprobs = None if lp is None else LogprobsLists(
            lp.token_ids.tolist(), lp.logprobs.tolist(), lp.sampled_ranks.tolist())
        if failed:
            states, sampled, rows, logprobs = _without(failed, states, sampled, rows, logprobs)
        self.batch.append_tokens(rows, sampled)
        if states is not None:
            self.logits_processors.accept(states, sampled)
        timings["sample"] = time.perf_counter() - t0
        return ModelRunnerOutput(req_ids=self.batch.req_ids[rows].tolist(),
                                 sampled_token_ids=sampled, logprobs=logprobs, timings=timings,
                                 failed=failed, deferred=deferred)

    def _ready_rows(self, logits: torch.Tensor, rows: np.ndarray,
                    ) -> tuple[list[CachedRequestState] | None, np.ndarray, torch.Tensor,
                               list[str]]:
        """The rows to sample, their request states where a logits processor constrains some
        request (else None), their logits, and the requests deferred: a row a processor is not
        ready for (its grammar still compiling) is not sampled, and its request computes its
        last token again next step while the batch goes on."""
        processors = self.logits_processors
        if not len(rows) or not processors.num_constrained:
            return None, rows, logits, []
        states = self.batch.states[rows].tolist()
        waiting = processors.deferred(states)
        if not waiting:
            return states, rows, logits, []
        skip = set(waiting)
        keep = [i for i in range(len(states)) if i not in skip]
        deferred = [states[i].req_id for i in waiting]
        if not keep:
            return [], rows[keep], logits, deferred
        return ([states[i] for i in keep], rows[keep], self.batch.select(logits, keep),
                deferred)

    def _check_bans(self, sampled: list[int], md: SamplingMetadata, rows: np.ndarray) -> None:
        """A sampler must honour ``banned_token_ids`` (``min_tokens`` not yet reached): one that
        sampled a banned token is at fault, and named."""
        banned = find_banned(sampled, md)
        if banned is not None:
            row, token = banned
            raise PluginError(
                f"{self.sampler_entry.describe()} sampled token {token} for request "
                f"{self.batch.req_ids[rows[row]]!r}, which is banned for it "
                "(SamplingMetadata.banned_token_ids: its min_tokens is not reached); a sampler "
                "must apply banned_token_ids (docs/plugins.md, 'A sampler')")


def _without(failed: dict[str, str], states: list[CachedRequestState], sampled: list[int],
             rows: np.ndarray, logprobs: LogprobsLists | None) -> tuple:
    """The sampled rows less those of requests a logits processor failed."""
    keep = [i for i, s in enumerate(states) if s.req_id not in failed]
    if logprobs is not None:
        logprobs = LogprobsLists(*([lists[i] for i in keep] for lists in (
            logprobs.token_ids, logprobs.logprobs, logprobs.sampled_ranks)))
    return [states[i] for i in keep], [sampled[i] for i in keep], rows[keep], logprobs
