"""The VRP with backhauls of the literature: Queiroga et al.'s (2020) VRPB files under the classic rule.

For each file (``TYPE: VRPB``, read under the classic backhaul rule: every linehaul before any backhaul on a route,
a route opening with a linehaul, deliveries and pickups each within the capacity; docs/environment.md), the methods
asked for solve it and each solution is reported with:

* cost: the file's convention, every edge rounded to the nearest integer (that of the ``.sol`` best-known
  solutions, whose ``Cost`` line is the BKS), and the gap to the BKS in percent;
* seconds: the method's search time (the model's compilation excluded; the local search's time on its own row);
* feasibility twice: by the environment's checker (``mvmoe_jax.checker``) under the classic rule, and by PyVRP
  (``pyvrp_solver.check_vrplib_routes``: ``pyvrp.read`` of the file, ``Solution.is_feasible()``, and no arc that
  PyVRP's reader prices at 2^44 to keep the order).

Methods: ``greedy`` (greedy x8 from every POMO start) and ``eas`` (efficient active search for ``--seconds``) with
the model ``--checkpoint`` through ``mvmoe_jax.solve`` and ``--distance_bias``; with ``--improve=ls`` the local
search after each (its own rows, at most ``--ls_seconds``); ``ortools`` (the reference model of the classic rule, ``--ortools_seconds``,
default ``--seconds``).

    python benchmarks/vrpb_queiroga.py --limit=6 --seconds=60 --improve=ls

``--limit K`` takes the K smallest files, ``--instances`` names them. The report (JSON and markdown, with the
machine, the date and the load average) is rewritten after each instance; ``--resume`` keeps the instances a
report with the same settings already holds (and with nothing left to run writes the report again).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DATA_DIR = os.path.join(os.path.dirname(REPO), "shared", "data", "external", "vrpb-queiroga")
METHODS = ("greedy", "eas", "ortools")
LABELS = {"greedy": "greedy x8", "greedy+ls": "greedy x8 + LS", "eas": "EAS", "eas+ls": "EAS + LS",
          "ortools": "OR-Tools"}
SETTINGS = ("checkpoint", "seconds", "ortools_seconds", "ls_seconds", "distance_bias", "methods", "improve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default=DATA_DIR, help="folder of the VRPB .vrp files and their .sol")
    p.add_argument("--instances", default="", help="comma-separated names (default: every .vrp in --data_dir)")
    p.add_argument("--limit", type=int, default=None, help="only the K smallest instances")
    p.add_argument("--checkpoint", default="mvmoe_4e_n50", help="the model (a shipped name or a path)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--seconds", type=float, default=60.0, help="EAS's time limit per instance")
    p.add_argument("--ortools_seconds", type=float, default=None, help="OR-Tools' per instance (default --seconds)")
    p.add_argument("--distance_bias", type=float, default=1.0, help="distance-aware decoding's bias (0: off)")
    p.add_argument("--improve", default="none", choices=("none", "ls"), help="ls: the local search after greedy / EAS")
    p.add_argument("--ls_seconds", type=float, default=None,
                   help="the local search's time limit per run (default --seconds; it stops earlier at a local optimum)")
    p.add_argument("--output", default=None, help="report JSON (markdown beside it); default benchmarks/results/")
    p.add_argument("--resume", action="store_true", help="keep the instances the report already has")
    return p


def best_known(sol_path: str) -> float:
    """The ``Cost`` line of a VRPLIB solution file."""
    with open(sol_path) as f:
        for line in f:
            if line.strip().lower().startswith("cost"):
                return float(line.split()[-1])
    raise SystemExit(f"{sol_path}: no Cost line")


def dimension(path: str) -> int:
    """DIMENSION of a VRPLIB file (read from its header)."""
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip().upper() == "DIMENSION":
                return int(value)
            if "SECTION" in line:
                break
    raise SystemExit(f"{path}: no DIMENSION line")


def select(data_dir: str, names: str, limit: int | None) -> list[str]:
    """Paths of the instances asked for, smallest first; each must have its .sol beside it."""
    if not os.path.isdir(data_dir):
        raise SystemExit(f"data folder not found: {data_dir}")
    if names:
        paths = [os.path.join(data_dir, n if n.endswith(".vrp") else n + ".vrp") for n in names.split(",") if n]
    else:
        paths = [os.path.join(data_dir, f) for f in os.listdir(data_dir) if f.endswith(".vrp")]
    for p in paths:
        if not os.path.isfile(p):
            raise SystemExit(f"instance not found: {p}")
        if not os.path.isfile(p[:-4] + ".sol"):
            raise SystemExit(f"no best-known solution beside {p} (expected {p[:-4]}.sol)")
    if limit is not None and limit < 1:
        raise SystemExit(f"--limit must be a positive integer, got {limit}")
    paths = sorted(paths, key=lambda p: (dimension(p), os.path.basename(p)))
    return paths[:limit] if limit else paths


def neural(path: str, search: str, *, checkpoint: str, seconds: float, distance_bias: float):
    """The model on one file: (routes: lists of customers 1..n, search seconds, detail dict)."""
    from mvmoe_jax import solve

    report = solve.solve([path], checkpoint=checkpoint, search=search,
                         time_limit=seconds if search != "greedy" else None, distance_bias=distance_bias,
                         improve="none")
    if not report.solutions:
        raise SystemExit(f"{path}: not solved ({'; '.join(r.error for r in report.refused)})")
    s = report.solutions[0]
    return s.routes, float(s.seconds), {"starts": s.starts, "rounds": s.rounds, "plan": "; ".join(report.plans.values()),
                                        "compile_seconds": report.compile_seconds}


def local_search_after(inst, routes, seconds: float):
    """The package's local search from ``routes`` (lists of customers) for at most ``seconds``: (routes, seconds,
    detail)."""
    from mvmoe_jax import local_search

    found = local_search.improve_instance(inst, [list(r) for r in routes], time_limit=seconds)
    return [list(t) for t in found.routes], float(found.seconds), {"local_optimum": found.local_optimum,
                                                                   "ls_rounds": found.rounds}


def ortools(inst_batch, seconds: float):
    """OR-Tools' classic model on the (batched, one) Instance: (routes, seconds, detail)."""
    from mvmoe_jax.baselines import common, ortools_solver
    from mvmoe_jax.checker import split_subtours

    res = ortools_solver.solve_problem(common.problems_from_instances(inst_batch)[0], time_limit=seconds)
    return split_subtours(res.route), float(res.seconds), {"status": res.status}


def assess(path: str, inst, meta, routes, bks: float) -> dict:
    """Cost under the file's convention, gap, and both verdicts on one solution."""
    from mvmoe_jax import checker
    from mvmoe_jax.baselines import pyvrp_solver

    routes = [[int(v) for v in r] for r in routes if len(r)]
    ours = checker.check_route(inst, [v for r in routes for v in (*r, 0)])
    theirs = pyvrp_solver.check_vrplib_routes(path, routes)
    cost = checker.tours_cost(meta.coords, routes, False, rounded=True)
    return {"cost": cost, "gap": (cost - bks) / bks * 100.0, "routes": len(routes),
            "checker_feasible": bool(ours.feasible), "checker_violation": ours.violation,
            "pyvrp_feasible": bool(theirs.feasible), "pyvrp_distance": theirs.distance, "pyvrp_reason": theirs.reason,
            "solution": routes}


def run_instance(path: str, args, methods: list[str]) -> dict:
    """Every method on one file: the instance's entry of the report."""
    import jax

    from mvmoe_jax.io import read_vrplib

    batch, meta = read_vrplib(path)
    if meta.variant != "VRPB" or meta.backhaul_rule != "classic":
        raise SystemExit(f"{path}: read as {meta.variant} under the {meta.backhaul_rule} rule, expected VRPB (classic)")
    inst = jax.tree.map(lambda x: x[0], batch)
    bks = best_known(path[:-4] + ".sol")
    entry = {"name": meta.name, "n": meta.num_customers, "capacity": meta.capacity, "bks": bks, "rows": []}

    def add(method, routes, seconds, detail):
        load = os.getloadavg()[0]
        row = {"method": method, "seconds": seconds, "load": round(load, 2), **detail,
               **assess(path, inst, meta, routes, bks)}
        entry["rows"].append(row)
        print(f"{meta.name}: {LABELS[method]:<16} cost {row['cost']:>10.0f}  gap {row['gap']:6.2f}%  "
              f"{seconds:7.1f} s  checker {'ok' if row['checker_feasible'] else row['checker_violation']}  "
              f"PyVRP {'ok' if row['pyvrp_feasible'] else row['pyvrp_reason']}  load {load:.1f}", flush=True)
        return routes

    for method in methods:
        if method == "ortools":
            add("ortools", *ortools(batch, args.ortools_seconds))
            continue
        routes, seconds, detail = neural(path, method, checkpoint=args.checkpoint, seconds=args.seconds,
                                         distance_bias=args.distance_bias)
        add(method, routes, seconds, detail)
        if args.improve == "ls":
            better, ls_seconds, detail = local_search_after(inst, routes, args.ls_seconds)
            add(method + "+ls", better, ls_seconds, {"after": method, **detail})
    return entry


def summary_rows(report: dict) -> list[tuple[str, float, float, int, int, int]]:
    """Per method, over the instances: (label, mean gap, mean seconds, checker-feasible, PyVRP-feasible, count)."""
    by_method: dict[str, list[dict]] = {}
    for entry in report["instances"]:
        for row in entry["rows"]:
            by_method.setdefault(row["method"], []).append(row)
    out = []
    for method, rows in by_method.items():
        out.append((LABELS[method], float(np.mean([r["gap"] for r in rows])), float(np.mean([r["seconds"] for r in rows])),
                    sum(r["checker_feasible"] for r in rows), sum(r["pyvrp_feasible"] for r in rows), len(rows)))
    return out


def rounds(row: dict) -> str:
    """What a row's search ran: EAS's iterations; the local search's rounds, "(limit)" where the time limit stopped
    it before a local optimum; "-" for greedy and OR-Tools."""
    if row["method"] == "eas":
        return str(row.get("rounds", "-"))
    if row["method"].endswith("+ls"):
        return f"{row['ls_rounds']}" + ("" if row["local_optimum"] else " (limit)")
    return "-"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"# VRPB (Queiroga et al. 2020) under the classic backhaul rule, {report['date']}", "",
             f"Machine: {report['machine']}; commit {report['commit']}. Model `{s['checkpoint']}` with distance bias "
             f"{s['distance_bias']:g}; EAS {s['seconds']:g} s, OR-Tools {s['ortools_seconds']:g} s, the local search (LS) "
             f"at most {s['ls_seconds']:g} s per instance. "
             "Cost: every edge rounded to the nearest integer (the `.sol` convention); gap to the file's BKS; "
             "seconds: search time (compilation excluded; the local search's own time on its row); "
             "rounds: EAS's iterations, the local search's rounds; "
             "feasible: by the environment's checker (classic rule) / by PyVRP (`pyvrp.read` of the file); "
             "load: the 1-minute load average when the row finished.", "",
             "| instance | n | BKS | method | cost | gap % | seconds | rounds | routes | checker | PyVRP | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in report["instances"]:
        for r in e["rows"]:
            lines.append(f"| {e['name']} | {e['n']} | {e['bks']:.0f} | {LABELS[r['method']]} | {r['cost']:.0f} | "
                         f"{r['gap']:.2f} | {r['seconds']:.1f} | {rounds(r)} | {r['routes']} | "
                         f"{'yes' if r['checker_feasible'] else 'NO'} | {'yes' if r['pyvrp_feasible'] else 'NO'} | "
                         f"{r['load']:.1f} |")
    lines += ["", "Over the instances:", "", "| method | mean gap % | mean seconds | checker feasible | PyVRP feasible |",
              "|---|---|---|---|---|"]
    for label, gap, sec, ok, ok_pyvrp, count in summary_rows(report):
        lines.append(f"| {label} | {gap:.2f} | {sec:.1f} | {ok}/{count} | {ok_pyvrp}/{count} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"--methods: unknown {unknown[0]!r}; choose from {', '.join(METHODS)}" if unknown
                         else "--methods: name at least one")
    if not args.seconds > 0:
        raise SystemExit(f"--seconds must be positive, got {args.seconds}")
    args.ortools_seconds = args.seconds if args.ortools_seconds is None else args.ortools_seconds
    args.ls_seconds = args.seconds if args.ls_seconds is None else args.ls_seconds
    for name in ("ortools_seconds", "ls_seconds"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name} must be positive, got {getattr(args, name)}")
    paths = select(args.data_dir, args.instances, args.limit)
    output = args.output or machine.default_output("vrpb_queiroga")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    settings = {"checkpoint": args.checkpoint, "seconds": args.seconds, "ortools_seconds": args.ortools_seconds,
                "ls_seconds": args.ls_seconds, "distance_bias": args.distance_bias, "methods": methods, "improve": args.improve}
    report = {"date": datetime.date.today().isoformat(), "machine": machine.jax_device(),
              "commit": machine.repository_commit(), "settings": settings, "instances": []}
    if args.resume and os.path.isfile(output):
        with open(output) as f:
            old = json.load(f)
        differ = [k for k in SETTINGS if old.get("settings", {}).get(k) != settings[k]]
        if differ:
            raise SystemExit(f"--resume: {output} was made with other settings ({differ[0]}: report "
                             f"{old['settings'].get(differ[0])!r}, now {settings[differ[0]]!r})")
        report["instances"] = old["instances"]
        report.update({k: old[k] for k in ("date", "machine", "commit") if k in old})   # where the first ones ran
    done = {e["name"] for e in report["instances"]}
    for path in paths:
        name = os.path.basename(path)[:-4]
        if name in done:
            continue
        start = time.perf_counter()
        entry = run_instance(path, args, methods)
        entry.update(wall_seconds=time.perf_counter() - start, date=datetime.date.today().isoformat(),
                     machine=machine.jax_device(), commit=machine.repository_commit())
        report["instances"].append(entry)
        machine.write_report(report, output, markdown(report))
    if not report["instances"]:
        raise SystemExit("no instance to run")
    if len(done) == len(report["instances"]):          # nothing new: the report is written again as it is
        machine.write_report(report, output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
