"""The positive control's synthetic target family (evaluation/synthetic_target.py) and its one-command sweep
(experiments/reconvergence-control/sweep.sh), run tiny end to end: a real target folder trained here, the project's
CLIs on it as a user's own target, and a lossless decode with carried rows."""

import json
import os
import random
import subprocess

import pytest
import torch
from conftest import REPO_ROOT
from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_carryover as mc
from carryover_common.benchmarks import encode_prompt, load_benchmark
from evaluation.synthetic_target import Rules, SyntheticArguments, build_tokenizer, make_prompt, make_prompts


def test_rho_sets_what_an_event_does_and_nothing_else():
    args = SyntheticArguments(output_dir="unused", num_spine=200, num_classes=8, num_events=4)
    rules = Rules(args)
    rng = random.Random(0)
    no_detours, all_detours = make_prompt(rng, 0.0, args), make_prompt(rng, 1.0, args)
    assert len(no_detours.events) == len(all_detours.events) == 4  # as many events, whatever rho
    assert set(no_detours.events.values()) == {None} and None not in all_detours.events.values()
    assert sum(d is not None for d in make_prompt(rng, 0.5, args).events.values()) == 2

    # rho 1: every event is a detour, so with the decorations removed the count goes on in lane a
    words = [f"a{all_detours.start}", *rules.response(all_detours, 80)]
    counted = [word for word in words if not word.startswith("d")]
    assert counted == [f"a{all_detours.start + i}" for i in range(len(counted))]
    decorated = 0
    for before, word in zip(words, words[1:]):  # a decoration follows exactly the tokens of an event class
        event = None if before.startswith("d") else all_detours.events.get(rules.token_class[int(before[1:])])
        assert word.startswith("d") == (event is not None) and (event is None or word == f"d{event}")
        decorated += word.startswith("d")
    assert decorated > 0

    # rho 0: no decorations; the count goes on and the lane switches after exactly the tokens of an event class
    words = [f"a{no_detours.start}", *rules.response(no_detours, 80)]
    assert [int(word[1:]) for word in words] == [no_detours.start + i for i in range(len(words))]
    switches = [a[0] != b[0] for a, b in zip(words, words[1:])]
    assert switches == [rules.token_class[int(a[1:])] in no_detours.events for a in words[:-1]] and any(switches)


def test_prompts_are_held_out_and_the_template_round_trips():
    args = SyntheticArguments(output_dir="unused", num_train_prompts=200, num_eval_prompts=20, rhos=[0.0, 1.0])
    train, held_out = make_prompts(args)
    train_prompts = {prompt.text() for prompt in train}
    assert len(train_prompts) == 200 and {prompt.rho for prompt in train} == {0.0, 1.0}
    for rho, prompts in held_out.items():
        assert len(prompts) == 20 and not {p.text() for p in prompts} & train_prompts
        assert all(prompt.rho == rho for prompt in prompts)
    tokenizer = build_tokenizer(args)
    text = train[0].text()
    ids = encode_prompt(tokenizer, text)["input_ids"][0].tolist()
    words = tokenizer.convert_ids_to_tokens(ids)
    assert words == ["<user>", *text.split(), "<assistant>"] and tokenizer.unk_token_id not in ids


@pytest.mark.slow
def test_the_sweep_runs_end_to_end_and_decodes_losslessly_with_carried_rows(tmp_path):
    """The sweep's one command at toy scale: every stage through the CLIs, then a decode with carried rows."""
    out, results = tmp_path / "run", tmp_path / "results"
    env = {
        **os.environ, "OUT": str(out), "RESULTS": str(results), "THREADS": "1", "TARGET_STEPS": "40",
        "BASELINE_STEPS": "6", "CONTINUE_STEPS": "3", "PROMPTS": "2", "RHOS": "0 1", "LAYERS": "0 1",
        "HF_HUB_OFFLINE": "1",
        "TARGET_FLAGS": "--hidden_size 64 --num_layers 2 --num_heads 2 --num_spine 300 --num_classes 8 --num_events 3 "
        "--num_train_prompts 16 --response_tokens 48 --batch_size 8",
    }
    sweep = subprocess.run(["bash", "experiments/reconvergence-control/sweep.sh"], cwd=REPO_ROOT, env=env,
                           capture_output=True, text=True, timeout=1200)
    assert sweep.returncode == 0, sweep.stderr[-4000:]
    summary_text = (results / "summary.json").read_text()
    summary = json.loads(summary_text)
    assert [row["rho"] for row in summary["rows"]] == [0.0, 1.0]
    for row in summary["rows"]:
        assert row["T0"]["mismatches"] == 0  # evaluation/run.py: carryover decoding equals plain greedy
        assert row["T0"]["gain_ci95"][0] <= row["T0"]["gain"] <= row["T0"]["gain_ci95"][1]
        assert "T1" in row
    assert (results / "gain_vs_reconvergence.png").stat().st_size > 0
    # the run's regenerated data and checkpoints are ordinary project folders
    assert (out / "carryover" / "model.safetensors").exists() and (out / "control" / "model.safetensors").exists()

    # a decode with carried rows equals the target's own greedy text, prompt by prompt
    target = AutoModelForCausalLM.from_pretrained(out / "synthetic" / "target").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "synthetic" / "target")
    drafter = mc.CarryoverDrafterModel.from_pretrained(out / "carryover").eval()
    assert drafter.config.carryover
    carried = 0
    for subset, prompts in load_benchmark(str(out / "synthetic" / "benchmark")).items():
        for prompt in prompts:
            inputs = encode_prompt(tokenizer, prompt)
            plain = target.generate(**inputs, max_new_tokens=64, do_sample=False)
            speculative = mc.generate(target, **inputs, assistant_model=drafter, max_new_tokens=64, do_sample=False)
            assert torch.equal(speculative, plain), subset
            carried += sum(round_.carried for round_ in drafter.generation_stats.rounds)
    assert carried > 0  # rounds drafted with the previous round's rejected rows
    # the sweep skips what exists: a second run does no training and rewrites the same summary
    again = subprocess.run(["bash", "experiments/reconvergence-control/sweep.sh"], cwd=REPO_ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert (results / "summary.json").read_text() == summary_text
