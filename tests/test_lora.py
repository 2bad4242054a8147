"""Multi-LoRA: greedy outputs equal transformers + PEFT's (``PeftModel``) on the same base and
adapters, token for token in float32, for each adapter and for batches mixing several adapters
and the base model, under chunked prefill, preemption and prefix caching; the slots' bookkeeping
as a property; and bad adapters refused with the adapter and the fault named.

The adapters are random PEFT adapters saved with ``save_pretrained``: different ranks, target
modules (fused q/k/v and gate/up parts among them), one with rsLoRA.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from corellm import LLM, LoRARequest, SamplingParams
from corellm.errors import InvalidRequestError
from tests.conftest import assert_pool_whole, engine_config
from tests.test_hf_equivalence import compare, hf_greedy

peft = pytest.importorskip("peft")

NEW_TOKENS = 16
PROMPT_LENS = (1, 5, 17, 40, 70)
# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "qv": (8, 16, ["q_proj", "v_proj"], False),
    "all": (16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj"], True),
    "mlp": (4, 8, ["o_proj", "gate_proj", "down_proj"], False),
}


def make_adapter(base: Path, out: Path, rank: int, alpha: int, targets: list[str],
                 rslora: bool, seed: int) -> Path:
    """A random PEFT LoRA adapter of ``base`` (A and B both random: a fresh adapter's B is 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                     init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(model, cfg)
    model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.generation_config.eos_token_id = None     # greedy past EOS, as ignore_eos
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    gen_cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=0, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    results = hf_greedy(model, prompts, gen_cfg)
    assert all(len(tokens) == NEW_TOKENS for tokens, _ in results)
    return results


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lora_setup(request, make_checkpoint, tmp_path_factory):
    """(arch, base path, prompts, {adapter name: LoRARequest}, {name or None: reference})."""
    base = make_checkpoint(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    loras = {}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = make_adapter(base, root / name, rank, alpha, targets, rslora, seed=10 + i)
        loras[name] = LoRARequest(name, i + 1, str(path))
    prompts = _prompts()
    refs = {None: peft_greedy(base, None, prompts)}
    for name, lora in loras.items():
        refs[name] = peft_greedy(base, Path(lora.lora_path), prompts)
    return request.param, base, prompts, loras, refs


def _prompts() -> list[list[int]]:
    import random
    rng = random.Random(7)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in PROMPT_LENS]


def lora_llm(base: Path, **sections) -> LLM:
    cfg = engine_config(base, **sections)
    cfg["model"]["max_model_len"] = 96
    cfg["lora"] = {"enable": True, "max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 3,
                   **cfg.get("lora", {})}
    return LLM(cfg)


def generate_mixed(llm: LLM, prompts: list[list[int]], loras: dict) -> tuple[list, list, list]:
    """Every prompt under the base model and under each adapter, all in one generate call:
    (outputs, each output's adapter name or None, its prompt's index)."""
    names = [None, *loras] * len(prompts)
    which = [i for i in range(len(prompts)) for _ in range(len(loras) + 1)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in which], params,
                           lora_request=[None if n is None else loras[n] for n in names],
                           use_tqdm=False)
    return outputs, names, which


def check_against(outputs, names, refs, prompts_of) -> list[str]:
    notes = []
    for out, name, p in zip(outputs, names, prompts_of):
        tokens, logits = refs[name][p]
        assert out.outputs[0].finish_reason == "length"
        note = compare(out.outputs[0].token_ids, tokens, logits)
        if note:
            notes.append(f"adapter {name}, prompt {p}: {note}")
    return notes


SETTINGS = {
    "default": {},
    "chunked_prefill": {"scheduler": {"max_num_batched_tokens": 24}},
    "preemption": {"kv_cache": {"num_blocks": 14}},
}


def test_adapters_change_the_outputs(lora_setup):
    """The references differ from the base model's: the test below compares something."""
    _, _, prompts, loras, refs = lora_setup
    for name in loras:
        differ = sum(refs[name][i][0] != refs[None][i][0] for i in range(len(prompts)))
        assert differ >= len(prompts) - 1, (name, differ)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_mixed_batch_matches_peft(lora_setup, setting):
    """Every prompt under the base model and each of three adapters, all in one generate call
    (two device slots for three adapters: requests wait for a slot, adapters are evicted and
    loaded again), each output equal to PEFT's."""
    arch, base, prompts, loras, refs = lora_setup
    llm = lora_llm(base, **SETTINGS[setting])
    outputs, names, which = generate_mixed(llm, prompts, loras)
    notes = check_against(outputs, names, refs, which)
    if notes:
        warnings.warn(f"{arch}/{setting}: accepted near ties: {notes}")
    assert len(notes) <= 1, notes
    if setting == "preemption":
        assert llm.get_stats().num_preemptions > 0
    assert_pool_whole(llm)
    llm.engine.scheduler.check_invariants()
    assert not llm.engine.scheduler.lora.users


def test_mixed_batch_over_two_tensor_parallel_ranks(lora_setup):
    """The same mixed batch over two ranks (each holds its heads' and columns' slice of every
    adapter: q/k/v and gate/up's B by rows, o and down's A by columns), with preemption: each
    output equal to PEFT's."""
    arch, base, prompts, loras, refs = lora_setup
    llm = lora_llm(base, parallel={"tensor_parallel_size": 2}, kv_cache={"num_blocks": 14})
    try:
        outputs, names, which = generate_mixed(llm, prompts, loras)
        notes = check_against(outputs, names, refs, which)
        assert len(notes) <= 1, notes
        assert llm.get_stats().num_preemptions > 0
        assert_pool_whole(llm)
    finally:
        llm.shutdown()


def test_each_adapter_alone_and_the_prefix_cache_keyed_by_adapter(lora_setup):
    """One adapter per call; a prompt's blocks cached under one adapter are found again by the
    same adapter, never by another one or by the base model."""
    arch, base, prompts, loras, refs = lora_setup
    llm = lora_llm(base)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    long = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    notes = []
    for name, lora in loras.items():
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               lora_request=lora, use_tqdm=False)
        notes += check_against(outputs, [name] * len(prompts), refs, range(len(prompts)))
    assert len(notes) <= 1, notes
    # the long prompt again: each adapter finds the blocks it computed; the base model,
    # which never ran it, none
    again = {}
    for name in [*loras, None]:
        out = llm.generate({"prompt_token_ids": prompts[long]}, params,
                           lora_request=None if name is None else loras[name], use_tqdm=False)
        again[name] = out[0].num_cached_tokens
        notes += check_against(out, [name], refs, [long])
    assert again["mlp"] == again["qv"] == again["all"] >= 16, again
    assert again[None] == 0, again
    assert_pool_whole(llm)


def test_a_request_for_another_adapter_waits_for_a_slot(lora_setup):
    """One slot, two adapters: the second adapter's requests run after the first's finish (none
    fails), and the adapter in the slot is never replaced under a running request."""
    _, base, prompts, loras, refs = lora_setup
    llm = lora_llm(base, lora={"max_loras": 1, "max_cpu_loras": 1})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    names = ["qv", "all", "qv", None, "all"]
    outputs = llm.generate([{"prompt_token_ids": prompts[i % len(prompts)]}
                            for i in range(len(names))], params,
                           lora_request=[None if n is None else loras[n] for n in names],
                           use_tqdm=False)
    notes = check_against(outputs, names, refs, [i % len(prompts) for i in range(len(names))])
    assert len(notes) <= 1, notes
    assert_pool_whole(llm)


# ------------------------------------------------------------------ bad adapters
@pytest.fixture(scope="module")
def bad_setup(make_checkpoint, tmp_path_factory):
    base = make_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora-bad")
    good = make_adapter(base, root / "good", 8, 16, ["q_proj", "v_proj"], False, seed=1)
    return base, root, good


def _copy(good: Path, dst: Path) -> Path:
    shutil.copytree(good, dst)
    return dst


def test_bad_adapters_are_refused_naming_the_fault(bad_setup, make_checkpoint):
    from safetensors.torch import load_file, save_file
    base, root, good = bad_setup
    llm = lora_llm(base, lora={"max_lora_rank": 8})
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def refused(path: Path, *fragments: str, name: str = "bad") -> None:
        with pytest.raises(InvalidRequestError) as exc:
            llm.generate("hello", params, lora_request=LoRARequest(name, 9, str(path)),
                         use_tqdm=False)
        assert exc.value.field == "lora_request"
        text = str(exc.value)
        assert f"'{name}'" in text and str(path) in text, text
        for fragment in fragments:
            assert fragment in text, (fragment, text)

    big = make_adapter(base, root / "big", 16, 16, ["q_proj"], False, seed=2)
    refused(big, "rank 16", "max_lora_rank 8")
    refused(root / "nowhere", "no such directory")
    no_cfg = _copy(good, root / "no-config")
    (no_cfg / "adapter_config.json").unlink()
    refused(no_cfg, "adapter_config.json is missing")
    no_w = _copy(good, root / "no-weights")
    (no_w / "adapter_model.safetensors").unlink()
    refused(no_w, "adapter_model.safetensors is missing")
    corrupt = _copy(good, root / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    refused(corrupt, "cannot be read")
    # a module the model lacks, and shapes from another base model
    tensors = load_file(good / "adapter_model.safetensors")
    renamed = _copy(good, root / "renamed")
    save_file({k.replace("q_proj", "query_key_value"): v for k, v in tensors.items()},
              renamed / "adapter_model.safetensors")
    refused(renamed, "query_key_value", "does not have")
    wider = _copy(good, root / "wider")
    save_file({k: (torch.zeros(v.shape[0], 2 * v.shape[1]) if "lora_A" in k else v)
               for k, v in tensors.items()}, wider / "adapter_model.safetensors")
    refused(wider, "do not fit", "another base model")
    nan = _copy(good, root / "nan")
    save_file({k: (v.clone().fill_(float("nan")) if "lora_B" in k else v)
               for k, v in tensors.items()}, nan / "adapter_model.safetensors")
    refused(nan, "non-finite")
    dora = _copy(good, root / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    refused(dora, "DoRA")
    # the good one runs, and nothing was loaded half
    out = llm.generate("hello", params, lora_request=LoRARequest("good", 1, str(good)),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert_pool_whole(llm)


def test_a_request_waiting_for_a_slot_is_not_passed_for_ever(lora_setup):
    """One slot: once a request waits for it, later requests of the adapter holding it wait
    too, so that adapter drains and the waiting one runs before them (with steady traffic on
    the loaded adapter it would otherwise wait for ever); the base model's requests go on."""
    _, base, prompts, loras, _ = lora_setup
    llm = lora_llm(base, lora={"max_loras": 1, "max_cpu_loras": 2})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    names = ["qv", "all", "qv", "qv", None, "qv"]
    outs = llm.generate([{"prompt_token_ids": prompts[0]}] * len(names), params,
                        lora_request=[None if n is None else loras[n] for n in names],
                        use_tqdm=False)
    first = [o.metrics.first_token_time for o in outs]
    assert first[1] < min(first[2], first[3], first[5]), first   # "all" before the later "qv"
    assert first[4] < first[1], first                            # the base model did not wait
    assert_pool_whole(llm)


def test_lora_request_without_lora_enabled_is_refused(llama_path, bad_setup):
    _, _, good = bad_setup
    llm = LLM(engine_config(llama_path))
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters"):
        llm.generate("hi", SamplingParams(max_tokens=2),
                     lora_request=LoRARequest("good", 1, str(good)), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, str(good))


def test_one_id_names_one_adapter(bad_setup):
    """The engine knows an adapter by its id (its slot, its cached blocks): a second adapter
    under an id in use is refused, naming the first."""
    base, root, good = bad_setup
    llm = lora_llm(base, lora={"max_lora_rank": 8})
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate("hi", params, lora_request=LoRARequest("good", 1, str(good)), use_tqdm=False)
    other = shutil.copytree(good, root / "other-copy")
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is already adapter 'good'"):
        llm.generate("hi", params, lora_request=LoRARequest("other", 1, str(other)),
                     use_tqdm=False)
    llm.generate("hi", params, lora_request=LoRARequest("good", 1, str(good)), use_tqdm=False)
    assert_pool_whole(llm)


# ------------------------------------------------------------------ the slots, as a property
def test_slots_never_evict_an_adapter_in_use():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from corellm.lora.slots import LoRASlots

    loras = [LoRARequest(f"a{i}", i + 1, f"/x/{i}") for i in range(5)]

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 3), st.lists(st.tuples(st.booleans(), st.integers(0, 4)),
                                       max_size=60))
    def run(max_loras, ops):
        slots = LoRASlots(max_loras)
        running: list[tuple[LoRARequest, int]] = []
        loaded: dict[int, int] = {}              # slot -> adapter id, as the workers see it
        for start, k in ops:
            if start:
                lora = loras[k]
                if not slots.can_take(lora):
                    # every slot holds an adapter some running request uses
                    assert len({r.lora_int_id for r, _ in running}) == max_loras
                    continue
                slot, load = slots.acquire(lora)
                if load:
                    assert all(loaded.get(slot) != r.lora_int_id for r, _ in running), \
                        "evicted an adapter in use"
                    loaded[slot] = lora.lora_int_id
                assert loaded[slot] == lora.lora_int_id
                running.append((lora, slot))
            elif running:
                lora, _ = running.pop(k % len(running))
                slots.release(lora)
            for r, s in running:
                assert loaded[s] == r.lora_int_id
            slots.check_invariants(r for r, _ in running)
    run()


# ------------------------------------------------------------------ the op, three ways
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_lora_linear_paths_agree_with_float64(tokens):
    """``ops.lora_linear`` of the reference, and the CPU platform's two paths (lora.c per token
    for a decode-sized step, in-place GEMMs per run of one adapter's tokens for a prefill),
    against the products in float64: tokens of three adapters and of the base model, in runs
    (as a prefill's requests) and interleaved (as a decode step's), on a QKV-like layer of three
    parts of different widths; the base model's rows untouched."""
    import numpy as np
    from types import SimpleNamespace

    from corellm.lora.model import LoRABatch
    from corellm.ops import DeviceOps
    from corellm_plugins.platform_cpu.ops import CpuDeviceOps

    g = torch.Generator().manual_seed(tokens)
    slots_n, rank, k, spans = 3, 8, 48, [(0, 32), (32, 16), (48, 16)]
    lora = SimpleNamespace(a=torch.randn(slots_n, 3, rank, k, generator=g),
                           b=[torch.randn(slots_n, rank, n, generator=g) for _, n in spans],
                           spans=spans, batch=LoRABatch(), kernel=None)
    lora.a[1, 2] = 0                              # slot 1 adapts only the first two parts
    x = torch.randn(tokens, k, generator=g)
    y0 = torch.randn(tokens, 64, generator=g)
    for layout in ("runs", "interleaved"):
        if layout == "runs":
            slots = np.repeat(np.arange(-1, slots_n), -(-tokens // (slots_n + 1)))[:tokens]
        else:
            slots = np.arange(tokens) % (slots_n + 1) - 1
        batch = lora.batch
        batch.groups.clear()
        batch.cache.clear()
        batch.slots = torch.from_numpy(slots)
        for s in np.unique(slots[slots >= 0]):
            batch.groups.append((int(s), torch.from_numpy(np.flatnonzero(slots == s))))
        want = y0.double().clone()
        for t, s in enumerate(slots):
            if s >= 0:
                for p, (off, n) in enumerate(spans):
                    h = lora.a[s, p].double() @ x[t].double()
                    want[t, off:off + n] += h @ lora.b[p][s].double()
        for name, ops, limit in (("reference", DeviceOps(), None),
                                 ("cpu kernel", CpuDeviceOps(), 1 << 20),
                                 ("cpu runs", CpuDeviceOps(), 0)):
            if limit is not None:
                ops.LORA_KERNEL_MAX_TOKENS = limit
            if name == "cpu runs" and layout == "interleaved" and tokens > 64:
                continue                              # (a prefill's tokens come in runs)
            batch.cache.clear()
            got = ops.lora_linear(y0.clone(), x, lora).double()
            if name == "cpu kernel":                  # lora.c ran (it keeps its arguments)
                from corellm_plugins.platform_cpu.lora_kernels import lora_kernels
                assert lora.kernel is not None or lora_kernels() is None
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (
                name, layout, (got - want).abs().max().item())
            base = slots < 0
            assert torch.equal(got[base], y0.double()[base]), (name, layout)


# ------------------------------------------------------------------ corellm bench
def test_bench_workload_mixes_adapters(lora_setup):
    """A workload's ``lora_adapters`` shares (the base model among them) are exact, drawn from
    their own stream (the prompts do not move), and an in-process run sends each request with
    its adapter: the outputs are PEFT's."""
    from collections import Counter

    from corellm_plugins.bench.engine_driver import drive_engine
    from corellm_plugins.bench.targets import RunOptions
    from corellm_plugins.bench.workload import build_workload, workload_stats
    from corellm_plugins.bench.workload_spec import load_workload_spec

    arch, base, prompts, loras, refs = lora_setup
    plain = {"num_requests": 12, "requests": {"input_len": 6, "output_len": NEW_TOKENS}}
    shares = [{"name": None, "weight": 1}, {"name": "qv", "path": loras["qv"].lora_path},
              {"name": "mlp", "path": loras["mlp"].lora_path, "weight": 2}]
    w0 = build_workload(load_workload_spec(plain), vocab_size=1024)
    w = build_workload(load_workload_spec({**plain, "lora_adapters": shares}), vocab_size=1024)
    assert [r.prompt_token_ids for r in w.requests] == [r.prompt_token_ids for r in w0.requests]
    assert Counter(r.lora_name for r in w.requests) == {None: 3, "qv": 3, "mlp": 6}
    assert workload_stats(w)["lora_adapters"] == {"mlp": 6, "qv": 3}
    assert "adapters" in w.description
    llm = lora_llm(base)
    records, _ = drive_engine(llm, w, RunOptions(progress=False, keep_outputs=True), salt="l")
    assert all(r.error is None for r in records)
    for req, rec in zip(w.requests, records):
        want = peft_greedy(base, None if req.lora_name is None
                           else Path(loras[req.lora_name].lora_path), [req.prompt_token_ids])
        note = compare(rec.output_token_ids, *want[0])
        assert note is None or "near tie" in note, (req.lora_name, note)
    assert_pool_whole(llm)
