"""Decoding benchmark: what carryover costs per round (the paper's t_reuse) and where `generate` spends its time.

    python evaluation/bench_decoding.py --drafter checkpoints/carryover --num_prompts 8 --max_new_tokens 128
    python evaluation/bench_decoding.py --drafter new --block_size 16     # a fresh random drafter: the worst case,
                                                                          # every round carries block_size-1 rows

On the same prompts, in one run, interleaved per prompt: plain greedy decoding, carryover ON and carryover OFF with
the same weights. Reports drafting time per round ON vs OFF (t_reuse = ON - OFF, also by number of carried rows),
and for each mode the share of wall time spent outside model computation: the target's forward, the drafter's
forward, and the target's LM head and embedding applied to the drafter's blocks (what is left is the Python and
bookkeeping overhead of the decoding loop). Writes a JSON file; prints a table. A benchmark, not a test: the
numbers are machine- and load-dependent; compare ratios measured in the same run.
"""

import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from carryover_common.benchmarks import encode_prompt, load_benchmark
from carryover_common.cli import parse_arguments
from carryover_common.targets import load_target
from evaluation.run import load_drafter
from modeling_carryover import CarryoverDrafterConfig, CarryoverDrafterModel, GenerationStats
from modeling_carryover import generate as carryover_generate
from modeling_carryover.generation_carryover import _synchronize


@dataclass
class BenchArguments:
    drafter: str = field(default="new", metadata={"help": "A drafter folder, or 'new' for a random drafter."})
    target: str | None = field(default=None, metadata={"help": "Default: the embedded SmolLM2-135M-Instruct."})
    num_draft_layers: int = field(default=2, metadata={"help": "For --drafter new."})
    block_size: int = field(default=16, metadata={"help": "For --drafter new."})
    benchmark: str = field(default="embedded")
    subset: str = field(default="humaneval")
    num_prompts: int = field(default=8)
    max_new_tokens: int = field(default=128)
    dtype: str = field(default="float32")
    output: str = field(default="outputs/bench_decoding.json")


class Timer:
    """Seconds counted by a subclass, read and reset with `take`."""

    seconds = 0.0

    def take(self) -> float:
        """The seconds counted since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class ForwardTimer(Timer):
    """Wall time spent inside a module's forward (hooks; CUDA-synchronised); with `outside`, only the calls made while
    that other timer's module is not running (the target's LM head called by the drafter, not by the target)."""

    def __init__(self, module, outside=None):
        self.seconds, self.calls, self.active, self.outside = 0.0, 0, False, outside
        device = next(module.parameters()).device
        self.handles = [
            module.register_forward_pre_hook(lambda *_: self._begin(device)),
            module.register_forward_hook(lambda *_: self._end(device)),
        ]

    def _begin(self, device):
        if self.outside is not None and self.outside.active:
            return
        _synchronize(device)
        self.active, self._start = True, time.perf_counter()

    def _end(self, device):
        if not self.active:
            return
        _synchronize(device)
        self.seconds += time.perf_counter() - self._start
        self.calls += 1
        self.active = False


class CallTimer(Timer):
    """Wall time spent in calls of the method `owner.name` (wrapped on the instance; CUDA-synchronised): the
    drafter's `draft_logits`, whose draft-vocabulary head multiplies the head's rows without calling the module."""

    def __init__(self, owner, name, device):
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            _synchronize(device)
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                _synchronize(device)
                self.seconds += time.perf_counter() - started

        setattr(owner, name, timed)


def benchmark_drafter(args, target, dtype):
    """A new random drafter, or a checkpoint, made in `dtype` as `load_drafter` makes it (RoPE buffers stay fp32)."""
    if args.drafter == "new":
        torch.manual_seed(0)
        config = CarryoverDrafterConfig.from_target_config(
            target.config, num_hidden_layers=args.num_draft_layers, block_size=args.block_size
        )
        return CarryoverDrafterModel._from_config(config, dtype=dtype).to(target.device).eval()
    return load_drafter(args.drafter, target, dtype)


ARGUMENT_CLASSES = (BenchArguments,)


@torch.no_grad()
def main(argv=None):
    (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_target(args.target, dtype=dtype, device=device)
    drafter = benchmark_drafter(args, target, dtype)
    prompts = load_benchmark(args.benchmark, subsets=[args.subset], limit=args.num_prompts)[args.subset]
    target_timer, drafter_timer = ForwardTimer(target), ForwardTimer(drafter)
    # the drafter's logits and block embeddings come from the target's LM head (or its draft-vocabulary rows) and
    # embedding, called directly
    head_timers = [CallTimer(drafter, "draft_logits", device), ForwardTimer(target.get_input_embeddings(), outside=target_timer)]

    modes = {"plain": None, "carryover_on": True, "carryover_off": False}
    totals = {mode: defaultdict(float) for mode in modes}
    rounds = {mode: [] for mode in modes}
    for index, prompt in enumerate(tqdm(prompts, desc="prompts")):
        inputs = encode_prompt(tokenizer, prompt).to(target.device)
        order = list(modes)[index % 3 :] + list(modes)[: index % 3]  # rotate: share the machine's drift
        for mode in order:
            for timer in (target_timer, drafter_timer, *head_timers):
                timer.take()
            _synchronize(target.device)
            started = time.perf_counter()
            if modes[mode] is None:
                out = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
            else:
                out = carryover_generate(
                    target, **inputs, assistant_model=drafter, carryover=modes[mode],
                    max_new_tokens=args.max_new_tokens, do_sample=False, linear_backend="default",  # as plain's
                )
                rounds[mode] += drafter.generation_stats.rounds
            _synchronize(target.device)
            totals[mode]["wall_seconds"] += time.perf_counter() - started
            totals[mode]["target_forward_seconds"] += target_timer.take()
            totals[mode]["drafter_forward_seconds"] += drafter_timer.take()
            totals[mode]["drafter_head_seconds"] += sum(timer.take() for timer in head_timers)
            totals[mode]["new_tokens"] += out.shape[1] - inputs["input_ids"].shape[1]

    report = {"settings": asdict(args), "device": str(target.device), "torch_threads": torch.get_num_threads(), "modes": {}}
    for mode, total in totals.items():
        inside = total["target_forward_seconds"] + total["drafter_forward_seconds"] + total["drafter_head_seconds"]
        entry = dict(total) | {
            "tokens_per_second": total["new_tokens"] / total["wall_seconds"],
            "share_outside_forwards": 1 - inside / total["wall_seconds"],
        }
        if rounds[mode]:
            entry |= {
                "rounds": len(rounds[mode]),
                "acceptance_length": GenerationStats(rounds[mode]).acceptance_length,
                "draft_seconds_per_round": statistics.fmean(r.draft_seconds for r in rounds[mode]),
                "verify_seconds_per_round": statistics.fmean(r.verify_seconds for r in rounds[mode]),
                "carried_rows_per_round": statistics.fmean(r.carried for r in rounds[mode]),
            }
        report["modes"][mode] = entry
    off_draft = report["modes"]["carryover_off"]["draft_seconds_per_round"]
    report["t_reuse_seconds"] = report["modes"]["carryover_on"]["draft_seconds_per_round"] - off_draft
    report["t_reuse_relative"] = report["t_reuse_seconds"] / off_draft
    by_carried = defaultdict(list)
    for r in rounds["carryover_on"]:
        by_carried[r.carried].append(r.draft_seconds)
    report["on_draft_seconds_by_carried_rows"] = {k: statistics.fmean(v) for k, v in sorted(by_carried.items())}

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'mode':<15}{'tok/s':>8}{'tau':>7}{'draft ms/round':>16}{'outside forwards':>18}")
    for mode, entry in report["modes"].items():
        draft = entry.get("draft_seconds_per_round")
        print(
            f"{mode:<15}{entry['tokens_per_second']:>8.1f}{entry.get('acceptance_length', float('nan')):>7.2f}"
            f"{(draft or float('nan')) * 1e3:>16.2f}{entry['share_outside_forwards']:>17.1%}"
        )
    print(f"t_reuse = {report['t_reuse_seconds'] * 1e3:.2f} ms per round ({report['t_reuse_relative']:+.1%} of OFF drafting)")
    print(f"-> {args.output}")
    return report


if __name__ == "__main__":
    main()
