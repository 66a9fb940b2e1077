"""``rollout run --config run.toml``: options from a TOML file, flags on top.

Every option of ``rollout run`` has a key: its long name without the dashes,
with ``_`` or ``-`` between words (``n_samples = 4``, ``max-new-tokens = 64``,
``server = ["http://a:30000", "http://b:30000"]``, ``workflow_kwargs = {max_turns = 3}``).
Values are TOML values of the option's kind (a flag: ``true``/``false``; a number:
an integer or a float; a path: a string) and are checked as the flag's own text
would be.  Precedence: a flag given on the command line, then the file, then the
option's default.

:func:`dump_config` writes the merged options as TOML (options left unset, with
no default, are omitted), which ``--print-config`` prints and ``rollout run``
saves as ``config.toml`` in ``--out``: ``rollout run --config OUT/config.toml``
repeats the run.  Paths are kept as written (relative ones stay relative to the
directory the run was started from).

Errors: :class:`ConfigError` (a ``ValueError``), one line naming the file and the key.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import RolloutError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "config_dict", "dump_config", "merge_config_file", "run_subparser"]

#: Options that steer the command itself and are never saved.
NOT_SAVED = ("config", "print_config", "help", "resume", "server_api_key")
#: Secrets: never saved, never read from a config file (rollout run takes them from a flag or the environment).
SECRETS = {"server_api_key": "ROLLOUT_SERVER_API_KEY"}
_UNSET = object()


class ConfigError(RolloutError, ValueError):
    """A config file that cannot be read or holds a bad key or value."""


def run_subparser(parser: argparse.ArgumentParser, command: str = "run") -> argparse.ArgumentParser:
    """The sub-parser of ``command`` in ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def _options(run: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in run._actions if a.option_strings and a.dest not in NOT_SAVED]


def _explicit(build_parser: Any, argv: list[str]) -> set[str]:
    """The ``dest`` of each option given on the command line (a second parse in
    which every default is a marker)."""
    parser = build_parser()
    run = run_subparser(parser)
    for action in _options(run):
        action.default = None if isinstance(action, argparse._AppendAction) else _UNSET
    args = parser.parse_args(argv)
    return {a.dest for a in _options(run) if getattr(args, a.dest) not in (_UNSET, None)}


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    """A TOML value for ``action``, checked as the flag's text would be."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in values):
            raise ConfigError(f"{where}: expected a string or a list of strings, got {value!r}")
        return [_convert_one(action, v, where) for v in values]
    return _convert_one(action, value, where)


def _convert_one(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(value, dict):
        if getattr(action.type, "__name__", "") != "_json_object":
            raise ConfigError(f"{where}: expected a single value, got a table")
        return value
    if isinstance(value, bool) or isinstance(value, (list, dict)) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: expected a {'number' if action.type not in (None, str) else 'string'}, "
                          f"got {value!r}")
    if action.type is None and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    try:
        converted = action.type(str(value)) if callable(action.type) else value
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: {converted!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def merge_config_file(build_parser: Any, argv: list[str], args: argparse.Namespace) -> argparse.Namespace:
    """``args`` (parsed from ``argv``) with the values of ``--config FILE`` filled
    in where no flag was given.  Returns ``args`` unchanged without ``--config``.

    Raises:
        ConfigError: the file is missing or not TOML, a key is not an option of
            ``rollout run``, or a value is of the wrong kind or out of range.
    """
    if getattr(args, "config", None) is None:
        return args
    path = Path(args.config)
    table = _read(path)
    by_key = {a.dest: a for a in _options(run_subparser(build_parser()))}
    explicit = _explicit(build_parser, argv)
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        action = by_key.get(key)
        if key in SECRETS:
            raise ConfigError(f"--config {path}: key {raw_key!r} is a secret, never read from a config file; set the "
                              f"environment variable {SECRETS[key]} instead")
        if action is None:
            raise ConfigError(f"--config {path}: unknown key {raw_key!r} (keys are rollout run's long options, "
                              "e.g. n_samples, dataset, reward)")
        if key not in explicit:
            setattr(args, key, _convert(action, value, f"--config {path}: key {raw_key!r}"))
    return args


def config_dict(build_parser: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The options of ``rollout run`` in ``args`` as TOML-ready values, in the
    order of ``--help``; unset ones (``None``) are left out."""
    out: dict[str, Any] = {}
    for action in _options(run_subparser(build_parser())):
        value = getattr(args, action.dest, None)
        if value is None or (isinstance(value, list) and not value and isinstance(action, argparse._AppendAction)):
            continue
        out[action.dest] = [str(v) for v in value] if isinstance(value, list) else \
            str(value) if isinstance(value, Path) else value
    return out


def dump_config(config: dict[str, Any]) -> str:
    """``config`` as TOML text (what ``--print-config`` prints and ``config.toml`` holds).

    Raises:
        ConfigError: a value TOML cannot hold (a JSON null inside ``workflow_kwargs``).
    """
    import tomli_w

    try:
        body = tomli_w.dumps(config)
    except TypeError as exc:
        raise ConfigError(f"cannot write the configuration as TOML: {exc}") from None
    return "# rollout run configuration: rollout run --config THIS_FILE repeats the run\n" + body
