"""The ``sim`` executor's options: light, so registering the executor imports no cost model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from corellm.components import ExecutorOptions


class SimOptions(ExecutorOptions):
    name: str = "sim"
    profile: str = Field(
        ..., description="Step-time profile (JSON) from `corellm bench calibrate`, measured "
                         "on real hardware or derived from a device's peaks (--roofline).")
    clock: Literal["virtual", "real"] = Field(
        "virtual", description="virtual: the engine's clock jumps by each predicted step "
                               "(offline, corellm bench); real: each step sleeps its predicted "
                               "time, so a server answers at the profiled device's pace.")
    token_id: int | None = Field(
        None, ge=0, description="The token every sampled row gets (default: the first id "
                                "from 1000 up that is no special token of the checkpoint).")
