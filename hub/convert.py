"""Checkpoint conversion: public DFlash-family drafters in, this project's drafter out, and back.

    python hub/convert.py --source z-lab/Qwen3-8B-DFlash-b16 --output_dir qwen3-8b-carryover      # import
    python hub/convert.py --source my-drafter --output_dir my-drafter-dflash --to dflash          # export
    python hub/convert.py --source my-drafter --output_dir my-drafter-dflash --to dflash --verifier <target>  # + head
    python hub/convert.py --source my-drafter --output_dir my-drafter-spec --to speculators --verifier Qwen/Qwen3-8B
    python hub/convert.py --source my-drafter --output_dir my-drafter-hf --to transformers    # transformers' DFlash

The formats, as read in their public code:

- z-lab DFlash (github z-lab/dflash, dflash/model.py): config.json `"architectures": ["DFlashDraftModel"]`,
  `model_type: qwen3` plus Qwen3 fields for the draft layers, `block_size` (top level; inside `dflash_config` in newer
  checkpoints), `num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`; weights `layers.*`, `fc`,
  `hidden_norm`, `norm`. Layer id l reads `hidden_states[l + 1]` and slot k of `[anchor, MASK...]` predicts
  token[a + k]: both exactly as here, so an import is the same drafter. Its sliding-window layers count the window
  from each query slot, not from the anchor as speculators and this drafter do: refused.
- DeepSpec DSpark (github deepseek-ai/DeepSpec, deepspec/modeling/dspark/): a Qwen3Config with top-level
  `target_layer_ids` (-1 = the embedding output), `mask_token_id`, `block_size`, `num_target_layers`, `markov_rank`,
  `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`; weights as z-lab's plus frozen copies of
  the target's `embed_tokens`/`lm_head`, `markov_head.markov_w1` (Embedding V x r), `markov_head.markov_w2`
  (Linear r -> V) and `confidence_head.proj` (Linear over [h ; W1[x]]). Its anchor slot is the first prediction
  (slot k predicts token[a + k + 1]), one slot off from ours. DeepSpec's "DFlash" checkpoints are the same class
  with `markov_rank: 0`.
- vLLM speculators (github vllm-project/speculators, src/speculators/models/dflash|dspark, convert/dflash):
  `speculators_model_type: dflash|dspark`, `transformer_layer_config` (the draft layers' Qwen3 config),
  `aux_hidden_state_layer_ids` = z-lab id + 1 (id k = the state after k layers; vLLM's `update_dflash` maps back
  with - 1), `mask_token_id`, `block_size`, `draft_vocab_size`, `sample_from_anchor` (False: z-lab's layout),
  `speculators_config: {algorithm, proposal_methods: [{proposal_type, speculative_tokens}], default_proposal_method,
  verifier: {name_or_path, architectures}}`; dspark adds the Markov and confidence heads under DeepSpec's names.
  A draft vocabulary (`draft_vocab_size` < the verifier's) comes with the buffers `d2t` (long [N]: draft index i is
  target token i + d2t[i], ids increasing; speculators' vocab_mapping) and `t2d` (bool [V]: which target tokens are
  drafted), and speculators' own training loads the N target LM-head rows from the verifier through `t2d`.
  `layer_types` in `transformer_layer_config` may hold `sliding_attention` layers (its training CLI's default): the
  block at anchor a sees the `sliding_window` context rows before a, and its own block causally unless
  `sliding_window_non_causal` (models/dflash/attention.py), which is this drafter's sliding-window rule.
- transformers' built-in DFlash (transformers >= 5.23, models/muse_glimmer_assistant, decoded by
  `target.generate(..., assistant_model=drafter, speculation_type="dflash")`): `"model_type":
  "muse_glimmer_assistant"`, top-level `target_layer_ids` (z-lab's ids), `block_size`, `mask_token_id`, `layer_types`
  (sliding by default); weights `encoder.fc`, `encoder.output_norm_enc` (= fc, hidden_norm), `layers.*`, `norm`; no
  attention biases. Its sliding-window layers see keys within the window on both sides of each query: refused.

Z-lab's, speculators' and transformers' DFlash layers apply RoPE to the whole head (their default RoPE ignores
`partial_rotary_factor`): an export of a partial-RoPE drafter is refused, and an import reads their configs as they
do, with full RoPE.
"""

import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import HfArgumentParser, MuseGlimmerAssistantConfig, PretrainedConfig, Qwen3Config
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from carryover_common.checkpoints import check_any_drafter_folder
from carryover_common.cli import check_exists
from carryover_common.outputs import check_output_dir, staged_folder
from modeling_carryover import CarryoverDrafterConfig, CarryoverDrafterModel

FORMATS = {
    "carryover": 'this project\'s (config.json "model_type": "carryover_drafter")',
    "dflash": 'z-lab DFlash (config.json "architectures": ["DFlashDraftModel"] with a "dflash_config")',
    "dspark": 'DeepSpec DSpark/DFlash (config.json "architectures": ["Qwen3DSparkModel"])',
    "speculators": 'vLLM speculators (config.json "speculators_model_type": "dflash" or "dspark")',
    "transformers": 'transformers\' built-in DFlash (config.json "model_type": "muse_glimmer_assistant")',
}
TRANSFORMERS_DFLASH_TYPE = "muse_glimmer_assistant"
# The draft-layer fields MuseGlimmerAssistantConfig shares with Qwen3Config (and ours).
TRANSFORMERS_LAYER_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "layer_types",
)
# transformers' built-in DFlash name -> ours (the draft layers and the final norm share their names)
TRANSFORMERS_DFLASH_KEYS = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
# Frozen copies of the target's embedding and LM head (and speculators' verifier parts): this drafter uses the target's.
TARGET_COPIES = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
# DeepSpec / speculators name -> ours. Same tensors: W1 [V, r], W2 [V, r], confidence [1, d + r] over [h ; W1[x]].
MARKOV_KEYS = {
    "markov_head.markov_w1.weight": "markov_embed.weight",
    "markov_head.markov_w2.weight": "markov_proj.weight",
    "confidence_head.proj.weight": "confidence_head.weight",
    "confidence_head.proj.bias": "confidence_head.bias",
}
CONFIDENCE_KEYS = {"confidence_head.weight", "confidence_head.bias"}


# ----------------------------------------------------------------------------------------------------------------
# Reading checkpoints
# ----------------------------------------------------------------------------------------------------------------


def resolve_checkpoint(path_or_repo_id: str, revision: str | None = None) -> Path:
    """A local folder as is; anything else is a Hub repo id, downloaded (needs a network)."""
    folder = Path(path_or_repo_id)
    if folder.is_dir():
        return folder
    if folder.exists() or path_or_repo_id.startswith((".", "/", "~")):
        raise ValueError(f"{path_or_repo_id} is not a checkpoint folder.")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.py"]
    return Path(snapshot_download(path_or_repo_id, revision=revision, allow_patterns=patterns))


def read_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{folder} has no config.json; expected a drafter checkpoint in one of the formats: {_expected()}."
        )
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not valid JSON ({error}).") from error


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights.")
    weights = {}
    for file in files:  # sharded checkpoints: the union of the shards
        try:
            weights.update(load_file(file))
        except SafetensorError as error:
            raise ValueError(f"{file} is not a readable safetensors file ({error}).") from error
    return weights


def checkpoint_format(config: dict) -> str:
    """Which of `FORMATS` a config.json belongs to; a clear error for anything else."""
    architectures = config.get("architectures") or []
    if config.get("model_type") == CarryoverDrafterConfig.model_type:
        return "carryover"
    if config.get("model_type") == TRANSFORMERS_DFLASH_TYPE:
        return "transformers"
    if "speculators_model_type" in config:
        return "speculators"
    if "dflash_config" in config:
        return "dflash"
    if "Qwen3DSparkModel" in architectures:
        return "dspark"
    if any(name.endswith("DSparkModel") for name in architectures):
        raise ValueError(f"{architectures[0]} is not supported: only Qwen3-style DSpark layers (Qwen3DSparkModel) map.")
    raise ValueError(
        f"Unrecognised drafter checkpoint (model_type={config.get('model_type')!r}, architectures={architectures}); "
        f"expected one of the formats: {_expected()}."
    )


def _expected() -> str:
    return "; ".join(FORMATS.values())


def _required(config: dict, key: str, source: str):
    if config.get(key) is None:
        raise ValueError(f"The {source} config.json lacks {key!r}.")
    return config[key]


# ----------------------------------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------------------------------


def import_drafter(path_or_repo_id: str, revision: str | None = None, init_only: bool = False) -> CarryoverDrafterModel:
    """Load a drafter checkpoint in any of `FORMATS` as this project's drafter.

    Foreign drafters come in with `carryover=False` and E_carry zero, so they decode exactly as the original and
    carryover training can continue from them (the vLLM plugin's DFlash export keeps its E_carry and setting). `init_only=True` also accepts DSpark's block layout (see
    `check_block_layout`) as an initialisation for training.
    """
    folder = resolve_checkpoint(path_or_repo_id, revision)
    config = read_config(folder)
    kind = checkpoint_format(config)
    if kind == "carryover":
        return CarryoverDrafterModel.from_pretrained(folder)
    weights = read_weights(folder)
    if kind == "dflash":
        return from_dflash(config, weights)
    if kind == "dspark":
        return from_dspark(config, weights, init_only)
    if kind == "transformers":
        return from_transformers_dflash(config, weights)
    return from_speculators(config, weights, init_only)


def from_dflash(config: dict, weights: dict[str, torch.Tensor]) -> CarryoverDrafterModel:
    """z-lab DFlash -> the same drafter here (carryover off). The fields `export_dflash` adds come back too: a draft
    vocabulary (`draft_vocab_size` with speculators' d2t/t2d) becomes our token map, and its `lm_head.weight` (the
    target head's rows of the draft tokens, for stock vLLM) is dropped, since ours scores the target's head; the vLLM
    plugin's E_carry and `dflash_config.carryover` and `target_model_type` are kept."""
    dflash = config["dflash_config"]
    source = "z-lab DFlash"
    draft_token_ids = speculators_token_map(config, weights, _required(config, "vocab_size", source), source)
    if draft_token_ids is not None:
        weights.pop("lm_head.weight", None)
    drafter_config = drafter_config_from_layers(
        config,
        source,
        # z-lab's own default when the ids are absent is the rule `default_target_layer_ids` implements
        target_layer_ids=dflash.get("target_layer_ids"),
        num_target_layers=_required(config, "num_target_layers", "z-lab DFlash"),
        block_size=config.get("block_size") or _required(dflash, "block_size", "z-lab DFlash"),
        mask_token_id=_required(dflash, "mask_token_id", "z-lab DFlash dflash_config"),
        draft_vocab_size=None if draft_token_ids is None else len(draft_token_ids),
    )
    drafter_config.carryover = bool(dflash.get("carryover", False))
    drafter_config.target_model_type = dflash.get("target_model_type", drafter_config.target_model_type)
    if draft_token_ids is not None:
        weights["draft_token_ids"] = draft_token_ids
    return drafter_from_weights(drafter_config, weights, source)


def from_dspark(config: dict, weights: dict[str, torch.Tensor], init_only: bool = False) -> CarryoverDrafterModel:
    """DeepSpec Qwen3DSparkModel -> ours: the backbone, W1/W2 and the confidence head map one to one; the block layout
    does not (see `check_block_layout`)."""
    source = "DeepSpec Qwen3DSparkModel"
    target_layer_ids = _required(config, "target_layer_ids", source)
    if -1 in target_layer_ids:
        raise ValueError(
            f"{source} target_layer_ids {target_layer_ids} use -1 (the embedding output); this drafter's features are "
            "decoder-layer outputs only."
        )
    rank = int(config.get("markov_rank", 0))
    if rank:
        check_markov_head_type(config.get("markov_head_type", "vanilla"), source)
    check_block_layout(sample_from_anchor=True, source=source, init_only=init_only)
    drafter_config = drafter_config_from_layers(
        config,
        source,
        target_layer_ids=target_layer_ids,
        num_target_layers=_required(config, "num_target_layers", source),
        block_size=_required(config, "block_size", source),
        mask_token_id=_required(config, "mask_token_id", source),
        markov_rank=rank,
    )
    weights = markov_weights(weights, drafter_config, bool(config.get("confidence_head_with_markov")), source)
    return drafter_from_weights(drafter_config, weights, source)


def from_speculators(config: dict, weights: dict[str, torch.Tensor], init_only: bool = False) -> CarryoverDrafterModel:
    """speculators dflash/dspark -> ours (a draft vocabulary's d2t/t2d become our token map). Unsupported: a target
    hidden size different from the drafter's, gated/rnn Markov heads, and (without `init_only`)
    `sample_from_anchor=True`."""
    kind = config["speculators_model_type"]
    source = f"speculators {kind}"
    if kind not in ("dflash", "dspark"):
        raise ValueError(f"speculators_model_type {kind!r} is not a DFlash-family drafter: expected dflash or dspark.")
    layers = _required(config, "transformer_layer_config", source)
    vocab_size, hidden_size = layers["vocab_size"], layers["hidden_size"]
    draft_token_ids = speculators_token_map(config, weights, vocab_size, source)
    if config.get("target_hidden_size") not in (None, hidden_size):
        raise ValueError(f"{source} has target_hidden_size {config['target_hidden_size']} != hidden_size {hidden_size}")
    aux_ids = _required(config, "aux_hidden_state_layer_ids", source)
    if min(aux_ids) < 1:
        raise ValueError(f"{source} aux_hidden_state_layer_ids {aux_ids} include 0 (the embedding output).")
    # Absent fields take the speculators defaults (DSparkSpeculatorConfig: DeepSpec's layout, rank 256, confidence on).
    rank = int(config.get("markov_rank", 256)) if kind == "dspark" else 0
    if rank:
        check_markov_head_type(config.get("markov_head_type", "vanilla"), source)
    check_block_layout(config.get("sample_from_anchor", kind == "dspark"), source, init_only)
    drafter_config = drafter_config_from_layers(
        layers,
        source,
        sliding_window_non_causal=bool(config.get("sliding_window_non_causal", False)),
        target_layer_ids=[i - 1 for i in aux_ids],  # speculators id k = the state after k layers = our id k - 1
        num_target_layers=config.get("num_target_layers") or verifier_num_layers(config),
        block_size=_required(config, "block_size", source),
        mask_token_id=_required(config, "mask_token_id", source),
        markov_rank=rank,
        draft_vocab_size=None if draft_token_ids is None else len(draft_token_ids),
    )
    weights = markov_weights(weights, drafter_config, config.get("confidence_head_with_markov", True), source)
    if draft_token_ids is not None:
        weights["draft_token_ids"] = draft_token_ids
    return drafter_from_weights(drafter_config, weights, source)


def speculators_token_map(config: dict, weights: dict[str, torch.Tensor], vocab_size: int, source: str):
    """Our token map (sorted target ids) from speculators' d2t/t2d, which are removed from `weights`; None for a
    full-vocabulary drafter. A map that contradicts itself or `draft_vocab_size` is a clear error."""
    size = config.get("draft_vocab_size") or vocab_size
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    if size == vocab_size and d2t is None:
        return None
    if d2t is None or t2d is None:
        raise ValueError(f"{source} has draft_vocab_size={size} of {vocab_size} but lacks its d2t/t2d token maps.")
    draft_token_ids = d2t.long() + torch.arange(len(d2t))  # speculators: target id = draft index + d2t[index]
    if len(d2t) != size or t2d.shape != (vocab_size,) or not torch.equal(t2d.bool().nonzero()[:, 0], draft_token_ids):
        raise ValueError(
            f"{source}'s token maps disagree: d2t has {len(d2t)} entries for draft_vocab_size={size}, and t2d "
            f"({tuple(t2d.shape)}, {int(t2d.bool().sum())} set) must mark exactly the targets of d2t."
        )
    return draft_token_ids


def from_transformers_dflash(config: dict, weights: dict[str, torch.Tensor]) -> CarryoverDrafterModel:
    """transformers' built-in DFlash (MuseGlimmerAssistantModel) -> the same drafter here (carryover off). Absent
    fields take MuseGlimmerAssistantConfig's defaults (sliding-window layers among them); its layers are Qwen3's
    without attention biases."""
    source = "transformers DFlash (muse_glimmer_assistant)"
    theirs = MuseGlimmerAssistantConfig.from_dict(config).to_dict()
    layers = {key: value for key, value in theirs.items() if not key.endswith("token_id")}  # not the layers' business
    layers |= {"model_type": "qwen3", "attention_bias": False, "vocab_size": _required(config, "vocab_size", source)}
    drafter_config = drafter_config_from_layers(
        layers,
        source,
        target_layer_ids=_required(config, "target_layer_ids", source),
        num_target_layers=_required(config, "num_target_layers", source),
        block_size=_required(config, "block_size", source),
        mask_token_id=_required(config, "mask_token_id", source),
    )
    weights = {TRANSFORMERS_DFLASH_KEYS.get(key, key): tensor for key, tensor in weights.items()}
    return drafter_from_weights(drafter_config, weights, source)


def check_block_layout(sample_from_anchor: bool, source: str, init_only: bool) -> None:
    """DSpark's layout (the anchor slot is the first prediction: slot k predicts token[a+k+1]) differs from ours and
    z-lab's (slot k predicts token[a+k], slot 0 none). The backbone computes the same hidden states at the same
    positions; only the readout is one slot apart, so the weights are a starting point, not the same drafter."""
    if not sample_from_anchor:
        return
    message = (
        f"{source} uses the DSpark block layout: the anchor slot is the first prediction (slot k predicts "
        "token[a+k+1]), while this drafter reads slot k as token[a+k] and slot 0 as nothing."
    )
    if not init_only:
        raise ValueError(
            message + " Imported as is it would propose different tokens. Pass init_only=True (--init_only) to import "
            "the weights anyway as an initialisation for training (same block_size and positions, readout one slot on)."
        )
    warnings.warn(message + " Imported as an initialisation only: train it before drafting with it.", stacklevel=3)


def check_markov_head_type(head_type: str, source: str) -> None:
    if head_type != "vanilla":
        raise ValueError(
            f"{source} has a {head_type!r} Markov head: not supported; only the first-order 'vanilla' head "
            "(W2(W1[x_prev])) maps onto this drafter's."
        )


def verifier_num_layers(config: dict) -> int:
    """speculators configs do not record the target's depth: read it from the verifier's config.json."""
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    try:
        verifier_config, _ = PretrainedConfig.get_config_dict(verifier)
    except OSError as error:
        raise ValueError(
            f"The speculators config does not record num_target_layers and the verifier {verifier!r} could not be "
            f"read to find it ({error})."
        ) from error
    return verifier_config.get("text_config", verifier_config)["num_hidden_layers"]


def drafter_config_from_layers(
    layers: dict, source: str, *, sliding_window_non_causal: bool | None = None, markov_rank: int = 0, **dflash_fields
) -> CarryoverDrafterConfig:
    """Our config from the draft layers' Qwen3 fields, as the source's Qwen3 layers read them; `dflash_fields`:
    target_layer_ids, num_target_layers, block_size, mask_token_id. Qwen3Config normalises legacy `rope_theta`/
    `rope_scaling` into `rope_parameters`. `sliding_window_non_causal`: the source's block rule in sliding-window
    layers, None where the source's sliding-window rule is not speculators' (such layers are refused)."""
    qwen3 = Qwen3Config.from_dict(layers)
    sliding = "sliding_attention" in qwen3.layer_types
    if sliding and sliding_window_non_causal is None:
        raise ValueError(
            f"{source} has sliding-window layers (layer_types={qwen3.layer_types}) whose window rule differs from "
            "this drafter's (speculators': the sliding_window context rows before the anchor): not supported."
        )
    return CarryoverDrafterConfig(
        vocab_size=qwen3.vocab_size,
        hidden_size=qwen3.hidden_size,
        intermediate_size=qwen3.intermediate_size,
        num_hidden_layers=qwen3.num_hidden_layers,
        num_attention_heads=qwen3.num_attention_heads,
        num_key_value_heads=qwen3.num_key_value_heads,
        head_dim=qwen3.head_dim,
        hidden_act=qwen3.hidden_act,
        rms_norm_eps=qwen3.rms_norm_eps,
        attention_bias=qwen3.attention_bias,
        max_position_embeddings=qwen3.max_position_embeddings,
        rope_parameters=full_head_rope(qwen3.rope_parameters, source),
        layer_types=list(qwen3.layer_types),
        sliding_window=qwen3.sliding_window if sliding else None,
        sliding_window_non_causal=bool(sliding_window_non_causal),
        carryover=False,
        markov_rank=markov_rank,
        **dflash_fields,
    )


def full_head_rope(rope_parameters: dict, source: str) -> dict:
    """The RoPE the source's Qwen3 layers apply: their default RoPE rotates the whole head whatever
    `partial_rotary_factor` says (a warning); with another rope_type the factor shrinks the tables and their forward
    fails, so there is nothing to reproduce."""
    rope = dict(rope_parameters)
    factor = rope.pop("partial_rotary_factor", 1.0)
    if factor == 1.0:
        return rope
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{source} has partial_rotary_factor {factor} with rope_type {rope['rope_type']!r}: its Qwen3 layers "
            "cannot apply that (the tables are narrower than the heads), so the checkpoint has no defined RoPE."
        )
    warnings.warn(
        f"{source} has partial_rotary_factor {factor}, which its Qwen3 layers ignore (they rotate the whole head): "
        "imported with full RoPE, as their forward (z-lab's model, speculators' trainer) runs it.",
        stacklevel=3,
    )
    return rope


def markov_weights(weights: dict, config: CarryoverDrafterConfig, confidence_with_markov: bool, source: str) -> dict:
    """DeepSpec/speculators weights under our names, without the target copies. A confidence head that reads h_k only
    gets zero columns for W1[x] (the same function); one without a Markov head here has no place and is dropped."""
    ours = {MARKOV_KEYS.get(key, key): tensor for key, tensor in weights.items() if key not in TARGET_COPIES}
    if "confidence_head.weight" not in ours:
        return ours
    if not config.markov_rank:
        warnings.warn(f"{source}: dropped the confidence head (ours exists only with a Markov head).", stacklevel=3)
        return {key: tensor for key, tensor in ours.items() if key not in CONFIDENCE_KEYS}
    if not confidence_with_markov:
        weight = ours["confidence_head.weight"]  # [1, d]
        ours["confidence_head.weight"] = torch.cat([weight, weight.new_zeros(1, config.markov_rank)], dim=-1)
    return ours


def drafter_from_weights(config: CarryoverDrafterConfig, weights: dict[str, torch.Tensor], source: str):
    """Our drafter holding `weights` (our names) in their dtype; E_carry stays zero. Missing, unexpected or misshapen
    tensors are a clear error: the checkpoint does not match its own config."""
    model = CarryoverDrafterModel(config)
    expected = model.state_dict()
    optional = {"carry_embedding"} | (CONFIDENCE_KEYS if config.markov_rank else set())
    missing = sorted(set(expected) - set(weights) - optional)
    unexpected = sorted(set(weights) - set(expected))
    misshapen = [
        f"{key} {tuple(tensor.shape)} != {tuple(expected[key].shape)}"
        for key, tensor in weights.items()
        if key in expected and tensor.shape != expected[key].shape
    ]
    if missing or unexpected or misshapen:
        raise ValueError(
            f"The {source} weights do not match the architecture in its config.json: missing {missing}, "
            f"unexpected {unexpected}, wrong shapes {misshapen}."
        )
    if config.markov_rank and "confidence_head.weight" not in weights:
        warnings.warn(
            f"{source} has no confidence head: ours keeps its initialisation (unused to draft).", stacklevel=3
        )
    model.load_state_dict(weights, strict=False)
    return model.to(weights["fc.weight"].dtype).eval()


# ----------------------------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------------------------


def export_dflash(
    drafter: CarryoverDrafterModel,
    output_dir: str | Path,
    keep_token_map: bool = False,
    target_lm_head: torch.Tensor | None = None,
) -> Path:
    """Write the z-lab DFlash format (vLLM / SGLang method "dflash"). Carryover and the Markov head have no place in
    it. No `auto_map`: z-lab's `dflash.py` is not part of the folder (load it with z-lab's package); to load and decode
    with transformers alone, export with `export_transformers`. A draft vocabulary is written as vLLM's DFlash model
    reads it, `draft_vocab_size` and speculators' `d2t`/`t2d`, when `keep_token_map` (serving/vllm_plugin.py's export,
    whose plugin gives the drafter its head at load) or with `target_lm_head`, the target's LM head weight
    [vocab, d]: its rows of the draft tokens are written as the drafter's own `lm_head.weight` [N, d], which stock
    vLLM loads instead of the target's whole head (`--to dflash --verifier`). Otherwise it is refused: z-lab's format
    has no such fields, and stock vLLM would score the first N rows of the target's head."""
    config = drafter.config
    format_name = "The z-lab DFlash format"
    keeps_token_map = keep_token_map or target_lm_head is not None
    check_exportable(config, format_name, keeps_sliding_layers=False, keeps_token_map=keeps_token_map)
    state = exported_state(drafter, format_name, keep_markov=False)
    dflash_config = {
        "architectures": ["DFlashDraftModel"],
        **qwen3_layer_config(config),
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
    }
    draft_token_ids = state.pop("draft_token_ids", None)
    if draft_token_ids is not None:
        dflash_config["draft_vocab_size"] = config.draft_vocab_size
        state |= speculators_token_maps(draft_token_ids, config.vocab_size)
        if target_lm_head is not None:  # [vocab, d] -> [N, d], the rows `draft_logits` scores
            state["lm_head.weight"] = drafter.draft_head_weight(target_lm_head.detach(), draft_token_ids).contiguous()
    return write_checkpoint(output_dir, dflash_config, state)


def export_speculators(drafter: CarryoverDrafterModel, output_dir: str | Path, verifier: str) -> Path:
    """Write the speculators format: `dflash`, or `dspark` with `sample_from_anchor: false` when there is a Markov
    head. Carryover has no place in it. `verifier`: the target's Hub id (or path), recorded for loaders."""
    config = drafter.config
    check_exportable(config, "The speculators format", keeps_sliding_layers=True, keeps_token_map=True)
    markov = config.markov_rank > 0
    state = exported_state(drafter, "The speculators format", keep_markov=True)
    last_layer = config.num_target_layers - 1
    if last_layer in config.target_layer_ids:
        warnings.warn(
            f"target layer {last_layer} is the target's last layer: vLLM captures auxiliary states before a layer, so "
            f"aux id {last_layer + 1} is never captured there (speculators' own converter drops it).",
            stacklevel=2,
        )
    speculators_config = {
        "architectures": ["DSparkSpeculator" if markov else "DFlashSpeculator"],
        "speculators_model_type": "dspark" if markov else "dflash",
        "transformer_layer_config": qwen3_layer_config(config),
        "draft_vocab_size": config.scored_vocab_size,
        "block_size": config.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "sample_from_anchor": False,  # z-lab's layout: the anchor slot predicts nothing, B - 1 drafts
        "sliding_window_non_causal": config.sliding_window_non_causal,
        # Not a speculators field (extra fields are allowed): lets an import check the layer ids offline.
        "num_target_layers": config.num_target_layers,
        "speculators_config": {
            "algorithm": "dspark" if markov else "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures(verifier, config)},
        },
    }
    if markov:
        speculators_config |= {
            "markov_rank": config.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        }
        theirs = {ours: name for name, ours in MARKOV_KEYS.items()}
        state = {theirs.get(key, key): tensor for key, tensor in state.items()}
    draft_token_ids = state.pop("draft_token_ids", None)
    if draft_token_ids is not None:
        state |= speculators_token_maps(draft_token_ids, config.vocab_size)
    return write_checkpoint(output_dir, speculators_config, state)


def speculators_token_maps(draft_token_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our token map as speculators' (and vLLM's EAGLE-3/DFlash) buffers: `d2t` [N] with target id = index + d2t[index],
    `t2d` bool [vocab_size] marking the drafted target tokens."""
    return {
        "d2t": draft_token_ids - torch.arange(len(draft_token_ids)),
        "t2d": torch.zeros(vocab_size, dtype=torch.bool).index_fill(0, draft_token_ids, True),
    }


def target_lm_head(target: str, drafter: CarryoverDrafterModel) -> torch.Tensor:
    """The LM head weight [vocab, d] of `target` (a folder, Hub id or the embedded default), loaded in float32, once
    `drafter.check_target` accepts it: another model's head would give the export foreign rows without an error."""
    from carryover_common.targets import load_target

    model = load_target(target, tokenizer=False)[0]
    drafter.check_target(model.config)
    return model.get_output_embeddings().weight


def export_transformers(drafter: CarryoverDrafterModel, output_dir: str | Path) -> Path:
    """Write transformers' built-in DFlash format: `AutoModel.from_pretrained(folder)` loads it without remote code,
    and `target.generate(..., assistant_model=drafter, speculation_type="dflash")` decodes with it as this drafter
    does with carryover=False. Carryover and the Markov head have no place in it."""
    config = drafter.config
    format_name = "transformers' built-in DFlash"
    check_exportable(config, format_name, keeps_sliding_layers=False, keeps_token_map=False)
    if config.attention_bias:
        raise ValueError(f"{format_name} has no attention biases; this drafter has (attention_bias=True).")
    layers = qwen3_layer_config(config)
    transformers_config = MuseGlimmerAssistantConfig(
        architectures=["MuseGlimmerAssistantModel"],
        **{key: layers[key] for key in TRANSFORMERS_LAYER_FIELDS},
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        target_layer_ids=list(config.target_layer_ids),
        bos_token_id=None,  # its defaults are another model's tokens
        eos_token_id=None,
        pad_token_id=None,
        # not its fields: the vocabulary and the target's depth, for imports and checks
        vocab_size=config.vocab_size,
        num_target_layers=config.num_target_layers,
    )
    theirs = {ours: name for name, ours in TRANSFORMERS_DFLASH_KEYS.items()}
    state = exported_state(drafter, format_name, keep_markov=False)
    state = {theirs.get(key, key): tensor for key, tensor in state.items()}
    return write_checkpoint(output_dir, transformers_config.to_diff_dict(), state)


def check_exportable(
    config: CarryoverDrafterConfig, format_name: str, keeps_sliding_layers: bool, keeps_token_map: bool
) -> None:
    """Refuse what the format's DFlash layers would compute differently: the export would propose other tokens."""
    if config.draft_vocab_size is not None and not keeps_token_map:
        # Expanding to the full vocabulary would score target rows this drafter was never trained to rank (and
        # drop a Markov head's N-row W2): it would propose other tokens, so it is refused, not approximated.
        raise ValueError(
            f"{format_name} has no draft-vocabulary token map, and this drafter drafts on {config.draft_vocab_size} "
            f"of {config.vocab_size} tokens: not exported. The speculators format keeps the map (d2t/t2d), and so "
            "do the vLLM plugin's export (`python -m serving.vllm_plugin`) and, with the target LM head's rows as the "
            "drafter's own head, `--to dflash --verifier <target>`."
        )
    factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise ValueError(
            f"{format_name} has no partial RoPE: its layers rotate the whole head and ignore partial_rotary_factor, "
            f"so this drafter (partial_rotary_factor {factor}) would draft differently there. Not exported."
        )
    if "sliding_attention" in config.layer_types and not keeps_sliding_layers:
        raise ValueError(
            f"{format_name} counts a sliding window from each query slot, this drafter from the block's anchor "
            f"(speculators' rule; layer_types={config.layer_types}): not exported. The speculators format keeps it."
        )


def qwen3_layer_config(config: CarryoverDrafterConfig) -> dict:
    """The draft layers as a Qwen3 config (z-lab's config.json body; speculators' transformer_layer_config)."""
    rope = dict(config.rope_parameters)
    layer_config = {
        "model_type": "qwen3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],  # readers on transformers 4.x take RoPE from rope_theta / rope_scaling
        "layer_types": list(config.layer_types),
        "use_sliding_window": "sliding_attention" in config.layer_types,
        "sliding_window": config.sliding_window,
        "tie_word_embeddings": False,
    }
    if rope.get("rope_type", "default") != "default":
        layer_config["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    return layer_config


def exported_state(drafter: CarryoverDrafterModel, format_name: str, keep_markov: bool) -> dict[str, torch.Tensor]:
    """The drafter's tensors that `format_name` has a place for; warns about what is dropped."""
    state = {key: tensor.detach().contiguous() for key, tensor in drafter.state_dict().items()}
    carry = [key for key in state if key.startswith(("carry_embedding", "carry_proj", "carry_gate"))]
    markov = [key for key in state if key.startswith(("markov_", "confidence_head"))]
    dropped = []
    if drafter.config.carryover or any(state[key].any() for key in carry):
        dropped.append(f"the carryover part ({', '.join(carry) or 'recycled rejected rows'})")
    if markov and not keep_markov:
        dropped.append(f"the Markov head ({', '.join(markov)})")
    if dropped:
        warnings.warn(
            f"{format_name} has no place for {' and '.join(dropped)}: dropped. The export drafts as this drafter does "
            f"with carryover=False{'' if keep_markov or not markov else ' and without its Markov correction'}.",
            stacklevel=3,
        )
    return {key: tensor for key, tensor in state.items() if key not in carry and (keep_markov or key not in markov)}


def verifier_architectures(verifier: str, config: CarryoverDrafterConfig) -> list[str]:
    """The verifier's `architectures`, read from its config.json as speculators does (e.g. ["Qwen3ForCausalLM"]);
    where that cannot be read (offline), the causal-LM class of the drafter's recorded `target_model_type`."""
    try:
        architectures = PretrainedConfig.get_config_dict(verifier)[0].get("architectures")
    except OSError:
        architectures = None
    if architectures:
        return list(architectures)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.target_model_type)
    if name is None:
        raise ValueError(
            f"Cannot tell the verifier's architectures: {verifier!r} has no readable config.json with them and the "
            f"drafter records no target model type (an imported drafter). Pass --verifier as the target's folder."
        )
    return [name]


def write_checkpoint(output_dir: str | Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, output_dir / "model.safetensors", metadata={"format": "pt"})
    return output_dir


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ConvertArguments:
    source: str = field(metadata={"help": "Drafter checkpoint (local folder or Hub repo id) in any supported format."})
    output_dir: str = field(metadata={"help": "Where to write the converted checkpoint."})
    to: Literal["carryover", "dflash", "speculators", "transformers"] = field(
        default="carryover",
        metadata={
            "help": "Output format: this project's (carryover), z-lab's (dflash, for vLLM/SGLang), vLLM speculators' "
            "or transformers' built-in DFlash (speculation_type='dflash')."
        },
    )
    verifier: str | None = field(
        default=None,
        metadata={
            "help": "--to speculators: the target model's Hub id, recorded as the verifier. --to dflash: the target "
            "(folder or Hub id) whose LM-head rows a draft-vocabulary drafter gets as its own head (stock vLLM)."
        },
    )
    revision: str | None = field(default=None, metadata={"help": "Hub revision of --source."})
    init_only: bool = field(
        default=False,
        metadata={"help": "Accept DSpark's block layout (anchor slot = first prediction) to initialise training."},
    )
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Write into a non-empty --output_dir."})

    def __post_init__(self):
        self.check_format()
        check_exists("source", self.source, hub=True)
        if (Path(self.source) / "config.json").is_file():  # a folder without one: import_drafter lists the formats
            check_any_drafter_folder(self.source)
        check_output_dir(self.output_dir, inputs=[self.source], overwrite=self.overwrite_output_dir)

    def check_format(self):
        if self.to == "speculators" and not self.verifier:
            raise ValueError("--to speculators needs --verifier (the target model's Hub id).")
        if self.verifier and self.to not in ("speculators", "dflash"):
            raise ValueError(f"--verifier has no effect with --to {self.to}: it is for --to speculators and --to dflash.")


def convert(args: ConvertArguments) -> Path:
    args.check_format()  # again: a caller may have changed the fields since they were parsed
    drafter = import_drafter(args.source, revision=args.revision, init_only=args.init_only)
    head = None if args.to != "dflash" or args.verifier is None else target_lm_head(args.verifier, drafter)
    with staged_folder(args.output_dir) as staging:  # a failed export leaves nothing, and earlier files stay whole
        if args.to == "dflash":
            export_dflash(drafter, staging, target_lm_head=head)
        elif args.to == "speculators":
            export_speculators(drafter, staging, args.verifier)
        elif args.to == "transformers":
            export_transformers(drafter, staging)
        else:
            drafter.save_pretrained(staging)
    return Path(args.output_dir)


ARGUMENT_CLASSES = (ConvertArguments,)


def main(argv: list[str] | None = None) -> None:
    try:
        (args,) = HfArgumentParser(ARGUMENT_CLASSES).parse_args_into_dataclasses(args=argv)
        output_dir = convert(args)
    except (ValueError, OSError) as error:
        sys.exit(f"convert: {error}")
    print(f"Wrote a {args.to} checkpoint to {output_dir}")


if __name__ == "__main__":
    main()
