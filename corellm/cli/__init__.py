"""The ``corellm`` command line: the commands and global options (``commands``) and the argument
parser every command uses (``parser``).

``corellm.cli`` is the public face of ``commands`` (``main(argv, plugins)``, the console
script's entry point ``corellm.cli:main``): its names are read from there when first asked
for."""

from typing import TYPE_CHECKING

from corellm._imports import facade

if TYPE_CHECKING:
    from corellm.cli.commands import *  # noqa: F403

__getattr__ = facade(__name__, "commands", ("commands", "parser"))
