"""The reference platform: models on the CPU with corellm's plain torch ops and nothing else.

It is what a new device port starts from. Copy this package, rename the platform, and replace
one method at a time with the device's own (each method in ``platform.py`` says what a real port
changes there); every method left alone keeps working, on the core's reference code, while the
others are written. This module only declares the platform and imports no torch, so that
discovery (every ``corellm`` command imports it) stays fast; the factory imports the
implementation when a config selects the platform.
"""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import Field

from corellm import hookimpl
from corellm.components import PlatformOptions, PlatformSpec

PLATFORM_NAME = "reference"


class ReferenceOptions(PlatformOptions):
    """The ``platform`` config section when ``name: reference``. A port's device knobs go here
    as typed fields: a misspelt key or a value out of bounds is then a config error naming
    ``platform.<key>`` and this plugin, before any model is loaded."""

    name: str = PLATFORM_NAME
    threads: int | None = Field(
        None, ge=1, description="torch threads of each worker process (None: as the executor "
                                "set them: torch's default in one process, a share of the "
                                "cores per tensor-parallel rank).")


def _availability() -> str | None:
    """Why the platform cannot run here, or None. The reference runs wherever torch runs. A
    port probes its device here, importing its runtime inside this function so that discovery
    stays cheap, and returns a sentence that ``corellm plugins`` shows and ``platform: auto``
    logs, such as "no NPU visible (torch_npu 2.1 found 0 devices)"."""
    return None


def _make(options: ReferenceOptions):
    from corellm_platform_reference.platform import ReferencePlatform  # imports torch
    return ReferencePlatform(options)


@hookimpl
def corellm_platforms() -> Iterator[PlatformSpec]:
    yield PlatformSpec(
        name=PLATFORM_NAME, factory=_make, options=ReferenceOptions, availability=_availability,
        # None: `platform: auto` never picks it; it runs only when named. A port of a real
        # device sets a priority above the CPU platform's (10), so that auto prefers the device
        # wherever its availability check passes.
        auto_priority=None,
        # The platform interface (corellm.platforms.PLATFORM_INTERFACE_VERSION) this code was
        # written against: a corellm of another major version refuses the plugin at start-up,
        # naming it, instead of failing later on a changed method. Written out, not imported:
        # it records what this code was written for, not what the running corellm has.
        interface_version=(1, 0),
        summary="The CPU with corellm's plain torch ops only: the starting point of a device "
                "port.")
