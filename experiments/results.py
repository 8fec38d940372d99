"""One result of docs/results.md from the runs that measured it: medians over the runs, with
their spread, written as the JSON docs/results/ keeps (summaries, not run folders).

    python -m experiments.results NAME --command "specrl bench rl --preset speed --seed {seed}" RUN_DIR ...

Each RUN_DIR holds a command's summary.json (`specrl bench rl`, `specrl drift`, `specrl bench
speed`, ...), or the summary-unfinished.json of a bench rl run that stopped early (its
`unfinished` field says which steps it summarizes); a finished bench rl run summarized again by
newer code (`--report-again`, its `again` field) is read by summary-again.json. Its numbers are
read as flat keys: nested dicts by name, a list of rows by what names a row (its batch, arm,
mode, step, dtype, ...), e.g. `engines.embedded.arms.online.step_speedup` or
`rows.b16.chain.speedup`; lists of plain numbers (curves) are left out. A key's median, min and
max are over the runs that have it. The result keeps, per run, its seed, date and code version,
so the page that quotes it need not.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from specrl.machine_load import shared

SUMMARY_FILES = ("summary-again.json", "summary.json", "summary-unfinished.json")  # what a run folder is read by, in turn
ROW_NAMES = ("batch", "arm", "mode", "gamma", "step", "dtype", "decoding", "spec")  # what identifies a row in a list


def flatten(obj, prefix: str = "") -> dict[str, float]:
    """The numbers (and booleans, as 0/1) of a summary as {dotted key: value}."""
    out: dict[str, float] = {}
    if isinstance(obj, bool):
        out[prefix] = float(obj)
    elif isinstance(obj, (int, float)):
        out[prefix] = float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list) and obj and all(isinstance(r, dict) for r in obj):
        for i, row in enumerate(obj):
            name = ".".join(f"b{row[n]}" if n == "batch" else str(row[n]) for n in ROW_NAMES
                            if isinstance(row.get(n), (str, int, float)) and not isinstance(row.get(n), bool))
            out.update(flatten(row, f"{prefix}.{name or i}"))
    return {k: v for k, v in out.items() if v == v}  # NaN: not a figure


def collect(name: str, command: str, runs: list[Path]) -> dict:
    """The result `name` from the summary.json of each run folder."""
    summaries, files = [], []
    for run in runs:
        # a finished run summarized again by newer code (`bench rl --report-again`) is read before its
        # first summary; a bench rl run that stopped early gives the report of its whole segments
        path = next((Path(run) / n for n in SUMMARY_FILES if (Path(run) / n).is_file()), None)
        if path is None:
            raise ValueError(f"{run} holds no summary.json (a finished run's folder is needed) "
                             f"nor summary-unfinished.json (`specrl bench rl --report-unfinished`)")
        summaries.append(json.loads(path.read_text()))
        files.append(path.name)
    flat = [flatten({k: v for k, v in s.items() if k != "machine"}) for s in summaries]
    keys = sorted(set().union(*flat))
    result = {"result": name, "command": command,
              "runs": [{"folder": str(run), "summary": f, "seed": s.get("seed"), "date": s.get("machine", {}).get("date"),
                        "code_version": s.get("machine", {}).get("code_version"), "timed_alone": timed_alone(fl),
                        "machine": {k: v for k, v in s.get("machine", {}).items() if k not in ("date", "code_version")}}
                       for run, f, s, fl in zip(runs, files, summaries, flat)],
              "median": {}, "min": {}, "max": {}, "n": {}}
    for k in keys:
        values = [f[k] for f in flat if k in f]
        result["median"][k] = statistics.median(values)
        result["min"][k], result["max"][k], result["n"][k] = min(values), max(values), len(values)
    return result


def timed_alone(flat: dict[str, float]) -> bool | None:
    """Whether a run's timings had the machine to themselves, from its summary's flat keys: no RL
    step and no timed decoding during which other processes kept the machine busy
    (specrl.machine_load.shared). None: the summary predates the measurement, or nothing was timed."""
    counts = [v for k, v in flat.items() if k.endswith(("shared_steps_n", "rl_steps_shared"))]
    busy = [v for k, v in flat.items() if k.endswith(("others_busy_cores", "others_busy_cores_eval_max"))]
    if not counts and not busy:
        return None
    return not any(counts) and not any(shared(b) for b in busy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.results", description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="the result's name: docs/results/NAME.json")
    p.add_argument("runs", nargs="+", type=Path, help="the run folders (each with its summary.json)")
    p.add_argument("--command", required=True, help="the command that made each run")
    p.add_argument("--out-dir", type=Path, default=Path("docs/results"), help="where NAME.json is written")
    args = p.parse_args(argv)
    try:
        result = collect(args.name, args.command, args.runs)
    except ValueError as e:
        print(f"experiments.results: {e}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{out}: {len(result['median'])} figures over {len(args.runs)} runs")
    for run in result["runs"]:
        if run["timed_alone"] is False:
            print(f"warning: {run['folder']} was timed while other processes kept the machine busy "
                  f"(specrl.machine_load): its timings are not the code's alone")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
