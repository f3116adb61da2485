"""Lossless speculative sampling (T > 0): the distribution of generated tokens equals the target's own.

A tiny vocabulary makes the exact distribution computable by enumeration; thousands of carryover `generate` calls
sample from it, with carryover on (proposals read the previous round's rejected rows). The same test detects a
generator whose candidate logits are not those its drafts were drawn from. With a draft vocabulary of 4 of the 6
tokens, q is 0 on the other two, which the target still produces: the output distribution must not change.
"""

import pytest
import torch
from conftest import greedy_dataset, make_drafter, make_target, train_drafter

import modeling_carryover as mc
from modeling_carryover.generation_carryover import CarryoverCandidateGenerator, _candidate_generator_of
from trainer.build import draft_vocab_from_rows
from transformers import GenerationMixin, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

VOCAB, NEW_TOKENS, SAMPLES = 6, 4, 2000


def tiny_sampling_setup(markov_rank, draft_vocab_size=None):
    """A 6-token target and a drafter trained on its greedy outputs: it proposes likely tokens, so speculative
    sampling accepts and rejects often (a drafter that is always rejected would hide a wrong q). With
    `draft_vocab_size`, the drafter scores the most frequent tokens of that data only."""
    target = make_target("llama", vocab_size=VOCAB, initializer_range=0.3)
    drafter = make_drafter(
        target, block_size=4, markov_rank=markov_rank, mask_token_id=VOCAB - 1, draft_vocab_size=draft_vocab_size
    )
    dataset = greedy_dataset(target, num_rows=32, prompt_len=5, new_tokens=24)
    if draft_vocab_size:
        drafter.set_draft_vocab(draft_vocab_from_rows(dataset, draft_vocab_size, VOCAB))
    train_drafter(target, drafter, dataset, epochs=6, num_anchors=8)
    return target, drafter, torch.tensor([[1, 4, 2, 0, 3]])


def exact_marginals(target, prompt, processors):
    """P(token at each new position) under the target's processed distribution, by enumerating all continuations."""
    marginals = torch.zeros(NEW_TOKENS, VOCAB, dtype=torch.float64)
    prefixes, prefix_probs = [()], torch.ones(1, dtype=torch.float64)
    for step in range(NEW_TOKENS):
        sequences = torch.tensor([prompt[0].tolist() + list(p) for p in prefixes])
        with torch.no_grad():
            logits = target(sequences).logits[:, -1].float()
        probs = processors(sequences, logits).softmax(-1).double()  # [P, V]
        joint = prefix_probs[:, None] * probs
        marginals[step] = joint.sum(0)
        prefixes = [p + (v,) for p in prefixes for v in range(VOCAB)]
        prefix_probs = joint.flatten()
    return marginals


def sampled_marginals(generate_fn, prompt):
    counts = torch.zeros(NEW_TOKENS, VOCAB, dtype=torch.float64)
    torch.manual_seed(0)
    for _ in range(SAMPLES):
        new = generate_fn(prompt)[0, prompt.shape[1] :]
        counts[torch.arange(NEW_TOKENS), new] += 1
    return counts / SAMPLES


def total_variation(p, q):
    return 0.5 * (p - q).abs().sum(-1)


SETTINGS = {"plain": {}, "warped": {"temperature": 0.7, "top_k": 4}}


@pytest.mark.parametrize(
    "markov_rank, setting, draft_vocab_size, confidence",
    [(0, "plain", None, None), (4, "plain", None, None), (0, "warped", None, None), (4, "warped", None, None),
     (0, "plain", 4, None), (4, "warped", 4, None), (0, "plain", None, 0.5)],
)
def test_sampling_matches_target_distribution(markov_rank, setting, draft_vocab_size, confidence):
    target, drafter, prompt = tiny_sampling_setup(markov_rank, draft_vocab_size)
    kwargs = SETTINGS[setting]
    processors = LogitsProcessorList()
    if setting == "warped":
        processors += [TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)]
    exact = exact_marginals(target, prompt, processors)

    rounds = []

    def speculative(ids):
        out = mc.generate(
            target, ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=True, carryover=True,
            draft_confidence_threshold=confidence, **kwargs,
        )
        rounds.extend(drafter.generation_stats.rounds)
        return out

    sampled = sampled_marginals(speculative, prompt)
    if draft_vocab_size:  # q = 0 where the target still puts mass: what the exactness check has to cover
        outside = [t for t in range(VOCAB) if t not in drafter.draft_token_ids.tolist()]
        assert exact[:, outside].sum(-1).max() > 0.05, exact
        assert not {d for r in rounds for d in r.drafts} & set(outside)
    # up to two drafts per round judged by speculative sampling, accepted often and rejected often
    assert max(r.proposed for r in rounds) == 2
    if confidence:  # rounds with room for two drafts verify one or two by the drafter's confidence (prompt: 5 tokens)
        assert {r.proposed for r in rounds if r.anchor_position + 1 + 2 < prompt.shape[1] + NEW_TOKENS} == {1, 2}
    accepted = sum(r.accepted for r in rounds) / sum(r.proposed for r in rounds)
    assert 0.2 < accepted < 0.95, accepted
    assert sum(r.carried > 0 for r in rounds) > 0.1 * len(rounds)  # carryover rounds are part of what is judged
    tv = total_variation(sampled, exact)
    # 2000 samples of a 6-way distribution: sampling noise gives TV ~0.02; a biased sampler gives far more
    assert tv.max() < 0.06, tv


class MismatchedLogitsGenerator(CarryoverCandidateGenerator):
    """Negative control: drafts are sampled from q, but the logits handed to speculative sampling claim a flatter q."""

    def _choose_drafts(self, input_ids, logits):
        candidates, candidate_logits, chosen_from = super()._choose_drafts(input_ids, logits)
        return candidates, candidate_logits / 4, chosen_from


def test_mismatched_candidate_logits_are_detected():
    target, drafter, prompt = tiny_sampling_setup(0)
    exact = exact_marginals(target, prompt, LogitsProcessorList())

    def biased_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        generator = MismatchedLogitsGenerator(model, drafter, generation_config, logits_processor, input_ids=input_ids)
        with _candidate_generator_of(model, generator):
            return GenerationMixin._assisted_decoding(
                model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                generation_config=generation_config, assistant_model=drafter, **model_kwargs,
            )

    def biased(ids):
        return target.generate(ids, custom_generate=biased_decoding, max_new_tokens=NEW_TOKENS, do_sample=True)

    tv = total_variation(sampled_marginals(biased, prompt), exact)
    assert tv.max() > 0.1, tv

