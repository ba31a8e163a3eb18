"""Recipes confirmed on a trained model: runs that continue the same shipped weights under different recipes
(``scripts/train_on.sh``, one core each), compared at equal training CPU seconds on their validation gap
(greedy from all starts, no augmentation, all 16 variants of the paper's sets).

    CPU_CORE=0 EPOCHS=4 scripts/train_on.sh RUNS/default mvmoe_4e_n50 --config.validation_instances=250
    CPU_CORE=1 EPOCHS=4 CONFIG=configs/mvmoe_paper.py scripts/train_on.sh RUNS/paper mvmoe_4e_n50 \
        --config.validation_instances=250
    python benchmarks/recipe_confirmation.py default=RUNS/default/mvmoe_4e_n50 paper=RUNS/paper/mvmoe_4e_n50 \
        --output=benchmarks/results/recipe_confirmation_n50.json

The report holds every validation point of every run (epoch 0 is the shipped weights), and each run's gaps at
the CPU time all runs reached.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine import cpu_model, write_report  # noqa: E402
from benchmarks.recipe_study import _at_seconds, gap_figure, run_points, save_gap_figure  # noqa: E402


def parse_runs(specs: list[str]) -> dict[str, str]:
    """``NAME=WORKDIR`` pairs to a mapping; each workdir must hold a ``metrics.jsonl``."""
    runs = {}
    for spec in specs:
        name, sep, workdir = spec.partition("=")
        if not sep or not name or not workdir:
            raise SystemExit(f"a run is NAME=WORKDIR, got {spec!r}")
        if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
            raise SystemExit(f"{workdir} holds no metrics.jsonl")
        runs[name] = workdir
    return runs


def summarize(runs: dict[str, str], problem_size: int) -> dict:
    points = {name: run_points(workdir) for name, workdir in runs.items()}
    common = min(pts[-1]["train_seconds"] for pts in points.values())
    return {"problem_size": problem_size, "cpu": cpu_model(), "common_seconds": common,
            "start": {k: points[next(iter(points))][0][k] for k in ("trained", "unseen", "all")},
            "at_common_seconds": {name: _at_seconds(pts, common) for name, pts in points.items()},
            "runs": points}


def markdown(report: dict) -> str:
    start = report["start"]
    lines = [f"Recipes continuing the shipped weights at n = {report['problem_size']}, one core per run "
             f"({report['cpu']}); greedy gap % (all starts, no augmentation) over 6 trained / 10 unseen variants.",
             "", f"| recipe | at {report['common_seconds']:.0f} CPU s: trained | unseen | last point: CPU s "
             "| trained | unseen |", "|---|---|---|---|---|---|",
             f"| shipped weights (start) | {start['trained']:.2f} | {start['unseen']:.2f} | | | |"]
    for name, at in report["at_common_seconds"].items():
        last = report["runs"][name][-1]
        lines.append(f"| {name} | {at['trained']:.2f} | {at['unseen']:.2f} | {last['train_seconds']:.0f} | "
                     f"{last['trained']:.2f} | {last['unseen']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    fig, axes = gap_figure()
    for name, pts in report["runs"].items():
        for ax, key in zip(axes, ("trained", "unseen")):
            ax.plot([p["train_seconds"] / 3600 for p in pts], [p[key] for p in pts], marker="o", label=name)
    save_gap_figure(fig, axes, f"n = {report['problem_size']}, continuing the shipped weights", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="NAME=WORKDIR of each run")
    p.add_argument("--problem_size", type=int, default=50)
    p.add_argument("--output", default="benchmarks/results/recipe_confirmation_n50.json")
    args = p.parse_args(argv)
    report = summarize(parse_runs(args.runs), args.problem_size)
    write_report(report, args.output, markdown(report))
    plot(report, os.path.splitext(args.output)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
