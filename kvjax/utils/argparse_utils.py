"""`FlexibleArgumentParser`: vLLM's command-line parser (vLLM 0.33 `vllm/utils/argparse_utils.py`),
so that a vLLM example script's `parser = FlexibleArgumentParser(); ...; args = parser.parse_args()`
parses the same command lines here.

What it adds to `argparse.ArgumentParser`, as vLLM's does (`parse_args` rewrites the command line,
then argparse parses it; `parse_known_args` is argparse's own, as in vLLM):

- `--flag_name` is `--flag-name`: underscores in an option's name (up to its first `.`) become
  dashes, with or without `=value`; values are left as they are.
- dotted JSON options: `--json-arg.key1 v1 --json-arg.key2.key3 v2` is `--json-arg
  '{"key1": "v1", "key2": {"key3": "v2"}}'`, and `--json-arg.key4+ a --json-arg.key4+=b,c` appends
  to a list (`"key4": ["a", "b", "c"]`). Each value is read as JSON, else as a human-readable
  integer (`80g`), else kept as a string. A key given twice warns ("Found duplicate keys"), as does
  a plain option given twice.
- `--config FILE.yaml`: the file's `key: value` pairs are inserted before the rest of the command
  line (after a sub-command, if the first argument is one), so the command line overrides the file,
  which overrides the defaults. `true` is `--key`, `false` is `--no-key` when the parser has it
  (else nothing), a list is `--key item ...`, a mapping is `--key '<JSON>'`.
- `-O3`, `-O=3`, `-O 3` (0-3), `-Odecode`: `--optimization-level <value>` (a parser without that
  option refuses it, as argparse refuses any unknown option).
- `action=argparse.BooleanOptionalAction` pairs `--enable-x` with `--disable-x` (`EnableDisableAction`;
  `--no-enable-x` still works and is hidden from help).
- `add_argument(..., deprecated=True)` warns when the option is used (Python < 3.13; later Pythons'
  argparse does it itself).
- help: options sorted, defaults shown (`SortedHelpFormatter`); `--help` lists the argument groups
  with one line each, `--help=<group title>` one group's options, `--help=<word>` the options whose
  names contain it, `--help=all` every option.
- `human_readable_int` ('1k' = 1,000, '1K' = 1,024, '25.6k' = 25,600) and `human_readable_int_or_auto`
  (also -1 / 'auto') as argparse `type=`s.

Left out, as they belong to vLLM's server CLI: `vllm serve`'s moving of `--model` to the positional
and its `--task` hint, `check_port`. Changed: vLLM's warnings go through its logger; here they are
Python warnings (library code never prints). vLLM reads a value such as `-0.5` as a dotted option
(`-0` with key `5`); here a dotted option must start with a letter after its dashes, so a negative
decimal stays a value. `--config` needs PyYAML, which kvjax does not require (flax and gguf, which
it does require, install it); without it `--config` is refused with a message saying so.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import warnings
from argparse import ArgumentDefaultsHelpFormatter, BooleanOptionalAction, RawDescriptionHelpFormatter
from collections import defaultdict
from typing import Any, Sequence

from kvjax.errors import UsageError

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OPTION_NAME = re.compile(r"(?<=--)[^.]*")  # an option's name: after its first "--", up to its first "."
_DOTTED = re.compile(r"--?[A-Za-z]")  # a dotted option (never a negative number such as -0.5)
_HELP_HINT = "Use --help=<group title>, --help=<word> or --help=all to see the options."


def human_readable_int(value: str) -> int:
    """'1k' → 1,000 and '25.6k' → 25,600 (decimal k m g t), '1K' → 1,024 (binary K M G T, whole
    numbers only), else a plain integer."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        try:
            return int(number) * _BINARY[suffix]
        except ValueError:
            raise argparse.ArgumentTypeError(f"decimals are not allowed with the binary suffix {suffix}; did you "
                                             f"mean {number}{suffix.lower()}?") from None
    return int(value)


def human_readable_int_or_auto(value: str) -> int:
    """human_readable_int, with '-1' or 'auto' (any case) → -1 (detect automatically)."""
    value = value.strip()
    if value == "-1" or value.lower() == "auto":
        return -1
    return human_readable_int(value)


def summary_line(description: str | None) -> str:
    """The first paragraph of a description as one line."""
    return " ".join((description or "").split("\n\n", 1)[0].split())


class SortedHelpFormatter(ArgumentDefaultsHelpFormatter, RawDescriptionHelpFormatter):
    """Options sorted by their names, defaults shown; a help text's single newlines join its
    sentences, while blank lines and list items (-, *, +, 1.) start new lines."""

    _JOIN = re.compile(r"(?<!\n)\n(?!\n)(?!\s*(-|\*|\+|\d+\.))\s*")

    def _split_lines(self, text, width):
        lines = self._JOIN.sub(" ", text).splitlines()
        return sum([textwrap.wrap(line, width) for line in lines], [])

    def add_arguments(self, actions):
        super().add_arguments(sorted(actions, key=lambda a: a.option_strings))


class EnableDisableAction(BooleanOptionalAction):
    """`BooleanOptionalAction` that pairs `--enable-x` with `--disable-x` (and the reverse);
    `--no-enable-x` / `--no-disable-x` are still accepted but left out of help."""

    _INVERSE = {"--enable-": "--disable-", "--disable-": "--enable-"}

    def __init__(self, option_strings, dest, *args, **kwargs):
        super().__init__(option_strings, dest, *args, **kwargs)
        inverses = [inverse + opt.removeprefix(prefix) for opt in option_strings
                    for prefix, inverse in self._INVERSE.items() if opt.startswith(prefix)]
        negated = {opt for opt in self.option_strings if opt not in option_strings}  # the --no- forms
        self.negative_option_strings = negated | set(inverses)
        self.visible_option_strings = [*option_strings, *inverses] if inverses else list(self.option_strings)
        self.option_strings = [*self.option_strings, *inverses]

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negative_option_strings)


def _register_action(action: argparse.Action, deprecated: bool, deprecated_actions: set) -> None:
    # The parser has registered every option string by now; help shows only the visible ones.
    if isinstance(action, EnableDisableAction):
        action.option_strings = action.visible_option_strings
    if deprecated:
        deprecated_actions.add(action)


class _FlexibleArgumentGroup(argparse._ArgumentGroup):
    """An argument group whose add_argument takes `deprecated=` on every Python, as the parser's."""

    def __init__(self, container, *args, **kwargs):
        super().__init__(container, *args, **kwargs)
        self._deprecated: set[argparse.Action] = container._deprecated

    def add_argument(self, *args, **kwargs):
        deprecated = sys.version_info < (3, 13) and kwargs.pop("deprecated", False)
        action = super().add_argument(*args, **kwargs)
        _register_action(action, deprecated, self._deprecated)
        return action


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that takes `--flag_name` for `--flag-name`, dotted JSON options,
    `--config FILE.yaml`, `-O<level>` and `--help=<keyword>` (module docstring). Keyword
    `add_json_tip` (default True): show how to pass JSON options under `--help=all`."""

    _json_tip: str = (
        "When passing JSON CLI arguments, the following sets of arguments are equivalent:\n"
        '   --json-arg \'{"key1": "value1", "key2": {"key3": "value2"}}\'\n'
        "   --json-arg.key1 value1 --json-arg.key2.key3 value2\n\n"
        "Additionally, list elements can be passed individually using +:\n"
        '   --json-arg \'{"key4": ["value3", "value4", "value5"]}\'\n'
        "   --json-arg.key4+ value3 --json-arg.key4+='value4,value5'\n\n")

    def __init__(self, *args, **kwargs):
        self._deprecated: set[argparse.Action] = set()  # before super().__init__, which adds --help
        kwargs.setdefault("formatter_class", SortedHelpFormatter)
        self.add_json_tip = kwargs.pop("add_json_tip", True)
        self._search_keyword: str | None = None  # vLLM keeps it on the class; one parser's here
        super().__init__(*args, **kwargs)
        self.register("action", BooleanOptionalAction, EnableDisableAction)

    if sys.version_info < (3, 13):  # Python 3.13's argparse warns about deprecated options itself
        def parse_known_args(self, args=None, namespace=None):
            namespace, args = super().parse_known_args(args, namespace)
            for action in self._deprecated:
                if hasattr(namespace, action.dest) and getattr(namespace, action.dest) != action.default:
                    warnings.warn(f"argument '{action.dest}' is deprecated", FutureWarning, stacklevel=2)
            return namespace, args

    def add_argument(self, *args, **kwargs):
        deprecated = sys.version_info < (3, 13) and kwargs.pop("deprecated", False)
        action = super().add_argument(*args, **kwargs)
        _register_action(action, deprecated, self._deprecated)
        return action

    def add_argument_group(self, *args, **kwargs):
        group = _FlexibleArgumentGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group

    # ------------------------------------------------------------------ help
    def format_help(self) -> str:
        """`--help`: the groups, one line each; `--help=<keyword>`: a group, the matching options, or all."""
        if self._subparsers is not None:  # only a bottom-level parser lists groups
            return super().format_help()
        formatter = self._get_formatter()
        keyword = self._search_keyword
        if keyword is not None:
            keyword = keyword.lower().replace("_", "-")
            if keyword == "all":
                if self.add_json_tip:
                    self.epilog = self._json_tip
                return super().format_help()
            for group in self._action_groups:
                if group.title and group.title.lower() == keyword:
                    formatter.start_section(group.title)
                    formatter.add_text(summary_line(group.description))
                    formatter.add_arguments(group._group_actions)
                    formatter.end_section()
                    formatter.add_text(self._json_tip)
                    return formatter.format_help()
            matched = [a for g in self._action_groups for a in g._group_actions
                       if any(keyword in opt.lower() for opt in a.option_strings)]
            if matched:
                formatter.start_section(f"Arguments matching '{keyword}'")
                formatter.add_arguments(matched)
                formatter.end_section()
                formatter.add_text(self._json_tip)
                return formatter.format_help()
            formatter.add_text(f"No group or arguments matching '{keyword}'.\n"
                               "Use '--help' to see available groups or '--help=all' to see all available parameters.")
            return formatter.format_help()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        formatter.start_section("Config Groups")
        groups = [g for g in self._action_groups if g._group_actions]
        titles = [g.title or "" for g in groups]
        title_width = max((len(t) for t in titles), default=0) + 1
        width = max(formatter._width - formatter._current_indent, title_width + 20)
        lines = []
        for title, group in zip(titles, groups):
            wrapped = textwrap.wrap(summary_line(group.description), width, initial_indent=f"{title: <{title_width}}",
                                    subsequent_indent=" " * title_width)
            lines.append("\n".join(wrapped) or title)
        formatter.add_text("\n".join(lines) + "\n")
        formatter.end_section()
        # vLLM's own CLI puts this hint in its epilog; a script's parser would otherwise never say it.
        formatter.add_text(self.epilog if self.epilog else _HELP_HINT)
        return formatter.format_help()

    # ------------------------------------------------------------------ parsing
    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        """argparse's parse_args on the command line rewritten as the module docstring says."""
        args = list(sys.argv[1:] if args is None else args)
        if "--config" in args:
            args = self._pull_args_from_config(args)
        processed = self._normalize(args)
        processed, duplicates = self._merge_dotted(processed)
        if duplicates:
            warnings.warn(f"Found duplicate keys {', '.join(sorted(duplicates))}", stacklevel=2)
        return super().parse_args(processed, namespace)

    def _normalize(self, args: list[str]) -> list[str]:
        """`--a_b[=v]` → `--a-b[=v]`, `--help=<keyword>` → `--help`, `-O<level>` → `--optimization-level <level>`."""
        out: list[str] = []
        for i, arg in enumerate(args):
            if arg.startswith("--help="):
                self._search_keyword = arg.split("=", 1)[-1].lower()
                out.append("--help")
            elif arg.startswith("--"):
                key, eq, value = arg.partition("=")
                out.append(_OPTION_NAME.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + eq + value)
            elif arg.startswith("-O") and arg != "-O":  # -O3, -Odecode, -O=3
                out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
            elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
                out.append("--optimization-level")
            else:
                out.append(arg)
        return out

    @staticmethod
    def _merge_dotted(args: list[str]) -> tuple[list[str], set[str]]:
        """Dotted options merged into one JSON value per option, appended after the other
        arguments; and the keys and options given more than once."""
        delete: set[int] = set()
        dict_args: dict[str, dict[str, Any]] = defaultdict(dict)
        duplicates: set[str] = set()
        seen: set[str] = set()
        for i, arg in enumerate(args):
            if i in delete:  # the value of a dotted option before it
                continue
            if arg.startswith("--") and "." not in arg:
                name = arg.split("=", 1)[0]
                (duplicates if name in seen else seen).add(name)
                continue
            if not (_DOTTED.match(arg) and "." in arg):
                continue
            if "=" in arg:
                arg, value_str = arg.split("=", 1)
                if "." not in arg:  # the "." was in the value
                    continue
            elif i + 1 < len(args):
                value_str = args[i + 1]
                delete.add(i + 1)
            else:
                continue  # no value: argparse says what is wrong with the option
            if arg.endswith("+"):
                arg, value_str = arg[:-1], json.dumps(value_str.split(","))
            key, *keys = arg.split(".")
            try:
                value = json.loads(value_str)
            except json.JSONDecodeError:
                try:
                    value = human_readable_int(value_str)
                except (ValueError, argparse.ArgumentTypeError):
                    value = value_str
            for k in reversed(keys):
                value = {k: value}
            duplicates |= {f"{key}.{d}" for d in _merge(dict_args[key], value)}
            delete.add(i)
        out = [a for i, a in enumerate(args) if i not in delete]
        for key, value in dict_args.items():  # as if each had been passed as one JSON value
            out += [key, json.dumps(value)]
        return out, duplicates

    # ------------------------------------------------------------------ --config FILE
    def _pull_args_from_config(self, args: list[str]) -> list[str]:
        """The command line with `--config FILE` replaced by the file's arguments, placed first (or
        right after a sub-command) so that the command line's own arguments take precedence."""
        if args.count("--config") > 1:
            raise UsageError("More than one config file specified!")
        index = args.index("--config")
        if index == len(args) - 1:
            raise UsageError("No config file specified! Please check your command-line arguments.")
        config_args = self.load_config_file(args[index + 1])
        rest = args[:index] + args[index + 2:]
        if args[0].startswith("-"):  # no sub-command
            return config_args + rest
        return [rest[0]] + config_args + rest[1:]

    def load_config_file(self, file_path: str) -> list[str]:
        """A YAML file's top-level `key: value` pairs as command-line arguments (module docstring):
        `{port: 1, tp: [1, 2], x: {a: 1}}` → `['--port', '1', '--tp', '1', '2', '--x', '{"a": 1}']`."""
        extension = file_path.split(".")[-1]
        if extension not in ("yaml", "yml"):
            raise UsageError(f"Config file must be of a yaml/yml type. {extension} supplied")
        try:
            import yaml
        except ImportError:
            raise UsageError(f"--config {file_path}: reading a YAML config needs PyYAML (pip install pyyaml)") from None
        try:
            with open(file_path, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            raise UsageError(f"Unable to read the config file at {file_path}: {e}") from None
        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise UsageError(f"config file {file_path}: expected a mapping of key: value, got {type(config).__name__}")
        out: list[str] = []
        for key, value in config.items():
            if isinstance(value, bool):
                no_key = "--no-" + str(key).replace("_", "-")
                if value:
                    out.append(f"--{key}")
                elif no_key in self._option_string_actions:
                    out.append(no_key)
            elif isinstance(value, list):
                if value:
                    out += [f"--{key}", *(str(item) for item in value)]
            elif isinstance(value, dict):  # read as a JSON option
                out += [f"--{key}", json.dumps(value)]
            else:
                out += [f"--{key}", str(value)]
        return out


def _merge(original: dict[str, Any], update: dict[str, Any]) -> set[str]:
    """Merge update into original (nested dicts merged, lists extended); → the keys overwritten."""
    duplicates: set[str] = set()
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(original.get(k), dict):
            duplicates |= {f"{k}.{d}" for d in _merge(original[k], v)}
        elif isinstance(v, list) and isinstance(original.get(k), list):
            original[k] += v
        else:
            if k in original:
                duplicates.add(k)
            original[k] = v
    return duplicates


__all__ = ["FlexibleArgumentParser", "SortedHelpFormatter", "EnableDisableAction", "human_readable_int",
           "human_readable_int_or_auto", "summary_line"]
