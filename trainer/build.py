"""Building the drafter to train (new, from a checkpoint, or initialised from the target) and the training rows."""

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets import Dataset, concatenate_datasets

from carryover_common.checkpoints import check_drafter_folder
from carryover_common.cli import check_at_least, check_exists
from modeling_carryover import CarryoverDrafterConfig, CarryoverDrafterModel

from .data import MANIFEST, TOKEN_FEATURES, load_regenerated, load_rows
from .objectives import anchor_eligible

FEATURE_INDEX = "feature_index"  # the column that points a training row at its stored features (trainer.features)

logger = logging.getLogger(__name__)


# DrafterArguments field -> CarryoverDrafterConfig field
ARCHITECTURE_FIELDS = {
    "num_draft_layers": "num_hidden_layers",
    "block_size": "block_size",
    "target_layer_ids": "target_layer_ids",
    "mask_token_id": "mask_token_id",
    "intermediate_size": "intermediate_size",
    "markov_rank": "markov_rank",
    "carryover_interface": "carryover_interface",
    "carry_gate": "carry_gate",
    "draft_vocab_size": "draft_vocab_size",
}


@dataclass
class DrafterArguments:
    """The drafter's architecture (a new drafter; unset fields take the defaults in brackets) or a checkpoint to
    continue from. A checkpoint's architecture stays, with four exceptions that start exactly as the checkpoint:
    `carryover_interface` (the ablation interfaces), `carry_gate` (gated carried rows), `markov_rank` on a
    checkpoint without a Markov head (the Markov variant warm-started from a DFlash drafter) and a larger
    `num_draft_layers` (a deeper drafter grown from a trained one); and `block_size`, which no weight depends on (a
    drafter trained on 8-token blocks continued on 16-token ones: its first slots start from what they learned, the
    new ones from the same MASK embedding)."""

    drafter_checkpoint: str | None = field(
        default=None,
        metadata={"help": "Continue from this drafter checkpoint (e.g. the baseline, for carryover training)."},
    )
    num_draft_layers: int | None = field(
        default=None,
        metadata={"help": "Decoder layers [1; the paper: 5]; more than a --drafter_checkpoint's grows it (extend_drafter)."},
    )
    block_size: int | None = field(default=None, metadata={"help": "Block size: block_size - 1 drafts per round [16]."})
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "0-based target layers whose outputs are the features [DFlash's rule]."}
    )
    mask_token_id: int | None = field(default=None, metadata={"help": "Token whose embedding fills the MASK slots."})
    intermediate_size: int | None = field(default=None, metadata={"help": "MLP width [the target's]."})
    markov_rank: int | None = field(default=None, metadata={"help": "> 0: the DSpark-style Markov head of this rank [0]."})
    carryover_interface: str | None = field(
        default=None, metadata={"help": "How carried rows are marked [embedding].", "choices": ["embedding", "none", "projector"]}
    )
    carry_gate: bool | None = field(
        default=None,
        metadata={
            "help": "Attend to the carried rows through zero-initialised per-head gates, so that carryover training "
            "starts drafting exactly as without the rows [False]."
        },
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "A draft vocabulary of this many tokens: the most frequent response (loss-mask) tokens of the "
            "training rows, plus the target's EOS tokens [the full vocabulary]."
        },
    )
    attn_implementation: str = field(
        default="eager",
        metadata={
            "help": "The drafter's attention in training: eager (the structured dense path) or flex_attention "
            "(FlexAttention: no [blocks x context] score tensor kept for backward; needs a GPU).",
            "choices": ["eager", "flex_attention"],
        },
    )
    init_from_target: bool = field(
        default=True,
        metadata={"help": "A new drafter starts from the target's last decoder layers, fc passing the last feature."},
    )

    def __post_init__(self):
        check_exists("drafter_checkpoint", self.drafter_checkpoint, hub=True)
        check_drafter_folder(self.drafter_checkpoint)
        check_at_least("num_draft_layers", self.num_draft_layers, 1)
        check_at_least("block_size", self.block_size, 2, " (the anchor and at least one draft slot)")
        check_at_least("target_layer_ids", self.target_layer_ids, 0)
        check_at_least("mask_token_id", self.mask_token_id, 0)
        check_at_least("intermediate_size", self.intermediate_size, 1)
        check_at_least("markov_rank", self.markov_rank, 0, " (0: no Markov head)")
        check_at_least("draft_vocab_size", self.draft_vocab_size, 1)

    def overrides(self) -> dict:
        """The config fields these arguments set explicitly."""
        return {key: getattr(self, name) for name, key in ARCHITECTURE_FIELDS.items() if getattr(self, name) is not None}


@torch.no_grad()
def init_from_target(drafter: CarryoverDrafterModel, target) -> None:
    """Start the drafter from the target's last `num_hidden_layers` decoder layers and final norm, with `fc` passing
    the last feature layer through: a much lower initial loss than a random start (measured on SmolLM2: 75 -> 14.5)."""
    target_layers = target.get_decoder().layers
    n = len(drafter.layers)
    for layer, source in zip(drafter.layers, target_layers[-n:]):
        source_state = source.state_dict()
        state = layer.state_dict()
        shared = {k: v for k, v in source_state.items() if k in state}
        mismatched = [k for k, v in shared.items() if v.shape != state[k].shape]
        if mismatched:
            raise ValueError(f"init_from_target: the drafter's layer shapes differ from the target's ({mismatched[:3]}).")
        layer.load_state_dict(shared, strict=False)  # Llama targets have no q_norm/k_norm: those stay at ones
    drafter.norm.weight.copy_(target.get_decoder().norm.weight)
    d = drafter.config.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -d:] = torch.eye(d)


def build_drafter(target, args: DrafterArguments, rows: Dataset | None = None) -> CarryoverDrafterModel:
    """A drafter for `target`: new, or loaded from `drafter_checkpoint` (float32 master weights). A new drafter with
    a draft vocabulary takes its token map from the training `rows`."""
    drafter = load_or_create_drafter(target, args, rows)
    drafter.set_attn_implementation(args.attn_implementation)  # not saved: checkpoints decode with the default
    return drafter


def load_or_create_drafter(target, args: DrafterArguments, rows: Dataset | None = None) -> CarryoverDrafterModel:
    if not args.drafter_checkpoint:
        drafter = CarryoverDrafterModel(CarryoverDrafterConfig.from_target_config(target.config, **args.overrides()))
        if args.init_from_target:
            init_from_target(drafter, target)
        if args.draft_vocab_size:
            if rows is None:
                raise ValueError("A new drafter with a draft vocabulary needs the training rows to count tokens in.")
            vocab = draft_vocab_from_rows(rows, args.draft_vocab_size, target.config.vocab_size, eos_token_ids(target))
            drafter.set_draft_vocab(vocab)
        return drafter
    drafter = CarryoverDrafterModel.from_pretrained(args.drafter_checkpoint, dtype=torch.float32)
    drafter.check_target(target.config)
    changed = {k: v for k, v in args.overrides().items() if getattr(drafter.config, k) != v}
    if "block_size" in changed:  # every slot reads the same MASK embedding at its own position: no weight changes
        drafter.config.block_size = changed.pop("block_size")
        drafter.config.check_values()
    extension = {k: changed.pop(k) for k in ("carryover_interface", "carry_gate", "markov_rank", "num_hidden_layers") if k in changed}
    if extension.get("markov_rank") is not None and drafter.config.markov_rank:
        changed["markov_rank"] = extension.pop("markov_rank")  # a trained Markov head is not resized
    if extension.get("num_hidden_layers", drafter.config.num_hidden_layers) < drafter.config.num_hidden_layers:
        changed["num_hidden_layers"] = extension.pop("num_hidden_layers")  # trained layers are not dropped
    if changed:
        raise ValueError(
            f"{args.drafter_checkpoint} has {', '.join(f'{k}={getattr(drafter.config, k)!r}' for k in changed)}; "
            f"the arguments ask for {changed}. A checkpoint's architecture cannot change (only carryover_interface, "
            "carry_gate, markov_rank on a drafter without a Markov head, more layers, and block_size)."
        )
    return extend_drafter(drafter, **extension) if extension else drafter


def eos_token_ids(target) -> list[int]:
    """The target's end-of-sequence ids (config and generation config): a draft vocabulary always keeps them."""
    ids = set()
    for config in (target.config.get_text_config(), getattr(target, "generation_config", None)):
        eos = getattr(config, "eos_token_id", None)
        ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos} - {None}
    return sorted(ids)


def draft_vocab_from_rows(rows: Dataset, size: int, vocab_size: int, always: list[int] = ()) -> torch.LongTensor:
    """FR-Spec's draft vocabulary: the `size` most frequent tokens under the rows' loss masks (ties: lower id first;
    never-seen tokens fill up by id), with the `always` ids (EOS) first in line. -> sorted target ids [size]"""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab_size}, got {size}.")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows.select_columns(["input_ids", "loss_mask"]).iter(batch_size=256):
        for ids, mask in zip(row["input_ids"], row["loss_mask"]):
            ids, mask = torch.as_tensor(ids), torch.as_tensor(mask).bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)
    priority = counts.clone()
    priority[list(always)] = counts.sum() + 1  # outranks every counted token
    order = torch.argsort(priority, descending=True, stable=True)  # stable: equal counts keep increasing ids
    chosen = order[:size].sort().values
    seen = counts[chosen].sum() / counts.sum().clamp(min=1)
    logger.info(f"Draft vocabulary: {size} of {vocab_size} tokens cover {seen:.2%} of the training response tokens.")
    return chosen


def extend_drafter(drafter: CarryoverDrafterModel, **changes) -> CarryoverDrafterModel:
    """The same drafter with another carryover marker (Table 3b's ablation: `carryover_interface`), gated carried
    rows (`carry_gate`), a new Markov head (`markov_rank`, on a drafter without one) or more decoder layers
    (`num_hidden_layers`). Every shared weight is kept; the new marker, the gates, the Markov correction W2 and the
    new layers' residual outputs start at zero, so the extended drafter drafts exactly as the original; an old marker
    or gate is dropped."""
    config = copy.deepcopy(drafter.config)
    for key, value in changes.items():
        setattr(config, key, value)
    num_old = drafter.config.num_hidden_layers
    config.layer_types = drafter.config.layer_types + drafter.config.layer_types[-1:] * (config.num_hidden_layers - num_old)
    extended = CarryoverDrafterModel(config)
    state = drafter.state_dict()
    gates = state.pop("carry_gate", None)  # [old layers, H]: a grown drafter has more rows
    missing, _ = extended.load_state_dict(state, strict=False)
    if gates is not None and extended.carry_gate is not None:
        with torch.no_grad():
            extended.carry_gate[: len(gates)] = gates  # the new layers' gates stay shut
    new_layers = tuple(f"layers.{i}." for i in range(num_old, config.num_hidden_layers))
    new_parts = ("carry_embedding", "carry_proj", "carry_gate", "markov_embed", "markov_proj", "confidence_head") + new_layers
    assert all(key.startswith(new_parts) for key in missing), missing
    for layer in extended.layers[num_old:]:
        grow_layer(layer, drafter.layers[-1])
    return extended


@torch.no_grad()
def grow_layer(layer, last_layer) -> None:
    """A new layer appended to a trained drafter: a copy of its last layer (attention and MLP weights already suited
    to the residual stream they read) whose residual outputs (o_proj, down_proj) start at zero, so that it adds
    nothing until training moves them (the gradient reaches them first, then the rest of the layer)."""
    layer.load_state_dict(last_layer.state_dict())
    for output in (layer.self_attn.o_proj, layer.mlp.down_proj):
        output.weight.zero_()
        if output.bias is not None:
            output.bias.zero_()


def shard_counts(paths: list, num_shards: int | list[int] | None) -> list[int]:
    """One `--dataset_shards` count per dataset (0: all of it), checked."""
    if num_shards is None:
        return [0] * len(paths)
    num_shards = [num_shards] if isinstance(num_shards, int) else list(num_shards)
    if len(num_shards) != len(paths):
        raise ValueError(
            f"{len(num_shards)} shard counts for {len(paths)} datasets: give one count per dataset (0: all of it)"
        )
    return num_shards


def concatenate_rows(parts: list[Dataset]) -> Dataset:
    """Several datasets' rows in order, with the columns they all have (one data mix of separately made sources)."""
    common = [c for c in parts[0].column_names if all(c in part.column_names for part in parts)]
    parts = [part.select_columns(common) for part in parts]
    # regenerated folders store int32/int8 tokens, JSONL or Parquet rows int64: one type, or the parts do not align
    for name in set(TOKEN_FEATURES) & set(common):
        parts = [part if part.features[name] == TOKEN_FEATURES[name] else part.cast_column(name, TOKEN_FEATURES[name]) for part in parts]
    return concatenate_datasets(parts)


def load_training_rows(paths: str | Path | list, num_shards: int | list[int] | None = None) -> Dataset:
    """A regenerated folder (`python -m trainer.regenerate`; `num_shards`: its first shards only), or rows with
    input_ids/loss_mask in a `save_to_disk` folder or a JSONL/Parquet/CSV file. Several paths: their rows in order,
    with the columns they all have (one data mix made of separately regenerated sources); `num_shards` is then one
    count per path, 0 for all of it (e.g. the finished shards of a regeneration still going on, beside others)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    num_shards = shard_counts(paths, num_shards)
    if len(paths) > 1:
        return concatenate_rows([load_training_rows(path, count) for path, count in zip(paths, num_shards)])
    path, count = paths[0], num_shards[0]
    if (Path(path) / MANIFEST).exists():
        return load_regenerated(path, count or None)
    if count:
        raise ValueError(f"{path} is not a regenerated folder: it has no shards to choose from (give it 0 or none)")
    return load_rows(path)


def check_token_ids(rows: Dataset, vocab_size: int) -> None:
    """Every input id must be a token of the target's vocabulary: a larger one would fail deep in an embedding lookup
    (an IndexError naming no row), and one from another tokenizer would train on garbage."""
    ids = pc.list_flatten(rows.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"])
    if len(ids) == 0:
        return
    low, high = pc.min_max(ids).values()
    if low.as_py() < 0 or high.as_py() >= vocab_size:
        bad = low.as_py() if low.as_py() < 0 else high.as_py()
        raise ValueError(
            f"The training rows hold token id {bad}, outside the target's vocabulary [0, {vocab_size}): they were "
            "tokenized for another model. Regenerate them with this target (`python -m trainer.regenerate`)."
        )


def prepare_rows(dataset: Dataset, max_seq_length: int) -> Dataset:
    """Check the columns, cut rows to `max_seq_length` (a features cache's FEATURE_INDEX column is kept), drop rows
    without two consecutive response tokens (no block can be anchored there: `anchor_eligible`). Raises a ValueError
    saying what is wrong; nothing is written."""
    missing = {"input_ids", "loss_mask"} - set(dataset.column_names)
    if missing:
        raise ValueError(
            f"The training dataset lacks {sorted(missing)} (has {dataset.column_names}); regenerate it with "
            "`python -m trainer.regenerate` or tokenize conversations with trainer.data.tokenize_conversations."
        )
    if len(dataset) == 0:
        raise ValueError("The training dataset is empty.")
    dataset = dataset.select_columns([c for c in ("input_ids", "loss_mask", FEATURE_INDEX) if c in dataset.column_names])
    columns = dataset.select_columns(["input_ids", "loss_mask"]).with_format("arrow")[:]
    unequal = pc.not_equal(pc.list_value_length(columns["input_ids"]), pc.list_value_length(columns["loss_mask"]))
    if pc.any(unequal).as_py():
        raise ValueError(
            f"{pc.sum(unequal).as_py()} rows have a loss_mask of another length than their input_ids (first: row "
            f"{pc.index(unequal, True).as_py()}): each token needs its 0/1 mask entry."
        )
    masks = pc.list_flatten(columns["loss_mask"])
    zero_one = pa.array([0, 1], masks.type) if not pa.types.is_boolean(masks.type) else None
    if zero_one is not None and len(masks) and not pc.all(pc.is_in(masks, value_set=zero_one)).as_py():
        values = sorted(set(pc.unique(masks).to_pylist()) - {0, 1})
        raise ValueError(
            f"loss_mask holds {values[:5]}: it must be 0 (prompt: not trained on) or 1 (response) for every token. "
            "Fix the rows (or regenerate them with `python -m trainer.regenerate`)."
        )
    dataset = dataset.map(
        lambda row: {"input_ids": row["input_ids"][:max_seq_length], "loss_mask": row["loss_mask"][:max_seq_length]}
    )
    usable = dataset.filter(lambda row: bool(anchor_eligible(torch.tensor(row["loss_mask"])).any()))
    if len(usable) == 0:
        raise ValueError(
            f"None of the {len(dataset)} rows has two consecutive response tokens within max_seq_length={max_seq_length}: "
            "nothing to train on (no block can be anchored)."
        )
    if len(usable) < len(dataset):
        logger.warning(
            f"Dropped {len(dataset) - len(usable)} of {len(dataset)} rows without two consecutive response tokens within "
            f"max_seq_length={max_seq_length} (no block can be anchored on them)."
        )
    return usable
