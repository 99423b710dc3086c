"""'Did you mean …' for mistyped commands and options, and an argparse parser that says it in one line.

Standard library only (it sits in launch/ so that the vendor launchers, which import nothing else, use it too)."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Iterable, NoReturn


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean --learning_rate?)' for the closest valid spelling, or '' when nothing is close."""
    key = word.split("=", 1)[0]
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings]


def unknown_options_message(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """'unknown option --lerning_rate (did you mean --learning_rate?)' for the first unknown option word."""
    options = [w for w in unknown if w.startswith("-")] or unknown
    first = options[0]
    rest = f" (and {' '.join(options[1:])})" if len(options) > 1 else ""
    return f"unknown option {first}{did_you_mean(first, option_strings(parser))}{rest}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), 'did you mean' for mistyped options, exit 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # --learning_rat must not silently match --learning_rate
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(unknown_options_message(unknown, self))
        return parsed

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}. See {self.prog} --help.", file=sys.stderr)
        sys.exit(2)
