"""Command-line arguments of the project's scripts: flags, or one JSON/YAML file with the same fields."""

import os
import sys

from transformers import HfArgumentParser


def parse_arguments(dataclass_types, argv: list[str] | None = None) -> tuple:
    """Instances of `dataclass_types` from `argv` (default: sys.argv[1:]): flags, or a single .json/.yaml/.yml file."""
    parser = HfArgumentParser(dataclass_types)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(os.path.abspath(argv[0]))
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        return parser.parse_yaml_file(os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(argv)
