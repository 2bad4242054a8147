"""Device platforms: the interface a device kind implements and how one is chosen
(``interface``), the host and its devices (``devices``), and tensor parallelism's ranks and
collectives (``distributed``).

``corellm.platforms`` is the public face of ``interface`` (``Platform``,
``PLATFORM_INTERFACE_VERSION``, ...): its names are read from there when first asked for, so
importing one module of this folder runs no other."""

from typing import TYPE_CHECKING

from corellm._imports import facade

if TYPE_CHECKING:
    from corellm.platforms.interface import *  # noqa: F403

__getattr__ = facade(__name__, "interface", ("interface", "devices", "distributed"))
