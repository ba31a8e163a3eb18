"""CVRPLIB Set X at equal time: ``mvmoe_jax.solve`` with a search under a time limit against OR-Tools given the
same wall time per instance, gap to the best-known solutions.

``--count`` files of the size group ``--group`` (customers; spread evenly by size, as ``setx_by_size.py`` picks
them) from ``--data_dir`` (default ``shared/data/external/cvrp-x``, the ``.sol`` files' ``Cost`` lines the
best-known values, CVRPLIB's convention: every edge rounded). Rows:

* ``greedy``: greedy x8 with the solver's size defaults (the distance bias and the local search from twice the
  model's training size);
* each ``--searches`` entry (``sgbs_eas`` by default) with ``--time_limit=--seconds`` and the same defaults; its
  seconds are the search's plus the local search's (which the time limit does not count);
* ``OR-Tools``: its CVRP model with guided local search, one process per core (``--workers``) with
  ``--workers`` x ``--seconds`` per instance, so that it has the same wall time per instance as the policy,
  which uses every core for one instance at a time.

Costs are in the files' convention; every route is replayed by the checker.

    python benchmarks/setx_search.py --group=100-299 --count=10 --seconds=10
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
import setx_by_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default=setx_by_size.DATA_DIR, help="folder of X-n*.vrp files with their .sol")
    p.add_argument("--checkpoint", default="mvmoe_4e_n50", help="the model (a shipped name or a path)")
    p.add_argument("--group", default="100-299", help="the size range, LOW-HIGH customers")
    p.add_argument("--count", type=int, default=10, help="files from the group")
    p.add_argument("--seconds", type=float, default=10.0, help="wall time per instance for each search and OR-Tools")
    p.add_argument("--searches", default="sgbs_eas", help="comma-separated searches of mvmoe_jax.solve")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="OR-Tools processes")
    p.add_argument("--output", default=None, help="report JSON (markdown beside it); default benchmarks/results/")
    return p


def ortools_rows(paths: list[str], best: dict[str, float], seconds: float, workers: int) -> dict[str, dict]:
    """OR-Tools on each file, ``workers`` at a time with ``workers * seconds`` each: {name: row}."""
    import jax

    from mvmoe_jax import checker
    from mvmoe_jax.baselines import common, ortools_solver
    from mvmoe_jax.io import read_vrplib

    read = [read_vrplib(p) for p in paths]
    problems = [common.problems_from_instances(inst)[0] for inst, _ in read]
    results = common.run_parallel(ortools_solver.solve_problem, problems, workers=workers, progress=False,
                                  time_limit=workers * seconds)
    rows = {}
    for (inst, meta), res in zip(read, results):
        check = checker.check_route(jax.tree.map(lambda x: x[0], inst), res.route)
        cost = checker.tours_cost(meta.coords, checker.split_subtours(res.route), False, convention=meta.cost_convention)
        rows[meta.name] = {"cost": cost, "gap": (cost - best[meta.name]) / best[meta.name] * 100.0,
                           "seconds": float(res.seconds) / workers, "feasible": bool(check.feasible),
                           "route": [int(v) for v in res.route]}
    return rows


def policy_rows(paths: list[str], bks: str, checkpoint: str, search: str, seconds: float) -> dict[str, dict]:
    """``mvmoe_jax.solve`` on every file: {name: row}."""
    from mvmoe_jax import solve

    options = {} if search == "greedy" else {"search": search, "time_limit": seconds}
    report = solve.solve(paths, checkpoint=checkpoint, bks=bks, **options)
    return {s.name: {"cost": s.convention_cost, "gap": s.gap, "seconds": s.seconds + s.improve_seconds,
                     "feasible": bool(s.feasible), "rounds": s.rounds} for s in report.solutions}


def markdown(report: dict) -> str:
    methods = list(report["methods"])
    lines = [f"Machine: {report['machine']}; commit {report['commit']}; {report['date']}; model {report['checkpoint']}; "
             f"Set X {report['group']} customers, {report['seconds']:g} s of wall time per instance for each search and "
             "OR-Tools (greedy: its own time). Gap % to the BKS in CVRPLIB's convention (edges rounded).", "",
             "| instance | " + " | ".join(f"{m} gap % | s" for m in methods) + " |",
             "|---|" + "---|---|" * len(methods)]
    for name in report["instances"]:
        lines.append(f"| {name} | " + " | ".join(
            f"{report['methods'][m][name]['gap']:.2f} | {report['methods'][m][name]['seconds']:.1f}" for m in methods) + " |")
    lines.append("| mean | " + " | ".join(f"**{report['summary'][m]['mean_gap']:.2f}** | "
                                         f"{report['summary'][m]['seconds_per_instance']:.1f}" for m in methods) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    (group,) = setx_by_size.parse_groups(args.group)
    if args.count < 1 or args.seconds <= 0 or args.workers < 1:
        raise SystemExit("--count and --workers must be positive, --seconds above 0")
    if not os.path.isdir(args.data_dir):
        raise SystemExit(f"--data_dir {args.data_dir}: no such folder")
    import vrplib

    names = setx_by_size.choose_files(args.data_dir, [group], args.count)[group]
    if not names:
        raise SystemExit(f"no X-n*.vrp file with a .sol in {args.data_dir} has {args.group} customers")
    best = {n: float(vrplib.read_solution(os.path.join(args.data_dir, n + ".sol"))["cost"]) for n in names}
    paths = [os.path.join(args.data_dir, n + ".vrp") for n in names]
    searches = [s for s in args.searches.split(",") if s]
    report = {"machine": machine.jax_device(), "commit": machine.repository_commit(),
              "date": datetime.date.today().isoformat(), "checkpoint": args.checkpoint, "group": args.group,
              "seconds": args.seconds, "workers": args.workers, "instances": names, "methods": {}}
    with tempfile.TemporaryDirectory() as tmp:
        bks = os.path.join(tmp, "bks.json")
        with open(bks, "w") as f:
            json.dump({"Set-X": best}, f)
        for search in ["greedy"] + searches:
            report["methods"][search] = policy_rows(paths, bks, args.checkpoint, search, args.seconds)
            print(f"{search}: done", flush=True)
    report["methods"]["OR-Tools"] = ortools_rows(paths, best, args.seconds, args.workers)
    report["summary"] = {m: {"mean_gap": float(np.mean([r["gap"] for r in rows.values()])),
                             "seconds_per_instance": float(np.mean([r["seconds"] for r in rows.values()])),
                             "feasible": int(sum(r["feasible"] for r in rows.values()))}
                         for m, rows in report["methods"].items()}
    for m, s in report["summary"].items():
        print(f"{m}: mean gap {s['mean_gap']:.2f} %, {s['seconds_per_instance']:.1f} s, {s['feasible']}/{len(names)} "
              "feasible", flush=True)
    output = args.output or machine.default_output("setx_search")
    machine.write_report(report, output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
