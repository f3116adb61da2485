"""Parallel greedy verification of many proposals on one recorded response (Algorithm 2, steps 2-3).

One target forward over the recorded sequence gives the committed features and a K/V cache. Every branch
`[token[a], draft_1 .. draft_c]` at positions `a .. a + c` is then verified in one packed forward that reads the
cached recorded prefix `< a` and its own predecessors only (a block-diagonal causal mask), chunked over anchors
(each chunk's branch K/V is cropped from the cache afterwards). This is the same computation the target does when
`generate` verifies the proposal `draft` after the prefix `token[: a + 1]`.

The packed mask reaches the target's attention kernels as given (transformers passes a 4D mask through), so it is
built here for each attention type: additive (0 visible, the dtype's minimum hidden), because only SDPA reads a bool
mask as visibility (eager and flex add it to the scores), and with the window of sliding-attention layers.
"""

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class TargetPass:
    """hidden_states: HF tuple (None where not requested); cache: K/V of the recorded sequence."""

    hidden_states: tuple
    cache: object


@dataclass
class BranchVerification:
    """hidden_states: HF tuple of [S, N, c+1, d] (requested layers only); greedy_tokens [S, N, c+1]: the target's
    argmax after each branch position; accepted_len [S, N]: drafts accepted by greedy verification."""

    hidden_states: tuple
    greedy_tokens: torch.LongTensor
    accepted_len: torch.LongTensor


MASKED_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")


def attention_layer_types(config) -> list[str]:
    """The target's attention type per decoder layer: `config.layer_types`, or Mistral-style one `sliding_window`."""
    text_config = config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        sliding = getattr(text_config, "sliding_window", None) is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"] * text_config.num_hidden_layers
    return list(layer_types)


def check_verification_support(target) -> None:
    """Carryover training verifies with a packed custom mask: refuse, before training starts, a target whose attention
    kernel ignores a 4D mask (flash attention) or whose layers attend in a way the mask does not model."""
    implementation = target.config._attn_implementation
    if implementation not in MASKED_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"Carryover training verifies all proposals in one forward with a custom 4D attention mask, which "
            f"attn_implementation={implementation!r} does not take. Load the target with one of "
            f"{MASKED_ATTENTION_IMPLEMENTATIONS}."
        )
    unsupported = sorted(set(attention_layer_types(target.config)) - {"full_attention", "sliding_attention"})
    if unsupported:
        raise ValueError(f"Carryover training supports full and sliding-window attention layers, not {unsupported}.")


@torch.no_grad()
def target_pass(target, input_ids, attention_mask, hidden_state_indices, use_cache=False) -> TargetPass:
    """Forward the recorded sequences [S, T] (right-padded) through the frozen target. The cache keeps every position
    (also in sliding-window layers, whose window the verification mask applies): branches anchor anywhere."""
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=hidden_state_indices,
        past_key_values=DynamicCache() if use_cache else None,
        use_cache=use_cache,
        logits_to_keep=1,  # logits are not needed here
    )
    return TargetPass(hidden_states=out.hidden_states, cache=out.past_key_values if use_cache else None)


def branch_visibility(anchor_positions, branch_len, prefix_len, sliding_window=None):
    """Bool [S, N*W, T + N*W]: branch token (i, k) sees prefix rows < a_i and branch tokens (i, <= k); with a sliding
    window, only keys at positions > its own position - window (transformers' sliding-window rule)."""
    S, N = anchor_positions.shape
    device = anchor_positions.device
    offsets = torch.arange(branch_len, device=device)
    query_positions = (anchor_positions[:, :, None] + offsets).reshape(S, N * branch_len)
    prefix_positions = torch.arange(prefix_len, device=device)
    sees_prefix = prefix_positions[None, None, :] < anchor_positions.repeat_interleave(branch_len, dim=1)[:, :, None]
    causal = torch.tril(torch.ones(branch_len, branch_len, dtype=torch.bool, device=device))
    own = torch.block_diag(*[causal] * N).expand(S, -1, -1)  # [S, N*W, N*W]
    visible = torch.cat([sees_prefix, own], dim=-1)
    if sliding_window is not None:
        key_positions = torch.cat([prefix_positions.expand(S, -1), query_positions], dim=-1)  # [S, T + N*W]
        visible &= key_positions[:, None, :] > query_positions[:, :, None] - sliding_window
    return visible


def branch_attention_mask(target, anchor_positions, branch_len, prefix_len):
    """The verification forward's `attention_mask`: additive [S, 1, N*W, T + N*W] in the target's dtype, or one per
    attention type ({"full_attention": ..., "sliding_attention": ...}) for a target that mixes them."""
    dtype = target.dtype
    text_config = target.config.get_text_config(decoder=True)

    def additive(layer_type):
        window = getattr(text_config, "sliding_window", None) if layer_type == "sliding_attention" else None
        visible = branch_visibility(anchor_positions, branch_len, prefix_len, window)[:, None]
        return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)

    layer_types = set(attention_layer_types(target.config))
    if len(layer_types) == 1:
        return additive(layer_types.pop())
    return {layer_type: additive(layer_type) for layer_type in layer_types}


@torch.no_grad()
def verify_branches(target, recorded: TargetPass, input_ids, anchor_positions, drafts, hidden_state_indices, chunk_size=64):
    """Greedy-verify `drafts` [S, N, c] proposed after the anchors `anchor_positions` [S, N] of `input_ids` [S, T].

    `recorded` must come from `target_pass(..., use_cache=True)` over the same `input_ids`.
    """
    S, N, c = drafts.shape
    T = input_ids.shape[1]
    anchor_tokens = torch.gather(input_ids, 1, anchor_positions)
    branch_ids = torch.cat([anchor_tokens.unsqueeze(-1), drafts], dim=-1)  # [S, N, W]
    branch_positions = anchor_positions.unsqueeze(-1) + torch.arange(c + 1, device=input_ids.device)

    hidden_chunks, token_chunks = [], []
    for start in range(0, N, chunk_size):
        ids = branch_ids[:, start : start + chunk_size]
        n = ids.shape[1]
        mask = branch_attention_mask(target, anchor_positions[:, start : start + chunk_size], c + 1, T)
        out = target(
            input_ids=ids.reshape(S, n * (c + 1)),
            position_ids=branch_positions[:, start : start + chunk_size].reshape(S, n * (c + 1)),
            attention_mask=mask,
            past_key_values=recorded.cache,
            output_hidden_states=hidden_state_indices,
            use_cache=True,
        )
        recorded.cache.crop(-n * (c + 1))  # drop this chunk's branch K/V: the next chunk must not see it
        hidden_chunks.append([None if h is None else h.view(S, n, c + 1, -1) for h in out.hidden_states])
        token_chunks.append(out.logits.argmax(-1).view(S, n, c + 1))

    hidden_states = tuple(
        None if chunk_layers[0] is None else torch.cat(list(chunk_layers), dim=1) for chunk_layers in zip(*hidden_chunks)
    )
    greedy_tokens = torch.cat(token_chunks, dim=1)
    # draft k is accepted while every draft before it was and it equals the target's argmax at the previous slot
    accepted_len = leading_matches(drafts == greedy_tokens[..., :-1])
    return BranchVerification(hidden_states=hidden_states, greedy_tokens=greedy_tokens, accepted_len=accepted_len)


def leading_matches(matches):
    """Greedy acceptance: how many leading slots match. [..., c] bool -> [...] long"""
    return matches.long().cumprod(dim=-1).sum(dim=-1)
