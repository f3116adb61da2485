"""Command-line arguments of the project's scripts: flags, or a JSON/YAML file with the same fields followed by flags
that override it (a recipe and one run's changes). Every script also takes `--threads` (torch's CPU threads), applied
here before any model work."""

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from transformers import HfArgumentParser


@dataclass
class RuntimeArguments:
    # Measured on the 2-core machine (SmolLM2-135M, fp32, 200-token prefill + 16 decode steps + 4 verifications):
    # alone, 2 threads took 0.60x the time of 1; beside one busy single-thread process, 2.0x (up to 10x).
    threads: int = field(
        default=1,
        metadata={"help": "torch CPU threads. 1 is robust when other jobs share the cores; give the core count on an idle machine."},
    )


def config_file_flags(path: str) -> list[str]:
    """The fields of a .json/.yaml/.yml file as flags: `key: value` -> `--key value`, lists -> `--key a b`, null: the
    default."""
    with open(path) as file:
        config = json.load(file) if path.endswith(".json") else yaml.safe_load(file)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a mapping of argument names to values")
    flags = []
    for key, value in config.items():
        if value is None:
            continue  # the field's default
        values = value if isinstance(value, list) else [value]
        flags += [f"--{key}", *(json.dumps(v) if isinstance(v, (bool, dict)) else str(v) for v in values)]
    return flags


def parse_arguments(dataclass_types, argv: list[str] | None = None) -> tuple:
    """Instances of `dataclass_types` from `argv` (default: sys.argv[1:]): flags, optionally after one .json/.yaml/.yml
    file whose fields they override. Unknown fields are an error. The `--threads` setting is applied, not returned
    (read it back with `torch.get_num_threads()`)."""
    types = (*(dataclass_types if isinstance(dataclass_types, (list, tuple)) else [dataclass_types]), RuntimeArguments)
    parser = HfArgumentParser(types)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].endswith((".json", ".yaml", ".yml")):
        argv = config_file_flags(argv[0]) + argv[1:]  # argparse keeps the last value given: the flags win
    *parsed, runtime = parser.parse_args_into_dataclasses(argv)
    check_at_least("threads", runtime.threads, 1)
    torch.set_num_threads(runtime.threads)
    return tuple(parsed)


def run_cli(main) -> None:
    """Run a script's `main()`: an error about its inputs (a ValueError or OSError, whose message names the problem and
    the fix) ends the process with that message and exit status 1, not a traceback; other errors keep theirs."""
    try:
        main()
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")


# Argument checks, called from the argument dataclasses' __post_init__: before any model is loaded.


def check_at_least(name: str, value, low, what: str = "") -> None:
    """`--name` (each value of a list) must be >= `low`; None (unset) passes."""
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is not None and v < low:
            raise ValueError(f"--{name} must be at least {low}{what}, got {v}.")


def check_between(name: str, value, low, high) -> None:
    """`--name` must lie in [low, high]; None (unset) passes."""
    if value is not None and not low <= value <= high:
        raise ValueError(f"--{name} must be between {low} and {high}, got {value}.")


FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".gz", ".bz2", ".xz", ".zst", ".yaml", ".yml", ".txt")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # name or org/name


def check_exists(name: str, value, hub: bool = False) -> None:
    """A path argument must exist. `hub`: a value shaped like a Hub repo id (name or org/name) may name one instead; a
    missing local path (./x, /x, a/b/c, ~/x) is reported as such, not as a bad Hub id."""
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is None or Path(v).expanduser().exists():
            continue
        if hub and _HUB_ID.match(v) and Path(v).suffix not in FILE_SUFFIXES:
            continue
        where = " (and it is not shaped like a Hub id, org/name)" if hub else ""
        raise ValueError(f"--{name} {v}: no such file or folder{where}. Check the path.")
