"""What the bench plugin's command-line modules share: the help formatter and the ``--help``
description of a module docstring.

``cli`` registers the ``workload`` and ``calibrate`` sub-commands, whose modules
(``workload_cli``, ``calibrate``) need these too: kept here, in a module that imports no other
module of the plugin, they import this one instead of ``cli``, so no import cycle runs through
the command line (``tests/test_bench.py`` checks the whole plugin for cycles).
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except None/False/[] (those options' help says what happens without
    them); descriptions and epilogs keep their line breaks. Also used by benchmarks/serve.py
    (imported from ``cli``, which re-exports it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def plain(doc: str | None) -> str:
    """A module docstring as a ``--help`` description: without its reST markup for literals
    (double backquotes) and bold (double asterisks)."""
    return (doc or "").replace("``", "").replace("**", "")
