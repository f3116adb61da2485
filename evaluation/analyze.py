"""How carried rows contribute (paper Section 5, Appendices B.2, C, D): replays of recorded T=0 rounds.

    python evaluation/analyze.py recall        --drafter ckpt/carry --baseline ckpt/base --limit 20
    python evaluation/analyze.py reconvergence --drafter ckpt/carry --baseline ckpt/base
    python evaluation/analyze.py attention     --drafter ckpt/carry
    python evaluation/analyze.py recall config.yaml        # the same fields as a JSON or YAML file

Each prompt is generated greedily with `--drafter` and carryover ON. Every recorded round is then re-verified with
`verify_branches` after its committed prefix (the final output up to the round's anchor), which gives the target's
greedy tokens along the proposal and the hidden states of its rejected rows, and replayed with three variants:
ON (the carryover weights with the previous round's rejected rows), OFF (the same weights, no carried rows) and
baseline (`--baseline`, never with carried rows). The ON replay reproduces the recorded drafts (reported as
`replay_reproduces_generate`, 1.0 up to floating-point ties).

  recall         matched-anchor Recall@k of the target's token (Section 5.1, Appendix B.2) -> recall.json, recall.png
  reconvergence  re-convergence count R (Eq. 3) per rejected ON round and per subset, normalised by baseline tau,
                 and its Pearson r with the per-subset carryover gain (Section 5.2, Appendix D)
                 -> reconvergence.json, reconvergence.png
  attention      share of drafter attention on carried rows (Appendix C) -> attention.json, attention.png
"""

import math
import sys
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from carryover_common.benchmarks import EMBEDDED, encode_prompt, load_benchmark
from carryover_common.checkpoints import check_drafter_folder, check_model_folder
from carryover_common.cli import check_at_least, check_exists, parse_arguments, run_cli
from carryover_common.outputs import check_output_dir, staged_folder
from carryover_common.targets import load_target
from evaluation.plots import plot_attention, plot_recall, plot_reconvergence
from evaluation.run import load_drafters, parse_drafter, provenance, tau, to_json
from modeling_carryover import generate as carryover_generate
from trainer.objectives import context_visibility
from trainer.verification import check_verification_support, target_pass, verify_branches

COMMANDS = ("recall", "reconvergence", "attention")


@dataclass
class AnalysisArguments:
    drafter: str = field(metadata={"help": "Carryover checkpoint: generates with carryover ON; the ON/OFF variants."})
    baseline: str | None = field(default=None, metadata={"help": "Baseline checkpoint (recall, reconvergence)."})
    target: str | None = field(default=None, metadata={"help": "Target folder or Hub id; default: embedded SmolLM2."})
    benchmark: str = field(default=EMBEDDED, metadata={"help": "'embedded', a folder of <subset>.jsonl, or a Hub id."})
    subsets: list[str] | None = field(default=None, metadata={"help": "Subsets to run; unset = all."})
    limit: int | None = field(default=None, metadata={"help": "Prompts per subset (the first N); unset = all."})
    max_new_tokens: int = field(default=256, metadata={"help": "Cap on generated tokens per prompt."})
    ks: list[int] = field(default_factory=lambda: [1, 16], metadata={"help": "recall: the k of Recall@k."})
    output_dir: str = field(default="outputs/analysis")
    device: str | None = field(default=None, metadata={"help": "Default: cuda if available, else cpu."})
    dtype: str = field(default="float32", metadata={"choices": ["float32", "bfloat16", "float16"]})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Replace this analysis's earlier <analysis>.json/.png in output_dir."}
    )

    def __post_init__(self):
        for name in ("drafter", "baseline"):
            check_exists(name, getattr(self, name), hub=True)
            check_drafter_folder(getattr(self, name))
        check_exists("target", self.target, hub=True)
        check_model_folder(self.target)
        if self.benchmark != EMBEDDED:
            check_exists("benchmark", self.benchmark, hub=True)
        check_at_least("limit", self.limit, 1, " prompt per subset (unset: all)")
        check_at_least("max_new_tokens", self.max_new_tokens, 1)
        check_at_least("ks", self.ks, 1)


# ----------------------------------------------------------------------------------------------------------------
# Recording and replaying rounds
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Recording:
    """One greedy carryover generation and its rounds re-verified after their committed prefixes.

    sequence [1, L] (prompt + output); anchors [1, N]; drafts [1, N, K] (recorded proposals, padded with the mask
    token where a round proposed fewer than K); proposed, accepted [N] (as recorded by `generate`);
    hidden_states: the target's hidden states over `sequence` (HF tuple, the requested layers only);
    branches: `verify_branches` of every round's proposal (greedy tokens [1, N, K+1], branch hidden states)."""

    sequence: torch.LongTensor
    anchors: torch.LongTensor
    drafts: torch.LongTensor
    proposed: torch.LongTensor
    accepted: torch.LongTensor
    hidden_states: tuple
    branches: object


@torch.no_grad()
def record(target, drafter, inputs, max_new_tokens, hidden_state_indices) -> Recording | None:
    sequence = carryover_generate(
        target, **inputs, assistant_model=drafter, carryover=True, max_new_tokens=max_new_tokens, do_sample=False,
        linear_backend="default",  # the replays run the target's modules as they are: so does the recording
    )
    rounds = drafter.generation_stats.rounds
    if not rounds:  # a one-token answer has no round
        return None
    device, num_positions = sequence.device, drafter.config.block_size - 1
    drafts = torch.full((1, len(rounds), num_positions), drafter.config.mask_token_id, device=device)
    for n, round_ in enumerate(rounds):
        drafts[0, n, : round_.proposed] = torch.tensor(round_.drafts, device=device)
    anchors = torch.tensor([[r.anchor_position for r in rounds]], device=device)
    recorded = target_pass(target, sequence, torch.ones_like(sequence), hidden_state_indices, use_cache=True)
    return Recording(
        sequence=sequence,
        anchors=anchors,
        drafts=drafts,
        proposed=torch.tensor([r.proposed for r in rounds], device=device),
        accepted=torch.tensor([r.accepted for r in rounds], device=device),
        hidden_states=recorded.hidden_states,
        branches=verify_branches(target, recorded, sequence, anchors, drafts, hidden_state_indices),
    )


def carried_rows(drafter, recording: Recording):
    """What round n read as carried rows: round n-1's rejected rows (none for the first round, which follows the
    prefill). Returns features [1, N, K, F], position ids [1, N, K] and the mask of real rows [1, N, K]."""
    num_positions = recording.drafts.shape[-1]
    window = drafter.target_features(recording.branches.hidden_states)  # [1, N, K+1, F]
    window_position_ids = recording.anchors[..., None] + torch.arange(num_positions + 1, device=window.device)
    rows, row_position_ids, valid = drafter.rejected_rows(window, window_position_ids, recording.accepted[None])
    # a round that proposed fewer than K drafts rejected only its real ones (the rest is padding)
    valid &= torch.arange(num_positions, device=valid.device) < (recording.proposed - recording.accepted)[None, :, None]

    def previous_round(x):
        return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)

    return previous_round(rows), previous_round(row_position_ids), previous_round(valid)


@dataclass
class Replay:
    """drafts [N, K]: greedy proposals; top_ids [N, K, k]: their k best candidates; attention_shares [N, 3]: mean
    attention on [context ; carried ; block] rows (over layers, heads and block slots), when asked for."""

    drafts: torch.LongTensor
    top_ids: torch.LongTensor
    attention_shares: torch.Tensor | None = None


@torch.no_grad()
def replay(target, drafter, recording: Recording, carried=None, top_k=16, attention=False, chunk_size=32) -> Replay:
    """Re-draft every recorded round from its committed prefix: context rows at positions < anchor (as at decoding),
    plus `carried` rows (from `carried_rows`) for ON. Rounds are drafted in parallel, `chunk_size` at a time."""
    features = drafter.target_features(recording.hidden_states)  # [1, L, F]
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    num_positions = drafter.config.block_size - 1
    drafts, top_ids, shares = [], [], []
    for start in range(0, recording.anchors.shape[1], chunk_size):
        anchors = recording.anchors[:, start : start + chunk_size]  # [1, n]
        anchor_ids = recording.sequence[0, anchors[0]]
        block_ids, block_position_ids = drafter.block_inputs(anchor_ids[None], anchors)  # [1, n, B]
        num_context = int(anchors.max())  # rows a block may see: < its anchor
        context_position_ids = torch.arange(num_context, device=anchors.device)
        carried_kwargs = {}
        if carried is not None:
            rows, row_position_ids, valid = (x[:, start : start + chunk_size] for x in carried)
            carried_kwargs = dict(carried_features=rows, carried_position_ids=row_position_ids, carried_mask=valid)
        out = drafter(
            embed(block_ids),
            block_position_ids,
            context_features=features[:, :num_context],
            context_position_ids=context_position_ids[None],
            context_mask=context_visibility(torch.ones_like(features[..., :num_context, 0]), anchors),
            output_attentions=attention,
            **carried_kwargs,
        )
        hidden = out.last_hidden_state[0, :, 1 : num_positions + 1]  # slot k predicts the token at anchor + k
        # each proposal scored under its own within-block prefix: the Markov head corrects with the previous draft
        chunk_drafts, logits = drafter.draft_tokens(drafter.draft_logits(lm_head, hidden), anchor_ids, return_logits=True)
        drafts.append(chunk_drafts)
        top_ids.append(drafter.to_target_ids(logits.topk(top_k, dim=-1).indices))
        if attention:
            shares.append(attention_shares(out.attentions, num_context, carried_kwargs.get("carried_features")))
    return Replay(torch.cat(drafts), torch.cat(top_ids), torch.cat(shares) if attention else None)


def attention_shares(attentions, num_context, carried_features):
    """Per round, the attention mass on [context ; carried ; block] rows, averaged over layers, heads and the block's
    query slots. With carry gates a query's weights on the carried rows are its head's gate (of either sign) times
    their softmax: the mass is then each weight's magnitude over the sum of magnitudes (for plain probabilities, the
    probabilities). attentions: per layer [1, n, H, B, T+R+B] -> [n, 3]."""
    num_carried = 0 if carried_features is None else carried_features.shape[2]
    weights = torch.stack(attentions).float().abs()  # [layers, 1, n, H, B, T+R+B]
    probs = (weights / weights.sum(-1, keepdim=True)).mean(dim=(0, 3, 4))[0]  # [n, T+R+B]
    bounds = [0, num_context, num_context + num_carried, probs.shape[-1]]
    return torch.stack([probs[:, lo:hi].sum(-1) for lo, hi in zip(bounds, bounds[1:])], dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# The three analyses
# ----------------------------------------------------------------------------------------------------------------


def committed_tokens(recording: Recording, num_positions: int) -> torch.LongTensor:
    """[N, K]: the token the target committed at anchor + 1 + j (its top-1 at T=0); -1 beyond the output."""
    index = recording.anchors[0, :, None] + 1 + torch.arange(num_positions, device=recording.anchors.device)
    length = recording.sequence.shape[1]
    return torch.where(index < length, recording.sequence[0, index.clamp(max=length - 1)], -1)


def recall_counts(replays: dict, targets, ks) -> tuple:
    """Matched-anchor protocol: at position j a round counts for every variant when ON and baseline both drafted the
    target's tokens at positions < j (OFF is counted regardless). Returns counted rounds [K] and
    {variant: {k: hits [K]}}."""
    matched = (replays["on"].drafts == targets) & (replays["baseline"].drafts == targets)  # [N, K]
    through_previous = torch.cat([torch.ones_like(matched[:, :1]), matched.long().cumprod(-1)[:, :-1].bool()], dim=-1)
    counted = through_previous & (targets >= 0)
    hits = {
        variant: {k: ((r.top_ids[..., :k] == targets[..., None]).any(-1) & counted).sum(0) for k in ks}
        for variant, r in replays.items()
    }
    return counted.sum(0), hits


def recall_summary(rounds, hits, ks) -> dict:
    """Micro-averaged Recall@k per position with normal-approximation 95% half-widths."""
    variants = {}
    for variant, per_k in hits.items():
        positions = []
        for j, n in enumerate(rounds.tolist()):
            entry = {"position": j, "rounds": n}
            for k in ks:
                p = per_k[k][j].item() / n if n else float("nan")
                entry[f"recall@{k}"] = p
                entry[f"recall@{k}_ci95"] = 1.96 * math.sqrt(p * (1 - p) / n) if n else float("nan")
            positions.append(entry)
        variants[variant] = positions
    return {"ks": list(ks), "variants": variants}


def reconvergence_count(predictions, committed) -> int:
    """Eq. 3: R = sum_q 1[exists delta in {-1, 0, +1}: z_{q+delta} = y_q], ignoring out-of-range indices.
    predictions z_q: the verifier's top-1 from the q-th rejected state; committed y_q: the token eventually committed
    at the position z_q predicts (None beyond the output)."""
    length = len(predictions)
    return sum(
        any(0 <= q + delta < length and predictions[q + delta] == y for delta in (-1, 0, 1))
        for q, y in enumerate(committed)
        if y is not None
    )


def rejected_round_statistics(recording: Recording) -> list[dict]:
    """Per rejected round: rejected rows L, re-convergence R, and the post-rejection proposal-verifier matches
    (drafts after the first rejection that equal the verifier's top-1 along the rejected branch)."""
    statistics = []
    sequence = recording.sequence[0].tolist()
    greedy = recording.branches.greedy_tokens[0].tolist()  # [N][K+1]: top-1 after each branch position
    for n, (anchor, proposed, accepted) in enumerate(
        zip(recording.anchors[0].tolist(), recording.proposed.tolist(), recording.accepted.tolist())
    ):
        if accepted == proposed:
            continue
        # branch slot k holds draft k (slot 0: the anchor); the rejected states are slots accepted+1 .. proposed and
        # the one at slot k predicts the token at anchor + k + 1
        predictions = greedy[n][accepted + 1 : proposed + 1]
        committed = [
            sequence[anchor + k + 1] if anchor + k + 1 < len(sequence) else None
            for k in range(accepted + 1, proposed + 1)
        ]
        drafts = recording.drafts[0, n].tolist()
        statistics.append({
            "rejected": proposed - accepted,
            "reconvergence": reconvergence_count(predictions, committed),
            "post_rejection_matches": sum(drafts[k - 1] == greedy[n][k - 1] for k in range(accepted + 2, proposed + 1)),
        })
    return statistics


def pearson(xs, ys) -> float | None:
    """Pearson r across the subsets where both values are defined; None with fewer than 3 of them (2 points always
    give |r| = 1) or without spread."""
    pairs = np.array([(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]).reshape(-1, 2)
    if len(pairs) < 3 or pairs.std(axis=0).min() == 0:
        return None
    return float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1])


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------


def agreement_with_generate(recording: Recording, on: Replay) -> dict:
    """Rounds, rounds whose ON replay drafted exactly the recorded proposal, and rounds whose re-verification
    accepted as many drafts as `generate` did."""
    proposed = recording.proposed.tolist()
    return {
        "rounds": len(proposed),
        "reproduced": sum(on.drafts[n, :p].tolist() == recording.drafts[0, n, :p].tolist() for n, p in enumerate(proposed)),
        "verified": int((recording.branches.accepted_len[0].clamp(max=recording.proposed) == recording.accepted).sum()),
    }


def run_analysis(command, args: AnalysisArguments) -> dict:
    if command not in COMMANDS:
        raise ValueError(f"Unknown analysis {command!r}; choose one of {COMMANDS}.")
    if command in ("recall", "reconvergence") and not args.baseline:
        raise ValueError(f"`{command}` compares with the baseline: pass --baseline <checkpoint>.")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    benchmark = load_benchmark(args.benchmark, args.subsets, args.limit)
    target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype), device=device)
    check_verification_support(target)
    specs = [parse_drafter(f"carryover={args.drafter}:on")]
    if args.baseline:
        specs.append(parse_drafter(f"baseline={args.baseline}:off"))
    loaded = load_drafters(specs, target, getattr(torch, args.dtype))
    drafters = {name: model for name, (model, _) in loaded.items()}
    drafter = drafters["carryover"]
    indices = sorted({i for model in drafters.values() for i in model.feature_hidden_state_indices})

    state = {"rounds": 0, "reproduced": 0, "verified": 0}
    per_subset = {}
    for subset, prompts in benchmark.items():
        per_subset[subset] = {"on_rounds": [], "baseline_rounds": [], "rejected": [], "recall": [], "attention": []}
        for prompt in tqdm(prompts, desc=f"{command} {subset}"):
            inputs = encode_prompt(tokenizer, prompt).to(device)
            recording = record(target, drafter, inputs, args.max_new_tokens, indices)
            if recording is None:
                continue
            collected = per_subset[subset]
            collected["on_rounds"] += drafter.generation_stats.rounds
            carried = carried_rows(drafter, recording)
            on = replay(target, drafter, recording, carried, max(args.ks), attention=command == "attention")
            for key, count in agreement_with_generate(recording, on).items():
                state[key] += count
            if command == "recall":
                off = replay(target, drafter, recording, None, max(args.ks))
                baseline = replay(target, drafters["baseline"], recording, None, max(args.ks))
                num_positions = min(on.drafts.shape[1], baseline.drafts.shape[1])
                replays = {
                    name: Replay(r.drafts[:, :num_positions], r.top_ids[:, :num_positions])
                    for name, r in (("on", on), ("off", off), ("baseline", baseline))
                }
                collected["recall"].append(recall_counts(replays, committed_tokens(recording, num_positions), args.ks))
            elif command == "reconvergence":
                collected["rejected"] += rejected_round_statistics(recording)
                carryover_generate(target, **inputs, assistant_model=drafters["baseline"], carryover=False,
                                   max_new_tokens=args.max_new_tokens, do_sample=False, linear_backend="default")
                collected["baseline_rounds"] += drafters["baseline"].generation_stats.rounds
            else:
                collected["attention"].append((on.attention_shares, carried[2][0].sum(-1)))

    if not state["rounds"]:
        raise ValueError("No speculative round was recorded (answers too short?): raise --max_new_tokens.")
    summary = {
        "analysis": command,
        "rounds": state["rounds"],
        "replay_reproduces_generate": state["reproduced"] / state["rounds"],
        "verification_agrees_with_generate": state["verified"] / state["rounds"],
    }
    with staged_folder(args.output_dir) as output_dir:  # moved into output_dir once both files are written
        if command == "recall":
            summary.update(summarize_recall(per_subset, args.ks))
            plot_recall(summary, output_dir / "recall.png")
        elif command == "reconvergence":
            summary.update(summarize_reconvergence(per_subset))
            plot_reconvergence(summary["subsets"], summary["correlation"], output_dir / "reconvergence.png")
        else:
            summary.update(summarize_attention(per_subset))
            plot_attention(summary["by_carried_rows"], output_dir / "attention.png")
        summary["provenance"] = provenance({**asdict(args), "analysis": command}, device)
        (output_dir / f"{command}.json").write_text(to_json(summary))
    return summary


def summarize_recall(per_subset, ks) -> dict:
    counts = [c for collected in per_subset.values() for c in collected["recall"]]
    num_positions = min(rounds.shape[0] for rounds, _ in counts)
    rounds = sum(r[:num_positions] for r, _ in counts)
    hits = {v: {k: sum(h[v][k][:num_positions] for _, h in counts) for k in ks} for v in counts[0][1]}
    return recall_summary(rounds, hits, ks)


def summarize_reconvergence(per_subset) -> dict:
    subsets = []
    for subset, collected in per_subset.items():
        rejected, baseline_tau = collected["rejected"], tau(collected["baseline_rounds"])
        row = {
            "subset": subset,
            "rejected_rounds": len(rejected),
            "baseline_tau": baseline_tau,
            "carryover_tau": tau(collected["on_rounds"]),
        }
        row["carryover_gain"] = row["carryover_tau"] / baseline_tau - 1
        for key in ("reconvergence", "rejected", "post_rejection_matches"):
            per_round = sum(s[key] for s in rejected) / len(rejected) if rejected else float("nan")
            row[f"{key}_per_rejected_round"] = per_round
            row[f"normalized_{key}"] = per_round / baseline_tau
        subsets.append(row)
    gains = [row["carryover_gain"] for row in subsets]
    correlation = {
        f"normalized_{key}": pearson([row[f"normalized_{key}"] for row in subsets], gains)
        for key in ("reconvergence", "rejected", "post_rejection_matches")
    }
    return {"subsets": subsets, "correlation": correlation}


def summarize_attention(per_subset) -> dict:
    shares = torch.cat([s for c in per_subset.values() for s, _ in c["attention"]])  # [rounds, 3]
    carried = torch.cat([n for c in per_subset.values() for _, n in c["attention"]])  # [rounds]
    with_rows = carried > 0

    def mean_shares(mask):
        context, carried_share, block = shares[mask].mean(0).tolist()
        return {"rounds": int(mask.sum()), "context_share": context, "carried_share": carried_share, "block_share": block}

    return {
        "with_carried_rows": mean_shares(with_rows) if with_rows.any() else {"rounds": 0},
        "by_carried_rows": {int(n): mean_shares(carried == n) for n in carried[with_rows].unique().tolist()},
    }


ARGUMENT_CLASSES = (AnalysisArguments,)


def parse_args(argv=None) -> tuple[str, AnalysisArguments]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: analyze.py {{{','.join(COMMANDS)}}} [--flags | config.json | config.yaml]")
    command, (args,) = argv[0], parse_arguments(ARGUMENT_CLASSES, argv[1:])
    inputs = [args.drafter, args.baseline, args.target, args.benchmark if args.benchmark != EMBEDDED else None]
    check_output_dir(args.output_dir, inputs=inputs, files={f"{command}.json", f"{command}.png"},
                     overwrite=args.overwrite_output_dir)
    return command, args


def main(argv=None) -> dict:
    summary = run_analysis(*parse_args(argv))
    print(to_json({k: v for k, v in summary.items() if k != "provenance"}))
    return summary


if __name__ == "__main__":
    run_cli(main)
