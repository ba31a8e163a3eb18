"""Beyond the training size: time, memory and quality of greedy x8 on generated instances of n = 200, 500
and 1,000, with the decoding plan that the memory available allowed (all POMO starts or fewer, chunks).

Each size and variant is a batch of K generated instances (the paper's generator; capacities 70, 100 and 150),
solved by ``mvmoe_jax.solve`` with its default memory budget (half the free memory on a CPU). Every route is
replayed by the checker. With ``--reference_seconds`` > 0 PyVRP solves the same instances, one process per
core with that many seconds each, and the gap to it is reported.

    python benchmarks/large_instances.py --checkpoint=mvmoe_4e_n50 --sizes=200,500,1000 --num_instances=4

Memory is the decoding program's own size as XLA compiled it (``plan bytes``) and the process's peak resident
memory after the size (sizes run in increasing order, so each peak covers its size). JSON and markdown go to
``--output``. CVRPLIB Set-X by size group is in ``benchmarks/paper_tables.py --sections=setx``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import sys
import time

import numpy as np

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def policy_row(cfg, params, batch, *, max_starts: int | None, memory_budget: int | None, seed: int) -> tuple[dict, np.ndarray]:
    """Greedy x8 on ``batch``: the report row and the per-instance costs (unit square)."""
    import jax

    from mvmoe_jax import checker, precision
    from mvmoe_jax.solve.search import Decoder, Settings, greedy_search

    k = int(batch.locs.shape[0])
    with precision.matmul_precision(precision.EVAL_DEFAULT):
        decoder = Decoder(cfg, params, Settings(max_starts=max_starts, memory_budget=memory_budget))
        res = greedy_search(decoder, batch, jax.random.key(seed), k)
    checks = checker.check_routes(batch, [checker.actions_to_route(a) for a in res.actions])
    plan = res.plans["greedy"]
    costs = np.asarray(res.cost, np.float64)
    # The checker recomputes each cost from the routes; a disagreement would be a wrong reported cost.
    recomputed = np.array([c.cost for c in checks], np.float64)
    return ({"instances": k, "mean_cost": float(costs.mean()), "feasible": int(sum(c.feasible for c in checks)),
             "cost_agrees": bool(np.allclose(costs, recomputed, rtol=1e-4)),
             "seconds_per_instance": res.seconds / k, "compile_seconds": res.compile_seconds,
             "plan": plan.describe(), "starts": plan.starts, "chunk": plan.chunk, "rows": plan.rows,
             "plan_bytes": plan.memory_bytes, "budget_bytes": plan.budget}, costs)


def reference_row(batch, seconds: float, workers: int) -> tuple[dict, np.ndarray]:
    """PyVRP on ``batch`` with ``seconds`` per instance: the row and per-instance costs (unit square)."""
    from mvmoe_jax import baselines

    sols = baselines.solve(batch, solver="pyvrp", time_limit=seconds, workers=workers, progress=False)
    return {"solver": "pyvrp", "seconds_per_instance": seconds, "mean_cost": float(np.mean(sols.costs))}, \
        np.asarray(sols.costs, np.float64)


def markdown(report: dict) -> str:
    lines = [f"Machine: {report['machine']}; commit {report['commit']}; {report['date']}; model "
             f"{report['checkpoint']}; {report['num_instances']} generated instances per size and variant; greedy "
             f"x8.", "",
             "| n | variant | decoding plan | s/inst | compile s | plan MiB | peak RSS MiB | mean cost | gap % to PyVRP "
             "| feasible |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        gap = "-" if r.get("gap") is None else f"{r['gap']:.2f} ({r['reference']['seconds_per_instance']:g} s)"
        lines.append(f"| {r['n']} | {r['variant']} | {r['plan']} | {r['seconds_per_instance']:.1f} | "
                     f"{r['compile_seconds']:.1f} | {r['plan_bytes'] / 2**20:.0f} | {r['peak_rss_bytes'] / 2**20:.0f} | "
                     f"{r['mean_cost']:.3f} | {gap} | {r['feasible']}/{r['instances']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="shipped name or checkpoint path")
    p.add_argument("--sizes", default="200,500,1000")
    p.add_argument("--variants", default="CVRP,VRPTW")
    p.add_argument("--num_instances", type=int, default=4)
    p.add_argument("--max_starts", type=int, default=None, help="at most this many POMO starts (default: all "
                   "that fit in memory)")
    p.add_argument("--memory_budget_gib", type=float, default=None, help="bytes a decoding program may take, in "
                   "GiB (default: half the free memory on a CPU, what the device has free otherwise)")
    p.add_argument("--reference_seconds", type=float, default=0.0, help="PyVRP seconds per instance for the gap "
                   "(0: no reference)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="PyVRP processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON path (markdown beside it); default "
                   "benchmarks/results/large_instances_<date>.json")
    args = p.parse_args(argv)

    import jax

    from mvmoe_jax import checkpoints, instances, problems
    from mvmoe_jax.evaluation import gap_percent

    sizes = sorted(int(s) for s in args.sizes.split(",") if s)
    variants = [v.name for v in problems.parse_variants(args.variants)]
    for n in sizes:
        if n not in instances.CAPACITY_BY_SIZE:
            raise SystemExit(f"size {n} has no defined capacity; choose from {sorted(instances.CAPACITY_BY_SIZE)}")
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * 2**30)
    cfg, params = checkpoints.load_policy(args.checkpoint)
    report = {"machine": machine.jax_device(), "commit": machine.repository_commit(),
              "date": datetime.date.today().isoformat(), "checkpoint": args.checkpoint,
              "num_instances": args.num_instances, "rows": []}
    output = args.output or machine.default_output("large_instances")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    for n in sizes:
        for i, variant in enumerate(variants):
            batch = instances.generate(jax.random.key(1000 * n + i), args.num_instances, n, variant)
            t0 = time.perf_counter()
            row, costs = policy_row(cfg, params, batch, max_starts=args.max_starts, memory_budget=budget,
                                    seed=args.seed)
            row.update(n=n, variant=variant, wall_seconds=time.perf_counter() - t0, peak_rss_bytes=peak_rss_bytes(),
                       gap=None)
            if args.reference_seconds > 0:
                row["reference"], ref = reference_row(batch, args.reference_seconds, args.workers)
                row["gap"] = gap_percent(costs, ref)
            print(f"n={n} {variant}: {row['plan']}; {row['seconds_per_instance']:.1f} s/inst, "
                  f"peak {row['peak_rss_bytes'] / 2**30:.2f} GiB, {row['feasible']}/{row['instances']} feasible",
                  flush=True)
            report["rows"].append(row)
    machine.write_report(report, output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
