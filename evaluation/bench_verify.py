"""Break-even benchmark: what a verification of k drafts costs the target against one plain decoding step, and so the
acceptance length a drafter needs before speculative decoding pays, per dtype and thread count.

    python evaluation/bench_verify.py                                   # embedded SmolLM2, float32 and bfloat16
    python evaluation/bench_verify.py --drafter hub/embedded/smollm2-135m-instruct/dflash-baseline --thread_counts 1 2

For each dtype x thread count, side by side in one run: the target's forward of n = 1 .. max_tokens new tokens after
a `cache_length`-token KV cache (median of `repeats`; n = 1 is a plain decoding step, n = k + 1 verifies k drafts:
the round's bonus token and its drafts), and with `--drafter`, the drafter's time per round of k drafts, measured
inside real carryover decoding of a few benchmark prompts (HumanEval) with `num_assistant_tokens=k` (`DraftRound.draft_seconds`:
the drafter's forward, its LM head over the k drafted slots and sampling). A round of k drafts breaks even at

    tau* = (t_draft + t_target(k + 1)) / t_target(1)

accepted tokens per round (tau counts the bonus token). Writes a JSON file; prints a table. A benchmark, not a
test: the numbers are machine- and load-dependent; compare ratios measured in the same run.
"""

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from carryover_common.benchmarks import encode_prompt, load_benchmark
from carryover_common.cli import parse_arguments
from carryover_common.targets import load_target, use_linear_backend
from evaluation.run import load_drafter
from modeling_carryover import generate as carryover_generate
from modeling_carryover.generation_carryover import _synchronize


@dataclass
class BenchArguments:
    target: str | None = field(default=None, metadata={"help": "Default: the embedded SmolLM2-135M-Instruct."})
    drafter: str | None = field(default=None, metadata={"help": "A drafter folder: adds its drafting time per round."})
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    linear_backends: list[str] = field(
        default_factory=lambda: ["default"],
        metadata={"help": "Float32 linear layers: 'default' and/or 'onednn' (evaluation/run.py --linear_backend); "
                  "other dtypes run 'default' only."},
    )
    thread_counts: list[int] = field(default_factory=lambda: [2])
    cache_length: int = field(default=300, metadata={"help": "Tokens in the KV cache before the timed forward."})
    max_tokens: int = field(default=8, metadata={"help": "Time forwards of 1 .. max_tokens new tokens."})
    draft_counts: list[int] = field(default_factory=lambda: [1, 2, 3, 7], metadata={"help": "k of the break-even table."})
    repeats: int = field(default=16, metadata={"help": "Timed forwards per size (the median is reported)."})
    benchmark: str = field(default="embedded", metadata={"help": "Prompts decoded to time the drafter."})
    subset: str = field(default="humaneval")
    num_prompts: int = field(default=4, metadata={"help": "Prompts decoded to time the drafter."})
    max_new_tokens: int = field(default=64)
    output: str = field(default="outputs/bench_verify.json")


def forward_milliseconds(target, cache_length: int, num_tokens: int, repeats: int) -> float:
    """Median wall time (ms) of the target's forward of `num_tokens` new tokens after a `cache_length`-token cache."""
    generator, vocab_size = torch.Generator().manual_seed(0), target.config.vocab_size
    context = torch.randint(vocab_size, (1, cache_length), generator=generator).to(target.device)
    times = []
    for _ in range(repeats):
        cache = DynamicCache(config=target.config)
        target(context, past_key_values=cache, use_cache=True)
        new = torch.randint(vocab_size, (1, num_tokens), generator=generator).to(target.device)
        _synchronize(target.device)
        started = time.perf_counter()
        target(new, past_key_values=cache, use_cache=True)
        _synchronize(target.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def drafting_milliseconds(args, target, tokenizer, drafter, num_drafts: int) -> float:
    """Mean drafting time per round of `num_drafts` drafts (ms) in real decoding of the benchmark's first prompts."""
    seconds = []
    for prompt in load_benchmark(args.benchmark, subsets=[args.subset], limit=args.num_prompts)[args.subset]:
        inputs = encode_prompt(tokenizer, prompt).to(target.device)
        carryover_generate(
            target, **inputs, assistant_model=drafter, num_assistant_tokens=num_drafts,
            max_new_tokens=args.max_new_tokens, do_sample=False, linear_backend="default",  # the backend under test
        )
        seconds += [r.draft_seconds for r in drafter.generation_stats.rounds if r.proposed == num_drafts]
    return statistics.fmean(seconds) * 1e3


@torch.no_grad()
def measure(args, dtype_name: str, backend: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_target(args.target, dtype=dtype, device=device)
    use_linear_backend(target, backend)
    target_ms = {n: forward_milliseconds(target, args.cache_length, n, args.repeats) for n in range(1, args.max_tokens + 1)}
    entry = {"dtype": dtype_name, "linear_backend": backend, "threads": threads, "target_forward_ms": target_ms}
    if args.drafter:
        drafter = use_linear_backend(load_drafter(args.drafter, target, dtype), backend)
        drafts = [k for k in args.draft_counts if k < drafter.config.block_size and k < args.max_tokens]
        draft_ms = {k: drafting_milliseconds(args, target, tokenizer, drafter, k) for k in drafts}
        entry |= {
            "draft_ms_per_round": draft_ms,
            "break_even_tau": {k: (draft_ms[k] + target_ms[k + 1]) / target_ms[1] for k in drafts},
        }
    return entry


ARGUMENT_CLASSES = (BenchArguments,)


def main(argv=None):
    (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
    report = {"settings": asdict(args), "results": []}
    for dtype_name in args.dtypes:
        for backend in args.linear_backends if dtype_name == "float32" else ["default"]:
            for threads in args.thread_counts:
                report["results"].append(measure(args, dtype_name, backend, threads))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)

    sizes = range(1, args.max_tokens + 1)
    header = f"{'dtype':<10}{'linears':>8}{'threads':>8}"
    settings = [f"{e['dtype']:<10}{e['linear_backend']:>8}{e['threads']:>8}" for e in report["results"]]
    print(f"target forward after a {args.cache_length}-token cache, in plain steps (n new tokens; n = k + 1 verifies k drafts)")
    print(f"{header}{'step ms':>9}" + "".join(f"{f'n={n}':>7}" for n in sizes))
    for setting, entry in zip(settings, report["results"]):
        ms = entry["target_forward_ms"]
        print(f"{setting}{ms[1]:>9.1f}" + "".join(f"{ms[n] / ms[1]:>7.2f}" for n in sizes))
    if args.drafter:
        print(f"\nbreak-even tau of {args.drafter}: (drafting + verifying k drafts) / plain step; (ms): drafting")
        drafts = list(report["results"][0]["break_even_tau"])
        print(header + "".join(f"{f'k={k}':>8}{'(ms)':>8}" for k in drafts))
        for setting, entry in zip(settings, report["results"]):
            tau, ms = entry["break_even_tau"], entry["draft_ms_per_round"]
            print(setting + "".join(f"{tau[k]:>8.2f}{ms[k]:>8.1f}" for k in drafts))
    print(f"-> {args.output}")
    return report


if __name__ == "__main__":
    main()
