"""Held-out prompts: prompts from the training mix's own sources that its regenerated responses never used, written as
a benchmark folder (one `<subset>.jsonl` per source) for `evaluation/run.py --benchmark <folder>`.

    python -m evaluation.heldout --data_dir data/smollm2-mix --output_dir evaluation/benchmarks/smollm2-heldout \
        --num_prompts 40 --target_dtype bfloat16 --threads 2

  python_code  coding tasks from the standard library's documented functions (`python-code`) whose function no
               training prompt names: no target compute;
  magpie       Magpie prompts sampled from the target with another seed than the training data's, minus any that
               equals a training prompt (up to case and whitespace).

The training prompts are read from the regenerated folder's shards, so the subsets are held out from exactly the
data the drafters were trained on.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from carryover_common.cli import check_at_least, check_exists, parse_arguments, run_cli
from carryover_common.outputs import check_output_dir
from carryover_common.targets import TargetArguments, load_target
from trainer.data import (
    deduplicate,
    load_regenerated,
    python_code_names,
    python_code_prompts,
    synthesize_prompts,
    write_atomic,
)

SUBSETS = ("python_code", "magpie")


@dataclass
class HeldoutArguments:
    data_dir: str = field(metadata={"help": "The regenerated training data (`python -m trainer.regenerate`)."})
    output_dir: str = field(default="evaluation/benchmarks/heldout", metadata={"help": "Where <subset>.jsonl go."})
    subsets: list[str] = field(default_factory=lambda: list(SUBSETS), metadata={"help": f"Of {SUBSETS}."})
    num_prompts: int = field(default=40, metadata={"help": "Prompts per subset."})
    seed: int = field(default=1, metadata={"help": "python-code draw and Magpie sampling seed (training used 0)."})
    magpie_max_new_tokens: int = field(default=64, metadata={"help": "Length cap of a synthesised user turn."})
    magpie_batch_size: int = field(default=32)
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Replace earlier <subset>.jsonl files."})

    def __post_init__(self):
        check_exists("data_dir", self.data_dir)
        unknown = set(self.subsets) - set(SUBSETS)
        if unknown:
            raise ValueError(f"--subsets {sorted(unknown)}: held-out subsets are {list(SUBSETS)}.")
        for name in ("num_prompts", "magpie_max_new_tokens", "magpie_batch_size"):
            check_at_least(name, getattr(self, name), 1)
        check_output_dir(self.output_dir, inputs=[self.data_dir], files={f"{name}.jsonl" for name in self.subsets},
                         overwrite=self.overwrite_output_dir)


def heldout_python_code(training_prompts: list[str], num_prompts: int, seed: int) -> list[str]:
    """Coding tasks on functions that no training prompt names."""
    return python_code_prompts(num_prompts, seed=seed, skip_names=python_code_names(training_prompts))


def heldout_magpie(target, tokenizer, training_prompts: list[str], args: HeldoutArguments) -> list[str]:
    """Magpie prompts (seed `args.seed`) that equal no training prompt: sampled with a margin, then filtered."""
    sampled = synthesize_prompts(
        target, tokenizer, 2 * args.num_prompts, batch_size=args.magpie_batch_size,
        max_new_tokens=args.magpie_max_new_tokens, seed=args.seed,
    )
    known = deduplicate(training_prompts)
    unseen = deduplicate([*known, *sampled])[len(known):]  # deduplicate keeps first occurrences: the training ones
    return unseen[: args.num_prompts]


ARGUMENT_CLASSES = (HeldoutArguments, TargetArguments)


def main(argv=None) -> dict:
    args, target_args = parse_arguments(ARGUMENT_CLASSES, argv)
    training_prompts = load_regenerated(args.data_dir)["prompt"]
    subsets = {}
    if "python_code" in args.subsets:
        subsets["python_code"] = heldout_python_code(training_prompts, args.num_prompts, args.seed)
    if "magpie" in args.subsets:
        target, tokenizer = load_target(target_args.target, target_args.target_adapter, dtype=target_args.torch_dtype)
        subsets["magpie"] = heldout_magpie(target, tokenizer, training_prompts, args)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, prompts in subsets.items():
        if len(prompts) < args.num_prompts:
            print(f"{name}: {len(prompts)} held-out prompts ({args.num_prompts} asked for)")
        lines = "".join(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts)
        write_atomic(output_dir / f"{name}.jsonl", lambda path: path.write_text(lines, encoding="utf-8"))
    print(f"{', '.join(f'{name}: {len(p)}' for name, p in subsets.items())} held-out prompts -> {output_dir}")
    return subsets


if __name__ == "__main__":
    run_cli(main)
