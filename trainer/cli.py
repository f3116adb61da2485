"""Command-line arguments of the project's scripts: flags, or one JSON/YAML file with the same fields. Every script
also takes `--threads` (torch's CPU threads), applied here before any model work."""

import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser


@dataclass
class RuntimeArguments:
    # Measured on the 2-core machine (SmolLM2-135M, fp32, 200-token prefill + 16 decode steps + 4 verifications):
    # alone, 2 threads took 0.60x the time of 1; beside one busy single-thread process, 2.0x (up to 10x).
    threads: int = field(
        default=1,
        metadata={"help": "torch CPU threads. 1 is robust when other jobs share the cores; give the core count on an idle machine."},
    )


def parse_arguments(dataclass_types, argv: list[str] | None = None) -> tuple:
    """Instances of `dataclass_types` from `argv` (default: sys.argv[1:]): flags, or a single .json/.yaml/.yml file.
    The `--threads` setting is applied, not returned (read it back with `torch.get_num_threads()`)."""
    types = (*(dataclass_types if isinstance(dataclass_types, (list, tuple)) else [dataclass_types]), RuntimeArguments)
    parser = HfArgumentParser(types)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        *parsed, runtime = parser.parse_json_file(os.path.abspath(argv[0]))
    elif len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        *parsed, runtime = parser.parse_yaml_file(os.path.abspath(argv[0]))
    else:
        *parsed, runtime = parser.parse_args_into_dataclasses(argv)
    if runtime.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {runtime.threads}")
    torch.set_num_threads(runtime.threads)
    return tuple(parsed)
