"""Descent: apply improving moves until none is left, every new route checked by the environment's rules.

Each round enumerates every candidate of every kind (``moves``) with its cost change, replays the routes of
the improving ones (``route_rules.replay``, the checker's rules exactly) and applies, best first, every
feasible improving move that touches no route an earlier one of the round touched (moves on disjoint routes
do not change each other's cost or feasibility). Rounds repeat until no feasible improving move is left (a
local optimum of all the kinds together) or the time limit is spent. The order of candidates is fixed (by
cost change, then kind and enumeration order), so the result depends only on the instance and the start.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from mvmoe_jax.local_search import moves as mv
from mvmoe_jax.local_search.route_rules import RouteRules, pad_routes, replay, route_costs, solution_order

# A move must lower the cost by more than this (unit-square distances): smaller changes are float rounding.
MIN_GAIN = 1e-6
# At most this many improving candidates are replayed in one round (best first).
MAX_REPLAYED = 4096
# The granular neighbourhood's K: inter-route moves add an arc to one of a customer's 40 nearest (PyVRP's and
# HGS's default granularity); at n = 1,000 a round then takes a tenth of the time of every candidate's.
NEIGHBOURS = 40


class StartInfeasibleError(ValueError):
    """The solution to improve breaks a rule of the environment or does not serve every customer once."""


@dataclasses.dataclass
class Improvement:
    """What ``improve`` did: routes (lists of customers, in the order the environment serves them), cost and
    start_cost (float64, unit square), rounds run, moves applied per kind, seconds, and whether a local
    optimum was reached (False when the time limit stopped it)."""

    routes: list[list[int]]
    cost: float
    start_cost: float
    rounds: int
    applied: dict[str, int]
    seconds: float
    local_optimum: bool


def solution_cost32(rules: RouteRules, routes: Sequence[Sequence[int]]) -> np.float32:
    """The checker's cost of routes served in this order: float32 sums of the environment's distances,
    accumulated move by move over the whole solution (open routes: moves into the depot free)."""
    total = np.float32(0.0)
    for t in routes:
        seq = [0, *t, 0]
        for a, b in zip(seq[:-1], seq[1:]):
            if not (rules.is_open and b == 0):
                total = np.float32(total + rules.dist[a, b])
    return total


def check_start(rules: RouteRules, routes: Sequence[Sequence[int]]) -> None:
    """StartInfeasibleError unless ``routes`` serve every customer once and keep every rule."""
    served = sorted(int(v) for t in routes for v in t)
    if served != list(range(1, rules.num_customers + 1)):
        missing = sorted(set(range(1, rules.num_customers + 1)) - set(served))
        twice = sorted({v for v in served if served.count(v) > 1})
        raise StartInfeasibleError(f"the solution to improve must serve every customer once (missing {missing[:8]}, "
                                   f"served twice {twice[:8]})")
    padded, lengths = pad_routes(routes)
    ok = replay(rules, padded, lengths)
    if not ok.all():
        raise StartInfeasibleError(f"the solution to improve breaks the environment's rules on route "
                                   f"{int(np.flatnonzero(~ok)[0])}: {list(routes[int(np.flatnonzero(~ok)[0])])}")


def _round(rules: RouteRules, layout: mv.Layout, costs: np.ndarray, kinds, max_segment: int,
           deadline: float | None = None, near: np.ndarray | None = None):
    """One round: the new routes of the moves applied, {row: route}, the kinds applied, and whether every improving
    candidate was looked at. Improving candidates are replayed best first, ``MAX_REPLAYED`` at a time, until a batch
    holds a feasible one, none is left, or ``time.perf_counter()`` passes ``deadline`` (then the round is
    incomplete: finding nothing does not make a local optimum)."""
    found = [mv.generate(k, layout, rules.arc, max_segment, near) for k in kinds]
    if not found:
        return {}, [], True
    delta = np.concatenate([c.delta for c in found])
    kind_of = np.concatenate([np.full(len(c.delta), n) for n, c in enumerate(found)])
    index = np.concatenate([np.arange(len(c.delta)) for c in found])
    improving = np.flatnonzero(delta < -MIN_GAIN)
    improving = improving[np.argsort(delta[improving], kind="stable")]
    for start in range(0, improving.size, MAX_REPLAYED):
        if start and deadline is not None and time.perf_counter() > deadline:
            return {}, [], False
        changed, applied = _apply_batch(rules, layout, costs, kinds, found, kind_of, index,
                                        improving[start:start + MAX_REPLAYED])
        if changed:
            return changed, applied, True
    return {}, [], True


def _apply_batch(rules: RouteRules, layout: mv.Layout, costs: np.ndarray, kinds, found, kind_of, index,
                 improving: np.ndarray):
    """Replay the candidates ``improving`` (indices into the concatenated candidates, best first) and apply,
    best first, each feasible one that touches no route an earlier one touched: ({row: route}, kinds applied)."""
    # Gathered kind by kind, then put back in the order of their cost change.
    parts = [mv.build(layout, found[n].take(index[improving[kind_of[improving] == n]])) for n in range(len(found))]
    order = np.argsort(np.argsort(kind_of[improving], kind="stable"), kind="stable")
    rows = np.concatenate([p[0] for p in parts])[order]
    first, first_len = mv.splice(layout, np.concatenate([p[1] for p in parts])[order])
    second, second_len = mv.splice(layout, np.concatenate([p[2] for p in parts])[order])
    ok = replay(rules, first, first_len) & (replay(rules, second, second_len) | (second_len == 0))
    # The exact change, from the routes themselves.
    new_cost = route_costs(rules, first) + np.where(second_len > 0, route_costs(rules, second), 0.0)
    old_cost = costs[rows[:, 0]] + np.where(rows[:, 1] >= 0, costs[np.maximum(rows[:, 1], 0)], 0.0)
    ok &= new_cost - old_cost < -MIN_GAIN
    changed: dict[int, list[int]] = {}
    applied = []
    touched_rows = rows.tolist()
    for c in np.flatnonzero(ok).tolist():
        r1, r2 = touched_rows[c]
        if r1 in changed or r2 in changed:
            continue
        changed[r1] = first[c, :first_len[c]].tolist()
        if r2 >= 0:
            changed[r2] = second[c, :second_len[c]].tolist()
        applied.append(kinds[kind_of[improving[c]]])
        if len(changed) >= len(costs) - 1:
            break
    return changed, applied


def improve(rules: RouteRules, routes: Sequence[Sequence[int]], *, kinds: Sequence[str] = mv.KINDS,
            max_segment: int = 3, time_limit: float | None = None, neighbours: int | None = NEIGHBOURS) -> Improvement:
    """Improve a feasible solution (lists of customers 1..n) by the moves ``kinds`` until a local optimum or
    ``time_limit`` seconds. ``max_segment``: the longest segment ``relocate`` moves. ``neighbours``: K of the
    granular neighbourhood (inter-route moves only through each customer's K nearest, ``moves.nearest``; the
    local optimum is then that neighbourhood's), None for every candidate. The result is never
    worse than the start, by the checker's cost too: should float32 rounding of the whole solution's sum make
    it so (moves that gain next to nothing), the start is returned."""
    t0 = time.perf_counter()
    unknown = [k for k in kinds if k not in mv.GENERATORS]
    if unknown:
        raise ValueError(f"unknown move {unknown[0]!r}; the moves are {', '.join(mv.KINDS)}")
    if max_segment < 1:
        raise ValueError(f"max_segment must be at least 1, got {max_segment}")
    if neighbours is not None and neighbours < 1:
        raise ValueError(f"neighbours must be at least 1 (or None: every candidate), got {neighbours}")
    near = None if neighbours is None else mv.nearest(rules.dist, neighbours)
    start = solution_order(rules, routes)
    check_start(rules, start)
    current = [list(t) for t in start]
    applied = {k: 0 for k in kinds}
    rounds, optimum = 0, False
    while True:
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
        layout = mv.Layout.from_routes(current, rules.num_customers)
        padded, _ = pad_routes(current)
        costs = np.append(route_costs(rules, padded), 0.0)           # the empty row costs nothing
        deadline = None if time_limit is None else t0 + time_limit
        changed, kinds_applied, complete = _round(rules, layout, costs, list(kinds), max_segment, deadline, near)
        rounds += 1
        if not changed:
            optimum = complete
            break
        for k in kinds_applied:
            applied[k] += 1
        new = layout.routes_by_row()
        for r, t in changed.items():
            new[r] = t
        current = [t for t in new if t]
    result = solution_order(rules, current)
    cost = float(route_costs(rules, pad_routes(result)[0]).sum())
    start_cost = float(route_costs(rules, pad_routes(start)[0]).sum())
    if solution_cost32(rules, result) > solution_cost32(rules, start):
        result, cost = start, start_cost
    return Improvement(routes=result, cost=cost, start_cost=start_cost, rounds=rounds, applied=applied,
                       seconds=time.perf_counter() - t0, local_optimum=optimum)
