"""Tau gains between drafters that `evaluation/run.py` decoded in different runs on the same prompts.

    python -m evaluation.compare --runs runs/eval-a runs/eval-b --gains gated=shifted carryover=shifted

Each run's `records.jsonl.gz` holds every prompt's rounds; a gain pairs the two drafters prompt by prompt (the same
subset, temperature, index and prompt hash) and gets `run.py`'s paired bootstrap interval. Pairing across runs is only
sound where the runs decoded alike: they must share the target and `max_new_tokens`, and a named drafter recorded in
more than one run (the usual control) must have the same weights and the same rounds in each, at every prompt both
hold (T=0 decoding is deterministic), or the comparison is refused; drafters no gain names are not read.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

from carryover_common.cli import parse_arguments
from evaluation.run import RunRecords, read_records, tau_gain_ci


@dataclass
class CompareArguments:
    runs: list[str] = field(metadata={"help": "evaluation/run.py output folders (each with its records.jsonl.gz)."})
    gains: list[str] = field(metadata={"help": "NAME=REFERENCE pairs of drafters recorded in the runs."})

    def __post_init__(self):
        for run in self.runs:
            if not (Path(run) / RunRecords.FILE).is_file():
                raise ValueError(f"--runs {run} has no {RunRecords.FILE}: give folders that evaluation/run.py wrote.")


# Settings that define what a prompt's tau measures: runs that differ in them are not paired.
PAIRED_SETTINGS = ("target", "max_new_tokens")


def prompt_rounds(runs: list[str], names: set[str]) -> dict:
    """{drafter: {(subset, temperature, index, prompt hash): accepted list}} for the named drafters over all runs; the
    runs must share the target and `max_new_tokens`, and a named drafter recorded in several runs must have the same
    weights and agree wherever they share a prompt. Other drafters are not read, so two runs may each hold a
    different drafter under one name (e.g. `adapter`) that no gain names."""
    recorded, first_identity, weights = {}, None, {}
    for run in runs:
        path = Path(run) / RunRecords.FILE
        identity, *records = read_records(path)  # the first line is the run's identity
        first_identity = first_identity or (path, identity)
        differs = [key for key in PAIRED_SETTINGS if identity.get(key) != first_identity[1].get(key)]
        if differs:
            raise ValueError(
                f"{path} and {first_identity[0]} were decoded with different {', '.join(differs)}: their prompts' tau "
                "measure different things and cannot be paired."
            )
        for name, recorded_weights in identity.get("drafters", {}).items():
            if name in names and weights.setdefault(name, (path, recorded_weights))[1] != recorded_weights:
                raise ValueError(
                    f"{name} in {path} is another drafter than {name} in {weights[name][0]} (weights fingerprint or "
                    "carryover setting): give them different names."
                )
        for record in records:
            key = (record["subset"], record["temperature"], record["index"], record["prompt"])
            for name, result in record["methods"].items():
                accepted = result.get("rounds", {}).get("accepted")
                if name not in names or accepted is None:  # plain decoding has no rounds
                    continue
                earlier = recorded.setdefault(name, {}).setdefault(key, accepted)
                if earlier != accepted:
                    raise ValueError(
                        f"{name} decoded prompt {key[2]} of {key[0]!r} (T={key[1]}) differently in {path} than in an "
                        "earlier run: the runs did not decode alike, so their drafters cannot be paired."
                    )
    return recorded


def gain(recorded: dict, name: str, reference: str) -> dict:
    """tau of both drafters over the prompts both have, the gain and its 95% interval."""
    missing = [n for n in (name, reference) if n not in recorded]
    if missing:
        raise ValueError(f"{missing} not in the runs' records (drafters: {sorted(recorded)}).")
    shared = sorted(recorded[name].keys() & recorded[reference].keys())
    if len(shared) < 2:
        raise ValueError(f"{name} and {reference} share {len(shared)} prompts: no paired comparison.")
    counts = {n: [(sum(a + 1 for a in recorded[n][k]), len(recorded[n][k])) for k in shared] for n in (name, reference)}
    tau = {n: sum(t for t, _ in c) / sum(r for _, r in c) for n, c in counts.items()}
    return {
        "drafter": name, "reference": reference, "prompts": len(shared), "tau": tau[name], "reference_tau": tau[reference],
        "tau_gain": tau[name] / tau[reference] - 1, "tau_gain_ci95": tau_gain_ci(counts[name], counts[reference]),
    }


ARGUMENT_CLASSES = (CompareArguments,)


def main(argv: list[str] | None = None) -> list[dict]:
    try:
        (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
        pairs = [pair.partition("=") for pair in args.gains]
        if any(not sep for _, sep, _ in pairs):
            raise ValueError(f"--gains takes NAME=REFERENCE pairs, got {args.gains}.")
        recorded = prompt_rounds(args.runs, {name for name, _, _ in pairs} | {reference for _, _, reference in pairs})
        results = [gain(recorded, name, reference) for name, _, reference in pairs]
    except (ValueError, OSError) as error:
        sys.exit(f"compare: {error}")
    for r in results:
        low, high = r["tau_gain_ci95"]
        print(f"{r['drafter']} vs {r['reference']} ({r['prompts']} prompts): tau {r['tau']:.3f} vs {r['reference_tau']:.3f}, "
              f"gain {r['tau_gain']:+.1%} [{low:+.1%}, {high:+.1%}]")
    return results


if __name__ == "__main__":
    main()
