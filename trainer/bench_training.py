"""Training benchmark: throughput and peak memory of baseline and carryover steps, side by side in one run, and how
a carryover step's time splits into the target pass, the detached first draft, the parallel verification, and the
drafter's second pass (forward + loss) and backward. The `_cached` modes read the target's features from a features
cache (trainer.features, extracted in that mode's process first, not timed) instead of the target's forward.

    python trainer/bench_training.py --dataset data/smollm2-magpie --steps 4 --batch_size 2 --num_anchors 64
    python trainer/bench_training.py --steps 4      # synthetic rows of random tokens if no dataset is given
    python trainer/bench_training.py --modes baseline baseline_cached    # cached features against the online target
    python trainer/bench_training.py --modes baseline --target_dtypes float32 bfloat16   # bf16 against float32

A benchmark, not a test: the numbers are machine- and load-dependent; compare ratios measured in the same run.
"""

import json
import multiprocessing
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's own start/stop chatter

import psutil
import torch
from accelerate.utils import send_to_device
from torch.profiler import ProfilerActivity, profile

from carryover_common.cli import parse_arguments
from carryover_common.targets import cpu_bf16_is_emulated, load_target
from trainer.build import DrafterArguments, build_drafter, load_training_rows, prepare_rows
from trainer.carryover_trainer import pad_collator
from trainer.features import extract_features
from trainer.objectives import LossSettings, default_gamma, training_step_loss

PHASES = ("carryover.target_pass", "carryover.first_draft", "carryover.verify", "carryover.drafter_loss")
MODES = ("baseline", "baseline_cached", "carryover", "carryover_cached")


@dataclass
class BenchArguments:
    target: str | None = field(default=None, metadata={"help": "Default: the embedded SmolLM2-135M-Instruct."})
    target_dtypes: list[str] = field(
        default_factory=lambda: ["float32"],
        metadata={
            "help": "The target's dtype; bfloat16 also runs the drafter under bf16 autocast. Several: every mode in "
            "each, side by side (a CPU that emulates bf16, AVX2 only, runs it several times slower than float32)."
        },
    )
    num_draft_layers: int = field(default=2)
    block_size: int = field(default=16)
    draft_vocab_size: int | None = field(default=None, metadata={"help": "The recipe's 8192: the head's most frequent rows."})
    dataset: str | None = field(default=None, metadata={"help": "Training rows; default: synthetic random tokens."})
    synthetic_length: int = field(default=256, metadata={"help": "Tokens per synthetic row (32 prompt + response)."})
    steps: int = field(default=4)
    batch_size: int = field(default=2)
    num_anchors: int = field(default=64)
    max_seq_length: int = field(default=512)
    verify_chunk_size: int = field(default=64)
    attn_implementation: str = field(default="eager", metadata={"help": "eager, or flex_attention (GPU only)."})
    modes: list[str] = field(default_factory=lambda: list(MODES), metadata={"choices": MODES})
    features_dtype: str = field(default="bfloat16", metadata={"help": "Storage dtype of the _cached modes' features."})
    output: str = field(default="outputs/bench_training.json")


class PeakMemory:
    """Peak memory above the starting point: CUDA allocator peak, or the process RSS sampled every 5 ms on CPU."""

    def __init__(self, device):
        self.device, self.peak, self._stop = device, 0, threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            process = psutil.Process()
            self.start = process.memory_info().rss
            self.thread = threading.Thread(target=self._sample, args=(process,), daemon=True)
            self.thread.start()
        return self

    def _sample(self, process):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, process.memory_info().rss - self.start)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            self._stop.set()
            self.thread.join()


def synthetic_rows(vocab_size, length, rows=16, prompt=32):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (rows, length), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": [[0] * prompt + [1] * (length - prompt)] * rows})


def run_steps(drafter, target, batches, features, args, carryover, optimizer, dtype):
    """`batches`: lists of rows, collated inside the timing (a features cache is read there, as in training)."""
    settings = LossSettings(gamma=default_gamma(drafter.config.block_size))
    device = next(drafter.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    backward_seconds, tokens = 0.0, 0
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with PeakMemory(device) as memory, profile(activities=activities, acc_events=True) as profiler, autocast:
        sync()
        started = time.perf_counter()
        for rows in batches:
            batch = send_to_device(pad_collator(rows, features), device)
            loss, _ = training_step_loss(drafter, target, batch, args.num_anchors, settings, carryover, args.verify_chunk_size)
            sync()
            t0 = time.perf_counter()
            loss.backward()
            sync()
            backward_seconds += time.perf_counter() - t0
            optimizer.step()
            optimizer.zero_grad()
            tokens += int((batch["loss_mask"] * batch["attention_mask"]).sum())
        sync()
        seconds = time.perf_counter() - started
    # on a GPU the work is asynchronous: a phase's time is the device time of the kernels launched inside it
    on_gpu = device.type == "cuda"
    events = {e.key: (e.device_time_total if on_gpu else e.cpu_time_total) / 1e6 for e in profiler.key_averages() if e.key in PHASES}
    split = {phase.split(".")[1]: events.get(phase, 0.0) for phase in PHASES} | {"backward": backward_seconds}
    return {
        "seconds_per_step": seconds / len(batches),
        "response_tokens_per_second": tokens / seconds,
        "peak_memory_mb": memory.peak / 2**20,
        "seconds_per_step_by_phase": {k: v / len(batches) for k, v in split.items()},
    }


def measure_mode(args, mode: str, dtype: str) -> dict:
    """One mode in its own process, so that its peak memory is not hidden by the other mode's freed allocations."""
    target, _ = load_target(args.target, tokenizer=False, dtype=getattr(torch, dtype))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target.to(device)
    rows = load_training_rows(args.dataset) if args.dataset else synthetic_rows(target.config.vocab_size, args.synthetic_length)
    torch.manual_seed(0)
    drafter_args = DrafterArguments(
        num_draft_layers=args.num_draft_layers,
        block_size=args.block_size,
        draft_vocab_size=args.draft_vocab_size,
        attn_implementation=args.attn_implementation,
    )
    drafter = build_drafter(target, drafter_args, rows).to(device).train()  # float32 master weights
    with tempfile.TemporaryDirectory(prefix="bench-features-") as features_dir:
        extraction, features = {}, None
        if mode.endswith("_cached"):
            started = time.perf_counter()
            features = extract_features(
                target, rows, features_dir, drafter.config.target_layer_ids, dtype=getattr(torch, args.features_dtype),
                max_seq_length=args.max_seq_length, batch_size=args.batch_size, progress=False,
            )
            size = sum(f.stat().st_size for f in features.paths)
            seconds = time.perf_counter() - started
            extraction = {"extraction_seconds_per_row": seconds / len(rows), "features_mb_per_row": size / 2**20 / len(rows)}
            rows = features.attach(rows, args.max_seq_length)
        rows = prepare_rows(rows, args.max_seq_length)
        batches = [[rows[(i * args.batch_size + j) % len(rows)] for j in range(args.batch_size)] for i in range(args.steps + 1)]
        carryover = mode.startswith("carryover")
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=6e-4)
        run_steps(drafter, target, batches[:1], features, args, carryover, optimizer, dtype)  # warmup
        result = run_steps(drafter, target, batches[1:], features, args, carryover, optimizer, dtype)
    return result | extraction | {"device": str(device)}


RATIOS = {  # name: (numerator mode, denominator mode), where both ran in the same dtype
    "carryover_step_cost_vs_baseline": ("carryover", "baseline"),
    "cached_baseline_steps_per_second_vs_online": ("baseline", "baseline_cached"),
    "cached_carryover_steps_per_second_vs_online": ("carryover", "carryover_cached"),
}


ARGUMENT_CLASSES = (BenchArguments,)


def main(argv=None):
    (args,) = parse_arguments(ARGUMENT_CLASSES, argv)
    report = {
        "settings": asdict(args),
        "torch_threads": torch.get_num_threads(),
        "cpu_bf16_is_emulated": cpu_bf16_is_emulated(),
        "modes": {},
    }

    def key(mode, dtype):  # a mode's name in the report: with several dtypes, "mode/dtype"
        return f"{mode}/{dtype}" if len(args.target_dtypes) > 1 else mode

    context = multiprocessing.get_context("spawn")
    for dtype in args.target_dtypes:
        for mode in args.modes:
            with context.Pool(1, initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)) as pool:
                report["modes"][key(mode, dtype)] = pool.apply(measure_mode, (args, mode, dtype))
    seconds = {name: entry["seconds_per_step"] for name, entry in report["modes"].items()}
    for dtype in args.target_dtypes:
        for name, (slow, fast) in RATIOS.items():
            if slow in args.modes and fast in args.modes:
                report[key(name, dtype)] = seconds[key(slow, dtype)] / seconds[key(fast, dtype)]
    first = args.target_dtypes[0]
    for dtype in args.target_dtypes[1:]:  # each mode's step in this dtype against the same mode in the first dtype
        for mode in args.modes:
            report[f"{mode}_seconds_per_step_{dtype}_vs_{first}"] = seconds[key(mode, dtype)] / seconds[key(mode, first)]

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    for name, entry in report["modes"].items():
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in entry["seconds_per_step_by_phase"].items() if v)
        print(
            f"{name:<26} {entry['seconds_per_step']:.2f} s/step  {entry['response_tokens_per_second']:.0f} tok/s  "
            f"peak +{entry['peak_memory_mb']:.0f} MB  [{phases}]"
        )
    for name, value in report.items():
        if isinstance(value, float):
            print(f"{name} = {value:.2f}")
    print(f"-> {args.output}")
    return report


if __name__ == "__main__":
    main()
