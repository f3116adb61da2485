"""PyTorch Carryover drafter: a DFlash-style block-diffusion drafter that also reads rejected target states.

This file travels with every checkpoint (`auto_map`), so it imports only torch, transformers and its siblings by
relative import. Shapes use: S sequences, N blocks per sequence, B block size, T context rows, R carried rows,
H query heads, K key/value heads, D head dim, d hidden size, F = len(target_layer_ids) * d feature width.

One forward serves decoding (S = N = 1, committed rows in a cache) and training (all anchors of a response at once):
each block attends to the committed context rows it may see, to its own carried rejected rows, and to itself.
"""

import functools
import inspect
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from packaging import version
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import ModelOutput

from .configuration_carryover import CarryoverDrafterConfig
from .generation_carryover import OneDNNLinear
from .generation_carryover import generate as carryover_generate  # its file is saved as custom_generate/generate.py

USAGE_HINT = (
    "A CarryoverDrafterModel is not a stand-alone assistant model: it drafts from the target's hidden states, which "
    "plain assisted generation does not pass. Decode with carryover through its own generation code:\n"
    "    target.generate(**inputs, assistant_model=drafter, custom_generate=<drafter folder or Hub repo id>, "
    "trust_remote_code=True)\n"
    "or, with the package installed: `modeling_carryover.generate(target, **inputs, assistant_model=drafter)`."
)


# ----------------------------------------------------------------------------------------------------------------
# Concepts shared by decoding and training (one definition each).
# ----------------------------------------------------------------------------------------------------------------


# A list `output_hidden_states=[...]` indexes HF's full tuple (0 = the embeddings, i + 1 = decoder layer i) from
# transformers 5.23 on; 5.19-5.22 index the decoder layers directly and return no embedding entry.
_LIST_INDEXES_FULL_TUPLE = version.parse(transformers.__version__).release >= (5, 23)

# save_pretrained(push_to_hub=True, ...) arguments that belong to push_to_hub
PUSH_TO_HUB_KWARGS = ("repo_id", "commit_message", "commit_description", "private", "revision", "create_pr", "tags")


def hidden_state_request(target_layer_ids: list[int]) -> list[int]:
    """The `output_hidden_states=` value that returns the OUTPUTS of decoder layers `target_layer_ids` only."""
    offset = 1 if _LIST_INDEXES_FULL_TUPLE else 0
    return [i + offset for i in target_layer_ids]


def layer_outputs(hidden_states, target_layer_ids: list[int], num_layers: int) -> list:
    """The outputs of decoder layers `target_layer_ids` from HF `hidden_states`, however they were requested: the full
    tuple (num_layers + 1 entries, embeddings first) or a transformers 5.19-5.22 list request (num_layers entries)."""
    offset = len(hidden_states) - num_layers
    return [hidden_states[i + offset] for i in target_layer_ids]


def rejected_rows(window_features, window_position_ids, accepted_len):
    """The rows of a verified window that carry over: the rejected draft positions.

    A verification window is `[anchor, draft_1 .. draft_c]`; the anchor and the `accepted_len` accepted drafts are
    committed, the rest were rejected. Rejected rows are packed to the front of `W - 1` slots.

    window_features [..., W, F], window_position_ids [..., W], accepted_len [...] (long)
    returns features [..., W-1, F], position ids [..., W-1], valid mask [..., W-1]
    """
    width = window_features.shape[-2]
    index = accepted_len.unsqueeze(-1) + 1 + torch.arange(width - 1, device=window_features.device)
    valid = index < width
    index = index.clamp(max=width - 1)
    features = torch.gather(window_features, -2, index.unsqueeze(-1).expand(*index.shape, window_features.shape[-1]))
    position_ids = torch.gather(window_position_ids, -1, index)
    return features, position_ids, valid


def check_draft_token_ids(draft_token_ids, config) -> None:
    """Raise a `ValueError` unless `draft_token_ids` is a valid token map for `config`: `draft_vocab_size` target ids,
    strictly increasing (so unique), each in [0, vocab_size)."""
    if config.draft_vocab_size is None:
        raise ValueError(
            "This drafter scores the whole target vocabulary (draft_vocab_size=None): a token map needs a drafter "
            "built with draft_vocab_size=N."
        )
    ids = draft_token_ids
    expected = (config.draft_vocab_size,)
    if ids.dtype != torch.long or tuple(ids.shape) != expected:
        raise ValueError(f"The draft token map must be a LongTensor of shape {expected}, got {ids.dtype} {tuple(ids.shape)}.")
    if len(ids) and not (0 <= int(ids[0]) and int(ids[-1]) < config.vocab_size):
        raise ValueError(f"The draft token map has ids outside the target vocabulary [0, {config.vocab_size}).")
    if (ids[1:] <= ids[:-1]).any():
        raise ValueError("The draft token map must list unique target ids in increasing order.")


def sliding_window_visibility(context_position_ids, anchor_positions, sliding_window: int):
    """A sliding-window layer's block at anchor a sees the context rows at positions a - sliding_window .. a - 1 (and
    whatever the context mask allows of them): speculators' DFlash rule, counted from the anchor for every slot.
    context_position_ids [S, T], anchor_positions [S, N] -> [S, N, T]"""
    return context_position_ids[:, None, :] >= (anchor_positions - sliding_window)[:, :, None]


def context_positions(context_position_ids, num_cached: int, S: int, device) -> torch.LongTensor:
    """Positions of all the context rows a block sees: the cached rows first (decoding commits rows in order from
    position 0), then the new ones. context_position_ids [S, T] or None -> [S, num_cached + T]"""
    cached = torch.arange(num_cached, device=device).expand(S, -1)
    return cached if context_position_ids is None else torch.cat([cached, context_position_ids.to(device)], dim=-1)


def causal_block_visibility(B: int, J: int, device) -> torch.BoolTensor:
    """Own rows `[R carried rows ; B block slots]` each block slot sees in a causal layer: every carried row, and the
    block slots up to its own. -> [B, J]"""
    slot_of_row = torch.arange(J, device=device) - (J - B)  # carried rows get negative slots
    return slot_of_row[None, :] <= torch.arange(B, device=device)[:, None]


def softmax_or_zero(scores):
    """Softmax over the last axis; a row whose keys are all masked (-inf) gets zeros instead of NaN."""
    has_key = scores.isfinite().any(-1, keepdim=True)
    return scores.masked_fill(~has_key, 0.0).softmax(-1) * has_key


def block_attention(
    query,
    context_keys,
    context_values,
    own_keys,
    own_values,
    context_mask,
    own_mask,
    scaling,
    causal_block=False,
    carry_gate=None,
):
    """Attention of N blocks to their shared context rows and to their own rows (carried rows + block), non-causal
    unless `causal_block` (then block slot k sees its carried rows and block slots 0..k). With `carry_gate` the R =
    J - B carried rows get a softmax of their own, scaled by the gate of each head and added to the softmax over the
    other rows (see `CarryoverDrafterConfig.carry_gate`).

    query [S, N, H, B, D]; context_keys/values [S, K, T, D] (shared by the N blocks of a sequence);
    own_keys/values [S, N, K, J, D]; context_mask [S, N, T] and own_mask [S, N, J] (True = visible) or None;
    carry_gate [H] or None.
    Returns the attention output [S, N, B, H*D] and the attention weights [S, N, H, B, T+J] (the probabilities;
    with a gate, those of the other rows plus the gated ones of the carried rows).
    """
    S, N, H, B, D = query.shape
    K, T, J = context_keys.shape[1], context_keys.shape[2], own_keys.shape[3]
    q = query.view(S, N, K, H // K, B, D)  # query head h reads key/value head h // (H // K), as in HF's repeat_kv
    scores = torch.cat(
        [torch.einsum("snkgbd,sktd->snkgbt", q, context_keys), torch.einsum("snkgbd,snkjd->snkgbj", q, own_keys)], -1
    ).float() * scaling
    if context_mask is not None or own_mask is not None or causal_block:
        if context_mask is None:
            context_mask = torch.ones(S, N, T, dtype=torch.bool, device=query.device)
        if own_mask is None:
            own_mask = torch.ones(S, N, J, dtype=torch.bool, device=query.device)
        own_mask = own_mask[:, :, None, :]  # [S, N, 1, J]
        if causal_block:
            own_mask = own_mask & causal_block_visibility(B, J, query.device)  # [S, N, B, J]
        visible = torch.cat([context_mask[:, :, None, :].expand(-1, -1, own_mask.shape[2], -1), own_mask], -1)
        scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    if carry_gate is None or J == B:
        probs = scores.softmax(-1)
    else:
        carried = torch.zeros(T + J, dtype=torch.bool, device=query.device)
        carried[T : T + J - B] = True
        gate = carry_gate.float().view(K, H // K, 1, 1)
        probs = scores.masked_fill(carried, float("-inf")).softmax(-1)  # the block always sees itself
        probs = probs + gate * softmax_or_zero(scores.masked_fill(~carried, float("-inf")))
    probs = probs.to(query.dtype)
    out = torch.einsum("snkgbt,sktd->snkgbd", probs[..., :T], context_values) + torch.einsum(
        "snkgbj,snkjd->snkgbd", probs[..., T:], own_values
    )
    out = out.reshape(S, N, H, B, D).transpose(2, 3).reshape(S, N, B, H * D)
    return out, probs.view(S, N, H, B, T + J)


def flex_block_mask(context_mask, own_mask, causal_block, S, N, B, T, J, device, rows="all"):
    """The FlexAttention BlockMask of the same visibility rule as `block_attention`, over the flattened layout:
    queries are the N blocks' slots `[N*B]`, keys are `[T shared context rows ; N blocks' own rows (N*J)]`, and a
    block's query sees a context row where `context_mask` allows it and its OWN rows only (where `own_mask` allows;
    with `causal_block`, its block's slots up to its own). context_mask [S, N, T], own_mask [S, N, J] or None.
    `rows`: "all", or for the gated attention's two softmaxes "uncarried" (all but the R = J - B carried rows) and
    "carried" (those only)."""
    if context_mask is None:
        context_mask = torch.ones(S, N, T, dtype=torch.bool, device=device)
    if own_mask is None:
        own_mask = torch.ones(S, N, J, dtype=torch.bool, device=device)
    context_mask = torch.cat([context_mask, context_mask.new_zeros(S, N, 1)], -1)  # a safe index when T = 0

    def visible(s, h, q, kv):
        n, own = q // B, kv - T
        sees_context = context_mask[s, n, kv.clamp(max=T)] & (kv < T)
        sees_own = own_mask[s, n, own % J] & (own >= 0) & (own // J == n)
        if causal_block:
            sees_own = sees_own & (own % J - (J - B) <= q % B)
        if rows == "carried":
            return sees_own & (own % J < J - B)
        if rows == "uncarried":
            sees_own = sees_own & (own % J >= J - B)
        return sees_context | sees_own

    return create_block_mask(visible, S, None, N * B, T + N * J, device=device)


@functools.cache
def compiled_flex_attention():
    return torch.compile(flex_attention)  # compiled once per process


def flex_block_attention(
    query, context_keys, context_values, own_keys, own_values, block_mask, scaling, carry_gate=None, carried_block_mask=None
):
    """`block_attention` through FlexAttention (no [.., B, T] score tensor is kept for backward): the same inputs,
    flattened to one query sequence of N*B slots per sequence and one key sequence `[T ; N*J]`, with `block_mask`
    from `flex_block_mask`. With `carry_gate` [H], `block_mask` excludes the carried rows and `carried_block_mask` sees
    only them (FlexAttention gives a query that sees no row zeros). Returns the attention output [S, N, B, H*D] (no
    probabilities)."""
    # on CPU eager, a slow reference: torch 2.13's CPU kernel template fails to build this mask
    attend = flex_attention if query.device.type == "cpu" else compiled_flex_attention()
    S, N, H, B, D = query.shape
    K, J = own_keys.shape[2], own_keys.shape[3]
    dtype = own_values.dtype  # under autocast the projections' dtype (the q/k norms promote to float32)
    q = query.transpose(1, 2).reshape(S, H, N * B, D).to(dtype)
    keys = torch.cat([context_keys, own_keys.transpose(1, 2).reshape(S, K, N * J, D)], 2).to(dtype)
    values = torch.cat([context_values, own_values.transpose(1, 2).reshape(S, K, N * J, D)], 2).to(dtype)
    out = attend(q, keys, values, block_mask=block_mask, scale=scaling, enable_gqa=H != K)
    if carry_gate is not None:
        carried_out = attend(q, keys, values, block_mask=carried_block_mask, scale=scaling, enable_gqa=H != K)
        out = out + carry_gate.to(out.dtype).view(1, H, 1, 1) * carried_out
    return out.view(S, H, N, B, D).permute(0, 2, 3, 1, 4).reshape(S, N, B, H * D)


# ----------------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------------


class CarryoverRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class CarryoverRotaryEmbedding(nn.Module):
    """RoPE with the target's settings, at absolute positions; `partial_rotary_factor` rotates a prefix of each head."""

    def __init__(self, config: CarryoverDrafterConfig):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        init_fn = self.compute_default_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, **kwargs):
        rope = config.rope_parameters
        rotary_dim = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        return inv_freq, 1.0

    @torch.no_grad()
    def forward(self, position_ids):
        """position_ids [...] -> cos, sin [..., rotary_dim] (float32)."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    """x [..., heads, T, D]; cos/sin [..., T, rotary_dim] without the heads axis. Rotates the first rotary_dim dims."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = (x_rot.float() * cos + rotate_half(x_rot.float()) * sin).to(x.dtype)
    return torch.cat((x_rot, x_pass), dim=-1)


class CarryoverMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class CarryoverAttention(nn.Module):
    """Queries from the block only; keys/values from [context rows ; carried rows ; block] with this layer's own
    k/v projections (the paper's Phi_l), per-head RMSNorm on q and k (Qwen3-style), RoPE at absolute positions."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.scaling = self.head_dim**-0.5
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = CarryoverRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = CarryoverRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, rows, rope):
        """rows [..., T, d] -> keys, values [..., K, T, D] with RoPE applied to the keys."""
        shape = (*rows.shape[:-1], self.num_kv_heads, self.head_dim)
        keys = self.k_norm(self.k_proj(rows).view(shape)).transpose(-3, -2)
        values = self.v_proj(rows).view(shape).transpose(-3, -2)
        return apply_rotary(keys, *rope), values

    def forward(self, hidden_states, context, carried, ropes, masks, past_key_values, carry_gate=None):
        """masks: the `AttentionMasks` of each layer type; this layer reads its own. carry_gate: this layer's [H], or
        None (no gate, or no carried rows to gate)."""
        masks = masks[self.layer_type]
        S, N, B, _ = hidden_states.shape
        query = self.q_norm(self.q_proj(hidden_states).view(S, N, B, self.num_heads, self.head_dim)).transpose(2, 3)
        query = apply_rotary(query, *ropes["block"])  # [S, N, H, B, D]
        block_keys, block_values = self.keys_values(hidden_states, ropes["block"])  # [S, N, K, B, D]

        if context is not None:
            context_keys, context_values = self.keys_values(context, ropes["context"])  # [S, K, T, D]
        else:
            context_keys = context_values = block_keys.new_zeros(S, self.num_kv_heads, 0, self.head_dim)
        if past_key_values is not None:  # committed rows only: carried rows and the block are never cached
            context_keys, context_values = past_key_values.update(context_keys, context_values, self.layer_idx)

        if carried is not None:
            carried_keys, carried_values = self.keys_values(carried, ropes["carried"])  # [S, N, K, R, D]
            block_keys = torch.cat([carried_keys, block_keys], dim=3)
            block_values = torch.cat([carried_values, block_values], dim=3)

        if masks.flex is not None:
            out = flex_block_attention(
                query, context_keys, context_values, block_keys, block_values, masks.flex, self.scaling, carry_gate,
                masks.flex_carried,
            )
            probs = None
        else:
            out, probs = block_attention(
                query, context_keys, context_values, block_keys, block_values, masks.context, masks.own, self.scaling,
                masks.causal_block, carry_gate,
            )
        return self.o_proj(out), probs


class CarryoverDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = CarryoverAttention(config, layer_idx)
        self.mlp = CarryoverMLP(config)
        self.input_layernorm = CarryoverRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = CarryoverRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, carried, ropes, masks, past_key_values, carry_gate=None):
        attn_out, probs = self.self_attn(
            self.input_layernorm(hidden_states), context, carried, ropes, masks, past_key_values, carry_gate
        )
        hidden_states = hidden_states + attn_out
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, probs


@dataclass
class AttentionMasks:
    """Who sees whom, shared by all layers of one type in one forward: the dense masks, or their FlexAttention
    BlockMask."""

    context: torch.BoolTensor | None  # [S, N, T_all]
    own: torch.BoolTensor | None  # [S, N, R + B]
    causal_block: bool = False  # block slot k sees block slots 0..k only (sliding-window layers, by default)
    flex: object | None = None  # BlockMask, when the model runs with attn_implementation="flex_attention"
    flex_carried: object | None = None  # with a carry gate: the BlockMask of the carried rows (`flex` then excludes them)


@dataclass
class CarryoverDrafterOutput(ModelOutput):
    """
    last_hidden_state (`[S, N, B, d]`): final-normed hidden states of the blocks (apply the target's LM head).
    attentions (`tuple` of `[S, N, H, B, T+R+B]`, *optional*): per-layer attention probabilities over
        [context rows ; carried rows ; block], when `output_attentions=True` (with a carry gate, the carried rows'
        probabilities scaled by the gate).
    """

    last_hidden_state: torch.FloatTensor | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


class CarryoverPreTrainedModel(PreTrainedModel):
    config_class = CarryoverDrafterConfig
    config: CarryoverDrafterConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _supports_flex_attn = True  # attn_implementation="flex_attention" (training on GPUs); default: the dense path
    _no_split_modules = ["CarryoverDecoderLayer"]

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True  # the attention reads config._attn_implementation on every forward (transformers' check is textual)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, CarryoverDrafterModel):
            if module.carry_embedding is not None:
                init.zeros_(module.carry_embedding)
            if module.carry_proj is not None:  # zero: the projector starts as "no marker"
                init.zeros_(module.carry_proj.weight)
            if module.markov_proj is not None:  # zero: the Markov drafter starts as plain DFlash
                init.zeros_(module.markov_proj.weight)
            if module.carry_gate is not None:  # zero: the carried rows change nothing at the start
                init.zeros_(module.carry_gate)


class CarryoverDrafterModel(CarryoverPreTrainedModel):
    """The Carryover drafter (see [`CarryoverDrafterConfig`]). Uses the target's embedding and LM head, which are
    not part of this model or its checkpoint."""

    def __init__(self, config: CarryoverDrafterConfig):
        config.check_values()  # again: from_pretrained(..., block_size=...) overrides fields after the config's init
        super().__init__(config)
        d, feature_size = config.hidden_size, config.feature_size
        self.fc = nn.Linear(feature_size, d, bias=False)
        self.hidden_norm = CarryoverRMSNorm(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(CarryoverDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = CarryoverRMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = CarryoverRotaryEmbedding(config)

        # E_carry: the one learned vector that marks rejected rows, added before F (Algorithm 1).
        self.carry_embedding = nn.Parameter(torch.zeros(feature_size)) if config.carryover_interface == "embedding" else None
        self.carry_proj = nn.Linear(feature_size, d, bias=False) if config.carryover_interface == "projector" else None
        # The gates of the carried rows' attention, one per layer and query head (config.carry_gate).
        gate_shape = (config.num_hidden_layers, config.num_attention_heads)
        self.carry_gate = nn.Parameter(torch.zeros(gate_shape)) if config.carry_gate else None

        # The draft vocabulary: the target ids of the LM-head rows the drafter scores (EAGLE-3's d2t as ids, sorted);
        # a buffer, so it is saved with the weights. A placeholder until `set_draft_vocab` (training) or loading.
        draft_token_ids = torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None
        self.register_buffer("draft_token_ids", draft_token_ids)
        self._draft_head = None  # (key, rows): the frozen LM head's draft-vocabulary rows, see `draft_logits`
        self._onednn_draft_head = None  # (rows, OneDNNLinear of them), see `draft_logits`

        rank = config.markov_rank
        self.markov_embed = nn.Embedding(config.vocab_size, rank) if rank else None  # W1: any previous target token
        self.markov_proj = nn.Linear(rank, config.scored_vocab_size, bias=False) if rank else None  # W2: scored tokens
        self.confidence_head = nn.Linear(d + rank, 1) if rank else None

        self.generation_stats = None  # filled by every carryover `generate` call
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, but a checkpoint with missing or unexpected drafter weights raises
        instead of leaving them randomly initialised."""
        return_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        problems = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
        if problems:
            raise ValueError(f"Corrupt or foreign drafter checkpoint {args[0] if args else ''!s}: {problems}")
        if model.draft_token_ids is not None:
            check_draft_token_ids(model.draft_token_ids, model.config)
        return (model, info) if return_info else model

    def __getattr__(self, name):
        if name == "generation_config":  # reached only by plain assisted generation: say what to do instead
            raise AttributeError(USAGE_HINT)
        return super().__getattr__(name)

    # -- the target interface ----------------------------------------------------------------------------------

    def get_input_embeddings(self):
        return None  # the target's embedding, which is not part of the drafter (FSDP asks)

    def get_output_embeddings(self):
        return None  # the target's LM head, likewise

    @property
    def feature_hidden_state_indices(self) -> list[int]:
        """What to pass as the target's `output_hidden_states=` to get the feature layers."""
        return hidden_state_request(self.config.target_layer_ids)

    def target_features(self, hidden_states) -> torch.Tensor:
        """Concatenate the target's feature layers from HF `hidden_states` (tuple of [S, T, d]) -> [S, T, F]."""
        config = self.config
        return torch.cat(layer_outputs(hidden_states, config.target_layer_ids, config.num_target_layers), dim=-1)

    def check_target(self, target_config) -> None:
        self.config.check_target(target_config)

    def block_inputs(self, anchor_ids, anchor_position_ids):
        """Blocks `[anchor, MASK x (B-1)]` at positions `anchor .. anchor + B - 1`.

        anchor_ids, anchor_position_ids [...] -> block ids, block position ids [..., B]
        """
        offsets = torch.arange(self.config.block_size, device=anchor_ids.device)
        block_ids = torch.full((*anchor_ids.shape, self.config.block_size), self.config.mask_token_id, device=anchor_ids.device)
        block_ids[..., 0] = anchor_ids
        return block_ids, anchor_position_ids.unsqueeze(-1) + offsets

    rejected_rows = staticmethod(rejected_rows)

    # -- the drafter -------------------------------------------------------------------------------------------

    def fuse(self, features, carried: bool = False):
        """F(H) = hidden_norm(fc(H)); carried (rejected) rows get their marker first. features [..., F] -> [..., d]."""
        features = features.to(self.fc.weight.dtype)
        if carried and self.carry_embedding is not None:
            features = features + self.carry_embedding
        fused = self.fc(features)
        if carried and self.carry_proj is not None:
            fused = fused + self.carry_proj(features)
        return self.hidden_norm(fused)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_position_ids: torch.LongTensor,
        context_features: torch.Tensor | None = None,
        context_position_ids: torch.LongTensor | None = None,
        context_mask: torch.BoolTensor | None = None,
        carried_features: torch.Tensor | None = None,
        carried_position_ids: torch.LongTensor | None = None,
        carried_mask: torch.BoolTensor | None = None,
        past_key_values=None,
        output_attentions: bool = False,
    ) -> CarryoverDrafterOutput:
        r"""
        block_embeds (`[S, N, B, d]`): target embeddings of the blocks `[anchor, MASK x (B-1)]`.
        block_position_ids (`[S, N, B]`): absolute positions of the block slots.
        context_features (`[S, T, F]`, *optional*): concatenated target features of committed rows. With a cache,
            only the rows not yet cached; they are appended to it.
        context_position_ids (`[S, T]`): their absolute positions.
        context_mask (`[S, N, T_all]`, *optional*): which context rows (cached + new) each block sees; None = all.
            Training passes `context_position_ids < anchor` (the anchor's own feature is not available at inference).
            Sliding-window layers further hide the rows before `anchor - sliding_window` (`sliding_window_visibility`).
        carried_features (`[S, N, R, F]`, *optional*): target features of rejected draft rows, read-only context for
            this proposal only; never cached.
        carried_position_ids (`[S, N, R]`): absolute positions at which they were computed.
        carried_mask (`[S, N, R]`, *optional*): which carried rows are real (the rest is padding).
        past_key_values (`transformers.DynamicCache`, *optional*): committed context keys/values per layer.
        output_attentions (`bool`): also return each layer's attention probabilities (always computed by the dense
            path, whatever `attn_implementation` is).
        """
        S, N, B, _ = block_embeds.shape
        hidden_states = block_embeds.to(self.fc.weight.dtype)
        ropes = {"block": self.rotary_emb(block_position_ids)}
        context = carried = None
        if context_features is not None:
            context = self.fuse(context_features)
            ropes["context"] = self.rotary_emb(context_position_ids)
        if carried_features is not None:
            carried = self.fuse(carried_features, carried=True)
            ropes["carried"] = self.rotary_emb(carried_position_ids)
        own_mask = None
        if carried_mask is not None:
            own_mask = torch.cat([carried_mask, carried_mask.new_ones(S, N, B)], dim=-1)
        num_cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        gates = self.carry_gate if carried is not None else None  # [layers, H]: only carried rows are gated
        masks = {}  # the AttentionMasks of each layer type this drafter has
        if "full_attention" in self.config.layer_types:
            masks["full_attention"] = AttentionMasks(context_mask, own_mask)
        if "sliding_attention" in self.config.layer_types:
            positions = context_positions(context_position_ids, num_cached, S, block_embeds.device)  # [S, T_all]
            window = sliding_window_visibility(positions, block_position_ids[..., 0], self.config.sliding_window)
            masks["sliding_attention"] = AttentionMasks(
                window if context_mask is None else window & context_mask,
                own_mask,
                causal_block=not self.config.sliding_window_non_causal,
            )
        if self.config._attn_implementation == "flex_attention" and not output_attentions:
            T = num_cached + (0 if context is None else context.shape[-2])
            J = B + (0 if carried is None else carried.shape[-2])
            for type_masks in masks.values():
                visibility = (type_masks.context, type_masks.own, type_masks.causal_block, S, N, B, T, J, block_embeds.device)
                type_masks.flex = flex_block_mask(*visibility, rows="all" if gates is None else "uncarried")
                if gates is not None:
                    type_masks.flex_carried = flex_block_mask(*visibility, rows="carried")

        attentions = ()
        for i, layer in enumerate(self.layers):
            carry_gate = None if gates is None else gates[i]
            hidden_states, probs = layer(hidden_states, context, carried, ropes, masks, past_key_values, carry_gate)
            if output_attentions:
                attentions += (probs,)
        return CarryoverDrafterOutput(
            last_hidden_state=self.norm(hidden_states), attentions=attentions if output_attentions else None
        )

    # -- the draft vocabulary (one definition for training and decoding) ---------------------------------------

    def set_draft_vocab(self, token_ids) -> None:
        """Use the target tokens `token_ids` (unique, increasing) as the draft vocabulary."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        check_draft_token_ids(ids, self.config)
        self.draft_token_ids.copy_(ids)

    def draft_logits(self, lm_head, hidden):
        """The target's LM head on the drafter's hidden states, restricted to the rows of the draft vocabulary (all
        rows without one). hidden [..., d] -> float32 logits [..., scored_vocab_size]"""
        weight = lm_head.weight
        # contiguous: a strided input (e.g. a block's slots after its anchor) is not folded into one matmul, and
        # `linear` then broadcasts the weight over every block ([S*N, d, V] batched: several times the time)
        hidden = hidden.to(weight.device, weight.dtype).contiguous()
        if self.draft_token_ids is None:
            return lm_head(hidden).float()
        rows = self.draft_token_ids.to(weight.device)
        head_weight = self.draft_head_weight(weight, rows)
        if getattr(lm_head, "bias", None) is not None:
            return nn.functional.linear(hidden, head_weight, lm_head.bias[rows]).float()
        if isinstance(lm_head, OneDNNLinear):  # the target's head runs in oneDNN: so do its rows here, packed once
            if self._onednn_draft_head is None or self._onednn_draft_head[0] is not head_weight:
                self._onednn_draft_head = (head_weight, OneDNNLinear(head_weight))  # a tuple: not a submodule
            return self._onednn_draft_head[1](hidden).float()
        return nn.functional.linear(hidden, head_weight).float()

    def draft_head_weight(self, weight, rows):
        """`weight[rows]`, kept while the (frozen) LM head and the token map are unchanged: gathering N rows costs as
        much as the drafting round's matmul itself. A head that trains is gathered on every call; rows gathered under
        inference mode are not reused outside it (autograd cannot save them)."""
        if weight.requires_grad:
            return weight[rows]
        key = (weight.data_ptr(), weight._version, weight.shape, weight.device, weight.dtype, self.draft_token_ids._version)
        key += (torch.is_inference_mode_enabled(),)
        if self._draft_head is None or self._draft_head[0] != key:
            self._draft_head = (key, weight[rows])
        return self._draft_head[1]

    def to_target_ids(self, draft_ids):
        """Draft-vocabulary indices -> target token ids. [...] -> [...]"""
        return draft_ids if self.draft_token_ids is None else self.draft_token_ids.to(draft_ids.device)[draft_ids]

    def to_draft_ids(self, token_ids):
        """Target token ids -> draft-vocabulary indices, -1 for tokens outside it. [...] -> [...]"""
        if self.draft_token_ids is None:
            return token_ids
        ids = self.draft_token_ids.to(token_ids.device)
        index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        index[ids] = torch.arange(len(ids), device=token_ids.device)
        return index[token_ids]

    def full_vocab_logits(self, logits):
        """Scored logits -> logits over the target's vocabulary, -inf outside the draft vocabulary (q = 0 there, which
        keeps speculative sampling exact). [..., scored_vocab_size] -> [..., vocab_size]"""
        if self.draft_token_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.draft_token_ids.to(logits.device), logits)

    # -- Markov head (DSpark-style first-order correction) ------------------------------------------------------

    def markov_correction(self, prev_token_ids):
        """W2(W1[x_{k-1}]): logit correction of the scored tokens for a slot whose previous (target) token is x_{k-1}.
        [...] -> [..., scored_vocab_size]"""
        return self.markov_proj(self.markov_embed(prev_token_ids.to(self.markov_embed.weight.device)))

    def draft_tokens(self, slot_logits, anchor_ids, temperature=0.0, return_logits=False):
        """Target-token drafts from the scored slot logits [..., c, scored_vocab_size] (`draft_logits`; slot k proposes
        the token at anchor + k): the argmax over the draft vocabulary at temperature 0 (greedy decoding's rule), else a
        sample from softmax(logits / temperature) (carryover training at T > 0: the branches sampled decoding
        proposes), mapped to target ids; left to right for the Markov head, which corrects each slot with the previous
        choice (the anchor for the first). -> [..., c] (and the corrected scored logits the drafts were chosen from,
        with `return_logits=True`)."""

        def choose(logits):  # [..., scored vocab] -> [...] draft-vocabulary indices
            if temperature == 0:
                return logits.argmax(-1)
            probs = (logits.float() / temperature).softmax(-1)
            return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(probs.shape[:-1])

        if self.config.markov_rank:
            previous, corrected, chosen = anchor_ids, [], []
            for logits in slot_logits.unbind(-2):
                corrected.append(logits + self.markov_correction(previous).to(logits.device, logits.dtype))
                chosen.append(choose(corrected[-1]))
                previous = self.to_target_ids(chosen[-1])
            slot_logits, choices = torch.stack(corrected, dim=-2), torch.stack(chosen, dim=-1)
        else:
            choices = choose(slot_logits)
        drafts = self.to_target_ids(choices)
        return (drafts, slot_logits) if return_logits else drafts

    def confidence(self, hidden_states, prev_token_ids):
        """P(slot k survives | slots before it did) = sigmoid(Linear([h_k ; W1[x_{k-1}]])). -> [...]"""
        features = torch.cat([hidden_states, self.markov_embed(prev_token_ids).to(hidden_states.dtype)], dim=-1)
        return torch.sigmoid(self.confidence_head(features).squeeze(-1))

    # -- decoding and checkpoints -------------------------------------------------------------------------------

    def save_pretrained(self, save_directory, *args, push_to_hub=False, **kwargs):
        """Save weights, config (with `auto_map`), the model code and `custom_generate/generate.py`, so that the
        folder (or a Hub repo with the same files) decodes with `custom_generate=<folder>` on its own."""
        # transformers uploads from inside its save_pretrained, before custom_generate/ exists here: push afterwards
        hub_kwargs = {key: kwargs.pop(key) for key in PUSH_TO_HUB_KWARGS if key in kwargs}
        repo_id = hub_kwargs.pop("repo_id", Path(save_directory).name)
        # FSDP2 swaps the instance's class for a subclass defined in torch: save as the class defined here, so that
        # the folder gets this code and an auto_map that names it
        sharded_class = type(self)
        self.__class__ = next(c for c in sharded_class.__mro__ if c.__module__ == CarryoverDrafterModel.__module__)
        try:
            super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.__class__ = sharded_class
        custom_generate = Path(save_directory) / "custom_generate"
        custom_generate.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(inspect.getsourcefile(carryover_generate), custom_generate / "generate.py")
        if push_to_hub:
            self.push_to_hub(repo_id, token=kwargs.get("token"), **hub_kwargs)


CarryoverDrafterConfig.register_for_auto_class()
CarryoverDrafterModel.register_for_auto_class("AutoModel")

__all__ = [
    "CarryoverDrafterModel",
    "CarryoverDrafterOutput",
    "CarryoverPreTrainedModel",
    "check_draft_token_ids",
    "hidden_state_request",
    "layer_outputs",
    "rejected_rows",
]
