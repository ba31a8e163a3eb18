"""VRPTW benchmark sets by class: Solomon's 56 instances (100 customers) and Gehring and Homberger's 60 of 1,000
customers, each of the six classes C1, C2, R1, R2, RC1, RC2 (clustered, random or mixed customers; short or long
horizons), solved by ``mvmoe_jax.solve`` with its size defaults and without its local search.

``--set=solomon`` reads ``shared/data/mvmoe-paper/Vrp-Set-Solomon`` (best-known values from ``BKS.json`` beside it,
where it has them); ``--set=gehring-homberger`` reads ``shared/data/external/vrptw-gehring-homberger`` (best-known
values from the ``Cost`` line of each ``.sol``). Both follow the DIMACS convention (distances truncated to one
decimal), which ``Solution.convention_cost`` applies. ``--per_class`` takes the first K files of each class by
number. Every route is replayed by the checker (``Solution.feasible``); seconds are the search's plus the local
search's, compilation excluded.

    python benchmarks/vrptw_classes.py --set=solomon
    python benchmarks/vrptw_classes.py --set=gehring-homberger --per_class=2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile

import numpy as np

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")
SETS = {"solomon": os.path.join(SHARED, "mvmoe-paper", "Vrp-Set-Solomon"),
        "gehring-homberger": os.path.join(SHARED, "external", "vrptw-gehring-homberger")}
CLASSES = ("C1", "C2", "R1", "R2", "RC1", "RC2")
CONFIGS = {"defaults": {}, "no local search": {"improve": "none"}}


def instance_class(name: str) -> str:
    """``C101`` / ``RC208`` (Solomon) and ``C1_10_1`` / ``RC2_10_4`` (Gehring-Homberger) -> C1, RC2, ..."""
    m = re.match(r"^(RC|C|R)(\d)", name.upper())
    if not m:
        raise SystemExit(f"{name}: not a Solomon or Gehring-Homberger instance name")
    return m.group(1) + m.group(2)


def _number(name: str) -> int:
    """The instance's number within its class (``C105`` -> 5, ``C1_10_7`` -> 7)."""
    digits = re.findall(r"\d+", name)
    return int(digits[-1]) if "_" in name else int(digits[0]) % 100


def choose_files(data_dir: str, per_class: int | None) -> dict[str, list[str]]:
    """Per class, the file paths (``.txt`` Solomon or ``.vrp``), first ``per_class`` by number (None: all)."""
    files = sorted(f for f in os.listdir(data_dir) if f.endswith((".txt", ".vrp")) and f[0].upper() in "CR")
    chosen = {c: [] for c in CLASSES}
    for f in sorted(files, key=lambda f: (instance_class(f[:-4]), _number(f[:-4]))):
        chosen[instance_class(f[:-4])].append(os.path.join(data_dir, f))
    return {c: paths[:per_class] if per_class else paths for c, paths in chosen.items() if paths}


def best_known(data_dir: str, names: list[str]) -> dict[str, float]:
    """Best-known values: a ``.sol`` file's ``Cost`` line beside the instance, else ``BKS.json`` one folder up."""
    out = {}
    table = {}
    bks_json = os.path.join(os.path.dirname(data_dir), "BKS.json")
    if os.path.exists(bks_json):
        from mvmoe_jax.io import load_bks

        table = load_bks(bks_json)
    for name in names:
        sol = os.path.join(data_dir, name + ".sol")
        if os.path.exists(sol):
            with open(sol) as f:
                costs = [line.split()[-1] for line in f if line.strip().lower().startswith("cost")]
            if costs:
                out[name] = float(costs[-1])
                continue
        if name in table:
            out[name] = table[name]
    return out


def summarise(solutions: list) -> dict:
    """Mean gap (over the solutions with a best-known value; None without any), mean convention cost, seconds."""
    gaps = [s.gap for s in solutions if s.gap is not None]
    return {"mean_gap": float(np.mean(gaps)) if gaps else None, "with_bks": len(gaps),
            "mean_cost": float(np.mean([s.convention_cost for s in solutions])),
            "seconds_per_instance": float(np.mean([s.seconds + s.improve_seconds for s in solutions])),
            "feasible": int(sum(s.feasible for s in solutions)),
            "gaps": {s.name: s.gap for s in solutions}}


def markdown(report: dict) -> str:
    lines = [f"Machine: {report['machine']}; commit {report['commit']}; {report['date']}; model {report['checkpoint']}; "
             f"{report['set']}; greedy x8 with `mvmoe_jax.solve`'s size defaults, and without the local search. Gap "
             "to the best-known values in the DIMACS convention; seconds per instance, the local search's included.",
             "", "| class | files | with BKS | " + " | ".join(f"{c} gap % | s/inst" for c in CONFIGS) + " | feasible |",
             "|---|---|---|" + "---|---|" * len(CONFIGS) + "---|"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"
    for row in report["classes"]:
        cells = " | ".join(f"{fmt(row[c]['mean_gap'])} | {row[c]['seconds_per_instance']:.1f}" for c in CONFIGS)
        lines.append(f"| {row['class']} | {row['files']} | {row[next(iter(CONFIGS))]['with_bks']} | {cells} | "
                     f"{sum(row[c]['feasible'] for c in CONFIGS)}/{len(CONFIGS) * row['files']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="solomon", choices=sorted(SETS))
    p.add_argument("--data_dir", default=None, help="the set's folder (default: its place under shared/data)")
    p.add_argument("--checkpoint", default="mvmoe_4e_n50", help="the model (a shipped name or a path)")
    p.add_argument("--per_class", type=int, default=None, help="files per class (default: all)")
    p.add_argument("--output", default=None, help="report JSON (markdown beside it); default benchmarks/results/")
    args = p.parse_args(argv)
    data_dir = args.data_dir or SETS[args.set]
    if not os.path.isdir(data_dir):
        raise SystemExit(f"--data_dir {data_dir}: no such folder")
    if args.per_class is not None and args.per_class < 1:
        raise SystemExit("--per_class must be positive")
    from mvmoe_jax import solve

    chosen = choose_files(data_dir, args.per_class)
    paths = [path for group in chosen.values() for path in group]
    if not paths:
        raise SystemExit(f"no Solomon .txt or VRPLIB .vrp instance of the classes {', '.join(CLASSES)} in {data_dir}")
    names = [os.path.basename(path)[:-4] for path in paths]
    best = best_known(data_dir, names)
    report = {"machine": machine.jax_device(), "commit": machine.repository_commit(), "set": args.set,
              "date": datetime.date.today().isoformat(), "checkpoint": args.checkpoint, "classes": []}
    with tempfile.TemporaryDirectory() as tmp:
        bks = os.path.join(tmp, "bks.json")
        with open(bks, "w") as f:
            json.dump({args.set: best}, f)
        solved = {label: {s.name.upper(): s for s in solve.solve(paths, checkpoint=args.checkpoint,
                                                                  bks=bks if best else None, **options).solutions}
                  for label, options in CONFIGS.items()}
    for cls, group in chosen.items():
        row = {"class": cls, "files": len(group)}
        for label in CONFIGS:
            row[label] = summarise([solved[label][os.path.basename(path)[:-4].upper()] for path in group])
        report["classes"].append(row)
        print(f"{cls}: " + ", ".join(f"{label} {row[label]['mean_gap']}" for label in CONFIGS), flush=True)
    output = args.output or machine.default_output(f"vrptw_classes_{args.set}")
    machine.write_report(report, output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
