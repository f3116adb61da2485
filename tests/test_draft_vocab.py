"""A draft vocabulary (FR-Spec; EAGLE-3's d2t/t2d): the drafter scores the target LM-head rows of N frequent tokens.

Decoding stays lossless (greedy here; exact speculative sampling in test_sampling.py), training and decoding draft
the same tokens, the token map travels with the checkpoint (fresh process) and with a speculators export, and it is
computed from the training rows as documented.
"""

import json

import pytest
import torch
from conftest import greedy_dataset, make_drafter, make_target, train_drafter
from datasets import Dataset
from safetensors.torch import load_file, save_file
from test_checkpoint import run_fresh
from test_training import assert_training_transition_reproduces_decoding

import modeling_carryover as mc
from hub.convert import (
    ConvertArguments,
    convert,
    export_dflash,
    export_speculators,
    export_transformers,
    import_drafter,
)
from trainer.build import DrafterArguments, build_drafter, draft_vocab_from_rows

DRAFT_VOCAB = 40  # of the tiny target's 96 tokens: its greedy responses also use tokens outside
_TRAINED = {}


def draft_vocab_drafter(markov_rank=0, block_size=8):
    """A drafter with a 40-token draft vocabulary from the tiny target's greedy data (baseline, then carryover)."""
    key = (markov_rank, block_size)
    if key not in _TRAINED:
        target = make_target("llama")
        dataset = greedy_dataset(target)
        drafter = make_drafter(target, block_size=block_size, markov_rank=markov_rank, draft_vocab_size=DRAFT_VOCAB)
        drafter.set_draft_vocab(draft_vocab_from_rows(dataset, DRAFT_VOCAB, target.config.vocab_size))
        train_drafter(target, drafter, dataset, carryover=False, epochs=8)
        trainer = train_drafter(target, drafter, dataset, carryover=True, epochs=4)
        _TRAINED[key] = (target, drafter, dataset, trainer)
    return _TRAINED[key]


def test_token_map_from_rows_is_top_n_by_frequency_ties_by_id():
    rows = Dataset.from_list(
        [
            {"input_ids": [9, 5, 5, 7, 7, 3, 3, 1], "loss_mask": [1, 0, 1, 1, 1, 1, 1, 0]},  # 9 and 1 only in prompts
            {"input_ids": [5, 8, 8, 2], "loss_mask": [1, 1, 1, 1]},
        ]
    )
    # response counts: 5 x2, 7 x2, 3 x2, 8 x2, 9 x1, 2 x1; ties broken by the lower id
    assert draft_vocab_from_rows(rows, 3, 12).tolist() == [3, 5, 7]
    assert draft_vocab_from_rows(rows, 5, 12).tolist() == [2, 3, 5, 7, 8]
    assert draft_vocab_from_rows(rows, 3, 12, always=[11]).tolist() == [3, 5, 11]  # EOS always in
    assert draft_vocab_from_rows(rows, 8, 12).tolist() == [0, 1, 2, 3, 5, 7, 8, 9]  # unseen ids fill up by id
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1..12"):
        draft_vocab_from_rows(rows, 0, 12)


def test_build_drafter_maps_the_training_rows_and_keeps_eos():
    target = make_target("llama", eos_token_id=95)
    dataset = greedy_dataset(target, num_rows=8, new_tokens=16)
    drafter = build_drafter(target, DrafterArguments(num_draft_layers=1, block_size=4, draft_vocab_size=12), dataset)
    expected = draft_vocab_from_rows(dataset, 12, 96, always=[95])
    assert 95 in expected.tolist() and torch.equal(drafter.draft_token_ids, expected)


def test_config_and_token_map_are_validated():
    target = make_target("llama")
    for size in (0, 97):
        with pytest.raises(ValueError, match="draft_vocab_size must be in 1..vocab_size"):
            make_drafter(target, draft_vocab_size=size)
    drafter = make_drafter(target, draft_vocab_size=4)
    for ids, message in [
        ([1, 2, 3], r"shape \(4,\)"),
        ([1, 2, 2, 3], "unique target ids in increasing order"),
        ([3, 2, 5, 7], "unique target ids in increasing order"),
        ([1, 2, 3, 96], "outside the target vocabulary"),
        ([-1, 2, 3, 4], "outside the target vocabulary"),
    ]:
        with pytest.raises(ValueError, match=message):
            drafter.set_draft_vocab(ids)
    with pytest.raises(ValueError, match=r"scores the whole target vocabulary \(draft_vocab_size=None\)"):
        make_drafter(target).set_draft_vocab([1, 2, 3])


def test_a_token_map_changed_in_place_scores_its_new_rows():
    """The gathered LM-head rows are cached (`draft_head_weight`): a token map changed in place after a forward (same
    storage, a new version) must score its own rows, not the cached ones of the old map."""
    target = make_target().requires_grad_(False)  # a frozen head: the one whose rows are cached
    drafter = make_drafter(target, draft_vocab_size=4)
    drafter.set_draft_vocab([1, 2, 3, 4])
    hidden = torch.randn(2, target.config.hidden_size)
    with torch.no_grad():
        before = drafter.draft_logits(target.lm_head, hidden)
        drafter.draft_token_ids.copy_(torch.tensor([5, 6, 7, 8]))
        after = drafter.draft_logits(target.lm_head, hidden)
    torch.testing.assert_close(after, hidden @ target.lm_head.weight[5:9].T)
    assert not torch.allclose(before, after)


def test_drafts_live_on_the_draft_vocabulary():
    target, drafter, _, trainer = draft_vocab_drafter()
    assert torch.equal(drafter.to_target_ids(drafter.to_draft_ids(drafter.draft_token_ids)), drafter.draft_token_ids)
    outside = [i for i in range(96) if i not in drafter.draft_token_ids.tolist()]
    assert (drafter.to_draft_ids(torch.tensor(outside)) == -1).all()
    logits = drafter.draft_logits(target.lm_head, torch.randn(2, 64))
    assert logits.shape == (2, DRAFT_VOCAB)
    torch.testing.assert_close(drafter.full_vocab_logits(logits)[:, drafter.draft_token_ids], logits)
    assert drafter.full_vocab_logits(logits)[:, outside].eq(float("-inf")).all()
    logged = [entry["out_of_vocab_labels"] for entry in trainer.state.log_history if "out_of_vocab_labels" in entry]
    assert logged and all(0 < share < 0.5 for share in logged), logged  # some labels cannot be drafted; logged


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_greedy_output_equals_target_greedy_with_a_draft_vocabulary(markov_rank):
    target, drafter, dataset, _ = draft_vocab_drafter(markov_rank)
    vocab = set(drafter.draft_token_ids.tolist())
    rounds = []
    prompts = [torch.tensor([row["input_ids"][:6]]) for row in dataset.select(range(3))] + [torch.tensor([[7, 3, 88, 1]])]
    for prompt in prompts:
        for max_new_tokens in (1, 5, 40):
            expected = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            for carryover in (True, False):
                out = mc.generate(
                    target, prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False, carryover=carryover
                )
                assert torch.equal(out, expected), (markov_rank, max_new_tokens, carryover)
                rounds += drafter.generation_stats.rounds
    assert all(set(r.drafts) <= vocab for r in rounds)  # the drafter proposes draft-vocabulary tokens only
    assert any(r.accepted == r.proposed for r in rounds) and any(r.accepted == 0 for r in rounds)
    assert any(r.carried for r in rounds)


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_training_drafts_equal_decoding_drafts_with_a_draft_vocabulary(markov_rank):
    """Train/serve parity: the training transition (detached draft, verification, carried rows) and the second pass
    draft on the draft vocabulary exactly what carryover decoding drafted in the next round."""
    target, drafter, dataset, _ = draft_vocab_drafter(markov_rank)
    assert_training_transition_reproduces_decoding(target, drafter, dataset)


def test_round_trip_in_a_fresh_process_keeps_the_token_map(tmp_path):
    target, drafter, dataset, _ = draft_vocab_drafter(markov_rank=8)
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    assert torch.equal(load_file(tmp_path / "drafter" / "model.safetensors")["draft_token_ids"], drafter.draft_token_ids)
    prompt = dataset[0]["input_ids"][:6]
    out = mc.generate(target, torch.tensor([prompt]), assistant_model=drafter, max_new_tokens=30, do_sample=False)
    expected = {"output": out[0].tolist(), "drafts": [r.drafts for r in drafter.generation_stats.rounds],
                "map": drafter.draft_token_ids.tolist()}
    code = f"""
import json, torch
from transformers import AutoModel, AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained("target")
drafter = AutoModel.from_pretrained("drafter", trust_remote_code=True)
assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
out = target.generate(torch.tensor([{prompt!r}]), assistant_model=drafter, custom_generate="drafter",
                      trust_remote_code=True, max_new_tokens=30, do_sample=False)
print(json.dumps({{"output": out[0].tolist(), "drafts": [r.drafts for r in drafter.generation_stats.rounds],
                  "map": drafter.draft_token_ids.tolist()}}))
"""
    result = run_fresh(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def test_a_corrupt_token_map_is_refused_on_load(tmp_path):
    target, drafter, _, _ = draft_vocab_drafter()
    drafter.save_pretrained(tmp_path / "drafter")
    weights = load_file(tmp_path / "drafter" / "model.safetensors")
    weights["draft_token_ids"] = weights["draft_token_ids"].flip(0)
    save_file(weights, tmp_path / "drafter" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="increasing order"):
        mc.CarryoverDrafterModel.from_pretrained(tmp_path / "drafter")


def test_speculators_export_writes_d2t_t2d_and_imports_the_same_drafter(tmp_path):
    target, drafter, dataset, _ = draft_vocab_drafter(markov_rank=8)
    with pytest.warns(UserWarning, match="carryover part"):
        exported = export_speculators(drafter, tmp_path / "spec", verifier="Qwen/Qwen3-0.6B")
    config = json.loads((exported / "config.json").read_text())
    weights = load_file(exported / "model.safetensors")
    ids = drafter.draft_token_ids
    assert config["draft_vocab_size"] == DRAFT_VOCAB and "draft_token_ids" not in weights
    assert torch.equal(weights["d2t"] + torch.arange(DRAFT_VOCAB), ids)  # speculators: target = index + d2t[index]
    assert weights["t2d"].dtype == torch.bool and torch.equal(weights["t2d"].nonzero()[:, 0], ids)
    assert weights["markov_head.markov_w2.weight"].shape == (DRAFT_VOCAB, 8)

    reimported = import_drafter(str(exported))
    assert reimported.config.draft_vocab_size == DRAFT_VOCAB and torch.equal(reimported.draft_token_ids, ids)
    prompt = torch.tensor([dataset[1]["input_ids"][:6]])
    expected = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=30, carryover=False)
    expected_drafts = [r.drafts for r in drafter.generation_stats.rounds]
    assert torch.equal(mc.generate(target, prompt, assistant_model=reimported, max_new_tokens=30), expected)
    assert [r.drafts for r in reimported.generation_stats.rounds] == expected_drafts

    weights["t2d"][ids[0]] = False
    save_file(weights, exported / "model.safetensors")
    with pytest.raises(ValueError, match="token maps disagree"):
        import_drafter(str(exported))


@pytest.mark.parametrize("export", [export_dflash, export_transformers])
def test_formats_without_a_token_map_refuse_a_draft_vocabulary(export, tmp_path):
    target = make_target("qwen3")
    drafter = make_drafter(target, draft_vocab_size=16)
    with pytest.raises(ValueError, match="no draft-vocabulary token map"):
        export(drafter, tmp_path / "out")


def test_dflash_export_with_the_target_head_writes_its_rows_and_the_map(tmp_path):
    """`--to dflash --verifier <target>` (what stock vLLM DFlash serves: serving/bench_serving.py's column) writes a
    draft vocabulary with speculators' map and the drafter's own head, the target LM head's rows of the draft tokens."""
    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    drafter = make_drafter(target, draft_vocab_size=16)
    ids = torch.arange(0, 96, 6)  # [16] target ids
    drafter.set_draft_vocab(ids)
    drafter.save_pretrained(tmp_path / "drafter")
    args = ConvertArguments(
        str(tmp_path / "drafter"), str(tmp_path / "out"), to="dflash", verifier=str(tmp_path / "target")
    )
    folder = convert(args)
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    assert (config["architectures"], config["draft_vocab_size"]) == (["DFlashDraftModel"], 16)
    assert torch.equal(weights["lm_head.weight"], target.lm_head.weight[ids])  # [16, d]
    assert torch.equal(weights["d2t"] + torch.arange(16), ids) and torch.equal(weights["t2d"].nonzero()[:, 0], ids)

    # it imports back as the same drafter: the map from d2t/t2d, the head rows dropped (ours scores the target's head)
    reimported = import_drafter(str(folder))
    assert reimported.config.draft_vocab_size == 16 and torch.equal(reimported.draft_token_ids, ids)
    assert all(torch.equal(value, reimported.state_dict()[key]) for key, value in drafter.state_dict().items())

    # another model's head is refused, not written: a Qwen3 target of another vocabulary
    make_target("qwen3", vocab_size=128).save_pretrained(tmp_path / "other")
    args.verifier, args.output_dir = str(tmp_path / "other"), str(tmp_path / "out2")
    with pytest.raises(ValueError, match="vocab"):
        convert(args)
    args.to = "transformers"
    with pytest.raises(ValueError, match="--verifier has no effect with --to transformers"):
        convert(args)


def test_vllm_plugin_export_imports_back_with_carryover_and_the_map(tmp_path):
    """serving/vllm_plugin.py's export (z-lab's format with E_carry, the carryover setting and a draft vocabulary)
    imports back as the drafter it was written from: the same weights, map and carryover, the same drafts."""
    from serving.vllm_plugin import export_vllm

    target, drafter, dataset, _ = draft_vocab_drafter()
    assert drafter.config.carryover and drafter.carry_embedding.any()
    reimported = import_drafter(str(export_vllm(drafter, tmp_path / "vllm")))
    assert reimported.config.carryover and reimported.config.draft_vocab_size == DRAFT_VOCAB
    assert all(torch.equal(value, reimported.state_dict()[key]) for key, value in drafter.state_dict().items())
    prompt = torch.tensor([dataset[1]["input_ids"][:6]])
    expected = mc.generate(target, prompt, assistant_model=drafter, max_new_tokens=30)
    expected_rounds = [(r.drafts, r.carried) for r in drafter.generation_stats.rounds]
    assert torch.equal(mc.generate(target, prompt, assistant_model=reimported, max_new_tokens=30), expected)
    assert [(r.drafts, r.carried) for r in reimported.generation_stats.rounds] == expected_rounds


def test_run_cli_computes_the_map_and_carryover_keeps_it(tmp_path):
    from trainer.run import main as run_main

    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    dataset = greedy_dataset(target, num_rows=12, new_tokens=24)
    dataset.save_to_disk(str(tmp_path / "data"))

    def cli(output_dir, *extra):
        return [
            "--target", str(tmp_path / "target"), "--dataset", str(tmp_path / "data"), "--output_dir", str(output_dir),
            "--num_draft_layers", "1", "--block_size", "4", "--per_device_train_batch_size", "4", "--max_steps", "2",
            "--report_to", "none", "--use_cpu", "--save_strategy", "no", "--disable_tqdm", "true", *extra,
        ]

    run_main(cli(tmp_path / "baseline", "--draft_vocab_size", "30"))
    baseline = mc.CarryoverDrafterModel.from_pretrained(tmp_path / "baseline")
    assert baseline.config.draft_vocab_size == 30
    assert torch.equal(baseline.draft_token_ids, draft_vocab_from_rows(dataset, 30, 96))
    trainer = run_main(cli(tmp_path / "carryover", "--drafter_checkpoint", str(tmp_path / "baseline"), "--carryover"))
    assert torch.equal(trainer.model.draft_token_ids, baseline.draft_token_ids)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        run_main(cli(tmp_path / "other", "--drafter_checkpoint", str(tmp_path / "baseline"), "--draft_vocab_size", "20"))


def test_markov_l1_with_a_draft_vocabulary_is_the_full_vocabulary_distance():
    """The Markov L1 term on a draft vocabulary (sum over draft tokens of |q - p| plus the target's mass outside them)
    equals sum_v |q_v - p_v| over the whole vocabulary with q = 0 outside, computed by hand; so does it without one."""
    from trainer.objectives import slot_terms, target_scored_distribution

    target = make_target("llama")
    lm_head = target.get_output_embeddings()
    for draft_vocab_size in (DRAFT_VOCAB, None):
        drafter = make_drafter(target, block_size=4, markov_rank=4, draft_vocab_size=draft_vocab_size)
        torch.manual_seed(0)
        torch.nn.init.normal_(drafter.markov_proj.weight)
        d, V = drafter.config.hidden_size, target.config.vocab_size
        hidden, target_hidden = torch.randn(2, 3, 4, d), torch.randn(2, 3, 4, d)
        labels, previous = torch.randint(V, (2, 3, 4)), torch.randint(V, (2, 3, 4))
        with torch.no_grad():
            _, _, l1, _ = slot_terms(drafter, lm_head, hidden, labels, previous, *target_scored_distribution(drafter, lm_head, target_hidden))
            logits = drafter.draft_logits(lm_head, hidden) + drafter.markov_correction(previous)
            q = drafter.full_vocab_logits(logits).softmax(-1)  # 0 outside the draft vocabulary
            p = lm_head(target_hidden).softmax(-1)
        assert (q > 0).sum(-1).max() == (draft_vocab_size or V)
        torch.testing.assert_close(l1, (q - p).abs().sum(-1), rtol=1e-5, atol=1e-5)
