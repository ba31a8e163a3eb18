"""Throughput of the environment alone: a uniformly random feasible policy on a (batch, pomo) grid.

Each decoding step applies ``action_mask`` and ``step`` to every trajectory of the grid inside one jitted
``lax.scan``; steps/s counts trajectory-steps (batch x pomo x decoding steps) per second of wall time,
compilation excluded. Prints a markdown table and writes JSON.

    python benchmarks/env_throughput.py --sizes 50,100 --batch 64 --pomo 0 --output FILE
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

import jax
import jax.numpy as jnp

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)
from mvmoe_jax import env, instances, problems


@partial(jax.jit, static_argnames=("pomo", "num_steps"))
def random_rollout(key, batch, pomo: int, num_steps: int):
    """Roll a random feasible policy for ``num_steps`` steps; returns final costs (batch, pomo)."""
    states = env.batch_reset(batch, pomo)

    def body(carry, k):
        states = carry
        mask = env.batch_action_mask(states)
        logits = jnp.where(mask, 0.0, -jnp.inf)
        actions = jax.random.categorical(k, logits)
        return env.batch_step(states, actions), None

    states, _ = jax.lax.scan(body, states, jax.random.split(key, num_steps))
    return states.cost, states.finished


def measure(size: int, batch_size: int, pomo: int, variants, repeats: int = 3) -> dict:
    key = jax.random.key(0)
    batch = instances.generate(key, batch_size, size, variants)
    num_steps = 2 * size + 2           # enough for every variant to finish (a depot visit per customer)
    t0 = time.perf_counter()
    cost, finished = jax.block_until_ready(random_rollout(key, batch, pomo, num_steps))
    compile_s = time.perf_counter() - t0
    assert bool(finished.all()), "random policy did not finish: raise num_steps"
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(random_rollout(jax.random.key(r + 1), batch, pomo, num_steps))
        times.append(time.perf_counter() - t0)
    best = min(times)
    steps = batch_size * pomo * num_steps
    return {"size": size, "batch": batch_size, "pomo": pomo, "variants": ",".join(map(str, variants)),
            "decode_steps": num_steps, "seconds": best, "compile_seconds": compile_s - best,
            "steps_per_second": steps / best}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="50,100")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--pomo", type=int, default=0, help="POMO starts; 0 = n (all starts)")
    p.add_argument("--variants", default="CVRP;VRPBLTW;TRAIN",
                   help="';'-separated variant specs, each one name or a comma list / ALL / TRAIN (mixed)")
    p.add_argument("--output", default="benchmarks/results/env_throughput.json")
    args = p.parse_args()
    device = machine.jax_device()
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for spec in args.variants.split(";"):
            variants = [v.name for v in problems.parse_variants(spec)]
            pomo = args.pomo or size
            row = measure(size, args.batch, pomo, variants)
            row["variant_spec"] = spec
            rows.append(row)
            print(f"n={size:4d} {spec:10s} batch={args.batch} pomo={pomo}: {row['steps_per_second']:.3e} "
                  f"steps/s ({row['seconds']:.3f} s, compile {row['compile_seconds']:.1f} s)", flush=True)
    print(f"\nDevice: {device}\n")
    print("| n | variants | batch x pomo | decode steps | seconds | trajectory-steps / s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['variant_spec']} | {r['batch']} x {r['pomo']} | {r['decode_steps']} | "
              f"{r['seconds']:.3f} | {r['steps_per_second']:.3e} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"device": device, "jax": jax.__version__, "rows": rows}, f, indent=1)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
