"""Regenerate the drafter's training responses with the target itself (on-policy data).

    python -m trainer.regenerate --data_dir data/smollm2-magpie --prompts magpie --num_prompts 2000 --target_dtype bfloat16
    python -m trainer.regenerate --data_dir data/qwen3-ultrachat --target Qwen/Qwen3-4B \\
        --prompts HuggingFaceH4/ultrachat_200k --prompt_split train_sft --num_prompts 50000 --max_new_tokens 2048

`--prompts` is a JSONL/Parquet/CSV file, a `save_to_disk` folder, a Hub dataset id, `magpie` (prompts sampled
from the target, kept in the data folder), `python-code` (coding tasks from the standard library's documented
functions, or with `--code_packages` those of installed packages) or `python-stub` (the same functions as stubs to
complete, HumanEval's form of a coding prompt). The target runs on the GPU when there is one. Several
sources mix, one `--num_prompts` each, shuffled together so every shard holds all of them:

    python -m trainer.regenerate --data_dir data/smollm2-mix --prompts python-code magpie --num_prompts 2500 1500

Running the same command again resumes an interrupted run. The same arguments are accepted by `trainer/run.py`,
which regenerates first and then trains.
"""

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from carryover_common.cli import check_at_least, check_exists, parse_arguments, run_cli
from carryover_common.outputs import check_output_dir
from carryover_common.targets import EMBEDDED_TARGET, TargetArguments, default_device, load_target
from trainer.data import (
    MANIFEST,
    load_prompts,
    python_code_names,
    python_code_prompts,
    regenerate,
    synthesize_prompts,
    write_atomic,
)


@dataclass
class RegenerationArguments:
    prompts: list[str] | None = field(
        default=None,
        metadata={
            "help": "Sources: JSONL/Parquet/CSV file, save_to_disk folder, Hub dataset id, 'magpie', 'python-code', "
            "'python-stub'."
        },
    )
    data_dir: str = field(default="data/regenerated", metadata={"help": "Where the regenerated shards go (resumable)."})
    prompt_split: str = field(default="train")
    prompt_column: str | None = field(default=None, metadata={"help": "Prompt or chat-messages column (default: auto)."})
    num_prompts: list[int] | None = field(
        default=None, metadata={"help": "One per source: its first N prompts (magpie, python-code, python-stub: how many to make)."}
    )
    exclude_prompts: list[str] | None = field(
        default=None,
        metadata={
            "help": "Prompt files or datasets (a held-out benchmark's): python-code and python-stub never draw the "
            "functions their prompts name."
        },
    )
    code_packages: list[str] | None = field(
        default=None,
        metadata={
            "help": "python-code and python-stub draw from these installed packages' documented functions (e.g. "
            "numpy sympy networkx) instead of the standard library's."
        },
    )
    magpie_max_new_tokens: int = field(default=128, metadata={"help": "Length cap of a synthesised user turn."})
    shard_size: int = field(default=256)
    generation_batch_size: int = field(default=16)
    max_new_tokens: int = field(default=1024, metadata={"help": "Cap on each regenerated response."})
    max_total_length: int | None = field(default=None, metadata={"help": "Cap on prompt + response tokens."})
    do_sample: bool = field(default=False, metadata={"help": "Sample the responses (default: greedy)."})
    temperature: float = field(default=1.0)
    top_p: float = field(default=1.0)
    top_k: int = field(default=0)
    generation_seed: int = field(default=0)
    chat_template_kwargs: str = field(default="{}", metadata={"help": 'JSON, e.g. {"enable_thinking": false}'})

    def __post_init__(self):
        check_exists("prompts", [p for p in self.prompts or () if p not in GENERATED_SOURCES], hub=True)
        check_exists("exclude_prompts", self.exclude_prompts, hub=True)
        check_at_least("num_prompts", self.num_prompts, 1, " (unset: all of a source)")
        for name in ("magpie_max_new_tokens", "shard_size", "generation_batch_size", "max_new_tokens"):
            check_at_least(name, getattr(self, name), 1)
        check_at_least("top_k", self.top_k, 0, " (0: no top-k cut)")
        check_at_least("max_total_length", self.max_total_length, 2)
        if self.do_sample and self.temperature <= 0:
            raise ValueError(
                f"--temperature must be above 0 with --do_sample (greedy: leave --do_sample out), got {self.temperature}."
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be above 0 and at most 1 (1: no nucleus cut), got {self.top_p}.")
        try:
            kwargs = json.loads(self.chat_template_kwargs)
        except json.JSONDecodeError as error:
            example = '{"enable_thinking": false}'
            raise ValueError(f"--chat_template_kwargs must be a JSON object, e.g. '{example}' ({error}).") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"--chat_template_kwargs must be a JSON object, got {self.chat_template_kwargs}.")


GENERATED_SOURCES = ("magpie", "python-code", "python-stub")  # --prompts made here, not read from a file


def check_data_dir(args: RegenerationArguments) -> None:
    """--data_dir is new, or a regeneration this run resumes or grows (its manifest is compared with the settings
    before any shard is written); a folder of other files is refused before the target is loaded."""
    folder = Path(args.data_dir)
    ours = folder.is_dir() and ((folder / MANIFEST).exists() or all(p.name.startswith("magpie-") for p in folder.iterdir()))
    inputs = [p for p in args.prompts or () if p not in GENERATED_SOURCES] + list(args.exclude_prompts or ())
    check_output_dir(folder, inputs=inputs, resumable=ours, flag=None, name="--data_dir")


def magpie_prompts(target, tokenizer, args: RegenerationArguments, num_prompts: int) -> list:
    """Synthesised once and kept next to the data: sampling is costly, and a resumed run must see the same list."""
    path = Path(args.data_dir) / f"magpie-n{num_prompts}-seed{args.generation_seed}.jsonl"
    if not path.exists():
        prompts = synthesize_prompts(
            target,
            tokenizer,
            num_prompts,
            batch_size=args.generation_batch_size,
            max_new_tokens=args.magpie_max_new_tokens,
            seed=args.generation_seed,
            chat_template_kwargs=json.loads(args.chat_template_kwargs),
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda p: p.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts)))
    return load_prompts(path)


def source_prompts(target, tokenizer, args: RegenerationArguments, source: str, num_prompts: int | None) -> list:
    if source in GENERATED_SOURCES and not num_prompts:
        raise ValueError(f"--prompts {source} needs its --num_prompts")
    if source == "magpie":
        return magpie_prompts(target, tokenizer, args, num_prompts)
    if source in ("python-code", "python-stub"):
        excluded = python_code_names(p for path in args.exclude_prompts or () for p in load_prompts(path))
        return python_code_prompts(
            num_prompts,
            seed=args.generation_seed,
            stubs=source == "python-stub",
            exclude_names=excluded,
            packages=args.code_packages or (),
        )
    return load_prompts(source, split=args.prompt_split, column=args.prompt_column, limit=num_prompts)


def mixed_prompts(target, tokenizer, args: RegenerationArguments) -> list:
    """The prompts of every source; several sources are shuffled together (seeded) so each shard mixes them."""
    counts = args.num_prompts or [None] * len(args.prompts)
    if len(counts) != len(args.prompts):
        raise ValueError(f"--num_prompts gives {len(counts)} counts for {len(args.prompts)} --prompts sources: give one each")
    prompts = [p for source, n in zip(args.prompts, counts) for p in source_prompts(target, tokenizer, args, source, n)]
    if len(args.prompts) > 1:
        random.Random(args.generation_seed).shuffle(prompts)
    return prompts


def regenerate_from_args(target, tokenizer, args: RegenerationArguments, target_name: str | None):
    """Prompts -> the target's responses in `args.data_dir` (resuming whatever is there) -> the dataset."""
    prompts = mixed_prompts(target, tokenizer, args)
    return regenerate(
        target,
        tokenizer,
        prompts,
        args.data_dir,
        shard_size=args.shard_size,
        batch_size=args.generation_batch_size,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_total_length,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.generation_seed,
        chat_template_kwargs=json.loads(args.chat_template_kwargs),
        target_name=target_name or EMBEDDED_TARGET,
    )


ARGUMENT_CLASSES = (TargetArguments, RegenerationArguments)


def main(argv=None):
    target_args, args = parse_arguments(ARGUMENT_CLASSES, argv)
    if not args.prompts:
        raise SystemExit("--prompts is required: a file, a save_to_disk folder, a Hub dataset id, 'magpie', 'python-code' or 'python-stub'")
    check_data_dir(args)
    target, tokenizer = load_target(
        target_args.target, adapter=target_args.target_adapter, dtype=target_args.torch_dtype, device=default_device()
    )
    data = regenerate_from_args(target, tokenizer, args, target_args.target)
    response_tokens = sum(sum(mask) for mask in data["loss_mask"])
    print(f"{len(data)} responses ({sum(data['finished'])} ended their turn), {response_tokens} response tokens -> {args.data_dir}")


if __name__ == "__main__":
    run_cli(main)
