"""`--config run.toml`: any `train` flag under its long name, flags on the command line winning.

The file's settings become flags placed before the command line's own (``schedule = "zb-h1"`` →
``--schedule zb-h1``, ``sequence_parallel = true`` → ``--sequence-parallel``, a list → its items
joined by commas), so argparse's last-one-wins gives the command line precedence and every
setting goes through the same parsing and checks as a flag. Keys may use ``-`` or ``_``. Several
`--config` files apply in order, a later one winning (a second file was ignored while the header
named it).

A flag may sit at the top of the file or in the table of the part of the run it sets — the
parts of `TrainSpec` (`[model]`, `[parallelism]`, `[optimizer]`, `[checkpoints]`,
`[evaluation]`, `[logging]`), as torchtitan's job config is laid out; a flag in another part's
table is refused, naming where it belongs. `effective_config` is what a run then stores in its
checkpoints, logs and summary (flat, by flag).
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Sequence
from pathlib import Path

from pipeloom.errors import ConfigError

__all__ = ["expand_config", "effective_config", "config_line", "part_of"]

_FLAG = "--config"
_IGNORED = ("help", "config")
_CLI_PARTS = {
    "model": ("model", "data", "data-dtype", "tokenizer", "image-size", "layers", "hidden", "heads", "ffn", "vocab"),
    "parallelism": (
        "schedule",
        "devices",
        "microbatches",
        "chunks",
        "slices",
        "forwards",
        "schedule-file",
        "mem-limit",
        "split",
        "batch-w",
        "ckpt",
        "passes",
        "costs",
        "hardware",
        "timeout",
        "reload-bf16",
        "nproc",
        "plan",
    ),
    "checkpoints": ("save", "resume"),
    "logging": ("quiet", "trace", "summary"),
}
"""The flags a TrainSpec does not hold as such (they choose its model, schedule or outputs), by part;
the model part also takes seq-len and microbatch-size, which shape the workload."""
_CLI_PARTS["model"] += ("seq-len", "microbatch-size")


def part_of(flag: str, action: argparse.Action) -> str | None:
    """The part of the run (a TrainSpec part's name) that a flag (its long name without dashes)
    sets; None: the run as a whole (steps)."""
    from pipeloom.runtime.spec import FLAT

    for part, flags in _CLI_PARTS.items():
        if flag in flags:
            return part
    where = FLAT.get(action.dest)
    return where[0] if where is not None else None


def expand_config(
    argv: Sequence[str], parser: argparse.ArgumentParser, position: int, launcher_only: Sequence[str] = ()
) -> list[str]:
    """`argv` with the settings of its ``--config FILE`` inserted as flags at `position` (after the
    command's name); unchanged without one. `launcher_only`: keys another launcher reads, skipped
    here (torchrun starts the ranks, so its entry point skips ``nproc``). ConfigError for an
    unreadable file or an unknown key."""
    argv = list(argv)
    tokens: list[str] = []
    for path in _config_paths(argv):  # each file's flags after the one before: the later file wins
        tokens += _file_flags(path, parser, launcher_only)
    return argv[:position] + tokens + argv[position:]


def _file_flags(path: str, parser: argparse.ArgumentParser, launcher_only: Sequence[str]) -> list[str]:
    try:
        settings = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"--config: cannot read {path!r}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config: {path!r} is not valid TOML: {error}") from None
    from pipeloom.runtime.spec import PARTS

    actions = _long_options(parser)
    tokens: list[str] = []
    for table, key, value in _settings(path, settings, PARTS):
        flag = "--" + key.replace("_", "-")
        if flag[2:] in launcher_only:
            continue
        action = actions.get(flag)
        if action is None or key in _IGNORED:
            where = f" in [{table}]" if table else ""
            raise ConfigError(f"--config: {path!r} sets {key!r}{where}, which is not a flag of this command")
        if table is not None and part_of(flag[2:], action) != table:
            home = part_of(flag[2:], action)
            belongs = f"under [{home}]" if home else "at the top of the file"
            raise ConfigError(f"--config: {path!r} sets {key!r} in [{table}]; it belongs {belongs}")
        tokens += _as_flags(path, key, flag, value, action)
    return tokens


def _settings(path: str, settings: dict, parts) -> list[tuple[str | None, str, object]]:
    """(its part's table or None, key, value) of every flag the file sets, at its top or in a
    part's table; ConfigError for a table that is no part."""
    out: list[tuple[str | None, str, object]] = []
    for key, value in settings.items():
        if not isinstance(value, dict):
            out.append((None, key, value))
            continue
        if key not in parts:
            raise ConfigError(
                f"--config: {path!r} has a table [{key}]; the parts of a run are {', '.join(f'[{p}]' for p in parts)}"
            )
        out += [(key, inner, setting) for inner, setting in value.items()]
    return out


def effective_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """Every flag's value as the run sees it, by long name (None: not given and no default)."""
    out: dict = {}
    for flag, action in _long_options(parser).items():
        if flag == "--help" or not hasattr(args, action.dest):
            continue
        out[flag[2:]] = getattr(args, action.dest)
    if getattr(args, "name", None):
        out["schedule"] = args.name
    if isinstance(out.get("config"), list) and len(out["config"]) == 1:
        out["config"] = out["config"][0]  # one file, as a run with one always recorded it
    return out


def config_line(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The effective configuration in one line: the settings that differ from the defaults."""
    from pipeloom.cli.train_args import LR_DEFAULTS

    defaults = {flag[2:]: parser.get_default(action.dest) for flag, action in _long_options(parser).items()}
    defaults.update({name.replace("_", "-"): value for name, value in LR_DEFAULTS.items()})
    changed = {
        key: value
        for key, value in effective_config(args, parser).items()
        if value != defaults.get(key) and value is not None
    }
    return "config: " + " ".join(f"{key}={value}" for key, value in changed.items())


def _config_paths(argv: list[str]) -> list[str]:
    paths = []
    for index, token in enumerate(argv):
        if token == _FLAG:
            if index + 1 >= len(argv):
                raise ConfigError("--config needs a TOML file")
            paths.append(argv[index + 1])
        elif token.startswith(_FLAG + "="):
            paths.append(token.split("=", 1)[1])
    return paths


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings if option.startswith("--")}


def _as_flags(path: str, key: str, flag: str, value, action: argparse.Action) -> list[str]:
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise ConfigError(f"--config: {path!r}: {key} is on or off: write {key} = true or false")
        return [flag] if value else []
    if isinstance(value, bool) or isinstance(value, dict):
        raise ConfigError(f"--config: {path!r}: {key} takes a value, got {value!r}")
    if isinstance(value, list):
        value = ",".join(str(item) for item in value)
    return [flag, str(value)]
