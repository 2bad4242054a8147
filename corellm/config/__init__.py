"""Configuration: the config's shape, the core's own sections, config files and ``--set``
overrides (``schema``); one pydantic config composed from those sections and the selected
plugins' options (``compose``); what a config and a checkpoint come to, worked out once
(``setup``); and which logits processors a config enables (``logits_processors``).

``corellm.config`` is the public face of ``compose`` (``EngineConfig``, ``load_config``,
``build_config``, the sections, ...): its names are read from there when first asked for, so
importing one module of this folder runs no other."""

from typing import TYPE_CHECKING

from corellm._imports import facade

if TYPE_CHECKING:
    from corellm.config.compose import *  # noqa: F403

__getattr__ = facade(__name__, "compose", ("compose", "schema", "setup", "logits_processors"))
