"""The command-line reference page, rendered from the `evstore` argument parser.

`python -m evstore_app.cli_reference > docs/reference/cli.md` (what `make docs`
runs) writes it; tests/test_docs.py checks that the committed page is what the
parser renders, so the page cannot drift from `evstore_app/cli.py`. Like
`evstore --help`, rendering imports no TensorFlow.
"""
import argparse
import sys

from evstore_app.cli import build_parser

__all__ = ["render"]

_HEADER = """\
# Command line reference

<!-- Generated from evstore_app/cli.py by `python -m evstore_app.cli_reference`; do not edit by hand. -->

Every command and flag of `evstore`, as its argument parser defines them (`evstore COMMAND --help`
prints the same). Conventions shared by all commands (output streams, exit status, signals) are in
[the command line guide](../guides/command-line.md).
"""


def _subcommands(parser):
    """(name, help, subparser) of `parser`'s sub-commands, in definition order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def _flag_cell(action):
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    metavar = f" {action.metavar or action.dest.upper()}" if action.nargs != 0 else ""
    return ", ".join(f"`{s}{metavar}`" for s in action.option_strings)


def _usage(parser):
    """The usage line on one line, whatever the terminal's width."""
    formatter = argparse.HelpFormatter(prog=parser.prog, width=10_000)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return " ".join(formatter.format_help().split())


def _default_cell(action):
    if not action.option_strings:
        return "(positional)"
    if action.required:
        return "required"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def _escape(text):
    """`text` as the content of a Markdown table cell."""
    text = (text or "").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("|", "\\|").replace("\n", " ")


def _render_command(path, parser, help_text, out):
    level = "#" * min(2 + len(path) - 1, 4)
    out.append(f"{level} evstore {' '.join(path)}\n")
    if help_text:
        out.append(help_text[:1].upper() + help_text[1:] + ".\n")
    out.append("```text\n" + _usage(parser) + "\n```\n")
    actions = [a for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction))
               and a.dest != "verbose"]
    if actions:
        out.append("| flag | default | meaning |\n| --- | --- | --- |")
        for a in actions:
            out.append(f"| {_flag_cell(a)} | {_default_cell(a)} | {_escape(a.help)} |")
        out.append("")
    for name, sub_help, sub in _subcommands(parser):
        _render_command(path + [name], sub, sub_help, out)


def render(parser=None):
    """The reference page (Markdown) of `parser`, by default `evstore`'s:
    one section per command and sub-command with its usage line and a table
    of its flags (defaults as the parser holds them). `-v` / `--verbose`,
    which every command takes, is described once."""
    parser = parser or build_parser()
    out = [_HEADER]
    out.append("## evstore\n")
    out.append(_escape(parser.description) + "\n")
    out.append("```text\n" + _usage(parser) + "\n```\n")
    out.append("| flag | meaning |\n| --- | --- |")
    out.append("| `--version` | print the installed version and exit |")
    out.append("| `-v`, `--verbose` | also show TensorFlow's log lines (every command takes it) |")
    out.append("")
    if parser.epilog:
        out.append(parser.epilog + "\n")
    for name, help_text, sub in _subcommands(parser):
        _render_command([name], sub, help_text, out)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
