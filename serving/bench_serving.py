"""Serving benchmark in vLLM (the paper's Table 2 layout): plain decoding, vLLM's own DFlash and carryover, at each
concurrency, tokens/s and acceptance length side by side in one run, and what carryover costs per round.

    bash serving/vllm_env.sh && . .venv-vllm/bin/activate
    python serving/bench_serving.py --drafter checkpoints/carryover --concurrency 1 2 4 8 \
        --num_prompts 4 --max_tokens 32 --repeats 3 --output experiments/cpu-benchmarks/bench_serving.json

The drafter (this project's checkpoint) is exported twice: `hub/convert.py --to dflash --verifier <target>`, served
by vLLM's own DFlash with the plugin disabled (`VLLM_PLUGINS=""`; a draft vocabulary gets the target LM head's rows of
its tokens as the drafter's own head, which stock vLLM loads and maps to target ids through `d2t`), and
`serving/vllm_plugin.py`'s export, served by the plugin with carryover on and, in the same engine, off
(`SamplingParams(extra_args={"carryover": False})`). Each engine runs in its own
process, in-process engine core and no async scheduling, so that one `step()` is one verification round of the batch.
At each concurrency c, the prompts (HumanEval and MT-Bench first turns, chat template, greedy, fixed length) are fed
with c requests in flight, `--repeats` times; the carryover engine alternates OFF and ON pass by pass. Reported per
mode and c: output tokens/s and acceptance length tau (1 + accepted / drafts, vLLM's counters) over all passes,
engine steps, and seconds per step (the median pass); and the per-round cost ratios carryover / vLLM DFlash and
carryover / carryover OFF (median seconds per step, same concurrency; OFF runs in the same engine, interleaved, so
that ratio is the least exposed to load drift). A benchmark, not a test: numbers depend on the machine and its load.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from carryover_common.benchmarks import encode_prompt, load_benchmark
from carryover_common.cli import parse_arguments


@dataclass
class ServingArguments:
    drafter: str = field(metadata={"help": "This project's drafter checkpoint (a folder)."})
    target: str | None = field(default=None, metadata={"help": "Default: the embedded SmolLM2-135M-Instruct."})
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    benchmark: str = field(default="embedded")
    num_prompts: int = field(default=4, metadata={"help": "Prompts per subset."})
    max_tokens: int = field(default=64, metadata={"help": "Output tokens per request (EOS ignored: equal work)."})
    repeats: int = field(default=3, metadata={"help": "Passes per mode and concurrency (alternating modes)."})
    dtype: str = field(default="float32")
    kv_cache_gib: int = field(default=2, metadata={"help": "VLLM_CPU_KVCACHE_SPACE."})
    output: str = field(default="outputs/bench_serving.json")


def run_batch(engine, prompts, concurrency, max_tokens, extra_args):
    """Serve `prompts` with at most `concurrency` in flight. Returns wall seconds, output tokens and engine steps."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
    pending, in_flight, tokens, steps = list(enumerate(prompts)), 0, 0, 0
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            index, prompt = pending.pop(0)
            engine.add_request(f"{time.monotonic_ns()}-{index}", {"prompt_token_ids": prompt}, params)
            in_flight += 1
        for output in engine.step():
            if output.finished:
                in_flight -= 1
                tokens += len(output.outputs[0].token_ids)
        steps += 1
    return time.perf_counter() - started, tokens, steps


def spec_counters(engine) -> dict:
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    return {names[m.name]: m.value for m in engine.get_metrics() if m.name in names}


def serve(job: dict) -> dict:
    """One engine (a worker process): every concurrency, its modes alternating, `repeats` passes each.
    -> {mode: {c: measurements}}, seconds per step as the median of the passes"""
    from vllm import LLM

    llm = LLM(model=job["target"], speculative_config=job["speculative_config"], dtype=job["dtype"],
              max_model_len=1024, max_num_seqs=max(job["concurrency"]), enforce_eager=True, disable_log_stats=False,
              async_scheduling=False, skip_tokenizer_init=True)  # fmt: skip
    engine = llm.llm_engine
    run_batch(engine, job["prompts"][:2], 2, 8, None)  # warm-up
    results = {mode: {} for mode in job["modes"]}
    for concurrency in job["concurrency"]:
        passes = {mode: [] for mode in job["modes"]}
        for _ in range(job["repeats"]):
            for mode, extra_args in job["modes"].items():
                before = spec_counters(engine) if job["speculative_config"] else {}
                seconds, tokens, steps = run_batch(engine, job["prompts"], concurrency, job["max_tokens"], extra_args)
                after = spec_counters(engine) if job["speculative_config"] else {}
                passes[mode].append({"seconds": seconds, "output_tokens": tokens, "steps": steps,
                                     **{k: after[k] - before[k] for k in after}})  # fmt: skip
        for mode, runs in passes.items():
            results[mode][concurrency] = measurements(runs)
            print(json.dumps({"mode": mode, "concurrency": concurrency, **results[mode][concurrency]}), flush=True)
    return results


def measurements(runs: list[dict]) -> dict:
    """Totals over the passes, tokens/s, tau, and seconds per step: the median pass and every pass."""
    total = {key: sum(run[key] for run in runs) for key in runs[0]}
    per_step = [run["seconds"] / run["steps"] for run in runs]
    result = {**total, "tokens_per_second": total["output_tokens"] / total["seconds"],
              "seconds_per_step": statistics.median(per_step), "seconds_per_step_passes": per_step}  # fmt: skip
    if "drafts" in total:
        result["acceptance_length"] = 1 + total["accepted"] / total["drafts"]
    return result


def run_worker(job: dict, plugins: bool) -> dict:
    """`serve(job)` in a fresh process: vLLM's engine, with or without this project's plugin."""
    with tempfile.TemporaryDirectory() as folder:
        job_file, result_file = Path(folder) / "job.json", Path(folder) / "result.json"
        job_file.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if not plugins:
            env["VLLM_PLUGINS"] = ""
        subprocess.run([sys.executable, __file__, "--worker", str(job_file), str(result_file)], env=env, check=True)
        return {mode: {int(c): r for c, r in by_c.items()} for mode, by_c in json.loads(result_file.read_text()).items()}


def prompt_ids(target: str, benchmark: str, num_prompts: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    subsets = load_benchmark(benchmark, limit=num_prompts)
    return [encode_prompt(tokenizer, p)["input_ids"][0].tolist() for prompts in subsets.values() for p in prompts]


def summary(results: dict, concurrency: list[int]) -> dict:
    """Per concurrency: tokens/s and tau of every mode, and the per-round cost ratios of carryover."""
    rows = {}
    for c in concurrency:
        row = {f"{mode} tok/s": results[mode][c]["tokens_per_second"] for mode in results}
        row |= {f"{mode} tau": results[mode][c]["acceptance_length"] for mode in results if mode != "plain"}
        step = {mode: results[mode][c]["seconds_per_step"] for mode in results}
        row["round cost carryover / vLLM DFlash"] = step["carryover"] / step["dflash"]
        row["round cost carryover / carryover OFF"] = step["carryover"] / step["carryover-off"]
        rows[c] = row
    return rows


ARGUMENT_CLASSES = (ServingArguments,)


def main(argv=None):
    (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
    import torch

    from carryover_common.targets import resolve_target_path
    from hub.convert import export_dflash, import_drafter, target_lm_head
    from serving.vllm_plugin import export_vllm

    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the cores may be shared
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    target = resolve_target_path(args.target)
    drafter = import_drafter(args.drafter)
    block = drafter.config.block_size
    with tempfile.TemporaryDirectory() as exports:
        # warns: E_carry dropped, as it should be; the target head's rows are written for a draft vocabulary only
        plain_export = export_dflash(drafter, f"{exports}/dflash", target_lm_head=target_lm_head(target, drafter))
        carryover_export = export_vllm(drafter, f"{exports}/carryover", carryover=True)
        job = {"target": target, "dtype": args.dtype, "prompts": prompt_ids(target, args.benchmark, args.num_prompts),
               "max_tokens": args.max_tokens, "concurrency": args.concurrency, "repeats": args.repeats}  # fmt: skip
        speculative = {"method": "dflash", "num_speculative_tokens": block - 1}
        results = run_worker({**job, "speculative_config": None, "modes": {"plain": None}}, plugins=False)
        results |= run_worker(
            {**job, "speculative_config": {**speculative, "model": str(plain_export)}, "modes": {"dflash": None}},
            plugins=False,
        )
        results |= run_worker(
            {**job, "speculative_config": {**speculative, "model": str(carryover_export)},
             "modes": {"carryover-off": {"carryover": False}, "carryover": {"carryover": True}}},
            plugins=True,
        )  # fmt: skip
    report = {
        "settings": {**asdict(args), "target": target, "threads": torch.get_num_threads(), "block_size": block,
                     "num_requests": len(job["prompts"]), "vllm": version("vllm-cpu")},  # fmt: skip
        "summary": summary(results, args.concurrency),
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    for c, row in report["summary"].items():
        print(f"c={c}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()))


def version(package: str) -> str:
    from importlib.metadata import version as installed

    return installed(package)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        job_file, result_file = sys.argv[2:4]
        Path(result_file).write_text(json.dumps(serve(json.loads(Path(job_file).read_text()))))
    else:
        main()
