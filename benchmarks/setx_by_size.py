"""CVRPLIB's Set X by size group: ``mvmoe_jax.solve`` with its size defaults (the distance bias and the local search
from twice the model's training size, fewer POMO starts above 200 customers) against the same without the local
search and without either, gap to the best-known solutions.

``--per_group`` files of each size group (``--groups``, customers; spread evenly over the group's files by size)
from ``--data_dir`` (default ``shared/data/external/cvrp-x``: the 100 X instances with their ``.sol`` files, whose
``Cost`` line is the best-known value with every edge rounded to the nearest integer, CVRPLIB's convention). Each
file is solved by greedy x8 three times (``CONFIGS``): with the defaults, with ``--improve=none``, and with
``--improve=none --distance_bias=0``. Gaps compare the cost in the files' convention (``Solution.convention_cost``);
seconds are the search's plus the local search's; every route is replayed by the checker (``Solution.feasible``).

    python benchmarks/setx_by_size.py --per_group=2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import numpy as np

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DATA_DIR = os.path.join(os.path.dirname(REPO), "shared", "data", "external", "cvrp-x")
CONFIGS = {"defaults": {}, "no local search": {"improve": "none"},
           "neither": {"improve": "none", "distance_bias": 0.0}}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default=DATA_DIR, help="folder of X-n*.vrp files with their .sol")
    p.add_argument("--checkpoint", default="mvmoe_4e_n50", help="the model (a shipped name or a path)")
    p.add_argument("--groups", default="100-299,300-599,600-1000", help="comma-separated size ranges (customers)")
    p.add_argument("--per_group", type=int, default=2, help="files per size group")
    p.add_argument("--output", default=None, help="report JSON (markdown beside it); default benchmarks/results/")
    return p


def parse_groups(text: str) -> list[tuple[int, int]]:
    """``"100-299,300-599"`` -> [(100, 299), (300, 599)]."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        lo, sep, hi = item.partition("-")
        if not (sep and lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):
            raise SystemExit(f"--groups item {item!r}: expected LOW-HIGH customers, e.g. 100-299")
        out.append((int(lo), int(hi)))
    return out


def customers(name: str) -> int:
    """Customers of an X instance from its name (``X-n101-k25``: 101 nodes, 100 customers)."""
    return int(name.split("-")[1][1:]) - 1


def choose_files(data_dir: str, groups: list[tuple[int, int]], per_group: int) -> dict[tuple[int, int], list[str]]:
    """Per group, ``per_group`` instance names spread evenly over the group's files in order of size."""
    names = sorted((f[:-4] for f in os.listdir(data_dir) if f.startswith("X-n") and f.endswith(".vrp")
                    and os.path.exists(os.path.join(data_dir, f[:-4] + ".sol"))), key=customers)
    chosen = {}
    for lo, hi in groups:
        inside = [n for n in names if lo <= customers(n) <= hi]
        picks = np.unique(np.linspace(0, len(inside) - 1, min(per_group, len(inside))).round().astype(int))
        chosen[lo, hi] = [inside[i] for i in picks] if inside else []
    return chosen


def markdown(report: dict) -> str:
    lines = [f"Machine: {report['machine']}; commit {report['commit']}; {report['date']}; model "
             f"{report['checkpoint']}; greedy x8 with `mvmoe_jax.solve`'s size defaults (distance bias and local "
             "search), without the local search, and without either. Gap to the BKS in CVRPLIB's convention (edges "
             "rounded); seconds per instance, the local search's included.", "",
             "| group | instances | " + " | ".join(f"{label} gap % | s/inst" for label in CONFIGS) + " | feasible |",
             "|---|---|" + "---|---|" * len(CONFIGS) + "---|"]
    for g in report["groups"]:
        cells = " | ".join(f"{g[label]['mean_gap']:.2f} | {g[label]['seconds_per_instance']:.1f}" for label in CONFIGS)
        lines.append(f"| {g['group']} | {', '.join(g['instances'])} | {cells} | "
                     f"{g['feasible']}/{len(CONFIGS) * len(g['instances'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    groups = parse_groups(args.groups)
    if args.per_group < 1:
        raise SystemExit("--per_group must be positive")
    if not os.path.isdir(args.data_dir):
        raise SystemExit(f"--data_dir {args.data_dir}: no such folder")
    import vrplib

    from mvmoe_jax import solve

    chosen = choose_files(args.data_dir, groups, args.per_group)
    names = [n for group in chosen.values() for n in group]
    if not names:
        raise SystemExit(f"no X-n*.vrp file with a .sol in {args.data_dir} falls in --groups {args.groups}")
    best = {n: float(vrplib.read_solution(os.path.join(args.data_dir, n + ".sol"))["cost"]) for n in names}
    report = {"machine": machine.jax_device(), "commit": machine.repository_commit(),
              "date": datetime.date.today().isoformat(), "checkpoint": args.checkpoint, "groups": []}
    with tempfile.TemporaryDirectory() as tmp:
        bks = os.path.join(tmp, "bks.json")
        with open(bks, "w") as f:
            json.dump({"Set-X": best}, f)
        paths = [os.path.join(args.data_dir, n + ".vrp") for n in names]
        solved = {label: {s.name: s for s in solve.solve(paths, checkpoint=args.checkpoint, bks=bks, **options).solutions}
                  for label, options in CONFIGS.items()}
    for (lo, hi), group in chosen.items():
        if not group:
            continue
        row = {"group": f"{lo}-{hi}", "instances": group,
               "feasible": sum(solved[label][n].feasible for label in CONFIGS for n in group)}
        for label in CONFIGS:
            sols = [solved[label][n] for n in group]
            row[label] = {"mean_gap": float(np.mean([s.gap for s in sols if s.gap is not None] or [np.nan])),
                          "seconds_per_instance": float(np.mean([s.seconds + s.improve_seconds for s in sols])),
                          "gaps": {s.name: s.gap for s in sols}, "starts": {s.name: s.starts for s in sols}}
        report["groups"].append(row)
        print(f"{lo}-{hi}: " + ", ".join(f"{label} {row[label]['mean_gap']:.2f} %" for label in CONFIGS), flush=True)
    output = args.output or machine.default_output("setx_by_size")
    machine.write_report(report, output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
