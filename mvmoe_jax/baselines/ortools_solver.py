"""OR-Tools routing model of all 16 variants, under exactly the environment's semantics.

Model (``docs/environment.md``; integers as explained in ``common``):

* Arc cost: Euclidean distance; with O, arcs into the depot cost 0.
* Capacity and backhauls under the paper's rule (and without backhauls), one dimension ``net`` = linehaul delivered - backhaul picked up on the route,
  i.e. 1 - load in the environment's terms. Its transit on arc i -> j is the demand of j (backhauls
  negative), it has no slack and every customer's value must stay in [0, capacity]: the environment
  requires load >= d_j before a linehaul (net <= 1 after it) and load - d_j <= 1 at a backhaul (net >= 0
  after it), nothing else. Linehauls and backhauls may therefore mix on a route in any order that keeps
  net in [0, 1]; a route can never open with a backhaul.
  The environment's vehicle leaves full (net 0) while any linehaul is unserved and empty (net = 1 in
  these terms) once all are. So there are two vehicle types: type A, one vehicle per non-backhaul
  customer, starting at net 0; and (B only) type B, one per backhaul, starting at net = capacity and
  barred from linehauls. Type-B routes are output after every type-A route, i.e. once every linehaul
  has been served, which is exactly when the environment's vehicle leaves empty. (The vehicle leaving
  full whatever it delivers means a route's linehauls may even total more than the capacity when
  backhauls are picked up in between; the paper's OR-Tools model instead let the vehicle leave with any
  load, which is looser.) Without B this is the usual capacity dimension.
* Classic backhaul rule (every linehaul before any backhaul, a route opens with a linehaul, deliveries and
  pickups each within the capacity): dimensions ``delivered`` and ``picked`` within the capacity, and
  ``order``, which counts the customers before a node with a backhaul weighing n + 1: at most n at a
  linehaul (no backhaul before it), at least 1 at a backhaul (the route did not open with it). One vehicle
  per linehaul.
* Mixed backhaul rule (any order, the vehicle leaves with the route's deliveries, the load on board within
  the capacity): dimension ``load`` (minus deliveries, plus pickups) within [0, capacity], whose value at
  the route's start is constrained equal to the route's deliveries (dimension ``delivered`` at its end).
  One vehicle per customer.
* L: dimension ``length`` (arc lengths rounded up; with O, arcs into the depot are 0), at most the limit
  rounded down at every node; closed routes also need length + d(j, 0) <= limit at every customer j
  (rule 4, set as a per-node bound).
* TW: dimension ``time`` = start of service, transit i -> j = s_i + d(i, j) rounded up, waiting as
  slack, start of service in [e_j, l_j] (rule 5); closed routes also need start_j + s_j + d(j, 0) <= the
  depot's closing time at every customer (rule 6) and the return by then. Open routes: arcs into the
  depot take no time and the depot does not close.

Search: parallel cheapest insertion, then guided local search until the time limit.
"""

from __future__ import annotations

import math

import numpy as np

from mvmoe_jax.baselines import common
from mvmoe_jax.baselines.common import Problem, SolveResult
from mvmoe_jax.problems import CLASSIC_RULE, MIXED_RULE, PAPER_RULE

NAME = "ortools"


def _import():
    try:
        from ortools.constraint_solver import pywrapcp, routing_enums_pb2
    except ImportError as e:  # pragma: no cover - depends on the install
        raise common.SolverUnavailableError(
            "OR-Tools is not installed (a dependency of mvmoe-jax: reinstall with pip install -e .) "
            f"(or pip install ortools) ({e})") from None
    return pywrapcp, routing_enums_pb2


def _ceil(x) -> np.ndarray:
    # Guard against 0.30000000000000004-style products tipping a whole unit up: subtract a hair first.
    return np.ceil(np.asarray(x, np.float64) * common.SCALE - 1e-6).astype(np.int64)


def _floor(x) -> np.ndarray:
    return np.floor(np.asarray(x, np.float64) * common.SCALE + 1e-6).astype(np.int64)


def _paper_load(manager, routing, units, cap, linehauls, num_a, num_b, free_start_load):
    """Paper rule (and no backhauls): one dimension ``net`` = delivered - picked up on the route, transit the
    demand of the node arrived at, within [0, capacity] everywhere; type-A vehicles start at 0 (full),
    type-B ones (backhauls only, after every linehaul) at the capacity (empty)."""
    n1 = len(units)
    num_vehicles = num_a + num_b
    net = np.broadcast_to(units[None, :], (n1, n1)).astype(np.int64)
    net_cb = routing.RegisterTransitMatrix(net.tolist())
    routing.AddDimension(net_cb, 0, int(cap), False, "net")
    net_dim = routing.GetDimensionOrDie("net")
    for v in range(num_vehicles):
        if v < num_a and free_start_load:
            net_dim.CumulVar(routing.Start(v)).SetRange(0, int(cap))
        else:
            net_dim.CumulVar(routing.Start(v)).SetValue(0 if v < num_a else int(cap))
    if num_b:
        type_b = list(range(num_a, num_vehicles))
        for j in linehauls:
            if units[j] == 0:
                continue
            routing.VehicleVar(manager.NodeToIndex(j)).RemoveValues(type_b)


def _classic_load(manager, routing, units, cap, linehauls, backhauls):
    """Classic rule: dimensions ``delivered`` and ``picked`` (transit: what the node left delivers / picks up),
    each within the capacity, and ``order``: transit 1 out of a linehaul, n + 1 out of a backhaul, so the value
    on arriving at a node counts the customers before it with every backhaul weighing more than all linehauls
    together. A linehaul's value at most n: no backhaul before it; a backhaul's at least 1: some customer before
    it, so the route opened with a linehaul."""
    n = len(units) - 1
    deliver = np.maximum(units, 0)
    pick = np.maximum(-units, 0)
    for name, vec in (("delivered", deliver), ("picked", pick)):
        cb = routing.RegisterUnaryTransitVector([int(v) for v in vec])
        routing.AddDimension(cb, 0, int(cap), True, name)
    heavy = n + 1
    order = [0] + [1 if units[j] >= 0 else heavy for j in range(1, n + 1)]
    cb = routing.RegisterUnaryTransitVector(order)
    routing.AddDimension(cb, 0, n + heavy * n, True, "order")
    dim = routing.GetDimensionOrDie("order")
    for j in linehauls:
        dim.CumulVar(manager.NodeToIndex(j)).SetMax(n)
    for j in backhauls:
        dim.CumulVar(manager.NodeToIndex(j)).SetMin(1)


def _mixed_load(manager, routing, units, cap, num_vehicles):
    """Mixed rule: ``load`` = what is on board on arriving at a node (transit: minus the delivery, plus the
    pickup of the node left), within [0, capacity] everywhere, starting at the route's deliveries: the value of
    ``delivered`` (transit: the node's delivery) at the route's end."""
    deliver = np.maximum(units, 0)
    cb = routing.RegisterUnaryTransitVector([int(v) for v in deliver])
    routing.AddDimension(cb, 0, int(cap), True, "delivered")
    cb = routing.RegisterUnaryTransitVector([int(v) for v in -units])
    routing.AddDimension(cb, 0, int(cap), False, "load")
    delivered = routing.GetDimensionOrDie("delivered")
    load = routing.GetDimensionOrDie("load")
    solver = routing.solver()
    for v in range(num_vehicles):
        solver.Add(load.CumulVar(routing.Start(v)) == delivered.CumulVar(routing.End(v)))


def build_model(problem: Problem, *, free_start_load: bool = False):
    """Build the routing model. Returns (manager, routing, info) where info holds what reading the
    solution back needs (vehicle types, the backhaul rule).

    ``free_start_load`` (diagnostics only, NOT the environment's semantics; paper rule only): type-A vehicles
    may leave with any load, i.e. net range <= capacity on every route, the looser backhaul model every route of
    the paper's OR-Tools files satisfies. Its routes generally fail the environment's checker.
    """
    pywrapcp, _ = _import()
    p = problem
    n = p.num_customers
    n1 = n + 1
    dist = p.distances()
    cdist = p.constraint_distances()
    units, cap, exact = common.demand_units(p.demand)
    units[0] = 0
    if not p.has_backhaul and np.any(units < 0):
        raise common.InfeasibleInstanceError("negative demands in a variant without backhauls")
    rule = p.backhaul_rule if p.has_backhaul else PAPER_RULE
    if rule not in (PAPER_RULE, CLASSIC_RULE, MIXED_RULE):
        raise common.BaselineError(f"instance {p.index}: unknown backhaul rule {rule}")
    if free_start_load and rule != PAPER_RULE:
        raise common.BaselineError("free_start_load is a variant of the paper's backhaul rule only")
    # "linehauls" here: every customer that is not a backhaul (a zero demand is neither in the paper's rule,
    # which is fine on either vehicle type, and counts as a linehaul under the classic rule's order).
    linehauls = [j for j in range(1, n1) if units[j] >= 0 or not p.has_backhaul]
    backhauls = [j for j in range(1, n1) if p.has_backhaul and units[j] < 0]
    if rule == PAPER_RULE:
        num_a, num_b = max(len(linehauls), 1), len(backhauls)
    elif rule == CLASSIC_RULE:      # every route starts with a linehaul: at most one route per linehaul
        if not linehauls:
            raise common.InfeasibleInstanceError(
                f"instance {p.index}: classic backhauls without a linehaul customer (a route starts with one)")
        num_a, num_b = len(linehauls), 0
    else:                           # mixed: any customer may be alone on a route
        num_a, num_b = max(n, 1), 0
    num_vehicles = num_a + num_b

    manager = pywrapcp.RoutingIndexManager(n1, num_vehicles, 0)
    routing = pywrapcp.RoutingModel(manager)

    # Arc cost: distance (open: into the depot is free).
    cost = np.rint(dist * common.SCALE).astype(np.int64)
    if p.is_open:
        cost[:, 0] = 0
    cost_cb = routing.RegisterTransitMatrix(cost.tolist())
    routing.SetArcCostEvaluatorOfAllVehicles(cost_cb)

    if rule == PAPER_RULE:
        _paper_load(manager, routing, units, cap, linehauls, num_a, num_b, free_start_load)
    elif rule == CLASSIC_RULE:
        _classic_load(manager, routing, units, cap, linehauls, backhauls)
    else:
        _mixed_load(manager, routing, units, cap, num_vehicles)

    # L: route length limit.
    if p.has_limit and math.isfinite(p.route_limit):
        length = _ceil(cdist)
        if p.is_open:
            length[:, 0] = 0
        limit = int(_floor(p.route_limit))
        len_cb = routing.RegisterTransitMatrix(length.tolist())
        routing.AddDimension(len_cb, 0, limit, True, "length")
        len_dim = routing.GetDimensionOrDie("length")
        for j in range(1, n1):
            ub = limit if p.is_open else limit - int(length[j, 0])
            if ub < length[0, j]:
                raise common.InfeasibleInstanceError(
                    f"customer {j} cannot be served within the route limit even on a route of its own")
            len_dim.CumulVar(manager.NodeToIndex(j)).SetMax(ub)

    # TW: start of service within the window; closed routes back before the depot closes.
    if p.has_tw:
        travel = _ceil(p.service_time[:, None] + cdist)
        if p.is_open:
            travel[:, 0] = 0
        close = int(_floor(p.tw_end[0]))
        horizon = int(_ceil(max(float(p.tw_end.max()), float(p.tw_end[0])) + float(p.service_time.max()) + 2.0))
        time_cb = routing.RegisterTransitMatrix(travel.tolist())
        routing.AddDimension(time_cb, horizon, horizon, False, "time")
        time_dim = routing.GetDimensionOrDie("time")
        early = _ceil(p.tw_start)
        late = _floor(p.tw_end)
        for j in range(1, n1):
            ub = int(late[j])
            if not p.is_open:
                ub = min(ub, close - int(travel[j, 0]))
            if max(int(early[j]), int(travel[0, j])) > ub:
                raise common.InfeasibleInstanceError(
                    f"customer {j} cannot be served within its time window even on a route of its own")
            time_dim.CumulVar(manager.NodeToIndex(j)).SetRange(int(early[j]), ub)
        for v in range(num_vehicles):
            time_dim.CumulVar(routing.Start(v)).SetValue(0)
            if not p.is_open:
                time_dim.CumulVar(routing.End(v)).SetMax(close)

    info = {"num_a": num_a, "num_b": num_b, "exact_demands": exact, "linehauls": linehauls,
            "backhauls": backhauls, "rule": rule}
    return manager, routing, info


def _tours(manager, routing, assignment, num_vehicles: int) -> list[tuple[int, list[int]]]:
    out = []
    for v in range(num_vehicles):
        idx = routing.Start(v)
        tour = []
        idx = assignment.Value(routing.NextVar(idx))
        while not routing.IsEnd(idx):
            tour.append(manager.IndexToNode(idx))
            idx = assignment.Value(routing.NextVar(idx))
        if tour:
            out.append((v, tour))
    return out


def _singleton_routes(info, num_vehicles: int) -> list[list[int]]:
    """Every customer on a route of its own (paper rule: linehauls on type-A vehicles, backhauls on type-B).
    Under the classic rule a backhaul cannot be alone: each follows a linehaul of its own while there are
    enough, the rest are appended to the last of those routes (a start only, which the model may refuse)."""
    routes = [[] for _ in range(num_vehicles)]
    if info["rule"] == CLASSIC_RULE:
        for k, j in enumerate(info["linehauls"]):
            routes[k] = [j]
        for k, j in enumerate(info["backhauls"]):
            routes[min(k, len(info["linehauls"]) - 1)].append(j)
        return routes
    if info["rule"] == MIXED_RULE:
        for k, j in enumerate(sorted(info["linehauls"] + info["backhauls"])):
            routes[k] = [j]
        return routes
    for k, j in enumerate(info["linehauls"]):
        routes[k] = [j]
    for k, j in enumerate(info["backhauls"]):
        routes[info["num_a"] + k] = [j]
    return routes


def model_accepts(problem: Problem, route, *, free_start_load: bool = False) -> bool:
    """Whether the OR-Tools model admits a flat route (for checking the model against the environment).

    Paper rule: each sub-tour goes to a vehicle of the type the environment would start it with: full (type A)
    while a linehaul is unserved when it starts, empty (type B) otherwise. Classic and mixed rules: the sub-tours
    on vehicles 0, 1, ... in turn.
    """
    from mvmoe_jax.checker import split_subtours

    manager, routing, info = build_model(problem, free_start_load=free_start_load)
    num_vehicles = info["num_a"] + info["num_b"]
    routes = [[] for _ in range(num_vehicles)]
    linehaul_left = set(int(j) for j in np.flatnonzero(problem.demand > 0))
    next_a, next_b = 0, info["num_a"]
    for tour in split_subtours(route):
        if linehaul_left or not problem.has_backhaul or info["rule"] != PAPER_RULE:
            if next_a >= info["num_a"]:
                return False
            routes[next_a] = tour
            next_a += 1
        else:
            if next_b >= num_vehicles:
                return False
            routes[next_b] = tour
            next_b += 1
        linehaul_left -= set(tour)
    served = sorted(v for t in routes for v in t)
    if served != list(range(1, problem.num_customers + 1)):
        return False
    return routing.ReadAssignmentFromRoutes(routes, False) is not None


# First-solution strategies tried in turn: where cheapest insertion dead-ends (classic backhauls with time
# windows, whose backhauls need a linehaul before them), building paths arc by arc often still succeeds.
FIRST_SOLUTIONS = ("PARALLEL_CHEAPEST_INSERTION", "PATH_CHEAPEST_ARC", "LOCAL_CHEAPEST_INSERTION")


def solve_problem(problem: Problem, time_limit: float = 20.0, log: bool = False,
                  free_start_load: bool = False) -> SolveResult:
    """Solve one problem: parallel cheapest insertion, then guided local search for ``time_limit`` s. Should the
    insertion find nothing, the other ``FIRST_SOLUTIONS`` and then one route per customer start the search in
    the time left. (``free_start_load``: see ``build_model``; diagnostics only.)"""
    pywrapcp, enums = _import()
    limit_ms = common.time_limit_ms(time_limit)
    with common.Timer() as timer:
        manager, routing, info = build_model(problem, free_start_load=free_start_load)
        num_vehicles = info["num_a"] + info["num_b"]
        start = timer.now()

        def params_for(strategy: str):
            params = pywrapcp.DefaultRoutingSearchParameters()
            params.first_solution_strategy = getattr(enums.FirstSolutionStrategy, strategy)
            params.local_search_metaheuristic = enums.LocalSearchMetaheuristic.GUIDED_LOCAL_SEARCH
            left_ms = limit_ms - int(1000 * (timer.now() - start))
            params.time_limit.FromMilliseconds(max(left_ms, limit_ms // 10, 1))
            params.log_search = bool(log)
            return params

        assignment, status = None, "ok"
        for k, strategy in enumerate(FIRST_SOLUTIONS):
            params = params_for(strategy)
            assignment = routing.SolveWithParameters(params)
            if assignment is not None:
                status = "ok" if k == 0 else f"ok (first solution: {strategy.lower()})"
                break
        if assignment is None:
            # No strategy found a first solution: start the local search from one route per customer instead.
            initial = routing.ReadAssignmentFromRoutes(_singleton_routes(info, num_vehicles), True)
            if initial is None:
                raise common.InfeasibleInstanceError(
                    f"instance {problem.index}: OR-Tools found no solution, and one route per customer "
                    "is infeasible too (a customer no route can serve?)")
            assignment = routing.SolveFromAssignmentWithParameters(initial, params)
            status = "ok (from singleton routes)"
            if assignment is None:
                raise common.InfeasibleInstanceError(f"instance {problem.index}: OR-Tools found no solution")
        objective = assignment.ObjectiveValue() / common.SCALE
        tours = _tours(manager, routing, assignment, num_vehicles)
    # Type-A tours (leaving full) first, then backhaul-only tours of type-B vehicles (leaving empty).
    tours.sort(key=lambda vt: vt[0] >= info["num_a"])
    route = common.flatten_tours([t for _, t in tours])
    cost = common.route_cost(problem, route)
    return SolveResult(index=problem.index, route=route, cost=cost, solver_objective=objective,
                       seconds=timer.seconds, status=status)


def solve(instances, *, time_limit: float = 20.0, workers: int = 1, progress: bool = True,
          check: bool = True) -> common.Solutions:
    """Solve every instance of a batched Instance with OR-Tools; routes are checked against the
    environment (``check``) and come back in the paper's flat format."""
    _import()
    common.time_limit_ms(time_limit)
    problems = common.problems_from_instances(instances)
    results = common.run_parallel(solve_problem, problems, workers=workers, progress=progress,
                                  desc="OR-Tools", time_limit=time_limit)
    sols = common.collect(NAME, results)
    if check:
        common.verify(instances, sols)
    return sols


def _vehicle_routes(problem: Problem, info, route) -> list[list[int]]:
    """A flat route's tours on the model's vehicles: paper rule, tours holding a linehaul on type A (they leave
    full), tours of backhauls only on type B (they leave empty); classic and mixed rules, on vehicles 0, 1, ..."""
    from mvmoe_jax.checker import split_subtours

    routes = [[] for _ in range(info["num_a"] + info["num_b"])]
    next_a, next_b = 0, info["num_a"]
    for tour in split_subtours(route):
        if not problem.has_backhaul or info["rule"] != PAPER_RULE or any(problem.demand[v] > 0 for v in tour):
            routes[next_a], next_a = tour, next_a + 1
        else:
            routes[next_b], next_b = tour, next_b + 1
    return routes


def improve_problem(problem: Problem, route, time_limit: float = 10.0,
                    metaheuristic: str = "GREEDY_DESCENT") -> SolveResult:
    """OR-Tools' local search from a solution (a flat route): ``GREEDY_DESCENT`` stops at the first local optimum of
    its moves, ``GUIDED_LOCAL_SEARCH`` goes on until ``time_limit``. A start its integer model does not accept (a
    time window or limit within rounding, ``status`` says so) comes back unchanged."""
    pywrapcp, enums = _import()
    with common.Timer() as timer:
        manager, routing, info = build_model(problem)
        params = pywrapcp.DefaultRoutingSearchParameters()
        params.local_search_metaheuristic = getattr(enums.LocalSearchMetaheuristic, metaheuristic)
        params.time_limit.FromMilliseconds(common.time_limit_ms(time_limit))
        routing.CloseModelWithParameters(params)
        initial = routing.ReadAssignmentFromRoutes(_vehicle_routes(problem, info, route), True)
        found = None if initial is None else routing.SolveFromAssignmentWithParameters(initial, params)
        if found is None:
            out, status = [int(v) for v in route], "start not accepted by the model"
        else:
            tours = _tours(manager, routing, found, info["num_a"] + info["num_b"])
            tours.sort(key=lambda vt: vt[0] >= info["num_a"])
            out, status = common.flatten_tours([t for _, t in tours]), "ok"
    return SolveResult(index=problem.index, route=out, cost=common.route_cost(problem, out),
                       solver_objective=float("nan"), seconds=timer.seconds, status=status)


def improve(instances, routes, *, time_limit: float = 10.0, metaheuristic: str = "GREEDY_DESCENT",
            workers: int = 1, progress: bool = False, check: bool = True) -> common.Solutions:
    """``improve_problem`` on each instance of a batched Instance from its flat route; checked like ``solve``."""
    _import()
    problems = common.problems_from_instances(instances)
    if len(routes) != len(problems):
        raise common.BaselineError(f"{len(routes)} routes for {len(problems)} instances")
    results = common.run_parallel(_improve_one, [(p, list(map(int, r))) for p, r in zip(problems, routes)],
                                  workers=workers, progress=progress, desc="OR-Tools local search",
                                  time_limit=time_limit, metaheuristic=metaheuristic)
    sols = common.collect(NAME + "_ls", results)
    if check:
        common.verify(instances, sols)
    return sols


def _improve_one(problem_and_route, **kwargs) -> SolveResult:
    problem, route = problem_and_route
    return improve_problem(problem, route, **kwargs)
