"""dflash-gpu-cont3 with larger draft vocabularies, not retrained: its 8,192 tokens plus the next most frequent in all
the shipped responses (data, data-stub, data-gpu, data-cpu: 21,384 rows), up to 16,384, and the full vocabulary. The
drafter's head is the target's frozen LM head, so every token's row exists; only the token map changes.

What it does: writes OUT/cont3-v16384 (the shipped map first in line, then the next most frequent response tokens) and
OUT/cont3-vfull (no map: all 49,152 tokens), and prints the share of the target's HumanEval response tokens each map
covers (the shipped 8,192: 96.9%; 16,384: 99.0%). experiments/draft-vocab-size/probe.sh runs it first, then the slot
accuracies and the decode.

Run, from the repository root of a checkout installed with `pip install -e .`:

    python experiments/draft-vocab-size/make_variants.py [OUT]    # default runs/vocab

Machine and time: the project's 2-core CPU machine; a small part of probe.sh's 13 minutes to the slot accuracies
(not timed on its own).

Result: the committed run (experiments/draft-vocab-size/draft-vocab-size, whose records name the variants' first
paths, /tmp/vocab) used variants this script writes byte for byte. HumanEval first 40, T=0, 7 drafts: tau 2.34 /
2.37 / 2.39 for 8,192 / 16,384 / 49,152 tokens, speedup 1.46x / 1.44x / 1.40x.
"""

import glob
import json
import logging
import shutil
import sys
from pathlib import Path

from datasets import Dataset
from safetensors.torch import load_file, save_file

from trainer.build import draft_vocab_from_rows

SHIPPED = "hub/embedded/smollm2-135m-instruct"
SOURCE = f"{SHIPPED}/dflash-gpu-cont3"
HUMANEVAL = "experiments/data-cpu-continuations/slot-accuracy/humaneval-responses/shard-00000.parquet"


def write_variant(out: str, weights: dict, draft_token_ids) -> None:
    """The source folder with another token map (None: the full vocabulary, no map)."""
    shutil.copytree(SOURCE, out, dirs_exist_ok=True)
    config = json.loads(Path(f"{out}/config.json").read_text())
    config["draft_vocab_size"] = None if draft_token_ids is None else len(draft_token_ids)
    Path(f"{out}/config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v for k, v in weights.items() if k != "draft_token_ids"}
    if draft_token_ids is not None:
        weights["draft_token_ids"] = draft_token_ids
    save_file(weights, f"{out}/model.safetensors", metadata={"format": "pt"})


def coverage(rows: Dataset, token_ids) -> float:
    """The share of the rows' response tokens (under their loss masks) inside the map."""
    inside = set(token_ids.tolist())
    tokens = [t for ids, mask in zip(rows["input_ids"], rows["loss_mask"]) for t, m in zip(ids, mask) if m]
    return sum(t in inside for t in tokens) / len(tokens)


def main(out_dir: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the coverage of each map
    weights = load_file(f"{SOURCE}/model.safetensors")
    vocab_size = json.loads(Path(f"{SOURCE}/config.json").read_text())["vocab_size"]
    rows = Dataset.from_parquet(sorted(glob.glob(f"{SHIPPED}/data*/shard-*.parquet")), columns=["input_ids", "loss_mask"])
    shipped = weights["draft_token_ids"]
    humaneval = Dataset.from_parquet(HUMANEVAL, columns=["input_ids", "loss_mask"])
    print(f"shipped map: {coverage(humaneval, shipped):.2%} of the HumanEval response tokens")
    ids = draft_vocab_from_rows(rows, 16384, vocab_size, always=shipped.tolist())  # the shipped map first in line
    print(f"16384: {coverage(humaneval, ids):.2%} of the HumanEval response tokens")
    write_variant(f"{out_dir}/cont3-v16384", weights, ids)
    write_variant(f"{out_dir}/cont3-vfull", weights, None)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/vocab")
