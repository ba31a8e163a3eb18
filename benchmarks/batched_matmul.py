"""How fast XLA on this machine runs the matrix products a decoding step is made of, against one plain product
of the same FLOPs: the evidence behind docs/performance.md's account of where a CPU decoding step goes.

A decoding step's products are instance-batched (each instance has its own keys, values and readout) and, in
the attention, per head with a head width of 16. Prints a markdown table of GFLOP/s per shape and writes JSON.

    python benchmarks/batched_matmul.py [--repeats 7] [--output benchmarks/results/batched_matmul.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402  (benchmarks/machine.py)

# (label, batch dims, m, k, n): out[batch] = a[batch] (m x k) @ b[batch] (k x n). B = 64 instances, P = 50 starts,
# N = 51 nodes, H = 8 heads of width 16, D = 128, 4 experts x 52 padded readout columns; T = 60 decoding steps.
SHAPES = (
    ("one plain product, a step's trajectories: [3200 x 128] @ [128 x 208]", (), 64 * 50, 128, 208),
    ("one plain product, 8 steps' trajectories: [25600 x 128] @ [128 x 208]", (), 8 * 64 * 50, 128, 208),
    ("readout: 64 instances x [50 x 128] @ [128 x 208]", (64,), 50, 128, 208),
    ("readout, 8 steps stacked: 64 x [400 x 128] @ [128 x 208]", (64,), 400, 128, 208),
    ("attention scores: 64 x 8 heads x [50 x 16] @ [16 x 51]", (64, 8), 50, 16, 51),
    ("attention scores, 8 steps stacked: 64 x 8 x [400 x 16] @ [16 x 51]", (64, 8), 400, 16, 51),
    ("key/value cotangent, one step: 64 x 8 x [51 x 50] @ [50 x 16]", (64, 8), 51, 50, 16),
    ("key/value cotangent, 60 steps at once: 64 x 8 x [51 x 3000] @ [3000 x 16]", (64, 8), 51, 3000, 16),
)


def gflops(batch: tuple[int, ...], m: int, k: int, n: int, repeats: int) -> tuple[float, float]:
    """(best seconds, GFLOP/s) of ``a @ b`` for float32 operands of shapes batch + (m, k) and batch + (k, n)."""
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, batch + (m, k), jnp.float32)
    b = jax.random.normal(key_b, batch + (k, n), jnp.float32)
    product = jax.jit(jnp.matmul)
    jax.block_until_ready(product(a, b))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(product(a, b))
        best = min(best, time.perf_counter() - t0)
    flops = 2.0 * m * k * n
    for size in batch:
        flops *= size
    return best, flops / best / 1e9


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per shape (the best is kept)")
    parser.add_argument("--output", default="benchmarks/results/batched_matmul.json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    device = machine.jax_device()
    rows = []
    for label, batch, m, k, n in SHAPES:
        seconds, rate = gflops(batch, m, k, n, args.repeats)
        rows.append({"shape": label, "batch": list(batch), "m": m, "k": k, "n": n, "seconds": seconds,
                     "gflops": rate})
        print(f"{label}: {rate:.1f} GFLOP/s ({seconds * 1e3:.2f} ms)", flush=True)
    print(f"\nDevice: {device}\n\n| product | ms | GFLOP/s |\n|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['seconds'] * 1e3:.2f} | {r['gflops']:.1f} |")
    result = {"device": device, "jax": jax.__version__, "repeats": args.repeats, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.output}")
    return result


if __name__ == "__main__":
    main()
