"""PyVRP (hybrid genetic search, pyvrp 0.12) for what it expresses exactly: the 8 variants without backhauls, and
the B variants under the classic and mixed backhaul rules (``docs/environment.md``).

PyVRP's pickup model (load = deliveries still on board + pickups so far <= capacity) is the mixed rule. It is
not the paper's rule (the vehicle leaves full whatever its route delivers), so B variants under that rule are
refused (``UnsupportedVariantError``); use OR-Tools for them. The classic rule adds an order (every linehaul
before any backhaul, a route opens with a linehaul), which PyVRP has no constraint for: as its own VRPLIB
reader does for ``TYPE: VRPB``, the arcs depot -> backhaul and backhaul -> linehaul get the prohibitive
distance ``pyvrp.constants.MAX_VALUE`` (2^44, far above any route's cost), and a solution using one is
refused as no solution. With the order kept, the load on board peaks at the route's deliveries or its
pickups, so the pickup model's capacity is the classic rule's.

Model, integers as in ``common`` (1e7 units per unit of distance / time):

* distance matrix: Euclidean; with O the arcs into the depot are 0. With L it is rounded UP (it is both
  the cost and the route-length constraint, ``max_distance`` = limit rounded down); without L to nearest.
* C: delivery demands (backhauls: pickup amounts), exact integers over the recovered integer capacity (rounded up otherwise), both
  multiplied by one integer factor so that loads and distances have similar magnitudes (PyVRP's
  penalty manager needs that).
* TW: duration matrix rounded up (arcs into the depot 0 with O), service times rounded up, opening times
  up, closing times down; closed routes: the vehicle's shift and the depot end at the depot's closing
  time, and a customer's latest start also leaves time to serve it and drive back (rule 6).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mvmoe_jax.baselines import common
from mvmoe_jax.baselines.common import Problem, SolveResult
from mvmoe_jax.problems import CLASSIC_RULE, PAPER_RULE

NAME = "pyvrp"
INT_MAX = np.iinfo(np.int64).max
MAX_VALUE = 1 << 44      # pyvrp.constants.MAX_VALUE: the prohibitive arc distance PyVRP's reader uses for VRPB


def _import():
    try:
        import pyvrp
        import pyvrp.stop
    except ImportError as e:  # pragma: no cover - depends on the install
        raise common.SolverUnavailableError(
            "PyVRP is not installed (a dependency of mvmoe-jax: reinstall with pip install -e .) "
            f"(or pip install pyvrp) ({e})") from None
    return pyvrp


def check_supported(problem: Problem) -> None:
    if problem.has_backhaul and problem.backhaul_rule == PAPER_RULE:
        raise common.UnsupportedVariantError(
            f"PyVRP cannot express the paper's backhaul rule exactly ({problem.variant}, instance "
            f"{problem.index}): its vehicle leaves with the route's deliveries; use --solver=ortools, or the "
            "classic or mixed rule")


def _ceil(x) -> np.ndarray:
    return np.ceil(np.asarray(x, np.float64) * common.SCALE - 1e-6).astype(np.int64)


def _floor(x) -> np.ndarray:
    return np.floor(np.asarray(x, np.float64) * common.SCALE + 1e-6).astype(np.int64)


def build_data(problem: Problem):
    """pyvrp.ProblemData for one problem (locations: depot 0, clients 1..n, as in the environment)."""
    pyvrp = _import()
    check_supported(problem)
    p = problem
    n = p.num_customers
    dist = p.distances()
    cdist = p.constraint_distances()
    units, cap, exact = common.demand_units(p.demand)
    if not exact:   # round deliveries and pickups up: a route within capacity in integers is within it in reals
        units = np.sign(p.demand) * np.ceil(np.abs(p.demand) * cap - 1e-6)
        units = units.astype(np.int64)
    units[0] = 0
    classic = p.has_backhaul and p.backhaul_rule == CLASSIC_RULE
    # Same order of magnitude for loads as for distances, or PyVRP's penalties cannot balance them
    # (exact integer multiples: the capacity constraint is unchanged).
    factor = max(1, common.SCALE // int(cap))
    units, cap = units * factor, int(cap) * factor

    limited = p.has_limit and math.isfinite(p.route_limit)
    distance = _ceil(cdist) if limited else np.rint(dist * common.SCALE).astype(np.int64)
    if p.is_open:
        distance[:, 0] = 0
    np.fill_diagonal(distance, 0)
    if classic:     # the order, as prohibitive arcs: depot -> backhaul, backhaul -> linehaul (demand >= 0)
        back = units < 0
        line = (units >= 0) & (np.arange(n + 1) > 0)
        distance[0, back] = MAX_VALUE
        distance[np.ix_(back, line)] = MAX_VALUE

    if p.has_tw:
        duration = _ceil(cdist)
        if p.is_open:
            duration[:, 0] = 0
        np.fill_diagonal(duration, 0)
        service = _ceil(p.service_time)
        early = _ceil(p.tw_start)
        late = _floor(p.tw_end)
        close = int(_floor(p.tw_end[0]))
    else:
        duration = np.zeros_like(distance)
        service = np.zeros(n + 1, np.int64)
        early = np.zeros(n + 1, np.int64)
        late = np.full(n + 1, INT_MAX, np.int64)
        close = INT_MAX

    clients = []
    for j in range(1, n + 1):
        tw_late = int(late[j])
        if p.has_tw and not p.is_open:
            tw_late = min(tw_late, close - int(service[j]) - int(duration[j, 0]))
        if p.has_tw and max(int(early[j]), int(duration[0, j])) > tw_late:
            raise common.InfeasibleInstanceError(
                f"customer {j} cannot be served within its time window even on a route of its own")
        clients.append(pyvrp.Client(x=float(p.locs[j, 0]), y=float(p.locs[j, 1]), delivery=[max(int(units[j]), 0)],
                                    pickup=[max(-int(units[j]), 0)],
                                    service_duration=int(service[j]), tw_early=int(early[j]),
                                    tw_late=tw_late))
    depot_late = close if (p.has_tw and not p.is_open) else INT_MAX
    depots = [pyvrp.Depot(x=float(p.locs[0, 0]), y=float(p.locs[0, 1]), tw_early=0, tw_late=depot_late)]
    vehicle = pyvrp.VehicleType(
        num_available=n, capacity=[int(cap)], tw_early=0, tw_late=depot_late,
        max_distance=int(_floor(p.route_limit)) if limited else INT_MAX)
    return pyvrp.ProblemData(clients=clients, depots=depots, vehicle_types=[vehicle],
                             distance_matrices=[distance], duration_matrices=[duration])


def solve_problem(problem: Problem, time_limit: float = 5.0, seed: int = 0) -> SolveResult:
    """Solve one problem with PyVRP's hybrid genetic search for ``time_limit`` seconds."""
    pyvrp = _import()
    common.time_limit_ms(time_limit)
    with common.Timer() as timer:
        data = build_data(problem)
        res = pyvrp.solve(data, stop=pyvrp.stop.MaxRuntime(float(time_limit)), seed=int(seed),
                          collect_stats=False, display=False)
        best = res.best
        if not best.is_feasible() or best.distance() >= MAX_VALUE:
            raise common.InfeasibleInstanceError(
                f"instance {problem.index}: PyVRP found no feasible solution in {time_limit} s; "
                "give it more time (--time_limit)")
        tours = [list(map(int, r.visits())) for r in best.routes()]
    route = common.flatten_tours(tours)
    return SolveResult(index=problem.index, route=route, cost=common.route_cost(problem, route),
                       solver_objective=float(res.cost()) / common.SCALE, seconds=timer.seconds)


def solve(instances, *, time_limit: float = 5.0, workers: int = 1, progress: bool = True, check: bool = True,
          seed: int = 0) -> common.Solutions:
    """Solve every instance of a batched Instance (variants without B, or with B under the classic or mixed
    rule) with PyVRP."""
    _import()
    common.time_limit_ms(time_limit)
    problems = common.problems_from_instances(instances)
    for p in problems:
        check_supported(p)
    results = common.run_parallel(solve_problem, problems, workers=workers, progress=progress, desc="PyVRP",
                                  time_limit=time_limit, seed=seed)
    sols = common.collect(NAME, results)
    if check:
        common.verify(instances, sols)
    return sols


@dataclasses.dataclass(frozen=True)
class VrplibVerdict:
    """PyVRP's verdict on routes for a VRPLIB file (``check_vrplib_routes``).

    feasible: PyVRP's ``Solution.is_feasible()`` (capacity, time windows, distance limits, every required client
              served) and, for ``TYPE: VRPB``, no arc that PyVRP's reader prices at ``MAX_VALUE`` (depot to
              backhaul, backhaul to linehaul: the order it enforces only through that price).
    distance: the routes' distance as PyVRP computes it on the file's data (edges rounded by ``round_func``).
    reason:   why not feasible, else None.
    """

    feasible: bool
    distance: float
    reason: str | None = None


def check_vrplib_routes(path, routes, round_func: str = "round") -> VrplibVerdict:
    """Ask PyVRP whether ``routes`` (lists of customers numbered 1..n in file order after the depot, as in VRPLIB
    ``.sol`` files and the solver's output) are feasible for the VRPLIB file at ``path``, read by ``pyvrp.read``
    with ``round_func`` (``round``: every edge rounded to the nearest integer, CVRPLIB's convention). Routes
    that are not a solution at all (a customer out of range or twice) raise ValueError."""
    pyvrp = _import()
    data = pyvrp.read(str(path), round_func=round_func)
    tours = [[int(v) for v in r] for r in routes if len(r)]
    bad = [v for r in tours for v in r if not 1 <= v <= data.num_clients]
    if bad:
        raise ValueError(f"{path}: customer {bad[0]} out of range 1..{data.num_clients}")
    seen = [v for r in tours for v in r]
    if len(seen) != len(set(seen)):
        raise ValueError(f"{path}: a customer is visited twice")
    try:
        sol = pyvrp.Solution(data, tours)
    except (RuntimeError, ValueError, IndexError) as e:
        raise ValueError(f"{path}: PyVRP refuses the routes ({e})") from None
    distance = float(sol.distance())
    reasons = []
    if sol.has_excess_load():
        reasons.append(f"excess load {list(sol.excess_load())}")
    if sol.has_time_warp():
        reasons.append(f"time warp {sol.time_warp()}")
    if sol.has_excess_distance():
        reasons.append(f"excess distance {sol.excess_distance()}")
    if not sol.is_complete():
        reasons.append(f"{sol.num_missing_clients()} customers not served")
    if distance >= MAX_VALUE:
        reasons.append("an arc PyVRP prohibits (a route opening with a backhaul, or a linehaul after a backhaul)")
    feasible = bool(sol.is_feasible()) and distance < MAX_VALUE
    return VrplibVerdict(feasible=feasible, distance=distance,
                         reason=None if feasible else ("; ".join(reasons) or "PyVRP reports the solution infeasible"))
