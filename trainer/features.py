"""Offline target features: the frozen target runs once over the training rows, and its feature layers are stored.

    python -m trainer.features --dataset data/smollm2 --output_dir data/smollm2-features --num_draft_layers 2
    python trainer/run.py --dataset data/smollm2 --features data/smollm2-features ...   # no target forward (baseline)

Row i of the dataset (as `load_training_rows` reads it) has its stored layers at index i: shard k holds rows
[k * shard_size, (k + 1) * shard_size) as one safetensors file (`hidden_states` [tokens, L, d], the rows one after
another, and `offsets` [rows + 1]), written atomically, so an interrupted extraction resumes at the first missing
shard and a finished shard is never redone; rows that extend the stored ones (a regeneration grown since) grow the
folder the same way (its partial last shard, if any, is extracted again). Training reads each row's slice through a memory map.

The manifest (FEATURES_MANIFEST) names the target (and a fingerprint of its weights), the stored layers, the storage
dtype and a fingerprint of the rows' input_ids: `TargetFeatures` refuses features of another target, of other rows,
or without a layer the drafter needs, naming what differs. `--final_hidden` also stores the target's last layer
(its final, normed hidden state), which the Markov objectives read.
"""

import bisect
import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from carryover_common.cli import check_at_least, check_exists, parse_arguments, run_cli
from carryover_common.outputs import check_output_dir, write_atomic
from carryover_common.targets import TargetArguments, default_device, load_target
from modeling_carryover.configuration_carryover import check_target_layer_ids, default_target_layer_ids
from modeling_carryover.modeling_carryover import hidden_state_request, layer_outputs
from trainer.build import FEATURE_INDEX, check_token_ids, concatenate_rows, load_training_rows, shard_counts
from trainer.data import _version, check_resumable
from trainer.verification import target_pass

logger = logging.getLogger(__name__)

FEATURES_MANIFEST = "features.json"
FEATURES_FORMAT = "carryover-features-v1"
# Manifest entries that may change between the runs of one resumed extraction (the target's identity is its weights
# fingerprint, not its name or path).
NOT_RESUME_KEYS = ("target", "versions", "batch_size")
# What the features folders of several datasets, read as one, must share.
SHARED_KEYS = ("target_fingerprint", "target_dtype", "num_target_layers", "hidden_size", "layer_ids", "dtype")


@dataclass
class FeatureArguments:
    dataset: list[str] = field(
        metadata={"help": "Training rows: a regenerated folder, or input_ids rows; several: their rows in order (as run.py)."}
    )
    output_dir: str = field(metadata={"help": "Where the features go (resumable: run again to finish)."})
    dataset_shards: list[int] | None = field(
        default=None, metadata={"help": "The first N shards of a regenerated --dataset, one count per dataset (as run.py)."}
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "0-based target layers to store [DFlash's rule for --num_draft_layers]."}
    )
    num_draft_layers: int = field(default=1, metadata={"help": "For the default target_layer_ids only."})
    final_hidden: bool = field(default=False, metadata={"help": "Also store the last layer (Markov drafters need it)."})
    dtype: str = field(default="bfloat16", metadata={"choices": ["bfloat16", "float16", "float32"]})
    max_seq_length: int = field(default=2048, metadata={"help": "Tokens stored per row (training may use fewer)."})
    shard_size: int = field(default=64, metadata={"help": "Rows per shard file."})
    batch_size: int = field(default=8, metadata={"help": "Rows per target forward."})

    def __post_init__(self):
        check_exists("dataset", self.dataset, hub=True)
        check_at_least("dataset_shards", self.dataset_shards, 0, " (0: all of a dataset)")
        check_at_least("target_layer_ids", self.target_layer_ids, 0)
        for name in ("num_draft_layers", "max_seq_length", "shard_size", "batch_size"):
            check_at_least(name, getattr(self, name), 1)


def data_fingerprints(rows: Dataset, every: int) -> list[str]:
    """sha256 of the rows' input_ids (each as int64, with its length), in order, after every `every` rows and after
    the last: entry k identifies the first (k + 1) * every rows, and the last entry all of them (what a shorter
    `--dataset_shards` prefix of the same rows is checked against)."""
    digest, prefixes = hashlib.sha256(), []
    for batch in rows.select_columns(["input_ids"]).with_format("numpy").iter(batch_size=every):
        for ids in batch["input_ids"]:
            digest.update(np.int64(len(ids)).tobytes() + np.asarray(ids, dtype=np.int64).tobytes())
        prefixes.append(digest.hexdigest())
    return prefixes


@torch.no_grad()
def weights_fingerprint(model, values: int = 1024) -> str:
    """sha256 of each parameter's name and shape and its first and last `values` entries rounded to bf16: tells
    checkpoints (and merged adapters) apart in any load dtype without hashing every weight."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        flat = parameter.detach().flatten()
        sample = torch.cat([flat[:values], flat[-values:]]).to("cpu", torch.bfloat16)
        digest.update(f"{name}{tuple(parameter.shape)}".encode() + sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def _shard_path(output_dir: Path, shard: int) -> Path:
    return output_dir / f"features-{shard:05d}.safetensors"


def _target_identity(target, target_name) -> dict:
    text = target.config.get_text_config(decoder=True)
    return {
        "target": target_name or target.name_or_path,
        "target_fingerprint": weights_fingerprint(target),
        "num_target_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
    }


def _row_identity(rows: Dataset, shard_size: int) -> dict:
    prefixes = data_fingerprints(rows, shard_size)
    return {"data_fingerprint": prefixes[-1], "shard_fingerprints": prefixes}


def _resume_view(manifest: dict) -> dict:
    """The manifest entries that must match for an extraction to resume."""
    return {key: value for key, value in manifest.items() if key not in NOT_RESUME_KEYS}


def _grown_from(output_dir: Path, manifest: dict, rows: Dataset) -> int:
    """How many rows `output_dir` holds features of, with these settings, as the first rows of `rows` (a regeneration
    grown since), or 0 when it does not: such a folder grows (feature shards for the new rows, and its partial last
    shard again) instead of being refused, and no whole shard is redone."""
    path = output_dir / FEATURES_MANIFEST
    if not path.exists():
        return 0
    recorded = json.loads(path.read_text())
    num_recorded, shard_size = recorded.get("num_rows") or 0, manifest["shard_size"]
    if not 0 < num_recorded < manifest["num_rows"]:
        return 0
    prefixes = manifest["shard_fingerprints"][: num_recorded // shard_size]
    if num_recorded % shard_size:
        prefixes.append(data_fingerprints(rows.select(range(num_recorded)), shard_size)[-1])
    prefix = dict(
        manifest, num_rows=num_recorded, num_shards=len(prefixes), data_fingerprint=prefixes[-1], shard_fingerprints=prefixes
    )
    return num_recorded if _resume_view(recorded) == _resume_view(prefix) else 0


def _shard_features(target, rows: Dataset, layer_ids, dtype, batch_size, max_seq_length, bar) -> dict:
    """One shard: the rows' stored layers one after another, `hidden_states` [tokens, L, d], and `offsets` [rows + 1]."""
    num_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    sequences = [ids[:max_seq_length] for ids in rows["input_ids"]]
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths in a batch: less padding
    stacked = [None] * len(sequences)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        length = max(len(sequences[i]) for i in batch)
        input_ids = torch.zeros(len(batch), length, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, i in enumerate(batch):  # right padding, as the training collator pads
            input_ids[row, : len(sequences[i])] = torch.as_tensor(sequences[i])
            attention_mask[row, : len(sequences[i])] = 1
        input_ids, attention_mask = input_ids.to(target.device), attention_mask.to(target.device)
        recorded = target_pass(target, input_ids, attention_mask, hidden_state_request(layer_ids))
        layers = torch.stack(layer_outputs(recorded.hidden_states, layer_ids, num_layers), dim=-2)  # [S, T, L, d]
        for row, i in enumerate(batch):
            stacked[i] = layers[row, : len(sequences[i])].to("cpu", dtype)
        bar.update(len(batch))
    offsets = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    return {"hidden_states": torch.cat(stacked), "offsets": offsets}


@torch.no_grad()
def extract_features(
    target,
    rows: Dataset,
    output_dir,
    layer_ids: list[int],
    *,
    dtype=torch.bfloat16,
    max_seq_length: int = 2048,
    shard_size: int = 64,
    batch_size: int = 8,
    target_name: str | None = None,
    progress: bool = True,
) -> "TargetFeatures":
    """Store the outputs of target decoder layers `layer_ids` for every row of `rows` in `output_dir` (resumably, see
    the module docstring); return the opened `TargetFeatures`. `target_name` (default: `target.name_or_path`) is the
    target's name recorded in the manifest; its identity is the weights fingerprint."""
    layer_ids = sorted(set(int(i) for i in layer_ids))
    check_target_layer_ids(layer_ids, target.config.get_text_config(decoder=True).num_hidden_layers)
    if len(rows) == 0:
        raise ValueError("No rows to extract features for: the dataset is empty.")
    manifest = {
        "format": FEATURES_FORMAT,
        **_target_identity(target, target_name),
        "target_dtype": str(target.dtype),
        "layer_ids": layer_ids,
        "dtype": str(dtype).removeprefix("torch."),
        **_row_identity(rows, shard_size),
        "num_rows": len(rows),
        "max_seq_length": max_seq_length,
        "shard_size": shard_size,
        "num_shards": math.ceil(len(rows) / shard_size),
        "batch_size": batch_size,
        "versions": {p: _version(p) for p in ("carryover-drafting", "torch", "transformers", "safetensors")},
    }
    manifest = json.loads(json.dumps(manifest))  # compare as it reads back from disk (tuples -> lists)
    output_dir = Path(output_dir)
    grown_from = _grown_from(output_dir, manifest, rows)
    if grown_from:  # the grown rows' first whole feature shards are the recorded ones
        if grown_from % shard_size:  # a partial last shard gets the new rows too (removed before the manifest changes)
            _shard_path(output_dir, grown_from // shard_size).unlink(missing_ok=True)
        write_atomic(output_dir / FEATURES_MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=2)))
    check_resumable(output_dir, manifest, FEATURES_MANIFEST, "features-*.safetensors", _resume_view)
    output_dir.mkdir(parents=True, exist_ok=True)
    if not (output_dir / FEATURES_MANIFEST).exists():
        write_atomic(output_dir / FEATURES_MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=2)))

    shards = [range(start, min(start + shard_size, len(rows))) for start in range(0, len(rows), shard_size)]
    todo = [k for k in range(len(shards)) if not _shard_path(output_dir, k).exists()]
    done_rows = len(rows) - sum(len(shards[k]) for k in todo)
    bar = tqdm(total=len(rows), initial=done_rows, desc="target features", unit="row", disable=not progress)
    for shard in todo:
        tensors = _shard_features(target, rows.select(shards[shard]), layer_ids, dtype, batch_size, max_seq_length, bar)
        write_atomic(_shard_path(output_dir, shard), lambda p: save_file(tensors, str(p)))
    bar.close()
    return TargetFeatures(output_dir)


class TargetFeatures:
    """A finished features folder, read through memory maps: `row(i)` is row i's stored layers [T_i, L, d]."""

    def __init__(self, path):
        self.path = Path(path)
        if not (self.path / FEATURES_MANIFEST).exists():
            raise ValueError(f"{self.path} has no {FEATURES_MANIFEST}: not a features folder (run python -m trainer.features)")
        self.manifest = json.loads((self.path / FEATURES_MANIFEST).read_text())
        if self.manifest.get("format") != FEATURES_FORMAT:
            raise ValueError(f"{self.path}: format {self.manifest.get('format')!r}, expected {FEATURES_FORMAT!r}")
        self.paths = [_shard_path(self.path, k) for k in range(self.manifest["num_shards"])]
        missing = [p.name for p in self.paths if not p.exists()]
        if missing:
            raise ValueError(
                f"{self.path}: {len(missing)} of {len(self.paths)} feature shards are missing ({missing[0]}, ...): run "
                "python -m trainer.features again with the same arguments to finish"
            )
        self.offsets = []
        for shard_path in self.paths:
            with safe_open(str(shard_path), "pt") as f:
                self.offsets.append(f.get_tensor("offsets").tolist())
        self.layer_ids = self.manifest["layer_ids"]

    def __len__(self):
        return self.manifest["num_rows"]

    def row(self, index: int, length: int | None = None) -> torch.Tensor:
        """Row `index`'s stored layers, its first `length` tokens (default: all) -> [T, L, d]."""
        shard, row = divmod(index, self.manifest["shard_size"])
        start, end = self.offsets[shard][row : row + 2]
        end = end if length is None else min(end, start + length)
        with safe_open(str(self.paths[shard]), "pt") as f:  # a memory map: only these tokens' bytes are read
            return f.get_slice("hidden_states")[start:end]

    def hidden_states(self, indices: list[int], lengths: list[int], width: int) -> tuple:
        """Rows `indices`, cut to `lengths` and right-padded to `width`, as an HF-style tuple of decoder-layer outputs
        (one entry per target layer, None where not stored: what `layer_outputs` reads): [S, width, d] each."""
        shape = (len(self.layer_ids), len(indices), width, self.manifest["hidden_size"])  # [L, S, T, d]
        stacked = torch.zeros(shape, dtype=getattr(torch, self.manifest["dtype"]))
        for row, (index, length) in enumerate(zip(indices, lengths)):
            stacked[:, row, :length] = self.row(index, length).movedim(1, 0)
        layers = dict(zip(self.layer_ids, stacked))
        return tuple(layers.get(i) for i in range(self.manifest["num_target_layers"]))

    def _refuse(self, what: str, recorded, wanted, advice: str):
        raise ValueError(f"{self.path} holds features of {what}: recorded {recorded}, this run has {wanted}. {advice}")

    def check_target(self, target, target_name: str | None = None) -> None:
        """Refuse features written by another target (other weights or shape); warn if it ran in another dtype."""
        identity, recorded = _target_identity(target, target_name), self.manifest
        if any(identity[k] != recorded[k] for k in ("target_fingerprint", "num_target_layers", "hidden_size")):
            self._refuse(
                "another target",
                f"{recorded['target']} (weights {recorded['target_fingerprint'][:12]}, {recorded['num_target_layers']} layers)",
                f"{identity['target']} (weights {identity['target_fingerprint'][:12]}, {identity['num_target_layers']} layers)",
                "Extract features with this target (python -m trainer.features --target ...).",
            )
        if str(target.dtype) != recorded["target_dtype"]:
            logger.warning(f"{self.path} was extracted with a {recorded['target_dtype']} target; this one is {target.dtype}.")

    def check_layers(self, layer_ids: list[int]) -> None:
        """Refuse a cache without every layer in `layer_ids` (the drafter's features, and the last layer for Markov)."""
        missing = sorted(set(layer_ids) - set(self.layer_ids))
        if missing:
            self._refuse(
                "other layers",
                f"layers {self.layer_ids}",
                f"a drafter that needs layers {sorted(set(layer_ids))} (missing {missing})",
                "Extract features with --target_layer_ids covering them (--final_hidden for the Markov head's last layer).",
            )

    def attach(self, rows: Dataset, max_seq_length: int, first_index: int = 0) -> Dataset:
        """`rows` (as the extraction read them) with a FEATURE_INDEX column (from `first_index`: where these features
        start among several), after checking they are the rows the features were extracted from and that rows of
        `max_seq_length` tokens have all their features stored."""
        shard_size = self.manifest["shard_size"]
        fingerprint = data_fingerprints(rows, shard_size)[-1] if len(rows) else None
        known = [self.manifest["data_fingerprint"]]
        if len(rows) % shard_size == 0:  # --dataset_shards: the first whole feature shards of the extracted rows
            known += self.manifest.get("shard_fingerprints", [])[len(rows) // shard_size - 1 : len(rows) // shard_size]
        if fingerprint not in known:
            self._refuse(
                "other rows", f"{self.manifest['num_rows']} rows (input_ids {self.manifest['data_fingerprint'][:12]})",
                f"{len(rows)} rows ({(fingerprint or 'none')[:12]})",
                "Extract features again for these rows (a prefix of them must be whole feature shards).",
            )
        if max_seq_length > self.manifest["max_seq_length"]:
            self._refuse(
                "shorter rows", f"max_seq_length={self.manifest['max_seq_length']}", f"max_seq_length={max_seq_length}",
                "Train with a max_seq_length no larger, or extract features with a larger one.",
            )
        return rows.add_column(FEATURE_INDEX, list(range(first_index, first_index + len(rows))))


class DatasetsFeatures(TargetFeatures):
    """Several datasets' features folders, one each, read as the features of their rows in order (as
    `load_training_rows` concatenates them): index `starts[k] + i` is row i of folder k. A dataset that grows (a
    regeneration) then grows only its own folder, and a dataset shared by several mixes is extracted once."""

    def __init__(self, parts: list[TargetFeatures]):
        first = parts[0]
        for part in parts[1:]:
            differs = [key for key in SHARED_KEYS if part.manifest.get(key) != first.manifest.get(key)]
            if differs:
                raise ValueError(
                    f"{part.path} and {first.path} hold features of different {', '.join(differs)}: extract every "
                    "dataset's features with the same target (and target dtype), layers and dtype."
                )
        self.parts, self.path, self.manifest, self.layer_ids = parts, first.path, first.manifest, first.layer_ids
        self.starts = np.cumsum([0] + [len(part) for part in parts]).tolist()

    def __len__(self):
        return self.starts[-1]

    def check_target(self, target, target_name: str | None = None) -> None:
        for part in self.parts:
            part.check_target(target, target_name)

    def row(self, index: int, length: int | None = None) -> torch.Tensor:
        folder = bisect.bisect_right(self.starts, index) - 1
        return self.parts[folder].row(index - self.starts[folder], length)

    def attach(self, rows: list[Dataset], max_seq_length: int) -> Dataset:
        """The rows of each dataset (one Dataset per folder), each checked against its folder, in order with the
        columns they all have and a FEATURE_INDEX into these features."""
        if len(rows) != len(self.parts):
            raise ValueError(f"{len(rows)} datasets for {len(self.parts)} features folders: give one folder per dataset")
        return concatenate_rows(
            [part.attach(part_rows, max_seq_length, start) for part, part_rows, start in zip(self.parts, rows, self.starts)]
        )


def rows_with_features(datasets: list[str], dataset_shards, features: list[str], max_seq_length: int):
    """The training rows of `datasets` (`load_training_rows`, with `dataset_shards`) with their FEATURE_INDEX column,
    and the features it points into: one folder for all their rows, or one per dataset -> (rows, features)."""
    if len(features) == 1:
        cache = TargetFeatures(features[0])
        return cache.attach(load_training_rows(datasets, dataset_shards), max_seq_length), cache
    if len(features) != len(datasets):
        raise ValueError(
            f"{len(features)} features folders for {len(datasets)} datasets: give one folder for all their rows, or "
            "one per dataset"
        )
    cache = DatasetsFeatures([TargetFeatures(path) for path in features])
    counts = shard_counts(datasets, dataset_shards)
    return cache.attach([load_training_rows(path, n) for path, n in zip(datasets, counts)], max_seq_length), cache


ARGUMENT_CLASSES = (TargetArguments, FeatureArguments)


def main(argv=None):
    target_args, args = parse_arguments(ARGUMENT_CLASSES, argv)
    # a features folder is resumed or grown (its manifest is compared with the settings); any other is refused
    resumable = (Path(args.output_dir) / FEATURES_MANIFEST).exists()
    check_output_dir(args.output_dir, inputs=[*args.dataset, target_args.target], resumable=resumable, flag=None)
    target, _ = load_target(
        target_args.target,
        adapter=target_args.target_adapter,
        dtype=target_args.torch_dtype,
        device=default_device(),
        tokenizer=False,
    )
    num_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    layer_ids = args.target_layer_ids or default_target_layer_ids(num_layers, args.num_draft_layers)
    layer_ids = list(layer_ids) + ([num_layers - 1] if args.final_hidden else [])
    rows = load_training_rows(args.dataset, args.dataset_shards)
    check_token_ids(rows, target.config.get_text_config().vocab_size)
    features = extract_features(
        target,
        rows,
        args.output_dir,
        layer_ids,
        dtype=getattr(torch, args.dtype),
        max_seq_length=args.max_seq_length,
        shard_size=args.shard_size,
        batch_size=args.batch_size,
        target_name=target_args.target,
    )
    print(f"{len(features)} rows, layers {features.layer_ids} ({args.dtype}) -> {args.output_dir}")
    return features


if __name__ == "__main__":
    run_cli(main)
