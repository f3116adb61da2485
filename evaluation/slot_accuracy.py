"""Teacher-forced slot accuracy: how well drafters predict each slot of a block on sets of responses, e.g. rows they
trained on against rows of the same kind they never saw (memorised or learned?) or against a benchmark's responses
(a distribution they were not trained for?).

    python evaluation/slot_accuracy.py --drafters cont3=<folder> cont6=<folder> --rows 128 \
        --sets seen=data/smollm2-data-gpu/shard-00000.parquet fresh=data/smollm2-data-cpu/shard-00005.parquet

A set is anything `--dataset` takes (a regenerated folder, one of its shard files, input_ids/loss_mask rows); `--rows`
of it are drawn at random (seeded). Every drafter sees the same rows, the same target features and the same random
anchors, as in a training step: slot k predicts the token k after the anchor from the anchor token and the target's
features of everything before it (a Markov head corrects each slot with the previous true token). Per set and
drafter: accuracy and cross-entropy per slot (a label outside a draft vocabulary counts as wrong, with no CE), and
`tau_if_independent` = 1 + sum_k prod_{j<=k} accuracy_j, the acceptance length if slot errors were independent (a
guide to compare sets, not a decoding measurement). -> slot_accuracy.json, slot_accuracy.png in --output_dir.
"""

import json
import sys
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from carryover_common.checkpoints import check_drafter_folder, check_model_folder
from carryover_common.cli import check_at_least, check_exists, parse_arguments
from carryover_common.outputs import check_output_dir, staged_folder
from carryover_common.targets import load_target
from evaluation.plots import plot_slot_accuracy
from evaluation.run import provenance
from modeling_carryover import CarryoverDrafterModel
from modeling_carryover.modeling_carryover import hidden_state_request
from trainer.build import load_training_rows, prepare_rows
from trainer.carryover_trainer import pad_collator
from trainer.objectives import (
    batch_with_features,
    blocks_at,
    drafter_hidden,
    sample_anchors,
    slot_terms,
    training_layer_ids,
)
from trainer.verification import target_pass


@dataclass
class SlotAccuracyArguments:
    drafters: list[str] = field(metadata={"help": "NAME=FOLDER drafter checkpoints (all for one target)."})
    sets: list[str] = field(metadata={"help": "NAME=PATH response sets: anything --dataset takes, or one shard file."})
    target: str | None = field(default=None, metadata={"help": "Target folder or Hub id; default: embedded SmolLM2."})
    rows: int = field(default=128, metadata={"help": "Rows drawn from each set (all of a smaller set)."})
    num_anchors: int = field(default=64, metadata={"help": "Random anchors per row (the training recipe's)."})
    batch_size: int = field(default=8)
    max_seq_length: int = field(default=512)
    seed: int = field(default=0, metadata={"help": "Seeds the rows drawn and the anchors."})
    output_dir: str = field(default="outputs/slot_accuracy")
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Replace an earlier slot_accuracy.json/.png."})

    def __post_init__(self):
        drafters, sets = named(self.drafters, "drafters"), named(self.sets, "sets")
        for path in drafters.values():
            check_exists("drafters", path, hub=True)
            check_drafter_folder(path)
        check_exists("sets", list(sets.values()), hub=True)
        check_exists("target", self.target, hub=True)
        check_model_folder(self.target)
        for name in ("rows", "num_anchors", "batch_size"):
            check_at_least(name, getattr(self, name), 1)
        check_at_least("max_seq_length", self.max_seq_length, 2)
        check_output_dir(self.output_dir, inputs=[*drafters.values(), *sets.values(), self.target],
                         files={"slot_accuracy.json", "slot_accuracy.png"}, overwrite=self.overwrite_output_dir)


def named(specs: list[str], what: str) -> dict[str, str]:
    pairs = [spec.partition("=") for spec in specs]
    if any(not sep or not name or not path for name, sep, path in pairs):
        raise ValueError(f"--{what} takes NAME=PATH entries, got {specs}.")
    return {name: path for name, _, path in pairs}


def draw_rows(path: str, rows: int, seed: int, max_seq_length: int):
    dataset = prepare_rows(load_training_rows(path), max_seq_length)
    return dataset.shuffle(seed=seed).select(range(min(rows, len(dataset))))


@torch.no_grad()
def set_accuracy(target, drafters: dict, rows, args) -> dict:
    """{drafter: per-slot sums of correct, cross-entropy and counted labels} over `rows`."""
    layer_ids = sorted(set().union(*(training_layer_ids(d.config) for d in drafters.values())))
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    num_slots = {name: d.config.block_size - 1 for name, d in drafters.items()}
    sums = {name: torch.zeros(3, c) for name, c in num_slots.items()}  # correct, ce, labels
    for start in tqdm(range(0, len(rows), args.batch_size), desc="batches", leave=False):
        inputs = pad_collator([rows[i] for i in range(start, min(start + args.batch_size, len(rows)))])
        hidden_states = target_pass(
            target, inputs["input_ids"], inputs["attention_mask"], hidden_state_request(layer_ids)
        ).hidden_states
        for name, drafter in drafters.items():
            batch = batch_with_features(drafter, inputs, hidden_states)
            torch.manual_seed(args.seed + start)  # the same anchors for every drafter
            anchor_positions, anchor_valid = sample_anchors(batch.loss_mask, args.num_anchors)
            hidden = drafter_hidden(drafter, embed_tokens, batch, anchor_positions)
            labels, label_valid, prev_token_ids, _ = blocks_at(batch, anchor_positions, anchor_valid, num_slots[name])
            ce, correct = slot_terms(drafter, lm_head, hidden, labels, prev_token_ids)
            valid = label_valid.float()
            sums[name] += torch.stack([(term * valid).sum((0, 1)) for term in (correct, ce, valid)])
    return sums


def summary(sums: torch.Tensor) -> dict:
    correct, ce, labels = sums
    accuracy = (correct / labels.clamp(min=1)).tolist()
    tau, survive = 1.0, 1.0
    for value in accuracy:
        survive *= value
        tau += survive
    return {
        "slot_accuracy": [round(a, 4) for a in accuracy],
        "slot_ce": [round(c, 4) for c in (ce / labels.clamp(min=1)).tolist()],
        "labels": [int(n) for n in labels.tolist()],
        "tau_if_independent": round(tau, 4),
    }


ARGUMENT_CLASSES = (SlotAccuracyArguments,)


def main(argv=None) -> dict:
    try:
        (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
        drafter_paths, set_paths = named(args.drafters, "drafters"), named(args.sets, "sets")
        target, _ = load_target(args.target, tokenizer=False)
        drafters = {}
        for name, path in drafter_paths.items():
            drafters[name] = CarryoverDrafterModel.from_pretrained(path, dtype=target.dtype).eval()
            drafters[name].check_target(target.config)
        results = {}
        for set_name, path in set_paths.items():
            rows = draw_rows(path, args.rows, args.seed, args.max_seq_length)
            sums = set_accuracy(target, drafters, rows, args)
            results[set_name] = {"path": path, "rows": len(rows)} | {name: summary(s) for name, s in sums.items()}
    except (ValueError, OSError) as error:
        sys.exit(f"slot_accuracy: {error}")
    report = {"sets": results, "provenance": provenance(asdict(args), target.device)}
    with staged_folder(args.output_dir) as output_dir:  # moved into output_dir once both files are written
        (output_dir / "slot_accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_slot_accuracy(results, list(drafters), output_dir / "slot_accuracy.png")
    for set_name, result in results.items():
        for name in drafters:
            accuracy = " ".join(f"{a:.3f}" for a in result[name]["slot_accuracy"])
            print(f"{set_name:>12} {name:>12}: slots {accuracy}  tau_if_independent {result[name]['tau_if_independent']:.3f}")
    return report


if __name__ == "__main__":
    main()
