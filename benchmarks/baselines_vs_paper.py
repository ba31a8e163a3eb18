"""Our reference solvers next to the paper's stored reference solutions, on the paper's n = 50 test sets.

Two parts (``--part``):

* ``ortools``: for each variant, our OR-Tools (exactly the environment's semantics) on the first K
  instances at the paper's 20 s budget, next to the paper's ``or_tools_20s_`` and ``or_tools_200s_``
  results on the same instances; how many of the paper's routes our environment accepts (checker), as
  stored and with sub-tours reordered so that backhaul-only tours come last; ours feasible K/K.
* ``pyvrp``: PyVRP (HGS) against the paper's ``hgs_`` references for CVRP and VRPTW (first K instances):
  mean gap in percent.

Results go to ``--out_dir`` as JSON (updated after every variant, so a partial run keeps what it did),
solution pickles (paper format) and a markdown table; ``--report_only`` rebuilds the markdown from the
JSON.

    python benchmarks/baselines_vs_paper.py --part=ortools --num_instances=20 --time_limit=20 --workers=2
    python benchmarks/baselines_vs_paper.py --part=pyvrp --num_instances=50 --time_limit=5 --workers=2
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(os.path.dirname(REPO), "shared", "data", "mvmoe-paper")
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results")


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _paper(data_dir, var, size, solver, k, inst):
    """Mean cost and env-feasibility of a paper solution file on the first k instances (None if absent)."""
    from mvmoe_jax import checker, io
    from mvmoe_jax.baselines import common

    path = io.reference_solution_path(data_dir, var, size, solver)
    if not os.path.exists(path):
        return None
    costs, routes = io.load_paper_solutions(path, num_instances=k)
    checks = checker.check_routes(inst, routes)
    probs = common.problems_from_instances(inst)
    reordered = [common.flatten_tours(common.order_tours(p, checker.split_subtours(r)))
                 for p, r in zip(probs, routes)]
    checks_re = checker.check_routes(inst, reordered)
    violations: dict[str, int] = {}
    for c in checks:
        if not c.feasible:
            violations[c.violation] = violations.get(c.violation, 0) + 1
    return {"file": os.path.basename(path), "mean": float(np.mean(costs)), "costs": costs.tolist(),
            "feasible": int(sum(c.feasible for c in checks)),
            "feasible_mask": [bool(c.feasible) for c in checks],
            "feasible_reordered": int(sum(c.feasible for c in checks_re)),
            "first_violations": violations,
            "checker_cost_max_rel_err": float(max(abs(c.cost - s) / s for c, s in zip(checks, costs)))}


def run_ortools(args, results: dict, json_path: str) -> None:
    from mvmoe_jax import baselines, io, problems

    part = results.setdefault("ortools", {"config": {
        "num_instances": args.num_instances, "time_limit": args.time_limit, "workers": args.workers,
        "size": args.size}, "variants": {}})
    for var in problems.parse_variants(args.variants):
        if var.name in part["variants"] and not args.redo:
            print(f"{var.name}: already done, skipping", flush=True)
            continue
        inst = io.load_paper_instances(io.dataset_path(args.data_dir, var, args.size), var,
                                       num_instances=args.num_instances)
        k = int(inst.locs.shape[0])
        load_before = load_average()
        t0 = time.perf_counter()
        sols = baselines.solve(inst, "ortools", time_limit=args.time_limit, workers=args.workers,
                               progress=args.progress, check=True)
        wall = time.perf_counter() - t0
        sols.save(os.path.join(args.out_dir, f"ortools{args.time_limit:g}s_{var.lower}{args.size}_first{k}.pkl"))
        row = {"k": k, "mean": sols.mean, "costs": sols.costs.tolist(), "seconds": sols.seconds.tolist(),
               "wall_seconds": wall, "feasible": int(sum(c.feasible for c in sols.checks)),
               "checker_cost_max_rel_err": float(max(abs(c.cost - s) / c.cost
                                                     for c, s in zip(sols.checks, sols.costs))),
               "load_before": load_before, "load_after": load_average()}
        for solver in ("or_tools_20s", "or_tools_200s"):
            row[solver] = _paper(args.data_dir, var, args.size, solver, k, inst)
        part["variants"][var.name] = row
        _save(results, json_path)
        p20, p200 = row["or_tools_20s"], row["or_tools_200s"]
        print(f"{var.name:9s} ours {sols.mean:.4f} ({row['feasible']}/{k} feasible) | paper 20s "
              f"{p20['mean'] if p20 else float('nan'):.4f} ({p20['feasible'] if p20 else '-'}/{k}) | paper 200s "
              f"{p200['mean'] if p200 else float('nan'):.4f} ({p200['feasible'] if p200 else '-'}/{k}) | "
              f"{wall:.0f}s wall, load {row['load_after']}", flush=True)


def run_pyvrp(args, results: dict, json_path: str) -> None:
    from mvmoe_jax import baselines, io, problems

    part = results.setdefault(f"pyvrp_{args.time_limit:g}s", {"config": {
        "num_instances": args.num_instances, "time_limit": args.time_limit, "workers": args.workers,
        "size": args.size}, "variants": {}})
    names = ["CVRP", "VRPTW"] if args.variants.upper() == "ALL" else [
        v.name for v in problems.parse_variants(args.variants)]
    for name in names:
        var = problems.get_variant(name)
        inst = io.load_paper_instances(io.dataset_path(args.data_dir, var, args.size), var,
                                       num_instances=args.num_instances)
        k = int(inst.locs.shape[0])
        load_before = load_average()
        t0 = time.perf_counter()
        sols = baselines.solve(inst, "pyvrp", time_limit=args.time_limit, workers=args.workers,
                               progress=args.progress, check=True, seed=args.seed)
        wall = time.perf_counter() - t0
        sols.save(os.path.join(args.out_dir, f"pyvrp{args.time_limit:g}s_{var.lower}{args.size}_first{k}.pkl"))
        row = {"k": k, "mean": sols.mean, "costs": sols.costs.tolist(), "seconds": sols.seconds.tolist(),
               "wall_seconds": wall, "feasible": int(sum(c.feasible for c in sols.checks)),
               "load_before": load_before, "load_after": load_average()}
        for solver in ("hgs", "hgs_pyvrp"):
            ref = _paper(args.data_dir, var, args.size, solver, k, inst)
            if ref is not None:
                gaps = (sols.costs - np.asarray(ref["costs"])) / np.asarray(ref["costs"]) * 100
                ok = np.asarray(ref["feasible_mask"])
                ref.update(gap_percent=float(gaps.mean()), gap_max=float(gaps.max()),
                           better=int((gaps < -1e-6).sum()), worse=int((gaps > 1e-6).sum()),
                           gap_percent_feasible_ref=float(gaps[ok].mean()) if ok.any() else None,
                           gaps=gaps.tolist())
            row[solver] = ref
        part["variants"][var.name] = row
        _save(results, json_path)
        h = row["hgs"]
        print(f"{var.name:6s} pyvrp {sols.mean:.5f} hgs {h['mean']:.5f} gap {h['gap_percent']:.4f}% "
              f"(max {h['gap_max']:.3f}%, better {h['better']}, worse {h['worse']}) {wall:.0f}s wall", flush=True)


def _save(results: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def _f(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


NOTES_ORTOOLS = """Reading the table. Without backhauls both runs solve the same problem with the same search
(parallel cheapest insertion + guided local search) and budget, so the means agree within the noise of a
20 s run on a shared machine (the load column is the 1-minute load average on 2 cores, which our two
workers shared with other jobs: a loaded run costs roughly 1-2 % in objective). With backhauls they do not solve the same problem. In our environment a vehicle leaves
the depot full (load 1) while any linehaul is unserved, so on every route the amount picked up so far
can never exceed the amount delivered so far (net = delivered - picked up stays in [0, 1]), a route can
never open with a backhaul, and routes of backhauls only (leaving empty) must come after every linehaul.
Every route of the paper's OR-Tools B files instead fits "net range <= capacity", i.e. the vehicle may
leave with any load, which admits routes that open with backhauls or pick up more than they delivered:
most of them fail our checker with `backhaul_overload`, and reordering sub-tours does not repair them.
Their problem is a relaxation of ours, so our objective is higher, most of all with time windows, where
a backhaul whose window is early can no longer start a route. Control: the same OR-Tools search on the
paper's looser model (`ortools_solver.solve_problem(..., free_start_load=True)`, diagnostics only)
reproduces the paper's 20 s means (first 6 instances, 20 s: VRPB 7.322 vs the paper's 7.319, VRPBTW
13.806 vs 13.723), so the gap in the B rows is the semantics, not the search."""


def markdown(results: dict) -> str:
    lines = [f"# Reference solvers vs the paper's stored solutions (n = 50)", ""]
    meta = results.get("meta", {})
    if meta:
        lines += [f"Machine: {meta.get('machine', '?')}; ortools {meta.get('ortools', '?')}, "
                  f"pyvrp {meta.get('pyvrp', '?')}.", ""]
    o = results.get("ortools")
    if o:
        c = o["config"]
        lines += [f"## OR-Tools, {c['time_limit']:g} s per instance, first {c['num_instances']} instances, "
                  f"{c['workers']} workers", "",
                  "`paper feasible` counts the paper's routes our environment accepts as stored "
                  "(in brackets: after moving backhaul-only sub-tours last). Means are over the same instances.",
                  "",
                  f"| variant | ours ({c['time_limit']:g} s) mean | paper or_tools_20s mean | paper or_tools_200s mean | ours vs 200s | "
                  "paper 20s feasible | paper 200s feasible | ours feasible | load (1 min) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, r in o["variants"].items():
            p20, p200 = r.get("or_tools_20s"), r.get("or_tools_200s")
            gap = None if not p200 else (r["mean"] - p200["mean"]) / p200["mean"] * 100
            feas = lambda p: "-" if not p else f"{p['feasible']}/{r['k']} ({p['feasible_reordered']})"
            lines.append(f"| {name} | {r['mean']:.4f} | {_f(p20 and p20['mean'])} | {_f(p200 and p200['mean'])} | "
                         f"{_f(gap, '+.2f')}% | {feas(p20)} | {feas(p200)} | {r['feasible']}/{r['k']} | "
                         f"{r['load_after'][0] if r.get('load_after') else '-'} |")
        lines += ["", NOTES_ORTOOLS, ""]
    pkeys = sorted((k for k in results if k.startswith("pyvrp")), key=lambda k: results[k]["config"]["time_limit"])
    if pkeys:
        lines += ["## PyVRP (HGS) against the paper's `hgs_` references", "",
                  "`gap, feasible refs` is the mean gap over the instances whose reference route our environment "
                  "accepts; `paper hgs_pyvrp gap` is the paper's own PyVRP run against the same `hgs_` file.", "",
                  "| variant | time / instance | PyVRP mean | paper hgs mean | mean gap | gap, feasible refs | max gap | "
                  "better / worse | paper hgs feasible | PyVRP feasible | paper hgs_pyvrp gap | load (1 min) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for key in pkeys:
            c = results[key]["config"]
            for name, r in results[key]["variants"].items():
                h, hp = r["hgs"], r.get("hgs_pyvrp")
                hp_gap = None if not hp else (hp["mean"] - h["mean"]) / h["mean"] * 100
                lines.append(f"| {name} | {c['time_limit']:g} s | {r['mean']:.5f} | {h['mean']:.5f} | "
                             f"{h['gap_percent']:+.4f}% | {_f(h.get('gap_percent_feasible_ref'), '+.4f')}% | "
                             f"{h['gap_max']:+.3f}% | {h['better']} / {h['worse']} | {h['feasible']}/{r['k']} | "
                             f"{r['feasible']}/{r['k']} | {_f(hp_gap, '+.4f')}% | "
                             f"{r['load_after'][0] if r.get('load_after') else '-'} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["ortools", "pyvrp"], default="ortools")
    ap.add_argument("--data_dir", default=DEFAULT_DATA)
    ap.add_argument("--size", type=int, default=50)
    ap.add_argument("--variants", default="ALL")
    ap.add_argument("--num_instances", type=int, default=None, help="default 20 (ortools) / 50 (pyvrp)")
    ap.add_argument("--time_limit", type=float, default=None, help="default 20 (ortools) / 5 (pyvrp)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out_dir", default=DEFAULT_OUT)
    ap.add_argument("--name", default="baselines_vs_paper", help="stem of the JSON / markdown files")
    ap.add_argument("--redo", action="store_true", help="re-solve variants already in the JSON")
    ap.add_argument("--report_only", action="store_true")
    ap.add_argument("--no_progress", dest="progress", action="store_false")
    args = ap.parse_args()
    if args.num_instances is None:
        args.num_instances = 20 if args.part == "ortools" else 50
    if args.time_limit is None:
        args.time_limit = 20.0 if args.part == "ortools" else 5.0
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, f"{args.name}.json")
    md_path = os.path.join(args.out_dir, f"{args.name}.md")
    results = {}
    if os.path.exists(json_path):
        with open(json_path) as f:
            results = json.load(f)
    if not args.report_only:
        import importlib.metadata as md

        results["meta"] = {"machine": f"{machine.cpu_model()}, {os.cpu_count()} CPUs",
                           "ortools": md.version("ortools"), "pyvrp": md.version("pyvrp")}
        if args.part == "ortools":
            run_ortools(args, results, json_path)
        else:
            run_pyvrp(args, results, json_path)
        _save(results, json_path)
    with open(md_path, "w") as f:
        f.write(markdown(results))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
