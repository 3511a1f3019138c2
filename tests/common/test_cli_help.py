"""Every flag of every command has help text and shows its default."""

from __future__ import annotations

import argparse

import pytest

from common.cli_help import HelpFormatter, description, shows_no_default
from decode_service.__main__ import build_parser as decode_parser
from prefill_service.__main__ import build_parser as prefill_parser
from router.__main__ import build_parser as router_parser
from router.cli import build_parser as flashsplit_parser


def commands() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, the ``flashsplit`` subcommands included."""
    found = {"flashsplit-router": router_parser(), "flashsplit-prefill": prefill_parser(),
             "flashsplit-decode": decode_parser()}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(f"{name} {sub}", subparser)

    walk("flashsplit", flashsplit_parser())
    return found


COMMANDS = commands()


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            and a.help is not argparse.SUPPRESS]  # hidden on purpose (tests' hooks)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_has_help(name):
    missing = [a.option_strings or a.dest for a in flags(COMMANDS[name]) if not a.help]
    assert not missing, f"{name}: flags without help text: {missing}"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_default_is_shown(name):
    parser = COMMANDS[name]
    assert issubclass(parser.formatter_class, HelpFormatter), name
    formatter = parser._get_formatter()
    hidden = [a.option_strings for a in flags(parser)
              if not shows_no_default(a) and "default" not in formatter._expand_help(a)]
    assert not hidden, f"{name}: flags whose help does not show their default: {hidden}"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_describes_itself(name):
    parser = COMMANDS[name]
    assert parser.description and "``" not in parser.description, name
    parser.format_help()  # a % in a help text that is not a format would raise here


def test_the_flashsplit_command_lists_each_subcommand_with_one_line():
    text = COMMANDS["flashsplit"].format_help()
    for sub in ("generate", "up", "demo", "bench"):
        assert f"    {sub} " in text, text
    assert "{generate,up,demo,bench}" not in text  # shown as COMMAND, then listed


def test_a_formatted_default_reads_as_the_value():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="0 = any")
    parser.add_argument("--name", default=None, help="a name (default: none)")
    parser.add_argument("--on", action="store_true", help="switch")
    parser.add_argument("--ids", default="", help="comma-separated ids")
    text = parser.format_help()
    assert "(default: )" not in text
    assert "0 = any (default: 0)" in text
    assert "(default: none)" in text and "(default: None)" not in text
    assert "switch (default" not in text


def test_description_is_the_first_paragraph_without_rest_quotes():
    assert description("``flashsplit-x``: serve\n    things.\n\nMore.") == \
        "flashsplit-x: serve things."
