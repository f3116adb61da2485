"""Carryover Drafting for Hugging Face transformers: the drafter model and its decoding.

The files of this package are also the remote code of every checkpoint (`auto_map`), so they import only torch,
transformers and each other (relative imports).
"""

from transformers import AutoConfig, AutoModel

from .configuration_carryover import CarryoverDrafterConfig, default_target_layer_ids
from .generation_carryover import (
    CarryoverCandidateGenerator,
    DraftRound,
    GenerationStats,
    carryover_decoding,
    confident_drafts,
    generate,
)
from .modeling_carryover import CarryoverDrafterModel, CarryoverDrafterOutput, rejected_rows

# With the package imported, AutoModel.from_pretrained(<drafter>) works without trust_remote_code (local classes win).
AutoConfig.register(CarryoverDrafterConfig.model_type, CarryoverDrafterConfig, exist_ok=True)
AutoModel.register(CarryoverDrafterConfig, CarryoverDrafterModel, exist_ok=True)

__all__ = [
    "CarryoverCandidateGenerator",
    "CarryoverDrafterConfig",
    "CarryoverDrafterModel",
    "CarryoverDrafterOutput",
    "DraftRound",
    "GenerationStats",
    "carryover_decoding",
    "confident_drafts",
    "default_target_layer_ids",
    "generate",
    "rejected_rows",
]
