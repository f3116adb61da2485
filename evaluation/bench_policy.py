"""Speculation policies side by side: plain greedy decoding, transformers' prompt lookup (no training), and a drafter
with the fixed policy (every draft of every block verified), the old confidence threshold and the adaptive policy.

    python evaluation/bench_policy.py --drafter hub/embedded/smollm2-135m-instruct/dflash-gpu-cont3 \
        --benchmarks embedded evaluation/benchmarks/smollm2-heldout --limit 10 --temperatures 0 1 \
        --output experiments/speculation-policy/policy.json

For each prompt every method decodes back to back, in an order that rotates with the prompt (so they share the
machine's noise), seeded alike at T>0; at T=0 each output is compared with plain greedy decoding's (mismatches must be
0). Per subset and temperature: speedup against plain (total tokens over total seconds, as a user waits), the mean
and 5th percentile of the per-prompt speedups, tau where a method has rounds, and for the adaptive policy its rounds by
kind and predicted against observed acceptance (a calibration plot). Every prompt's record is appended to
`<output>.records.jsonl` as it finishes: run the same command again to resume. A benchmark, not a test: compare
ratios from one run only.
"""

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from carryover_common.benchmarks import encode_prompt, load_benchmark
from carryover_common.cli import parse_arguments
from carryover_common.targets import LINEAR_BACKENDS, load_target, use_linear_backend
from evaluation.run import load_drafter
from modeling_carryover import generate as carryover_generate

METHODS = ("plain", "prompt-lookup", "fixed", "threshold", "adaptive")


@dataclass
class PolicyBenchArguments:
    drafter: str = field(metadata={"help": "The drafter folder (or Hub id) the speculative methods use."})
    target: str | None = field(default=None, metadata={"help": "Default: the embedded SmolLM2-135M-Instruct."})
    benchmarks: list[str] = field(
        default_factory=lambda: ["embedded"], metadata={"help": "Benchmarks ('embedded', folders of <subset>.jsonl)."}
    )
    limit: int = field(default=10, metadata={"help": "Prompts per subset (the first N)."})
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = field(default=128)
    methods: list[str] = field(default_factory=lambda: list(METHODS), metadata={"choices": list(METHODS)})
    prompt_lookup_num_tokens: int = field(default=10, metadata={"help": "transformers' prompt lookup candidates."})
    draft_confidence_threshold: float = field(default=0.1, metadata={"help": "The 'threshold' method's threshold."})
    linear_backend: str = field(
        default="onednn", metadata={"help": "Linear layers of target and drafter, every method alike.",
                                    "choices": list(LINEAR_BACKENDS)}
    )
    seed: int = field(default=0)
    output: str = field(default="outputs/bench_policy.json")

    def __post_init__(self):
        if self.limit < 1 or self.max_new_tokens < 1 or any(t < 0 for t in self.temperatures):
            raise ValueError("--limit and --max_new_tokens must be at least 1, --temperatures at least 0.")
        if "plain" not in self.methods:
            raise ValueError("--methods must include plain: every speedup is measured against it.")


ARGUMENT_CLASSES = (PolicyBenchArguments,)


@torch.no_grad()
def decode(method, target, drafter, inputs, temperature, seed, args) -> tuple[list[int], float, list]:
    """One timed generation -> (new token ids, seconds, the drafter's rounds)."""
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
    kwargs = {**inputs, "max_new_tokens": args.max_new_tokens, "do_sample": temperature > 0, **sampling}
    started = time.perf_counter()
    if method == "plain":
        output = target.generate(**kwargs)
    elif method == "prompt-lookup":
        output = target.generate(**kwargs, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens)
    else:
        policy = {"fixed": {"speculation_policy": "fixed"}, "adaptive": {"speculation_policy": "adaptive"},
                  "threshold": {"speculation_policy": "fixed", "draft_confidence_threshold": args.draft_confidence_threshold}}
        # linear_backend "default": the modules as main() set them, the same for every method
        output = carryover_generate(target, assistant_model=drafter, **policy[method], linear_backend="default", **kwargs)
    seconds = time.perf_counter() - started
    rounds = [asdict(r) for r in drafter.generation_stats.rounds] if method in ("fixed", "threshold", "adaptive") else []
    return output[0, inputs["input_ids"].shape[1] :].tolist(), seconds, rounds


def records_done(path: Path) -> dict:
    """{(subset, temperature, index): record} of an earlier run of the same command (a cut-off last line is dropped)."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            done[record["subset"], record["temperature"], record["index"]] = record
    return done


def summarize(records: list[dict], methods: list[str]) -> list[dict]:
    """One row per subset ("all": every subset), temperature and method."""
    rows = []
    groups = {}
    for record in records:
        for subset in (record["subset"], "all"):
            groups.setdefault((subset, record["temperature"]), []).append(record)
    for (subset, temperature), group in sorted(groups.items(), key=lambda item: (item[0][1], item[0][0] == "all", item[0][0])):
        plain_speed = sum(r["methods"]["plain"]["tokens"] for r in group) / sum(r["methods"]["plain"]["seconds"] for r in group)
        for method in methods:
            results = [r["methods"][method] for r in group]
            speed = sum(r["tokens"] for r in results) / sum(r["seconds"] for r in results)
            per_prompt = sorted((r["tokens"] / r["seconds"]) / (p["methods"]["plain"]["tokens"] / p["methods"]["plain"]["seconds"])
                                for r, p in zip(results, group))
            rounds = [round_ for r in results for round_ in r["rounds"]]
            kinds = {}
            for round_ in rounds:
                kinds[round_["kind"]] = kinds.get(round_["kind"], 0) + 1
            rows.append({
                "subset": subset, "temperature": temperature, "method": method, "prompts": len(group),
                "tokens_per_second": speed, "speedup": speed / plain_speed,
                "mean_prompt_speedup": statistics.mean(per_prompt),
                "p5_prompt_speedup": per_prompt[max(0, round(0.05 * (len(per_prompt) - 1)))],
                "tau": (sum(r["accepted"] + 1 for r in rounds) / len(rounds)) if rounds else None,
                "rounds_by_kind": kinds,
                "mismatches": sum(r.get("mismatch", False) for r in results) if temperature == 0 else None,
                "draft_seconds": sum(r["draft_seconds"] for r in rounds), "verify_seconds": sum(r["verify_seconds"] for r in rounds),
                "policy_seconds": sum(r.get("policy_seconds", 0.0) for r in rounds),
            })
    return rows


def calibration(records: list[dict]) -> list[dict]:
    """The adaptive policy's predicted accepted drafts against the observed ones, in bins of the prediction."""
    pairs = [(r["predicted_accepted"], r["accepted"]) for record in records for r in record["methods"].get("adaptive", {}).get("rounds", [])
             if r["kind"] == "draft" and r["predicted_accepted"] is not None]
    bins = []
    for low in [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]:
        high = {0.0: 0.5, 0.5: 1.0, 1.0: 1.5, 1.5: 2.0, 2.0: 3.0, 3.0: 4.0, 4.0: 99.0}[low]
        inside = [(p, o) for p, o in pairs if low <= p < high]
        if inside:
            bins.append({"predicted": statistics.mean(p for p, _ in inside), "observed": statistics.mean(o for _, o in inside),
                         "rounds": len(inside)})
    return bins


def plot_calibration(bins: list[dict], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(4.5, 4))
    top = max([b["predicted"] for b in bins] + [b["observed"] for b in bins] + [1.0])
    axes.plot([0, top], [0, top], color="grey", linestyle="--", linewidth=1)
    axes.scatter([b["predicted"] for b in bins], [b["observed"] for b in bins], s=[10 + b["rounds"] / 5 for b in bins])
    axes.set_xlabel("predicted accepted drafts a round")
    axes.set_ylabel("observed accepted drafts a round")
    axes.set_title("Adaptive policy: calibration")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown(rows: list[dict]) -> str:
    lines = ["| T | Subset | Method | Speedup | Mean / p5 per prompt | τ | Rounds by kind | Mismatches |", "|" + "---|" * 8]
    for row in rows:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(row["rounds_by_kind"].items()))
        tau = "" if row["tau"] is None else f"{row['tau']:.2f}"
        mismatches = "" if row["mismatches"] is None else f"{row['mismatches']}/{row['prompts']}"
        cells = [f"{row['temperature']:g}", row["subset"], row["method"], f"{row['speedup']:.2f}×",
                 f"{row['mean_prompt_speedup']:.2f} / {row['p5_prompt_speedup']:.2f}", tau, kinds, mismatches]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
    output = Path(args.output)
    records_path = output.with_suffix(".records.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)
    target, tokenizer = load_target(args.target, dtype=torch.float32)
    drafter = load_drafter(args.drafter, target, torch.float32)
    use_linear_backend(target, args.linear_backend)
    use_linear_backend(drafter, args.linear_backend)
    done = records_done(records_path)
    settings = {k: v for k, v in asdict(args).items() if k != "output"}
    records = [r for r in done.values() if r["settings"] == settings]
    done = {key: r for key, r in done.items() if r["settings"] == settings}
    warm = encode_prompt(tokenizer, "Write a Python function that adds two numbers.")
    for method in args.methods:  # one unrecorded generation each: first-call costs out of the timings
        decode(method, target, drafter, warm, 0.0, args.seed, args)
    for benchmark in args.benchmarks:
        for subset, prompts in load_benchmark(benchmark, None, args.limit).items():
            for temperature in args.temperatures:
                for index, prompt in enumerate(tqdm(prompts, desc=f"{subset} T={temperature:g}")):
                    if (subset, temperature, index) in done:
                        continue
                    inputs = encode_prompt(tokenizer, prompt)
                    methods, results, outputs = list(args.methods), {}, {}
                    for method in methods[index % len(methods) :] + methods[: index % len(methods)]:
                        tokens, seconds, rounds = decode(method, target, drafter, inputs, temperature, args.seed + index, args)
                        outputs[method] = tokens
                        results[method] = {"tokens": len(tokens), "seconds": seconds, "rounds": rounds}
                    if temperature == 0:
                        for method in methods:
                            results[method]["mismatch"] = outputs[method] != outputs["plain"]
                    record = {"subset": subset, "temperature": temperature, "index": index, "settings": settings,
                              "threads": torch.get_num_threads(), "methods": results}
                    with records_path.open("a") as file:
                        file.write(json.dumps(record) + "\n")
                    records.append(record)
    rows = summarize(records, args.methods)
    bins = calibration(records)
    report = {"results": rows, "calibration": bins, "settings": settings, "threads": torch.get_num_threads(),
              "plain_tokens_per_second": {f"{r['subset']} T={r['temperature']:g}": r["tokens_per_second"]
                                          for r in rows if r["method"] == "plain"}}
    output.write_text(json.dumps(report, indent=2))
    output.with_suffix(".md").write_text(markdown(rows))
    if bins:
        plot_calibration(bins, output.with_suffix(".calibration.png"))
    print(output.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
