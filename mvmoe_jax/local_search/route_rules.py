"""The environment's rules for whole routes, replayed for many candidate routes at once (numpy).

``replay`` runs the moves of ``env.step`` and the checks of ``env.violations`` (``docs/environment.md``) over
a batch of routes, each from the depot back to it, in float32 with the same operations in the same order, so a
route is feasible here exactly when the checker accepts it. What one route cannot see of the others is fixed by
the order ``solution_order`` gives the routes: under the paper's backhaul rule a route that holds a linehaul
leaves full, one of backhauls only leaves empty because it comes after every linehaul is served.

A route is a sequence of distinct customers (1..n); a batch of them is int (C, L) padded with the depot (0)
after each route's ``lengths[c]`` customers.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from mvmoe_jax import env
from mvmoe_jax.problems import CLASSIC_RULE, MIXED_RULE, PAPER_RULE

F32 = np.float32
EPS = F32(env.EPS)
ONE_EPS = F32(1.0 + env.EPS)


@dataclasses.dataclass(frozen=True)
class RouteRules:
    """One instance's data as the rules read it (host arrays).

      dist:    float32 (n+1, n+1) the environment's distances (``distance_matrix``).
      arc:     float64 (n+1, n+1) the cost of each arc: ``dist``, with open routes 0 into the depot.
      demand, service_time, tw_start, tw_end: float32 (n+1,).
      route_limit: float32 (); is_open, has_backhaul, has_limit, has_tw: bool; backhaul_rule: int.
    """

    dist: np.ndarray
    arc: np.ndarray
    demand: np.ndarray
    service_time: np.ndarray
    tw_start: np.ndarray
    tw_end: np.ndarray
    route_limit: np.float32
    is_open: bool
    has_backhaul: bool
    has_limit: bool
    has_tw: bool
    backhaul_rule: int

    @classmethod
    def from_instance(cls, inst) -> "RouteRules":
        """From one (unbatched) Instance."""
        import jax

        host = jax.device_get(inst)
        if np.ndim(host.locs) != 2:
            raise ValueError(f"expected one instance (locs of shape (n+1, 2)), got locs {np.shape(host.locs)}")
        dist = distance_matrix(np.asarray(host.locs, F32))
        arc = dist.astype(np.float64)
        if bool(host.is_open):
            arc[:, 0] = 0.0
        return cls(dist=dist, arc=arc, demand=np.asarray(host.demand, F32),
                   service_time=np.asarray(host.service_time, F32), tw_start=np.asarray(host.tw_start, F32),
                   tw_end=np.asarray(host.tw_end, F32), route_limit=F32(host.route_limit),
                   is_open=bool(host.is_open), has_backhaul=bool(host.has_backhaul), has_limit=bool(host.has_limit),
                   has_tw=bool(host.has_tw), backhaul_rule=int(host.backhaul_rule))

    @property
    def num_customers(self) -> int:
        return self.dist.shape[0] - 1

    def leaves_full(self, routes: np.ndarray) -> np.ndarray:
        """bool (C,): whether each route leaves the depot full under the paper's rule, i.e. holds a linehaul
        (it then comes before every route of backhauls only, ``solution_order``)."""
        return np.any(self.demand[routes] > 0, axis=1)


def distance_matrix(locs: np.ndarray) -> np.ndarray:
    """float32 (n+1, n+1) from coordinates float32 (n+1, 2): ``env.distance_matrix``'s values bitwise (each
    square rounded to float32, then their sum, then the square root; numpy fuses nothing)."""
    x, y = locs[:, 0], locs[:, 1]
    dx = x[None, :] - x[:, None]
    dy = y[None, :] - y[:, None]
    return np.sqrt(dx * dx + dy * dy).astype(F32)


def route_costs(rules: RouteRules, routes: np.ndarray) -> np.ndarray:
    """float64 (C,): each route's cost, depot to depot (open routes: the move into the depot free); routes
    int (C, L) padded with the depot."""
    seq = np.concatenate([np.zeros((routes.shape[0], 1), routes.dtype), routes,
                          np.zeros((routes.shape[0], 1), routes.dtype)], axis=1)
    return rules.arc[seq[:, :-1], seq[:, 1:]].sum(axis=1)


def replay(rules: RouteRules, routes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """bool (C,): each route keeps every rule of the environment from its start at the depot to its return.

    routes int (C, L), the first ``lengths[c]`` entries of row c customers (distinct, >= 1), the rest 0."""
    r = rules
    routes = np.asarray(routes)
    c_count, width = routes.shape
    lengths = np.asarray(lengths)
    paper, classic, mixed = (r.backhaul_rule == rule for rule in (PAPER_RULE, CLASSIC_RULE, MIXED_RULE))
    zero = np.zeros(c_count, F32)
    load = np.where(r.leaves_full(routes), F32(1.0), F32(0.0)).astype(F32) if paper else np.ones(c_count, F32)
    delivered, picked, peak, time, length = zero.copy(), zero.copy(), zero.copy(), zero.copy(), zero.copy()
    current = np.zeros(c_count, routes.dtype)
    bad = np.zeros(c_count, bool)
    d_depot = r.dist[0]
    close_eps = r.tw_end[0] + EPS
    limit_eps = r.route_limit + EPS
    for t in range(width + 1):
        active = t <= lengths
        if not active.any():
            break
        a = routes[:, t] if t < width else np.zeros(c_count, routes.dtype)
        a = np.where(t < lengths, a, 0)
        is_depot = a == 0
        q = r.demand[a]
        d = r.dist[current, a]
        # env.violations, the row of node a.
        broken = load + EPS < q                                                     # capacity
        if r.has_backhaul:
            on_board = load if paper else picked
            broken |= on_board - q > ONE_EPS                                        # backhaul_overload
            if classic:
                broken |= ~is_depot & np.where(q < 0, current == 0, picked > 0)     # backhaul_order
        if r.has_limit:
            if r.is_open:
                broken |= (length + d > limit_eps) & ~is_depot
            else:
                broken |= length + d + d_depot[a] > limit_eps
        if r.has_tw:
            start = np.maximum(time + d, r.tw_start[a])
            late = start > r.tw_end[a] + EPS
            broken |= late & ~is_depot if r.is_open else late
            if not r.is_open:
                broken |= start + r.service_time[a] + d_depot[a] > close_eps      # depot_closing
        bad |= active & broken
        # env.step to a customer (the return to the depot ends the route; nothing after it is checked).
        delivered = delivered + np.maximum(q, F32(0.0))
        picked = picked + np.maximum(-q, F32(0.0))
        peak = np.maximum(peak, picked - delivered)
        length = length + d
        if r.has_tw:
            time = np.maximum(time + d, r.tw_start[a]) + r.service_time[a]
        if paper:
            load = load - q
        else:
            load = F32(1.0) - delivered - (peak if mixed else F32(0.0))
        current = a
    return ~bad


def pad_routes(routes: Sequence[Sequence[int]], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Lists of customers -> (int32 (R, width) padded with the depot, lengths int32 (R,))."""
    lengths = np.array([len(t) for t in routes], np.int32)
    width = max(int(lengths.max(initial=0)), 1) if width is None else width
    out = np.zeros((len(routes), width), np.int32)
    for i, t in enumerate(routes):
        out[i, :len(t)] = t
    return out, lengths


def solution_order(rules: RouteRules, routes: Sequence[Sequence[int]]) -> list[list[int]]:
    """The routes (empty ones dropped) in the order the environment serves them as given: with backhauls under
    the paper's rule, the routes holding a linehaul first, then those of backhauls only (they leave empty once
    every linehaul is served); otherwise as given."""
    routes = [list(map(int, t)) for t in routes if len(t)]
    if not (rules.has_backhaul and rules.backhaul_rule == PAPER_RULE):
        return routes
    full = [bool(np.any(rules.demand[t] > 0)) for t in routes]
    return [t for t, f in zip(routes, full) if f] + [t for t, f in zip(routes, full) if not f]
