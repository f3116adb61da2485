"""Parallel greedy verification of many proposals on one recorded response (Algorithm 2, steps 2-3).

One target forward over the recorded sequence gives the committed features and a K/V cache. Every branch
`[token[a], draft_1 .. draft_c]` at positions `a .. a + c` is then verified in one packed forward that reads the
cached recorded prefix `< a` and its own predecessors only (a block-diagonal causal mask), chunked over anchors
(each chunk's branch K/V is cropped from the cache afterwards). This is the same computation the target does when
`generate` verifies the proposal `draft` after the prefix `token[: a + 1]`.
"""

from dataclasses import dataclass

import torch


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


@torch.no_grad()
def target_pass(target, input_ids, attention_mask, hidden_state_indices, use_cache=False) -> TargetPass:
    """Forward the recorded sequences [S, T] (right-padded) through the frozen target."""
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=hidden_state_indices,
        use_cache=use_cache,
        logits_to_keep=1,  # logits are not needed here
    )
    return TargetPass(hidden_states=out.hidden_states, cache=out.past_key_values if use_cache else None)


def branch_attention_mask(anchor_positions, branch_len, prefix_len):
    """Bool mask [S, 1, N*W, T + N*W]: branch token (i, k) sees prefix rows < a_i and branch tokens (i, <= k)."""
    S, N = anchor_positions.shape
    device = anchor_positions.device
    sees_prefix = torch.arange(prefix_len, device=device)[None, None, None, :] < anchor_positions[:, :, None, None]
    sees_prefix = sees_prefix.expand(S, N, branch_len, prefix_len).reshape(S, N * branch_len, prefix_len)
    causal = torch.tril(torch.ones(branch_len, branch_len, dtype=torch.bool, device=device))
    own = torch.block_diag(*[causal] * N)  # [N*W, N*W]
    return torch.cat([sees_prefix, own.expand(S, -1, -1)], dim=-1)[:, None]


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
        mask = branch_attention_mask(anchor_positions[:, start : start + chunk_size], c + 1, T)
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
    matches = drafts == greedy_tokens[..., :-1]
    accepted_len = matches.long().cumprod(dim=-1).sum(dim=-1)
    return BranchVerification(hidden_states=hidden_states, greedy_tokens=greedy_tokens, accepted_len=accepted_len)
