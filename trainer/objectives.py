"""Training objectives: anchors, labels, the baseline losses and the parallel draft-verify-draft transition.

Shapes: S responses, T tokens, N anchors per response, B block size, c = B - 1 draft slots, F feature width, V vocab.
Everything the drafter sees (features, blocks, positions, carried rows) is built with the drafter's own methods, the
ones decoding uses, so that training and decoding agree (the parity tests in tests/test_training.py).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from modeling_carryover.modeling_carryover import hidden_state_request, layer_outputs

from .verification import leading_matches, target_pass, verify_branches


def default_gamma(block_size: int) -> float:
    """Decay of the position weights: DFlash uses 7 for B = 16 and 4 for B = 8 (5 in between)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size > 8 else 4.0


def position_weights(num_slots: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k - 1) / gamma) for draft slots k = 1 .. c: early slots matter most, since a rejection stops the
    acceptance of everything after it. -> [c]"""
    return torch.exp(-torch.arange(num_slots, device=device, dtype=torch.float) / gamma)


def anchor_eligible(loss_mask):
    """Where a block can be anchored: positions a where loss_mask[a] and loss_mask[a + 1] hold (the anchor is a
    response token and slot 1 has a label). loss_mask [..., T] -> [..., T] bool."""
    mask = loss_mask.bool()
    eligible = torch.zeros_like(mask)
    eligible[..., :-1] = mask[..., :-1] & mask[..., 1:]
    return eligible


def sample_anchors(loss_mask, num_anchors: int):
    """Random anchors per response, sorted, among the `anchor_eligible` positions. Fewer when the response is short.

    loss_mask [S, T] -> anchor_positions [S, N], anchor_valid [S, N] (padding anchors sit at position 0)
    """
    S, T = loss_mask.shape
    eligible = anchor_eligible(loss_mask)
    counts = eligible.sum(-1)
    N = int(min(num_anchors, counts.max().item())) if counts.numel() else 0
    if N == 0:
        raise ValueError("No response has two consecutive loss-mask tokens: nothing to anchor a block on.")
    # random keys for eligible positions, +inf elsewhere: the N smallest are a uniform sample without replacement
    keys = torch.rand(S, T, device=loss_mask.device).masked_fill(~eligible, float("inf"))
    picked = keys.topk(N, dim=-1, largest=False).indices  # [S, N]
    anchor_valid = torch.gather(eligible, 1, picked)
    anchor_positions = torch.where(anchor_valid, picked, torch.zeros_like(picked))
    order = torch.where(anchor_valid, anchor_positions, torch.full_like(anchor_positions, T)).argsort(-1)
    return torch.gather(anchor_positions, 1, order), torch.gather(anchor_valid, 1, order)


def block_labels(input_ids, loss_mask, anchor_positions, anchor_valid, num_slots: int):
    """Slot k of the block at anchor a predicts token[a + k] (k = 1 .. c); a label counts where it and every label
    before it lie inside the sequence and the loss mask (a draft never continues across a gap in the mask, such as a
    user turn). -> labels [S, N, c], label_valid [S, N, c]"""
    T = input_ids.shape[1]
    index = anchor_positions.unsqueeze(-1) + torch.arange(1, num_slots + 1, device=input_ids.device)  # [S, N, c]
    inside = index < T
    index = index.clamp(max=T - 1)
    labels = torch.gather(input_ids, 1, index.flatten(1)).view_as(index)
    in_mask = torch.gather(loss_mask.bool(), 1, index.flatten(1)).view_as(index)
    return labels, (inside & in_mask & anchor_valid.unsqueeze(-1)).cummin(dim=-1).values


def context_visibility(attention_mask, anchor_positions):
    """Block at anchor a sees context rows at positions STRICTLY before a: at inference the anchor's own target
    feature is not available yet. -> [S, N, T]"""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions[None, None, :] < anchor_positions[:, :, None]) & attention_mask.bool()[:, None, :]


@dataclass
class Batch:
    """One collated batch plus the target's recorded features: the inputs every drafter pass needs."""

    input_ids: torch.LongTensor  # [S, T]
    attention_mask: torch.LongTensor  # [S, T]
    loss_mask: torch.LongTensor  # [S, T]
    features: torch.Tensor  # [S, T, F]
    target_final_hidden: torch.Tensor | None  # [S, T, d] target's final hidden states (Markov objectives)


def batch_with_features(module, batch_inputs, hidden_states) -> Batch:
    """The padded rows of `batch_inputs` (pad_collator's) with what the drafter reads of the target's layer outputs
    `hidden_states`: its fused-context features, and for a Markov head the target's final hidden state."""
    config = module.config
    final = None
    if config.markov_rank:
        final = layer_outputs(hidden_states, [config.num_target_layers - 1], config.num_target_layers)[0]
    return Batch(
        input_ids=batch_inputs["input_ids"],
        attention_mask=batch_inputs["attention_mask"],
        loss_mask=batch_inputs["loss_mask"] * batch_inputs["attention_mask"],
        features=module.target_features(hidden_states),
        target_final_hidden=final,
    )


def drafter_hidden(drafter, embed_tokens, batch: Batch, anchor_positions, carried=None):
    """All blocks of a batch in one drafter forward (invalid anchors too: the loss gives them no weight). carried:
    (features [S,N,R,F], position ids, mask) or None.
    -> hidden states of the draft slots [S, N, c, d]"""
    anchor_ids = torch.gather(batch.input_ids, 1, anchor_positions)
    block_ids, block_position_ids = drafter_module(drafter).block_inputs(anchor_ids, anchor_positions)
    context_position_ids = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device).expand_as(batch.input_ids)
    carried_features, carried_position_ids, carried_mask = carried if carried is not None else (None, None, None)
    out = drafter(
        embed_tokens(block_ids),
        block_position_ids,
        context_features=batch.features,
        context_position_ids=context_position_ids,
        context_mask=context_visibility(batch.attention_mask, anchor_positions),
        carried_features=carried_features,
        carried_position_ids=carried_position_ids,
        carried_mask=carried_mask,
    )
    return out.last_hidden_state[:, :, 1:]


def drafter_module(drafter):
    """The drafter behind a DDP/accelerate wrapper (its helper methods live there)."""
    return getattr(drafter, "module", drafter)


@dataclass
class LossSettings:
    gamma: float
    markov_ce_weight: float = 0.1
    markov_l1_weight: float = 0.9
    confidence_weight: float = 1.0
    chunk_size: int = 64  # blocks per LM-head chunk in the loss
    first_pass_weight: float = 0.0  # carryover: weight of the first pass's baseline loss (0: Algorithm 2 as published)


def chunks(length: int, size: int):
    """Slices of `range(length)`, `size` at a time."""
    return [slice(start, start + size) for start in range(0, length, size)]


def apply_lm_head(lm_head, hidden):
    """The target's (frozen, possibly bf16) LM head on drafter hidden states -> float32 logits."""
    return lm_head(hidden.to(lm_head.weight.dtype)).float()


@torch.no_grad()
def target_scored_distribution(module, lm_head, target_hidden):
    """The target's next-token distribution on the drafter's scored tokens, and its mass outside them (0 without a
    draft vocabulary), for the L1 term. target_hidden [..., d] -> [..., scored_vocab_size], [...]"""
    probs = apply_lm_head(lm_head, target_hidden).softmax(-1)
    if module.draft_token_ids is None:
        return probs, probs.new_zeros(probs.shape[:-1])
    scored = probs.index_select(-1, module.draft_token_ids.to(probs.device))
    return scored, (probs.sum(-1) - scored.sum(-1)).clamp(min=0)


def slot_terms(module, lm_head, hidden, labels, prev_token_ids, target_probs=None, target_outside_mass=None):
    """Per-slot loss terms of a chunk of blocks, each [S, n, c]: cross-entropy and correctness, plus for the Markov
    head, given the target's side (`target_probs`), the L1 distance to the target's distribution
    (`target_scored_distribution`) and the confidence BCE against clamp(1 - 0.5 L1, 0, 1).

    With a draft vocabulary the logits cover its tokens only: a label outside it gets CE 0 (`block_losses` gives it
    no weight) and counts as not correct; the L1 is over the full vocabulary with q = 0 outside the draft vocabulary,
    i.e. sum over the draft tokens of |q - p| plus the target's mass outside them, so 1 - 0.5 L1 stays the exact
    acceptance probability (without a [..., full vocabulary] softmax of q, or its gradient)."""
    logits = module.draft_logits(lm_head, hidden)  # [S, n, c, V']: the big tensor, recomputed in backward
    if module.config.markov_rank:
        logits = logits + module.markov_correction(prev_token_ids).float()
    draft_labels = module.to_draft_ids(labels)  # -1 outside the draft vocabulary
    ce = F.cross_entropy(logits.flatten(0, 2), draft_labels.flatten(), reduction="none", ignore_index=-1)
    ce = ce.view_as(labels)
    correct = (module.to_target_ids(logits.argmax(-1)) == labels).float()
    if not module.config.markov_rank or target_probs is None:  # or a Markov drafter scored on its logits only
        return ce, correct
    l1 = (logits.softmax(-1) - target_probs).abs().sum(-1) + target_outside_mass  # in [0, 2]
    confidence_target = (1 - 0.5 * l1).clamp(0, 1).detach()
    confidence = module.confidence(hidden, prev_token_ids).float().clamp(1e-6, 1 - 1e-6)
    bce = F.binary_cross_entropy(confidence, confidence_target, reduction="none")
    return ce, correct, l1, bce


def block_losses(drafter, lm_head, hidden, labels, label_valid, prev_token_ids, target_hidden, settings: LossSettings):
    """The baseline objective of the drafter variant, position-weighted (w_k = exp(-(k-1)/gamma)) and normalised by
    the weights of the valid slots: DFlash = cross-entropy; Markov (DSpark) = 0.1 CE of the corrected logits + 0.9 L1
    to the target's distribution + 1.0 confidence BCE. With a draft vocabulary, slots whose label lies outside it
    cannot be predicted: they get no weight in any term (`out_of_vocab_labels` logs their share of the valid labels)
    and count as wrong in `accuracy`.

    hidden [S, N, c, d]; labels, label_valid, prev_token_ids [S, N, c]; target_hidden [S, N, c, d] (the target's final
    hidden state before each label, Markov only). Blocks go through the LM head `settings.chunk_size` at a time under
    activation checkpointing, so [S, N, c, V] logits never exist at once. Returns (loss, metrics dict).
    """
    module = drafter_module(drafter)
    learnable = label_valid & (module.to_draft_ids(labels) >= 0)  # [S, N, c]: inside the draft vocabulary, if any
    weights = position_weights(labels.shape[-1], settings.gamma, hidden.device) * learnable  # [S, N, c]
    totals, num_correct = None, 0
    for part in chunks(labels.shape[1], settings.chunk_size):
        inputs = (hidden[:, part], labels[:, part], prev_token_ids[:, part])
        if target_hidden is not None:  # the target's side of the L1 term: once, outside the recomputed function
            inputs += target_scored_distribution(module, lm_head, target_hidden[:, part])
        if hidden.requires_grad:
            ce, correct, *markov = checkpoint(slot_terms, module, lm_head, *inputs, use_reentrant=False)
        else:
            ce, correct, *markov = slot_terms(module, lm_head, *inputs)
        sums = [(term * weights[:, part]).sum() for term in (ce, *markov)]
        totals = sums if totals is None else [t + x for t, x in zip(totals, sums)]
        num_correct += (correct * label_valid[:, part]).sum().detach()
    ce, *markov = [t / weights.sum().clamp(min=1e-8) for t in totals]
    metrics = {"ce": ce.detach(), "accuracy": num_correct / label_valid.sum().clamp(min=1)}
    if module.draft_token_ids is not None:
        metrics["out_of_vocab_labels"] = (label_valid & ~learnable).sum() / label_valid.sum().clamp(min=1)
    if not markov:
        return ce, metrics
    l1, bce = markov
    loss = settings.markov_ce_weight * ce + settings.markov_l1_weight * l1 + settings.confidence_weight * bce
    return loss, metrics | {"l1": l1.detach(), "confidence_bce": bce.detach()}


def gather_rows(rows, positions):
    """rows [S, T, X], positions [S, N, c] -> [S, N, c, X] (positions are clamped into the sequence)."""
    S, N, c = positions.shape
    index = positions.clamp(0, rows.shape[1] - 1).reshape(S, N * c)
    return torch.gather(rows, 1, index.unsqueeze(-1).expand(-1, -1, rows.shape[-1])).view(S, N, c, -1)


def blocks_at(batch: Batch, anchor_positions, anchor_valid, num_slots: int):
    """Labels, the Markov head's previous tokens (teacher forcing: token[a + k - 1]) and the target's final hidden
    states before each label (its distribution there: Markov objectives) of the blocks at `anchor_positions`."""
    labels, label_valid = block_labels(batch.input_ids, batch.loss_mask, anchor_positions, anchor_valid, num_slots)
    prev_positions = anchor_positions.unsqueeze(-1) + torch.arange(num_slots, device=labels.device)
    prev_token_ids = gather_rows(batch.input_ids.unsqueeze(-1), prev_positions).squeeze(-1)
    target_hidden = None
    if batch.target_final_hidden is not None:
        target_hidden = gather_rows(batch.target_final_hidden, prev_positions)
    return labels, label_valid, prev_token_ids, target_hidden


@dataclass
class Transition:
    """The draft-verify result for each anchor: accepted length, shifted anchor, carried rejected rows."""

    drafts: torch.LongTensor  # [S, N, c] the first pass's drafts
    accepted_len: torch.LongTensor  # [S, N]
    verified_len: torch.LongTensor  # [S, N] drafts this forward's greedy verification accepts, up to the response end
    shifted_anchor_positions: torch.LongTensor  # [S, N]
    shifted_anchor_valid: torch.BoolTensor  # [S, N]
    carried: tuple  # (features [S, N, c, F], position ids [S, N, c], mask [S, N, c])


@torch.no_grad()
def draft_verify(
    drafter,
    target,
    embed_tokens,
    lm_head,
    batch: Batch,
    recorded,
    anchor_positions,
    anchor_valid,
    chunk_size,
    hidden=None,
    temperature=0.0,
):
    """Algorithm 2, steps 1-4: a detached draft at every anchor (greedy, or sampled at `temperature` > 0), the frozen
    target verifies all branches in parallel, accepted lengths m, rejected states, shifted anchors a' = a + m + 1.
    `hidden`: the first pass's draft slot states [S, N, c, d] when the caller already ran it (to train on it as well),
    else computed here.

    m counts the leading drafts that agree with the recorded response: the record is the target's own output (greedy
    verification accepts exactly these drafts for greedy-regenerated data), so the recorded prefix through a' is what
    decoding commits, the recorded continuation is the supervision, and the first carried row is never the recorded
    token at a'. Where the record and this forward's greedy verification disagree (a near-tie decided otherwise by
    other numerics, or sampled data), following the verification instead would carry the true continuation's own
    features as "rejected" rows. `verified_len` is the verification's own count (a diagnostic).

    Sampled drafts keep the record as the committed path: speculative sampling commits a draft exactly when it is the
    token committed there (a rejected draft x has p(x) < q(x), so the residual it is replaced from is 0 at x), so m
    counts the sampled drafts that repeat the record, and the carried rows are the sampled branch after them. (The
    record itself is the greedy regeneration: these are sampled decoding's branches along greedy paths.)
    """
    module = drafter_module(drafter)
    num_slots = module.config.block_size - 1
    with record_function("carryover.first_draft"):
        if hidden is None:
            hidden = drafter_hidden(drafter, embed_tokens, batch, anchor_positions)
        hidden = hidden.detach()
        anchor_ids = torch.gather(batch.input_ids, 1, anchor_positions)
        drafts = torch.cat(  # the LM head a chunk of anchors at a time: [S, N, c, V] logits never exist at once
            [
                module.draft_tokens(module.draft_logits(lm_head, hidden[:, part]), anchor_ids[:, part], temperature)
                for part in chunks(hidden.shape[1], chunk_size)
            ],
            dim=1,
        )  # [S, N, c]

    indices = module.feature_hidden_state_indices
    with record_function("carryover.verify"):
        verified = verify_branches(target, recorded, batch.input_ids, anchor_positions, drafts, indices, chunk_size)
    labels, label_valid = block_labels(batch.input_ids, batch.loss_mask, anchor_positions, anchor_valid, num_slots)
    accepted_len = leading_matches((drafts == labels) & label_valid)  # the drafts that repeat the record
    verified_len = torch.minimum(verified.accepted_len, label_valid.sum(-1))  # past the response, nothing to compare

    branch_features = module.target_features(verified.hidden_states)  # [S, N, B, F]: the verified blocks
    _, branch_position_ids = module.block_inputs(anchor_ids, anchor_positions)
    carried = module.rejected_rows(branch_features, branch_position_ids, accepted_len)

    shifted = anchor_positions + accepted_len + 1
    T = batch.input_ids.shape[1]
    shifted_valid = anchor_valid & (shifted < T)
    shifted = torch.where(shifted_valid, shifted, torch.zeros_like(shifted))
    shifted_valid &= torch.gather(batch.loss_mask.bool(), 1, shifted)  # the anchor a' is a response token, as at first
    return Transition(drafts, accepted_len, verified_len, shifted, shifted_valid, carried)


def training_layer_ids(config) -> list:
    """The target layers a training step reads: the feature layers, and for the Markov objectives the target's final
    (normed) hidden state, which is the last layer's output in HF."""
    return config.target_layer_ids + ([config.num_target_layers - 1] if config.markov_rank else [])


def training_step_loss(
    drafter,
    target,
    batch_inputs,
    num_anchors,
    settings: LossSettings,
    carryover: bool,
    chunk_size=64,
    carry_rows=True,
    draft_temperature=0.0,
):
    """Loss of one batch: baseline (blocks at random anchors) or carryover (draft-verify-draft, the loss of the second
    pass at the shifted anchors with the rejected rows carried, plus `settings.first_pass_weight` x the first pass's
    baseline loss at the random anchors). `carry_rows=False` (an ablation) keeps the shifted anchors and drops the
    rows: the second pass is then the baseline objective at a' = a + m + 1. `draft_temperature` > 0 samples the first
    pass's drafts (the rejected branches of sampled decoding) instead of taking the argmax. Returns (loss, metrics).

    The target's layer outputs come from its forward over the batch, or from `batch_inputs["target_hidden_states"]`
    (stored by trainer.features: a tuple with one [S, T, d] entry per target layer): then the baseline runs no target
    forward, and carryover runs it only for the K/V cache its verification reads."""
    module = drafter_module(drafter)
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    input_ids, attention_mask = batch_inputs["input_ids"], batch_inputs["attention_mask"]
    hidden_states = batch_inputs.get("target_hidden_states")  # read from a features cache (trainer.features), or None
    recorded = None
    if hidden_states is None or carryover:  # carryover verifies against the K/V cache of the recorded sequence
        request = hidden_state_request(training_layer_ids(module.config)) if hidden_states is None else False
        with record_function("carryover.target_pass"):
            recorded = target_pass(target, input_ids, attention_mask, request, carryover)
        hidden_states = recorded.hidden_states if hidden_states is None else hidden_states
    batch = batch_with_features(module, batch_inputs, hidden_states)
    num_slots = module.config.block_size - 1
    anchor_positions, anchor_valid = sample_anchors(batch.loss_mask, num_anchors)
    metrics = {}
    carried, first_loss, first_hidden = None, None, None
    if carryover and settings.first_pass_weight > 0:  # also train the first pass: drafting without carried rows
        with record_function("carryover.first_pass_loss"):
            first_hidden = drafter_hidden(drafter, embed_tokens, batch, anchor_positions)
            first_blocks = blocks_at(batch, anchor_positions, anchor_valid, num_slots)
            first_loss, first_metrics = block_losses(drafter, lm_head, first_hidden, *first_blocks, settings)
        metrics |= {"first_pass_" + name: value for name, value in first_metrics.items()}
    if carryover:
        transition = draft_verify(
            drafter,
            target,
            embed_tokens,
            lm_head,
            batch,
            recorded,
            anchor_positions,
            anchor_valid,
            chunk_size,
            first_hidden,
            draft_temperature,
        )
        valid = anchor_valid.float()
        metrics["first_draft_accepted"] = (transition.accepted_len * valid).sum() / valid.sum()
        rejected_rows = (transition.carried[2] & anchor_valid[..., None]).sum() / valid.sum()
        metrics["carried_rows" if carry_rows else "dropped_rows"] = rejected_rows
        metrics["record_disagreement"] = ((transition.verified_len != transition.accepted_len).float() * valid).sum() / valid.sum()
        anchor_positions, anchor_valid, carried = (
            transition.shifted_anchor_positions,
            transition.shifted_anchor_valid,
            transition.carried if carry_rows else None,
        )
    with record_function("carryover.drafter_loss"):  # the baseline pass, or carryover's second pass
        hidden = drafter_hidden(drafter, embed_tokens, batch, anchor_positions, carried)
        labels, label_valid, prev_token_ids, target_hidden = blocks_at(batch, anchor_positions, anchor_valid, num_slots)
        loss, loss_metrics = block_losses(drafter, lm_head, hidden, labels, label_valid, prev_token_ids, target_hidden, settings)
    if first_loss is not None:
        loss = loss + settings.first_pass_weight * first_loss
    return loss, metrics | loss_metrics


__all__ = [
    "Batch",
    "batch_with_features",
    "LossSettings",
    "Transition",
    "block_labels",
    "block_losses",
    "blocks_at",
    "context_visibility",
    "default_gamma",
    "draft_verify",
    "position_weights",
    "sample_anchors",
    "training_step_loss",
]
