"""PyVRP (hybrid genetic search, pyvrp 0.12) for the 8 variants it expresses exactly: no backhauls.

PyVRP's pickup model (load = deliveries still on board + pickups so far <= capacity) is not the
environment's backhaul rule (the vehicle leaves full whatever its route delivers), so B variants are
refused (``UnsupportedVariantError``); use OR-Tools for them.

Model, integers as in ``common`` (1e7 units per unit of distance / time):

* distance matrix: Euclidean; with O the arcs into the depot are 0. With L it is rounded UP (it is both
  the cost and the route-length constraint, ``max_distance`` = limit rounded down); without L to nearest.
* C: delivery demands, exact integers over the recovered integer capacity (rounded up otherwise), both
  multiplied by one integer factor so that loads and distances have similar magnitudes (PyVRP's
  penalty manager needs that).
* TW: duration matrix rounded up (arcs into the depot 0 with O), service times rounded up, opening times
  up, closing times down; closed routes: the vehicle's shift and the depot end at the depot's closing
  time, and a customer's latest start also leaves time to serve it and drive back (rule 6).
"""

from __future__ import annotations

import math

import numpy as np

from mvmoe_jax.baselines import common
from mvmoe_jax.baselines.common import Problem, SolveResult

NAME = "pyvrp"
INT_MAX = np.iinfo(np.int64).max


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
    if problem.has_backhaul:
        raise common.UnsupportedVariantError(
            f"PyVRP cannot express the environment's backhaul rule exactly ({problem.variant}, instance "
            f"{problem.index}); use --solver=ortools for variants with B")


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
    if not exact:   # round deliveries up: a route within capacity in integers is within it in reals
        units = np.ceil(p.demand * cap - 1e-6).astype(np.int64)
    units[0] = 0
    # Same order of magnitude for loads as for distances, or PyVRP's penalties cannot balance them
    # (exact integer multiples: the capacity constraint is unchanged).
    factor = max(1, common.SCALE // int(cap))
    units, cap = units * factor, int(cap) * factor

    limited = p.has_limit and math.isfinite(p.route_limit)
    distance = _ceil(cdist) if limited else np.rint(dist * common.SCALE).astype(np.int64)
    if p.is_open:
        distance[:, 0] = 0
    np.fill_diagonal(distance, 0)

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
        clients.append(pyvrp.Client(x=float(p.locs[j, 0]), y=float(p.locs[j, 1]), delivery=[int(units[j])],
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
        if not best.is_feasible():
            raise common.InfeasibleInstanceError(
                f"instance {problem.index}: PyVRP found no feasible solution in {time_limit} s; "
                "give it more time (--time_limit)")
        tours = [list(map(int, r.visits())) for r in best.routes()]
    route = common.flatten_tours(tours)
    return SolveResult(index=problem.index, route=route, cost=common.route_cost(problem, route),
                       solver_objective=float(res.cost()) / common.SCALE, seconds=timer.seconds)


def solve(instances, *, time_limit: float = 5.0, workers: int = 1, progress: bool = True, check: bool = True,
          seed: int = 0) -> common.Solutions:
    """Solve every instance of a batched Instance (variants without B) with PyVRP."""
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
