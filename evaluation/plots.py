"""PNG figures of the evaluation and the analyses (matplotlib, Agg backend: no display needed)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

def _is_drafter(row) -> bool:
    return "acceptance_length" in row  # plain-decoding rows have no acceptance statistics


def _panels(results, title):
    """One panel per temperature; returns the figure, {temperature: axis} and the drafter names in run order."""
    temperatures = list(dict.fromkeys(row["temperature"] for row in results))
    drafters = list(dict.fromkeys(row["drafter"] for row in results if _is_drafter(row)))
    figure, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.2), squeeze=False)
    figure.suptitle(title)
    return figure, dict(zip(temperatures, axes[0])), drafters


def _save(figure, path):
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_tau(results, path):
    """Acceptance length per subset: grouped bars, one bar per drafter (the paper's Figure 3)."""
    figure, axes, drafters = _panels(results, "Acceptance length τ (bonus token included)")
    subsets = list(dict.fromkeys(row["subset"] for row in results))
    width = 0.8 / len(drafters)
    for temperature, axis in axes.items():
        by_key = {(row["drafter"], row["subset"]): row for row in results if row["temperature"] == temperature}
        for i, name in enumerate(drafters):
            values = [by_key[name, subset]["acceptance_length"] for subset in subsets]
            offsets = [s + (i - (len(drafters) - 1) / 2) * width for s in range(len(subsets))]
            bars = axis.bar(offsets, values, width, label=name)
            axis.bar_label(bars, fmt="%.2f", fontsize=7)
        axis.set_xticks(range(len(subsets)), subsets, rotation=30, ha="right")
        axis.set_ylabel("τ")
        axis.set_title(f"T = {temperature:g}")
        axis.margins(y=0.1)
        axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(drafters))
    _save(figure, path)


def plot_acceptance_by_position(results, path):
    """Share of rounds whose draft at position i was accepted, all subsets together, one line per drafter."""
    figure, axes, drafters = _panels(results, "Acceptance by draft position (all subsets)")
    for temperature, axis in axes.items():
        for row in results:
            if row["temperature"] == temperature and row["subset"] == "all" and _is_drafter(row):
                axis.plot(range(len(row["acceptance_at_pos"])), row["acceptance_at_pos"], marker="o", label=row["drafter"])
        axis.set_xlabel("draft position")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel("acceptance rate")
        axis.set_ylim(-0.02, 1.02)
        axis.set_title(f"T = {temperature:g}")
        axis.legend()
    _save(figure, path)


def plot_latency(results, path):
    """Section 2's latency decomposition per round: t_draft (without reuse), t_reuse and t_verify stacked, with the
    speedup the latency model predicts (S = τ t_AR / (t_draft + t_verify + t_reuse)) beside the measured one.
    A negative measured t_reuse (timing noise) is drawn as 0."""
    figure, axes, drafters = _panels(results, "Latency per round (all subsets) and speedup: predicted / measured")
    for temperature, axis in axes.items():
        rows = [row for row in results if row["temperature"] == temperature and row["subset"] == "all" and _is_drafter(row)]
        names = [row["drafter"] for row in rows]
        reuse = [max(row["t_reuse"] or 0.0, 0.0) * 1e3 for row in rows]
        draft = [row["t_draft"] * 1e3 - r for row, r in zip(rows, reuse)]
        verify = [row["t_verify"] * 1e3 for row in rows]
        axis.bar(names, draft, label="t_draft")
        axis.bar(names, reuse, bottom=draft, label="t_reuse")
        axis.bar(names, verify, bottom=[d + r for d, r in zip(draft, reuse)], label="t_verify")
        for i, row in enumerate(rows):
            axis.annotate(f"{row['predicted_speedup']:.2f}× / {row['speedup']:.2f}×", (i, draft[i] + reuse[i] + verify[i]),
                          ha="center", va="bottom", fontsize=9)
        axis.axhline(rows[0]["t_ar"] * 1e3, color="grey", linestyle="--", label="t_AR (plain, per token)")
        axis.set_ylabel("ms per round")
        axis.set_title(f"T = {temperature:g}")
        axis.margins(y=0.15)
        axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4)
    _save(figure, path)


def plot_recall(recall, path):
    """Matched-anchor Recall@k by draft position, one line per variant, normal-approximation 95% error bars."""
    ks = list(recall["ks"])
    figure, axes = plt.subplots(1, len(ks), figsize=(6 * len(ks), 4.2), squeeze=False)
    figure.suptitle("Target-token recall at matched anchors (T=0)")
    for axis, k in zip(axes[0], ks):
        for i, (variant, positions) in enumerate(recall["variants"].items()):
            xs = [p["position"] + 0.05 * (i - 1) for p in positions if p["rounds"]]  # offsets keep error bars apart
            ys = [p[f"recall@{k}"] for p in positions if p["rounds"]]
            errors = [p[f"recall@{k}_ci95"] for p in positions if p["rounds"]]
            axis.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=variant)
        axis.set_xlabel("draft position")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel(f"Recall@{k}")
        axis.set_ylim(-0.02, 1.02)
        axis.legend()
    _save(figure, path)


def plot_reconvergence(subsets, correlation, path):
    """Normalised re-convergence per subset against the subset's carryover gain (the paper's Figure 5, right)."""
    figure, axis = plt.subplots(figsize=(5.5, 4.2))
    xs = [row["normalized_reconvergence"] for row in subsets]
    ys = [100 * row["carryover_gain"] for row in subsets]
    axis.scatter(xs, ys)
    for row, x, y in zip(subsets, xs, ys):
        axis.annotate(row["subset"], (x, y), fontsize=8)
    r = correlation.get("normalized_reconvergence")
    axis.set_title("Re-convergence vs carryover gain" + (f" (r = {r:.2f})" if r is not None else ""))
    axis.set_xlabel("re-converged positions per rejected round / baseline τ")
    axis.set_ylabel("τ gain (%)")
    _save(figure, path)


def plot_attention(by_rejected, path):
    """Share of drafter attention on carried rows by the number of carried (rejected) rows (Appendix C)."""
    figure, axis = plt.subplots(figsize=(5.5, 4.2))
    counts = sorted(by_rejected, key=int)
    axis.bar([str(c) for c in counts], [100 * by_rejected[c]["carried_share"] for c in counts])
    axis.set_xlabel("carried rows in the round")
    axis.set_ylabel("attention on carried rows (%)")
    axis.set_title("Attention to carried rows")
    _save(figure, path)


def plot_slot_accuracy(results, drafters, path):
    """Teacher-forced accuracy by block slot, one panel per response set, one line per drafter."""
    figure, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), squeeze=False, sharey=True)
    figure.suptitle("Teacher-forced slot accuracy")
    for axis, (set_name, result) in zip(axes[0], results.items()):
        for name in drafters:
            accuracy = result[name]["slot_accuracy"]
            axis.plot(range(1, len(accuracy) + 1), accuracy, marker="o", label=name)
        axis.set_xlabel("slot (tokens after the anchor)")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylim(-0.02, 1.02)
        axis.set_title(f"{set_name} ({result['rows']} rows)")
        axis.legend()
    axes[0][0].set_ylabel("accuracy")
    _save(figure, path)
