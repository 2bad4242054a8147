"""The ``corellm`` command line: the commands and global options (``main``) and the argument
parser every command uses (``parser``).

``corellm.cli`` is the public face of ``main`` (``main(argv, plugins)``): its names are read
from there when first asked for."""

from typing import TYPE_CHECKING

from corellm._imports import facade

if TYPE_CHECKING:
    from corellm.cli.main import *  # noqa: F403

__getattr__ = facade(__name__, "main", ("main", "parser"))
