"""Moved to ``corellm.platforms.shm_ring`` (plugin API 1.12), where the ``ray`` executor shares
it; this old path keeps working, with a ``DeprecationWarning``, until corellm 0.7."""

from __future__ import annotations

import warnings

from corellm.platforms.shm_ring import (RingClosed, RingReader, RingSpec,  # noqa: F401
                                        RingWriter, create_ring, doorbell_pair, unlink_ring)

warnings.warn("corellm_plugins.executor_multiproc.shm moved to corellm.platforms.shm_ring; the "
              "old path goes in corellm 0.7", DeprecationWarning, stacklevel=2)
