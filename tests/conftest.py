"""Shared fixtures: tiny, randomly initialised real transformers targets and drafters, built in the test process."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub read it: no network in tests

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from modeling_carryover import CarryoverDrafterConfig, CarryoverDrafterModel

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,  # 0.02 makes tiny random targets loop on one token; 0.1 gives varied, learnable text
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def make_target(kind="llama", seed=0, **overrides):
    """A tiny random Llama-, Qwen3- (optionally hybrid sliding-window) or Mistral-style causal LM in eval mode."""
    torch.manual_seed(seed)
    fields = {**TINY, **overrides}
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**fields))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **fields))
    elif kind == "qwen3-sliding":  # hybrid: full-attention layers, then sliding-window ones
        model = Qwen3ForCausalLM(
            Qwen3Config(head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=2, **fields)
        )
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(head_dim=16, **fields))
    else:
        raise ValueError(kind)
    return model.eval()


def make_drafter(target, seed=1, **overrides):
    """A random drafter for `target` (2 layers, block 4 unless overridden)."""
    torch.manual_seed(seed)
    fields = {"num_hidden_layers": 2, "block_size": 4, **overrides}
    return CarryoverDrafterModel(CarryoverDrafterConfig.from_target_config(target.config, **fields)).eval()


@pytest.fixture
def llama_target():
    return make_target("llama")


@pytest.fixture
def qwen3_target():
    return make_target("qwen3")


def greedy_dataset(target, num_rows=48, prompt_len=6, new_tokens=48, seed=0):
    """The target's own greedy continuations of random prompts: `input_ids` and a `loss_mask` on the response."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        prompt = torch.randint(0, target.config.vocab_size, (1, prompt_len), generator=generator)
        sequence = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0]
        response_len = sequence.shape[0] - prompt_len
        rows.append({"input_ids": sequence.tolist(), "loss_mask": [0] * prompt_len + [1] * response_len})
    return Dataset.from_list(rows)


def train_drafter(target, drafter, dataset, carryover=False, epochs=10, num_anchors=16, lr=3e-3, output_dir=None, **kwargs):
    """A few epochs of the real CarryoverTrainer on CPU; returns the trainer (the drafter is trained in place)."""
    import tempfile

    from transformers import TrainingArguments

    from dataclasses import fields

    from trainer.carryover_trainer import AblationArguments, CarryoverArguments, CarryoverTrainer

    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(prefix="carryover-test-"),
        per_device_train_batch_size=4,
        num_train_epochs=epochs,
        learning_rate=lr,
        lr_scheduler_type="constant",
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    ablations = {field.name for field in fields(AblationArguments)}
    trainer = CarryoverTrainer(
        model=drafter.train(),
        args=args,
        train_dataset=dataset,
        target_model=target,
        carryover_args=CarryoverArguments(
            num_anchors=num_anchors, carryover=carryover, **{k: v for k, v in kwargs.items() if k not in ablations}
        ),
        ablation_args=AblationArguments(**{k: v for k, v in kwargs.items() if k in ablations}),
    )
    trainer.train()
    drafter.eval()
    return trainer


_TRAINED = {}


def trained_drafter(kind="llama", block_size=4, markov_rank=0, carryover=True):
    """A drafter trained on the tiny target's greedy outputs (baseline, then carryover), cached per session."""
    key = (kind, block_size, markov_rank, carryover)
    if key not in _TRAINED:
        target = make_target(kind)
        dataset = greedy_dataset(target)
        drafter = make_drafter(target, block_size=block_size, markov_rank=markov_rank)
        train_drafter(target, drafter, dataset, carryover=False, epochs=8)
        if carryover:
            train_drafter(target, drafter, dataset, carryover=True, epochs=4)
        _TRAINED[key] = (target, drafter, dataset)
    return _TRAINED[key]
