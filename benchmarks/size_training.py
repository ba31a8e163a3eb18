"""Training for size against decoding for it: models compared on the same generated instances beyond n = 50,
each with the CPU time its training took beyond the shipped weights.

An arm is ``LABEL=SOURCE[@EPOCH][:ALPHA]``: a shipped model's name or a training workdir at its checkpoint of
EPOCH, decoded greedy x8 with the constant distance bias ALPHA (``nn/locality.py``; not for a
model that learned its own, whose learned value is reported). A workdir's CPU time is the sum of its metrics'
``train_cpu_seconds`` up to that epoch (validation excluded); a shipped model's is 0.

    python benchmarks/size_training.py --sizes=200,500,1000 --variants=CVRP,VRPTW \
        --arms="shipped + bias 1=mvmoe_4e_n50:1,n = 50 on + bias 1=RUNS/long/mvmoe_4e_n50@4:1,\
sizes=RUNS/sizes/mvmoe_4e_sizes@4" \
        --references_from=benchmarks/results/large_instances_defaults_n200_2026-12-07.json,...

The instances are ``benchmarks/large_instances.py``'s (the same seeds per size and variant), so its reports' PyVRP
costs serve as references (``--references_from``, several comma-separated); sizes without one report mean costs
only. Every route is replayed by the checker. Above 200 customers every arm decodes from the solver's default
number of starts (min(200, 50,000 / n)). JSON and markdown go to ``--output``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)
from large_instances import peak_rss_bytes, policy_row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def parse_arm(text: str) -> dict:
    """``LABEL=SOURCE[@EPOCH][:ALPHA]`` -> {"label", "source", "epoch", "alpha"} (epoch and alpha None where not
    given)."""
    label, sep, rest = text.rpartition("=")
    if not sep or not label.strip() or not rest.strip():
        raise SystemExit(f"--arms item {text!r}: expected LABEL=SOURCE[@EPOCH][:ALPHA]")
    source, colon, alpha = rest.rpartition(":") if ":" in rest else (rest, "", "")
    source, at, epoch = source.partition("@")
    try:
        return {"label": label.strip(), "source": source.strip(), "epoch": int(epoch) if at else None,
                "alpha": float(alpha) if colon else None}
    except ValueError:
        raise SystemExit(f"--arms item {text!r}: EPOCH must be a whole number and ALPHA a number") from None


def training_cpu_seconds(workdir: str, epoch: int) -> float:
    """The summed ``train_cpu_seconds`` of a training workdir's epochs 1..epoch (its metrics.jsonl)."""
    from mvmoe_jax.training_validation import read_metrics

    rows = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if 1 <= r["epoch"] <= epoch]
    if len(rows) != epoch:
        raise SystemExit(f"{workdir}: metrics of {len(rows)} of its first {epoch} epochs; cannot count its CPU time")
    return float(sum(r["time"]["train_cpu_seconds"] for r in rows))


def load_arm(arm: dict):
    """(config to decode with, params, the arm's report fields)."""
    import dataclasses

    from mvmoe_jax import checkpoints
    from mvmoe_jax.nn.policy import distance_bias_of, refuse_fixed_bias_on_learned

    source = arm["source"]
    if os.path.isdir(source):
        if arm["epoch"] is None:
            raise SystemExit(f"arm {arm['label']!r}: name the epoch of workdir {source} (@EPOCH)")
        epoch = arm["epoch"]
        cfg, params = checkpoints.restore_policy(os.path.join(source, "checkpoints"), step=epoch)
        cpu = training_cpu_seconds(source, epoch)
    else:
        if arm["epoch"] is not None:
            raise SystemExit(f"arm {arm['label']!r}: @EPOCH is for a training workdir, not {source!r}")
        cfg, params = checkpoints.load_policy(source)
        epoch, cpu = None, 0.0
    try:
        refuse_fixed_bias_on_learned(cfg, arm["alpha"])
    except ValueError as e:
        raise SystemExit(f"arm {arm['label']!r}: {e}") from None
    if arm["alpha"] is not None:
        cfg = dataclasses.replace(cfg, distance_bias=arm["alpha"])
    return cfg, params, {"label": arm["label"], "source": source, "epoch": epoch, "training_cpu_hours": cpu / 3600,
                         "distance_bias": distance_bias_of(cfg, params), "learned": cfg.learned_distance_bias}


def markdown(report: dict) -> str:
    lines = [f"Machine: {report['machine']}; commit {report['commit']}; {report['date']}; greedy x8 on generated "
             "instances (`benchmarks/large_instances.py`'s seeds); CPU-hours: training beyond the shipped weights.", "",
             "| model | CPU-h | alpha | n | variant | instances | mean cost | gap % to PyVRP | s/inst | feasible |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        arm = report["arms"][r["arm"]]
        gap = "-" if r.get("gap") is None else f"{r['gap']:.2f}"
        alpha = f"{arm['distance_bias']:.3f}" + (" (learned)" if arm["learned"] else "")
        lines.append(f"| {arm['label']} | {arm['training_cpu_hours']:.2f} | {alpha} | {r['n']} | {r['variant']} | "
                     f"{r['instances']} | {r['mean_cost']:.4f} | {gap} | {r['seconds_per_instance']:.1f} | "
                     f"{r['feasible']}/{r['instances']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", required=True, help="LABEL=SOURCE[@EPOCH][:ALPHA],... (see the module's doc)")
    p.add_argument("--sizes", default="200,500,1000")
    p.add_argument("--variants", default="CVRP,VRPTW")
    p.add_argument("--num_instances", default="4", help="instances per size: one number, or SIZE:COUNT,... "
                   "(e.g. 200:4,500:2,1000:2, the counts of the stored references)")
    p.add_argument("--references_from", default="", help="reports of benchmarks/large_instances.py whose PyVRP "
                   "costs to use (comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON path (markdown beside it); default "
                   "benchmarks/results/size_training_<date>.json")
    args = p.parse_args(argv)

    import jax

    from mvmoe_jax import instances, problems
    from mvmoe_jax.evaluation import gap_percent
    from mvmoe_jax.solve.models import size_default_max_starts

    sizes = sorted(int(s) for s in args.sizes.split(",") if s)
    variants = [v.name for v in problems.parse_variants(args.variants)]
    counts = ({int(k): int(v) for k, v in (item.split(":") for item in args.num_instances.split(","))}
              if ":" in args.num_instances else {n: int(args.num_instances) for n in sizes})
    missing = [n for n in sizes if n not in counts or n not in instances.CAPACITY_BY_SIZE]
    if missing:
        raise SystemExit(f"sizes {missing}: no instance count given, or no defined capacity "
                         f"({sorted(instances.CAPACITY_BY_SIZE)})")
    references = {}
    for path in filter(None, args.references_from.split(",")):
        with open(path) as f:
            references.update(json.load(f).get("references", {}))
    arms = [load_arm(parse_arm(item)) for item in args.arms.split(",") if item.strip()]
    report = {"machine": machine.jax_device(), "commit": machine.repository_commit(),
              "date": datetime.date.today().isoformat(), "arms": [a[2] for a in arms], "rows": []}
    output = args.output or machine.default_output("size_training")
    for n in sizes:
        for i, variant in enumerate(variants):
            count = counts[n]
            batch = instances.generate(jax.random.key(1000 * n + i), count, n, variant)
            ref = next((np.asarray(v["costs"], np.float64) for k, v in references.items()
                        if k.split()[:3] == [str(n), variant, str(count)]), None)
            for index, (cfg, params, arm) in enumerate(arms):
                row, costs = policy_row(cfg, params, batch, max_starts=size_default_max_starts(n), memory_budget=None,
                                        seed=args.seed)
                row.pop("routes")
                row.update(arm=index, n=n, variant=variant, peak_rss_bytes=peak_rss_bytes(),
                           gap=None if ref is None else gap_percent(costs, ref))
                report["rows"].append(row)
                gap = "" if ref is None else f", gap {row['gap']:.2f} %"
                print(f"n={n} {variant} {arm['label']}: mean {row['mean_cost']:.4f}{gap}, "
                      f"{row['seconds_per_instance']:.1f} s/inst, {row['feasible']}/{count} feasible", flush=True)
    machine.write_report(report, output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
