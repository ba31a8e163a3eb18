"""Beyond the training size: time, memory and quality of greedy x8 on generated instances of n = 200, 500
and 1,000, with the decoding plan that the memory available allowed (all POMO starts or fewer, chunks).

Each size and variant is a batch of K generated instances (the paper's generator; capacities 70, 100 and 150),
solved by ``mvmoe_jax.solve`` with its default memory budget (half the free memory on a CPU). Every route is
replayed by the checker. With ``--reference_seconds`` > 0 PyVRP solves the same instances, one process per
core with that many seconds each, and the gap to it is reported.

    python benchmarks/large_instances.py --checkpoint=mvmoe_4e_n50 --sizes=200,500,1000 --num_instances=4

Distance-aware decoding (``mvmoe_jax/nn/locality.py``): ``--decodings=ALPHA:K,...`` solves every size and
variant under each (distance bias alpha, k candidates; ``0:0`` the plain decoder). With ``--choose_on=SIZE``
the options are first chosen per variant on validation instances of that size (other seeds than the reported
ones): the alpha of ``--alphas`` and the k of ``--ks`` with the lowest mean cost, each alone; the reported rows
are then the plain decoder, the chosen alpha, every k, and the chosen alpha with the chosen k.

    python benchmarks/large_instances.py --checkpoint=mvmoe_4e_n50 --sizes=200,500 --choose_on=200 \
        --alphas=0.5,1,2,4 --ks=10,20,50 --reference_seconds=60

With ``--ls_seconds`` > 0 the local search (``mvmoe_jax.local_search``, the solver's ``--improve=ls``) then runs
on each greedy solution for at most that many seconds, and the row also reports its cost, gap and time (the
total time per instance is greedy's plus the local search's):

    python benchmarks/large_instances.py --checkpoint=mvmoe_4e_n50 --sizes=1000 --num_instances=2 \
        --decodings=1:0 --max_starts=200 --ls_seconds=15 --reference_seconds=60

Memory is the decoding program's own size as XLA compiled it (``plan bytes``) and the process's peak resident
memory after the size (sizes run in increasing order, so each peak covers its size). JSON and markdown go to
``--output``. CVRPLIB Set-X by size group is in ``benchmarks/paper_tables.py --sections=setx``.
"""

from __future__ import annotations

import argparse
import datetime
import json
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


def parse_decodings(text: str) -> list[tuple[float, int]]:
    """``"ALPHA:K,ALPHA:K"`` -> [(alpha, k), ...] (``0:0``: the plain decoder)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        alpha, sep, k = item.partition(":")
        try:
            out.append((float(alpha), int(k)))
        except ValueError:
            raise SystemExit(f"--decodings item {item!r}: expected ALPHA:K, e.g. 1.5:20") from None
        if not sep:
            raise SystemExit(f"--decodings item {item!r}: expected ALPHA:K, e.g. 1.5:20")
    return out


def decoding_name(alpha: float, k: int) -> str:
    parts = ([f"bias {alpha:g}"] if alpha else []) + ([f"{k} candidates"] if k else [])
    return ", ".join(parts) or "plain"


def with_decoding(cfg, alpha: float, k: int):
    """``cfg`` decoding with the distance bias alpha and k candidates; a model that learned its bias keeps it (an
    alpha other than 0 given for it stops the run)."""
    import dataclasses

    if cfg.learned_distance_bias:
        if alpha:
            raise SystemExit(f"--decodings: this model learned its distance bias; give ALPHA 0 (got {alpha:g})")
        return dataclasses.replace(cfg, candidates=k)
    return dataclasses.replace(cfg, distance_bias=alpha, candidates=k)


def validation_batch(n: int, variant_index: int, variant: str, count: int):
    """Validation instances of size n: seeds apart from the reported batches' (``1000 n + i``)."""
    import jax

    from mvmoe_jax import instances

    return instances.generate(jax.random.key(7_000_000 + 1000 * n + variant_index), count, n, variant)


def choose_options(cfg, params, n: int, variants: list[str], alphas: list[float], ks: list[int], count: int, *,
                   max_starts, memory_budget, seed: int) -> dict:
    """Per variant, greedy x8 on ``count`` validation instances of size n under the plain decoder, each alpha
    alone and each k alone: {variant: {"rows": [...], "alpha": best alpha, "k": best k}} (lowest mean cost; an
    option that never beats the plain decoder is still chosen, and its rows show by how much it lost)."""
    chosen = {}
    for i, variant in enumerate(variants):
        batch = validation_batch(n, i, variant, count)
        rows = []
        for alpha, k in [(0.0, 0)] + [(a, 0) for a in alphas] + [(0.0, k) for k in ks]:
            row, _ = policy_row(with_decoding(cfg, alpha, k), params, batch, max_starts=max_starts,
                                memory_budget=memory_budget, seed=seed)
            row.pop("routes")
            row.update(distance_bias=alpha, candidates=k)
            rows.append(row)
            print(f"validation n={n} {variant} {decoding_name(alpha, k)}: mean {row['mean_cost']:.4f}, "
                  f"{row['seconds_per_instance']:.1f} s/inst", flush=True)
        best = lambda key: min((r for r in rows if r[key] and not r["distance_bias" if key == "candidates"
                                                                     else "candidates"]),
                               key=lambda r: r["mean_cost"])[key]
        chosen[variant] = {"rows": rows, "alpha": best("distance_bias") if alphas else 0.0,
                           "k": best("candidates") if ks else 0}
    return chosen


def policy_row(cfg, params, batch, *, max_starts: int | None, memory_budget: int | None, seed: int) -> tuple[dict, np.ndarray]:
    """Greedy x8 on ``batch``: the report row (its ``routes`` the best route of each instance, in the paper's flat
    format) and the per-instance costs (unit square)."""
    import jax

    from mvmoe_jax import checker, precision
    from mvmoe_jax.solve.search import Decoder, Settings, greedy_search

    k = int(batch.locs.shape[0])
    with precision.matmul_precision(precision.EVAL_DEFAULT):
        decoder = Decoder(cfg, params, Settings(max_starts=max_starts, memory_budget=memory_budget))
        res = greedy_search(decoder, batch, jax.random.key(seed), k)
    routes = [checker.actions_to_route(a) for a in res.actions]
    checks = checker.check_routes(batch, routes)
    plan = res.plans["greedy"]
    costs = np.asarray(res.cost, np.float64)
    # The checker recomputes each cost from the routes; a disagreement would be a wrong reported cost.
    recomputed = np.array([c.cost for c in checks], np.float64)
    return ({"instances": k, "mean_cost": float(costs.mean()), "feasible": int(sum(c.feasible for c in checks)),
             "routes": routes,
             "cost_agrees": bool(np.allclose(costs, recomputed, rtol=1e-4)),
             "seconds_per_instance": res.seconds / k, "compile_seconds": res.compile_seconds,
             "plan": plan.describe(), "starts": plan.starts, "chunk": plan.chunk, "rows": plan.rows,
             "plan_bytes": plan.memory_bytes, "budget_bytes": plan.budget, "costs": costs.tolist()}, costs)


def local_search_row(batch, routes: list[list[int]], costs: np.ndarray, seconds: float) -> tuple[dict, np.ndarray]:
    """The solver's local search (``solve.api.improve_routes``) for at most ``seconds`` on each instance's
    ``routes`` (the paper's flat format) of cost ``costs``: the row's local-search fields and the per-instance
    costs (unit square), each route replayed by the checker."""
    from mvmoe_jax import checker
    from mvmoe_jax.solve.api import improve_routes

    found, found_costs, times = improve_routes(batch, routes, costs.tolist(), time_limit=seconds)
    checks = checker.check_routes(batch, found)
    found_costs = np.asarray(found_costs, np.float64)
    return {"ls_mean_cost": float(found_costs.mean()), "ls_seconds_per_instance": float(np.mean(times)),
            "ls_limit_seconds": seconds, "ls_feasible": int(sum(c.feasible for c in checks)),
            "ls_cost_agrees": bool(np.allclose(found_costs, [c.cost for c in checks], rtol=1e-4)),
            "ls_costs": found_costs.tolist()}, found_costs


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
             "| n | variant | decoding plan | options | s/inst | compile s | plan MiB | peak RSS MiB | mean cost "
             "| gap % to PyVRP | feasible |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        gap = "-" if r.get("gap") is None else f"{r['gap']:.2f} ({r['reference']['seconds_per_instance']:g} s)"
        options = decoding_name(r.get("distance_bias", 0.0), r.get("candidates", 0))
        lines.append(f"| {r['n']} | {r['variant']} | {r['plan']} | {options} | {r['seconds_per_instance']:.1f} | "
                     f"{r['compile_seconds']:.1f} | {r['plan_bytes'] / 2**20:.0f} | {r['peak_rss_bytes'] / 2**20:.0f} | "
                     f"{r['mean_cost']:.3f} | {gap} | {r['feasible']}/{r['instances']} |")
    with_ls = [r for r in report["rows"] if "ls_mean_cost" in r]
    if with_ls:
        lines += ["", "Greedy x8, then the local search for at most its limit per instance:", "",
                  "| n | variant | options | greedy s/inst | gap % | LS limit s | LS s/inst | total s/inst | gap % after LS "
                  "| feasible |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in with_ls:
            gap, ls_gap = (("-" if r.get(key) is None else f"{r[key]:.2f}") for key in ("gap", "ls_gap"))
            lines.append(f"| {r['n']} | {r['variant']} | {decoding_name(r.get('distance_bias', 0.0), r.get('candidates', 0))} "
                         f"| {r['seconds_per_instance']:.1f} | {gap} | {r['ls_limit_seconds']:g} | "
                         f"{r['ls_seconds_per_instance']:.1f} | "
                         f"{r['seconds_per_instance'] + r['ls_seconds_per_instance']:.1f} | {ls_gap} | "
                         f"{r['ls_feasible']}/{r['instances']} |")
    for n, by_variant in report.get("validation", {}).items():
        lines += ["", f"Options chosen on {report['validation_instances']} validation instances of n = {n} per "
                      "variant (mean cost, greedy x8):", "",
                  "| variant | options | mean cost | s/inst |", "|---|---|---|---|"]
        for variant, v in by_variant.items():
            for r in v["rows"]:
                lines.append(f"| {variant} | {decoding_name(r['distance_bias'], r['candidates'])} | "
                             f"{r['mean_cost']:.4f} | {r['seconds_per_instance']:.1f} |")
            lines.append(f"| {variant} | **chosen: alpha {v['alpha']:g}, k {v['k']}** | | |")
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
    p.add_argument("--decodings", default="0:0", help="ALPHA:K,... distance bias and candidates to solve with "
                   "(0:0: the plain decoder)")
    p.add_argument("--choose_on", type=int, default=None, help="choose alpha and k per variant on validation "
                   "instances of this size (then --decodings is ignored)")
    p.add_argument("--alphas", default="0.5,1,2,4", help="with --choose_on: the distance biases tried")
    p.add_argument("--ks", default="10,20,50", help="with --choose_on: the candidate counts tried")
    p.add_argument("--validation_instances", type=int, default=8)
    p.add_argument("--references_from", default=None, help="a report of this script whose PyVRP costs to reuse "
                   "for the same sizes, variants, instance counts and seconds")
    p.add_argument("--ls_seconds", type=float, default=0.0, help="the local search's time limit per instance "
                   "after greedy (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON path (markdown beside it); default "
                   "benchmarks/results/large_instances_<date>.json")
    args = p.parse_args(argv)

    import jax

    from mvmoe_jax import checkpoints, instances, problems
    from mvmoe_jax.evaluation import gap_percent
    from mvmoe_jax.nn.policy import distance_bias_of

    sizes = sorted(int(s) for s in args.sizes.split(",") if s)
    variants = [v.name for v in problems.parse_variants(args.variants)]
    for n in sizes:
        if n not in instances.CAPACITY_BY_SIZE:
            raise SystemExit(f"size {n} has no defined capacity; choose from {sorted(instances.CAPACITY_BY_SIZE)}")
    budget = None if args.memory_budget_gib is None else int(args.memory_budget_gib * 2**30)
    cfg, params = checkpoints.load_policy(args.checkpoint)
    report = {"machine": machine.jax_device(), "commit": machine.repository_commit(),
              "date": datetime.date.today().isoformat(), "checkpoint": args.checkpoint,
              "num_instances": args.num_instances, "rows": [], "references": {}}
    output = args.output or machine.default_output("large_instances")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    known = {}
    if args.references_from:
        with open(args.references_from) as f:
            known = json.load(f).get("references", {})
    decodings = {variant: parse_decodings(args.decodings) for variant in variants}
    if args.choose_on is not None:
        alphas = [float(a) for a in args.alphas.split(",") if a]
        ks = [int(k) for k in args.ks.split(",") if k]
        chosen = choose_options(cfg, params, args.choose_on, variants, alphas, ks, args.validation_instances,
                                max_starts=args.max_starts, memory_budget=budget, seed=args.seed)
        report["validation"] = {str(args.choose_on): chosen}
        report["validation_instances"] = args.validation_instances
        for variant, c in chosen.items():
            decodings[variant] = list(dict.fromkeys([(0.0, 0), (c["alpha"], 0)] + [(0.0, k) for k in ks]
                                                    + [(c["alpha"], c["k"])]))
    for n in sizes:
        for i, variant in enumerate(variants):
            batch = instances.generate(jax.random.key(1000 * n + i), args.num_instances, n, variant)
            ref_key = f"{n} {variant} {args.num_instances} {args.reference_seconds:g}"
            ref = None
            if args.reference_seconds > 0:
                if ref_key in known:
                    report["references"][ref_key] = known[ref_key]
                else:
                    row_ref, ref_costs = reference_row(batch, args.reference_seconds, args.workers)
                    report["references"][ref_key] = dict(row_ref, costs=ref_costs.tolist())
                ref = np.asarray(report["references"][ref_key]["costs"], np.float64)
            for alpha, k in decodings[variant]:
                t0 = time.perf_counter()
                decoding = with_decoding(cfg, alpha, k)
                row, costs = policy_row(decoding, params, batch, max_starts=args.max_starts, memory_budget=budget,
                                        seed=args.seed)
                row.update(n=n, variant=variant, distance_bias=distance_bias_of(decoding, params), candidates=k,
                           wall_seconds=time.perf_counter() - t0, peak_rss_bytes=peak_rss_bytes(), gap=None)
                routes = row.pop("routes")
                ls_costs = None
                if args.ls_seconds > 0:
                    ls_row, ls_costs = local_search_row(batch, routes, costs, args.ls_seconds)
                    row.update(ls_row, ls_gap=None)
                if ref is not None:
                    row["reference"] = {k_: v for k_, v in report["references"][ref_key].items() if k_ != "costs"}
                    row["gap"] = gap_percent(costs, ref)
                    if ls_costs is not None:
                        row["ls_gap"] = gap_percent(ls_costs, ref)
                print(f"n={n} {variant} {decoding_name(row['distance_bias'], k)}: {row['plan']}; "
                      f"{row['seconds_per_instance']:.1f} s/inst, mean {row['mean_cost']:.4f}, "
                      f"peak {row['peak_rss_bytes'] / 2**30:.2f} GiB, "
                      f"{row['feasible']}/{row['instances']} feasible", flush=True)
                if ls_costs is not None:
                    print(f"  + local search: {row['ls_seconds_per_instance']:.1f} s/inst, mean {row['ls_mean_cost']:.4f}, "
                          f"{row['ls_feasible']}/{row['instances']} feasible", flush=True)
                report["rows"].append(row)
                with open(output, "w") as f:           # what is measured so far, should the run be stopped
                    json.dump(report, f, indent=1)
    machine.write_report(report, output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
