"""Train a Carryover drafter: baseline, or draft-verify-draft carryover continuing a baseline.

    # regenerate data with the (embedded) target, then train a baseline drafter
    python trainer/run.py --prompts magpie --num_prompts 2000 --data_dir data/smollm2 \
        --output_dir checkpoints/baseline --num_draft_layers 2 --block_size 8 --num_train_epochs 3
    # continue it with carryover (fresh optimizer), and the fair control: the same steps without carryover
    python trainer/run.py --dataset data/smollm2 --drafter_checkpoint checkpoints/baseline --carryover \
        --output_dir checkpoints/carryover --num_train_epochs 1
    python trainer/run.py --dataset data/smollm2 --drafter_checkpoint checkpoints/baseline \
        --output_dir checkpoints/control --num_train_epochs 1
    # the target's features stored once (resumable): baseline steps then run no target forward
    python -m trainer.features --dataset data/smollm2 --output_dir data/smollm2-features --num_draft_layers 2
    python trainer/run.py --dataset data/smollm2 --features data/smollm2-features --output_dir checkpoints/baseline ...
    python trainer/run.py config.yaml                     # the same fields in a JSON or YAML file
    torchrun --nproc_per_node 2 trainer/run.py ...        # DDP; `accelerate launch` works the same way
    torchrun --nproc_per_node 8 trainer/run.py ... --fsdp full_shard --fsdp_config fsdp.json   # FSDP2: {"version": 2}

Arguments: TargetArguments (target, PEFT adapter), DrafterArguments (architecture or checkpoint), DataArguments,
RegenerationArguments (prompts to regenerate first), CarryoverArguments (objective), AblationArguments (ablations of
carryover training, apart from the objective) and transformers'
TrainingArguments (output_dir, epochs, learning rate, resume_from_checkpoint, ...). Checkpoints hold the drafter only
and load and decode like any drafter folder (remote code + custom_generate/).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from carryover_common.cli import check_at_least, check_exists, parse_arguments, run_cli
from carryover_common.outputs import check_output_dir, move_into
from carryover_common.targets import TargetArguments, default_device, load_target, warn_if_cpu_bf16_is_slow
from trainer.build import DrafterArguments, build_drafter, check_token_ids, load_training_rows, prepare_rows
from trainer.carryover_trainer import TRAINING_SETTINGS_FILE, AblationArguments, CarryoverArguments, CarryoverTrainer
from trainer.features import rows_with_features
from trainer.regenerate import RegenerationArguments, check_data_dir, regenerate_from_args


@dataclass
class DataArguments:
    dataset: list[str] | None = field(
        default=None,
        metadata={
            "help": "Training rows: a regenerated folder, or input_ids/loss_mask rows (save_to_disk folder, JSONL, "
            "Parquet); several: their rows in order."
        },
    )
    dataset_shards: list[int] | None = field(
        default=None,
        metadata={
            "help": "Only the first N shards of a regenerated --dataset (its regeneration may go on); several "
            "datasets: one count each, 0 for all of it."
        },
    )
    max_seq_length: int = field(default=2048, metadata={"help": "Rows are cut to this many tokens."})
    eval_rows: int = field(default=0, metadata={"help": "Hold out this many rows for evaluation (eval_loss)."})
    features: list[str] | None = field(
        default=None,
        metadata={
            "help": "The target's stored features of --dataset (python -m trainer.features): one folder for all its "
            "rows, or one per dataset. Baseline steps run no target forward; carryover reads them and still verifies "
            "with the target."
        },
    )
    # transformers 5 removed TrainingArguments.overwrite_output_dir: the project's own flag, with the same name
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into a non-empty --output_dir (a drafter there is replaced when training ends)."},
    )

    def __post_init__(self):
        check_exists("dataset", self.dataset, hub=True)
        check_exists("features", self.features)
        check_at_least("dataset_shards", self.dataset_shards, 0, " (0: all of a dataset)")
        check_at_least("max_seq_length", self.max_seq_length, 2, " (an anchor and one token to draft)")
        check_at_least("eval_rows", self.eval_rows, 0)


ARGUMENT_CLASSES = (
    TargetArguments,
    DrafterArguments,
    DataArguments,
    RegenerationArguments,
    CarryoverArguments,
    AblationArguments,
    TrainingArguments,
)


def check_training_arguments(training_args: TrainingArguments) -> None:
    """The TrainingArguments values that the Trainer would take without a word: 0 steps trains one and saves it."""
    if training_args.max_steps == 0 or training_args.max_steps < -1:
        raise ValueError(f"--max_steps must be at least 1 (-1: set by --num_train_epochs), got {training_args.max_steps}.")
    if training_args.max_steps == -1 and training_args.num_train_epochs <= 0:
        raise ValueError(f"--num_train_epochs must be above 0 (or give --max_steps), got {training_args.num_train_epochs}.")
    check_at_least("learning_rate", training_args.learning_rate, 0)


def main(argv=None):
    target_args, drafter_args, data_args, regeneration_args, carryover_args, ablation_args, training_args = (
        parse_arguments(ARGUMENT_CLASSES, argv)
    )
    check_training_arguments(training_args)
    if not (data_args.dataset or regeneration_args.prompts):
        raise SystemExit("Give the training data: --dataset <folder>, or --prompts <source|magpie> to regenerate it.")
    if data_args.features and not data_args.dataset:
        raise SystemExit("--features belong to the rows of --dataset: regenerate first, then extract them.")
    if drafter_args.attn_implementation == "flex_attention" and training_args.device.type == "cpu":
        raise ValueError("--attn_implementation flex_attention needs a GPU (PyTorch's FlexAttention has no CPU backward).")
    if training_args.bf16 and training_args.device.type == "cpu":
        warn_if_cpu_bf16_is_slow("The drafter's training step (--bf16 true)", "--bf16 false")
    regenerating = not data_args.dataset
    if regenerating and training_args.world_size > 1:
        raise SystemExit(
            "--prompts regenerates in one process: run `python -m trainer.regenerate` (or trainer/run.py without "
            "torchrun) first, then train on its folder with --dataset."
        )
    if regenerating:
        check_data_dir(regeneration_args)
    inputs = [*(data_args.dataset or [regeneration_args.data_dir]), *(data_args.features or [])]
    check_output_dir(
        training_args.output_dir,
        inputs=[*inputs, drafter_args.drafter_checkpoint, target_args.target],
        resumable=bool(training_args.resume_from_checkpoint),
        overwrite=data_args.overwrite_output_dir,
    )
    with training_args.main_process_first(desc="loading the target"):  # a cold cache converts the embedded GGUF once
        target, tokenizer = load_target(
            target_args.target,
            adapter=target_args.target_adapter,
            dtype=target_args.torch_dtype,
            device=default_device() if regenerating else None,  # the Trainer places it for training
            tokenizer=regenerating,
        )

    features = None
    if regenerating:
        rows = regenerate_from_args(target, tokenizer, regeneration_args, target_args.target)
    elif data_args.features:
        rows, features = rows_with_features(
            data_args.dataset, data_args.dataset_shards, data_args.features, data_args.max_seq_length
        )
    else:
        rows = load_training_rows(data_args.dataset, data_args.dataset_shards)
    rows = prepare_rows(rows, data_args.max_seq_length)
    check_token_ids(rows, target.config.get_text_config().vocab_size)
    eval_rows = None
    if data_args.eval_rows:
        split = rows.train_test_split(test_size=data_args.eval_rows, seed=training_args.seed)
        rows, eval_rows = split["train"], split["test"]

    inputs_record = {
        "dataset": data_args.dataset or [regeneration_args.data_dir],
        "dataset_shards": data_args.dataset_shards,
        "num_rows": len(rows),
        "features": data_args.features,
        "drafter_checkpoint": drafter_args.drafter_checkpoint,
    }
    set_seed(training_args.seed)  # the same new drafter on every rank (FSDP shards each rank's own values)
    drafter = build_drafter(target, drafter_args, rows)
    trainer = CarryoverTrainer(
        model=drafter,
        args=training_args,
        train_dataset=rows,
        eval_dataset=eval_rows,
        target_model=target,
        carryover_args=carryover_args,
        ablation_args=ablation_args,
        target_features=features,
        inputs_record=inputs_record,
    )
    resume = training_args.resume_from_checkpoint
    if resume:
        check_resumed_inputs(resume, training_args.output_dir, inputs_record)
    trainer.train(resume_from_checkpoint=True if resume in ("true", "latest") else resume)
    save_final_model(trainer, training_args.output_dir)
    if eval_rows is not None:
        trainer.evaluate()
    return trainer


def check_resumed_inputs(resume: str, output_dir: str, inputs_record: dict) -> None:
    """A resumed run must read what its checkpoint was trained on: the Trainer skips the batches already seen by
    position, so other rows (e.g. a regeneration grown in between) would repeat some rows and never show others."""
    checkpoint = get_last_checkpoint(output_dir) if resume in ("true", "latest") else resume
    settings = Path(checkpoint or "", TRAINING_SETTINGS_FILE)
    if checkpoint is None or not settings.exists():
        return  # the Trainer says what is missing; a checkpoint from before the record was kept has none to compare
    recorded = json.loads(settings.read_text()).get("inputs", {})
    changed = {key: (recorded[key], value) for key, value in inputs_record.items() if key in recorded and recorded[key] != value}
    if changed:
        details = "; ".join(f"{key}: {old} then, {new} now" for key, (old, new) in changed.items())
        raise SystemExit(
            f"{checkpoint} was trained on other inputs ({details}): resuming would repeat some rows and skip others. "
            "Resume with the same data (e.g. its --dataset_shards), or train into a new --output_dir."
        )


def save_final_model(trainer, output_dir: str) -> None:
    """Save the drafter into a temporary folder, then move its files into `output_dir`: a drafter already there stays
    whole until the new one is complete. The folder has one name on every rank (FSDP saves from all of them)."""
    staging = Path(output_dir) / ".final.partial"
    trainer.save_model(str(staging))
    if trainer.is_world_process_zero():
        move_into(staging, output_dir)


def end_distributed():
    """Leave the process group cleanly: a rank that exits with gloo's threads still running can abort at shutdown."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
    end_distributed()
