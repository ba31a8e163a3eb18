"""Solution checker: replay routes through the environment and report feasibility and cost.

A route is a flat list of node indices with 0 between sub-tours, as in the paper's solution files: the
leading depot is omitted (a leading 0 is accepted too) and the final return to the depot is implied (a
trailing 0 is accepted too). Replaying uses exactly the environment's masks, so "feasible" means "a
policy acting in our environment could have produced this route".
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mvmoe_jax import env
from mvmoe_jax.instances import Instance
from mvmoe_jax.problems import CLASSIC_RULE, PAPER_RULE

# Rule index returned for a route that ends before every customer is served.
UNSERVED = len(env.RULES)
RULE_NAMES = env.RULES + ("unserved_customers",)


class InfeasibleInstanceError(ValueError):
    """An instance has a customer that no route can serve."""


class RouteVerificationError(RuntimeError):
    """A route that a solver or decoder produced is infeasible, or its reported cost is not the
    environment's: a bug in whatever produced it, never a property of the instance."""


@dataclasses.dataclass(frozen=True)
class RouteCheck:
    """Outcome of replaying one route.

    feasible:  every move allowed by the environment and every customer served.
    violation: name of the first rule broken (``RULE_NAMES``), or None.
    position:  index in the route of the first infeasible move (None if feasible or only unserved).
    node:      the node that move went to.
    cost:      the route's cost under the environment (open variants: moves into the depot cost 0),
               computed whether or not the route is feasible.
    """

    feasible: bool
    violation: str | None
    position: int | None
    node: int | None
    cost: float


def _normalise(route: Sequence[int], num_customers: int, index: int) -> list[int]:
    try:
        nodes = [int(v) for v in route]
    except (TypeError, ValueError):
        raise ValueError(f"route {index}: node indices must be integers") from None
    if nodes and nodes[0] == 0:
        nodes = nodes[1:]
    bad = [v for v in nodes if not 0 <= v <= num_customers]
    if bad:
        raise ValueError(f"route {index}: node index {bad[0]} out of range 0..{num_customers}")
    if not nodes or nodes[-1] != 0:
        nodes.append(0)
    return nodes


def _pad_routes(routes: Sequence[Sequence[int]], num_customers: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 (B, T) routes padded with the depot, and their true lengths (B,). T rounds up to 16 so
    that datasets of similar route lengths share one compiled replay."""
    norm = [_normalise(r, num_customers, i) for i, r in enumerate(routes)]
    lengths = np.array([len(r) for r in norm], np.int32)
    width = int(-(-max(lengths.max(), 1) // 16) * 16)
    padded = np.zeros((len(norm), width), np.int32)
    for i, r in enumerate(norm):
        padded[i, :len(r)] = r
    return padded, lengths


@jax.jit
def _replay(inst: Instance, actions: jax.Array, length: jax.Array):
    """One route: actions int (T,), valid prefix ``length``. Returns (rule, position, finished, cost)."""
    def body(carry, xs):
        state, rule, pos = carry
        t, a = xs
        broken = env.violations(state)[:, a]                       # (num_rules,)
        first = jnp.argmax(broken)
        new_fault = (t < length) & jnp.any(broken) & (rule < 0)
        rule = jnp.where(new_fault, first, rule)
        pos = jnp.where(new_fault, t, pos)
        # Past the route's end only depot moves remain; they cost nothing once finished.
        state = jax.tree.map(lambda new, old: jnp.where(t < length, new, old), env.step(state, a), state)
        return (state, rule, pos), None

    init = (env.reset(inst), jnp.int32(-1), jnp.int32(-1))
    steps = jnp.arange(actions.shape[0], dtype=jnp.int32)
    (state, rule, pos), _ = jax.lax.scan(body, init, (steps, actions))
    return rule, pos, state.finished, state.cost


_replay_batch = jax.jit(jax.vmap(_replay))


def check_routes(instances: Instance, routes: Sequence[Sequence[int]]) -> list[RouteCheck]:
    """Check one route per instance of a batched Instance (leading batch axis)."""
    n_inst = instances.locs.shape[0]
    if len(routes) != n_inst:
        raise ValueError(f"{len(routes)} routes for {n_inst} instances")
    padded, lengths = _pad_routes(routes, instances.locs.shape[1] - 1)
    rule, pos, finished, cost = jax.device_get(
        _replay_batch(instances, jnp.asarray(padded), jnp.asarray(lengths)))
    out = []
    for i in range(n_inst):
        r = int(rule[i])
        if r < 0 and not finished[i]:
            r = UNSERVED
        if r < 0:
            out.append(RouteCheck(True, None, None, None, float(cost[i])))
        elif r == UNSERVED:
            out.append(RouteCheck(False, RULE_NAMES[r], None, None, float(cost[i])))
        else:
            p = int(pos[i])
            out.append(RouteCheck(False, RULE_NAMES[r], p, int(padded[i, p]), float(cost[i])))
    return out


def check_route(instance: Instance, route: Sequence[int]) -> RouteCheck:
    """Check one route on a single (unbatched) Instance."""
    batched = jax.tree.map(lambda x: jnp.asarray(x)[None], instance)
    return check_routes(batched, [route])[0]


def verify_routes(instances: Instance, routes: Sequence[Sequence[int]], costs, *, source: str,
                  rtol: float = 1e-5, error: type[RouteVerificationError] = RouteVerificationError
                  ) -> list[RouteCheck]:
    """Replay every route; raise ``error`` naming the instances whose route is infeasible or whose
    reported cost differs from the checker's by more than ``rtol`` (relative). Returns the checks."""
    checks = check_routes(instances, routes)
    bad = []
    for i, (c, cost) in enumerate(zip(checks, costs)):
        if not c.feasible:
            bad.append(f"instance {i}: {c.violation} at position {c.position} (node {c.node})")
        elif abs(c.cost - float(cost)) > rtol * max(abs(c.cost), 1e-12):
            bad.append(f"instance {i}: reported cost {float(cost):.7f} but the checker's is {c.cost:.7f}")
    if bad:
        raise error(f"{source}: {len(bad)} of {len(checks)} routes fail the environment's checker: "
                    + "; ".join(bad[:5]))
    return checks


def split_subtours(route: Sequence[int]) -> list[list[int]]:
    """[a, b, 0, c] -> [[a, b], [c]] (empty sub-tours dropped)."""
    tours, cur = [], []
    for v in route:
        if int(v) == 0:
            if cur:
                tours.append(cur)
            cur = []
        else:
            cur.append(int(v))
    if cur:
        tours.append(cur)
    return tours


# How a file's best-known costs count an edge of Euclidean length d (``tours_cost``): ``exact`` d itself; ``nint``
# d rounded to the nearest integer (CVRPLIB's EUC_2D, e.g. Set X); ``dimacs`` d truncated to one decimal (the
# DIMACS challenge's rule, used by CVRPLIB for the Solomon and Gehring-Homberger VRPTW sets).
COST_CONVENTIONS = ("exact", "nint", "dimacs")


def edge_units(d: float, convention: str) -> float:
    """An edge of Euclidean length ``d`` under ``convention`` (``COST_CONVENTIONS``), in units of the convention's
    resolution: d for ``exact``, the integer nearest d for ``nint``, the tenths of d truncated for ``dimacs``."""
    if convention == "exact":
        return d
    if convention == "nint":
        return math.floor(d + 0.5)
    if convention == "dimacs":
        return math.floor(10.0 * d)
    raise ValueError(f"unknown cost convention {convention!r}; choose one of {', '.join(COST_CONVENTIONS)}")


def tours_cost(coords: np.ndarray, routes: Sequence[Sequence[int]], is_open: bool, rounded: bool = False, *,
               convention: str | None = None) -> float:
    """The cost of ``routes`` (lists of customers 1..n) on coordinates float64 (n+1, 2), depot first: the depot
    closing every route unless routes are open, each edge counted under ``convention`` (``COST_CONVENTIONS``;
    default ``exact``, or ``nint`` with ``rounded``). Under ``dimacs`` the sum is of whole tenths, so it is
    exact to one decimal."""
    convention = convention or ("nint" if rounded else "exact")
    total = 0.0
    for tour in routes:
        seq = [0, *tour] + ([] if is_open else [0])
        for a, b in zip(seq[:-1], seq[1:]):
            total += edge_units(math.dist(coords[a], coords[b]), convention)
    return total / 10.0 if convention == "dimacs" else total


def actions_to_route(actions) -> list[int]:
    """A decoded action sequence (depot-padded, starting after the forced depot move) -> the paper's
    flat route format: repeated depots collapsed, leading and trailing depots dropped."""
    out: list[int] = []
    for v in np.asarray(actions).tolist():
        if v == 0 and (not out or out[-1] == 0):
            continue
        out.append(int(v))
    while out and out[-1] == 0:
        out.pop()
    return out


def _allowed(state: env.State, j) -> jax.Array:
    """bool (): no rule of ``env.violations`` forbids the move to node j."""
    return ~jnp.any(env.violations(state)[:, j])


def _depot_roundtrip_ok(inst: Instance) -> jax.Array:
    """bool (n,) for one instance: can customer i be served on a route of its own?

    Linehauls, and backhauls under the mixed rule, from the full vehicle at the depot; backhauls under the paper
    rule from the state the environment reaches once every linehaul is served (at the depot, leaving empty).
    Under the classic rule a backhaul needs a linehaul before it: see ``_classic_backhaul_ok``.
    """
    start = env.reset(inst)
    empty = start.replace(visited=start.visited | (inst.demand > 0), load=jnp.float32(0.0))
    paper = inst.backhaul_rule == PAPER_RULE

    def one(i):
        s = jax.tree.map(lambda a, b: jnp.where(paper & (inst.demand[i] < 0), a, b), empty, start)
        return _allowed(s, i) & _allowed(env.step(s, i), 0)

    return jax.vmap(one)(jnp.arange(1, inst.locs.shape[0]))


def _classic_backhaul_ok(inst: Instance) -> jax.Array:
    """bool (n,) for one instance under the classic rule: customer i can be served on a route of one linehaul l
    and then i (for a linehaul, on its own). Every rule is checked at each move; the move to i already
    ensures the way back to the depot (closed routes), and an open route needs none. O(n^2) per instance."""
    start = env.reset(inst)
    customers = jnp.arange(1, inst.locs.shape[0])
    first = jax.vmap(lambda l: _allowed(start, l))(customers) & (inst.demand[1:] >= 0)          # (n,)
    then = jax.vmap(lambda l: ~jnp.any(env.violations(env.step(start, l)), axis=0)[1:])(customers)  # (n, n)
    via_linehaul = jnp.any(first[:, None] & then, axis=0)
    return jnp.where(inst.demand[1:] < 0, via_linehaul, _depot_roundtrip_ok(inst))


_unreachable_any_rule = jax.jit(jax.vmap(lambda inst: ~_depot_roundtrip_ok(inst)))
_unreachable_classic = jax.jit(jax.vmap(lambda inst: jnp.where(
    (inst.backhaul_rule == CLASSIC_RULE) & inst.has_backhaul, ~_classic_backhaul_ok(inst), ~_depot_roundtrip_ok(inst))))


def needs_classic_check(inst: Instance) -> bool:
    """Whether any instance of ``inst`` (single or batched) has backhauls under the classic rule (host-side)."""
    return bool(np.any((np.asarray(inst.backhaul_rule) == CLASSIC_RULE) & np.asarray(inst.has_backhaul)))


def unreachable_customers(inst: Instance) -> jax.Array:
    """bool (B, n): customers no route of this environment can serve (a batched Instance)."""
    return (_unreachable_classic if needs_classic_check(inst) else _unreachable_any_rule)(inst)


def validate_instances(inst: Instance, source: str = "dataset") -> None:
    """Raise InfeasibleInstanceError naming instances with a customer no route can serve (the decoder
    would otherwise meet a state with no feasible move)."""
    bad = np.asarray(unreachable_customers(inst))
    if bad.any():
        rows = np.flatnonzero(bad.any(1))
        detail = "; ".join(f"instance {r}: customers {(np.flatnonzero(bad[r]) + 1).tolist()[:8]}"
                           for r in rows[:5])
        raise InfeasibleInstanceError(
            f"{source}: {len(rows)} instance(s) have customers that cannot be served even on a route of their "
            f"own (demand over capacity, window closed before arrival, or route limit too short): {detail}")


def unservable_reasons(inst: Instance, *, scale: float = 1.0, node_name=lambda i: f"customer {i}") -> list[str]:
    """One sentence per customer of ONE (unbatched) instance that no route can serve
    (``unreachable_customers``, the authority), naming why: its demand or pickup exceeds the capacity, its
    time window closes before a vehicle from the depot can arrive, it cannot be served and the vehicle be
    back before the depot closes, or its round trip from the depot is longer than the route limit.
    Distances and times are multiplied by ``scale`` (a reader's factor back to the file's units);
    ``node_name(i)`` names customer i (1..n) as the file numbers it. Empty when every customer is servable.
    Without time windows and route limits only the capacity can stand in the way, and that is checked without
    compiling the replay."""
    if bool(inst.has_tw) or bool(inst.has_limit) or needs_classic_check(inst):
        batched = jax.tree.map(lambda x: jnp.asarray(x)[None], inst)
        bad = np.flatnonzero(np.asarray(unreachable_customers(batched))[0]) + 1
    else:
        bad = np.flatnonzero(np.abs(np.asarray(inst.demand, np.float64)[1:]) > 1 + env.EPS) + 1
    if bad.size == 0:
        return []
    f = {k: np.asarray(getattr(inst, k), np.float64) for k in ("locs", "demand", "service_time", "tw_start",
                                                               "tw_end", "route_limit")}
    is_open, has_tw, has_limit = (bool(getattr(inst, k)) for k in ("is_open", "has_tw", "has_limit"))
    classic = needs_classic_check(inst)
    d0 = np.sqrt(((f["locs"] - f["locs"][0]) ** 2).sum(-1))
    eps = env.EPS
    out = []
    for i in bad.tolist():
        d, q = d0[i], f["demand"][i]
        start = max(d, f["tw_start"][i])
        if abs(q) > 1 + eps:
            why = f"its {'pickup' if q < 0 else 'demand'} is {abs(q):.4g} times the vehicle capacity"
        elif has_tw and d > f["tw_end"][i] + eps:
            why = (f"its time window closes at {f['tw_end'][i] * scale:.6g}, before a vehicle from the depot "
                   f"can arrive (travel time {d * scale:.6g})")
        elif has_tw and not is_open and start + f["service_time"][i] + d > f["tw_end"][0] + eps:
            why = (f"a vehicle serving it is back at the depot at {(start + f['service_time'][i] + d) * scale:.6g} "
                   f"at the earliest, after the depot closes at {f['tw_end'][0] * scale:.6g}")
        elif q < 0 and classic and not np.any(f["demand"][1:] >= 0):
            why = "under the classic backhaul rule a route starts with a linehaul, and the instance has none"
        elif has_limit and (d if is_open else 2 * d) > f["route_limit"] + eps:
            trip = "the way from the depot" if is_open else "its round trip from the depot"
            why = (f"{trip} ({(d if is_open else 2 * d) * scale:.6g}) is longer than the route limit "
                   f"{f['route_limit'] * scale:.6g}")
        elif q < 0 and classic:
            why = ("under the classic backhaul rule it must follow a linehaul, and no route of one linehaul and it "
                   "keeps the time windows and the route limit")
        else:
            why = "no route of its own can serve it under the environment's rules"
        out.append(f"{node_name(i)}: {why}")
    return out
