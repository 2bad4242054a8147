"""``corellm bench`` and the simulator it A/B-tests on: tools beside the engine, not in it.

A plugin like any third-party one. It registers the ``bench`` command (``corellm_commands``:
seeded workloads against engine configs or live servers, side by side; ``bench workload`` and
``bench calibrate``) and the ``sim`` executor (``corellm_executors``: no model, step times from a
cost model calibrated on real hardware, on virtual time). Modules:

* ``cli``, ``workload_cli``, ``calibrate``: the command and its sub-commands (``cli`` also
  turns ``vllm bench serve``'s flags into a workload spec);
* ``workload``: the seeded requests a workload spec builds, and their statistics;
* ``workload_spec``: workload specs (YAML), their validation and errors;
* ``distributions``: the lengths, durations and arrival patterns a spec draws from;
* ``runner``: running targets through a workload, side by side; ``targets``: what a run
  measures, its options and its result; ``sessions``: when each request is due;
* ``engine_driver``: driving an in-process engine; ``server_client``: driving a live server;
  ``server_process``: starting ``corellm serve`` for a run;
* ``metrics``, ``report``: per-request records, their statistics, the A/B table, JSON and plot;
* ``env``: the machine record every result carries; ``progress``: logging on stderr;
* ``costmodel`` (step shapes, the fitted model), ``roofline``, ``model_shape``, ``devices``,
  ``profile``, ``options`` and ``sim``: the step-time models, the profile file and the ``sim``
  executor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from corellm import hookimpl
from corellm.components import CommandSpec, ExecutorSpec

from .options import SimOptions


@hookimpl
def corellm_commands() -> Iterator[CommandSpec]:
    from .cli import configure_bench
    yield CommandSpec(name="bench", factory=configure_bench,
                      summary="benchmark configs or servers on one seeded workload (A/B)")


def _sim_executor(options: SimOptions, ctx: Any) -> Any:
    from .sim import SimExecutor
    return SimExecutor(options, ctx)


@hookimpl
def corellm_executors() -> Iterator[ExecutorSpec]:
    yield ExecutorSpec(name="sim", factory=_sim_executor, options=SimOptions, runs_model=False,
                       summary="No model: step times predicted by a calibrated cost model, on "
                               "virtual time (A/B tests at scale, hardware what-ifs).")
