"""Effect of bfloat16 matmuls on solution quality and speed: greedy x8 evaluation of the same checkpoint
in float32 and in bfloat16 on the paper's test sets, with the gap to the paper's reference solutions.

    python benchmarks/bf16_quality.py --models=mvmoe --problems=CVRP,VRPTW,OVRPBLTW --size=50 \
        --num_instances=256

Checkpoints: ``--checkpoint`` (one model), else the briefly trained reference fixtures of
``shared/fixtures/torch-reference`` (trained at n = 20 for 200 batches: far from converged, so absolute gaps
are large; the float32 / bfloat16 difference is what this measures). Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_cli  # noqa: E402  (benchmarks/peer_cli.py)
from throughput import MODELS, REPO_ROOT, device_description  # noqa: E402

from mvmoe_jax import checkpoints, evaluation, io, problems  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mvmoe", help=f"comma list of {list(MODELS)}")
    p.add_argument("--checkpoint", default=None, help="evaluate this checkpoint (one model) instead")
    p.add_argument("--problems", default="CVRP,VRPTW,OVRPBLTW")
    p.add_argument("--size", type=int, default=50)
    p.add_argument("--num_instances", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--data_dir", default=os.path.join(os.path.dirname(REPO_ROOT), "shared", "data", "mvmoe-paper"))
    p.add_argument("--output", default="benchmarks/results/bf16_quality.json")
    args = p.parse_args()

    models = [m.strip() for m in args.models.split(",")]
    rows = []
    for model in models:
        path = args.checkpoint or peer_cli.fixture_checkpoint(model)
        if path is None:
            raise SystemExit(f"no checkpoint for {model}: pass --checkpoint, or place the reference fixtures at "
                             f"{peer_cli.FIXTURE_DIR}")
        cfg, params = checkpoints.load_policy(path)
        for var in problems.parse_variants(args.problems):
            inst = io.load_paper_instances(io.dataset_path(args.data_dir, var, args.size), var,
                                           num_instances=args.num_instances)
            ref_path = io.reference_solution_path(args.data_dir, var, args.size)
            ref = io.load_paper_solutions(ref_path, num_instances=args.num_instances)[0] \
                if os.path.exists(ref_path) else None
            row = {"model": model, "checkpoint": os.path.basename(path), "variant": var.name, "size": args.size,
                   "instances": int(inst.locs.shape[0])}
            for dtype in ("float32", "bfloat16"):
                res = evaluation.evaluate_dataset(dataclasses.replace(cfg, compute_dtype=dtype), params, inst,
                                                  batch_size=args.batch_size, progress=False,
                                                  desc=f"{var.name} {dtype}")
                row[dtype] = {"mean": res.mean, "gap": None if ref is None else evaluation.gap_percent(res.obj, ref),
                              "seconds": res.seconds}
                row[f"{dtype}_obj"] = res.obj
            a, b = row.pop("float32_obj"), row.pop("bfloat16_obj")
            row["relative_change_percent"] = float((b.mean() - a.mean()) / a.mean() * 100)
            row["instances_changed"] = int(np.sum(np.abs(a - b) > 1e-4 * a))
            rows.append(row)
            print(f"{MODELS[model]:11s} {var.name:9s} fp32 {row['float32']['mean']:.4f} "
                  f"bf16 {row['bfloat16']['mean']:.4f} ({row['relative_change_percent']:+.3f}%, "
                  f"{row['instances_changed']}/{row['instances']} instances differ); time "
                  f"{row['float32']['seconds']:.1f} s vs {row['bfloat16']['seconds']:.1f} s", flush=True)

    print(f"\nDevice: {device_description()}\n")
    print("| model | variant | n | instances | fp32 obj (gap %) | bf16 obj (gap %) | change | instances "
          "changed | fp32 s | bf16 s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fmt_gap = lambda g: "" if g is None else f" ({g:.2f}%)"
    for r in rows:
        f32, b16 = r["float32"], r["bfloat16"]
        print(f"| {MODELS[r['model']]} | {r['variant']} | {r['size']} | {r['instances']} | {f32['mean']:.4f}"
              f"{fmt_gap(f32['gap'])} | {b16['mean']:.4f}{fmt_gap(b16['gap'])} | {r['relative_change_percent']:+.3f}% "
              f"| {r['instances_changed']} | {f32['seconds']:.1f} | {b16['seconds']:.1f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"device": device_description(), "rows": rows}, f, indent=1)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
