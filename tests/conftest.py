"""Shared fixtures: tiny, randomly initialised real transformers targets and drafters, built in the test process."""

import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from modeling_carryover import CarryoverDrafterConfig, CarryoverDrafterModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def make_target(kind="llama", seed=0, **overrides):
    """A tiny random Llama- or Qwen3-style causal LM in eval mode."""
    torch.manual_seed(seed)
    fields = {**TINY, **overrides}
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**fields))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **fields))
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
