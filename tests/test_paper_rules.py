"""The paper's rules, computed by hand on small cases: each test can fail when the rule it names changes.

- Algorithm 2 / Appendix B.1: the second drafter pass is trained at the shifted anchor a' = a + m + 1 on the recorded
  continuation y_{>a'}, with the rejected rows of the first proposal carried (E_carry added to them only), position
  weights w_k = exp(-(k-1)/gamma) on the valid labels only; a' must be a response token (multi-turn rows).
- Eq. 2 / Algorithm 1: E_carry marks the carried rows only; with no carried rows (carryover OFF) a drafter whose
  E_carry is non-zero computes exactly what it computes with E_carry zeroed.
- Eq. 3 (Section 5.2): the re-convergence count R of a rejected round, on synthetic rounds and on recorded ones.
- Appendix C: the attention share on [context ; carried ; block] keys, on synthetic attention probabilities.
- Appendix D: the per-subset normalisation by baseline tau and the Pearson r with the carryover gain.

The references here are written from the definitions with plain target forwards and one-block drafter forwards (the
decoding layout), never with the trainer's or the analysis's own helpers.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_drafter, make_target

import modeling_carryover as mc
from evaluation import analyze
from modeling_carryover.generation_carryover import DraftRound
from trainer.objectives import Batch, LossSettings, block_losses, draft_verify, training_step_loss
from trainer.verification import BranchVerification, target_pass

# ---------------------------------------------------------------------------------------------------------------
# References from the definitions
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def feature_rows(target, drafter, ids):
    """The target features of every position of `ids` [1, L] by hand: the outputs of decoder layers
    `target_layer_ids` (HF tuple entry id + 1; entry 0 is the embeddings), concatenated. -> [L, F]"""
    hidden_states = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden_states[i + 1][0] for i in drafter.config.target_layer_ids], dim=-1)


@torch.no_grad()
def block_logits(target, drafter, tokens, features, anchor, carried=None):
    """One block [token[a], MASK x c] at positions a .. a + c as decoding drafts it: committed context rows < a, plus
    `carried` = (feature rows [R, F], their positions [R]). -> slot logits [c, V] (slot k predicts token[a + k])."""
    B = drafter.config.block_size
    block = torch.full((1, 1, B), drafter.config.mask_token_id)
    block[0, 0, 0] = tokens[anchor]
    carried_kwargs = {}
    if carried is not None:
        carried_kwargs = dict(carried_features=carried[0][None, None], carried_position_ids=carried[1][None, None])
    out = drafter(
        target.get_input_embeddings()(block),
        torch.arange(anchor, anchor + B)[None, None],
        context_features=features[None, :anchor],
        context_position_ids=torch.arange(anchor)[None],
        **carried_kwargs,
    )
    return target.lm_head(out.last_hidden_state[0, 0, 1:])


def num_valid_labels(loss_mask, a, c):
    """Labels token[a + k], k = 1 .. c, count while they lie inside the row and in the loss mask (no gap crossed)."""
    n = 0
    while n < c and a + n + 1 < len(loss_mask) and loss_mask[a + n + 1]:
        n += 1
    return n


def reference_carryover_loss(target, drafter, ids, loss_mask, gamma):
    """Algorithm 2 for one recorded row, anchor by anchor (every a with loss_mask[a] and loss_mask[a + 1]):
    greedy draft d at a; m = leading drafts equal to the record (while labels are valid); a' = a + m + 1, kept when
    it is inside the row and a response token; carried rows = the target's states at the rejected branch positions
    a + m + 1 .. a + c of [y_{<=a} ; d]; second draft at a' with those rows; loss = sum_k w_k CE_k / sum_k w_k over
    the valid labels y_{a'+k} of all kept anchors, w_k = exp(-(k-1)/gamma).
    Returns (loss, [(a, m, a', kept)])."""
    tokens, mask = ids[0].tolist(), loss_mask[0].tolist()
    T, c = len(tokens), drafter.config.block_size - 1
    features = feature_rows(target, drafter, ids)
    weighted, total, transitions = 0.0, 0.0, []
    for a in range(T - 1):
        if not (mask[a] and mask[a + 1]):
            continue
        drafts = block_logits(target, drafter, tokens, features, a).argmax(-1).tolist()
        m = 0
        while m < num_valid_labels(mask, a, c) and drafts[m] == tokens[a + 1 + m]:
            m += 1
        shifted = a + m + 1
        kept = shifted < T and bool(mask[shifted])
        transitions.append((a, m, shifted, kept))
        if not kept:
            continue
        carried = None
        if m < c:  # rejected branch positions a + m + 1 .. a + c, computed after [y_{<=a} ; d]
            branch = feature_rows(target, drafter, torch.tensor([tokens[: a + 1] + drafts]))
            carried = (branch[shifted:], torch.arange(shifted, a + c + 1))
        logits = block_logits(target, drafter, tokens, features, shifted, carried)
        for k in range(1, num_valid_labels(mask, shifted, c) + 1):
            w = math.exp(-(k - 1) / gamma)
            weighted += w * F.cross_entropy(logits[k - 1], torch.tensor(tokens[shifted + k])).item()
            total += w
    return weighted / total, transitions


def plant_accepted_drafts(target, drafter, ids, anchor, num_accepted):
    """Rewrite the record after `anchor` so that its first `num_accepted` drafts repeat it and the next one does not
    (the draft at a depends only on the record up to a, which is left unchanged)."""
    tokens = ids[0].tolist()
    drafts = block_logits(target, drafter, tokens, feature_rows(target, drafter, ids), anchor).argmax(-1).tolist()
    ids = ids.clone()
    ids[0, anchor + 1 : anchor + 1 + num_accepted] = torch.tensor(drafts[:num_accepted])
    if num_accepted < len(drafts) and anchor + 1 + num_accepted < ids.shape[1]:
        ids[0, anchor + 1 + num_accepted] = (drafts[num_accepted] + 1) % target.config.vocab_size
    return ids


def trainer_loss(target, drafter, ids, loss_mask, gamma):
    """The trainer's carryover loss on one row with every eligible anchor sampled."""
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    torch.manual_seed(0)
    return training_step_loss(drafter, target, inputs, ids.shape[1], LossSettings(gamma=gamma), carryover=True, chunk_size=4)


def carryover_drafter(target, block_size=4, seed=1):
    """A random drafter with a non-zero E_carry, so that the marker of the carried rows matters."""
    drafter = make_drafter(target, block_size=block_size, seed=seed)
    with torch.no_grad():
        drafter.carry_embedding.normal_(std=2.0)
    return drafter


# ---------------------------------------------------------------------------------------------------------------
# Algorithm 2: the second pass at a' = a + m + 1
# ---------------------------------------------------------------------------------------------------------------


def test_second_pass_loss_at_the_shifted_anchor_by_hand():
    """The carryover loss of `training_step_loss` equals Algorithm 2 computed by hand: second draft at a' = a + m + 1
    with the rejected rows, labels y_{a'+k}, position weights on valid labels only (the last anchors' blocks run past
    the row's end). The record is arranged so that m takes the values 0, 2 and c (full acceptance: no carried rows)."""
    target = make_target("llama")
    drafter = carryover_drafter(target)
    ids = target.generate(torch.tensor([[5, 17, 40, 3]]), max_new_tokens=16, do_sample=False)  # T = 20
    ids = plant_accepted_drafts(target, drafter, ids, anchor=5, num_accepted=2)
    ids = plant_accepted_drafts(target, drafter, ids, anchor=11, num_accepted=3)
    loss_mask = torch.tensor([[0] * 4 + [1] * 16])
    gamma = 2.0
    expected, transitions = reference_carryover_loss(target, drafter, ids, loss_mask, gamma)
    accepted = {a: m for a, m, _, _ in transitions}
    assert accepted[5] == 2 and accepted[11] == 3 and 0 in accepted.values()
    loss, metrics = trainer_loss(target, drafter, ids, loss_mask, gamma)
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    assert metrics["first_draft_accepted"].item() == pytest.approx(sum(accepted.values()) / len(accepted))


def test_multi_turn_row_never_anchors_on_a_non_response_token():
    """A two-turn row [prompt | answer 1 | one non-response token | answer 2]: a first proposal accepted up to the end
    of answer 1 shifts its anchor onto the non-response token, which is no anchor (the block there would otherwise
    learn answer 2 from a token the target did not write); labels never cross the gap."""
    target = make_target("llama")
    drafter = carryover_drafter(target)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    ids = target.generate(torch.tensor([[9, 31, 2]]), max_new_tokens=12, do_sample=False)  # T = 15
    ids = plant_accepted_drafts(target, drafter, ids, anchor=3, num_accepted=2)  # the drafts repeat tokens 4, 5
    expected, transitions = reference_carryover_loss(target, drafter, ids, loss_mask, gamma=2.0)
    assert (3, 2, 6, False) in transitions  # a' = 6 is the gap token

    recorded = target_pass(target, ids, torch.ones_like(ids), drafter.feature_hidden_state_indices, use_cache=True)
    batch = Batch(ids, torch.ones_like(ids), loss_mask, drafter.target_features(recorded.hidden_states), None)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    anchors, valid = torch.tensor([[3, 8]]), torch.tensor([[True, True]])
    transition = draft_verify(drafter, target, embed, lm_head, batch, recorded, anchors, valid, chunk_size=4)
    assert transition.accepted_len[0, 0].item() == 2  # the third label (token 6) is outside the mask: not compared
    assert transition.shifted_anchor_valid[0].tolist() == [False, True]

    loss, _ = trainer_loss(target, drafter, ids, loss_mask, gamma=2.0)
    assert loss.item() == pytest.approx(expected, rel=1e-4)


def test_loss_with_one_invalid_slot_by_hand():
    """Position weights are zero where a label is invalid: a block whose third label lies past the response and a
    block at a padding anchor add nothing to the loss (numerator or normaliser)."""
    drafter = make_drafter(make_target("llama"))  # DFlash: the loss is the position-weighted cross-entropy
    lm_head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))  # logits = [h0, h1, 0]
    hidden = torch.tensor([[[[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]], [[0.0, 4.0], [1.0, 1.0], [5.0, 0.0]]]])
    labels = torch.tensor([[[0, 2, 1], [0, 0, 2]]])
    label_valid = torch.tensor([[[True, True, False], [False, False, False]]])
    prev = torch.zeros_like(labels)  # unused without a Markov head
    loss, metrics = block_losses(drafter, lm_head, hidden, labels, label_valid, prev, None, LossSettings(gamma=1.0))
    ce1 = -math.log(math.exp(2) / (math.exp(2) + 2))  # logits [2, 0, 0], label 0
    ce2 = -math.log(1 / (math.e + 2))  # logits [0, 1, 0], label 2
    w2 = math.exp(-1.0)
    assert loss.item() == pytest.approx((ce1 + w2 * ce2) / (1 + w2), rel=1e-6)
    assert metrics["accuracy"].item() == 0.5  # slot 1 right, slot 2 wrong; the invalid slots are not counted


# ---------------------------------------------------------------------------------------------------------------
# Eq. 2: E_carry marks carried rows only
# ---------------------------------------------------------------------------------------------------------------


def test_carryover_off_equals_carry_embedding_zeroed():
    """With no carried rows, a drafter with a non-zero E_carry computes exactly what it computes with E_carry zeroed
    (committed context rows never get the marker), in decoding (carryover OFF) and in one forward; carried rows get
    it added once, before F: rows H with E_carry = rows H + E_carry with E_carry zeroed."""
    target = make_target("llama")
    drafter = carryover_drafter(target)
    marker = drafter.carry_embedding.detach().clone()
    prompt = torch.tensor([[7, 70, 12, 55, 3, 41]])

    def decode(carryover):
        states = []
        hook = drafter.register_forward_hook(lambda module, args, out: states.append(out.last_hidden_state.clone()))
        try:
            output = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=24, carryover=carryover)
        finally:
            hook.remove()
        return output, states, drafter.generation_stats.rounds

    off, on = decode(False), decode(True)
    assert any(r.carried for r in on[2])
    features = feature_rows(target, drafter, off[0])
    tokens = off[0][0].tolist()
    rows, positions = torch.randn(3, features.shape[-1]), torch.arange(10, 13)
    with_marker = [block_logits(target, drafter, tokens, features, 10, carried) for carried in (None, (rows, positions))]
    with torch.no_grad():
        drafter.carry_embedding.zero_()
    off_zeroed, on_zeroed = decode(False), decode(True)
    zeroed = [block_logits(target, drafter, tokens, features, 10, carried) for carried in (None, (rows + marker, positions))]

    assert torch.equal(off[0], off_zeroed[0]) and len(off[1]) == len(off_zeroed[1])
    for a, b in zip(off[1], off_zeroed[1]):
        assert torch.equal(a, b)
    assert torch.equal(with_marker[0], zeroed[0])
    torch.testing.assert_close(with_marker[1], zeroed[1], atol=1e-5, rtol=1e-5)
    # the marker is live where rows are carried: ON decoding is not the same computation without it
    assert len(on[1]) != len(on_zeroed[1]) or any(not torch.equal(a, b) for a, b in zip(on[1], on_zeroed[1]))
    assert not torch.allclose(with_marker[1], block_logits(target, drafter, tokens, features, 10, (rows, positions)))


# ---------------------------------------------------------------------------------------------------------------
# Eq. 3: re-convergence
# ---------------------------------------------------------------------------------------------------------------


def reconvergence_by_hand(predictions, committed):
    """Eq. 3 written out: R = sum_q 1[exists delta in {-1, 0, +1}: z_{q+delta} = y_q], out-of-range ignored."""
    count = 0
    for q, y in enumerate(committed):
        if y is None:
            continue
        neighbours = [predictions[i] for i in (q - 1, q, q + 1) if 0 <= i < len(predictions)]
        count += y in neighbours
    return count


def test_rejected_round_statistics_on_synthetic_rounds():
    """Three recorded rounds of K = 6 drafts over the output y_i = 10 + i (positions 0 .. 19), by hand. Branch slot k
    holds draft k at position a + k, and the verifier's top-1 there predicts position a + k + 1.

    round 0: a = 2, m = 1; rejected slots 2..6 (L = 5) predict positions 5..9: y_q = 15 + q = [15 16 17 18 19];
             z = [15 70 71 72 19]: q = 0 (z_0) and q = 4 (z_4) re-converge -> R = 2. Drafts after the first rejection
             (3..6) equal the verifier's top-1 at the slot before them for drafts 3 and 5 -> 2 matches.
    round 1: fully accepted -> no statistics.
    round 2: a = 16, 3 proposed (length cap), m = 0; rejected slots 1..3 predict positions 18, 19, 20:
             y = [28, 29, beyond the output]; z = [29, 28, 50]: q = 0 (z_1), q = 1 (z_0) -> R = 2; draft 2 = 29 matches.
    Slots past a round's proposal are padding (their verifier tokens 90.. are never read)."""
    M = 95  # the mask token pads short proposals
    sequence = torch.arange(10, 30)[None]
    recording = analyze.Recording(
        sequence=sequence,
        anchors=torch.tensor([[2, 9, 16]]),
        drafts=torch.tensor([[[13, 60, 15, 61, 71, 62], list(range(20, 26)), [40, 29, 42, M, M, M]]]),
        proposed=torch.tensor([6, 6, 3]),
        accepted=torch.tensor([1, 6, 0]),
        hidden_states=(),
        branches=BranchVerification(
            hidden_states=(),
            greedy_tokens=torch.tensor([[[13, 14, 15, 70, 71, 72, 19], list(range(20, 27)), [27, 29, 28, 50, 90, 91, 92]]]),
            accepted_len=torch.tensor([[1, 6, 0]]),
        ),
    )
    assert analyze.rejected_round_statistics(recording) == [
        {"rejected": 5, "reconvergence": 2, "post_rejection_matches": 2},
        {"rejected": 3, "reconvergence": 2, "post_rejection_matches": 1},
    ]
    assert reconvergence_by_hand([15, 70, 71, 72, 19], [15, 16, 17, 18, 19]) == 2
    assert reconvergence_by_hand([29, 28, 50], [28, 29, None]) == 2


def recorded_carryover_generation():
    """A tiny target, a carryover drafter (block 5) and the analysis's recording of 30 greedy tokens."""
    target = make_target("llama")
    drafter = carryover_drafter(target, block_size=5)
    prompt = torch.tensor([[4, 61, 23, 8, 90, 33]])
    recording = analyze.record(
        target, drafter, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, 30,
        drafter.feature_hidden_state_indices,
    )
    return target, drafter, recording


def test_reconvergence_of_recorded_rounds_from_plain_target_forwards():
    """For every rejected round of a real carryover generation: the verifier's top-1 along the rejected branch from a
    plain target forward over [output up to the anchor ; the round's drafts], the eventually committed tokens from
    the final output, and Eq. 3 by hand give the analysis's R and rejected count."""
    target, drafter, recording = recorded_carryover_generation()
    output = recording.sequence[0].tolist()
    expected = []
    for r in drafter.generation_stats.rounds:
        if r.accepted == r.proposed:
            continue
        a, m, p = r.anchor_position, r.accepted, r.proposed
        with torch.no_grad():
            greedy = target(torch.tensor([output[: a + 1] + r.drafts])).logits[0, a:].argmax(-1).tolist()
        assert greedy[m] != r.drafts[m] and greedy[:m] == r.drafts[:m]  # the round's verification, as recorded
        predictions = greedy[m + 1 : p + 1]  # rejected slot m + 1 + q predicts position a + m + 2 + q
        committed = [output[a + m + 2 + q] if a + m + 2 + q < len(output) else None for q in range(p - m)]
        expected.append((p - m, reconvergence_by_hand(predictions, committed)))
    statistics = analyze.rejected_round_statistics(recording)
    assert [(s["rejected"], s["reconvergence"]) for s in statistics] == expected
    assert len(expected) >= 3


# ---------------------------------------------------------------------------------------------------------------
# Appendix C: attention share; Appendix D: normalisation and correlation
# ---------------------------------------------------------------------------------------------------------------


def one_hot_attention(keys, spec):
    """[1, n, H, B, keys] probabilities: spec[round][head][slot] = the key that slot's query attends to (prob 1)."""
    n, H, B = len(spec), len(spec[0]), len(spec[0][0])
    probs = torch.zeros(1, n, H, B, keys)
    for i, heads in enumerate(spec):
        for h, slots in enumerate(heads):
            for b, key in enumerate(slots):
                probs[0, i, h, b, key] = 1.0
    return probs


def test_attention_shares_on_synthetic_probabilities():
    """Keys are [context rows 0..2 ; carried rows 3..4 ; block 5..6] (T = 3, R = 2, B = 2); every query attends to one
    key. Shares average over layers, heads and query slots. The attended keys sit on both sides of each boundary."""
    layer0 = one_hot_attention(7, [[[2, 3], [4, 5]], [[0, 6], [2, 2]]])
    layer1 = one_hot_attention(7, [[[3, 3], [3, 3]], [[5, 6], [1, 4]]])
    carried = torch.zeros(1, 2, 2, 6)  # only its number of rows is read
    shares = analyze.attention_shares((layer0, layer1), num_context=3, carried_features=carried)
    # round 0: keys 2, 3, 4, 5, 3, 3, 3, 3 -> context 1/8, carried 6/8, block 1/8
    # round 1: keys 0, 6, 2, 2, 5, 6, 1, 4 -> context 4/8 (0, 2, 2, 1), carried 1/8 (4), block 3/8 (6, 5, 6)
    torch.testing.assert_close(shares, torch.tensor([[1 / 8, 6 / 8, 1 / 8], [4 / 8, 1 / 8, 3 / 8]]))

    # without carried rows: keys [context 0..2 ; block 3..4]
    no_rows = one_hot_attention(5, [[[2, 3], [3, 4]]])
    torch.testing.assert_close(
        analyze.attention_shares((no_rows,), num_context=3, carried_features=None), torch.tensor([[1 / 4, 0.0, 3 / 4]])
    )

    # gated carried rows (gate -0.5): keys [context 0 ; carried 1..2 ; block 3]; the query puts 1 on key 0 and -0.5 x
    # (0.5, 0.5) on the carried rows -> magnitudes 1 and 0.5 of 1.5
    gated = torch.tensor([1.0, -0.25, -0.25, 0.0]).view(1, 1, 1, 1, 4)
    torch.testing.assert_close(
        analyze.attention_shares((gated,), num_context=1, carried_features=torch.zeros(1, 1, 2, 6)),
        torch.tensor([[2 / 3, 1 / 3, 0.0]]),
    )


def test_attention_replay_puts_no_mass_on_absent_carried_rows():
    """In the ON replay of recorded rounds, a round without carried rows has a carried share of exactly 0 (masked
    keys) and the others a positive one; the shares of a round sum to 1."""
    target, drafter, recording = recorded_carryover_generation()
    carried = analyze.carried_rows(drafter, recording)
    shares = analyze.replay(target, drafter, recording, carried, attention=True, chunk_size=4).attention_shares
    num_rows = carried[2][0].sum(-1)
    assert (num_rows == 0).any() and (num_rows > 0).any()
    assert torch.equal(shares[num_rows == 0, 1], torch.zeros(int((num_rows == 0).sum())))
    assert (shares[num_rows > 0, 1] > 0).all()
    torch.testing.assert_close(shares.sum(-1), torch.ones(len(num_rows)))


def test_reconvergence_summary_normalises_by_baseline_tau_and_correlates_by_hand():
    """Three subsets with known rounds: normalised statistic = per-rejected-round mean / baseline tau, gain =
    carryover tau / baseline tau - 1, and r = the Pearson correlation written out."""

    def rounds(accepted):
        return [DraftRound(anchor_position=0, proposed=3, carried=0, committed_rows=0, accepted=m) for m in accepted]

    def stats(values):
        return [{"rejected": 3, "reconvergence": v, "post_rejection_matches": 0} for v in values]

    per_subset = {
        "a": {"on_rounds": rounds([3, 1]), "baseline_rounds": rounds([1, 1]), "rejected": stats([2, 0])},
        "b": {"on_rounds": rounds([2, 2]), "baseline_rounds": rounds([3, 1]), "rejected": stats([3])},
        "c": {"on_rounds": rounds([3, 3, 0]), "baseline_rounds": rounds([1, 0, 2]), "rejected": stats([1, 2, 3])},
    }
    summary = analyze.summarize_reconvergence(per_subset)
    # baseline tau: a 2, b 3, c 2; carryover tau: a 3, b 3, c 3 -> gains 0.5, 0, 0.5
    # R per rejected round: a 1, b 3, c 2 -> normalised 1/2, 1, 1
    rows = {row["subset"]: row for row in summary["subsets"]}
    assert [rows[s]["baseline_tau"] for s in "abc"] == [2.0, 3.0, 2.0]
    assert [rows[s]["carryover_gain"] for s in "abc"] == pytest.approx([0.5, 0.0, 0.5])
    assert [rows[s]["normalized_reconvergence"] for s in "abc"] == pytest.approx([0.5, 1.0, 1.0])
    xs, ys = [0.5, 1.0, 1.0], [0.5, 0.0, 0.5]
    mx, my = sum(xs) / 3, sum(ys) / 3
    r = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(
        sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys)
    )
    assert r == pytest.approx(-0.5)
    assert summary["correlation"]["normalized_reconvergence"] == pytest.approx(r)
    # 3 rejected rows per round everywhere: normalised 3/2, 1, 3/2, in step with the gains; no matches: no spread
    assert summary["correlation"]["normalized_rejected"] == pytest.approx(1.0)
    assert summary["correlation"]["normalized_post_rejection_matches"] is None
