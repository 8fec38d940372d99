"""PNG plots of the experiments' outputs, shared by the scripts and notebooks/analysis.ipynb.

Each function reads only files in an output folder (metrics.jsonl, summary.json, rl/metrics.jsonl
for a drift run; summary.json for a speed run), so a plot can always be rebuilt from a saved run.
Every plot is titled with its setup; a speed-up is drawn as the median over the timed repeats of
the per-repeat ratio, with the repeats' min-max as an error bar, where the run saved its
repeats; batch axes are log2 with a tick at each measured batch size.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

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


def spread(ratios, fallback: float) -> tuple[float, float, float]:
    """(median, min, max) of per-repeat speed-ups; `fallback` three times where none were saved."""
    ratios = [r for r in ratios or () if r is not None]
    if not ratios:
        return fallback, fallback, fallback
    return statistics.median(ratios), min(ratios), max(ratios)


def _plot_spread(ax, x, stats, **style):
    """Medians joined by the style's line, min-max as error bars."""
    med = [s[0] for s in stats]
    err = [[s[0] - s[1] for s in stats], [s[2] - s[0] for s in stats]]
    return ax.errorbar(x, med, yerr=err, capsize=3, **style)


def batch_axis(ax, batches) -> None:
    """A log2 batch axis that reads 1, 4, 16, 64: a tick at each measured batch size."""
    batches = sorted(set(batches))
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("batch size")


def _title(ax, what: str, setup: str | None) -> None:
    ax.set_title(what + (f"\n{setup}" if setup else ""), fontsize=9)


def drift_speedups(rows, arm) -> tuple[list[int], list[tuple[float, float, float]]]:
    """Per evaluation point: the arm's speed-up over plain as (median, min, max) over the point's
    timed repeats (tokens/s per repeat against plain's in the same repeat)."""
    plain = {r["step"]: r for r in rows if r["arm"] == "plain"}
    pts = sorted((r["step"], r) for r in rows if r["arm"] == arm and "speedup" in r)
    stats = []
    for step, r in pts:
        base = plain.get(step, {}).get("tokens_per_s_repeats")
        ratios = [a / b for a, b in zip(r.get("tokens_per_s_repeats") or (), base or ())]
        stats.append(spread(ratios, r["speedup"]))
    return [p[0] for p in pts], stats


def plot_arms(rows, key: str, ylabel: str, path: Path, arms=("frozen", "online", "reference"), hline=None,
              setup: str | None = None):
    """`key` per evaluation point and arm; a speed-up with its spread over the point's repeats."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for arm in arms:
        if key == "speedup":
            x, stats = drift_speedups(rows, arm)
            if x:
                _plot_spread(ax, x, stats, label=arm, **ARM_STYLE[arm])
            continue
        x, y = _series(rows, arm, key)
        if x:
            ax.plot(x, y, label=arm, **ARM_STYLE[arm])
    if hline is not None:
        ax.axhline(hline, color="0.5", lw=0.8, ls="--")
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    _title(ax, ylabel + (" (median, min-max over repeats)" if key == "speedup" else ""), setup)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reward(rl_rows, rows, path: Path, setup: str | None = None):
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in rl_rows], [r["reward"] for r in rl_rows], color="tab:purple", lw=1, label="reward")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean rollout reward", color="tab:purple")
    ax2 = ax.twinx()
    x, y = _series(rows, "plain", "kl_from_start")
    ax2.plot(x, y, color="tab:orange", marker="o", label="KL from start")
    ax2.set_ylabel("policy KL from start (nats/token)", color="tab:orange")
    _title(ax, "reward and policy drift", setup)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance_heatmap(rows, path: Path, arms=("frozen", "online"), setup: str | None = None):
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
    if setup:
        fig.suptitle(f"acceptance per draft position\n{setup}", fontsize=9, y=1.04)
    fig.colorbar(im, ax=list(axes), label="acceptance rate (cumulative)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_speedup_vs_batch(speed_rows, path: Path, bound_rows=None, deep_rows=(), setup: str | None = None):
    """Speed-up against batch size per arm, with its spread over the repeats where the rows
    carry `speedup_repeats`; `deep_rows` (a drift run's deep-target sweep) are drawn beside
    them, one line per mode, labelled with the target's preset and depth."""
    fig, ax = plt.subplots(figsize=(7.5 if deep_rows else 6, 3.8))
    arms = [a for a in dict.fromkeys(r["arm"] for r in speed_rows) if a != "plain"]
    for arm in arms:
        pts = sorted((r["batch"], spread(r.get("speedup_repeats"), r["speedup"]))
                     for r in speed_rows if r["arm"] == arm)
        _plot_spread(ax, [p[0] for p in pts], [p[1] for p in pts], label=arm, **ARM_STYLE.get(arm, dict(marker="o")))
    for mode in [m for m in dict.fromkeys(r["mode"] for r in deep_rows) if m != "plain"]:
        rows = [r for r in deep_rows if r["mode"] == mode]
        pts = sorted((r["batch"], spread(r.get("speedup_repeats"), r["speedup"])) for r in rows)
        _plot_spread(ax, [p[0] for p in pts], [p[1] for p in pts],
                     label=f"{rows[0]['target_layers']}-layer target, {mode}", **DEEP_STYLE.get(mode, dict(marker="o")))
    if bound_rows:
        pts = sorted((r["batch"], r["bound"]) for r in bound_rows)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="0.3", ls="--", label="bound")
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    batch_axis(ax, [r["batch"] for r in [*speed_rows, *deep_rows]])
    ax.set_ylabel("speed-up over plain decoding")
    _title(ax, "speed-up against batch size (median, min-max over repeats)", setup)
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


def plot_sweep(rows, mode: str, xkey: str, xlabel: str, path: Path, setup: str | None = None):
    """Measured speed-up (solid, median with min-max over repeats) and its bound (dashed)
    against `xkey`, one colour per batch size."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    batches = sorted({r["batch"] for r in rows if r["mode"] == mode})
    for i, b in enumerate(batches):
        pts = sorted((r[xkey], spread(r.get("speedup_repeats"), r["speedup"]), _num(r.get("bound")))
                     for r in rows if r["mode"] == mode and r["batch"] == b)
        color = plt.cm.viridis(i / max(1, len(batches) - 1))
        _plot_spread(ax, [p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=f"batch {b}")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", color=color, lw=1)
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_xticks(sorted({r[xkey] for r in rows if r["mode"] == mode}))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speed-up (solid) / bound (dashed)")
    _title(ax, f"{mode} speed-up against {xlabel}", setup)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speed_plots(out) -> list[Path]:
    """Plots of a `specrl bench speed` folder: chain length and tree budget (embedded engine: vLLM
    runs one chain length), and the best configuration against batch size."""
    out = Path(out)
    summary = json.loads((out / "summary.json").read_text())
    rows = [r for r in summary["rows"] if r.get("arm", "") != "embedded-plain"]
    setup = (f"bench speed: preset {summary.get('preset')}, {summary.get('engine', 'embedded')} engine, "
             f"temperature {summary.get('temperature')}, {summary.get('repeats')} repeats")
    paths = []
    for mode, xkey, xlabel, name in (("chain", "gamma", "chain length gamma", "speedup_vs_gamma.png"),
                                     ("tree", "tree_budget", "tree budget (draft tokens verified)",
                                      "speedup_vs_tree_budget.png")):
        if summary.get("engine", "embedded") == "embedded" and any(r["mode"] == mode for r in rows):
            paths.append(out / name)
            plot_sweep(rows, mode, xkey, xlabel, paths[-1], setup)
    best = []
    for b in sorted({r["batch"] for r in rows}):
        spec = [r for r in rows if r["batch"] == b and r["mode"] != "plain"]
        if spec:
            top = max(spec, key=lambda r: r["speedup"])
            best.append({"batch": b, "arm": "best configuration", "speedup": top["speedup"],
                         "speedup_repeats": top.get("speedup_repeats"), "bound": _num(top.get("bound"))})
    if best:
        paths.append(out / "speedup_vs_batch.png")
        plot_speedup_vs_batch(best, paths[-1], bound_rows=best, setup=setup)
    return paths


def drift_plots(out, setup: str | None = None) -> list[Path]:
    """The five plots of a drift run, written next to its metrics; returns their paths. `setup`
    titles them (default: the engine, seed and RL steps from summary.json)."""
    out = Path(out)
    rows, summary, rl_rows = load_drift(out)
    setup = setup or (f"drift: {summary.get('engine', 'embedded')} engine, seed {summary['seed']}, "
                      f"{summary['rl_steps']} RL steps")
    paths = [out / "accept_length.png", out / "speedup.png", out / "reward.png", out / "acceptance_heatmap.png",
             out / "speedup_vs_batch.png"]
    plot_arms(rows, "accept_length", "accept length (tokens / verify step)", paths[0], setup=setup)
    plot_arms(rows, "speedup", "speed-up over plain decoding", paths[1], hline=1.0, setup=setup)
    plot_reward(rl_rows, rows, paths[2], setup=setup)
    plot_acceptance_heatmap(rows, paths[3], setup=setup)
    plot_speedup_vs_batch(summary["speedup_vs_batch"], paths[4], deep_rows=summary.get("speedup_vs_batch_deep_target", []),
                          setup=setup)
    return paths


__all__ = ["drift_plots", "batch_axis", "spread", "load_drift", "read_jsonl", "plot_arms", "plot_reward", "plot_acceptance_heatmap",
           "plot_speedup_vs_batch", "plot_sweep", "speed_plots"]


RL_PART_STYLE = {"rollout_full_s": ("rollout, full batch", "tab:blue"), "rollout_tail_s": ("rollout, tail", "tab:cyan"),
                 "update_s": ("policy update", "tab:orange"), "feature_capture_s": ("feature capture", "tab:pink"),
                 "draft_train_s": ("draft training + sync", "tab:red"), "score_s": ("reward", "0.6"),
                 "policy_sync_s": ("policy sync", "tab:purple"), "other_s": ("other", "0.85")}


def plot_rl_bench(summary: dict, path: Path) -> Path:
    """`specrl bench rl`: per engine and arm, the median RL step split into its parts (stacked),
    with each arm's step-time ratio over `off` above its bar."""
    engines = summary["engines"]
    fig, axes = plt.subplots(1, len(engines), figsize=(3 + 1.6 * max(len(s["arms"]) for s in engines.values()), 4.2),
                             squeeze=False)
    for ax, (engine, s) in zip(axes[0], engines.items()):
        names = list(s["arms"])
        bottom = [0.0] * len(names)
        for part, (label, color) in RL_PART_STYLE.items():
            vals = [s["arms"][a].get(part) or 0.0 for a in names]
            if part == "rollout_full_s" and not any(vals):  # an engine that does not split its rollout
                vals, label = [s["arms"][a]["rollout_s"] for a in names], "rollout"
            elif part == "rollout_tail_s" and not any(s["arms"][a].get("rollout_full_s") for a in names):
                continue
            ax.bar(names, vals, bottom=bottom, color=color, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, a in enumerate(names):
            ax.text(i, bottom[i], f"x{s['arms'][a]['step_speedup']:.2f}", ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("median seconds per RL step")
        _title(ax, f"RL step by arm ({engine})", f"preset {summary['preset']}, {summary['steps']} steps, "
                                                  f"segments of {summary['segment']}")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
