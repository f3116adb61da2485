"""The sweep's table and plot: per rho, tau of baseline, control and carryover, carryover's gain against its control
with its 95% paired bootstrap interval (T=0 and T=1, from evaluation/run.py's report.json), and the rejected-branch
statistics of evaluation/analyze.py reconvergence (R, post-rejection matches, carried rows per rejected round, each
normalised by the control's tau), with Pearson r of gain against normalised R as in the paper's Figures 5 and 7.

    python experiments/reconvergence-control/summarize.py --run runs/reconvergence-control \
        --output_dir experiments/reconvergence-control/results
"""

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from carryover_common.cli import parse_arguments, run_cli
from evaluation.analyze import pearson

PAPER_R = 0.96  # the paper's Appendix D: normalised re-convergence against dataset-level gain, Qwen3-4B Markov, T=0


@dataclass
class SummaryArguments:
    run: str = field(metadata={"help": "The sweep's output folder (OUT of sweep.sh)."})
    output_dir: str = field(metadata={"help": "Where table.md, summary.json, the plot and the run's reports go."})


def rho_of(subset: str) -> float:
    return float(subset.removeprefix("rho_"))


def summarize(run: Path) -> dict:
    report = json.loads((run / "eval" / "report.json").read_text())["results"]
    statistics = json.loads((run / "reconvergence" / "reconvergence.json").read_text())
    tau = {(r["subset"], r["temperature"], r["drafter"]): r for r in report if r["drafter"] != "plain"}
    rows = []
    for stats in statistics["subsets"]:
        subset = stats["subset"]
        row = {"subset": subset, "rho": rho_of(subset)}
        for temperature in sorted({t for s, t, _ in tau if s == subset}):
            key = f"T{temperature:g}"
            carryover = tau[subset, temperature, "carryover"]
            row[key] = {
                "baseline_tau": tau[subset, temperature, "baseline"]["acceptance_length"],
                "control_tau": tau[subset, temperature, "control"]["acceptance_length"],
                "carryover_tau": carryover["acceptance_length"],
                "gain": carryover["tau_gain"],
                "gain_ci95": carryover["tau_gain_ci95"],
                "mismatches": carryover.get("mismatches"),
            }
        for name in ("reconvergence", "post_rejection_matches", "rejected"):  # null (NaN): no rejected round
            for key in (f"{name}_per_rejected_round", f"normalized_{name}"):
                row[key] = math.nan if stats[key] is None else stats[key]
        rows.append(row)
    rows.sort(key=lambda row: row["rho"])
    correlation = {
        f"T{t}": {
            name: pearson([row[f"normalized_{name}"] for row in rows], [row[f"T{t}"]["gain"] for row in rows])
            for name in ("reconvergence", "post_rejection_matches", "rejected")
        }
        for t in (0, 1)
        if all(f"T{t}" in row for row in rows)
    }
    return {"rows": rows, "correlation": correlation, "paper_r": PAPER_R}


def percent(gain, interval) -> str:
    return f"{100 * gain:+.1f}% [{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"


def table(summary: dict) -> str:
    lines = [
        "| rho | control tau T=0 | carryover tau T=0 | gain T=0 [95% CI] | gain T=1 [95% CI] | R / rejected round | "
        "R / control tau | post-rejection matches | carried rows |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["rows"]:
        t0, t1 = row["T0"], row.get("T1")
        lines.append(
            f"| {row['rho']:.2f} | {t0['control_tau']:.2f} | {t0['carryover_tau']:.2f} | "
            f"{percent(t0['gain'], t0['gain_ci95'])} | {percent(t1['gain'], t1['gain_ci95']) if t1 else '-'} | "
            f"{row['reconvergence_per_rejected_round']:.2f} | {row['normalized_reconvergence']:.2f} | "
            f"{row['post_rejection_matches_per_rejected_round']:.2f} | {row['rejected_per_rejected_round']:.2f} |"
        )
    lines.append("")
    for temperature, values in summary["correlation"].items():
        formatted = ", ".join(f"{name} {value:.2f}" if value is not None else f"{name} -" for name, value in values.items())
        lines.append(f"Pearson r of the {temperature} gain with (normalised): {formatted}. Paper: {PAPER_R} (R, T=0).")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    figure, axis = plt.subplots(figsize=(6, 4.5))
    for offset, (temperature, marker) in enumerate((("T0", "o"), ("T1", "s"))):
        rows = [row for row in summary["rows"] if temperature in row]
        xs = [row["normalized_reconvergence"] + 0.004 * offset for row in rows]
        ys = [100 * row[temperature]["gain"] for row in rows]
        errors = [
            [100 * (row[temperature]["gain"] - row[temperature]["gain_ci95"][0]) for row in rows],
            [100 * (row[temperature]["gain_ci95"][1] - row[temperature]["gain"]) for row in rows],
        ]
        r = summary["correlation"].get(temperature, {}).get("reconvergence")
        label = f"{temperature[0]}={temperature[1:]}" + (f" (r = {r:.2f})" if r is not None else "")
        axis.errorbar(xs, ys, yerr=errors, fmt=marker, capsize=3, label=label)
        if temperature == "T0":
            for row, x, y in zip(rows, xs, ys):
                axis.annotate(f"ρ={row['rho']:g}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    axis.axhline(0, color="grey", linewidth=0.8)
    axis.set_xlabel("re-converged positions per rejected round / control τ")
    axis.set_ylabel("τ gain of carryover vs its control (%)")
    axis.set_title(f"Synthetic positive control (paper: r = {PAPER_R})")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    (args,) = parse_arguments((SummaryArguments,), argv)
    run, output_dir = Path(args.run), Path(args.output_dir)
    summary = summarize(run)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (output_dir / "table.md").write_text(table(summary))
    plot(summary, output_dir / "gain_vs_reconvergence.png")
    # the runs' own reports travel with the summary (the checkpoints and data stay in the run folder)
    for source in ("eval/report.json", "eval/table.md", "reconvergence/reconvergence.json", "synthetic/synthetic.json"):
        destination = output_dir / source.replace("/", "_")
        shutil.copyfile(run / source, destination)
    print(table(summary))
    return summary


if __name__ == "__main__":
    run_cli(main)
