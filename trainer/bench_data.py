"""Data-generation benchmark: tokens per second of response regeneration and of Magpie prompt synthesis with the
target, for each dtype x batch size x thread count, side by side in one run (each setting in its own process, on the
same prompts and seeds).

    python trainer/bench_data.py                                  # embedded SmolLM2, 32 HumanEval prompts
    python trainer/bench_data.py --dtypes float32 --batch_sizes 16 32 64 --thread_counts 1

A benchmark, not a test: the numbers are machine- and load-dependent; compare ratios measured in the same run.
"""

import itertools
import json
import multiprocessing
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from carryover_common.benchmarks import load_benchmark
from carryover_common.cli import parse_arguments
from carryover_common.targets import load_target
from trainer.data import regenerate, synthesize_prompts


@dataclass
class BenchArguments:
    target: str | None = field(default=None, metadata={"help": "Default: the embedded SmolLM2-135M-Instruct."})
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    batch_sizes: list[int] = field(default_factory=lambda: [8, 32])
    thread_counts: list[int] = field(default_factory=lambda: [1, 2])
    num_prompts: int = field(default=32, metadata={"help": "HumanEval prompts regenerated per setting."})
    max_new_tokens: int = field(default=64, metadata={"help": "Cap on each regenerated response."})
    magpie_samples: int = field(default=32, metadata={"help": "Magpie samples drawn per setting (0: skip)."})
    magpie_max_new_tokens: int = field(default=64)
    output: str = field(default="outputs/bench_data.json")


def measure_setting(args: BenchArguments, dtype: str, batch_size: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    target, tokenizer = load_target(args.target, dtype=getattr(torch, dtype))
    prompts = load_benchmark("embedded", subsets=["humaneval"], limit=args.num_prompts)["humaneval"]
    result = {"dtype": dtype, "batch_size": batch_size, "threads": threads}
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        rows = regenerate(target, tokenizer, prompts, folder, batch_size=batch_size, shard_size=len(prompts),
                          max_new_tokens=args.max_new_tokens, progress=False)
        seconds = time.perf_counter() - start
    response_tokens = sum(sum(mask) for mask in rows["loss_mask"])
    result["regenerate"] = {"seconds": seconds, "response_tokens": response_tokens, "tokens_per_second": response_tokens / seconds}
    if args.magpie_samples:
        start = time.perf_counter()
        try:
            made = synthesize_prompts(target, tokenizer, args.magpie_samples, batch_size=batch_size,
                                      max_new_tokens=args.magpie_max_new_tokens, max_samples=args.magpie_samples,
                                      progress=False)
        except ValueError:  # no sample closed its turn within the cap: the time still counts
            made = []
        seconds = time.perf_counter() - start
        sampled = args.magpie_samples * args.magpie_max_new_tokens  # every row runs to the cap or the batch's last stop
        result["magpie"] = {"seconds": seconds, "prompts": len(made), "samples": args.magpie_samples,
                            "samples_per_second": args.magpie_samples / seconds, "max_tokens_sampled": sampled}
    return result


ARGUMENT_CLASSES = (BenchArguments,)


def main(argv=None):
    (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
    settings = list(itertools.product(args.dtypes, args.batch_sizes, args.thread_counts))
    report = {"settings": asdict(args), "cpu_cores": os.cpu_count(), "results": []}
    context = multiprocessing.get_context("spawn")
    for dtype, batch_size, threads in settings:
        with context.Pool(1) as pool:  # a fresh process per setting: its own thread pool, no warm caches
            result = pool.apply(measure_setting, (args, dtype, batch_size, threads))
        report["results"].append(result)
        magpie = result.get("magpie", {})
        print(f"{dtype:<9} batch {batch_size:<3} threads {threads}: regenerate {result['regenerate']['tokens_per_second']:6.1f} "
              f"tok/s" + (f", magpie {magpie['samples_per_second']:.2f} samples/s" if magpie else ""), flush=True)
    slowest = min(r["regenerate"]["tokens_per_second"] for r in report["results"])
    for r in report["results"]:
        r["regenerate"]["vs_slowest"] = r["regenerate"]["tokens_per_second"] / slowest
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"-> {args.output}")
    return report


if __name__ == "__main__":
    main()
