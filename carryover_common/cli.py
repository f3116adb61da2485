"""Command-line arguments of the project's scripts: flags, or a JSON/YAML file with the same fields followed by flags
that override it (a recipe and one run's changes). Every script also takes `--threads` (torch's CPU threads), applied
here before any model work."""

import json
import sys
from dataclasses import dataclass, field

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
    if runtime.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {runtime.threads}")
    torch.set_num_threads(runtime.threads)
    return tuple(parsed)
