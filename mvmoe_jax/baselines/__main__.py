"""Solve a dataset in the paper's format with a reference solver; write the paper's solution format.

    python -m mvmoe_jax.baselines --solver=ortools --problem=VRPBLTW --data=vrpbltw50_uniform.pkl \
        --num_instances=20 --time_limit=20 --workers=2 --output=ortools_vrpbltw50.pkl

``--backhauls=classic`` or ``mixed`` solves instances with backhauls under that rule instead of the paper's
(``docs/environment.md``). Every route is replayed through the environment's checker before the file is written. With
``--reference=FILE`` (a solution file for the same instances) the mean gap to it is printed too.
Exit status: 0 on success, 2 for bad input (message on stderr), 1 if a route fails the checker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mvmoe_jax.baselines", description=__doc__.split("\n\n")[0])
    p.add_argument("--solver", required=True,
                   help="ortools (all 16 variants) or pyvrp (variants without B; with B under the classic and mixed rules)")
    p.add_argument("--problem", required=True, help="variant name, e.g. CVRP, VRPBLTW")
    p.add_argument("--data", required=True, help="instance file in the paper's pickle format")
    p.add_argument("--backhauls", default="paper",
                   help="the backhaul rule the instances are solved under: paper (the paper's data, default), classic "
                        "or mixed (docs/environment.md)")
    p.add_argument("--num_instances", type=int, default=None, help="solve the first K instances (default all)")
    p.add_argument("--offset", type=int, default=0, help="skip this many instances first")
    p.add_argument("--time_limit", type=float, default=None,
                   help="seconds per instance (default 20 for ortools, 5 for pyvrp)")
    p.add_argument("--workers", type=int, default=1, help="parallel solver processes")
    p.add_argument("--output", required=True, help="solution file to write (paper format: [(cost, route)])")
    p.add_argument("--seed", type=int, default=0, help="random seed (pyvrp)")
    p.add_argument("--reference", default=None, help="solution file to report the mean gap against")
    p.add_argument("--json", default=None, help="also write a JSON summary (costs, seconds, gap) here")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def _error(msg: str, code: int = 2):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from mvmoe_jax import baselines, instances, io, problems

    try:
        solver = baselines.canonical_solver(args.solver)
        var = problems.get_variant(args.problem)
        rule = problems.backhaul_rule_name(args.backhauls)
        baselines.check_supported(solver, var, rule)
        if not os.path.isfile(args.data):
            raise FileNotFoundError(f"data file not found: {args.data}")
        if args.num_instances is not None and args.num_instances < 1:
            raise ValueError(f"--num_instances must be >= 1, got {args.num_instances}")
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        if args.time_limit is not None and not args.time_limit > 0:
            raise ValueError(f"--time_limit must be positive, got {args.time_limit}")
        if args.reference and not os.path.isfile(args.reference):
            raise FileNotFoundError(f"reference file not found: {args.reference}")
        try:
            named = io.variant_from_filename(args.data)
        except ValueError:
            named = None
        if named is not None and named.name != var.name:
            print(f"warning: --problem={var.name} but the file name says {named.name}", file=sys.stderr)
        inst = io.load_paper_instances(args.data, var, num_instances=args.num_instances, offset=args.offset)
        inst = instances.with_backhaul_rule(inst, rule)
    except (ValueError, FileNotFoundError, ImportError) as e:
        _error(str(e))

    k = int(inst.locs.shape[0])
    n = int(inst.locs.shape[1] - 1)
    limit = baselines.DEFAULT_TIME_LIMIT[solver] if args.time_limit is None else args.time_limit
    rule_text = f" under the {rule} backhaul rule" if var.backhaul else ""
    print(f"{solver}: {k} {var.name} instances (n = {n}){rule_text} from {args.data}, {limit:g} s each, "
          f"{args.workers} worker(s)", flush=True)
    start = time.perf_counter()
    try:
        sols = baselines.solve(inst, solver, time_limit=limit, workers=args.workers,
                               progress=not args.no_progress, check=True, seed=args.seed)
    except baselines.InfeasibleSolutionError as e:
        _error(str(e), code=1)
    except (ValueError, ImportError) as e:
        _error(str(e))
    wall = time.perf_counter() - start
    sols.save(args.output)
    print(f"mean cost {sols.mean:.5f} over {k} instances; all {k} routes pass the environment's checker; "
          f"{np.mean(sols.seconds):.2f} s per instance, {wall:.1f} s wall; wrote {args.output}")
    summary = {"solver": solver, "problem": var.name, "backhaul_rule": rule, "data": os.path.abspath(args.data), "n": n,
               "num_instances": k, "offset": args.offset, "time_limit": limit, "workers": args.workers,
               "mean": sols.mean, "costs": sols.costs.tolist(), "seconds": sols.seconds.tolist(),
               "wall_seconds": wall, "feasible": k}
    if args.reference:
        ref, _ = io.load_paper_solutions(args.reference, num_instances=k, offset=args.offset)
        if len(ref) != k:
            _error(f"reference file {args.reference} has {len(ref)} solutions in range, need {k}")
        gaps = (sols.costs - ref) / ref * 100.0
        summary.update(reference=os.path.abspath(args.reference), reference_mean=float(ref.mean()),
                       gap_percent=float(gaps.mean()))
        print(f"reference mean {ref.mean():.5f}; mean gap {gaps.mean():.4f}%")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
