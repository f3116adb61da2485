"""Training: the mask, labels and losses on hand-computed examples, train/serve parity with `generate`, learning,
E_carry, resume, and bad input. Real tiny transformers targets, the real Trainer."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import greedy_dataset, make_drafter, make_target, train_drafter, trained_drafter
from transformers import DynamicCache

import modeling_carryover as mc
from modeling_carryover.modeling_carryover import block_attention, hidden_state_request, layer_outputs
from trainer.carryover_trainer import pad_collator
from trainer.objectives import (
    Batch,
    LossSettings,
    block_labels,
    block_losses,
    blocks_at,
    context_visibility,
    draft_verify,
    drafter_hidden,
    position_weights,
    sample_anchors,
)
from trainer.verification import check_verification_support, leading_matches, target_pass, verify_branches


# ---------------------------------------------------------------------------------------------------------------
# Hand-computed pieces
# ---------------------------------------------------------------------------------------------------------------


def test_context_visibility_is_strictly_before_the_anchor():
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0]])  # one padding position
    anchors = torch.tensor([[0, 2, 5]])
    expected = torch.tensor(
        [
            [0, 0, 0, 0, 0, 0],  # anchor 0: no context row before it
            [1, 1, 0, 0, 0, 0],  # anchor 2: rows 0, 1 (not its own row 2)
            [1, 1, 1, 1, 1, 0],  # anchor 5: rows 0..4, padding excluded
        ],
        dtype=torch.bool,
    )
    assert torch.equal(context_visibility(attention_mask, anchors)[0], expected)


def test_block_attention_equals_the_dense_training_mask():
    """Who sees whom, against an independent dense attention over [context ; carried of all blocks ; all blocks]:
    block b sees context rows < anchor_b, its own valid carried rows and its own block (bidirectionally)."""
    torch.manual_seed(0)
    S, N, H, K, B, D, T, R = 1, 3, 4, 2, 3, 8, 7, 2
    query = torch.randn(S, N, H, B, D)
    ctx_k, ctx_v = torch.randn(S, K, T, D), torch.randn(S, K, T, D)
    own_k, own_v = torch.randn(S, N, K, R + B, D), torch.randn(S, N, K, R + B, D)
    anchors = torch.tensor([[1, 3, 6]])
    context_mask = context_visibility(torch.ones(S, T), anchors)
    carried_mask = torch.tensor([[[True, True], [True, False], [False, False]]])
    own_mask = torch.cat([carried_mask, torch.ones(S, N, B, dtype=torch.bool)], -1)
    out, _ = block_attention(query, ctx_k, ctx_v, own_k, own_v, context_mask, own_mask, D**-0.5)

    # dense reference: keys = [context (T) ; block 0 rows (R+B) ; block 1 rows ; block 2 rows]
    keys = torch.cat([ctx_k[0]] + [own_k[0, n] for n in range(N)], dim=1)  # [K, T + N(R+B), D]
    values = torch.cat([ctx_v[0]] + [own_v[0, n] for n in range(N)], dim=1)
    dense = torch.zeros(N * B, T + N * (R + B), dtype=torch.bool)
    for n, a in enumerate([1, 3, 6]):
        rows = slice(n * B, (n + 1) * B)
        dense[rows, :a] = True
        start = T + n * (R + B)
        dense[rows, start : start + R] = carried_mask[0, n]
        dense[rows, start + R : start + R + B] = True
    q = query[0].transpose(0, 1).reshape(H, N * B, D)  # [H, N*B, D]
    k = keys.repeat_interleave(H // K, dim=0)
    v = values.repeat_interleave(H // K, dim=0)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)  # [H, N*B, D]
    reference = reference.view(H, N, B, D).permute(1, 2, 0, 3).reshape(1, N, B, H * D)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_gated_block_attention_by_hand():
    """carry_gate: the carried rows get a softmax of their own, scaled by the gate of each head and added to the
    softmax over the other rows (checked head by head against plain softmax attention); a block with no valid carried
    row gets nothing from them (and no NaN, forward or backward); with the gates at zero the attention is exactly the
    attention without the carried rows."""
    torch.manual_seed(0)
    S, N, H, K, B, D, T, R = 1, 2, 4, 2, 3, 8, 5, 2
    query = torch.randn(S, N, H, B, D, requires_grad=True)
    ctx_k, ctx_v = torch.randn(S, K, T, D), torch.randn(S, K, T, D)
    own_k, own_v = torch.randn(S, N, K, R + B, D), torch.randn(S, N, K, R + B, D)
    context_mask = torch.ones(S, N, T, dtype=torch.bool)
    context_mask[0, 0, 3:] = False
    carried_mask = torch.tensor([[[True, False], [False, False]]])  # block 1 carries no valid row
    own_mask = torch.cat([carried_mask, torch.ones(S, N, B, dtype=torch.bool)], -1)
    gate = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    out, probs = block_attention(query, ctx_k, ctx_v, own_k, own_v, context_mask, own_mask, D**-0.5, carry_gate=gate)

    def attend(q, keys, values, visible):  # plain softmax attention; nothing visible -> zeros
        if not visible.any():
            return torch.zeros_like(q)
        return ((q @ keys.T) * D**-0.5).masked_fill(~visible, float("-inf")).softmax(-1) @ values

    is_carried = (torch.arange(T + R + B) >= T) & (torch.arange(T + R + B) < T + R)
    for n in range(N):
        visible = torch.cat([context_mask[0, n], own_mask[0, n]])
        for h in range(H):
            kv = h // (H // K)
            keys, values = torch.cat([ctx_k[0, kv], own_k[0, n, kv]]), torch.cat([ctx_v[0, kv], own_v[0, n, kv]])
            q = query[0, n, h].detach()
            expected = attend(q, keys, values, visible & ~is_carried) + gate[h] * attend(q, keys, values, visible & is_carried)
            torch.testing.assert_close(out[0, n, :, h * D : (h + 1) * D], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs[0, 0, :, :, T : T + R].sum(-1), gate.detach()[:, None].expand(H, B))
    assert probs[0, 1, :, :, T : T + R].abs().sum() == 0
    out.square().sum().backward()
    assert query.grad.isfinite().all() and gate.grad.isfinite().all() and (gate.grad != 0).all()

    shut, _ = block_attention(query, ctx_k, ctx_v, own_k, own_v, context_mask, own_mask, D**-0.5, carry_gate=torch.zeros(H))
    without_rows, _ = block_attention(query, ctx_k, ctx_v, own_k[:, :, :, R:], own_v[:, :, :, R:], context_mask, None, D**-0.5)
    torch.testing.assert_close(shut, without_rows, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("carry_gate", [False, True])
def test_flex_attention_equals_the_dense_path(carry_gate):
    """attn_implementation="flex_attention" (the training path on GPUs) computes what the dense path computes, in the
    training layout (2 sequences, padding, invalid anchors, padded carried rows, GQA) and through decoding's cache,
    with and without carry gates (two FlexAttention calls: the carried rows and the others). CPU FlexAttention has no
    backward, so only the forward is compared here."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4, carry_gate=carry_gate)
    if carry_gate:
        with torch.no_grad():
            drafter.carry_gate.normal_()
    torch.manual_seed(0)
    S, N, R, T = 2, 3, 3, 14
    sequences = torch.randint(0, target.config.vocab_size, (S, T))
    attention_mask = torch.ones(S, T, dtype=torch.long)
    attention_mask[1, 10:] = 0
    recorded = target_pass(target, sequences, attention_mask, drafter.feature_hidden_state_indices)
    batch = Batch(sequences, attention_mask, attention_mask, drafter.target_features(recorded.hidden_states), None)
    anchors, valid = torch.tensor([[2, 6, 11], [0, 5, 9]]), torch.tensor([[True, True, True], [True, True, False]])
    carried = (
        torch.randn(S, N, R, drafter.config.feature_size) * 3,
        anchors.unsqueeze(-1) + torch.arange(R),
        torch.tensor([[[True, True, False], [False, False, False], [True, True, True]]] * S),
    )
    embed = target.get_input_embeddings()
    with torch.no_grad():
        dense = [drafter_hidden(drafter, embed, batch, anchors, c) for c in (None, carried)]
        drafter.set_attn_implementation("flex_attention")
        assert drafter.config._attn_implementation == "flex_attention"
        flex = [drafter_hidden(drafter, embed, batch, anchors, c) for c in (None, carried)]
        flex_output = mc.generate(target, sequences[:1, :5], assistant_model=drafter, max_new_tokens=20, carryover=True)
        drafter.set_attn_implementation("eager")
        dense_output = mc.generate(target, sequences[:1, :5], assistant_model=drafter, max_new_tokens=20, carryover=True)
    for a, b in zip(dense, flex):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert torch.equal(flex_output, dense_output)


def test_labels_and_position_weights_by_hand():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0]])  # response = positions 2..5
    anchors, valid = torch.tensor([[2, 4]]), torch.tensor([[True, True]])
    labels, label_valid = block_labels(input_ids, loss_mask, anchors, valid, num_slots=3)
    assert labels.tolist() == [[[13, 14, 15], [15, 16, 16]]]  # slot k -> token[a + k]; clamped past the end
    assert label_valid.tolist() == [[[True, True, True], [True, False, False]]]  # 16 is outside the mask, 7 outside T
    # a gap in the mask (a user turn between two assistant turns) ends the block's labels: no draft crosses it
    gap_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1]])
    _, label_valid = block_labels(input_ids, gap_mask, torch.tensor([[1]]), torch.tensor([[True]]), num_slots=4)
    assert label_valid.tolist() == [[[True, False, False, False]]]
    weights = position_weights(3, gamma=2.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_teacher_forcing_inputs_by_hand():
    """Slot k of the block at a: label token[a + k]; the Markov head's previous token token[a + k - 1] (the anchor for
    slot 1); the target distribution it matches is the one after that token, i.e. the target's final hidden state at
    a + k - 1, which is what the target's own LM head turns into its logits."""
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    ones = torch.ones_like(input_ids)
    final_hidden = torch.arange(7.0)[None, :, None].expand(1, 7, 2)  # row t holds t
    batch = Batch(input_ids, ones, ones, features=None, target_final_hidden=final_hidden)
    labels, label_valid, prev_token_ids, target_hidden = blocks_at(batch, torch.tensor([[2]]), torch.tensor([[True]]), 3)
    assert labels.tolist() == [[[13, 14, 15]]] and label_valid.all()
    assert prev_token_ids.tolist() == [[[12, 13, 14]]]
    assert target_hidden[..., 0].tolist() == [[[2.0, 3.0, 4.0]]]

    target = make_target("llama")
    num_layers = target.config.num_hidden_layers
    sequence = torch.randint(0, target.config.vocab_size, (1, 12))
    recorded = target_pass(target, sequence, torch.ones_like(sequence), hidden_state_request([num_layers - 1]))
    final = layer_outputs(recorded.hidden_states, [num_layers - 1], num_layers)[0]
    with torch.no_grad():
        torch.testing.assert_close(target.lm_head(final), target(sequence).logits)


def test_loss_gamma_defaults_to_the_reference_and_is_configurable(tmp_path):
    from transformers import TrainingArguments

    from trainer.carryover_trainer import CarryoverArguments, CarryoverTrainer

    target = make_target("llama")
    dataset = greedy_dataset(target, num_rows=2, new_tokens=8)

    def gamma(block_size, **kwargs):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
        trainer = CarryoverTrainer(model=make_drafter(target, block_size=block_size), args=args, train_dataset=dataset,
                                   target_model=target, carryover_args=CarryoverArguments(**kwargs))
        return trainer.loss_settings.gamma

    assert (gamma(8), gamma(16), gamma(16, loss_gamma=2.5)) == (4.0, 7.0, 2.5)


def test_anchor_sampling_respects_the_loss_mask():
    torch.manual_seed(0)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1]])
    anchors, valid = sample_anchors(loss_mask, num_anchors=4)
    for row, (a, v) in enumerate(zip(anchors.tolist(), valid.tolist())):
        picked = [x for x, ok in zip(a, v) if ok]
        assert picked == sorted(set(picked))
        assert all(loss_mask[row, x] and loss_mask[row, x + 1] for x in picked)
    assert valid.sum(-1).tolist() == [2, 4]  # the short response offers only anchors 2 and 3
    with pytest.raises(ValueError, match="consecutive"):
        sample_anchors(torch.tensor([[0, 1, 0, 1]]), num_anchors=4)


class _TinyLMHead(torch.nn.Module):
    """An LM head given by an explicit matrix (V=3) reading the first 2 of `hidden` dims, to compute losses by hand."""

    def __init__(self, hidden=2):
        super().__init__()
        weight = torch.zeros(3, hidden)
        weight[:, :2] = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x @ self.weight.T


def test_dflash_loss_by_hand():
    helpers = ("draft_logits", "to_draft_ids", "to_target_ids", "full_vocab_logits")  # the model's, no draft vocabulary
    fields = {"config": type("C", (), {"markov_rank": 0})(), "draft_token_ids": None}
    drafter = type("D", (), fields | {name: getattr(mc.CarryoverDrafterModel, name) for name in helpers})()
    hidden = torch.tensor([[[[2.0, 0.0], [0.0, 1.0]]]])  # [S=1, N=1, c=2, d=2] -> logits [2,0,0] and [0,1,0]
    labels = torch.tensor([[[0, 2]]])
    valid = torch.tensor([[[True, True]]])
    prev = torch.zeros_like(labels)  # unused without a Markov head
    loss, metrics = block_losses(drafter, _TinyLMHead(), hidden, labels, valid, prev, None, LossSettings(gamma=1.0))
    ce0 = -math.log(math.exp(2) / (math.exp(2) + 2))
    ce1 = -math.log(1 / (math.e + 2))
    w1 = math.exp(-1.0)
    assert loss.item() == pytest.approx((ce0 + w1 * ce1) / (1 + w1), rel=1e-5)
    assert metrics["accuracy"].item() == 0.5


def test_markov_losses_by_hand():
    target = make_target("llama", vocab_size=3, hidden_size=64)
    drafter = make_drafter(target, markov_rank=2, mask_token_id=2)
    with torch.no_grad():
        drafter.markov_embed.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        drafter.markov_proj.weight.copy_(torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))  # prev 0 -> +1 on token 1
        drafter.confidence_head.weight.zero_()
        drafter.confidence_head.bias.zero_()  # confidence 0.5 everywhere
    head = _TinyLMHead(hidden=64)
    hidden = torch.zeros(1, 1, 1, 64)
    hidden[..., 0] = 1.0  # logits from the tiny head use the first 2 dims: [1, 0, 0]
    labels, valid, prev = torch.tensor([[[1]]]), torch.tensor([[[True]]]), torch.tensor([[[0]]])
    target_hidden = torch.zeros(1, 1, 1, 64)  # the tiny head maps it to logits [0, 0, 0]: a uniform target
    loss, metrics = block_losses(drafter, head, hidden, labels, valid, prev, target_hidden, LossSettings(gamma=1.0))
    corrected = torch.tensor([1.0, 1.0, 0.0])  # [1,0,0] + W2(W1[0]) = [1,0,0] + [0,1,0]
    p = corrected.softmax(-1)
    ce = -p[1].log().item()
    l1 = (p - 1 / 3).abs().sum().item()
    c_star = min(max(1 - 0.5 * l1, 0), 1)
    bce = -(c_star * math.log(0.5) + (1 - c_star) * math.log(0.5))
    assert metrics["ce"].item() == pytest.approx(ce, rel=1e-5)
    assert metrics["l1"].item() == pytest.approx(l1, rel=1e-5)
    assert metrics["confidence_bce"].item() == pytest.approx(bce, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * ce + 0.9 * l1 + 1.0 * bce, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Train/serve parity
# ---------------------------------------------------------------------------------------------------------------


def lossless_rounds(target, drafter, dataset, num_prompts, max_new_tokens, **generate_kwargs):
    """Carryover-decode the first prompts of `dataset`, asserting each output is the target's greedy one; the rounds."""
    rounds = []
    for row in dataset.select(range(num_prompts)):
        prompt = torch.tensor([row["input_ids"][:6]])
        expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
        output = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, **generate_kwargs)
        assert torch.equal(output, expected)
        rounds += drafter.generation_stats.rounds
    return rounds


def _batch_of(target, drafter, sequence, markov=False):
    indices = drafter.feature_hidden_state_indices
    recorded = target_pass(target, sequence, torch.ones_like(sequence), indices, use_cache=True)
    batch = Batch(
        input_ids=sequence,
        attention_mask=torch.ones_like(sequence),
        loss_mask=torch.ones_like(sequence),
        features=drafter.target_features(recorded.hidden_states),
        target_final_hidden=None,
    )
    return batch, recorded


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_training_logits_equal_decoding_logits(markov_rank):
    """The training forward (all anchors of a response at once, context mask, padded carried rows) gives the logits
    the decoding layout gives (drafter cache filled incrementally, one block, exact carried rows)."""
    target, drafter, dataset = trained_drafter("llama", 4, markov_rank)
    sequence = torch.tensor([dataset[3]["input_ids"]])
    batch, recorded = _batch_of(target, drafter, sequence)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    anchors = torch.tensor([[9, 15, 30]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    # carried rows for each anchor: a proposal verified at an earlier anchor, rejected after its first draft
    previous = anchors - 2
    drafts = torch.randint(0, target.config.vocab_size, (1, 3, 3))
    drafts[..., 0] = sequence[0, previous + 1]  # the first draft is right, the next two are (most likely) wrong
    branch = verify_branches(target, recorded, sequence, previous, drafts, drafter.feature_hidden_state_indices)
    window = drafter.target_features(branch.hidden_states)
    window_positions = previous.unsqueeze(-1) + torch.arange(4)
    accepted = torch.ones_like(anchors)
    carried = drafter.rejected_rows(window, window_positions, accepted)
    assert carried[2].sum() == 6 and torch.equal(carried[1][..., 0], anchors)  # rejected rows start at the anchor

    with torch.no_grad():
        for rows in (carried, None):  # with and without carried rejected rows
            training = lm_head(drafter_hidden(drafter, embed, batch, anchors, rows))  # [1, 3, c, V]
            for n, a in enumerate(anchors[0].tolist()):
                cache, half = DynamicCache(), a // 2
                block_ids, block_positions = drafter.block_inputs(sequence[:, a], torch.tensor([a]))
                block = (embed(block_ids)[:, None], block_positions[:, None])
                # an earlier round committed the first half of the rows; this round commits the rest (and reads the
                # carried rows)
                drafter(*block, past_key_values=cache, context_features=batch.features[:, :half], context_position_ids=torch.arange(half)[None])
                carried_rows = {} if rows is None else {
                    "carried_features": rows[0][:, n : n + 1, :2], "carried_position_ids": rows[1][:, n : n + 1, :2]
                }
                out = drafter(
                    *block,
                    past_key_values=cache,
                    context_features=batch.features[:, half:a],
                    context_position_ids=torch.arange(half, a)[None],
                    **carried_rows,
                )
                decoding = lm_head(out.last_hidden_state[0, 0, 1:])
                torch.testing.assert_close(training[0, n], decoding, atol=1e-4, rtol=1e-4)


def test_parallel_verification_equals_what_generate_observes():
    """For every round of a real carryover `generate`, the training-time parallel verification of that round's
    proposal gives the accepted length generate used and the hidden states of the target's verification forward."""
    target, drafter, dataset = trained_drafter("llama", 8, 0)
    observed = []
    hook = target.register_forward_hook(lambda module, args, kwargs_out: observed.append(kwargs_out.hidden_states))
    try:
        sequence = mc.generate(target, torch.tensor([dataset[2]["input_ids"][:6]]), assistant_model=drafter, max_new_tokens=60)
    finally:
        hook.remove()
    rounds = drafter.generation_stats.rounds
    assert any(0 < r.accepted < r.proposed for r in rounds)
    recorded = target_pass(target, sequence, torch.ones_like(sequence), drafter.feature_hidden_state_indices, use_cache=True)
    anchors = torch.tensor([[r.anchor_position for r in rounds if r.proposed == 7]])
    drafts = torch.tensor([[r.drafts for r in rounds if r.proposed == 7]])
    verified = verify_branches(target, recorded, sequence, anchors, drafts, drafter.feature_hidden_state_indices)
    full = [r for r in rounds if r.proposed == 7]
    assert verified.accepted_len[0].tolist() == [r.accepted for r in full]
    # the target forward after the prefill verifies round 0, the next one round 1, ...
    for i, r in enumerate(full):
        states = observed[rounds.index(r) + 1]  # observed[0] is the prefill
        for layer in drafter.feature_hidden_state_indices:
            torch.testing.assert_close(verified.hidden_states[layer][0, i], states[layer][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", {"attn_implementation": "sdpa"}),
        ("llama", {"attn_implementation": "eager"}),
        ("qwen3-sliding", {}),  # full and sliding-window layers: one mask per type
        ("mistral", {"sliding_window": 6, "attn_implementation": "eager"}),  # every layer sliding, one mask
    ],
)
def test_parallel_verification_equals_one_forward_per_branch(kind, overrides):
    """Every branch of the packed verification (a right-padded batch, chunked) equals a plain target forward over
    `token[: a + 1] + drafts` with the target's own masks: the same greedy tokens, accepted lengths and hidden states,
    with eager and SDPA attention (a 4D mask reaches both as given) and sliding-window layers."""
    target = make_target(kind, **overrides)
    lengths, c = (30, 24), 3
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.zeros(2, max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths):
        prompt = torch.randint(0, target.config.vocab_size, (1, 4), generator=generator)
        input_ids[i, :n] = target.generate(prompt, max_new_tokens=n - 4, do_sample=False)[0]
        attention_mask[i, :n] = 1
    anchors = torch.tensor([[2, 9, 17, 28], [3, 11, 16, 22]])  # the last branches run past the response's end
    # the recorded continuation (greedy: accepted) with one slot replaced from a random position on
    drafts = torch.stack([input_ids[i, (anchors[i, :, None] + torch.arange(1, c + 1)).clamp(max=lengths[i] - 1)] for i in range(2)])
    wrong = torch.randint(0, c + 1, (2, 4), generator=generator)
    drafts = torch.where(torch.arange(c)[None, None] == wrong[..., None], (drafts + 1) % target.config.vocab_size, drafts)
    layers, num_layers = [0, 2, 3], target.config.num_hidden_layers
    indices = hidden_state_request(layers)
    recorded = target_pass(target, input_ids, attention_mask, indices, use_cache=True)
    verified = verify_branches(target, recorded, input_ids, anchors, drafts, indices, chunk_size=3)
    assert 0 < verified.accepted_len.sum() < verified.accepted_len.numel() * c  # accepted and rejected drafts
    for i, j in [(i, j) for i in range(2) for j in range(4)]:
        a = anchors[i, j].item()
        branch = torch.cat([input_ids[i, : a + 1], drafts[i, j]])[None]
        with torch.no_grad():
            out = target(branch, output_hidden_states=True)
        greedy = out.logits[0, a:].argmax(-1)
        assert verified.greedy_tokens[i, j].tolist() == greedy.tolist()
        assert verified.accepted_len[i, j].item() == (drafts[i, j] == greedy[:-1]).long().cumprod(0).sum().item()
        branch_states = layer_outputs(verified.hidden_states, layers, num_layers)
        for branch_state, state in zip(branch_states, layer_outputs(out.hidden_states, layers, num_layers)):
            torch.testing.assert_close(branch_state[i, j], state[0, a:], atol=1e-5, rtol=1e-5)


def test_carryover_trains_and_decodes_losslessly_on_a_sliding_window_target():
    """A hybrid target (full + sliding-window layers, window 6 < block 8): carryover training runs with the real
    Trainer, and the trained drafter decodes exactly the target's greedy output with long accepted spans."""
    target, drafter, dataset = trained_drafter("qwen3-sliding", 8, 0)
    rounds = lossless_rounds(target, drafter, dataset, num_prompts=4, max_new_tokens=60)
    assert any(0 < r.accepted < r.proposed for r in rounds) and any(r.carried for r in rounds)
    assert sum(r.accepted + 1 for r in rounds) / len(rounds) > 2


def test_carryover_training_refuses_a_target_without_a_4d_mask():
    """Flash attention ignores a custom 4D mask: carryover training says so before it starts."""
    target = make_target("llama")
    target.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="4D attention mask"):
        check_verification_support(target)
    check_verification_support(make_target("qwen3-sliding"))


def test_accepted_length_follows_the_record_where_greedy_verification_disagrees():
    """Where the recorded response is not this forward's greedy choice (a near-tie decided otherwise, or sampled data),
    m follows the record: drafts that repeat the record are committed, never carried as "rejected" rows (those rows
    would be the true continuation's own features: a label leak decoding never sees)."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)  # untrained: its drafts are not the target's greedy tokens
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    sequence = target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=17, do_sample=False)
    anchors, valid = torch.tensor([[10]]), torch.tensor([[True]])
    with torch.no_grad():
        batch, _ = _batch_of(target, drafter, sequence)
        drafts = drafter.draft_tokens(lm_head(drafter_hidden(drafter, embed, batch, anchors)), sequence[0, 10])
    sequence[0, 11:14] = drafts[0, 0]  # a record that says the drafts were generated (and context < 10 is unchanged)
    batch, recorded = _batch_of(target, drafter, sequence)
    transition = draft_verify(drafter, target, embed, lm_head, batch, recorded, anchors, valid, chunk_size=4)
    with torch.no_grad():
        greedy = target(sequence[:, :14]).logits[0, 10:13].argmax(-1)
    verified = (drafts[0, 0] == greedy).long().cumprod(0).sum().item()
    assert verified < 3 and transition.verified_len.item() == verified  # the target itself rejects a draft
    assert transition.accepted_len.item() == 3  # but all three drafts are the record: committed, none carried
    assert transition.carried[2].sum().item() == 0
    assert transition.shifted_anchor_positions.item() == 14


def test_first_draft_of_training_equals_decoding_proposal():
    """Algorithm 2's detached first draft at an anchor is the proposal carryover-OFF decoding makes there."""
    target, drafter, dataset = trained_drafter("llama", 4, 8)
    sequence = mc.generate(target, torch.tensor([dataset[5]["input_ids"][:6]]), assistant_model=drafter, max_new_tokens=40, carryover=False)
    rounds = [r for r in drafter.generation_stats.rounds if r.proposed == 3]
    batch, recorded = _batch_of(target, drafter, sequence)
    anchors = torch.tensor([[r.anchor_position for r in rounds]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        hidden = drafter_hidden(drafter, embed, batch, anchors)
        drafts = drafter.draft_tokens(lm_head(hidden), sequence[0, anchors[0]][None])
    assert drafts[0].tolist() == [r.drafts for r in rounds]
    transition = draft_verify(drafter, target, embed, lm_head, batch, recorded, anchors, valid, chunk_size=2)
    assert transition.accepted_len[0].tolist() == [r.accepted for r in rounds]
    assert torch.equal(transition.shifted_anchor_positions, anchors + transition.accepted_len + 1)
    # fully accepted proposals stay in the loss, with empty carried context; the others carry their rejected rows
    full = transition.accepted_len == 3
    assert full.any() and (~full).any() and transition.shifted_anchor_valid.all()
    assert transition.carried[2].sum(-1).tolist() == (3 - transition.accepted_len).tolist()


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_sampled_drafts_follow_the_tempered_softmax_over_the_draft_vocabulary(markov_rank):
    """At a temperature > 0 each slot's draft is a sample of softmax(logits / T) over the draft vocabulary (nothing
    outside it), and the Markov head corrects slot 2 with the draft sampled at slot 1."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=3, markov_rank=markov_rank, draft_vocab_size=4)
    ids = torch.tensor([3, 7, 11, 20])
    drafter.set_draft_vocab(ids)
    torch.manual_seed(0)
    if markov_rank:  # W2 starts at zero (plain DFlash): give the correction something to do
        torch.nn.init.normal_(drafter.markov_embed.weight, std=1.0)
        torch.nn.init.normal_(drafter.markov_proj.weight, std=0.3)
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5], [0.2, -0.3, 0.6, 0.0]])  # [c, scored vocab]
    temperature, n = 0.7, 20000
    with torch.no_grad():
        drafts = drafter.draft_tokens(logits.expand(n, 2, 4), torch.full((n,), 5), temperature)  # [n, c]

        def expected(slot, previous):
            correction = drafter.markov_correction(torch.tensor(previous)) if markov_rank else 0
            return ((logits[slot] + correction) / temperature).softmax(-1)

        def frequencies(tokens):  # target ids -> share of each draft-vocabulary token
            return (tokens[:, None] == ids).float().mean(0)

        assert torch.isin(drafts, ids).all()
        torch.testing.assert_close(frequencies(drafts[:, 0]), expected(0, 5), atol=0.015, rtol=0)
        checked = 0
        for token in ids.tolist():  # slot 2 given slot 1's draft
            given = drafts[:, 0] == token
            if given.sum() >= 2000:
                torch.testing.assert_close(frequencies(drafts[given, 1]), expected(1, token), atol=0.03, rtol=0)
                checked += 1
        assert checked >= 2
        if markov_rank:  # the correction does change slot 2's distribution with slot 1's draft
            assert (expected(1, 3) - expected(1, 20)).abs().max() > 0.1


def test_sampled_first_pass_carries_the_sampled_branch():
    """carry_temperature > 0: the first pass samples its drafts; m counts those that repeat the record, the carried
    rows are the target's features of the sampled branch after them (one plain forward per branch), and the trainer
    runs with it (and refuses a negative temperature or one without carryover)."""
    import copy

    target, cached, dataset = trained_drafter("llama", 4, 0)
    sequence = torch.tensor([dataset[5]["input_ids"]])
    batch, recorded = _batch_of(target, cached, sequence)
    anchors = torch.arange(6, 40, 2)[None]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    greedy = draft_verify(cached, target, embed, lm_head, batch, recorded, anchors, valid, chunk_size=8)
    torch.manual_seed(0)
    sampled = draft_verify(cached, target, embed, lm_head, batch, recorded, anchors, valid, chunk_size=8, temperature=1.0)
    assert (sampled.drafts != greedy.drafts).any()  # the trained drafter is not certain everywhere
    labels, label_valid = block_labels(sequence, batch.loss_mask, anchors, valid, 3)
    assert torch.equal(sampled.accepted_len, leading_matches((sampled.drafts == labels) & label_valid))
    assert 0 < sampled.accepted_len.sum() < sampled.accepted_len.numel() * 3
    features, position_ids, carried = sampled.carried
    for j, a in enumerate(anchors[0].tolist()):
        m = sampled.accepted_len[0, j].item()
        assert carried[0, j].tolist() == [True] * (3 - m) + [False] * m
        with torch.no_grad():
            out = target(torch.cat([sequence[0, : a + 1], sampled.drafts[0, j]])[None], output_hidden_states=True)
        branch = cached.target_features(out.hidden_states)[0, a + 1 + m :]  # the drafts after the accepted ones
        torch.testing.assert_close(features[0, j, : 3 - m], branch, atol=1e-5, rtol=1e-5)
        assert position_ids[0, j, : 3 - m].tolist() == list(range(a + 1 + m, a + 4))

    drafter = copy.deepcopy(cached)
    trainer = train_drafter(target, drafter, dataset, carryover=True, epochs=1, carry_temperature=1.0)
    accepted = [entry["first_draft_accepted"] for entry in trainer.state.log_history if "first_draft_accepted" in entry]
    assert accepted and all(0 <= value < 3 for value in accepted)
    for bad in ({"carryover": True, "carry_temperature": -1.0}, {"carryover": False, "carry_temperature": 1.0}):
        with pytest.raises(ValueError, match="carry_temperature"):
            train_drafter(target, drafter, dataset, epochs=1, **bad)


# ---------------------------------------------------------------------------------------------------------------
# Learning, E_carry, init from target
# ---------------------------------------------------------------------------------------------------------------


def mean_tau(target, drafter, dataset, rows=range(8), carryover=None):
    rounds = []
    for row in dataset.select(rows):
        mc.generate(target, torch.tensor([row["input_ids"][:6]]), assistant_model=drafter, max_new_tokens=40, carryover=carryover)
        rounds += drafter.generation_stats.rounds
    return mc.GenerationStats(rounds).acceptance_length


def test_training_lowers_the_loss_and_raises_acceptance():
    target = make_target("llama")
    dataset = greedy_dataset(target)
    drafter = make_drafter(target, block_size=4)
    untrained = mean_tau(target, drafter, dataset)
    trainer = train_drafter(target, drafter, dataset, epochs=8)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.6 * losses[0]
    trained = mean_tau(target, drafter, dataset)
    assert trained > untrained + 0.5, (untrained, trained)


def test_carry_embedding_moves_and_is_used():
    import copy

    target = make_target("llama")
    dataset = greedy_dataset(target)
    baseline = make_drafter(target, block_size=8)
    train_drafter(target, baseline, dataset, epochs=6)
    assert baseline.carry_embedding.abs().max() == 0  # the baseline objective does not touch it
    # carryover continues the baseline at a realistic drafter lr; E_carry with its own lr vs with the drafter's
    same_lr = copy.deepcopy(baseline)
    train_drafter(target, same_lr, dataset, carryover=True, epochs=3, lr=6e-4, carry_embedding_lr=None)
    drafter = copy.deepcopy(baseline)
    trainer = train_drafter(target, drafter, dataset, carryover=True, epochs=3, lr=6e-4)
    assert drafter.config.carryover
    logged = [e for e in trainer.state.log_history if "first_draft_accepted" in e]
    assert logged and all(e["carried_rows"] > 0 for e in logged)
    moved, moved_at_drafter_lr = drafter.carry_embedding.abs().max(), same_lr.carry_embedding.abs().max()
    assert moved > 4 * moved_at_drafter_lr, (moved, moved_at_drafter_lr)
    # ...and it is used: the same carried rows without the marker give other logits
    batch, recorded = _batch_of(target, drafter, torch.tensor([dataset[0]["input_ids"]]))
    anchors, valid = torch.tensor([[10, 20]]), torch.tensor([[True, True]])
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    transition = draft_verify(drafter, target, embed, lm_head, batch, recorded, anchors, valid, chunk_size=8)
    carried = (transition.carried[0], transition.carried[1], torch.ones_like(transition.carried[2]))
    with torch.no_grad():
        marked = drafter_hidden(drafter, embed, batch, transition.shifted_anchor_positions, carried)
        saved = drafter.carry_embedding.clone()
        drafter.carry_embedding.zero_()
        unmarked = drafter_hidden(drafter, embed, batch, transition.shifted_anchor_positions, carried)
        drafter.carry_embedding.copy_(saved)
    assert (marked - unmarked).abs().max() > 1e-3


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_first_pass_loss_weight_adds_the_baseline_loss_at_the_same_anchors(markov_rank):
    """first_pass_loss_weight w: the carryover loss becomes second pass + w x the baseline loss of the first pass at
    the same random anchors (loss and gradients), and the transition is unchanged; w = 0 is Algorithm 2 as published."""
    import copy

    from trainer.objectives import training_step_loss

    target, cached, dataset = trained_drafter("llama", 4, markov_rank)
    drafter = copy.deepcopy(cached)  # the cached drafter is shared with other tests: train a copy
    batch = pad_collator(list(dataset.select(range(4))))

    def loss_and_grads(carryover, weight):
        drafter.zero_grad()
        torch.manual_seed(0)  # the same anchors in every call
        settings = LossSettings(gamma=4.0, first_pass_weight=weight)
        loss, metrics = training_step_loss(drafter, target, batch, 8, settings, carryover=carryover)
        loss.backward()
        return loss.detach(), metrics, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in drafter.parameters()]

    second, second_metrics, second_grads = loss_and_grads(True, 0.0)
    first, _, first_grads = loss_and_grads(False, 0.0)
    mixed, mixed_metrics, mixed_grads = loss_and_grads(True, 0.5)
    torch.testing.assert_close(mixed, second + 0.5 * first)
    for g_mixed, g_second, g_first in zip(mixed_grads, second_grads, first_grads):
        torch.testing.assert_close(g_mixed, g_second + 0.5 * g_first, rtol=1e-4, atol=1e-6)
    assert mixed_metrics["first_draft_accepted"] == second_metrics["first_draft_accepted"]
    assert "first_pass_ce" in mixed_metrics and "first_pass_ce" not in second_metrics
    assert 0 < second_metrics["first_draft_accepted"] < 3  # some drafts accepted, some rejected: rows are carried
    trainer = train_drafter(target, drafter, dataset, carryover=True, epochs=1, first_pass_loss_weight=0.5)
    assert any("first_pass_ce" in entry for entry in trainer.state.log_history)
    for bad in ({"carryover": False, "first_pass_loss_weight": 0.5}, {"carryover": True, "first_pass_loss_weight": -1.0}):
        with pytest.raises(ValueError, match="first_pass_loss_weight"):
            train_drafter(target, drafter, dataset, epochs=1, **bad)
    for name in ("num_anchors", "verify_chunk_size"):  # zero would fail later with a misleading error
        with pytest.raises(ValueError, match=f"{name} must be at least 1, got 0"):
            train_drafter(target, drafter, dataset, epochs=1, carryover=True, **{name: 0})


def test_carry_rows_false_trains_the_shifted_anchors_without_rows():
    """carry_rows=False (the ablation of carryover's rows): the same draft-verify shift of the anchors, then the
    baseline objective at a' = a + m + 1 with no carried rows; E_carry is not trained, the checkpoint decodes without
    rows, and the flag needs --carryover."""
    import copy

    from trainer.objectives import training_step_loss

    target, cached, dataset = trained_drafter("llama", 4, 0)
    drafter = copy.deepcopy(cached)
    inputs = pad_collator([dataset[3]])
    settings = LossSettings(gamma=4.0)

    def step_loss(carry_rows):
        torch.manual_seed(0)  # the same anchors in every call
        with torch.no_grad():
            return training_step_loss(drafter, target, inputs, 8, settings, carryover=True, carry_rows=carry_rows)

    with_rows, rows_metrics = step_loss(True)
    without_rows, metrics = step_loss(False)
    # by hand: the same anchors, the transition, then the baseline loss at the shifted anchors
    batch, recorded = _batch_of(target, drafter, inputs["input_ids"])
    batch.loss_mask = inputs["loss_mask"]
    torch.manual_seed(0)
    anchors, valid = sample_anchors(batch.loss_mask, 8)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        transition = draft_verify(drafter, target, embed, lm_head, batch, recorded, anchors, valid, chunk_size=64)
        shifted, shifted_valid = transition.shifted_anchor_positions, transition.shifted_anchor_valid
        hidden = drafter_hidden(drafter, embed, batch, shifted)
        expected, _ = block_losses(drafter, lm_head, hidden, *blocks_at(batch, shifted, shifted_valid, 3), settings)
    torch.testing.assert_close(without_rows, expected)
    assert metrics["first_draft_accepted"] == rows_metrics["first_draft_accepted"]
    assert metrics["dropped_rows"] == rows_metrics["carried_rows"] > 0 and "carried_rows" not in metrics
    assert (with_rows - without_rows).abs() > 1e-4  # the rows the ablation drops do change the loss

    marker = drafter.carry_embedding.clone()
    trainer = train_drafter(target, drafter, dataset, carryover=True, epochs=1, carry_rows=False)
    assert torch.equal(drafter.carry_embedding, marker) and not drafter.config.carryover
    assert any("dropped_rows" in entry for entry in trainer.state.log_history)
    with pytest.raises(ValueError, match="carry_rows"):
        train_drafter(target, drafter, dataset, epochs=1, carry_rows=False)


@pytest.mark.parametrize("interface", ["projector", "none"])
def test_carryover_interface_ablations_train_and_decode(interface):
    """Table 3b's markers: switching a trained drafter's interface keeps every shared weight; carryover training then
    trains the projector (or runs with no marker at all), and decoding stays lossless."""
    from trainer.build import extend_drafter

    target, trained, dataset = trained_drafter("llama", 4, 0)
    drafter = extend_drafter(trained, carryover_interface=interface)
    before = drafter.state_dict()
    for name, weight in trained.state_dict().items():
        if name != "carry_embedding":
            assert torch.equal(before[name], weight), name
    assert set(before) - set(trained.state_dict()) == ({"carry_proj.weight"} if interface == "projector" else set())
    assert "carry_embedding" not in before
    train_drafter(target, drafter, dataset, carryover=True, epochs=1)
    if interface == "projector":
        assert drafter.carry_proj.weight.abs().sum() > 0  # it started at zero and learned
    assert any(r.carried for r in lossless_rounds(target, drafter, dataset, num_prompts=3, max_new_tokens=40))


def test_carry_gate_starts_as_the_checkpoint_then_opens_with_carryover_training(tmp_path):
    """`--drafter_checkpoint <drafter> --carry_gate true`: every shared weight is kept and the gates start at zero, so
    with carryover on the drafter proposes round for round what the checkpoint proposes with carryover off, although
    it reads carried rows; baseline training leaves the gates shut (frozen), carryover training opens them at their
    own learning rate; decoding stays lossless and the gates are saved and loaded with the weights."""
    import copy

    from trainer.build import DrafterArguments, build_drafter, extend_drafter

    target, trained, dataset = trained_drafter("llama", 4, 0)
    trained.save_pretrained(tmp_path / "trained")
    gated = build_drafter(target, DrafterArguments(drafter_checkpoint=str(tmp_path / "trained"), carry_gate=True)).eval()
    config = trained.config
    assert gated.carry_gate.shape == (config.num_hidden_layers, config.num_attention_heads)
    assert gated.carry_gate.abs().max() == 0
    for name, weight in trained.state_dict().items():
        assert torch.equal(gated.state_dict()[name], weight), name
    without_rows = lossless_rounds(target, trained, dataset, num_prompts=3, max_new_tokens=40, carryover=False)
    with_gated_rows = lossless_rounds(target, gated, dataset, num_prompts=3, max_new_tokens=40, carryover=True)
    assert any(r.carried for r in with_gated_rows)
    assert [r.drafts for r in with_gated_rows] == [r.drafts for r in without_rows]

    control = copy.deepcopy(gated)
    train_drafter(target, control, dataset, carryover=False, epochs=1)
    assert control.carry_gate.abs().max() == 0
    trainer = train_drafter(target, gated, dataset, carryover=True, epochs=1, carry_gate_lr=0.05)
    assert [g["lr"] for g in trainer.optimizer.param_groups if g.get("name") == "carry_gate"] == [0.05]
    assert gated.carry_gate.abs().min() > 0
    assert any(r.carried for r in lossless_rounds(target, gated.eval(), dataset, num_prompts=3, max_new_tokens=40))
    gated.save_pretrained(tmp_path / "gated")
    assert torch.equal(mc.CarryoverDrafterModel.from_pretrained(tmp_path / "gated").carry_gate, gated.carry_gate)
    grown = extend_drafter(gated, num_hidden_layers=config.num_hidden_layers + 1)
    assert torch.equal(grown.carry_gate[:-1], gated.carry_gate) and grown.carry_gate[-1].abs().max() == 0


def test_train_carry_only_moves_only_what_reads_the_rows(tmp_path):
    """`--train_carry_only`: gated carryover training moves E_carry and the gates and no other weight, so with its rows
    off the drafter proposes round for round what its starting checkpoint proposes, and with them on it decodes
    losslessly with carried rows; without carried rows the flag is refused."""
    from trainer.build import DrafterArguments, build_drafter

    target, trained, dataset = trained_drafter("llama", 4, 0)
    trained.save_pretrained(tmp_path / "trained")
    gated = build_drafter(target, DrafterArguments(drafter_checkpoint=str(tmp_path / "trained"), carry_gate=True))
    before = {name: weight.clone() for name, weight in gated.state_dict().items()}
    train_drafter(target, gated, dataset, carryover=True, epochs=2, carry_gate_lr=0.05, train_carry_only=True)
    assert {name for name, p in gated.named_parameters() if p.requires_grad} == {"carry_embedding", "carry_gate"}
    changed = {name for name, weight in gated.state_dict().items() if not torch.equal(weight, before[name])}
    assert changed == {"carry_embedding", "carry_gate"}
    rows_off = lossless_rounds(target, gated, dataset, num_prompts=3, max_new_tokens=40, carryover=False)
    checkpoint = lossless_rounds(target, trained, dataset, num_prompts=3, max_new_tokens=40, carryover=False)
    assert [r.drafts for r in rows_off] == [r.drafts for r in checkpoint]
    assert any(r.carried for r in lossless_rounds(target, gated, dataset, num_prompts=3, max_new_tokens=40))
    with pytest.raises(ValueError, match="train_carry_only"):
        train_drafter(target, gated, dataset, epochs=1, train_carry_only=True)


def test_markov_head_warm_starts_from_a_dflash_checkpoint(tmp_path):
    """`--drafter_checkpoint <DFlash drafter> --markov_rank r`: the Markov variant starts as the checkpoint (zero
    correction: the same drafts round by round), its objectives then train the new head, decoding stays lossless;
    a trained Markov head is not resized."""
    from trainer.build import DrafterArguments, build_drafter

    target, trained, dataset = trained_drafter("llama", 4, 0)
    trained.save_pretrained(tmp_path / "dflash")
    drafter = build_drafter(target, DrafterArguments(drafter_checkpoint=str(tmp_path / "dflash"), markov_rank=4))
    assert drafter.config.markov_rank == 4 and drafter.markov_proj.weight.abs().max() == 0
    trained_rounds = [r.drafts for r in lossless_rounds(target, trained, dataset, num_prompts=3, max_new_tokens=40)]
    assert [r.drafts for r in lossless_rounds(target, drafter, dataset, num_prompts=3, max_new_tokens=40)] == trained_rounds
    train_drafter(target, drafter, dataset, epochs=1)
    assert drafter.markov_proj.weight.abs().max() > 0
    lossless_rounds(target, drafter, dataset, num_prompts=3, max_new_tokens=40)
    drafter.save_pretrained(tmp_path / "markov")
    with pytest.raises(ValueError, match="markov_rank"):
        build_drafter(target, DrafterArguments(drafter_checkpoint=str(tmp_path / "markov"), markov_rank=8))


def test_more_layers_grow_from_a_trained_checkpoint(tmp_path):
    """`--drafter_checkpoint <drafter> --num_draft_layers <more>`: the new layers start with zero residual outputs, so
    the grown drafter drafts exactly as the checkpoint; training then moves them, decoding stays lossless; a
    checkpoint's layers are never dropped."""
    from trainer.build import DrafterArguments, build_drafter

    target, trained, dataset = trained_drafter("llama", 4, 0)
    trained.save_pretrained(tmp_path / "small")
    num_layers = trained.config.num_hidden_layers
    grown = build_drafter(target, DrafterArguments(drafter_checkpoint=str(tmp_path / "small"), num_draft_layers=num_layers + 2))
    assert grown.config.num_hidden_layers == len(grown.layers) == num_layers + 2
    assert grown.config.layer_types == trained.config.layer_types + trained.config.layer_types[-1:] * 2
    new_layer = grown.layers[-1]
    assert new_layer.self_attn.o_proj.weight.abs().max() == 0 and new_layer.mlp.down_proj.weight.abs().max() == 0
    assert torch.equal(new_layer.self_attn.q_proj.weight, trained.layers[-1].self_attn.q_proj.weight)
    trained_rounds = [r.drafts for r in lossless_rounds(target, trained, dataset, num_prompts=3, max_new_tokens=40)]
    assert [r.drafts for r in lossless_rounds(target, grown, dataset, num_prompts=3, max_new_tokens=40)] == trained_rounds
    train_drafter(target, grown, dataset, epochs=1)
    assert new_layer.self_attn.o_proj.weight.abs().max() > 0 and new_layer.mlp.down_proj.weight.abs().max() > 0
    lossless_rounds(target, grown, dataset, num_prompts=3, max_new_tokens=40)
    grown.save_pretrained(tmp_path / "grown")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        build_drafter(target, DrafterArguments(drafter_checkpoint=str(tmp_path / "grown"), num_draft_layers=num_layers))


def test_a_checkpoint_continues_on_larger_blocks(tmp_path):
    """`--drafter_checkpoint <drafter> --block_size <more>`: the same weights (no weight depends on the block size),
    rounds of block_size - 1 drafts and as many carried rows; carryover training runs on the larger blocks and
    decoding stays lossless."""
    from trainer.build import DrafterArguments, build_drafter

    target, trained, dataset = trained_drafter("llama", 4, 0)
    trained.save_pretrained(tmp_path / "block4")
    drafter = build_drafter(target, DrafterArguments(drafter_checkpoint=str(tmp_path / "block4"), block_size=7))
    assert drafter.config.block_size == 7 and trained.config.block_size == 4
    state = trained.state_dict()
    assert drafter.state_dict().keys() == state.keys()
    assert all(torch.equal(weight, state[name]) for name, weight in drafter.state_dict().items())
    train_drafter(target, drafter, dataset, carryover=True, epochs=1)
    rounds = lossless_rounds(target, drafter, dataset, num_prompts=3, max_new_tokens=40)
    assert max(len(r.drafts) for r in rounds) == 6 and max(r.carried for r in rounds) > 3  # beyond the old 3 slots
    with pytest.raises(ValueError, match="block_size must be at least 2"):
        build_drafter(target, DrafterArguments(drafter_checkpoint=str(tmp_path / "block4"), block_size=1))


def test_init_from_target_starts_lower():
    from trainer.build import DrafterArguments, build_drafter
    from trainer.objectives import training_step_loss

    target = make_target("llama")
    batch = pad_collator(list(greedy_dataset(target, num_rows=8)))
    losses = {}
    for init in (True, False):
        torch.manual_seed(0)
        drafter = build_drafter(target, DrafterArguments(num_draft_layers=2, block_size=4, init_from_target=init))
        with torch.no_grad():
            losses[init], _ = training_step_loss(drafter, target, batch, 16, LossSettings(gamma=4.0), carryover=False)
    assert losses[True] < losses[False]


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_chunked_loss_equals_one_pass(markov_rank):
    """The LM head runs over chunks of blocks under checkpointing: same loss, same gradients as one big pass."""
    target = make_target("llama")
    drafter = make_drafter(target, markov_rank=markov_rank)
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 3, 64)
    labels = torch.randint(0, 96, (2, 5, 3))
    valid = torch.rand(2, 5, 3) > 0.2
    prev = torch.randint(0, 96, (2, 5, 3))
    target_hidden = torch.randn(2, 5, 3, 64)
    results = []
    for chunk_size in (2, 64):
        drafter.zero_grad()
        leaf = hidden.clone().requires_grad_(True)
        loss, _ = block_losses(
            drafter, target.lm_head, leaf, labels, valid, prev, target_hidden, LossSettings(gamma=3.0, chunk_size=chunk_size)
        )
        loss.backward()
        grads = [leaf.grad] + [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
        results.append((loss.detach(), grads))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def assert_training_transition_reproduces_decoding(target, drafter, dataset):
    """From every decoding round that carried nothing (the first, or one after a full acceptance) and was partly
    rejected, the training transition (detached draft, parallel verification, shifted anchor, rejected rows) followed
    by the second drafter pass proposes exactly what carryover decoding proposed in the next round."""
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    checked = 0
    for row in dataset.select(range(8)):
        sequence = mc.generate(target, torch.tensor([row["input_ids"][:6]]), assistant_model=drafter, max_new_tokens=60)
        rounds = drafter.generation_stats.rounds
        batch, recorded = _batch_of(target, drafter, sequence)
        for current, following in zip(rounds, rounds[1:]):
            if current.carried or current.proposed != drafter.config.block_size - 1 or current.accepted == current.proposed:
                continue
            anchors, valid = torch.tensor([[current.anchor_position]]), torch.tensor([[True]])
            transition = draft_verify(drafter, target, embed, lm_head, batch, recorded, anchors, valid, chunk_size=4)
            assert transition.accepted_len.item() == current.accepted
            assert transition.shifted_anchor_positions.item() == following.anchor_position
            assert transition.carried[2].sum().item() == following.carried
            with torch.no_grad():
                hidden = drafter_hidden(drafter, embed, batch, transition.shifted_anchor_positions, transition.carried)
                logits = drafter.draft_logits(lm_head, hidden[0, 0, : following.proposed])
                drafts = drafter.draft_tokens(logits, sequence[0, following.anchor_position])
            assert drafts.tolist() == following.drafts
            checked += 1
    assert checked >= 3


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_draft_verify_draft_reproduces_two_decoding_rounds(markov_rank):
    """Algorithm 2 against Algorithm 1 end to end (`assert_training_transition_reproduces_decoding`)."""
    target, drafter, dataset = trained_drafter("llama", 8, markov_rank)
    assert_training_transition_reproduces_decoding(target, drafter, dataset)


def test_training_benchmark_compares_dtypes_side_by_side(tmp_path):
    """trainer/bench_training.py --target_dtypes float32 bfloat16: every mode in each dtype in one run, and each mode's
    step time in bf16 against the same mode in float32, from exactly those measurements."""
    from trainer import bench_training

    make_target("llama").save_pretrained(tmp_path / "target")
    output = tmp_path / "bench.json"
    before = torch.get_num_threads()
    try:
        report = bench_training.main([
            "--target", str(tmp_path / "target"), "--num_draft_layers", "1", "--block_size", "4", "--steps", "1",
            "--batch_size", "1", "--num_anchors", "4", "--synthetic_length", "40", "--modes", "baseline", "carryover",
            "--target_dtypes", "float32", "bfloat16", "--output", str(output), "--threads", "1",
        ])
    finally:
        torch.set_num_threads(before)
    assert json.loads(output.read_text()) == json.loads(json.dumps(report))
    modes = report["modes"]
    assert sorted(modes) == ["baseline/bfloat16", "baseline/float32", "carryover/bfloat16", "carryover/float32"]
    seconds = {name: entry["seconds_per_step"] for name, entry in modes.items()}
    for mode in ("baseline", "carryover"):
        ratio = report[f"{mode}_seconds_per_step_bfloat16_vs_float32"]
        assert ratio == pytest.approx(seconds[f"{mode}/bfloat16"] / seconds[f"{mode}/float32"])
    for dtype in ("float32", "bfloat16"):
        assert report[f"carryover_step_cost_vs_baseline/{dtype}"] == pytest.approx(
            seconds[f"carryover/{dtype}"] / seconds[f"baseline/{dtype}"]
        )
    assert isinstance(report["cpu_bf16_is_emulated"], bool)
