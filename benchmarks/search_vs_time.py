"""Quality against time: greedy x8, sampling, EAS, SGBS and SGBS + EAS under several time limits, beside PyVRP and
OR-Tools given the same wall time on the same machine, on the first K instances of the paper's n = 50 test sets.

Every method solves the same K instances of a variant and gets the same wall time for the whole set: the
policy's searches run batched on all of the machine's cores with ``time_limit`` seconds per instance; the
reference solvers run one process per core (``--workers``, default all cores), each instance given
``time_limit x workers`` seconds, so that K instances take K x time_limit seconds of wall time in both.
Gaps are to the paper's reference solutions (HGS for CVRP and VRPTW, OR-Tools 200 s otherwise), averaged
per instance as the paper does. Compilation is excluded from the policy's seconds and reported apart.

    python benchmarks/search_vs_time.py --checkpoint=mvmoe_4e_n50 --num_instances=100 --time_limits=0.5,2,8

``--methods`` picks the policy's searches and ``--solvers`` the reference solvers, so that a run over every variant
at one limit can compare EAS with OR-Tools alone, or the searches on a few instances at one limit:

    python benchmarks/search_vs_time.py --checkpoint=mvmoe_4e_n50 --variants=ALL --time_limits=2 \
        --methods=greedy,eas --solvers=ortools --output=all_variants_2s.json
    python benchmarks/search_vs_time.py --checkpoint=mvmoe_4e_n50 --variants=CVRP,VRPTW --num_instances=20 \
        --time_limits=2 --methods=greedy,eas,sgbs,sgbs_eas --output=searches_2s.json

``--improve`` adds, for each of the policy's runs, the same routes improved afterwards: ``ls`` by the local search
(``mvmoe_jax.local_search``, as ``--improve=ls`` of ``mvmoe_jax.solve``), ``ortools_ls`` by OR-Tools' own local
search from them (greedy descent to its local optimum, one process, the paper's backhaul rule); their rows count
the search's and the improvement's seconds:

    python benchmarks/search_vs_time.py --checkpoint=mvmoe_4e_n50 --variants=CVRP,VRPTW,OVRP,VRPBLTW \
        --num_instances=20 --methods=greedy --improve=none,ls,ortools_ls --solvers=ortools --time_limits=0.25,1

JSON, markdown and a PNG (gap against seconds per instance, one panel per variant) go to ``--output``, the
JSON after every variant. Each variant is measured in one go on one machine, and its entry names the machine
and commit; ``--resume`` continues the report at ``--output``, measuring only the variants it lacks (the run's
settings must be the report's).
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
from mvmoe_jax.training_validation import save_figure  # noqa: E402  (the repository root is on the path now)

DEFAULT_DATA = os.path.join(os.path.dirname(REPO), "shared", "data", "mvmoe-paper")
# Two trained variants, the hardest unseen one, and an unseen one without time windows.
DEFAULT_VARIANTS = "CVRP,VRPTW,OVRPBLTW,VRPBL"


def _row(method: str, time_limit: float | None, costs: np.ndarray, reference: np.ndarray, seconds: float,
         feasible: int, **extra) -> dict:
    from mvmoe_jax.evaluation import gap_percent

    return {"method": method, "time_limit": time_limit, "mean_cost": float(np.mean(costs)),
            "gap": gap_percent(costs, reference), "seconds_per_instance": seconds / len(costs),
            "feasible": feasible, "instances": len(costs), **extra}


# The policy's searches, in the order they run.
POLICY_METHODS = ("greedy", "sampling", "eas", "sgbs", "sgbs_eas")
# Those a run measures unless told: the report's first searches, so that an earlier report resumes as it was made.
DEFAULT_METHODS = "greedy,sampling,eas"
# What may improve a search's routes afterwards (``none``: the search's own row).
IMPROVEMENTS = ("none", "ls", "ortools_ls")


def improved_routes(batch, routes, improvement: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Each instance's routes (lists of customers) improved by ``improvement``: (costs float64 (K,), seconds (K,),
    how many the checker accepts)."""
    import jax

    from mvmoe_jax import checker, local_search
    from mvmoe_jax.baselines import ortools_solver

    flat = [[v for t in r for v in (*t, 0)][:-1] for r in routes]
    if improvement == "ls":
        costs, seconds, out = [], [], []
        for i, r in enumerate(routes):
            found = local_search.improve_instance(jax.tree.map(lambda x: x[i], batch), r)
            costs.append(found.cost)
            seconds.append(found.seconds)
            out.append([v for t in found.routes for v in (*t, 0)][:-1])
    elif improvement == "ortools_ls":
        sols = ortools_solver.improve(batch, flat, time_limit=600.0, check=False)
        costs, seconds, out = sols.costs, sols.seconds, sols.routes
    else:
        raise ValueError(f"unknown improvement {improvement!r}; choose from {', '.join(IMPROVEMENTS)}")
    feasible = sum(c.feasible for c in checker.check_routes(batch, out))
    return np.asarray(costs, np.float64), np.asarray(seconds, np.float64), feasible


def policy_rows(cfg, params, batch, reference: np.ndarray, time_limits, seed: int,
                methods=POLICY_METHODS, improve=("none",)) -> list[dict]:
    """Greedy x8 once, then sampling, EAS, SGBS and SGBS + EAS at each time limit (seconds per instance), those of
    them in ``methods``, a search's row with its mean rounds (and SGBS's depths) per instance; each followed by the
    rows of its routes improved by each of ``improve`` but ``none``."""
    from mvmoe_jax.solve import solve_instances

    rows = []
    runs = [("greedy x8", None)] if "greedy" in methods else []
    runs += [(s, t) for t in time_limits for s in POLICY_METHODS[1:] if s in methods]
    for method, limit in runs:
        search = method.split()[0]
        t0 = time.perf_counter()
        sols = solve_instances(cfg, params, batch, search=search, seed=seed,
                               **({} if limit is None else {"time_limit": limit}))
        wall = time.perf_counter() - t0
        seconds = float(sum(s.seconds for s in sols))
        rows.append(_row(method, limit, np.array([s.cost for s in sols]), reference, seconds,
                         sum(s.feasible for s in sols), wall_seconds=wall, compile_seconds=max(wall - seconds, 0.0),
                         rounds=int(np.mean([s.rounds for s in sols])),
                         **({"samples": sorted({s.samples for s in sols})} if search == "sampling" else {}),
                         **({"depths": float(np.mean([s.depths for s in sols]))} if search.startswith("sgbs") else {})))
        print(f"  {method:10s} {limit or '':>5}  gap {rows[-1]['gap']:6.2f}%  {rows[-1]['seconds_per_instance']:.2f} s/inst",
              flush=True)
        for improvement in improve:
            if improvement == "none":
                continue
            costs, improve_s, feasible = improved_routes(batch, [s.routes for s in sols], improvement)
            rows.append(_row(f"{method} + {improvement}", limit, costs, reference, seconds + float(improve_s.sum()),
                             feasible, improve_seconds_per_instance=float(improve_s.mean()),
                             improve_seconds_max=float(improve_s.max())))
            print(f"  {rows[-1]['method']:10s} {limit or '':>5}  gap {rows[-1]['gap']:6.2f}%  "
                  f"{rows[-1]['seconds_per_instance']:.2f} s/inst (improvement {improve_s.mean():.3f})", flush=True)
    return rows


def baseline_rows(batch, variant: str, reference: np.ndarray, time_limits, workers: int, solvers) -> list[dict]:
    """Each reference solver that models ``variant`` exactly, at each time limit (same wall time per set)."""
    from mvmoe_jax import baselines

    rows = []
    for solver in solvers:
        if variant not in baselines.supported_variants(solver):
            continue
        for limit in time_limits:
            t0 = time.perf_counter()
            sols = baselines.solve(batch, solver=solver, time_limit=limit * workers, workers=workers, progress=False)
            wall = time.perf_counter() - t0
            # The solvers' own seconds spread over the workers: the wall time they used, without the
            # start-up of the worker processes (reported apart as wall_seconds).
            used = float(np.sum(sols.seconds)) / workers
            rows.append(_row(solver, limit, sols.costs, reference, used, len(sols.costs), wall_seconds=wall))
            print(f"  {solver:10s} {limit:>5}  gap {rows[-1]['gap']:6.2f}%  {rows[-1]['seconds_per_instance']:.2f} s/inst",
                  flush=True)
    return rows


# What a resumed run must share with the report it continues.
SETTINGS = ("checkpoint", "num_instances", "time_limits", "methods", "solvers", "workers", "seed", "improve")
# Settings that older reports lack, as they were measured.
SETTING_DEFAULTS = {"improve": ["none"]}


def markdown(report: dict) -> str:
    lines = [f"Model {report['checkpoint']}; first {report['num_instances']} instances of each n = 50 set; "
             f"reference solvers in {report['workers']} processes.", ""]
    variants_by_run = {}
    for variant, entry in report["variants"].items():
        variants_by_run.setdefault((entry["machine"], entry["commit"], entry["date"]), []).append(variant)
    for (machine_name, commit, date), names in sorted(variants_by_run.items()):
        lines.append(f"- {', '.join(names)}: {machine_name}; commit {commit}; {date}")
    loads = {v: e["load_average"] for v, e in report["variants"].items() if "load_average" in e}
    if loads:
        lines.append("- 1-minute load average as each variant ended (a shared machine): "
                     + ", ".join(f"{v} {x:g}" for v, x in loads.items()))
    lines += ["", "| variant | method | time limit (s/inst) | gap % | s/inst | of which improvement | feasible "
              "| rounds (SGBS: depths) |",
              "|---|---|---|---|---|---|---|---|"]
    for variant, entry in report["variants"].items():
        for r in entry["rows"]:
            limit = "-" if r["time_limit"] is None else f"{r['time_limit']:g}"
            improvement = (f"{r['improve_seconds_per_instance']:.3f}" if "improve_seconds_per_instance" in r else "-")
            rounds = "-" if r["time_limit"] is None or "rounds" not in r else str(r["rounds"])
            rounds += f" ({r['depths']:.0f})" if "depths" in r else ""
            lines.append(f"| {variant} | {r['method']} | {limit} | {r['gap']:.2f} | {r['seconds_per_instance']:.2f} "
                         f"| {improvement} | {r['feasible']}/{r['instances']} | {rounds} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    variants = list(report["variants"])
    cols = min(len(variants), 4)
    rows_of_panels = -(-len(variants) // cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(4 * cols, 3.6 * rows_of_panels), squeeze=False)
    for ax in axes.flat[len(variants):]:
        ax.set_visible(False)
    # One colour per method across the panels, whichever methods a variant has.
    methods = dict.fromkeys(r["method"] for entry in report["variants"].values() for r in entry["rows"])
    colour = {m: f"C{i}" for i, m in enumerate(methods)}
    for ax, variant in zip(axes.flat, variants):
        rows = report["variants"][variant]["rows"]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["seconds_per_instance"], r["gap"]) for r in rows if r["method"] == method)
            ax.plot(*zip(*pts), marker="o", label=method, color=colour[method])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # a span under a decade labels its minor ticks
        ax.set_title(variant)
        ax.set_xlabel("seconds per instance")
    for ax in axes[:, 0]:
        ax.set_ylabel("gap to the paper's reference (%)")
    return save_figure(fig, axes.flat[:len(variants)], path)


def resumed_report(output: str, settings: dict) -> dict:
    """The report at ``output`` to continue; SystemExit when there is none or it was made with other settings."""
    try:
        with open(output) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--resume: no report to continue at {output} ({e})") from None
    differ = [f"{k}: report {report.get(k, SETTING_DEFAULTS.get(k))!r}, now {settings[k]!r}" for k in SETTINGS
              if report.get(k, SETTING_DEFAULTS.get(k)) != settings[k]]
    if differ:
        raise SystemExit(f"--resume: {output} was measured with other settings ({'; '.join(differ)})")
    print(f"resuming {output}: {', '.join(report['variants']) or 'no variant'} measured already", flush=True)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="shipped name or checkpoint path")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--num_instances", type=int, default=100)
    p.add_argument("--time_limits", default="0.5,2,8", help="comma list of seconds per instance")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list of the policy's searches to run: greedy (x8), sampling, eas, sgbs, sgbs_eas")
    p.add_argument("--improve", default="none", help="comma list: none (the search's routes), ls (then the local "
                   "search), ortools_ls (then OR-Tools' local search); one row each")
    p.add_argument("--solvers", default="pyvrp,ortools", help="reference solvers to run beside the policy")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="reference-solver processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data_dir", default=DEFAULT_DATA)
    p.add_argument("--output", default=None, help="JSON path (markdown and PNG beside it); default "
                   "benchmarks/results/search_vs_time_<date>.json")
    p.add_argument("--resume", action="store_true", help="continue the report at --output: only its missing "
                   "variants are measured")
    args = p.parse_args(argv)

    from mvmoe_jax import checkpoints, io, problems

    settings = {"checkpoint": args.checkpoint, "num_instances": args.num_instances, "workers": args.workers,
                "time_limits": [float(t) for t in args.time_limits.split(",") if t],
                "methods": [m for m in args.methods.split(",") if m],
                "solvers": [s for s in args.solvers.split(",") if s], "seed": args.seed,
                "improve": [m for m in args.improve.split(",") if m]}
    unknown = sorted(set(settings["methods"]) - set(POLICY_METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(unknown)}; the policy's searches are "
                         f"{', '.join(POLICY_METHODS)}")
    unknown = sorted(set(settings["improve"]) - set(IMPROVEMENTS))
    if unknown:
        raise SystemExit(f"--improve: unknown {', '.join(unknown)}; choose from {', '.join(IMPROVEMENTS)}")
    output = args.output or machine.default_output("search_vs_time")
    stem = os.path.splitext(output)[0]
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    report = {**settings, "variants": {}}
    if args.resume:
        report = resumed_report(output, settings)
    variants = [v.name for v in problems.parse_variants(args.variants)]
    todo = [v for v in variants if v not in report["variants"]]
    if todo:
        cfg, params = checkpoints.load_policy(args.checkpoint)
    for variant in todo:
        print(variant, flush=True)
        batch = io.load_paper_instances(io.dataset_path(args.data_dir, variant, 50), variant,
                                        num_instances=args.num_instances)
        reference, _ = io.load_paper_solutions(io.reference_solution_path(args.data_dir, variant, 50),
                                               num_instances=args.num_instances)
        rows = policy_rows(cfg, params, batch, reference, settings["time_limits"], args.seed, settings["methods"],
                           settings["improve"])
        rows += baseline_rows(batch, variant, reference, settings["time_limits"], args.workers, settings["solvers"])
        report["variants"][variant] = {"machine": machine.jax_device(), "commit": machine.repository_commit(),
                                       "date": datetime.date.today().isoformat(), "rows": rows,
                                       "load_average": round(os.getloadavg()[0], 2)}
        with open(output, "w") as f:          # after every variant, so that a partial run keeps what it did
            json.dump(report, f, indent=1)
    report["plot"] = plot(report, stem + ".png")
    machine.write_report(report, output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
