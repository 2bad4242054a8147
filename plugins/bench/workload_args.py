"""The workload a ``corellm bench`` command line describes: which dataset (random, ShareGPT,
a trace, or a ``--workload`` file), the flags that apply to it, and the function that builds
the workload of each seed. The random dataset's flags are ``vllm bench serve``'s
(``spec_from_vllm_args``)."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .workload_spec import WorkloadSpec

DEFAULT_NUM_PROMPTS = 64
SHAREGPT_FLAGS = ("sharegpt_output_len", "sharegpt_sessions", "sharegpt_think_time")
TRACE_FLAGS = ("trace_speedup", "trace_window", "trace_sample", "trace_block_size")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_dataset_flags(args: argparse.Namespace) -> None:
    """Refuse flags that do not apply to the chosen workload, naming them."""
    from .workload_spec import WorkloadError

    name = args.dataset_name
    problems = []
    if args.workload and name != "random":
        problems.append(("--dataset-name", f"{name} is not used with --workload (the file "
                                           "describes the workload); give one of them"))
    if args.dataset_path and (name == "random" or args.workload):
        problems.append(("--dataset-path", "needs --dataset-name sharegpt or trace (the random "
                                           "dataset has no file)"))
    for dest in SHAREGPT_FLAGS if name != "sharegpt" or args.workload else ():
        if getattr(args, dest, None) not in (None, False):
            problems.append((_flag(dest), "only with --dataset-name sharegpt"))
    if name == "sharegpt" and args.sharegpt_think_time and not args.sharegpt_sessions:
        problems.append(("--sharegpt-think-time", "only with --sharegpt-sessions"))
    for dest in TRACE_FLAGS if name != "trace" or args.workload else ():
        if getattr(args, dest, None) is not None:
            problems.append((_flag(dest), "only with --dataset-name trace"))
    if name == "trace" and not args.workload:
        if not math.isinf(args.request_rate) or args.burstiness != 1.0:
            problems.append(("--request-rate" if not math.isinf(args.request_rate)
                             else "--burstiness", "not used with a trace (its timestamps are "
                                                  "the arrivals; --trace-speedup scales them)"))
        if not args.dataset_path:
            problems.append(("--dataset-path", "--dataset-name trace needs the trace file"))
    if problems:
        raise WorkloadError(problems)


def dataset_settings(args: argparse.Namespace, workload: Any = None) -> dict[str, Any]:
    """What the result's ``settings`` record of the dataset and its options."""
    if args.workload:
        return {"dataset_name": None}
    spec = getattr(workload, "spec", None) or {}
    out: dict[str, Any] = {"dataset_name": args.dataset_name,
                           "dataset_path": spec.get("path", args.dataset_path)}
    if args.dataset_name == "sharegpt":
        out.update(ignore_eos=args.ignore_eos, sharegpt_output_len=args.sharegpt_output_len,
                   sharegpt_sessions=args.sharegpt_sessions,
                   sharegpt_think_time=args.sharegpt_think_time or 0.0)
    elif args.dataset_name == "trace":
        out.update(trace_format=spec.get("format"), trace_speedup=args.trace_speedup or 1.0,
                   trace_window=list(args.trace_window) if args.trace_window else None,
                   trace_sample=args.trace_sample or 1.0,
                   trace_block_size=args.trace_block_size or 512)
    return out


def workload_maker(args: argparse.Namespace, tokenizer: Any, vocab_size: int,
                   exclude_ids: set[int], max_model_len: int | None = None,
                   ) -> tuple[Any, int]:
    """A function seed -> Workload, and the base seed. With ``max_model_len`` a workload whose
    sessions outgrow the context is refused before anything runs (ShareGPT sessions are cut
    at the turn that would outgrow it; trace requests that cannot fit are left out)."""
    from .workload import build_workload
    from .workload_spec import load_workload_spec

    check_dataset_flags(args)
    if args.workload:
        spec = load_workload_spec(args.workload)
        base = args.seed if args.seed is not None else getattr(spec, "seed", None)
        base = 0 if base is None else base

        def make(seed: int) -> Any:
            return build_workload(spec, vocab_size=vocab_size, exclude_ids=exclude_ids,
                                  seed=seed, tokenizer=tokenizer, max_model_len=max_model_len)
        return make, base

    base = 0 if args.seed is None else args.seed
    num_prompts = args.num_prompts or DEFAULT_NUM_PROMPTS
    if args.dataset_name == "sharegpt":
        from .datasets import read_sharegpt, sharegpt_path, sharegpt_workload
        from .progress import log
        data = read_sharegpt(sharegpt_path(args.dataset_path))
        log(data.summary())

        def make_sharegpt(seed: int) -> Any:
            return sharegpt_workload(
                data, tokenizer, num_prompts=num_prompts, seed=seed,
                request_rate=args.request_rate, burstiness=args.burstiness,
                output_len=args.sharegpt_output_len, sessions=args.sharegpt_sessions,
                think_time_s=args.sharegpt_think_time or 0.0, ignore_eos=args.ignore_eos,
                vocab_size=vocab_size, max_model_len=max_model_len)
        return make_sharegpt, base
    if args.dataset_name == "trace":
        from .traces import MOONCAKE_BLOCK_SIZE, TraceOptions, read_trace, trace_workload
        trace = read_trace(args.dataset_path)
        options = TraceOptions(speedup=args.trace_speedup or 1.0,
                               window=args.trace_window or (None, None),
                               sample=args.trace_sample or 1.0, num_prompts=args.num_prompts,
                               block_size=args.trace_block_size or MOONCAKE_BLOCK_SIZE)

        def make_trace(seed: int) -> Any:
            return trace_workload(trace, vocab_size=vocab_size, exclude_ids=exclude_ids,
                                  seed=seed, options=options, max_model_len=max_model_len)
        return make_trace, base

    def make_random(seed: int) -> Any:
        spec = spec_from_vllm_args(
            input_len=args.input_len or args.random_input_len,
            output_len=args.output_len or args.random_output_len,
            range_ratio=args.random_range_ratio, num_prompts=num_prompts,
            request_rate=args.request_rate, burstiness=args.burstiness, seed=seed)
        return build_workload(spec, vocab_size=vocab_size, exclude_ids=exclude_ids,
                              seed=seed, tokenizer=tokenizer, max_model_len=max_model_len)
    return make_random, base


def spec_from_vllm_args(*, input_len: int, output_len: int, range_ratio: float,
                        num_prompts: int, request_rate: float, burstiness: float,
                        seed: int) -> WorkloadSpec:
    """The workload ``vllm bench serve --dataset-name random`` sends with these flags.

    vLLM draws each request's input and output length as integers uniform in
    [floor(len * (1 - r)), ceil(len * (1 + r))] (r = ``--random-range-ratio``, in [0, 1); the
    output range is raised to at least 1), random token ids for the prompt, and gamma
    inter-arrival times (shape ``burstiness``, mean 1/rate; ``request_rate = inf`` sends
    everything at once). Two deliberate differences: vLLM first subtracts the tokens its
    tokenizer would add (a BOS) from the input length because it sends text; corellm sends the
    token ids themselves, so the prompt is exactly the drawn length. And the bounds are computed
    free of float noise (vLLM's ``ceil(100 * 1.1)`` is 111).
    """
    from .distributions import vllm_arrivals
    from .workload_spec import WorkloadError, load_workload_spec

    problems = []
    if not 0.0 <= range_ratio < 1.0:
        problems.append(("random_range_ratio", f"must be in [0, 1), got {range_ratio:g}"))
    if input_len < 1:
        problems.append(("random_input_len", f"must be >= 1, got {input_len}"))
    if output_len < 1:
        problems.append(("random_output_len", f"must be >= 1, got {output_len}"))
    if num_prompts < 1:
        problems.append(("num_prompts", f"must be >= 1, got {num_prompts}"))
    if not request_rate > 0:
        problems.append(("request_rate", f"must be > 0 (or inf), got {request_rate:g}"))
    if not burstiness > 0:
        problems.append(("burstiness", f"must be > 0, got {burstiness:g}"))
    if problems:
        raise WorkloadError(problems)

    def bounds(length: int) -> tuple[int, int]:
        # Round away float noise (1e-9 of a token) before floor/ceil: 100 * (1 + 0.1) is
        # 110.00000000000001 in binary floating point, which must stay 110.
        low = math.floor(round(length * (1.0 - range_ratio), 9))
        high = math.ceil(round(length * (1.0 + range_ratio), 9))
        return low, high

    def dist(low: int, high: int) -> dict[str, Any]:
        return ({"dist": "fixed", "value": low} if low == high
                else {"dist": "uniform", "low": low, "high": high})

    in_lo, in_hi = bounds(input_len)
    if in_lo < 1:
        raise WorkloadError([("random_range_ratio", f"with --random-input-len {input_len} the "
                                                    f"shortest prompt would be {in_lo} tokens; "
                                                    "lower the ratio or raise the length")])
    out_lo, out_hi = bounds(output_len)
    out_lo, out_hi = max(out_lo, 1), max(out_hi, 1)
    arrivals = vllm_arrivals(request_rate, burstiness)
    return load_workload_spec({
        "name": "random", "seed": seed, "num_requests": num_prompts,
        "requests": {"input_len": dist(in_lo, in_hi), "output_len": dist(out_lo, out_hi)},
        "arrivals": arrivals})
