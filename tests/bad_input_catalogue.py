"""Run every command of the project on bad inputs, as a new user would, and print what happened to each.

    python tests/bad_input_catalogue.py            # all cases (a few minutes on 2 cores) -> docs/bad-inputs.md
    python tests/bad_input_catalogue.py convert    # only the cases whose name contains "convert"

Each case runs one CLI in a fresh process on tiny random models built here (no download), in a scratch folder.
Verdicts:
  clear       refused with a message that names the problem (the case's `names`) and no traceback
  unclear     refused, but with a raw traceback or a message that does not name the problem
  silent      ran to the end: the bad input was used, capped or ignored without a word
  destroyed   a file the user had before the run was changed or removed (checked on every case, whatever its outcome)
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]


@dataclass
class Case:
    name: str
    argv: list  # the command after `python`, with {placeholders} of the workspace
    names: list  # the message must contain one of these (case-insensitive): the flag or file at fault
    setup: callable = None  # makes the bad input in the workspace: setup(root)
    protect: list = field(default_factory=list)  # folders/files of the user's that must stay byte for byte


# ------------------------------------------------------------------------------------------------------------------
# The workspace: a tiny target with its tokenizer, a drafter, training rows, a benchmark, earlier results
# ------------------------------------------------------------------------------------------------------------------


def build_workspace(root: Path) -> None:
    import torch
    from conftest import make_drafter, make_target
    from datasets import Dataset
    from test_evaluation import tiny_tokenizer, two_token_target, write_benchmark

    target = two_token_target()
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    make_drafter(target, seed=1).save_pretrained(root / "drafter")
    make_drafter(target, seed=2).save_pretrained(root / "trained")  # "a folder holding a trained drafter"
    make_drafter(make_target(), seed=3, draft_vocab_size=32).save_pretrained(root / "vocab_drafter")
    rows = [{"input_ids": [5 + (i + j) % 80 for j in range(24)], "loss_mask": [0] * 6 + [1] * 18} for i in range(12)]
    Dataset.from_list(rows).save_to_disk(str(root / "data"))
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(8)))
    write_benchmark(root / "bench", {"alpha": 2})
    (root / "user_files").mkdir()
    (root / "user_files" / "notes.txt").write_text("my notes, not a run's output\n")
    torch.save({}, root / "user_files" / "weights.pt")


def earlier_eval_run(root: Path, name: str = "eval_run") -> None:
    """An evaluation folder as an earlier run left it: records, report, table."""
    check_setup(run([sys.executable, *format_argv(EVAL + ["--temperatures", "0", "--output_dir", f"{{root}}/{name}"], root)]))


def truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def copy_folder(source: Path, destination: Path) -> Path:
    import shutil

    shutil.copytree(source, destination)
    return destination


def token_map_mismatch(root: Path) -> None:
    folder = copy_folder(root / "vocab_drafter", root / "bad_vocab")
    config = json.loads((folder / "config.json").read_text())
    config["draft_vocab_size"] = 40  # the weights hold a 32-token map
    (folder / "config.json").write_text(json.dumps(config))


def user_files(name: str):
    """A setup: a folder of the user's own files (one per case, as a case may destroy it)."""
    return lambda root: copy_folder(root / "user_files", root / name)


def rows_with(root: Path, name: str, change) -> None:
    from datasets import Dataset

    rows = [{"input_ids": [5 + (i + j) % 80 for j in range(24)], "loss_mask": [0] * 6 + [1] * 18} for i in range(12)]
    change(rows[3])
    Dataset.from_list(rows).save_to_disk(str(root / name))


TRAIN = ["trainer/run.py", "--target", "{root}/target", "--num_draft_layers", "1", "--block_size", "4", "--num_anchors", "4",
         "--per_device_train_batch_size", "4", "--report_to", "none", "--use_cpu", "--disable_tqdm", "true",
         "--save_strategy", "no"]
TRAIN_OK = TRAIN + ["--dataset", "{root}/data", "--max_steps", "1"]
REGEN = ["-m", "trainer.regenerate", "--target", "{root}/target", "--prompts", "{root}/prompts.jsonl", "--max_new_tokens", "4",
         "--shard_size", "4"]
FEATURES = ["-m", "trainer.features", "--target", "{root}/target", "--dataset", "{root}/data", "--dtype", "float32"]
EVAL = ["evaluation/run.py", "--target", "{root}/target", "--drafters", "b={root}/drafter", "--benchmark", "{root}/bench",
        "--max_new_tokens", "8", "--warmup", "0", "--device", "cpu"]
EVAL_OK = EVAL + ["--temperatures", "0", "--output_dir", "{root}/eval_new"]
CONVERT = ["hub/convert.py"]
PUBLISH = ["hub/publish.py", "--repo_id", "me/drafter", "--base_model", "me/target", "--dry_run"]

CASES = [
    # trainer/run.py
    Case("train: --output_dir holds a trained drafter", TRAIN_OK + ["--output_dir", "{root}/trained"], ["overwrite_output_dir"],
         protect=["trained"]),
    Case("train: --output_dir is the --dataset folder", TRAIN + ["--dataset", "{root}/data_t", "--max_steps", "1", "--output_dir",
         "{root}/data_t"], ["data_t"], setup=lambda r: copy_folder(r / "data", r / "data_t"), protect=["data_t"]),
    Case("train: --max_steps 0", TRAIN + ["--dataset", "{root}/data", "--max_steps", "0", "--output_dir", "{root}/t1"], ["max_steps"]),
    Case("train: --num_train_epochs 0", TRAIN + ["--dataset", "{root}/data", "--num_train_epochs", "0", "--output_dir", "{root}/t2"],
         ["num_train_epochs"]),
    Case("train: --dataset that does not exist", TRAIN + ["--dataset", "{root}/no/such/data", "--output_dir", "{root}/t3"],
         ["no/such/data"]),
    Case("train: loss_mask with 5 and -1", TRAIN + ["--dataset", "{root}/mask5", "--max_steps", "1", "--output_dir", "{root}/t4"],
         ["loss_mask"], setup=lambda r: rows_with(r, "mask5", lambda row: row["loss_mask"].__setitem__(slice(0, 2), [5, -1]))),
    Case("train: token id beyond the vocabulary", TRAIN + ["--dataset", "{root}/bigid", "--max_steps", "1", "--output_dir", "{root}/t5"],
         ["vocab"], setup=lambda r: rows_with(r, "bigid", lambda row: row["input_ids"].__setitem__(8, 5000))),
    Case("train: malformed JSONL rows (line 3)", TRAIN + ["--dataset", "{root}/broken.jsonl", "--max_steps", "1", "--output_dir", "{root}/t6"],
         ["broken.jsonl"], setup=lambda r: (r / "broken.jsonl").write_text(
             "\n".join((r / "rows.jsonl").read_text().splitlines()[:2] + ['{"input_ids": [1, 2', ""]))),
    Case("train: truncated drafter model.safetensors", TRAIN_OK + ["--drafter_checkpoint", "{root}/cut", "--output_dir", "{root}/t7"],
         ["model.safetensors"], setup=lambda r: truncate(copy_folder(r / "drafter", r / "cut") / "model.safetensors")),
    Case("train: --drafter_checkpoint that does not exist", TRAIN_OK + ["--drafter_checkpoint", "{root}/no_such_ckpt", "--output_dir", "{root}/t8"],
         ["no_such_ckpt"]),
    Case("train: --drafter_checkpoint is not a drafter (the target)", TRAIN_OK + ["--drafter_checkpoint", "{root}/target", "--output_dir", "{root}/t9"],
         ["not a carryover drafter", "not a drafter"]),
    Case("train: --target that does not exist", TRAIN_OK + ["--target", "./no_such_target", "--output_dir", "{root}/t10"],
         ["no_such_target"]),
    Case("train: --num_draft_layers 0", TRAIN_OK + ["--num_draft_layers", "0", "--output_dir", "{root}/t11"], ["num_draft_layers"]),
    Case("train: --block_size 1", TRAIN_OK + ["--block_size", "1", "--output_dir", "{root}/t12"], ["block_size"]),
    Case("train: --eval_rows -1", TRAIN_OK + ["--eval_rows", "-1", "--output_dir", "{root}/t13"], ["eval_rows"]),
    Case("train: --dataset_shards -1", TRAIN_OK + ["--dataset_shards", "-1", "--output_dir", "{root}/t17"], ["dataset_shards"]),
    Case("train: --num_anchors 0", TRAIN_OK + ["--num_anchors", "0", "--output_dir", "{root}/t18"], ["num_anchors"]),
    Case("train: --max_seq_length 0", TRAIN_OK + ["--max_seq_length", "0", "--output_dir", "{root}/t14"], ["max_seq_length"]),
    Case("train: --target_dtype fp16", TRAIN_OK + ["--target_dtype", "fp16", "--output_dir", "{root}/t15"], ["float16"]),
    Case("train: config's draft_vocab_size disagrees with its token map",
         TRAIN + ["--dataset", "{root}/data", "--max_steps", "1", "--drafter_checkpoint", "{root}/bad_vocab", "--output_dir", "{root}/t16"],
         ["draft_vocab_size"], setup=token_map_mismatch),
    # python -m trainer.regenerate
    Case("regenerate: --num_prompts 0", REGEN + ["--num_prompts", "0", "--data_dir", "{root}/r1"], ["num_prompts"]),
    Case("regenerate: --prompts file that does not exist", REGEN[:-6] + ["--prompts", "{root}/nope.jsonl", "--data_dir", "{root}/r2"],
         ["nope.jsonl"]),
    Case("regenerate: --prompts file that is not UTF-8",
         ["-m", "trainer.regenerate", "--target", "{root}/target", "--prompts", "{root}/latin1.jsonl", "--data_dir", "{root}/r3"],
         ["latin1.jsonl"], setup=lambda r: (r / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))),
    Case("regenerate: --data_dir holds the user's files", REGEN + ["--data_dir", "{root}/user_files1"], ["user_files1"],
         setup=user_files("user_files1"), protect=["user_files1"]),
    Case("regenerate: --shard_size 0", REGEN[:-2] + ["--shard_size", "0", "--data_dir", "{root}/r4"], ["shard_size"]),
    Case("regenerate: --do_sample --temperature 0", REGEN + ["--do_sample", "--temperature", "0", "--data_dir", "{root}/r5"],
         ["temperature"]),
    Case("regenerate: --chat_template_kwargs not JSON", REGEN + ["--chat_template_kwargs", "{bad", "--data_dir", "{root}/r6"],
         ["chat_template_kwargs"]),
    Case("regenerate: --do_sample --top_p 0", REGEN + ["--do_sample", "--top_p", "0", "--data_dir", "{root}/r8"], ["top_p"]),
    Case("regenerate: --max_new_tokens 0", REGEN[:-4] + ["--max_new_tokens", "0", "--data_dir", "{root}/r7"], ["max_new_tokens"]),
    # python -m trainer.features
    Case("features: --output_dir holds the user's files", FEATURES + ["--output_dir", "{root}/user_files2"], ["user_files2"],
         setup=user_files("user_files2"), protect=["user_files2"]),
    Case("features: --output_dir is the --dataset folder", ["-m", "trainer.features", "--target", "{root}/target", "--dataset",
         "{root}/data_f", "--dtype", "float32", "--output_dir", "{root}/data_f"], ["data_f"],
         setup=lambda r: copy_folder(r / "data", r / "data_f"), protect=["data_f"]),
    Case("features: --dataset that does not exist", ["-m", "trainer.features", "--target", "{root}/target", "--dataset",
         "{root}/no_such_rows", "--output_dir", "{root}/f1"], ["no_such_rows"]),
    Case("features: --shard_size 0", FEATURES + ["--shard_size", "0", "--output_dir", "{root}/f2"], ["shard_size"]),
    Case("features: token id beyond the vocabulary", ["-m", "trainer.features", "--target", "{root}/target", "--dataset", "{root}/bigid2",
         "--output_dir", "{root}/f3"], ["vocab"], setup=lambda r: rows_with(r, "bigid2", lambda row: row["input_ids"].__setitem__(2, 999))),
    # evaluation/run.py
    Case("evaluate: into an earlier run's folder without --resume, then a bad flag", EVAL + ["--temperatures", "0",
         "--num_assistant_tokens", "0", "--output_dir", "{root}/eval_run"], ["--resume", "num_assistant_tokens"],
         setup=earlier_eval_run, protect=["eval_run"]),
    Case("evaluate: into an earlier run's folder without --resume", EVAL + ["--temperatures", "0", "--output_dir", "{root}/eval_run2"],
         ["--resume"], setup=lambda r: earlier_eval_run(r, "eval_run2"), protect=["eval_run2"]),
    Case("evaluate: --drafters without NAME=", EVAL_OK[:-1] + ["{root}/e14", "--drafters", "{root}/drafter"], ["NAME=PATH"]),
    Case("evaluate: --limit 0", EVAL_OK[:-1] + ["{root}/e15", "--limit", "0"], ["limit"]),
    Case("evaluate: --temperatures -1", EVAL + ["--temperatures", "-1", "--output_dir", "{root}/e1"], ["temperature"]),
    Case("evaluate: --num_assistant_tokens 100 (block 4)", EVAL_OK[:-1] + ["{root}/e2", "--num_assistant_tokens", "100"],
         ["num_assistant_tokens"]),
    Case("evaluate: --num_assistant_tokens 0", EVAL_OK[:-1] + ["{root}/e3", "--num_assistant_tokens", "0"], ["num_assistant_tokens"]),
    Case("evaluate: drafter path that does not exist", EVAL_OK[:-1] + ["{root}/e4", "--drafters", "b={root}/no/such/drafter"],
         ["no/such/drafter"]),
    Case("evaluate: truncated drafter model.safetensors", EVAL_OK[:-1] + ["{root}/e5", "--drafters", "b={root}/cut2"],
         ["model.safetensors"], setup=lambda r: truncate(copy_folder(r / "drafter", r / "cut2") / "model.safetensors")),
    Case("evaluate: truncated target model.safetensors", EVAL_OK[:-1] + ["{root}/e6", "--target", "{root}/cut_target"],
         ["model.safetensors"], setup=lambda r: truncate(copy_folder(r / "target", r / "cut_target") / "model.safetensors")),
    Case("evaluate: malformed benchmark line 3", EVAL_OK[:-1] + ["{root}/e7", "--benchmark", "{root}/badbench"], ["alpha.jsonl, line 3", "alpha.jsonl:3"],
         setup=lambda r: (r / "badbench").mkdir() or (r / "badbench" / "alpha.jsonl").write_text('{"prompt": "w1"}\n\n{"prompt": w2}\n')),
    Case("evaluate: benchmark that is not UTF-8", EVAL_OK[:-1] + ["{root}/e8", "--benchmark", "{root}/latinbench"], ["alpha.jsonl"],
         setup=lambda r: (r / "latinbench").mkdir() or (r / "latinbench" / "alpha.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))),
    Case("evaluate: --max_new_tokens 0", EVAL_OK[:-1] + ["{root}/e9", "--max_new_tokens", "0"], ["max_new_tokens"]),
    Case("evaluate: --dtype fp16", EVAL_OK[:-1] + ["{root}/e10", "--dtype", "fp16"], ["float16"]),
    Case("evaluate: --draft_confidence_threshold 1.5", EVAL_OK[:-1] + ["{root}/e11", "--draft_confidence_threshold", "1.5"],
         ["draft_confidence_threshold"]),
    Case("evaluate: --warmup -1", EVAL_OK[:-1] + ["{root}/e12", "--warmup", "-1"], ["warmup"]),
    Case("evaluate: --benchmark folder that does not exist", EVAL_OK[:-1] + ["{root}/e13", "--benchmark", "{root}/no_bench/"], ["no_bench"]),
    # hub/convert.py
    Case("convert: --output_dir is --source (in place)", CONVERT + ["--source", "{root}/drafter_i", "--output_dir", "{root}/drafter_i",
         "--to", "dflash"], ["drafter_i"], setup=lambda r: copy_folder(r / "drafter", r / "drafter_i"), protect=["drafter_i"]),
    Case("convert: --output_dir inside --source", CONVERT + ["--source", "{root}/drafter_c", "--output_dir", "{root}/drafter_c/dflash",
         "--to", "dflash"], ["drafter_c"], setup=lambda r: copy_folder(r / "drafter", r / "drafter_c"), protect=["drafter_c"]),
    Case("convert: --output_dir holds the user's files", CONVERT + ["--source", "{root}/drafter", "--output_dir", "{root}/user_files3"],
         ["overwrite_output_dir"], setup=user_files("user_files3"), protect=["user_files3"]),
    Case("convert: truncated --source weights", CONVERT + ["--source", "{root}/cut3", "--output_dir", "{root}/c1"], ["model.safetensors"],
         setup=lambda r: truncate(copy_folder(r / "drafter", r / "cut3") / "model.safetensors")),
    Case("convert: --source that does not exist", CONVERT + ["--source", "{root}/no_such_source", "--output_dir", "{root}/c2"],
         ["no_such_source"]),
    # hub/publish.py
    Case("publish: --output_dir is --checkpoint", PUBLISH + ["--checkpoint", "{root}/drafter_p", "--output_dir", "{root}/drafter_p"],
         ["--checkpoint", "drafter_p"], setup=lambda r: copy_folder(r / "drafter", r / "drafter_p"), protect=["drafter_p"]),
    Case("publish: --output_dir holds the user's files", PUBLISH + ["--checkpoint", "{root}/drafter", "--output_dir", "{root}/user_files4"],
         ["overwrite_output_dir"], setup=user_files("user_files4"), protect=["user_files4"]),
    Case("publish: --eval_report that does not exist", PUBLISH + ["--checkpoint", "{root}/drafter", "--output_dir", "{root}/p2",
         "--eval_report", "{root}/no_report.json"], ["no_report.json"]),
    Case("publish: truncated checkpoint weights", PUBLISH + ["--checkpoint", "{root}/cut4", "--output_dir", "{root}/p1"], ["model.safetensors"],
         setup=lambda r: truncate(copy_folder(r / "drafter", r / "cut4") / "model.safetensors")),
    # the others
    Case("vllm export: --output_dir is --source", ["-m", "serving.vllm_plugin", "--source", "{root}/drafter_v", "--output_dir",
         "{root}/drafter_v"], ["drafter_v"], setup=lambda r: copy_folder(r / "drafter", r / "drafter_v"), protect=["drafter_v"]),
    Case("vllm export: --output_dir holds the user's files", ["-m", "serving.vllm_plugin", "--source", "{root}/drafter", "--output_dir",
         "{root}/user_files5"], ["overwrite_output_dir"], setup=user_files("user_files5"), protect=["user_files5"]),
    Case("slot_accuracy: --output_dir holds an earlier slot_accuracy.json", ["evaluation/slot_accuracy.py", "--drafters", "b={root}/drafter",
         "--sets", "s={root}/data", "--target", "{root}/target", "--rows", "2", "--num_anchors", "2", "--output_dir", "{root}/slot"],
         ["overwrite_output_dir"], setup=lambda r: (r / "slot").mkdir() or (r / "slot" / "slot_accuracy.json").write_text("{}"),
         protect=["slot"]),
    Case("slot_accuracy: --rows 0", ["evaluation/slot_accuracy.py", "--drafters", "b={root}/drafter", "--sets", "s={root}/data",
         "--target", "{root}/target", "--rows", "0", "--output_dir", "{root}/slot2"], ["rows"]),
    Case("analyze: --output_dir holds an earlier recall.json", ["evaluation/analyze.py", "recall", "--drafter", "{root}/drafter", "--baseline",
         "{root}/drafter", "--target", "{root}/target", "--benchmark", "{root}/bench", "--max_new_tokens", "8", "--output_dir", "{root}/an"],
         ["overwrite_output_dir"], setup=lambda r: (r / "an").mkdir() or (r / "an" / "recall.json").write_text("{}"), protect=["an"]),
    Case("analyze: --ks 0", ["evaluation/analyze.py", "recall", "--drafter", "{root}/drafter", "--baseline", "{root}/drafter", "--target",
         "{root}/target", "--benchmark", "{root}/bench", "--ks", "0", "--output_dir", "{root}/an2"], ["ks"]),
    Case("heldout: --output_dir is the --data_dir", ["-m", "evaluation.heldout", "--data_dir", "{root}/regen", "--output_dir", "{root}/regen",
         "--subsets", "python_code", "--num_prompts", "2"], ["regen"], setup=lambda r: regenerated(r), protect=["regen"]),
    Case("heldout: --num_prompts 0", ["-m", "evaluation.heldout", "--data_dir", "{root}/regen0", "--output_dir", "{root}/h1",
         "--subsets", "python_code", "--num_prompts", "0"], ["num_prompts"], setup=lambda r: regenerated(r, "regen0")),
    Case("compare: --runs folder without records", ["evaluation/compare.py", "--runs", "{root}/user_files", "--gains", "a=b"],
         ["records.jsonl.gz"]),
]


def regenerated(root: Path, name: str = "regen") -> None:
    check_setup(run([sys.executable, *format_argv(REGEN + ["--data_dir", f"{{root}}/{name}"], root)]))


def check_setup(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"setup failed: {last_words(result.stderr)}")


# ------------------------------------------------------------------------------------------------------------------
# Running and judging
# ------------------------------------------------------------------------------------------------------------------


def format_argv(argv: list, root: Path) -> list:
    return [arg.replace("{root}", str(root)) for arg in argv]


def run(command: list, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO_ROOT), "HF_MODULES_CACHE": os.environ.get("HF_MODULES_CACHE", "")}
    env = {k: v for k, v in env.items() if v}
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def snapshot(paths: list) -> dict:
    """{file: sha256} of every file under `paths` (folders or files)."""
    files = {}
    for path in paths:
        for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            files[str(file)] = hashlib.sha256(file.read_bytes()).hexdigest()
    return files


def last_words(stderr: str) -> str:
    """The error message: after a traceback its exception line (progress bars may follow it), else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    exceptions = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b.*", line)]
    if "Traceback (most recent call last)" in stderr and exceptions:
        return exceptions[-1]
    return lines[-1] if lines else ""


def judge(case: Case, root: Path) -> dict:
    try:
        if case.setup:
            case.setup(root)
    except Exception as error:  # a broken workspace says nothing about the command: shown as such
        return {"input": case.name, "outcome": str(error)[:300], "verdict": "setup failed"}
    protected = [root / p for p in case.protect]
    before = snapshot(protected)
    try:
        result = run([sys.executable, *format_argv(case.argv, root)])
        returncode, stderr = result.returncode, result.stderr
    except subprocess.TimeoutExpired:
        returncode, stderr = None, "timed out"
    after = snapshot(protected)
    changed = sorted(Path(f).relative_to(root).as_posix() for f in before if before[f] != after.get(f))
    message = last_words(stderr)
    if changed:
        verdict, outcome = "destroyed", f"changed or removed {', '.join(changed[:3])}" + (" ..." if len(changed) > 3 else "")
    elif returncode == 0:
        verdict, outcome = "silent", "ran to the end"
    else:
        named = any(n.lower() in message.lower() for n in case.names)
        raw = "Traceback (most recent call last)" in stderr
        verdict = "clear" if named and not raw else "unclear"
        outcome = ("traceback: " if raw else "") + message
    return {"input": case.name, "outcome": outcome.replace(str(root), "<scratch>")[:300], "verdict": verdict}


def table(rows: list) -> str:
    verdicts = ["clear", "unclear", "silent", "destroyed"] + (["setup failed"] if any(r["verdict"] == "setup failed" for r in rows) else [])
    counts = {v: sum(r["verdict"] == v for r in rows) for v in verdicts}
    lines = ["| input | outcome | verdict |", "|---|---|---|"]
    for r in rows:
        outcome = r["outcome"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['input']} | {outcome} | {r['verdict']} |")
    summary = f"{len(rows)} bad inputs: " + ", ".join(f"{n} {v}" for v, n in counts.items())
    return "\n".join(lines) + "\n\n" + summary + "\n"


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    selected = [c for c in CASES if not argv or any(a in c.name for a in argv)]
    with tempfile.TemporaryDirectory(prefix="bad-inputs-") as scratch:
        root = Path(scratch)
        os.environ["HF_MODULES_CACHE"] = str(root / "modules")  # remote code copies stay in the scratch folder
        build_workspace(root)
        with ThreadPoolExecutor(max_workers=2) as pool:
            rows = list(pool.map(lambda case: judge(case, root), selected))
    text = table(rows)
    print(text)
    if not argv:
        header = ("# Bad inputs: what each command does with them\n\nMade by `python tests/bad_input_catalogue.py` "
                  "(every CLI in a fresh process, tiny random models). Verdicts: clear (refused, naming the problem "
                  "and the fix), unclear (a raw traceback or a message that does not name the problem), silent (ran "
                  "without a word), destroyed (a user's file changed or removed).\n\n")
        (REPO_ROOT / "docs" / "bad-inputs.md").write_text(header + text)
    return rows


if __name__ == "__main__":
    main()
