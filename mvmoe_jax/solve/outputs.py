"""What a solve writes: a VRPLIB ``.sol`` file per instance (``vrplib.write_solution``), one JSON summary per run,
and the table printed at the end. Only solutions that passed the checker reach these functions.

``.sol`` files list one route per line, ``Route #k: c1 c2 ...``, customers numbered as in the input: 1..n in
the Instance's order (a VRPLIB file's node k + 1 is customer k; the depot, node 1, is 0 and not listed), then
``Cost: <cost>`` in the file's units under the environment's rules (unrounded Euclidean lengths; an open
route ends at its last customer).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np
import vrplib


def write_sol(path: str, routes: Sequence[Sequence[int]], cost: float) -> str:
    """Write routes and cost in VRPLIB's solution format; returns ``path``."""
    vrplib.write_solution(path, [list(map(int, r)) for r in routes], data={"Cost": repr(float(cost))})
    return path


def write_summary(path: str, summary: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    return path


def _fmt(value, spec: str) -> str:
    """``value`` formatted by ``spec`` (width first, e.g. '11.1f'), or a dash as wide."""
    return format(value, spec) if value is not None else format("-", f">{spec.split('.')[0]}")


def table(solutions, search: str) -> str:
    """One line per solution: instance, variant, n, POMO starts used, cost (and greedy's when searching
    further), best-known value, gap, seconds, checker verdict."""
    more = search != "greedy"
    head = f"{'instance':24s} {'variant':9s} {'n':>5s} {'starts':>6s} {'cost':>12s}"
    head += f" {'greedy':>12s}" if more else ""
    head += f" {'best known':>11s} {'gap %':>7s} {'s':>7s}  checker"
    lines = [head]
    for s in solutions:
        line = f"{s.name[:24]:24s} {s.variant:9s} {s.num_customers:5d} {s.starts:6d} {s.cost:12.3f}"
        line += f" {s.greedy_cost:12.3f}" if more else ""
        line += (f" {_fmt(s.best_known, '11.1f')} {_fmt(s.gap, '7.2f')} {s.seconds:7.2f}  "
                 f"{'ok' if s.feasible else s.violation}")
        lines.append(line)
    gaps = [s.gap for s in solutions if s.gap is not None]
    if gaps:
        lines.append(f"mean gap over {len(gaps)} instance(s) with a best-known value: {np.mean(gaps):.2f}%")
    if any(s.gap is not None and s.cost_rounded is not None for s in solutions):
        lines.append("(gaps of VRPLIB instances compare the cost with every edge rounded to an integer, CVRPLIB's "
                     "convention; the cost column is unrounded)")
    return "\n".join(lines)
