"""Draft-vocabulary benchmark: drafting time per round and training step time with a draft vocabulary of N tokens
against the full vocabulary, in one run, interleaved (the machine's drift is shared).

    python evaluation/bench_draft_vocab.py --sizes 8192 16384 32768 --num_prompts 4 --max_new_tokens 64 --steps 3

Each size gets the same random drafter (same seed; the new-drafter default of bench_decoding.py) restricted to its
first N token ids: what a drafter costs does not depend on which N rows of the LM head it scores. Decoding: the mean
`draft_seconds` of the carryover `generate` rounds (drafter forward, LM-head rows, draft choice), greedy, carryover
off. Training: one baseline `training_step_loss` + backward + AdamW step on random rows. A benchmark, not a test:
compare the ratios measured in the same run.
"""

import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from carryover_common.benchmarks import encode_prompt, load_benchmark
from carryover_common.cli import parse_arguments
from carryover_common.targets import load_target
from modeling_carryover import CarryoverDrafterConfig, CarryoverDrafterModel
from modeling_carryover import generate as carryover_generate
from trainer.objectives import LossSettings, default_gamma, training_step_loss

FULL = "full"


@dataclass
class BenchArguments:
    sizes: list[int] = field(default_factory=lambda: [8192, 16384, 32768], metadata={"help": "Draft vocabularies."})
    target: str | None = field(default=None, metadata={"help": "Default: the embedded SmolLM2-135M-Instruct."})
    num_draft_layers: int = field(default=2)
    block_size: int = field(default=16)
    benchmark: str = field(default="embedded")
    subset: str = field(default="humaneval")
    num_prompts: int = field(default=4)
    max_new_tokens: int = field(default=64)
    steps: int = field(default=3, metadata={"help": "Timed training steps per size (after one warmup step)."})
    batch_size: int = field(default=2)
    sequence_length: int = field(default=256)
    num_anchors: int = field(default=32)
    output: str = field(default="outputs/bench_draft_vocab.json")


def drafter_for(target, size, args) -> CarryoverDrafterModel:
    torch.manual_seed(0)
    config = CarryoverDrafterConfig.from_target_config(
        target.config, num_hidden_layers=args.num_draft_layers, block_size=args.block_size,
        draft_vocab_size=None if size == FULL else size,
    )
    return CarryoverDrafterModel(config).to(target.device)


def rotated(items, index):
    return items[index % len(items) :] + items[: index % len(items)]


@torch.no_grad()
def drafting_seconds_per_round(target, tokenizer, drafters, args) -> dict:
    prompts = load_benchmark(args.benchmark, subsets=[args.subset], limit=args.num_prompts)[args.subset]
    seconds = defaultdict(list)
    for index, prompt in enumerate(prompts):
        inputs = encode_prompt(tokenizer, prompt).to(target.device)
        for size in rotated(list(drafters), index):
            drafter = drafters[size].eval()
            carryover_generate(
                target, **inputs, assistant_model=drafter, carryover=False, max_new_tokens=args.max_new_tokens, do_sample=False,
                linear_backend="default",
            )
            seconds[size] += [r.draft_seconds for r in drafter.generation_stats.rounds]
    return {size: statistics.fmean(values) for size, values in seconds.items()}


def training_seconds_per_step(target, drafters, args) -> dict:
    generator = torch.Generator().manual_seed(0)
    S, T = args.batch_size, args.sequence_length
    batch = {
        "input_ids": torch.randint(0, target.config.vocab_size, (S, T), generator=generator),
        "attention_mask": torch.ones(S, T, dtype=torch.long),
        "loss_mask": (torch.arange(T) >= T // 8).long().expand(S, T),
    }
    batch = {key: value.to(target.device) for key, value in batch.items()}
    settings = LossSettings(gamma=default_gamma(args.block_size))
    optimizers = {size: torch.optim.AdamW(d.parameters(), lr=1e-4) for size, d in drafters.items()}
    seconds = defaultdict(list)
    for step in range(args.steps + 1):  # step 0 warms up
        for size in rotated(list(drafters), step):
            drafter = drafters[size].train()
            started = time.perf_counter()
            loss, _ = training_step_loss(drafter, target, batch, args.num_anchors, settings, carryover=False)
            loss.backward()
            optimizers[size].step()
            optimizers[size].zero_grad()
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            if step:
                seconds[size].append(time.perf_counter() - started)
    return {size: statistics.fmean(values) for size, values in seconds.items()}


ARGUMENT_CLASSES = (BenchArguments,)


def main(argv=None):
    (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_target(args.target, device=device)
    drafters = {size: drafter_for(target, size, args) for size in [*args.sizes, FULL]}
    draft = drafting_seconds_per_round(target, tokenizer, drafters, args)
    step = training_seconds_per_step(target, drafters, args)
    report = {
        "settings": asdict(args),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "vocab_size": target.config.vocab_size,
        "sizes": {
            str(size): {
                "draft_seconds_per_round": draft[size],
                "draft_cost_vs_full": draft[size] / draft[FULL],
                "train_seconds_per_step": step[size],
                "train_cost_vs_full": step[size] / step[FULL],
            }
            for size in drafters
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'draft vocab':<12}{'draft ms/round':>16}{'vs full':>9}{'train s/step':>14}{'vs full':>9}")
    for size, entry in report["sizes"].items():
        print(
            f"{size:<12}{entry['draft_seconds_per_round'] * 1e3:>16.2f}{entry['draft_cost_vs_full']:>9.2f}"
            f"{entry['train_seconds_per_step']:>14.3f}{entry['train_cost_vs_full']:>9.2f}"
        )
    print(f"-> {args.output}")
    return report


if __name__ == "__main__":
    main()
