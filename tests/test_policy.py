"""The speculation policy (`speculation_policy="adaptive"`): each round a drafted block (and how many of its drafts to
verify), a prompt-lookup candidate or a plain step, by expected tokens per second. Its parts on their own (the n-gram
proposer, the measured costs, the calibrated acceptance, the choices), and exactness with every kind of round mixed
in one generation, with and without carried rows, at T=0 (greedy equality) and T>0 (the enumeration test)."""

import itertools

import pytest
import torch
from conftest import trained_drafter
from test_decoding import prompts_for
from test_sampling import exact_marginals, sampled_marginals, tiny_sampling_setup, total_variation
from transformers import LogitsProcessorList

import modeling_carryover as mc
from modeling_carryover.generation_carryover import (
    MAX_BACKOFF,
    WARMUP_DRAFTED_ROUNDS,
    NgramAcceptance,
    PolicyState,
    SlotAcceptance,
    SpeculationPolicy,
    VerifyCosts,
    best_length,
    ngram_candidate,
)


def test_ngram_candidate_continues_the_most_recent_longest_match():
    ids = torch.tensor([5, 1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 4, 2, 3])
    # the tail's 3-gram (4, 2, 3) never occurred before; its 2-gram (2, 3) did, most recently at positions 7-8
    candidate, n = ngram_candidate(ids, max_ngram=3, max_tokens=4)
    assert (candidate.tolist(), n) == ([7, 6, 4, 2], 2)
    candidate, n = ngram_candidate(torch.tensor([1, 2, 3, 1, 2, 3]), max_tokens=2)
    assert (candidate.tolist(), n) == ([1, 2], 3)  # the longest match first
    assert ngram_candidate(torch.tensor([1, 2, 3, 4]))[0].numel() == 0  # nothing recurs
    candidate, n = ngram_candidate(torch.tensor([7]))
    assert candidate.numel() == 0 and n == 0


def test_verify_costs_interpolate_between_measured_row_counts_and_follow_the_machine():
    costs = VerifyCosts()
    costs.observe(1, 0.010)
    assert costs(1) == 0.010 and costs(8) is None  # one row count measured: nothing to interpolate from
    costs.observe(8, 0.024)
    assert costs(4) == pytest.approx(0.016) and costs(10) == pytest.approx(0.028)  # linear, extrapolated past 8
    for _ in range(30):  # the machine slows down (a second process): the moving average follows it...
        costs.observe(8, 0.048)
    assert costs(8) == pytest.approx(0.048, rel=0.01)
    assert costs(1) == pytest.approx(0.020, rel=0.01)  # ...and the plain step, not measured meanwhile, moves along


def test_slot_acceptance_calibrates_the_drafters_confidence_online():
    """A drafter 90% sure of drafts the target accepts 30% of the time: the model starts at 0.9 and learns 0.3; slots
    after the first rejection get no label."""
    model = SlotAcceptance(num_slots=3)
    confidence = torch.tensor([0.9, 0.9, 0.9])
    assert model(confidence).tolist() == pytest.approx([0.9, 0.9, 0.9])
    generator = torch.Generator().manual_seed(0)
    for _ in range(2000):
        accepted = 0
        while accepted < 3 and torch.rand(1, generator=generator) < 0.3:
            accepted += 1
        model.observe(confidence, verified=3, accepted=accepted)
    assert model(confidence)[0] == pytest.approx(0.3, abs=0.05)
    untouched = SlotAcceptance(num_slots=3)
    untouched.observe(confidence, verified=1, accepted=1)  # slot 0 accepted, slots 1-2 never judged
    assert untouched.weights[1:].tolist() == [[1.0, 0.0], [1.0, 0.0]]


def test_best_length_weighs_expected_tokens_against_the_measured_verification_cost():
    survival = torch.tensor([0.9, 0.5, 0.3, 0.2])
    cheap, dear = VerifyCosts(), VerifyCosts()
    cheap.observe(1, 0.010), cheap.observe(5, 0.011)  # a GPU-like forward: rows almost free
    dear.observe(1, 0.010), dear.observe(5, 0.050)  # torch's default CPU GEMM: each row costs a plain step
    assert best_length(survival, 0.001, cheap)[0] == 4
    k, tokens, rate = best_length(survival, 0.001, dear)
    assert k == 1 and tokens == pytest.approx(1.9) and rate == pytest.approx(1.9 / 0.021)


def policy_with(drafted_tokens, drafted_seconds, plain_seconds=0.010, row_seconds=0.002, ngram_accepted=None):
    state = PolicyState(SlotAcceptance(7), NgramAcceptance(10), draft_seconds=0.002, drafted_tokens=drafted_tokens,
                        drafted_seconds=drafted_seconds, drafted_rounds=WARMUP_DRAFTED_ROUNDS + 1)
    if ngram_accepted is not None:
        state.ngram.reached[:] += 100
        state.ngram.accepted[:] += ngram_accepted * 100
    costs = VerifyCosts()
    costs.observe(1, plain_seconds), costs.observe(8, plain_seconds + 7 * row_seconds)
    return SpeculationPolicy(state, costs)


def test_the_policy_drafts_where_it_pays_skips_where_it_does_not_and_probes_again_after_a_backoff():
    no_repeat = torch.arange(20)
    assert policy_with(drafted_tokens=2.5, drafted_seconds=0.020).choose_round(no_repeat, 10) == ("draft", None)

    losing = policy_with(drafted_tokens=1.1, drafted_seconds=0.020)  # 55 tokens/s against plain's 100
    kinds = []
    for _ in range(40):
        kind, _ = losing.choose_round(no_repeat, 10)
        kinds.append(kind)
        if kind == "draft":  # the probe loses again: the backoff doubles
            losing.observe(mc.DraftRound(0, 1, 0, 0, kind="draft", accepted=0, draft_seconds=0.002,
                                         verify_seconds=0.012), torch.tensor([0.5]))
    probes = [i for i, kind in enumerate(kinds) if kind == "draft"]
    assert kinds[0] == "plain" and len(probes) >= 3
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0] and max(gaps) <= MAX_BACKOFF + 1

    # a recurring n-gram whose candidates the target has accepted: cheaper tokens than drafting
    repeating = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    kind, candidate = policy_with(drafted_tokens=2.0, drafted_seconds=0.020, ngram_accepted=0.9).choose_round(repeating, 10)
    assert kind == "ngram" and candidate.tolist()[:3] == [4, 5, 6]


class SchedulePolicy(SpeculationPolicy):
    """Round kinds from a fixed cycle and 1..c verified drafts in turn, so that every kind of round occurs, mixed, in
    one generation; it still learns (observe) as the adaptive policy does."""

    def __init__(self, drafter, target, do_sample, kinds=("draft", "draft", "ngram", "plain", "draft", "ngram"), start=0):
        base = SpeculationPolicy.for_drafter(drafter, target, do_sample)
        super().__init__(base.state, base.verify_costs)
        self.kinds, self.lengths = itertools.islice(itertools.cycle(kinds), start, None), itertools.cycle([3, 1, 2])

    def choose_round(self, ids, max_candidates):
        kind = next(self.kinds)
        if kind == "ngram":
            candidate, self.ngram_size = ngram_candidate(ids, max_tokens=min(4, max_candidates))
            return ("ngram", candidate) if len(candidate) else ("plain", None)
        return kind, None

    def choose_num_drafts(self, confidence):
        return min(next(self.lengths), len(confidence)), 0.0


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_every_kind_of_round_mixed_in_one_generation_is_lossless_at_t0(markov_rank):
    target, drafter, dataset = trained_drafter("llama", 4, markov_rank)
    rounds = []
    for prompt in prompts_for(dataset, target):
        for max_new_tokens in (1, 5, 40):
            expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            for carryover in (True, False):
                policy = SchedulePolicy(drafter, target, do_sample=False)
                out = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=max_new_tokens,
                                  do_sample=False, carryover=carryover, speculation_policy=policy)
                assert torch.equal(out, expected), (max_new_tokens, carryover)
                rounds += [(carryover, r) for r in drafter.generation_stats.rounds]
    kinds = {r.kind for _, r in rounds}
    assert kinds == {"draft", "ngram", "plain"}
    assert any(r.kind == "ngram" and r.accepted > 0 for _, r in rounds)  # candidates were accepted, not only refused
    carried = [r for on, r in rounds if on and r.kind == "draft" and r.carried > 0]
    assert carried  # carried rows took part
    assert {r.proposed for _, r in rounds if r.kind == "draft"} >= {1, 2, 3}
    assert all(r.carried == 0 for _, r in rounds if r.kind != "draft")
    # a drafted round right after an n-gram or plain round carries nothing: those rejected no drafter rows
    for (_, previous), (_, this) in zip(rounds, rounds[1:]):
        if previous.kind != "draft" and this.kind == "draft" and this.anchor_position > previous.anchor_position:
            assert this.carried == 0


def test_the_adaptive_policy_is_lossless_and_records_its_rounds():
    """The real policy, timings and all: whatever it chooses, the output is plain greedy decoding's; each round says
    its kind, what the policy predicted and the time it took."""
    target, drafter, dataset = trained_drafter("llama", 4, 0)
    for prompt in prompts_for(dataset, target):
        expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
        out = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                          speculation_policy="adaptive")
        assert torch.equal(out, expected)
        stats = drafter.generation_stats
        assert sum(stats.rounds_by_kind().values()) == stats.num_rounds > 0
        assert all(r.policy_seconds >= 0 and (r.kind != "draft" or r.predicted_accepted is not None) for r in stats.rounds)
    with pytest.raises(ValueError, match="speculation_policy"):
        mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=4, speculation_policy="greedy")
    with pytest.raises(ValueError, match="fixed"):
        mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=4, speculation_policy="adaptive",
                    draft_confidence_threshold=0.5)


def test_every_kind_of_round_mixed_keeps_sampling_exact():
    """With the Markov head (its drafts' q depends on the previous draft): speculative sampling with drafted rounds of 1-3 verified drafts (q = the drafter's), n-gram rounds (q = a point
    mass) and plain steps, carried rows on: the tokens' distribution is the target's, by enumeration."""
    target, drafter, prompt = tiny_sampling_setup(markov_rank=4)
    exact = exact_marginals(target, prompt, LogitsProcessorList())
    rounds, calls = [], itertools.count()

    def speculative(ids):  # each call starts the cycle elsewhere: 4 new tokens are only a few rounds
        policy = SchedulePolicy(drafter, target, do_sample=True, kinds=("draft", "draft", "ngram", "plain"),
                                start=next(calls) % 4)
        out = mc.generate(target, ids, assistant_model=drafter, max_new_tokens=4, do_sample=True, carryover=True,
                          speculation_policy=policy)
        rounds.extend(drafter.generation_stats.rounds)
        return out

    tv = total_variation(sampled_marginals(speculative, prompt), exact)
    assert {r.kind for r in rounds} == {"draft", "ngram", "plain"}
    assert any(r.kind == "ngram" and r.accepted > 0 for r in rounds) and any(r.carried > 0 for r in rounds)
    assert tv.max() < 0.06, tv
