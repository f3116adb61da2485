"""`CarryoverTrainer`: a `transformers.Trainer` that trains a Carryover drafter against a frozen target.

The target is prepared by the Trainer's accelerator for evaluation only (device placement, no DDP/FSDP wrapping, not
trained, not saved); its features are computed online each step, or read from a features cache (`target_features`,
written by `python -m trainer.features`): then a baseline step runs no target forward. The drafter trains under DDP or FSDP2
(`--fsdp full_shard --fsdp_config '{"version": 2}'`, which shards each CarryoverDecoderLayer). Only the drafter is optimised and checkpointed
(`save_pretrained` writes the remote code and `custom_generate/`, so every checkpoint decodes as it is).
"""

import json
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import Trainer

from carryover_common.cli import check_at_least

from .features import FEATURE_INDEX, TargetFeatures
from .objectives import LossSettings, default_gamma, training_layer_ids, training_step_loss
from .verification import check_verification_support

TRAINING_SETTINGS_FILE = "carryover_training.json"


@dataclass
class CarryoverArguments:
    """What the drafter is trained on and how (the rest is `TrainingArguments`)."""

    carryover: bool = field(
        default=False,
        metadata={"help": "Train with parallel draft-verify-draft (Algorithm 2); False trains the baseline objective."},
    )
    num_anchors: int = field(default=512, metadata={"help": "Random anchors per response (fewer when it is short)."})
    loss_gamma: float | None = field(
        default=None, metadata={"help": "Position-weight decay; default 7 for block 16, 4 for block 8."}
    )
    markov_ce_weight: float = field(default=0.1, metadata={"help": "Markov variant: weight of the cross-entropy."})
    markov_l1_weight: float = field(default=0.9, metadata={"help": "Markov variant: weight of the L1 to the target."})
    confidence_weight: float = field(default=1.0, metadata={"help": "Markov variant: weight of the confidence BCE."})
    carry_embedding_lr: float | None = field(
        default=1e-2,
        metadata={
            "help": "Learning rate of E_carry (None: the drafter's). Target features reach per-dimension magnitudes "
            "of ~1-11 (outliers in the thousands): at the drafter's lr a zero-initialised E_carry barely moves."
        },
    )
    carry_gate_lr: float | None = field(
        default=1e-2,
        metadata={
            "help": "Learning rate of the carry gates (--carry_gate; None: the drafter's). A gate is one number per "
            "head that starts at zero: Adam moves it about one learning rate a step, so the drafter's would leave "
            "it shut."
        },
    )
    verify_chunk_size: int = field(default=64, metadata={"help": "Anchors per packed target verification forward."})

    def __post_init__(self):
        check_at_least("num_anchors", self.num_anchors, 1)
        check_at_least("verify_chunk_size", self.verify_chunk_size, 1)
        for name in ("loss_gamma", "markov_ce_weight", "markov_l1_weight", "confidence_weight", "carry_embedding_lr",
                     "carry_gate_lr"):
            check_at_least(name, getattr(self, name), 0)


@dataclass
class AblationArguments:
    """Ablations of carryover training, apart from the objective a user needs. None of them gained against its control
    on SmolLM2 (docs/results.md); they stay so that those experiments reproduce."""

    carry_embedding_init: str = field(
        default="keep",
        metadata={
            "help": "E_carry at the start: 'keep' (as loaded; zero for a fresh or imported baseline), 'zeros', or "
            "'feature_rms' (random signs scaled by carry_embedding_init_scale x the per-dimension RMS of the "
            "target features of the first batch).",
            "choices": ["keep", "zeros", "feature_rms"],
        },
    )
    carry_embedding_init_scale: float = field(default=0.1, metadata={"help": "Scale for carry_embedding_init=feature_rms."})
    first_pass_loss_weight: float = field(
        default=0.0,
        metadata={
            "help": "Carryover: weight of the first drafter pass's baseline loss (random anchors, no carried rows) "
            "added to the second pass's. 0 is Algorithm 2 as published (gradients through the second pass only); > 0 "
            "keeps the shared weights drafting well without carried rows while they learn to use them."
        },
    )
    carry_rows: bool = field(
        default=True,
        metadata={
            "help": "Carryover: give the second pass the rejected rows. False keeps the draft-verify shift of the "
            "anchors (a' = a + m + 1) and trains the second pass without carried rows: the ablation that separates "
            "what the shifted anchors and what the rows do to the drafter. The checkpoint then decodes without rows."
        },
    )
    carry_temperature: float = field(
        default=0.0,
        metadata={
            "help": "Carryover: the first pass samples its drafts at this temperature (0: the argmax, as greedy "
            "decoding drafts). At 1 the carried rows are the rejected branches of decoding at T=1 (pure sampling), "
            "which differ from greedy ones; the record stays the committed path."
        },
    )
    train_carry_only: bool = field(
        default=False,
        metadata={
            "help": "Carryover: train only what reads the carried rows (E_carry, and the gates or the projector where "
            "the drafter has them); every other weight stays as loaded. With --carry_gate the result decodes without "
            "its rows exactly as its starting checkpoint, so comparing the two measures what the rows add and "
            "nothing else (full carryover training also moves the shared weights, which every run here made worse)."
        },
    )


def pad_collator(rows: list[dict], features: TargetFeatures | None = None) -> dict:
    """Right-pad `input_ids` and `loss_mask` rows into a batch with its `attention_mask`; with `features`, also the
    rows' stored target layers (`target_hidden_states`, see `TargetFeatures.hidden_states`), padded the same way."""
    length = max(len(row["input_ids"]) for row in rows)
    batch = {name: torch.zeros(len(rows), length, dtype=torch.long) for name in ("input_ids", "attention_mask", "loss_mask")}
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = torch.as_tensor(row["input_ids"])
        batch["loss_mask"][i, :n] = torch.as_tensor(row["loss_mask"])
        batch["attention_mask"][i, :n] = 1
    if features is not None:
        lengths = [len(row["input_ids"]) for row in rows]
        batch["target_hidden_states"] = features.hidden_states([row[FEATURE_INDEX] for row in rows], lengths, length)
    return batch


class CarryoverTrainer(Trainer):
    # compute_loss returns a per-batch mean: let the Trainer scale it for gradient accumulation.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        *args,
        target_model=None,
        carryover_args: CarryoverArguments | None = None,
        ablation_args: AblationArguments | None = None,
        target_features: TargetFeatures | None = None,
        inputs_record: dict | None = None,
        **kwargs,
    ):
        """`target_features`: the target's stored layers for the rows of the datasets (which must come from
        `target_features.attach`); without it, each step computes them with a target forward. `inputs_record`: what
        the run read (data folders, features, starting checkpoint), kept as `inputs` in carryover_training.json."""
        if target_model is None:
            raise ValueError("CarryoverTrainer needs the frozen target: CarryoverTrainer(..., target_model=target).")
        kwargs.setdefault("data_collator", partial(pad_collator, features=target_features))
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and training_args.ddp_find_unused_parameters is None:
            # Every trained parameter gets a gradient each step (the carry marker is frozen without carryover; carried
            # rows are padded, never absent), but the Markov and confidence heads are applied outside the drafter's
            # forward: DDP's unused-parameter search would mark them ready early, then again in backward.
            training_args.ddp_find_unused_parameters = False
        if training_args is not None and training_args.device.type == "cpu":
            training_args.dataloader_pin_memory = False  # pinning needs an accelerator (torch warns on every run)
        super().__init__(*args, **kwargs)
        self.args.remove_unused_columns = False  # loss_mask is not a drafter forward argument
        self.carryover_args = carryover_args or CarryoverArguments()
        self.ablation_args = ablation_args or AblationArguments()
        self.inputs_record = inputs_record
        for name in ("num_anchors", "verify_chunk_size"):
            if getattr(self.carryover_args, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self.carryover_args, name)}.")
        weight = self.ablation_args.first_pass_loss_weight
        if weight < 0 or (weight > 0 and not self.carryover_args.carryover):
            raise ValueError(
                f"first_pass_loss_weight={weight}: it weighs carryover's first pass; use a value >= 0, with --carryover."
            )
        if not self.ablation_args.carry_rows and not self.carryover_args.carryover:
            raise ValueError("carry_rows=False ablates carryover training's rows: it needs --carryover true.")
        temperature = self.ablation_args.carry_temperature
        if temperature < 0 or (temperature > 0 and not self.carryover_args.carryover):
            raise ValueError(
                f"carry_temperature={temperature}: it is the temperature of carryover's first-pass drafts; use a value "
                ">= 0, with --carryover true."
            )
        carries_rows = self.carryover_args.carryover and self.ablation_args.carry_rows
        drafter = self.accelerator.unwrap_model(self.model)
        drafter.check_target(target_model.config)
        if self.carryover_args.carryover:
            check_verification_support(target_model)
        if target_features is not None:
            self._check_features(target_features, target_model, drafter.config)
        config = drafter.config
        config.carryover = carries_rows  # the checkpoint decodes the way it was trained by default
        self.loss_settings = LossSettings(
            gamma=self.carryover_args.loss_gamma or default_gamma(config.block_size),
            markov_ce_weight=self.carryover_args.markov_ce_weight,
            markov_l1_weight=self.carryover_args.markov_l1_weight,
            confidence_weight=self.carryover_args.confidence_weight,
            first_pass_weight=self.ablation_args.first_pass_loss_weight,
        )
        if self.ablation_args.train_carry_only:
            if not carries_rows:
                raise ValueError("train_carry_only trains what reads the carried rows: it needs --carryover true (with rows).")
            drafter.requires_grad_(False)  # the Trainer's optimizer takes only parameters that require grad
        # The carryover marker trains only where rows are carried: otherwise it gets no gradient (and DDP requires
        # every trained parameter to get one).
        for part in (drafter.carry_embedding, drafter.carry_proj, drafter.carry_gate):
            if part is not None:
                part.requires_grad_(carries_rows)
        target_model.requires_grad_(False).eval()
        self.target_model = self.accelerator.prepare_model(target_model, evaluation_mode=True)
        self._carry_init_pending = carries_rows and self.ablation_args.carry_embedding_init != "keep"
        self._step_metrics = defaultdict(list)

    def _check_features(self, features: TargetFeatures, target_model, config) -> None:
        features.check_target(target_model)
        features.check_layers(training_layer_ids(config))
        for name, dataset in (("train_dataset", self.train_dataset), ("eval_dataset", self.eval_dataset)):
            if dataset is not None and FEATURE_INDEX not in dataset.column_names:
                raise ValueError(f"{name} has no {FEATURE_INDEX!r} column: pass the rows through target_features.attach.")

    # -- the loss ------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._carry_init_pending:
            self._carry_init_pending = False
            if self.state.global_step == 0:  # a resumed run keeps the E_carry it trained
                self._init_carry_embedding(inputs)
        loss, metrics = training_step_loss(
            model,
            self.target_model,
            inputs,
            self.carryover_args.num_anchors,
            self.loss_settings,
            carryover=self.carryover_args.carryover,
            carry_rows=self.ablation_args.carry_rows,
            chunk_size=self.carryover_args.verify_chunk_size,
            draft_temperature=self.ablation_args.carry_temperature,
        )
        prefix = "" if model.training else "eval_"
        values = self.accelerator.reduce(torch.stack([v.detach().float() for v in metrics.values()]), "mean")
        for name, value in zip(metrics, values.tolist()):  # the mean over ranks, not rank 0's share
            self._step_metrics[prefix + name].append(value)
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs, *args, **kwargs):
        prefix = "eval_" if any(k.startswith("eval_") for k in logs) else ""
        for name in [n for n in self._step_metrics if n.startswith("eval_") == bool(prefix)]:
            values = self._step_metrics.pop(name)
            logs[name] = sum(values) / len(values)
        super().log(logs, *args, **kwargs)

    @torch.no_grad()
    def _init_carry_embedding(self, inputs):
        """Initialise E_carry before the first carryover step (see AblationArguments.carry_embedding_init)."""
        drafter = self.accelerator.unwrap_model(self.model)
        if drafter.carry_embedding is None:
            return
        if self.ablation_args.carry_embedding_init == "zeros":
            drafter.carry_embedding.zero_()
            return
        hidden_states = inputs.get("target_hidden_states")  # from the features cache, if training reads one
        if hidden_states is None:
            hidden_states = self.target_model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                output_hidden_states=drafter.feature_hidden_state_indices,
                use_cache=False,
            ).hidden_states
        features = drafter.target_features(hidden_states)[inputs["attention_mask"].bool()].float()  # [rows, F]
        rms = features.pow(2).mean(0).sqrt()
        signs = torch.randint(0, 2, rms.shape, device=rms.device) * 2 - 1
        value = (self.ablation_args.carry_embedding_init_scale * rms * signs).to(drafter.carry_embedding.dtype)
        if self.accelerator.num_processes > 1:
            torch.distributed.broadcast(value, src=0)  # the same E_carry on every rank
        parameter = drafter.carry_embedding
        if isinstance(parameter, DTensor):  # FSDP2 shards it: each rank keeps its part of the value
            value = distribute_tensor(value, parameter.device_mesh, parameter.placements)
        parameter.copy_(value)

    # -- optimisation and saving ---------------------------------------------------------------------------------

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, with E_carry and the carry gates each in a group of its own (own learning rate,
        no weight decay)."""
        optimizer = super().create_optimizer(model)
        drafter = self.accelerator.unwrap_model(self.model)
        own_lr = {"carry_embedding": self.carryover_args.carry_embedding_lr, "carry_gate": self.carryover_args.carry_gate_lr}
        for name, lr in own_lr.items():
            parameter = getattr(drafter, name)
            if parameter is None or lr is None or not parameter.requires_grad:
                continue
            if any(group.get("name") == name for group in optimizer.param_groups):
                continue
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if p is not parameter]
            optimizer.add_param_group({"params": [parameter], "lr": lr, "weight_decay": 0.0, "name": name})
        return optimizer

    def save_model(self, output_dir=None, _internal_call=False):
        super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            settings = {
                "carryover": asdict(self.carryover_args) | asdict(self.ablation_args),
                "loss": asdict(self.loss_settings),
                "training": {
                    k: v for k, v in self.args.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))
                },
                "target": getattr(self.target_model.config, "_name_or_path", None),
                "torch_threads": torch.get_num_threads(),
            }
            if self.inputs_record:
                settings["inputs"] = self.inputs_record
            with open(os.path.join(output_dir, TRAINING_SETTINGS_FILE), "w") as f:
                json.dump(settings, f, indent=2, default=str)
