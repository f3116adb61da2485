"""Generate docs/cli.md, the command-line flags of every script, from the scripts' argument dataclasses.

    python docs/cli_reference.py            # rewrite docs/cli.md
    python docs/cli_reference.py --check    # exit 1 if docs/cli.md is not what the code would generate

A script is a module of the project's packages whose `main` parses its flags; each declares the dataclasses it parses
in a module-level tuple `ARGUMENT_CLASSES`. Every field becomes a row: flag, type, default, and `metadata["help"]`.
transformers' own `TrainingArguments` is linked, not expanded (only fields a subclass adds are listed).
"""

import argparse
import dataclasses
import importlib
import re
import sys
import types
import typing
from pathlib import Path

from check_links import github_slug  # the same anchors the link checker expects (docs/ is the script's folder)

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "cli.md"
PACKAGES = ("trainer", "evaluation", "hub", "serving", "carryover_common")
# The order of the page: the main scripts first, then any other script found, by path.
FIRST = (
    "trainer/run.py",
    "trainer/regenerate.py",
    "trainer/features.py",
    "evaluation/run.py",
    "evaluation/analyze.py",
    "evaluation/compare.py",
    "evaluation/slot_accuracy.py",
    "evaluation/heldout.py",
    "hub/convert.py",
    "hub/publish.py",
    "serving/vllm_plugin.py",
)
TRAINING_ARGUMENTS_DOCS = "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments"
MAIN_PARSES_FLAGS = re.compile(r"\bparse_arguments\(|HfArgumentParser\(")


def script_paths() -> list[str]:
    """Project files (relative paths) that define `main` and parse flags in them, main scripts first."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            source = path.read_text(encoding="utf-8")
            if path.name != "cli.py" and re.search(r"^def main\(", source, re.M) and MAIN_PARSES_FLAGS.search(source):
                found.append(path.relative_to(ROOT).as_posix())
    return [p for p in FIRST if p in found] + sorted(p for p in found if p not in FIRST)


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def command_of(path: str, module) -> str:
    """How the script is run: the form its own docstring's usage shows (`python -m pkg.mod` or `python pkg/mod.py`)."""
    doc = module.__doc__ or ""
    match = re.search(rf"python (-m {re.escape(module_name(path))}\b|{re.escape(path)})", doc)
    return f"python {match.group(1)}" if match else f"python {path}"


def summary_of(module) -> str:
    """The first sentence of the module docstring, on one line."""
    first_paragraph = (module.__doc__ or "").strip().split("\n\n")[0]
    text = " ".join(first_paragraph.split())
    match = re.match(r"(.+?[.:])(\s|$)", text)
    sentence = match.group(1) if match else text
    return sentence[:-1] + "." if sentence.endswith(":") else sentence


def type_name(annotation) -> str:
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return "one of " + ", ".join(str(arg) for arg in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def default_of(field: dataclasses.Field) -> str | None:
    """The default as the command line would spell it; None for a required flag."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return None
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) if value else "(empty)"
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):  # an Enum
        value = value.value
    return str(value)


def cell(text: str) -> str:
    """Table-cell text: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code_cell(text: str) -> str:
    return f"`{cell(text)}`" if text != "" else ""


def is_training_arguments(cls) -> bool:
    try:
        from transformers import TrainingArguments
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, TrainingArguments)


def fields_table(cls, skip: set[str] = frozenset()) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| flag | type | default | help |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if not field.init or field.name in skip:
            continue
        help_text = field.metadata.get("help", "")
        choices = field.metadata.get("choices")
        if choices:
            help_text = f"{help_text} Choices: {', '.join(map(str, choices))}.".strip()
        default = default_of(field)
        rows.append(
            f"| `--{field.name}` | {code_cell(type_name(hints.get(field.name, field.type)))} "
            f"| {'*required*' if default is None else code_cell(default)} | {cell(help_text)} |"
        )
    return rows


def class_section(cls) -> list[str]:
    lines = [f"**{cls.__name__}**", ""]
    if is_training_arguments(cls):
        from transformers import TrainingArguments

        lines += [
            f"Every field of transformers' [`TrainingArguments`]({TRAINING_ARGUMENTS_DOCS}) "
            "(`--output_dir`, `--learning_rate`, `--num_train_epochs`, `--bf16`, `--resume_from_checkpoint`, ...).",
            "",
        ]
        if cls is TrainingArguments:
            return lines
        lines += fields_table(cls, skip={f.name for f in dataclasses.fields(TrainingArguments)})
    else:
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(f"{cls.__name__}("):  # not the dataclass's generated signature
            lines += [" ".join(doc.split("\n\n")[0].split()), ""]
        lines += fields_table(cls)
    return lines + [""]


def generate() -> str:
    from carryover_common.cli import RuntimeArguments

    lines = [
        "# Command-line flags",
        "",
        "<!-- Generated by docs/cli_reference.py from the scripts' argument dataclasses; do not edit by hand. -->",
        "",
        "Every script below reads flags; those marked *config file* also take a JSON or YAML file with the same fields",
        "as their first argument, and flags after it override it:",
        "`python trainer/run.py trainer/configs/smollm2_dflash.yaml --output_dir elsewhere`.",
        "",
        "Those scripts also take the runtime flags:",
        "",
        *fields_table(RuntimeArguments),
        "",
    ]
    scripts, problems = [], []
    for path in script_paths():
        module = importlib.import_module(module_name(path))
        classes = getattr(module, "ARGUMENT_CLASSES", None)
        if classes is None:
            problems.append(f"{path}: no module-level ARGUMENT_CLASSES (the dataclasses its main parses)")
            continue
        scripts.append((path, module, tuple(classes)))
    if problems:
        raise SystemExit("cli_reference: " + "; ".join(problems))
    lines += ["| script | what it does |", "|---|---|"]
    for path, module, _ in scripts:
        command = command_of(path, module)
        lines.append(f"| [`{command}`](#{github_slug(command)}) | {cell(summary_of(module))} |")
    lines.append("")
    for path, module, classes in scripts:
        command = command_of(path, module)
        source = (ROOT / path).read_text(encoding="utf-8")
        config_file = "parse_arguments(" in source
        subcommands = getattr(module, "COMMANDS", None)
        usage = command + (f" {{{','.join(subcommands)}}}" if subcommands else "")
        usage += " [config.yaml]" if config_file else ""
        lines += [
            f"## {command}",
            "",
            f"{summary_of(module)} Source: [`{path}`](../{path}).",
            "",
            f"`{usage} [--flags]`" + (" (*config file*; also `--threads`)" if config_file else ""),
            "",
        ]
        for cls in classes:
            lines += class_section(cls)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/cli.md from the scripts' argument dataclasses.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is stale, without writing it")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else None
        if current != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is stale: the scripts' arguments changed. "
                "Run `python docs/cli_reference.py` and commit the result.",
                file=sys.stderr,
            )
            return 1
        print(f"{OUTPUT.relative_to(ROOT)} is current")
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
