"""The analyses of evaluation/analyze.py: replay of recorded rounds, matched-anchor recall, re-convergence, attention."""

import json
import math

import pytest
import torch
from conftest import make_drafter, make_target
from test_evaluation import tiny_tokenizer, workspace  # noqa: F401  (session fixture shared with test_evaluation)

from carryover_common.benchmarks import encode_prompt
from evaluation import analyze

MAX_NEW_TOKENS = 24


def recorded_generation(drafter, target, prompts=("w1 w2 w3", "w40 w5 w77 w8 w9")):
    tokenizer = tiny_tokenizer()
    for prompt in prompts:
        inputs = encode_prompt(tokenizer, prompt)
        recording = analyze.record(target, drafter, inputs, MAX_NEW_TOKENS, drafter.feature_hidden_state_indices)
        yield recording, list(drafter.generation_stats.rounds)


@pytest.mark.parametrize("markov_rank", [0, 8])
def test_replay_on_reproduces_the_drafts_of_generate(markov_rank):
    """Replaying a round with the previous round's rejected rows gives exactly the drafts `generate` proposed."""
    target = make_target()
    drafter = make_drafter(target, block_size=5, markov_rank=markov_rank)
    if markov_rank:  # a live correction head, so that each slot depends on the previous slot's own choice
        torch.nn.init.normal_(drafter.markov_proj.weight, std=2.0)
    rounds_with_rows = 0
    for recording, rounds in recorded_generation(drafter, target):
        carried = analyze.carried_rows(drafter, recording)
        assert carried[2][0].sum(-1).tolist() == [r.carried for r in rounds]  # same rows generate carried
        assert recording.branches.accepted_len[0].tolist() == [r.accepted for r in rounds]
        on = analyze.replay(target, drafter, recording, carried, top_k=16, chunk_size=3)
        for n, r in enumerate(rounds):
            assert on.drafts[n, : r.proposed].tolist() == r.drafts
        off = analyze.replay(target, drafter, recording, None, top_k=16)
        for n, r in enumerate(rounds):
            if r.carried == 0:  # nothing carried: ON and OFF are the same computation
                assert torch.equal(on.top_ids[n], off.top_ids[n])
        rounds_with_rows += sum(r.carried > 0 for r in rounds)
        assert not torch.equal(on.top_ids, off.top_ids)  # the carried rows change the candidates
    assert rounds_with_rows > 0


def test_reconvergence_count_follows_equation_3():
    # q=0: z_1 == y_0 (delta +1); q=1: z_2 == y_1 (delta +1); q=2: no z matches 9
    assert analyze.reconvergence_count([5, 6, 7], [6, 7, 9]) == 2
    # delta -1 and 0; z_{-1} and z_3 are out of range, never compared
    assert analyze.reconvergence_count([4, 8, 3], [4, 4, 8]) == 3
    assert analyze.reconvergence_count([1, 2], [3, 1]) == 1
    # committed tokens beyond the output are ignored
    assert analyze.reconvergence_count([1, 2, 3], [1, None, None]) == 1
    assert analyze.reconvergence_count([], []) == 0


def test_pearson_across_subsets():
    assert analyze.pearson([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert analyze.pearson([1.0, 2.0, 3.0, float("nan")], [3.0, 2.0, 1.0, 5.0]) == pytest.approx(-1.0)
    assert analyze.pearson([1.0, 2.0], [1.0, 2.0]) is None  # two subsets always give |r| = 1
    assert analyze.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None


def test_recall_counts_use_matched_anchors():
    """Position j counts a round only if ON and baseline both drafted the target's tokens before j; OFF is scored on
    those rounds whatever it drafted."""
    targets = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, -1]])
    drafts = {
        "on": torch.tensor([[1, 2, 0], [1, 0, 3], [1, 2, 3]]),
        "off": torch.tensor([[0, 0, 0], [0, 0, 0], [0, 0, 0]]),
        "baseline": torch.tensor([[1, 2, 3], [1, 2, 3], [0, 2, 3]]),
    }
    replays = {name: analyze.Replay(d, d[..., None]) for name, d in drafts.items()}  # top-1 = the draft
    rounds, hits = analyze.recall_counts(replays, targets, ks=[1])
    # j=0: all 3 rounds; j=1: rounds 0, 1 (round 2's baseline missed j=0); j=2: round 0 only (round 1's ON missed j=1)
    assert rounds.tolist() == [3, 2, 1]
    assert hits["on"][1].tolist() == [3, 1, 0]
    assert hits["baseline"][1].tolist() == [2, 2, 1]
    assert hits["off"][1].tolist() == [0, 0, 0]
    summary = analyze.recall_summary(rounds, hits, [1])
    assert summary["variants"]["on"][1]["recall@1"] == pytest.approx(0.5)
    assert summary["variants"]["on"][1]["recall@1_ci95"] == pytest.approx(1.96 * math.sqrt(0.25 / 2))


def analysis_argv(workspace, tmp_path, command):  # noqa: F811
    return [command, "--target", str(workspace / "target"), "--drafter", str(workspace / "carryover"),
            "--baseline", str(workspace / "baseline"), "--benchmark", str(workspace / "bench"),
            "--max_new_tokens", str(MAX_NEW_TOKENS), "--device", "cpu", "--output_dir", str(tmp_path)]


def test_recall_analysis(workspace, tmp_path):  # noqa: F811
    summary = analyze.main(analysis_argv(workspace, tmp_path, "recall"))
    assert summary["replay_reproduces_generate"] == 1.0 and summary["verification_agrees_with_generate"] == 1.0
    variants = summary["variants"]
    assert set(variants) == {"on", "off", "baseline"}
    for positions in variants.values():
        rounds = [p["rounds"] for p in positions]
        assert rounds[0] == summary["rounds"]  # position 0: every round, all variants share the anchor
        assert all(a >= b for a, b in zip(rounds, rounds[1:])) and rounds[1] > 0
        for p in positions:
            if p["rounds"]:
                assert 0 <= p["recall@1"] <= p["recall@16"] <= 1
                assert p["recall@1_ci95"] >= 0
    assert [p["rounds"] for p in variants["on"]] == [p["rounds"] for p in variants["off"]]
    written = json.loads((tmp_path / "recall.json").read_text())["variants"]  # strict JSON: undefined -> null
    for variant, positions in variants.items():
        assert [p["recall@1"] if p["rounds"] else None for p in positions] == [p["recall@1"] for p in written[variant]]
    assert (tmp_path / "recall.png").read_bytes()[:4] == b"\x89PNG"


def test_reconvergence_analysis(workspace, tmp_path):  # noqa: F811
    summary = analyze.main(analysis_argv(workspace, tmp_path, "reconvergence"))
    subsets = summary["subsets"]
    assert [row["subset"] for row in subsets] == ["alpha", "beta", "gamma"]
    for row in subsets:
        assert row["rejected_rounds"] > 0
        assert 0 <= row["reconvergence_per_rejected_round"] <= row["rejected_per_rejected_round"] <= 3
        assert 0 <= row["post_rejection_matches_per_rejected_round"] < row["rejected_per_rejected_round"]
        assert row["normalized_reconvergence"] == pytest.approx(row["reconvergence_per_rejected_round"] / row["baseline_tau"])
        assert row["carryover_gain"] == pytest.approx(row["carryover_tau"] / row["baseline_tau"] - 1)
        assert 1 <= row["baseline_tau"] <= 4 and 1 <= row["carryover_tau"] <= 4
    # r is the Pearson correlation of the rows' normalised R with their gains, written out (not a range that always
    # holds); the synthetic cases are in test_paper_rules.py
    xs = [row["normalized_reconvergence"] for row in subsets]
    ys = [row["carryover_gain"] for row in subsets]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    covariance = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    spread = math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))
    assert summary["correlation"]["normalized_reconvergence"] == pytest.approx(covariance / spread)
    assert (tmp_path / "reconvergence.json").is_file() and (tmp_path / "reconvergence.png").is_file()


def test_attention_analysis(workspace, tmp_path):  # noqa: F811
    argv = ["attention", "--target", str(workspace / "target"), "--drafter", str(workspace / "carryover"),
            "--benchmark", str(workspace / "bench"), "--subsets", "alpha", "--max_new_tokens", str(MAX_NEW_TOKENS),
            "--device", "cpu", "--output_dir", str(tmp_path)]
    summary = analyze.main(argv)
    overall = summary["with_carried_rows"]
    assert overall["rounds"] > 0 and 0 < overall["carried_share"] < 1
    assert overall["context_share"] + overall["carried_share"] + overall["block_share"] == pytest.approx(1, abs=1e-5)
    by_rows = summary["by_carried_rows"]
    assert sum(entry["rounds"] for entry in by_rows.values()) == overall["rounds"]
    for share in ("context_share", "carried_share", "block_share"):  # the overall mean is the rounds-weighted mean
        weighted = sum(entry["rounds"] * entry[share] for entry in by_rows.values()) / overall["rounds"]
        assert overall[share] == pytest.approx(weighted, abs=1e-6)
    assert set(by_rows) <= {1, 2, 3}
    assert (tmp_path / "attention.png").is_file()


def test_recall_needs_a_baseline(workspace, tmp_path):  # noqa: F811
    argv = ["recall", "--target", str(workspace / "target"), "--drafter", str(workspace / "carryover"),
            "--benchmark", str(workspace / "bench"), "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match="pass --baseline"):
        analyze.main(argv)
