"""Reference solvers (mvmoe_jax.baselines): every route passes the environment's checker with the same cost,
the OR-Tools model admits exactly the routes the environment admits, the command line, bad input.

The solvers are dependencies of the package; should one be missing (a partial install), these tests skip,
except under CI (CI=true), where a missing solver is a failure.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mvmoe_jax import checker, env, instances, io, problems
from mvmoe_jax.baselines import common

N = 20
NON_B = [v.name for v in problems.VARIANTS if not v.backhaul]


def _require(module: str):
    try:
        return __import__(module)
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {module} is not installed (pip install -e .)")
        pytest.skip(f"{module} not installed (pip install -e .)")


@pytest.fixture(scope="module")
def ortools_solver():
    _require("ortools")
    from mvmoe_jax.baselines import ortools_solver
    return ortools_solver


@pytest.fixture(scope="module")
def pyvrp_solver():
    _require("pyvrp")
    from mvmoe_jax.baselines import pyvrp_solver
    return pyvrp_solver


def _batch(variant: str, k: int, seed: int = 0, n: int = N):
    return instances.generate(jax.random.PRNGKey(1000 * seed + problems.VARIANT_NAMES.index(variant)), k, n,
                              variant)


def _assert_checked(batch, sols):
    checks = checker.check_routes(batch, sols.routes)
    for i, (c, cost) in enumerate(zip(checks, sols.costs)):
        assert c.feasible, f"instance {i}: {c.violation} at {c.position} (node {c.node}) in {sols.routes[i]}"
        assert abs(c.cost - cost) <= 1e-5 * c.cost, (i, c.cost, cost)
    n = batch.locs.shape[1] - 1
    for r in sols.routes:
        assert sorted(v for v in r if v) == list(range(1, n + 1))
        assert r[0] != 0 and r[-1] != 0 and all(a or b for a, b in zip(r[:-1], r[1:]))


# ----------------------------------------------------------------------------------------------------
# Every route passes the checker, cost equal to the checker's
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", problems.VARIANT_NAMES)
def test_ortools_routes_pass_checker(ortools_solver, variant):
    batch = _batch(variant, 3)
    sols = ortools_solver.solve(batch, time_limit=0.5, workers=1, progress=False, check=False)
    _assert_checked(batch, sols)
    for r in sols.results:       # the solver's own objective is the same cost, up to integer rounding
        assert abs(r.solver_objective - r.cost) < 1e-4


@pytest.mark.parametrize("variant", NON_B)
def test_pyvrp_routes_pass_checker(pyvrp_solver, variant):
    batch = _batch(variant, 2)
    sols = pyvrp_solver.solve(batch, time_limit=0.5, workers=1, progress=False, check=False)
    _assert_checked(batch, sols)


def test_solve_api_checks_mixed_batch_and_saves(ortools_solver, tmp_path):
    from mvmoe_jax import baselines

    batch = instances.generate(jax.random.PRNGKey(7), 4, N, problems.VARIANT_NAMES)
    sols = baselines.solve(batch, "ortools", time_limit=0.3, progress=False)
    assert sols.checks is not None and all(c.feasible for c in sols.checks)
    path = tmp_path / "sol.pkl"
    sols.save(path)
    costs, routes = io.load_paper_solutions(path)
    np.testing.assert_allclose(costs, sols.costs)
    assert routes == sols.routes


def test_verify_rejects_bad_routes_and_costs():
    batch = _batch("CVRP", 2)
    n = N
    good = [list(range(1, n + 1))]          # one tour: over capacity for these instances
    sols = common.Solutions("x", np.array([1.0, 1.0]), good * 2, np.zeros(2), [])
    with pytest.raises(common.InfeasibleSolutionError, match="capacity"):
        common.verify(batch, sols)
    singles = common.flatten_tours([[j] for j in range(1, n + 1)])
    probs = common.problems_from_instances(batch)
    costs = np.array([common.route_cost(p, singles) for p in probs])
    sols = common.Solutions("x", costs * 1.001, [singles] * 2, np.zeros(2), [])
    with pytest.raises(common.InfeasibleSolutionError, match="reported cost"):
        common.verify(batch, sols)
    sols = common.Solutions("x", costs, [singles] * 2, np.zeros(2), [])
    assert all(c.feasible for c in common.verify(batch, sols))


# ----------------------------------------------------------------------------------------------------
# The OR-Tools model admits exactly what the environment admits
# ----------------------------------------------------------------------------------------------------

@jax.jit
def _random_rollouts(batch, key):
    """Random feasible policy (depot discouraged, so routes are long): actions (B, 2n+2)."""
    n = batch.locs.shape[1] - 1

    def one(inst, k):
        def body(s, kk):
            m = env.action_mask(s)
            logits = jnp.where(m, jnp.where(jnp.arange(n + 1) == 0, -3.0, 0.0), -jnp.inf)
            a = jax.random.categorical(kk, logits)
            return env.step(s, a), a
        s, acts = jax.lax.scan(body, env.reset(inst), jax.random.split(k, 2 * n + 2))
        return acts, s.finished

    return jax.vmap(one)(batch, jax.random.split(key, batch.locs.shape[0]))


def _two_swapped(routes, seed: int) -> list[list[int]]:
    """Each route (a node sequence with depot zeros) with two of its customers, drawn at random, swapped."""
    rng = np.random.default_rng(seed)
    swapped = []
    for r in routes:
        r = list(r)
        idx = [i for i, v in enumerate(r) if v]
        i, j = rng.choice(idx, 2, replace=False)
        r[i], r[j] = r[j], r[i]
        swapped.append(r)
    return swapped


@pytest.mark.parametrize("variant", problems.VARIANT_NAMES)
def test_ortools_model_admits_exactly_env_routes(ortools_solver, variant):
    """Random feasible rollouts of the environment (which mix linehauls and backhauls, end with
    backhaul-only tours, hit capacity exactly, ...) must all be admitted by the model, and routes with
    two customers swapped must be admitted iff the environment's checker accepts them."""
    batch = _batch(variant, 30, seed=3)
    acts, finished = _random_rollouts(batch, jax.random.PRNGKey(problems.VARIANT_NAMES.index(variant)))
    assert bool(np.all(finished))
    routes = [checker.actions_to_route(a) for a in np.asarray(acts)]
    swapped = _two_swapped(routes, seed=0)
    probs = common.problems_from_instances(batch)
    for rs in (routes, swapped):
        checks = checker.check_routes(batch, rs)
        for p, r, c in zip(probs, rs, checks):
            assert ortools_solver.model_accepts(p, r) == c.feasible, (p.index, r, c.violation)
    assert all(c.feasible for c in checker.check_routes(batch, routes))


def _tiny_backhaul_instance(demand_raw, xy=None, capacity=10.0, variant="VRPB"):
    n = len(demand_raw)
    if xy is None:
        ang = np.linspace(0, 2 * np.pi, n, endpoint=False)
        xy = np.stack([0.5 + 0.1 * np.cos(ang), 0.5 + 0.1 * np.sin(ang)], -1)
    return instances.from_arrays(np.array([[0.5, 0.5]]), np.asarray(xy)[None], np.array([demand_raw], float),
                                 capacity, variant=variant)


def test_backhaul_rule_derivation(ortools_solver):
    """The environment's backhaul rule, as the model encodes it: on a route that leaves full, net =
    delivered - picked up stays in [0, capacity] (so a route cannot open with a backhaul, picks up at most
    what it has delivered so far, and may mix linehauls and backhauls); a route of backhauls only leaves
    empty, so it must come after every linehaul, and may then pick up a full capacity."""
    inst = _tiny_backhaul_instance([6, 4, -5, -3, -10])      # capacity 10: linehauls 1, 2; backhauls 3, 4, 5
    p = common.problems_from_instances(inst)[0]
    cases = [
        ((1, 2, 3, 4, 0, 5), True),            # deliver 10, pick 8; then 5 alone, leaving empty
        ((1, 3, 2, 4, 0, 5), True),            # mixed: deliver 6, pick 5, deliver 4, pick 3
        ((2, 4, 1, 3, 0, 5), True),            # mixed: deliver 4, pick 3, deliver 6 (load 0.9), pick 5
        ((1, 2, 5, 0, 3, 4), True),            # deliver 10, pick 10 (exactly full); then 3 + 4 from empty
        ((1, 2, 0, 3, 4, 0, 5), True),         # two backhaul-only tours at the end
        ((3, 1, 2, 4, 0, 5), False),           # a route cannot open with a backhaul (load 1 + 0.5)
        ((5, 0, 1, 2, 3, 4), False),           # backhaul-only tour first: the vehicle leaves full
        ((1, 5, 0, 2, 3, 4), False),           # picks 10 after delivering 6
        ((1, 2, 0, 3, 4, 5), False),           # backhaul-only tour picking 18 > 10
        ((1, 0, 3, 0, 2, 4, 0, 5), False),     # tour [3] leaves full while linehaul 2 is unserved
        ((2, 4, 3, 1, 0, 5), False),           # deliver 4, pick 3 + 5 > 4
    ]
    batch = jax.tree.map(lambda x: jnp.repeat(x, len(cases), 0), inst)
    checks = checker.check_routes(batch, [list(r) for r, _ in cases])
    for (route, expected), c in zip(cases, checks):
        assert c.feasible == expected, (route, c.violation)
        assert ortools_solver.model_accepts(p, list(route)) == expected, route
    # The paper's looser model (the vehicle may leave with any load) admits a route opening with a backhaul.
    assert ortools_solver.model_accepts(p, [3, 1, 2, 4, 0, 5], free_start_load=True)
    assert ortools_solver.model_accepts(p, [1, 5, 0, 2, 3, 4], free_start_load=True)       # leaves with 4
    assert not ortools_solver.model_accepts(p, [1, 2, 4, 0, 5, 3], free_start_load=True)   # picks 15 > 10
    # Customer 1 (6) can carry neither backhaul (7, 8) home, and 7 + 8 > 10: the solver must return
    # [1] first, then the two backhaul-only tours.
    inst = _tiny_backhaul_instance([6, -7, -8])
    sols = ortools_solver.solve(inst, time_limit=0.3, progress=False)
    tours = checker.split_subtours(sols.routes[0])
    assert tours[0] == [1] and sorted(tours[1:]) == [[2], [3]]


# ----------------------------------------------------------------------------------------------------
# The classic and mixed backhaul rules
# ----------------------------------------------------------------------------------------------------

B_VARIANTS = [v.name for v in problems.VARIANTS if v.backhaul]
OTHER_RULES = ("classic", "mixed")


def _solvable_batch(variant: str, rule: str, k: int, seed: int, tries: int = 4):
    """k generated instances under ``rule`` that a random rollout of the environment solves (the generator does
    not redraw for the classic rule's order, so some draws have no solution), and a finished rollout's route for
    each (``tries`` random rollouts per instance)."""
    m = 4 * k
    batch = instances.generate(jax.random.PRNGKey(seed + problems.VARIANT_NAMES.index(variant)), m, N, variant,
                               backhaul_rule=rule)
    copies = jax.tree.map(lambda x: jnp.concatenate([x] * tries), batch)
    acts, finished = _random_rollouts(copies, jax.random.PRNGKey(seed))
    finished = np.asarray(finished).reshape(tries, m)
    keep = np.flatnonzero(finished.any(0))[:k]
    assert keep.size == k, f"only {keep.size} of {m} instances solved by {tries} random rollouts each"
    routes = [checker.actions_to_route(np.asarray(acts)[int(np.argmax(finished[:, i])) * m + i]) for i in keep]
    return jax.tree.map(lambda x: x[keep], batch), routes


@pytest.mark.parametrize("rule", OTHER_RULES)
@pytest.mark.parametrize("variant", B_VARIANTS)
def test_ortools_routes_pass_checker_under_each_rule(ortools_solver, variant, rule):
    batch, _ = _solvable_batch(variant, rule, 2, seed=40)
    sols = ortools_solver.solve(batch, time_limit=0.2, workers=1, progress=False, check=False)
    _assert_checked(batch, sols)
    for r in sols.results:
        assert abs(r.solver_objective - r.cost) < 1e-4


@pytest.mark.parametrize("rule", OTHER_RULES)
@pytest.mark.parametrize("variant", ["VRPB", "OVRPBL", "VRPBTW", "OVRPBLTW"])
def test_ortools_model_admits_exactly_env_routes_under_each_rule(ortools_solver, variant, rule):
    """Under the classic and mixed rules too, the model admits every finished random rollout of the
    environment, and a route with two customers swapped exactly when the checker accepts it."""
    batch, routes = _solvable_batch(variant, rule, 10, seed=7)
    swapped = _two_swapped(routes, seed=1)
    probs = common.problems_from_instances(batch)
    assert all(p.backhaul_rule == problems.backhaul_rule_index(rule) for p in probs)
    verdicts = []
    for rs in (routes, swapped):
        checks = checker.check_routes(batch, rs)
        for p, r, c in zip(probs, rs, checks):
            assert ortools_solver.model_accepts(p, r) == c.feasible, (p.index, r, c.violation)
            verdicts.append(c.feasible)
    assert all(verdicts[:len(routes)]) and not all(verdicts[len(routes):])


def test_classic_and_mixed_rules_as_the_model_encodes_them(ortools_solver):
    """Hand-made routes on capacity 10 (linehauls 1: 6, 2: 4, 6: 3; backhauls 3: 5, 4: 3, 5: 10), each admitted
    by the model exactly when the checker admits it under the instance's rule, and the verdict written out."""
    base = _tiny_backhaul_instance([6, 4, -5, -3, -10, 3])
    cases = {
        "classic": [
            ((1, 2, 3, 4, 0, 6, 5), True),         # deliver 10 then pick 8; deliver 3 then pick 10
            ((1, 2, 6, 3, 0, 4, 5), False),        # deliveries 13 > 10
            ((1, 3, 2, 4, 0, 6, 5), False),        # a linehaul after a backhaul
            ((3, 1, 0, 2, 4, 0, 6, 5), False),     # a route opening with a backhaul
            ((1, 2, 0, 6, 5, 0, 3, 4), False),     # a route of backhauls only
            ((1, 3, 4, 0, 2, 6, 5), True),         # pick 8; deliver 7 then pick 10
            ((1, 5, 3, 0, 2, 6, 4), False),        # pickups 15 > 10
        ],
        "mixed": [
            ((1, 2, 3, 4, 0, 6, 5), True),         # leaves with 10, on board 0 -> 8; leaves with 3, then 10
            ((3, 2, 0, 1, 4, 0, 6, 5), True),      # leaves with 4, picks 5 first: 9 on board
            ((6, 5, 0, 1, 3, 0, 2, 4), True),      # leaves with 3, 0 after, picks 10; 6 -> 0 -> 5; 4 -> 0 -> 3
            ((5, 6, 0, 1, 3, 0, 2, 4), False),     # leaves with 3, picks 10 before delivering: 13 on board
            ((4, 2, 1, 0, 3, 0, 6, 5), False),     # leaves with 10, picks 3 first: 13 on board
            ((2, 4, 6, 0, 1, 3, 0, 5), True),      # leaves with 7: 3 after 2, 6 with 4, 3 after 6
            ((1, 2, 6, 0, 3, 4, 5), False),        # deliveries 13 > 10
            ((3, 1, 0, 2, 4, 0, 6, 5), False),     # leaves with 6, picks 5 first: 11 on board
        ],
    }
    for rule, rows in cases.items():
        inst = instances.with_backhaul_rule(base, rule)
        p = common.problems_from_instances(inst)[0]
        batch = jax.tree.map(lambda x: jnp.repeat(x, len(rows), 0), inst)
        checks = checker.check_routes(batch, [list(r) for r, _ in rows])
        for (route, expected), c in zip(rows, checks):
            assert c.feasible == expected, (rule, route, c.violation)
            assert ortools_solver.model_accepts(p, list(route)) == expected, (rule, route)
        sols = ortools_solver.solve(inst, time_limit=0.2, progress=False)
        assert sols.checks[0].feasible


@pytest.mark.parametrize("rule", OTHER_RULES)
@pytest.mark.parametrize("variant", ["VRPB", "OVRPBL", "VRPBLTW"])
def test_pyvrp_routes_pass_checker_under_each_rule(pyvrp_solver, variant, rule):
    """PyVRP solves the classic and mixed rules (the classic order through prohibitive arcs); every route passes
    the environment's checker under the instance's rule."""
    import pyvrp.constants

    assert pyvrp_solver.MAX_VALUE == pyvrp.constants.MAX_VALUE
    batch, _ = _solvable_batch(variant, rule, 2, seed=60)
    sols = pyvrp_solver.solve(batch, time_limit=0.3, workers=1, progress=False, check=False)
    _assert_checked(batch, sols)


def test_pyvrp_keeps_the_classic_order_where_it_costs_distance(pyvrp_solver):
    """Backhauls beside the depot and linehauls far out: without the order a route would collect the backhauls
    on the way out; under the classic rule PyVRP serves them on the way back, as the checker requires."""
    xy = [[0.52, 0.5], [0.5, 0.52], [0.9, 0.5], [0.9, 0.55], [0.9, 0.45]]
    inst = _tiny_backhaul_instance([-2, -2, 3, 3, 3], xy=np.array(xy), capacity=10.0)
    for rule in OTHER_RULES:
        batch = instances.with_backhaul_rule(inst, rule)
        sols = pyvrp_solver.solve(batch, time_limit=0.3, progress=False)
        assert sols.checks[0].feasible
        tours = checker.split_subtours(sols.routes[0])
        if rule == "classic":
            assert all(t[0] > 2 for t in tours), tours
            for t in tours:
                kinds = [v <= 2 for v in t]          # True: a backhaul
                assert kinds == sorted(kinds), tours


def _vrpb_file(path, coords, delivery, pickup, capacity):
    """A VRPLIB TYPE VRPB file (node 1 the depot), in the dialect of PyVRP's reader."""
    rows = lambda v: "".join(f"{i + 1}\t{x}\n" for i, x in enumerate(v))
    text = (f"NAME: {path.stem}\nTYPE: VRPB\nDIMENSION: {len(coords)}\nCAPACITY: {capacity}\nEDGE_WEIGHT_TYPE: EUC_2D\n"
            "NODE_COORD_SECTION\n" + "".join(f"{i + 1}\t{x}\t{y}\n" for i, (x, y) in enumerate(coords))
            + "DEMAND_SECTION\n" + rows(delivery) + "BACKHAUL_SECTION\n" + rows(pickup) + "DEPOT_SECTION\n1\n-1\nEOF\n")
    path.write_text(text)
    return path


def test_pyvrp_checks_vrplib_routes_with_the_classic_order(pyvrp_solver, tmp_path):
    """PyVRP's verdict on a VRPB file: capacity, every customer, and the order that its reader only prices."""
    coords = [(0, 0), (10, 0), (20, 0), (3, 4), (0, 10)]
    path = _vrpb_file(tmp_path / "t.vrp", coords, [0, 6, 4, 0, 5], [0, 0, 0, 7, 0], 10)
    ok = pyvrp_solver.check_vrplib_routes(path, [[1, 2, 3], [4]])
    assert ok.feasible and ok.reason is None
    assert ok.distance == checker.tours_cost(np.array(coords, float), [[1, 2, 3], [4]], False, rounded=True)
    verdicts = {
        "backhaul first": pyvrp_solver.check_vrplib_routes(path, [[3, 1, 2], [4]]),
        "linehaul after a backhaul": pyvrp_solver.check_vrplib_routes(path, [[1, 3, 2], [4]]),
        "over capacity": pyvrp_solver.check_vrplib_routes(path, [[1, 2, 4, 3]]),
        "unserved": pyvrp_solver.check_vrplib_routes(path, [[1, 2, 3]]),
    }
    for what, v in verdicts.items():
        assert not v.feasible and v.reason, what
    assert "prohibits" in verdicts["backhaul first"].reason and "prohibits" in verdicts["linehaul after a backhaul"].reason
    assert "load" in verdicts["over capacity"].reason and "not served" in verdicts["unserved"].reason
    with pytest.raises(ValueError, match="out of range"):
        pyvrp_solver.check_vrplib_routes(path, [[1, 2, 3, 9], [4]])
    with pytest.raises(ValueError, match="twice"):
        pyvrp_solver.check_vrplib_routes(path, [[1, 2, 3], [4, 1]])


def test_demand_units():
    paper_like = np.array([0, 3, 9, 1, 40, -7]) / 40.0
    units, cap, exact = common.demand_units(paper_like.astype(np.float32).astype(np.float64))
    assert exact and cap == 40 and units.tolist() == [0, 3, 9, 1, 40, -7]
    units, cap, exact = common.demand_units(np.array([0, 0.5, 0.25]))
    assert exact and cap == 4 and units.tolist() == [0, 2, 1]
    units, cap, exact = common.demand_units(np.array([0, 0.123456789, 1 / np.pi]))
    assert not exact and cap == common.FALLBACK_DEMAND_SCALE
    with pytest.raises(common.InfeasibleInstanceError):
        common.demand_units(np.array([0, 1.5]))


def test_non_integer_demands_still_feasible(ortools_solver, pyvrp_solver):
    batch = _batch("VRPBL", 2)
    rng = np.random.default_rng(0)
    jitter = jnp.asarray(rng.uniform(0.9, 1.0, batch.demand.shape), jnp.float32)
    batch = batch.replace(demand=batch.demand * jitter)
    sols = ortools_solver.solve(batch, time_limit=0.3, progress=False, check=False)
    _assert_checked(batch, sols)
    batch = _batch("VRPLTW", 2)
    batch = batch.replace(demand=batch.demand * jitter)
    sols = pyvrp_solver.solve(batch, time_limit=0.3, progress=False, check=False)
    _assert_checked(batch, sols)


def test_route_order_and_cost_helpers():
    inst = _tiny_backhaul_instance([6, 4, -5, -3, -10], variant="OVRPB")
    p = common.problems_from_instances(inst)[0]
    assert common.order_tours(p, [[5], [1, 3], [2, 4]]) == [[1, 3], [2, 4], [5]]
    assert common.flatten_tours([[1, 3], [], [2]]) == [1, 3, 0, 2]
    d = p.distances()
    assert common.route_cost(p, [1, 3, 0, 2]) == pytest.approx(d[0, 1] + d[1, 3] + d[0, 2])


# ----------------------------------------------------------------------------------------------------
# Command line and bad input
# ----------------------------------------------------------------------------------------------------

def _write_paper_instances(path, batch, variant):
    """Write a batch in the paper's instance format (raw demands over capacity 30 for n = 20)."""
    var = problems.get_variant(variant)
    host = jax.device_get(batch)
    rows = []
    for i in range(host.locs.shape[0]):
        row = [host.locs[i, :1].tolist(), host.locs[i, 1:].tolist(),
               np.rint(host.demand[i, 1:] * 30).astype(int).tolist(), 30.0]
        if var.limit:
            row.append(float(host.route_limit[i]))
        if var.tw:
            row += [host.service_time[i, 1:].tolist(), host.tw_start[i, 1:].tolist(), host.tw_end[i, 1:].tolist()]
        rows.append(tuple(row))
    with open(path, "wb") as f:
        pickle.dump(rows, f, protocol=4)


@pytest.mark.parametrize("solver,variant", [("ortools", "VRPBLTW"), ("pyvrp", "OVRPLTW")])
def test_command_line_writes_readable_solutions(tmp_path, solver, variant):
    _require("ortools" if solver == "ortools" else "pyvrp")
    batch = _batch(variant, 3, seed=5)
    data = tmp_path / f"{variant.lower()}20_uniform.pkl"
    _write_paper_instances(data, batch, variant)
    out = tmp_path / "out" / "sol.pkl"
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "mvmoe_jax.baselines", f"--solver={solver}", f"--problem={variant}",
           f"--data={data}", "--num_instances=3", "--time_limit=0.5", "--workers=2", f"--output={out}",
           f"--json={summary}", "--no_progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pass the environment's checker" in proc.stdout
    costs, routes = io.load_paper_solutions(out)
    assert len(routes) == 3
    loaded = io.load_paper_instances(data, variant)
    checks = checker.check_routes(loaded, routes)
    assert all(c.feasible for c in checks)
    np.testing.assert_allclose(costs, [c.cost for c in checks], rtol=1e-5)
    assert summary.exists()


@pytest.mark.parametrize("solver,rule", [("ortools", "classic"), ("pyvrp", "mixed")])
def test_command_line_solves_under_the_stated_backhaul_rule(tmp_path, capsys, solver, rule):
    """--backhauls=RULE: the routes written pass the checker under that rule (and the classic ones keep its
    order, which the paper's rule does not ask for)."""
    _require(solver)
    from mvmoe_jax.baselines.__main__ import main

    batch, _ = _solvable_batch("VRPB", rule, 2, seed=80)
    data = tmp_path / "vrpb20_uniform.pkl"
    _write_paper_instances(data, batch, "VRPB")
    out = tmp_path / "sol.pkl"
    assert main([f"--solver={solver}", "--problem=VRPB", f"--data={data}", f"--backhauls={rule}",
                 "--time_limit=0.3", f"--output={out}", "--no_progress"]) == 0
    assert f"under the {rule} backhaul rule" in capsys.readouterr().out
    costs, routes = io.load_paper_solutions(out)
    loaded = instances.with_backhaul_rule(io.load_paper_instances(data, "VRPB"), rule)
    checks = checker.check_routes(loaded, routes)
    assert all(c.feasible for c in checks), [c.violation for c in checks]
    np.testing.assert_allclose(costs, [c.cost for c in checks], rtol=1e-5)
    if rule == "classic":
        for i, r in enumerate(routes):
            for t in checker.split_subtours(r):
                back = [bool(loaded.demand[i, v] < 0) for v in t]
                assert not back[0] and back == sorted(back), t


@pytest.mark.parametrize("argv,message", [
    (["--solver=gurobi", "--problem=CVRP"], "unknown solver 'gurobi'"),
    (["--solver=ortools", "--problem=VRPX"], "unknown VRP variant 'VRPX'"),
    (["--solver=pyvrp", "--problem=VRPBTW"], "pyvrp cannot express VRPBTW exactly"),
    (["--solver=ortools", "--problem=VRPB", "--backhauls=strict"], "unknown backhaul rule 'strict'"),
    (["--solver=ortools", "--problem=CVRP", "--data=/nonexistent/cvrp50_uniform.pkl"], "data file not found"),
    (["--solver=ortools", "--problem=CVRP", "--num_instances=0"], "--num_instances must be >= 1"),
    (["--solver=ortools", "--problem=CVRP", "--time_limit=0"], "--time_limit must be positive"),
])
def test_command_line_bad_input(tmp_path, capsys, argv, message):
    from mvmoe_jax.baselines.__main__ import main

    data = tmp_path / "cvrp20_uniform.pkl"
    _write_paper_instances(data, _batch("CVRP", 1), "CVRP")
    if not any(a.startswith("--data") for a in argv):
        argv = argv + [f"--data={data}"]
    with pytest.raises(SystemExit) as exc:
        main(argv + [f"--output={tmp_path / 'o.pkl'}"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.pkl").exists()


def test_command_line_wrong_fields(tmp_path, capsys):
    from mvmoe_jax.baselines.__main__ import main

    data = tmp_path / "cvrp20_uniform.pkl"
    _write_paper_instances(data, _batch("CVRP", 1), "CVRP")
    with pytest.raises(SystemExit) as exc:
        main(["--solver=ortools", "--problem=VRPTW", f"--data={data}", f"--output={tmp_path / 'o.pkl'}"])
    assert exc.value.code == 2
    assert "fields" in capsys.readouterr().err


def test_api_bad_input():
    from mvmoe_jax import baselines

    batch = _batch("VRPB", 1)
    with pytest.raises(baselines.UnknownSolverError, match="expected one of: ortools, pyvrp"):
        baselines.solve(batch, "lkh")
    with pytest.raises(problems.UnknownVariantError):
        baselines.check_supported("ortools", "VRPQ")
    with pytest.raises(baselines.UnsupportedVariantError, match="ortools"):
        baselines.check_supported("pyvrp", "OVRPB")
    assert len(baselines.supported_variants("ortools")) == 16
    assert baselines.supported_variants("pyvrp") == tuple(NON_B)
    with pytest.raises(baselines.BaselineError, match="workers"):
        common.run_parallel(lambda p: p, [], workers=0)


def test_pyvrp_refuses_backhauls(pyvrp_solver):
    from mvmoe_jax import baselines

    with pytest.raises(baselines.UnsupportedVariantError, match="backhaul"):
        pyvrp_solver.solve(_batch("VRPBL", 1), time_limit=0.2, progress=False)


# ----------------------------------------------------------------------------------------------------
# Slow: the paper's test sets
# ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_pyvrp_matches_paper_hgs(pyvrp_solver, paper_dir):
    for variant in ("CVRP", "VRPTW"):
        inst = io.load_paper_instances(io.dataset_path(paper_dir, variant, 50), variant, num_instances=6)
        ref, _ = io.load_paper_solutions(io.reference_solution_path(paper_dir, variant, 50, "hgs"),
                                         num_instances=6)
        sols = pyvrp_solver.solve(inst, time_limit=10, workers=2, progress=False)
        assert np.mean((sols.costs - ref) / ref) < 0.005, (variant, sols.costs, ref)


@pytest.mark.slow
@pytest.mark.parametrize("variant", problems.VARIANT_NAMES)
def test_ortools_paper_sets_feasible(ortools_solver, paper_dir, variant):
    inst = io.load_paper_instances(io.dataset_path(paper_dir, variant, 50), variant, num_instances=2)
    sols = ortools_solver.solve(inst, time_limit=5, workers=2, progress=False)
    assert all(c.feasible for c in sols.checks)
