"""What a user gets without the fine print: the quickstart's calls on the embedded target with the strongest shipped
drafter, plain `target.generate` as a user runs it (torch's GEMM) against the speculative call with its linear layers
left alone (`linear_backend="default"`) and with `"auto"` (oneDNN for the call), plus plain decoding in oneDNN.

    python experiments/speculative-linear-default/measure.py --limit 5 --threads 2 \
        --output experiments/speculative-linear-default/threads2.json

For each prompt the four methods run back to back in an order that rotates with the prompt; T=0, 128 new tokens,
float32. Reports total tokens over total seconds per subset and method, speedups against the user's plain call, and
T=0 mismatches against it (the two GEMMs round differently, so a near-tie could flip: counted, not hidden).
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel

from carryover_common.benchmarks import encode_prompt, load_benchmark
from carryover_common.cli import parse_arguments
from carryover_common.targets import load_target
from modeling_carryover import generate as carryover_generate
from modeling_carryover.generation_carryover import linear_backend_of

METHODS = ("plain", "plain-onednn", "speculative-default", "speculative-auto")


@dataclass
class Arguments:
    drafter: str = field(default="hub/embedded/smollm2-135m-instruct/dflash-gpu-cont3")
    benchmarks: list[str] = field(default_factory=lambda: ["embedded", "evaluation/benchmarks/smollm2-heldout"])
    limit: int = field(default=5, metadata={"help": "Prompts per subset (the first N)."})
    max_new_tokens: int = field(default=128)
    output: str = field(default="experiments/speculative-linear-default/result.json")


def decode(method, target, drafter, inputs, max_new_tokens):
    kwargs = {**inputs, "max_new_tokens": max_new_tokens, "do_sample": False}
    started = time.perf_counter()
    if method == "plain":
        output = target.generate(**kwargs)
    elif method == "plain-onednn":
        with linear_backend_of("onednn", target):
            output = target.generate(**kwargs)
    else:
        output = carryover_generate(target, assistant_model=drafter, linear_backend=method.split("-")[1], **kwargs)
    return output[0, inputs["input_ids"].shape[1] :].tolist(), time.perf_counter() - started


def main(argv=None):
    (args,) = parse_arguments((Arguments,), argv)
    target, tokenizer = load_target(None)
    drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True)
    prompts = [(subset, prompt) for benchmark in args.benchmarks
               for subset, items in load_benchmark(benchmark, limit=args.limit).items() for prompt in items]
    subsets = list(dict.fromkeys(subset for subset, _ in prompts))
    warm = encode_prompt(tokenizer, "Hello")
    for method in METHODS:
        decode(method, target, drafter, warm, 16)
    totals = {subset: {m: [0, 0.0] for m in METHODS} for subset in subsets}
    mismatches = {m: 0 for m in METHODS}
    for index, (subset, prompt) in enumerate(tqdm(prompts, desc="prompts")):
        inputs = encode_prompt(tokenizer, prompt)
        outputs = {}
        for method in METHODS[index % 4:] + METHODS[: index % 4]:
            tokens, seconds = decode(method, target, drafter, inputs, args.max_new_tokens)
            outputs[method] = tokens
            totals[subset][method][0] += len(tokens)
            totals[subset][method][1] += seconds
        for method in METHODS:
            mismatches[method] += outputs[method] != outputs["plain"]
    rows = []
    for subset in [*subsets, "all"]:
        parts = list(totals.values()) if subset == "all" else [totals[subset]]
        speed = {m: sum(p[m][0] for p in parts) / sum(p[m][1] for p in parts) for m in METHODS}
        rows.append({"subset": subset, "tokens_per_second": speed,
                     "speedup_vs_user_plain": {m: speed[m] / speed["plain"] for m in METHODS}})
    report = {"rows": rows, "mismatches_vs_user_plain": mismatches, "prompts": len(prompts),
              "torch_threads": torch.get_num_threads(), "arguments": vars(args)}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))
    print("| subset | " + " | ".join(METHODS) + " |\n|---|" + "---|" * len(METHODS))
    for row in rows:
        print(f"| {row['subset']} | " + " | ".join(
            f"{row['tokens_per_second'][m]:.1f} ({row['speedup_vs_user_plain'][m]:.2f}x)" for m in METHODS) + " |")
    print("mismatches against the user's plain call:", mismatches)


if __name__ == "__main__":
    main()
