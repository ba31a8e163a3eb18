"""Build fixed validation sets for a problem size without a paper test set (n = 20, say): generated instances
of every variant in the paper's file layout, with reference solutions from a reference solver, so that a
training run validated on them reports gaps rather than objectives alone.

    python scripts/make_validation_sets.py benchmarks/data/validation_n20 --size=20 --instances=100 \
        --solver=ortools --time_limit=1
    python train.py --config=configs/mvmoe.py --config.problem_size=20 --config.pomo_size=20 \
        --config.data_dir=benchmarks/data/validation_n20 --config.validation_problems=ALL

Writes ``DIR/<VARIANT>/<variant><n>_uniform.pkl`` and ``DIR/<VARIANT>/reference_<variant><n>_uniform.pkl``
(every route replayed through the checker by the solver wrapper) and ``DIR/references.json`` saying which
solver, time limit and seed made them. A variant whose files exist is skipped, so an interrupted call
continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--size", type=int, default=20)
    p.add_argument("--instances", type=int, default=100)
    p.add_argument("--variants", default="ALL")
    p.add_argument("--seed", type=int, default=20261207)
    p.add_argument("--solver", default="ortools")
    p.add_argument("--time_limit", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)

    import jax

    from mvmoe_jax import baselines, problems
    from mvmoe_jax.instances import CAPACITY_BY_SIZE, generate
    from mvmoe_jax.io import paper

    if args.size not in CAPACITY_BY_SIZE:
        print(f"error: --size must be one of {sorted(CAPACITY_BY_SIZE)}, got {args.size}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.directory)
    record_path = out / "references.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    for i, var in enumerate(problems.parse_variants(args.variants)):
        data = pathlib.Path(paper.dataset_path(out, var, args.size))
        ref = pathlib.Path(paper.reference_solution_path(out, var, args.size, solver="reference"))
        if data.exists() and ref.exists():
            continue
        inst = generate(jax.random.fold_in(jax.random.key(args.seed), i), args.instances, args.size, var)
        paper.save_paper_instances(data, inst, CAPACITY_BY_SIZE[args.size])
        back = paper.load_paper_instances(data, var)            # what a validator will read
        t0 = time.perf_counter()
        sols = baselines.solve(back, args.solver, time_limit=args.time_limit, workers=args.workers, progress=False)
        paper.save_paper_solutions(ref, sols.costs, sols.routes)
        record[var.name] = {"instances": args.instances, "solver": args.solver, "time_limit": args.time_limit,
                            "seed": args.seed, "variant_index": i, "mean_cost": float(sols.costs.mean()),
                            "seconds": round(time.perf_counter() - t0, 1)}
        record_path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{var.name}: {args.instances} instances, mean reference cost {sols.costs.mean():.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
