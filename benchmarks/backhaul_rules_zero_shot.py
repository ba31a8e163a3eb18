"""Zero-shot under each backhaul rule: a model (trained under the paper's rule, or fine-tuned under others),
greedy x8, on generated instances under the paper, classic and mixed rules, against OR-Tools' exact model of each
rule.

For each rule and variant, ``--num_instances`` generated instances of size ``--n`` (``instances.generate(...,
backhaul_rule=)``; the generator does not redraw for the classic rule's order, so draws where some backhaul has no
linehaul to follow are replaced by further draws). Greedy x8 from every POMO start (``mvmoe_jax.solve``), and
OR-Tools for ``--ortools_seconds`` per instance, one process. The report is rewritten after every row. Every route of both is replayed by the checker under
the instance's rule. The gap is greedy's cost over OR-Tools' minus one, in percent, averaged over the instances
both solved (a classic greedy rollout can dead-end: it then counts as unsolved).

    python benchmarks/backhaul_rules_zero_shot.py --num_instances=64 --ortools_seconds=2

``--ortools_from=REPORT`` reuses an earlier report's OR-Tools costs (the same instances), so that two models are
compared on the same references.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

VARIANTS = ("VRPB", "VRPBTW", "OVRPB", "VRPBLTW")
RULES = ("paper", "classic", "mixed")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="mvmoe_4e_n50", help="the model (a shipped name or a path)")
    p.add_argument("--n", type=int, default=50, help="customers per instance")
    p.add_argument("--num_instances", type=int, default=64, help="instances per rule and variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants with backhauls")
    p.add_argument("--rules", default=",".join(RULES), help="comma-separated backhaul rules")
    p.add_argument("--ortools_seconds", type=float, default=2.0, help="OR-Tools' time per instance")
    p.add_argument("--trained_rules", default="paper", help="the rules the model was trained under, for the report "
                   "(a fine-tuned model: its train_backhaul_rules)")
    p.add_argument("--ortools_from", default=None, help="a report of this script whose OR-Tools costs to reuse for "
                   "the same rows, instance counts, seed and seconds (to compare models on the same references)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="report JSON (markdown beside it); default benchmarks/results/")
    return p


def servable_batch(variant: str, rule: str, n: int, count: int, seed: int):
    """``count`` generated instances under ``rule`` in which the checker finds every customer servable (draws
    where one is not are skipped), and how many draws that took."""
    import jax

    from mvmoe_jax import checker, instances, problems

    kept, drawn, block = [], 0, 0
    while sum(int(b.locs.shape[0]) for b in kept) < count:
        if drawn >= 20 * count:
            raise SystemExit(f"{variant} under the {rule} rule: fewer than {count} servable instances in {drawn} draws")
        key = jax.random.key(1_000_000 * seed + 1000 * problems.VARIANT_NAMES.index(variant) + block)
        batch = instances.generate(key, count, n, variant, backhaul_rule=rule)
        ok = np.flatnonzero(~np.asarray(checker.unreachable_customers(batch)).any(1))
        kept.append(jax.tree.map(lambda x: x[ok], batch))
        drawn += count
        block += 1
    batch = jax.tree.map(lambda *xs: np.concatenate(xs)[:count], *kept)
    return jax.tree.map(jax.numpy.asarray, batch), drawn


def greedy(cfg, params, batch):
    """Greedy x8: (costs float64 (K,), inf where no rollout finished or the checker refuses, seconds)."""
    from mvmoe_jax import solve

    sols = solve.solve_instances(cfg, params, batch, search="greedy")
    costs = np.array([s.cost if s.feasible else np.inf for s in sols], np.float64)
    return costs, float(sum(s.seconds for s in sols))


def ortools(batch, seconds: float):
    """OR-Tools per instance: costs float64 (K,) (inf where it found no solution), each route checked."""
    from mvmoe_jax import checker
    from mvmoe_jax.baselines import common, ortools_solver

    costs, routes = [], []
    for p in common.problems_from_instances(batch):
        try:
            res = ortools_solver.solve_problem(p, time_limit=seconds)
        except common.InfeasibleInstanceError:
            costs.append(np.inf)
            routes.append([])
            continue
        costs.append(res.cost)
        routes.append(res.route)
    costs = np.array(costs, np.float64)
    found = np.flatnonzero(np.isfinite(costs))
    if found.size:
        import jax
        sub = jax.tree.map(lambda x: x[found], batch)
        checker.verify_routes(sub, [routes[i] for i in found], costs[found], source="OR-Tools",
                              error=common.InfeasibleSolutionError)
    return costs


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"# Zero-shot under each backhaul rule, n = {s['n']}, {report['date']}", "",
             f"Machine: {report['machine']}; commit {report['commit']}. Model `{s['checkpoint']}` (trained under the "
             f"{', '.join(s.get('trained_rules', ['paper']))} rule(s)), greedy x8; OR-Tools {s['ortools_seconds']:g} s "
             f"per instance; {s['num_instances']} "
             "generated instances per row. Gap: greedy over OR-Tools, mean over the instances both solved; "
             "solved: finished and accepted by the checker under the instance's rule.", "",
             "| rule | variant | greedy mean | OR-Tools mean | gap % | greedy solved | OR-Tools solved | greedy s/inst |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        gap = "-" if r["gap"] is None else f"{r['gap']:.2f}"
        lines.append(f"| {r['rule']} | {r['variant']} | {r['greedy_mean']:.4f} | {r['ortools_mean']:.4f} | {gap} | "
                     f"{r['greedy_solved']}/{r['instances']} | {r['ortools_solved']}/{r['instances']} | "
                     f"{r['greedy_seconds_per_instance']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from mvmoe_jax import checkpoints, problems

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    try:
        for v in variants:
            if not problems.get_variant(v).backhaul:
                raise ValueError(f"{v} has no backhauls: the rules do not apply")
        rules = [problems.backhaul_rule_name(r) for r in rules]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.num_instances < 1 or not args.ortools_seconds > 0:
        raise SystemExit("--num_instances and --ortools_seconds must be positive")
    cfg, params = checkpoints.load_policy(args.checkpoint)
    output = args.output or machine.default_output("backhaul_rules_zero_shot")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    report = {"date": datetime.date.today().isoformat(), "machine": machine.jax_device(),
              "commit": machine.repository_commit(),
              "settings": {"checkpoint": args.checkpoint, "n": args.n, "num_instances": args.num_instances,
                           "ortools_seconds": args.ortools_seconds, "seed": args.seed,
                           "trained_rules": [r.strip() for r in args.trained_rules.split(",") if r.strip()],
                           "ortools_from": args.ortools_from},
              "rows": []}
    known = {}
    if args.ortools_from:
        with open(args.ortools_from) as f:
            earlier = json.load(f)
        same = {k: earlier["settings"].get(k) for k in ("n", "num_instances", "ortools_seconds", "seed")}
        if same != {k: report["settings"][k] for k in same}:
            raise SystemExit(f"--ortools_from {args.ortools_from}: its settings {same} differ from this run's")
        known = {(r["rule"], r["variant"]): r["ortools_costs"] for r in earlier["rows"]}
    rows = []
    for rule in rules:
        for variant in variants:
            batch, drawn = servable_batch(variant, rule, args.n, args.num_instances, args.seed)
            g, g_seconds = greedy(cfg, params, batch)
            if (rule, variant) in known:
                o = np.array([np.inf if c is None else c for c in known[rule, variant]], np.float64)
            else:
                o = ortools(batch, args.ortools_seconds)
            both = np.isfinite(g) & np.isfinite(o)
            row = {"rule": rule, "variant": variant, "instances": args.num_instances, "drawn": drawn,
                   "greedy_solved": int(np.isfinite(g).sum()), "ortools_solved": int(np.isfinite(o).sum()),
                   "greedy_mean": float(g[both].mean()) if both.any() else float("nan"),
                   "ortools_mean": float(o[both].mean()) if both.any() else float("nan"),
                   "gap": float(((g[both] - o[both]) / o[both]).mean() * 100) if both.any() else None,
                   "greedy_seconds_per_instance": g_seconds / args.num_instances,
                   "load": round(os.getloadavg()[0], 2),
                   "greedy_costs": [c if np.isfinite(c) else None for c in g.tolist()],
                   "ortools_costs": [c if np.isfinite(c) else None for c in o.tolist()]}
            rows.append(row)
            report["rows"] = rows
            machine.write_report(report, output, markdown(report))
            gap = "-" if row["gap"] is None else f"{row['gap']:.2f}%"
            print(f"{rule:>7} {variant:<8} greedy {row['greedy_mean']:.4f} OR-Tools {row['ortools_mean']:.4f} gap {gap} "
                  f"solved {row['greedy_solved']}/{row['ortools_solved']} of {args.num_instances} "
                  f"(load {row['load']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
