"""PNG plots of the experiments' outputs, shared by the scripts and notebooks/analysis.ipynb.

Each function reads only files in an output folder (metrics.jsonl, summary.json, rl/metrics.jsonl
for a drift run; summary.json for a speed sweep), so a plot can always be rebuilt from a saved run.
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ARM_STYLE = {"plain": dict(color="0.4", ls=":"), "frozen": dict(color="tab:red", marker="o"),
             "online": dict(color="tab:blue", marker="s"), "reference": dict(color="tab:green", marker="^", ls="none"),
             "adaptive": dict(color="tab:cyan", marker="D", ls="--")}
# the deeper target's rows in the drift run's batch sweep (DriftPreset.deep_target), by mode
DEEP_STYLE = {"chain": dict(color="0.15", marker="P", ls="-."), "adaptive": dict(color="0.55", marker="X", ls="-.")}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_drift(out) -> tuple[list[dict], dict, list[dict]]:
    """(evaluation rows, summary, RL step rows) of a drift run folder."""
    out = Path(out)
    return read_jsonl(out / "metrics.jsonl"), json.loads((out / "summary.json").read_text()), \
        read_jsonl(out / "rl" / "metrics.jsonl")


def _series(rows, arm, key):
    pts = sorted((r["step"], r[key]) for r in rows if r["arm"] == arm and key in r)
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_arms(rows, key: str, ylabel: str, path: Path, arms=("frozen", "online", "reference"), hline=None):
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm in arms:
        x, y = _series(rows, arm, key)
        if x:
            ax.plot(x, y, label=arm, **ARM_STYLE[arm])
    if hline is not None:
        ax.axhline(hline, color="0.5", lw=0.8, ls="--")
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reward(rl_rows, rows, path: Path):
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in rl_rows], [r["reward"] for r in rl_rows], color="tab:purple", lw=1, label="reward")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean rollout reward", color="tab:purple")
    ax2 = ax.twinx()
    x, y = _series(rows, "plain", "kl_from_start")
    ax2.plot(x, y, color="tab:orange", marker="o", label="KL from start")
    ax2.set_ylabel("policy KL from start (nats/token)", color="tab:orange")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance_heatmap(rows, path: Path, arms=("frozen", "online")):
    fig, axes = plt.subplots(1, len(arms), figsize=(4.2 * len(arms), 3.4), sharey=True)
    for ax, arm in zip(axes, arms):
        pts = sorted((r["step"], r["accept_rate_per_pos"]) for r in rows if r["arm"] == arm)
        depth = max(len(p) for _, p in pts)
        grid = [[p[d] if d < len(p) else float("nan") for _, p in pts] for d in range(depth)]
        im = ax.imshow(grid, aspect="auto", origin="lower", vmin=0, vmax=1, cmap="viridis")
        ax.set_xticks(range(len(pts)), [s for s, _ in pts])
        ax.set_yticks(range(depth), [str(d + 1) for d in range(depth)])
        ax.set_title(arm)
        ax.set_xlabel("RL step")
    axes[0].set_ylabel("draft position")
    fig.colorbar(im, ax=list(axes), label="acceptance rate (cumulative)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_speedup_vs_batch(speed_rows, path: Path, bound_rows=None, deep_rows=()):
    """Speed-up against batch size per arm; `deep_rows` (a drift run's deep-target sweep) are
    drawn beside them, one line per mode, labelled with the target's preset and depth."""
    fig, ax = plt.subplots(figsize=(7.5 if deep_rows else 6, 3.6))
    arms = [a for a in dict.fromkeys(r["arm"] for r in speed_rows) if a != "plain"]
    for arm in arms:
        pts = sorted((r["batch"], r["speedup"]) for r in speed_rows if r["arm"] == arm)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=arm, **ARM_STYLE.get(arm, dict(marker="o")))
    for mode in [m for m in dict.fromkeys(r["mode"] for r in deep_rows) if m != "plain"]:
        rows = [r for r in deep_rows if r["mode"] == mode]
        pts = sorted((r["batch"], r["speedup"]) for r in rows)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{rows[0]['target_layers']}-layer target, {mode}",
                **DEEP_STYLE.get(mode, dict(marker="o")))
    if bound_rows:
        pts = sorted((r["batch"], r["bound"]) for r in bound_rows)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="0.3", ls="--", label="bound (DESIGN 4)")
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speed-up over plain decoding")
    if deep_rows:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _num(x) -> float:
    """A bound the run could not measure (None: no full-batch step) plots as a gap."""
    return float("nan") if x is None else x


def plot_sweep(rows, mode: str, xkey: str, xlabel: str, path: Path):
    """Measured speed-up (solid) and its bound (dashed) against `xkey`, one colour per batch size."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    batches = sorted({r["batch"] for r in rows if r["mode"] == mode})
    for i, b in enumerate(batches):
        pts = sorted((r[xkey], r["speedup"], _num(r["bound"])) for r in rows if r["mode"] == mode and r["batch"] == b)
        color = plt.cm.viridis(i / max(1, len(batches) - 1))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=f"batch {b}")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", color=color, lw=1)
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speed-up (solid) / bound (dashed)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speed_plots(out) -> list[Path]:
    """Plots of a speed sweep folder (experiments.speed): chain length, tree budget, batch size."""
    out = Path(out)
    rows = json.loads((out / "summary.json").read_text())["rows"]
    paths = []
    if any(r["mode"] == "chain" for r in rows):
        paths.append(out / "speedup_vs_gamma.png")
        plot_sweep(rows, "chain", "gamma", "chain length gamma", paths[-1])
    if any(r["mode"] == "tree" for r in rows):
        paths.append(out / "speedup_vs_tree_budget.png")
        plot_sweep(rows, "tree", "tree_budget", "tree budget (draft tokens verified)", paths[-1])
    best = []
    for b in sorted({r["batch"] for r in rows}):
        spec = [r for r in rows if r["batch"] == b and r["mode"] != "plain"]
        if spec:
            top = max(spec, key=lambda r: r["speedup"])
            best.append({"batch": b, "arm": "best configuration", "speedup": top["speedup"], "bound": _num(top["bound"])})
    if best:
        paths.append(out / "speedup_vs_batch.png")
        plot_speedup_vs_batch(best, paths[-1], bound_rows=best)
    return paths


def drift_plots(out) -> list[Path]:
    """The five plots of a drift run, written next to its metrics; returns their paths."""
    out = Path(out)
    rows, summary, rl_rows = load_drift(out)
    paths = [out / "accept_length.png", out / "speedup.png", out / "reward.png", out / "acceptance_heatmap.png",
             out / "speedup_vs_batch.png"]
    plot_arms(rows, "accept_length", "accept length (tokens / verify step)", paths[0])
    plot_arms(rows, "speedup", "speed-up over plain decoding", paths[1], hline=1.0)
    plot_reward(rl_rows, rows, paths[2])
    plot_acceptance_heatmap(rows, paths[3])
    plot_speedup_vs_batch(summary["speedup_vs_batch"], paths[4], deep_rows=summary.get("speedup_vs_batch_deep_target", []))
    return paths


__all__ = ["drift_plots", "load_drift", "read_jsonl", "plot_arms", "plot_reward", "plot_acceptance_heatmap",
           "plot_speedup_vs_batch", "plot_sweep", "speed_plots"]
