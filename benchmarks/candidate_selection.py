"""Per decoding step, the cost of finding the k nearest feasible customers (``nn/locality.py``, the candidate
sets): the bisection over neighbour ranks that ``candidate_mask`` runs, against ``jax.lax.top_k`` and a sort of
each row of distances, on one chunk of a greedy decoding (one instance copy, all n starts, as the cpu plan
decodes above n = 100).

    python benchmarks/candidate_selection.py --sizes=200,500 --ks=20,50

Microseconds per step (median of ``--repeats`` runs of 50 steps), printed and saved as JSON (markdown beside it).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 50


def timed(fn, *args, repeats: int) -> float:
    """Median microseconds per step of ``fn`` (a jitted loop of STEPS steps)."""
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append((time.perf_counter() - t0) / STEPS * 1e6)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="200,500")
    p.add_argument("--ks", default="20,50")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from mvmoe_jax.nn import locality

    def loop(select):
        """STEPS steps, each selecting from a mask changed by the previous step's result (no step is hoisted)."""
        def run(mask, current, table):
            body = lambda _, m: mask ^ select(m, current, table)
            return jax.lax.fori_loop(0, STEPS, body, mask)
        return jax.jit(run)

    def by_ranks(k):
        return lambda m, cur, ranks: locality.candidate_mask(m, locality.current_ranks(ranks, cur), k)

    def by_top_k(k):
        def select(m, cur, locs):
            d = jnp.where(m[..., 1:], locality.current_distances(locs, cur)[..., 1:], jnp.inf)
            kth = -jax.lax.top_k(-d, k)[0][..., -1:]
            return jnp.concatenate([m[..., :1], m[..., 1:] & (d <= kth)], axis=-1)
        return select

    def by_sort(k):
        def select(m, cur, locs):
            d = jnp.where(m[..., 1:], locality.current_distances(locs, cur)[..., 1:], jnp.inf)
            kth = jnp.sort(d, axis=-1)[..., k - 1:k]
            return jnp.concatenate([m[..., :1], m[..., 1:] & (d <= kth)], axis=-1)
        return select

    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        locs = jax.random.uniform(jax.random.key(n), (1, n + 1, 2))
        mask = jax.random.uniform(jax.random.key(n + 1), (1, n, n + 1)) < 0.7
        current = jax.random.randint(jax.random.key(n + 2), (1, n), 0, n + 1)
        ranks = locality.neighbour_ranks(locs)
        for k in (int(s) for s in args.ks.split(",")):
            row = {"n": n, "k": k,
                   "rank_bisection_us": timed(loop(by_ranks(k)), mask, current, ranks, repeats=args.repeats),
                   "top_k_us": timed(loop(by_top_k(k)), mask, current, locs, repeats=args.repeats),
                   "sort_us": timed(loop(by_sort(k)), mask, current, locs, repeats=args.repeats)}
            rows.append(row)
            print(row, flush=True)
    report = {"machine": machine.jax_device(), "commit": machine.repository_commit(),
              "date": datetime.date.today().isoformat(), "rows": rows}
    lines = [f"Machine: {report['machine']}; commit {report['commit']}; {report['date']}; one chunk of n starts.", "",
             "| n | k | rank bisection us/step | top_k us/step | sort us/step |", "|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['k']} | {r['rank_bisection_us']:.0f} | {r['top_k_us']:.0f} | {r['sort_us']:.0f} |"
              for r in rows]
    output = args.output or machine.default_output("candidate_selection")
    machine.write_report(report, output, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
