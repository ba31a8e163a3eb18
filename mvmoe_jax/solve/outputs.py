"""What a solve writes: a VRPLIB ``.sol`` file per instance (``vrplib.write_solution``), one JSON summary per run,
and the table printed at the end. Only solutions that passed the checker reach these functions.

``.sol`` files list one route per line, ``Route #k: c1 c2 ...``, customers numbered as in the input: 1..n in
the Instance's order (a VRPLIB file's node k + 1 is customer k; the depot, node 1, is 0 and not listed), then
``Cost: <cost>`` in the file's units under the environment's rules (an open route ends at its last customer),
each edge counted in the input's own convention (``checker.COST_CONVENTIONS``: rounded to an integer for
CVRPLIB's EUC_2D files, truncated to one decimal for time-window VRPLIB files and Solomon files, exact
otherwise), the convention of its best-known values. Comment lines (``#``, which VRPLIB readers skip) follow:
the convention, and for open routes that each route ends at its last customer.

``--save_adapted=PATH`` (``write_adapted``) writes EAS's adapted parameters to one ``.npz`` file (plain arrays,
read with ``numpy.load(PATH)``; no pickled objects). Per instance size n solved:

  ``embeddings_n<n>``  float32 (K, 8, n + 1, D): each instance's adapted node embeddings (the encoder's output,
                       which EAS-Emb adapts; depot first, then customers 1..n), one set per symmetric copy in
                       ``instances.augment_8``'s order (``copies`` below);
  ``names_n<n>``       str (K,): the instances, as in the ``.sol`` files and the summary, in input order;
  ``sources_n<n>``     str (K,): where each was read from; ``model_n<n>`` str (): the checkpoint.

and ``method`` str () (``eas-emb``) and ``copies`` str (8,): each copy's coordinates from the instance's (x, y).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np
import vrplib


CONVENTION_NOTES = {"exact": "Cost: exact Euclidean edge lengths",
                    "nint": "Cost: every edge rounded to the nearest integer (CVRPLIB's EUC_2D convention)",
                    "dimacs": "Cost: every edge truncated to one decimal (the DIMACS convention)"}
OPEN_ROUTES_NOTE = "Open routes: each route ends at its last customer; Cost counts no return to the depot"


def write_sol(path: str, routes: Sequence[Sequence[int]], cost: float, *, convention: str = "exact",
              open_routes: bool = False) -> str:
    """Write routes and cost in VRPLIB's solution format, then comment lines naming the cost ``convention``
    (``CONVENTION_NOTES``) and, with ``open_routes``, that the routes are open; returns ``path``."""
    vrplib.write_solution(path, [list(map(int, r)) for r in routes], data={"Cost": repr(float(cost))})
    notes = [CONVENTION_NOTES[convention]] + ([OPEN_ROUTES_NOTE] if open_routes else [])
    with open(path, "a") as f:
        f.writelines(f"# {note}\n" for note in notes)
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


def variant_label(variant: str, backhaul_rule: str) -> str:
    """The variant's name, with the backhaul rule for a variant with backhauls: ``VRPB/classic``."""
    return f"{variant}/{backhaul_rule}" if "B" in variant.replace("VRP", "", 1) else variant


def table(solutions, search: str) -> str:
    """One line per solution: instance, variant (with its backhaul rule), n, POMO starts used, cost (and greedy's when searching
    further), best-known value, gap, seconds, checker verdict."""
    more = search != "greedy"
    head = f"{'instance':24s} {'variant':16s} {'n':>5s} {'starts':>6s} {'cost':>12s}"
    head += f" {'greedy':>12s}" if more else ""
    head += f" {'best known':>11s} {'gap %':>7s} {'s':>7s}  checker"
    lines = [head]
    for s in solutions:
        line = f"{s.name[:24]:24s} {variant_label(s.variant, s.backhaul_rule):16s} {s.num_customers:5d} {s.starts:6d} " \
               f"{_fmt(s.cost if s.found else None, '12.3f')}"
        line += f" {_fmt(s.greedy_cost if s.found else None, '12.3f')}" if more else ""
        line += (f" {_fmt(s.best_known, '11.1f')} {_fmt(s.gap, '7.2f')} {s.seconds:7.2f}  "
                 f"{'ok' if s.feasible else s.violation if s.found else 'no solution found'}")
        lines.append(line)
    gaps = [s.gap for s in solutions if s.gap is not None]
    if gaps:
        lines.append(f"mean gap over {len(gaps)} instance(s) with a best-known value: {np.mean(gaps):.2f}%")
    if any(s.gap is not None and s.cost_convention != "exact" for s in solutions):
        lines.append("(gaps compare the cost in the input's own convention, the .sol file's: edges rounded to "
                     "integers for CVRPLIB files, truncated to one decimal for time-window VRPLIB and Solomon files; "
                     "the cost column is exact)")
    return "\n".join(lines)


# Rounds of each search as the reports name them.
ROUND_WORDS = {"sampling": "rounds", "eas": "iterations", "sgbs": "passes", "sgbs_eas": "rounds"}


def below_best_known_warnings(solutions) -> list[str]:
    """One line per solution whose cost (in its convention) is below its best-known value: a file cut short, or
    a best-known value of another instance or convention, far more often than a new best."""
    return [f"{s.name}: cost {s.convention_cost:.6g} is below the best-known value {s.best_known:.6g} "
            f"({s.gap:+.2f} %); check that the file is complete and the value is this instance's"
            for s in solutions if s.gap is not None and s.convention_cost < s.best_known * (1 - 1e-9)]


def idle_search_warning(solutions, search: str, time_limit: float | None, compile_seconds: float) -> list[str]:
    """One line when ``search`` (not greedy) ran no round on some instances: the time limit (per instance, which
    compilation is not counted in) left no room for one after greedy x8."""
    idle = [s for s in solutions if search in ROUND_WORDS and s.rounds == 0]
    if not idle:
        return []
    greedy = sum(s.greedy_seconds for s in idle) / len(idle)
    why = (f"--time_limit={time_limit:g} s per instance left no room for one after greedy x8 ({greedy:.2f} s per "
           f"instance); compilation ({compile_seconds:.1f} s) is not counted in the limit"
           if time_limit is not None else "--rounds allowed none")
    names = ", ".join(s.name for s in idle[:3]) + (", ..." if len(idle) > 3 else "")
    return [f"--search={search} ran 0 {ROUND_WORDS[search]} on {len(idle)} instance(s) ({names}): {why}; "
            "raise --time_limit or give --rounds"]


COPIES = ("(x, y)", "(1-x, y)", "(x, 1-y)", "(1-x, 1-y)", "(y, x)", "(1-y, x)", "(y, 1-x)", "(1-y, 1-x)")


def write_adapted(path: str, solutions) -> str:
    """EAS's adapted embeddings of ``solutions`` (each with ``adapted``) in the layout of the module docstring;
    returns ``path`` (written as given: numpy adds no ``.npz``)."""
    by_size: dict[int, list] = {}
    for s in solutions:
        if s.adapted is None:
            why = (f"--search={s.search} adapts none" if s.search != "eas"
                   else "EAS ran 0 iterations: the time limit left no room for one after greedy x8")
            raise ValueError(f"{s.name}: no adapted parameters to save ({why})")
        by_size.setdefault(s.num_customers, []).append(s)
    arrays = {"method": np.array("eas-emb"), "copies": np.array(COPIES)}
    for n, group in by_size.items():
        arrays[f"embeddings_n{n}"] = np.stack([np.asarray(s.adapted, np.float32) for s in group])
        arrays[f"names_n{n}"] = np.array([s.name for s in group])
        arrays[f"sources_n{n}"] = np.array([s.source for s in group])
        arrays[f"model_n{n}"] = np.array(group[0].model)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path
