"""An executor wrapper: times every step the wrapped executor runs and writes a summary when
the engine shuts down. It wraps any executor (``uniproc``, ``multiproc`` under tensor
parallelism, ``sim``), chosen and configured in its ``delegate`` sub-section."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import Future

from pydantic import Field

from corellm import hookimpl
from corellm.components import BuildContext, ExecutorOptions, ExecutorSpec, delegate_field
from corellm.wrappers import ExecutorWrapper

CORELLM_PLUGIN_API = "1.7"


class TimingOptions(ExecutorOptions):
    name: str = "timing"
    report: str = Field("step-times.json", description="JSON file the summary is written to "
                                                       "at shutdown.")
    delegate: ExecutorOptions = delegate_field("executor")


class TimingExecutor(ExecutorWrapper):
    def __init__(self, inner, report: str) -> None:
        super().__init__(inner)
        self.report = report
        self.step_seconds: list[float] = []
        self.written = False

    def execute_model(self, scheduler_output):
        start = time.perf_counter()
        out = super().execute_model(scheduler_output)
        if isinstance(out, Future):          # multiproc: the step ends when its result comes
            out.add_done_callback(lambda _: self._record(start))
        else:
            self._record(start)
        return out

    def _record(self, start: float) -> None:
        self.step_seconds.append(time.perf_counter() - start)

    def shutdown(self) -> None:
        super().shutdown()
        if self.written:                     # shutdown is idempotent: write once
            return
        self.written = True
        times = sorted(self.step_seconds)
        with open(self.report, "w") as f:
            json.dump({"steps": len(times), "total_s": sum(times),
                       "median_ms": 1e3 * statistics.median(times) if times else None,
                       "max_ms": 1e3 * times[-1] if times else None}, f)


def make_timing(options: TimingOptions, ctx: BuildContext) -> TimingExecutor:
    return TimingExecutor(ctx.build_delegate(options), options.report)


@hookimpl
def corellm_executors() -> Iterator[ExecutorSpec]:
    yield ExecutorSpec(name="timing", factory=make_timing, options=TimingOptions,
                       summary="Times every step of the executor it wraps (delegate).")
