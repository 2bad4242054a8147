"""The argument parser of every ``corellm`` command: argparse's, naming the closest flag, choice
or command to a misspelt one (Python 3.11's argparse suggests nothing)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from corellm.config.schema import did_you_mean


class Parser(argparse.ArgumentParser):
    """argparse's parser, naming the closest match to a misspelt flag or choice:
    ``corellm generate: error: unrecognized arguments: --max-token (did you mean --max-tokens?)``,
    ``invalid choice: 'serv'; did you mean serve?``. Every parser of the command line is one:
    argparse makes sub-parsers (plugin commands' and nested ones too) of their parent's class."""

    _unknown_flags: list[str] = []

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        strings = list(sys.argv[1:] if args is None else args)
        self._unknown_flags = self._flags_not_known(strings)
        return super().parse_known_args(strings, namespace)

    def parse_args(self, args: Sequence[str] | None = None,    # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.unrecognized(parsed, extra)
        return parsed

    def unrecognized(self, parsed: argparse.Namespace, extra: Sequence[str]) -> NoReturn:
        """Exit with the error for ``extra``, the arguments no parser took, as the sub-command
        that was given (the innermost one) reports it: with its name, usage and flags."""
        parser = self._chosen(parsed)
        parser.error(parser._unrecognized_message(extra, root=self))

    def error(self, message: str) -> NoReturn:
        # An unknown flag's value is taken for the next positional (`bench --num-prompt 3`:
        # "invalid choice: '3'"): the flag is the mistake to report.
        if self._unknown_flags and not message.startswith("unrecognized arguments"):
            message = self._unrecognized_message(self._unknown_flags)
        super().error(message)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            hint = did_you_mean(str(value), [str(c) for c in action.choices])
            if hint:
                choices = ", ".join(map(repr, action.choices))
                raise argparse.ArgumentError(
                    action, f"invalid choice: {value!r}{hint} (choose from {choices})")
        super()._check_value(action, value)

    def _subcommands(self) -> argparse._SubParsersAction | None:
        return next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)),
                    None)

    def _chosen(self, parsed: argparse.Namespace) -> Parser:
        """The innermost sub-command parser ``parsed`` went through (found by the ``dest`` each
        level of sub-commands stores its choice in; a level without one ends the search)."""
        parser: Parser = self
        while True:
            sub = parser._subcommands()
            name = getattr(parsed, sub.dest, None) if sub is not None else None
            child = sub.choices.get(name) if sub is not None and name is not None else None
            if not isinstance(child, Parser):
                return parser
            parser = child

    def _flags_not_known(self, strings: Sequence[str]) -> list[str]:
        """The flags among this parser's own arguments (those before ``--`` or a sub-command's
        name) that none of its options spells."""
        sub = self._subcommands()
        commands = set(sub.choices) if sub is not None else set()
        unknown = []
        for text in strings:
            if text == "--" or text in commands:
                break
            if not self._looks_like_flag(text):
                continue
            flag = text.split("=", 1)[0]
            if flag in self._option_string_actions or (
                    flag[1:2] not in self.prefix_chars and flag[:2] in self._option_string_actions):
                continue            # known, or a short option with its value attached (-p5)
            unknown.append(flag)
        return unknown

    def _looks_like_flag(self, text: str) -> bool:
        return (len(text) > 1 and text[0] in self.prefix_chars
                and not self._negative_number_matcher.match(text))

    def _unrecognized_message(self, extra: Sequence[str], root: Parser | None = None) -> str:
        options = [o for o in self._option_string_actions if o.startswith("--")]
        words = []
        for text in extra:
            words.append(text)
            if not self._looks_like_flag(text):
                continue
            flag = text.split("=", 1)[0]
            if root is not None and root is not self and flag in root._option_string_actions:
                words.append(f"(an option of {root.prog} itself: it goes before the command)")
                continue
            hint = did_you_mean(flag, options, " (did you mean {}?)")
            if hint:
                words.append(hint.strip())
        return "unrecognized arguments: " + " ".join(words)
