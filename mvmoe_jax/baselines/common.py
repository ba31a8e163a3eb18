"""What both reference solvers share: plain-numpy problems, integer scaling, costs, route ordering, the
process pool and the check of every route against the environment.

The solvers work on integers; the environment checks floats (float32, eps = 1e-5, see env.py). Scaling is
chosen so that any route a solver accepts passes the environment's checks:

* travel times, route lengths and time windows: ``SCALE`` (1e7) units per unit of distance / time; in
  constraint dimensions every arc is rounded UP (``ceil``), opening times UP and closing times / limits
  DOWN, so an integer-feasible route is feasible in exact arithmetic, and float32 replay stays within eps.
* demands: the paper's demands are integers over an integer capacity (raw / 30, 40, 50, 70). We recover
  that integer capacity from the normalised float demands (``demand_units``), so loads are exact. Data
  whose demands are not such fractions fall back to 1e8 units per capacity; the worst-case rounding of a
  whole route is then n * 1e-8, far below the environment's eps.

Objective values use distances rounded to the nearest unit; the reported cost is recomputed in float64
from the returned routes with the environment's rule (open variants: moves into the depot cost 0) and is
checked against ``checker.check_routes``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import multiprocessing
import time
from typing import Callable, Sequence

import numpy as np

from mvmoe_jax import checker

SCALE = 10 ** 7                 # integer units per unit of distance / time
FALLBACK_DEMAND_SCALE = 10 ** 8  # units per capacity when demands are not fractions of an integer capacity
MAX_INTEGER_CAPACITY = 10_000


class BaselineError(ValueError):
    """Base class of the errors the reference solvers raise for bad input."""


class UnknownSolverError(BaselineError):
    pass


class UnsupportedVariantError(BaselineError):
    """The solver cannot express this variant exactly (PyVRP and backhauls)."""


class SolverUnavailableError(ImportError):
    """The solver's package (ortools / pyvrp) is not installed."""


class InfeasibleInstanceError(BaselineError, checker.InfeasibleInstanceError):
    """An instance has a customer that no route can serve (also a ``checker.InfeasibleInstanceError``, so
    one ``except`` serves the evaluator's and the solvers' refusals)."""


class InfeasibleSolutionError(checker.RouteVerificationError):
    """A solver returned a route that the environment's checker rejects (a modelling bug)."""


@dataclasses.dataclass
class Problem:
    """One instance as plain float64 numpy (picklable, no JAX), node 0 the depot.

    demand is normalised (capacity 1, backhauls < 0); tw_end[0] is the depot's closing time with TW;
    route_limit is +inf without L; backhaul_rule an index of ``problems.BACKHAUL_RULES`` (0 paper, 1 classic,
    2 mixed; it matters only with backhauls).
    """

    locs: np.ndarray
    demand: np.ndarray
    service_time: np.ndarray
    tw_start: np.ndarray
    tw_end: np.ndarray
    route_limit: float
    is_open: bool
    has_backhaul: bool
    has_limit: bool
    has_tw: bool
    index: int = 0
    backhaul_rule: int = 0

    @property
    def num_customers(self) -> int:
        return self.locs.shape[0] - 1

    @property
    def variant(self) -> str:
        from mvmoe_jax import problems
        return problems.variant_from_flags(self.is_open, self.has_backhaul, self.has_limit, self.has_tw).name

    def distances(self) -> np.ndarray:
        """float64 (n+1, n+1) Euclidean distances (from the float32 coordinates the environment uses)."""
        xy = self.locs
        return np.sqrt(((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1))

    def constraint_distances(self) -> np.ndarray:
        """Distances for constraint dimensions: the larger of the float64 value and the float32 value
        computed as the environment does, so rounding up covers both."""
        d64 = self.distances()
        xy = self.locs.astype(np.float32)
        d32 = np.sqrt(((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1, dtype=np.float32)).astype(np.float64)
        return np.maximum(d64, d32)


def problems_from_instances(instances) -> list[Problem]:
    """A batched Instance (leading batch axis) -> one ``Problem`` per instance."""
    import jax

    host = jax.device_get(instances)
    locs = np.asarray(host.locs, np.float64)
    if locs.ndim != 3:
        raise BaselineError(f"expected a batched Instance (locs (batch, n+1, 2)), got locs {locs.shape}")
    rules = np.asarray(host.backhaul_rule).reshape(-1)
    out = []
    for i in range(locs.shape[0]):
        out.append(Problem(
            locs=locs[i], demand=np.asarray(host.demand[i], np.float64),
            service_time=np.asarray(host.service_time[i], np.float64),
            tw_start=np.asarray(host.tw_start[i], np.float64), tw_end=np.asarray(host.tw_end[i], np.float64),
            route_limit=float(host.route_limit[i]), is_open=bool(host.is_open[i]),
            has_backhaul=bool(host.has_backhaul[i]), has_limit=bool(host.has_limit[i]),
            has_tw=bool(host.has_tw[i]), index=i, backhaul_rule=int(rules[i])))
    return out


def demand_units(demand: np.ndarray) -> tuple[np.ndarray, int, bool]:
    """Normalised demands (n+1,) -> (integer demands int64 (n+1,), integer capacity, exact).

    Finds the smallest integer capacity Q <= 10,000 for which every demand * Q is an integer (up to
    float32 rounding): then the integer model is the environment's exactly. Otherwise demands are rounded
    to 1e8 units per capacity (exact = False).
    """
    d = np.asarray(demand, np.float64)
    if np.any(np.abs(d) > 1.0 + 1e-6):
        raise InfeasibleInstanceError(f"a customer's demand exceeds the vehicle capacity "
                                      f"(max |demand| = {np.abs(d).max():.6g} capacities)")
    qs = np.arange(1, MAX_INTEGER_CAPACITY + 1, dtype=np.float64)[:, None]
    scaled = d[None, :] * qs
    err = np.abs(scaled - np.rint(scaled)).max(axis=1)
    ok = np.flatnonzero(err <= 1e-7 * qs[:, 0] + 1e-9)
    if ok.size:
        q = int(qs[ok[0], 0])
        return np.rint(d * q).astype(np.int64), q, True
    q = FALLBACK_DEMAND_SCALE
    return np.rint(d * q).astype(np.int64), q, False


def route_cost(problem: Problem, route: Sequence[int], dist: np.ndarray | None = None) -> float:
    """float64 cost of a flat route under the environment's rule (open: moves into the depot cost 0)."""
    dist = problem.distances() if dist is None else dist
    seq = [0] + [int(v) for v in route] + [0]
    total = 0.0
    for a, b in zip(seq[:-1], seq[1:]):
        if problem.is_open and b == 0:
            continue
        total += float(dist[a, b])
    return total


def flatten_tours(tours: Sequence[Sequence[int]]) -> list[int]:
    """[[a, b], [c]] -> [a, b, 0, c] (the paper's flat format: 0 between sub-tours, no leading or
    trailing depot)."""
    out: list[int] = []
    for t in tours:
        if not t:
            continue
        if out:
            out.append(0)
        out.extend(int(v) for v in t)
    return out


def order_tours(problem: Problem, tours: Sequence[Sequence[int]]) -> list[list[int]]:
    """Sub-tours in an order the environment accepts: under the paper's backhaul rule, tours holding a linehaul
    first (they leave full), tours of backhauls only last (they leave empty once every linehaul is served); under
    the other rules, and without backhauls, routes do not depend on each other and keep their order."""
    tours = [list(map(int, t)) for t in tours if len(t)]
    if not problem.has_backhaul or problem.backhaul_rule != 0:
        return tours
    has_line = [any(problem.demand[v] > 0 for v in t) for t in tours]
    return [t for t, h in zip(tours, has_line) if h] + [t for t, h in zip(tours, has_line) if not h]


@dataclasses.dataclass
class SolveResult:
    """One instance's outcome: the flat route, its float64 cost under the environment's rule, the
    solver's own objective converted back to distance units, and seconds spent."""

    index: int
    route: list[int]
    cost: float
    solver_objective: float
    seconds: float
    status: str = "ok"


@dataclasses.dataclass
class Solutions:
    """A batch of results in instance order."""

    solver: str
    costs: np.ndarray
    routes: list[list[int]]
    seconds: np.ndarray
    results: list[SolveResult]
    checks: list | None = None

    @property
    def mean(self) -> float:
        return float(np.mean(self.costs))

    def save(self, path) -> None:
        """Write the paper's solution format: a list of (cost, route)."""
        from mvmoe_jax.io import save_paper_solutions

        save_paper_solutions(path, self.costs, self.routes)


def _call(args):
    fn, problem, kwargs = args
    return fn(problem, **kwargs)


_MAIN_GUARD = ("Worker processes are spawned (never forked) and import your main module: a script that "
               "solves with workers > 1 must do so under `if __name__ == '__main__':`.")


def run_parallel(fn: Callable[..., SolveResult], problems: Sequence[Problem], *, workers: int = 1,
                 progress: bool = True, desc: str = "", **kwargs) -> list[SolveResult]:
    """Solve every problem with ``fn(problem, **kwargs)``: in this process when workers == 1, else in a
    pool of ``workers`` spawned processes (never forked: the parent may hold JAX's threads). Results come
    back in the order of ``problems``; a progress bar counts finished instances."""
    from tqdm.auto import tqdm

    if workers < 1:
        raise BaselineError(f"workers must be >= 1, got {workers}")
    results: list[SolveResult | None] = [None] * len(problems)
    bar = tqdm(total=len(problems), desc=desc, disable=not progress, dynamic_ncols=True)
    try:
        if workers == 1 or len(problems) == 1:
            for i, p in enumerate(problems):
                results[i] = fn(p, **kwargs)
                bar.update(1)
        else:
            ctx = multiprocessing.get_context("spawn")
            try:
                with cf.ProcessPoolExecutor(max_workers=min(workers, len(problems)), mp_context=ctx) as pool:
                    futures = {pool.submit(_call, (fn, p, kwargs)): i for i, p in enumerate(problems)}
                    for fut in cf.as_completed(futures):
                        results[futures[fut]] = fut.result()
                        bar.update(1)
            except cf.process.BrokenProcessPool as e:
                raise RuntimeError("a solver worker process died. " + _MAIN_GUARD +
                                   " Otherwise the solver crashed (out of memory?).") from e
    finally:
        bar.close()
    return results  # type: ignore[return-value]


def collect(solver: str, results: Sequence[SolveResult]) -> Solutions:
    return Solutions(solver=solver, costs=np.array([r.cost for r in results], np.float64),
                     routes=[r.route for r in results], seconds=np.array([r.seconds for r in results]),
                     results=list(results))


def verify(instances, solutions: Solutions, rtol: float = 1e-5) -> list:
    """Replay every route through the environment's checker; raise InfeasibleSolutionError if one is
    infeasible or its reported cost differs from the checker's by more than ``rtol`` (relative)."""
    solutions.checks = checker.verify_routes(
        instances, solutions.routes, solutions.costs, rtol=rtol, error=InfeasibleSolutionError,
        source=f"{solutions.solver} (a modelling bug, please report it)")
    return solutions.checks


def time_limit_ms(seconds: float) -> int:
    if not (seconds > 0 and math.isfinite(seconds)):
        raise BaselineError(f"time_limit must be a positive number of seconds, got {seconds}")
    return max(1, int(round(seconds * 1000)))


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def now(self) -> float:
        return time.perf_counter()

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
