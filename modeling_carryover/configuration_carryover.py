"""Configuration of the Carryover drafter (remote-code safe: imports only transformers and the standard library)."""

import copy

from transformers import PreTrainedConfig

CARRYOVER_INTERFACES = ("embedding", "none", "projector")
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_target_layer_ids(target_layer_ids: list[int], num_target_layers: int) -> None:
    """Feature layers must be decoder layers of the target: id l is the output of decoder layer l."""
    if not target_layer_ids:
        raise ValueError("target_layer_ids must name at least one target layer.")
    bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"target_layer_ids {bad} out of range: the target has {num_target_layers} decoder layers, "
            f"valid ids are 0..{num_target_layers - 1} (id l = output of decoder layer l)."
        )


def full_attention_rope(rope_parameters) -> dict | None:
    """The target's RoPE settings for the drafter's (full-attention) layers: Gemma-style targets give one entry per
    layer type ({"sliding_attention": {...}, "full_attention": {...}}), the others one for all layers."""
    rope = dict(rope_parameters or {})
    if isinstance(rope.get("full_attention"), dict):
        rope = dict(rope["full_attention"])
    return copy.deepcopy(rope) or None


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """DFlash's rule: one feature -> the middle layer; else evenly spaced from layer 1 to layer L-3.

    Ids are 0-based decoder-layer OUTPUTS (id l = HF `output_hidden_states[l + 1]`).
    Qwen3-4B (L=36) with 5 features gives [1, 9, 17, 25, 33].
    """
    if num_features > num_target_layers:
        raise ValueError(
            f"A drafter with {num_features} layers reads {num_features} target layers by default, but the target has "
            f"{num_target_layers}: pass target_layer_ids (or fewer drafter layers)."
        )
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start + 1 < num_features:  # very shallow targets (tests): spread over all layers
        start, end = 0, num_target_layers - 1
    return [int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features)]


class CarryoverDrafterConfig(PreTrainedConfig):
    r"""
    Configuration of a [`CarryoverDrafterModel`]: a DFlash-style block-diffusion drafter (optionally with a
    DSpark-style first-order "Markov" head) that reads the target's hidden states as attention context and, with
    carryover, also the target's hidden states of the previous round's REJECTED draft tokens.

    The drafter has no embedding and no LM head of its own: it uses the target's, so `hidden_size` and `vocab_size`
    must equal the target's. Build it from a target with [`CarryoverDrafterConfig.from_target_config`].

    Args:
        vocab_size (`int`): vocabulary size of the TARGET (rows of its embedding / LM head).
        hidden_size (`int`): hidden size; must equal the target's hidden size.
        intermediate_size (`int`): width of each drafter layer's SwiGLU MLP.
        num_hidden_layers (`int`): number of drafter decoder layers.
        num_attention_heads (`int`): query heads per drafter layer.
        num_key_value_heads (`int`, *optional*): key/value heads (GQA); defaults to `num_attention_heads`.
        head_dim (`int`, *optional*): per-head width; defaults to `hidden_size // num_attention_heads`.
        hidden_act (`str`): MLP activation (`"silu"` for Llama/Qwen-style targets).
        rms_norm_eps (`float`): epsilon of every RMSNorm (layer norms, per-head q/k norms, `hidden_norm`, `norm`).
        attention_bias (`bool`): whether q/k/v/o projections have a bias.
        max_position_embeddings (`int`): longest position the RoPE tables are meant for (the target's value).
        rope_parameters (`dict`, *optional*): the TARGET's RoPE settings (`rope_type`, `rope_theta`, scaling keys,
            `partial_rotary_factor`): the drafter applies RoPE at the same absolute positions as the target.
        initializer_range (`float`): std of the normal initialisation of linear layers.
        layer_types (`list[str]`, *optional*): per drafter layer, `"full_attention"` (the default for every layer:
            a block sees every context row before its anchor and its whole block) or `"sliding_attention"`, with the
            window rule of vLLM speculators' DFlash (its training CLI makes every layer sliding unless
            `--full-attention-indices` is given): the block at anchor a sees the `sliding_window` context rows at
            positions a - sliding_window .. a - 1, its carried rows, and its own block causally (slot k sees slots
            0..k) unless `sliding_window_non_causal`.
        sliding_window (`int`, *optional*): context rows a sliding-window layer sees before the anchor; required
            when a layer is `"sliding_attention"`.
        sliding_window_non_causal (`bool`): sliding-window layers see their whole block (as full layers do) instead
            of causally.
        target_layer_ids (`list[int]`, *optional*): 0-based target decoder layers whose OUTPUTS are the features
            (id `l` is `output_hidden_states[l + 1]`), concatenated in this order. Defaults to DFlash's evenly
            spaced rule with one feature layer per drafter layer.
        num_target_layers (`int`): number of decoder layers of the target (to validate `target_layer_ids`).
        block_size (`int`): tokens per block `[anchor, MASK x (block_size - 1)]`; each round proposes
            `block_size - 1` tokens and carries at most `block_size - 1` rejected rows.
        mask_token_id (`int`): target token id whose embedding fills the masked block slots (ideally an unused
            token, e.g. 151669 for Qwen3).
        carryover (`bool`): default for decoding: recycle the previous round's rejected target states as one round
            of extra context. Off for a new, baseline or imported drafter; carryover training turns it on. Can be
            switched per `generate` call (`carryover=False` gives the same weights OFF).
        carryover_interface (`str`): how carried rows are told apart from committed context:
            `"embedding"` (the paper's `E_carry`: one learned vector added to the rejected features before `F`),
            `"none"` (no marker), or `"projector"` (a separate, zero-initialised linear map added to `fc` for the
            carried rows; the paper's Table 3b ablation).
        carry_gate (`bool`): attend to the carried rows through a gate (LLaMA-Adapter's zero-init attention): in
            every layer the carried rows get a softmax of their own, added to the attention over the other rows
            scaled by a learned value per head (`carry_gate`, [num_hidden_layers, num_attention_heads]) that starts
            at zero. A drafter that never saw carried rows then starts carryover training drafting exactly as
            without them, and opens to them only as far as they help. False: one softmax over all rows (the paper).
        markov_rank (`int`): 0 for a plain DFlash drafter; `r > 0` adds the DSpark-style first-order correction
            `lm_head(h_k) + W2(W1[x_{k-1}])` of rank `r` and its confidence head (trained with DSpark's objective
            and exported with the head; decoding does not use the confidence head: it proposes `block_size - 1`
            tokens, or `num_assistant_tokens`, or as many as `draft_confidence_threshold` keeps, judged on the
            corrected logits).
        draft_vocab_size (`int`, *optional*): None (the default) scores the target's whole vocabulary. `N` restricts
            the drafter to a draft vocabulary of N target tokens (FR-Spec; EAGLE-3's d2t/t2d), in practice the N most
            frequent in the training responses: the model's `draft_token_ids` buffer (saved with the weights) names
            the target LM-head rows it scores. Drafting, the training losses and the sampling distribution q live on
            that subset; q is 0 outside it, so speculative sampling stays exact. The Markov head's W2 then has N rows.
        target_model_type (`str`, *optional*): `model_type` of the target the drafter was built for (provenance).
    """

    model_type = "carryover_drafter"

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    rope_parameters: dict | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    sliding_window_non_causal: bool = False
    initializer_range: float = 0.02
    target_layer_ids: list[int] | None = None
    num_target_layers: int = 32
    block_size: int = 16
    mask_token_id: int = 0
    carryover: bool = False
    carryover_interface: str = "embedding"
    carry_gate: bool = False
    markov_rank: int = 0
    draft_vocab_size: int | None = None
    target_model_type: str | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        self.check_values()

    def check_values(self):
        """Raise a `ValueError` naming the first invalid field."""
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft slot), got {self.block_size}.")
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids has duplicates: {self.target_layer_ids}.")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}).")
        if self.carryover_interface not in CARRYOVER_INTERFACES:
            raise ValueError(f"carryover_interface must be one of {CARRYOVER_INTERFACES}, got {self.carryover_interface!r}.")
        if "rope_theta" not in self.rope_parameters:
            raise ValueError(
                f"rope_parameters {self.rope_parameters} has no rope_theta (settings per layer type, e.g. Gemma 3's, "
                "give the full-attention layers' entry, as from_target_config does)."
            )
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope_type {rope_type!r} depends on the sequence length; the drafter supports static RoPE.")
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must name one of {LAYER_TYPES} for each of the {self.num_hidden_layers} layers, got "
                f"{self.layer_types}."
            )
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError(f"Sliding-window layers need sliding_window >= 1, got {self.sliding_window}.")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in 1..vocab_size ({self.vocab_size}) or None (the full vocabulary), got "
                f"{self.draft_vocab_size}."
            )
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})."
            )

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """Refuse configs of other models (a target, a DFlash checkpoint) instead of silently building a drafter."""
        model_type = config_dict.get("model_type")
        if model_type is not None and model_type != cls.model_type:
            hint = " (a DFlash/DSpark drafter: import it with `python hub/convert.py`)" if "dflash_config" in config_dict else ""
            raise ValueError(
                f"Not a Carryover drafter checkpoint: its config has model_type={model_type!r}{hint}; expected "
                f"{cls.model_type!r}."
            )
        return super().from_dict(config_dict, **kwargs)

    @property
    def scored_vocab_size(self) -> int:
        """Logits per draft slot: `draft_vocab_size`, else the target's `vocab_size`."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_size(self) -> int:
        """Width of one concatenated target-feature row: `len(target_layer_ids) * hidden_size`."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_target_config(cls, target_config, **overrides) -> "CarryoverDrafterConfig":
        """Fill the drafter's sizes, RoPE and vocabulary from a Llama/Qwen2/Qwen3-style target config.

        `overrides` set any field (e.g. `num_hidden_layers=5, block_size=16, markov_rank=256`). A `hidden_size` or
        `vocab_size` override that disagrees with the target raises, since the drafter uses the target's embedding
        and LM head.
        """
        text = target_config.get_text_config()
        num_heads = text.num_attention_heads
        fields = {
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_attention_heads": num_heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or num_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            "hidden_act": getattr(text, "hidden_act", "silu"),
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "attention_bias": bool(getattr(text, "attention_bias", False)),
            "max_position_embeddings": text.max_position_embeddings,
            "rope_parameters": full_attention_rope(text.rope_parameters),
            "num_target_layers": text.num_hidden_layers,
            "target_model_type": text.model_type,
        }
        for key in ("hidden_size", "vocab_size"):
            if key in overrides and overrides[key] != fields[key]:
                raise ValueError(
                    f"{key}={overrides[key]} does not match the target's {key}={fields[key]}: the drafter uses the "
                    "target's embedding and LM head."
                )
        if "mask_token_id" not in overrides:
            # An unused row is best (Qwen3: 151669); without one, the pad row, else the last row of the vocabulary.
            pad = getattr(text, "pad_token_id", None)
            eos = getattr(text, "eos_token_id", None)
            eos = set(eos) if isinstance(eos, list) else {eos}
            fields["mask_token_id"] = pad if pad is not None and pad not in eos else text.vocab_size - 1
        fields.update(overrides)
        if overrides.get("target_layer_ids") is None:
            fields["target_layer_ids"] = default_target_layer_ids(
                fields["num_target_layers"], fields.get("num_hidden_layers", cls.num_hidden_layers)
            )
        return cls(**fields)

    def check_target(self, target_config) -> None:
        """Raise a `ValueError` if this drafter cannot draft for `target_config`."""
        text = target_config.get_text_config()
        problems = []
        if text.hidden_size != self.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != target's {text.hidden_size}")
        if text.vocab_size != self.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target's {text.vocab_size}")
        if text.num_hidden_layers != self.num_target_layers:
            problems.append(f"built for a {self.num_target_layers}-layer target, this one has {text.num_hidden_layers}")
        bad = [i for i in self.target_layer_ids if i >= text.num_hidden_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} do not exist in a {text.num_hidden_layers}-layer target")
        if problems:
            raise ValueError("This drafter does not fit the target: " + "; ".join(problems) + ".")


__all__ = ["CarryoverDrafterConfig", "check_target_layer_ids", "default_target_layer_ids"]
