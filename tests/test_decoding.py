"""Carryover decoding through `generate`: losslessness at T=0, cache correctness, bounded carried state, and that
carryover really reads the rejected rows. Real tiny transformers targets, real drafters trained with the real
Trainer, the real `generate` loop."""

import pytest
import torch
from conftest import make_drafter, make_target, trained_drafter
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import modeling_carryover as mc
from trainer.verification import target_pass, verify_branches

LENGTHS = [1, 2, 3, 5, 17, 40, 100]


def prompts_for(dataset, target, n_in_distribution=3, n_random=2, seed=0):
    """Prompts the drafter was trained on (high acceptance) and random ones (low acceptance)."""
    prompts = [torch.tensor([row["input_ids"][:6]]) for row in dataset.select(range(n_in_distribution))]
    generator = torch.Generator().manual_seed(seed)
    prompts += [torch.randint(0, target.config.vocab_size, (1, 3 + 4 * i), generator=generator) for i in range(n_random)]
    return prompts


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("markov_rank", [0, 8])
def test_greedy_output_equals_target_greedy(kind, block_size, markov_rank):
    target, drafter, dataset = trained_drafter(kind, block_size, markov_rank)
    lengths = LENGTHS if (kind, block_size, markov_rank) == ("llama", 4, 0) else [1, 5, 40, 100]
    rounds = []
    for prompt in prompts_for(dataset, target):
        for max_new_tokens in lengths:
            expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            for carryover in (True, False):
                out = mc.generate(
                    target, prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False, carryover=carryover
                )
                assert torch.equal(out, expected), (kind, block_size, markov_rank, max_new_tokens, carryover)
                rounds += drafter.generation_stats.rounds
    # the check only means something if drafts were accepted, fully and partly, and rejected
    assert any(r.accepted == r.proposed for r in rounds)
    assert any(0 < r.accepted < r.proposed for r in rounds) or block_size == 2
    assert any(r.accepted == 0 for r in rounds)
    if block_size > 2:
        assert sum(r.accepted + 1 for r in rounds) / len(rounds) > 1.5


def test_fewer_drafts_per_round_than_the_block_stay_lossless():
    """`num_assistant_tokens` caps the drafts the target verifies per round (the block is still filled): every round
    proposes at most that many, output equals plain greedy, and carried rows are only the verified rejected drafts."""
    target, drafter, dataset = trained_drafter("llama", 8, 0)
    for num_drafts in (1, 3):
        rounds = []
        for prompt in prompts_for(dataset, target):
            expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
            out = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False, num_assistant_tokens=num_drafts)
            assert torch.equal(out, expected), num_drafts
            rounds += drafter.generation_stats.rounds
        assert max(r.proposed for r in rounds) == num_drafts and all(r.carried <= num_drafts for r in rounds)
        assert any(r.accepted == num_drafts for r in rounds) and any(r.carried > 0 for r in rounds)
    with pytest.raises(ValueError, match="num_assistant_tokens .drafts per round. must be at least 1, got 0"):
        mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=4, num_assistant_tokens=0)


def test_a_block_above_transformers_default_of_20_assistant_tokens_drafts_all_its_slots():
    """Unset `num_assistant_tokens` means the whole block (block_size - 1 drafts), not transformers' own assisted
    decoding default of 20, which its generation config fills in."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=24)
    prompt = torch.tensor([[1, 5, 9, 13]])
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=30), expected)
    assert drafter.generation_stats.rounds[0].proposed == 23


def test_confident_drafts_stay_lossless_and_shorten_unlikely_rounds():
    """`draft_confidence_threshold`: a round verifies the leading drafts whose running product of the drafter's top
    probabilities stays at or above it (at least one). Output equals plain greedy; higher thresholds verify fewer."""
    top_probs = torch.tensor([0.9, 0.8, 0.5])  # running products 0.9, 0.72, 0.36
    logits = torch.stack([torch.tensor([p, (1 - p) / 2, (1 - p) / 2]).log() for p in top_probs])
    assert [mc.confident_drafts(logits, t) for t in (0.3, 0.5, 0.8, 0.95)] == [3, 2, 1, 1]

    target, drafter, dataset = trained_drafter("llama", 8, 0)
    mean_proposed = {}
    for threshold in (0.01, 0.1, 0.4):  # this tiny drafter's top probabilities are low (0.2-0.8 at its first slot)
        rounds = []
        for prompt in prompts_for(dataset, target):
            expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
            out = mc.generate(
                target, prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                draft_confidence_threshold=threshold,
            )
            assert torch.equal(out, expected), threshold
            rounds += drafter.generation_stats.rounds
        assert all(1 <= r.proposed == len(r.drafts) <= 7 for r in rounds)
        assert len({r.proposed for r in rounds}) > 1  # the round length follows the drafter's confidence
        mean_proposed[threshold] = sum(r.proposed for r in rounds) / len(rounds)
    assert mean_proposed[0.01] > mean_proposed[0.1] > mean_proposed[0.4], mean_proposed
    # a Markov drafter is judged on its corrected slots: a correction that makes every slot certain verifies them all
    markov = make_drafter(target, block_size=8, markov_rank=4)
    with torch.no_grad():  # every slot's correction puts all its mass on token 5
        markov.markov_embed.weight.fill_(1.0)
        markov.markov_proj.weight.zero_()[5] = 100.0
    out = mc.generate(target, prompt, assistant_model=markov, max_new_tokens=40, draft_confidence_threshold=0.5)
    assert torch.equal(out, expected) and max(r.proposed for r in markov.generation_stats.rounds) == 7
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=f"draft_confidence_threshold must be in \\(0, 1\\], got {bad}"):
            mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=4, draft_confidence_threshold=bad)


@pytest.mark.parametrize("carryover", [True, False])
def test_eos_inside_a_block(carryover):
    target, drafter, dataset = trained_drafter("llama", 8, 0)
    prompt = torch.tensor([dataset[0]["input_ids"][:6]])
    plain = target.generate(prompt, max_new_tokens=60, do_sample=False)[0, 6:].tolist()
    # an EOS that first appears well inside the continuation, so that it falls inside an accepted block
    eos_index = next(i for i in range(5, len(plain)) if plain[i] not in plain[:i])
    eos = plain[eos_index]
    expected = target.generate(prompt, max_new_tokens=60, do_sample=False, eos_token_id=eos)
    out = mc.generate(
        target, prompt, assistant_model=drafter, max_new_tokens=60, do_sample=False, eos_token_id=eos, carryover=carryover
    )
    assert torch.equal(out, expected)
    assert out.shape[1] == 6 + eos_index + 1 and out[0, -1].item() == eos
    # the premise: the last round drafted the EOS and more after it, so the output was cut inside its block
    last = drafter.generation_stats.rounds[-1]
    assert eos in last.drafts[:-1], last.drafts


class StopAtToken(StoppingCriteria):
    """A user's own criterion: stop once `token` is generated."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stop_strings_and_custom_criteria_inside_a_block():
    """transformers checks stopping criteria once per round: a stop string or a custom criterion met in the middle of
    an accepted block must still end the output exactly where `target.generate` ends it (ids, scores, cache)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target, drafter, dataset = trained_drafter("llama", 8, 0)
    # word-level, one word per token id, plus StopStringCriteria's probe word "abcdef"
    words = {f"w{i}": i for i in range(target.config.vocab_size)} | {"abcdef": target.config.vocab_size, "<unk>": target.config.vocab_size + 1}
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    prompt = torch.tensor([dataset[0]["input_ids"][:6]])
    plain = target.generate(prompt, max_new_tokens=60, do_sample=False)[0, 6:].tolist()
    mid_round = 0
    for index in [i for i in range(3, len(plain)) if plain[i] not in plain[:i]][:4]:
        word = tokenizer.convert_ids_to_tokens(plain[index])
        for stop in ({"stop_strings": [word], "tokenizer": tokenizer}, {"stopping_criteria": StoppingCriteriaList([StopAtToken(plain[index])])}):
            settings = dict(max_new_tokens=60, do_sample=False, return_dict_in_generate=True, output_scores=True, **stop)
            expected = target.generate(prompt, **settings)
            assert expected.sequences.shape[1] == 6 + index + 1
            for carryover in (True, False):
                out = mc.generate(target, prompt, assistant_model=drafter, carryover=carryover, **settings)
                assert torch.equal(out.sequences, expected.sequences), (word, stop.keys(), carryover)
                assert len(out.scores) == index + 1 and out.past_key_values.get_seq_length() == 6 + index
                last = drafter.generation_stats.rounds[-1]
                mid_round += last.anchor_position + last.accepted + 1 > out.sequences.shape[1] - 1  # cut inside it
    assert mid_round >= 2  # the case that needs the cut happened
    # stop strings set in a generation config (the caller's object is left unchanged)
    config = GenerationConfig(max_new_tokens=60, do_sample=False, stop_strings=[word])
    expected = target.generate(prompt, generation_config=config, tokenizer=tokenizer)
    assert torch.equal(mc.generate(target, prompt, assistant_model=drafter, generation_config=config, tokenizer=tokenizer), expected)
    assert config.stop_strings == [word]
    with pytest.raises(ValueError, match="tokenizer"):
        mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=10, stop_strings=["w1"])


def carried_rows_of(target, drafter, recorded, sequence, previous):
    """The rejected rows of round `previous`, recomputed: the target re-verifies its proposal after its anchor."""
    drafts = torch.tensor([[previous.drafts]])
    anchors = torch.tensor([[previous.anchor_position]])
    branch = verify_branches(target, recorded, sequence, anchors, drafts, drafter.feature_hidden_state_indices)
    assert branch.accepted_len.item() == previous.accepted  # the same verdict generate reached
    window = drafter.target_features(branch.hidden_states)  # [1, 1, W, F]
    window_positions = previous.anchor_position + torch.arange(window.shape[2])[None, None]
    rows, row_positions, valid = drafter.rejected_rows(window, window_positions, torch.tensor([[previous.accepted]]))
    return dict(carried_features=rows, carried_position_ids=row_positions, carried_mask=valid)


def proposal_logits(target, drafter, features, sequence, round_, carried):
    """Slot logits of `round_`'s block recomputed without a drafter cache from the committed rows before its anchor."""
    a = round_.anchor_position
    block_ids, block_positions = drafter.block_inputs(sequence[:, a], torch.tensor([a]))
    with torch.no_grad():
        out = drafter(
            target.get_input_embeddings()(block_ids)[:, None],
            block_positions[:, None],
            context_features=features[:, :a],
            context_position_ids=torch.arange(a)[None],
            **carried,
        )
    return target.get_output_embeddings()(out.last_hidden_state[0, 0, 1 : round_.proposed + 1])


def replay_proposals(target, drafter, sequence, rounds, carryover=True):
    """Recompute every round's proposal from scratch: no drafter cache, committed context = the target's features of
    the final sequence before the anchor, carried rows = the previous round's proposal re-verified by the target."""
    recorded = target_pass(target, sequence, torch.ones_like(sequence), drafter.feature_hidden_state_indices, use_cache=True)
    features = drafter.target_features(recorded.hidden_states)  # [1, L, F]
    proposals = []
    for previous, current in zip([None] + rounds[:-1], rounds):
        carried = {}
        if carryover and previous is not None and previous.accepted < previous.proposed:
            carried = carried_rows_of(target, drafter, recorded, sequence, previous)
        logits = proposal_logits(target, drafter, features, sequence, current, carried)
        proposals.append(drafter.draft_tokens(logits, sequence[0, current.anchor_position]).tolist())
    return proposals


@pytest.mark.parametrize("markov_rank", [0, 8])
@pytest.mark.parametrize("carryover", [True, False])
def test_incremental_cache_equals_recomputation(markov_rank, carryover):
    target, drafter, dataset = trained_drafter("llama", 4, markov_rank)
    for prompt in prompts_for(dataset, target, 2, 1):
        sequence = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=40, do_sample=False, carryover=carryover)
        rounds = drafter.generation_stats.rounds
        assert sum(r.carried > 0 for r in rounds) > 0 or not carryover
        assert replay_proposals(target, drafter, sequence, rounds, carryover) == [r.drafts for r in rounds]


def test_carried_rows_are_bounded_and_last_one_round():
    target, drafter, dataset = trained_drafter("llama", 8, 0)
    block = drafter.config.block_size
    seen_full = seen_partial = False
    for prompt in prompts_for(dataset, target):
        mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=80, do_sample=False)
        rounds = drafter.generation_stats.rounds
        assert rounds[0].carried == 0  # the first proposal follows the prefill: nothing was rejected yet
        for previous, current in zip(rounds, rounds[1:]):
            assert current.carried <= block - 1
            # exactly the previous round's rejected drafts, and only them: replaced every round
            assert current.carried == previous.proposed - previous.accepted
            seen_full |= previous.accepted == previous.proposed and current.carried == 0
            seen_partial |= current.carried > 0
        for r in rounds:  # the drafter cache holds committed rows only: every position before the anchor, no more
            assert r.committed_rows == r.anchor_position
    assert seen_full and seen_partial


def test_carryover_reads_the_rejected_rows():
    """A trained carryover drafter's proposal depends on the carried rows: replacing them changes its logits, and
    decoding ON vs OFF (same weights) proposes differently."""
    target, drafter, dataset = trained_drafter("llama", 8, 0)
    differs = []
    for row in dataset.select(range(8)):
        prompt = torch.tensor([row["input_ids"][:6]])
        sequence = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=60, do_sample=False)
        on_rounds = drafter.generation_stats.rounds
        mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=60, do_sample=False, carryover=False)
        differs.append([r.drafts for r in on_rounds] != [r.drafts for r in drafter.generation_stats.rounds])
        if differs[-1]:
            break
    assert any(differs)

    # a round with carried rows: its block with the true rejected rows vs with the same rows in reverse order
    recorded = target_pass(target, sequence, torch.ones_like(sequence), drafter.feature_hidden_state_indices, use_cache=True)
    features = drafter.target_features(recorded.hidden_states)
    index = next(i for i, r in enumerate(on_rounds) if r.carried >= 2)
    carried = carried_rows_of(target, drafter, recorded, sequence, on_rounds[index - 1])
    true_logits = proposal_logits(target, drafter, features, sequence, on_rounds[index], carried)
    assert drafter.draft_tokens(true_logits, sequence[0, on_rounds[index].anchor_position]).tolist() == on_rounds[index].drafts
    valid = carried["carried_mask"][0, 0]
    reversed_rows = carried["carried_features"].clone()
    reversed_rows[0, 0, valid] = reversed_rows[0, 0, valid].flip(0)
    other_logits = proposal_logits(target, drafter, features, sequence, on_rounds[index], carried | {"carried_features": reversed_rows})
    assert (true_logits - other_logits).abs().max() > 1e-2


def test_drafter_config_validation():
    target = make_target("llama")
    with pytest.raises(ValueError, match="out of range"):
        mc.CarryoverDrafterConfig.from_target_config(target.config, target_layer_ids=[0, 9])
    with pytest.raises(ValueError, match="block_size"):
        mc.CarryoverDrafterConfig.from_target_config(target.config, block_size=1)
    with pytest.raises(ValueError, match="mask_token_id"):
        mc.CarryoverDrafterConfig.from_target_config(target.config, mask_token_id=500)
    with pytest.raises(ValueError, match="hidden_size"):
        mc.CarryoverDrafterConfig.from_target_config(target.config, hidden_size=32)
    with pytest.raises(ValueError, match="carryover_interface"):
        mc.CarryoverDrafterConfig.from_target_config(target.config, carryover_interface="gate")
    config = mc.CarryoverDrafterConfig.from_target_config(target.config, num_hidden_layers=2)
    assert config.target_layer_ids == [0, 3] and config.hidden_size == 64 and config.vocab_size == 96
    qwen3 = mc.CarryoverDrafterConfig.from_target_config(make_target("qwen3").config)
    assert qwen3.head_dim == 16
    assert mc.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    with pytest.raises(ValueError, match="pass target_layer_ids"):  # 5 drafter layers read 5 layers of a 4-layer target
        mc.CarryoverDrafterConfig.from_target_config(target.config, num_hidden_layers=5)


def test_from_pretrained_overrides_are_validated(tmp_path):
    """`from_pretrained(path, block_size=...)` sets fields after the config's own checks ran: the model checks again."""
    make_drafter(make_target("llama")).save_pretrained(tmp_path)
    for override, message in (({"block_size": 1}, "block_size"), ({"mask_token_id": 500}, "mask_token_id"),
                              ({"target_layer_ids": [0, 9]}, "out of range")):
        with pytest.raises(ValueError, match=message):
            mc.CarryoverDrafterModel.from_pretrained(tmp_path, **override)


def test_bad_inputs_fail_at_once_with_clear_errors():
    target = make_target("llama")
    drafter = make_drafter(target)
    prompt = torch.randint(0, 96, (1, 5))
    with pytest.raises(ValueError, match="batch size 1"):
        mc.generate(target, torch.randint(0, 96, (2, 5)), assistant_model=drafter, max_new_tokens=5)
    with pytest.raises(ValueError, match="padded"):
        mc.generate(target, prompt, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]), assistant_model=drafter, max_new_tokens=5)
    with pytest.raises(ValueError, match="num_beams"):
        mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=5, num_beams=2)
    with pytest.raises(ValueError, match="assistant_model"):
        mc.generate(target, prompt, max_new_tokens=5)
    other = make_target("llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="does not fit the target"):
        mc.generate(other, prompt, assistant_model=drafter, max_new_tokens=5)
    wider = make_target("llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="hidden size"):
        mc.generate(wider, prompt, assistant_model=drafter, max_new_tokens=5)
    # plain assisted generation cannot feed a carryover drafter: it must say how to call it instead
    with pytest.raises(AttributeError, match="custom_generate"):
        target.generate(prompt, assistant_model=drafter, max_new_tokens=5)


def test_foreign_and_corrupt_checkpoints(tmp_path):
    import safetensors.torch

    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="Not a Carryover drafter"):
        mc.CarryoverDrafterModel.from_pretrained(tmp_path / "target")
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path / "drafter")
    weights = tmp_path / "drafter" / "model.safetensors"
    state = safetensors.torch.load_file(weights)
    state.pop("fc.weight")
    safetensors.torch.save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing_keys"):
        mc.CarryoverDrafterModel.from_pretrained(tmp_path / "drafter")


def test_a_gemma3_target_with_rope_per_layer_type_decodes_losslessly():
    """Gemma 3 targets give RoPE settings per layer type: the drafter takes the full-attention layers' (its own layers
    are full attention); a config with the nested settings themselves is a clear error, not a KeyError at init."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    torch.manual_seed(0)
    target = Gemma3ForCausalLM(config).eval()
    drafter = make_drafter(target)
    assert drafter.config.rope_parameters == config.rope_parameters["full_attention"]
    prompt = torch.tensor([[2, 5, 9, 13, 7]])
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=30), expected)
    with pytest.raises(ValueError, match="has no rope_theta .settings per layer type"):
        mc.CarryoverDrafterConfig(**{**drafter.config.to_dict(), "rope_parameters": config.rope_parameters})
