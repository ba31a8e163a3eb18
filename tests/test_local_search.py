"""The local search (mvmoe_jax.local_search): its replay of routes gives the checker's verdict, every move's cost
change is the recomputed one, and on all 16 variants under the three backhaul rules it returns checker-feasible
solutions no worse than the start, at a local optimum, the same every time. Small instances (n = 20), starts
built by a nearest-neighbour policy acting through the environment's own mask."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mvmoe_jax import checker, env, instances, local_search, problems
from mvmoe_jax.local_search import descent, moves
from mvmoe_jax.local_search.route_rules import RouteRules, distance_matrix, pad_routes, replay, solution_order

N = 20
CASES = [(v.name, rule) for v in problems.VARIANTS
         for rule in (problems.BACKHAUL_RULES if v.backhaul else ("paper",))]

_mask = jax.jit(env.action_mask)
_step = jax.jit(env.step)


def nearest_neighbour(inst) -> list[list[int]] | None:
    """Routes of the policy that always moves to the nearest node the environment's mask allows, customers
    before the depot; None at a dead end."""
    s = env.reset(inst)
    dist = np.asarray(env.distance_matrix(inst.locs))
    flat = []
    while not bool(s.finished):
        allowed = np.asarray(_mask(s))
        cur = int(s.current)
        customers = np.flatnonzero(allowed[1:]) + 1
        if customers.size:
            a = int(customers[np.argmin(dist[cur, customers])])
        elif cur != 0:
            a = 0
        else:
            return None
        flat.append(a)
        s = _step(s, a)
    return checker.split_subtours(flat)


@pytest.fixture(scope="module")
def starts():
    """{(variant, rule): [(instance, start routes)]}: two instances per case that have a nearest-neighbour
    solution."""
    out = {}
    for k, (variant, rule) in enumerate(CASES):
        found = []
        for draw in range(4):                   # the classic rule with time windows leads it into dead ends
            batch = instances.generate(jax.random.key(100 * draw + k), 8, N, variant, backhaul_rule=rule)
            for i in range(8):
                inst = jax.tree.map(lambda x: x[i], batch)
                routes = nearest_neighbour(inst) if len(found) < 2 else None
                if routes is not None:
                    found.append((inst, routes))
        assert len(found) >= 2, (variant, rule)
        out[(variant, rule)] = found[:2]
    return out


def tiny(locs, demand, **fields) -> instances.Instance:
    """A hand-made instance without time windows or route limits (``fields`` override)."""
    n1 = len(demand)
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    base = dict(locs=f32(locs), demand=f32(demand), service_time=f32(np.zeros(n1)), tw_start=f32(np.zeros(n1)),
                tw_end=f32(np.zeros(n1)), route_limit=f32(np.inf), is_open=jnp.asarray(False),
                has_backhaul=jnp.asarray(bool(np.any(np.asarray(demand) < 0))), has_limit=jnp.asarray(False),
                has_tw=jnp.asarray(False), backhaul_rule=jnp.int8(0))
    return instances.Instance(**{**base, **fields})


def flat(routes) -> list[int]:
    return [v for t in routes for v in (*t, 0)]


def checked(inst, routes) -> checker.RouteCheck:
    return checker.check_route(inst, flat(routes))


def test_distances_are_the_environments_bitwise():
    batch = instances.generate(jax.random.key(0), 8, N, "CVRP")
    for i in range(8):
        ours = distance_matrix(np.asarray(batch.locs[i], np.float32))
        assert np.array_equal(ours.view(np.int32), np.asarray(env.distance_matrix(batch.locs[i])).view(np.int32))


def _perturbed(rng, routes):
    """A solution a few random edits away: a customer moved, two swapped or a route cut in two."""
    routes = [list(t) for t in routes]
    for _ in range(rng.integers(1, 4)):
        kind = rng.integers(3)
        r = int(rng.integers(len(routes)))
        if kind == 0:
            u = routes[r].pop(int(rng.integers(len(routes[r]))))
            s = int(rng.integers(len(routes) + 1))
            if s == len(routes):
                routes.append([u])
            else:
                routes[s].insert(int(rng.integers(len(routes[s]) + 1)), u)
        elif kind == 1:
            s = int(rng.integers(len(routes)))
            i, j = int(rng.integers(len(routes[r]))), int(rng.integers(len(routes[s])))
            routes[r][i], routes[s][j] = routes[s][j], routes[r][i]
        elif len(routes[r]) > 1:
            cut = int(rng.integers(1, len(routes[r])))
            routes.append(routes[r][cut:])
            routes[r] = routes[r][:cut]
        routes = [t for t in routes if t]
    return routes


def test_replay_gives_the_checkers_verdict_on_all_variants_and_rules(starts):
    rng = np.random.default_rng(0)
    insts, solutions = [], []
    for found in starts.values():
        for inst, routes in found:
            rules = RouteRules.from_instance(inst)
            for _ in range(12):
                sol = solution_order(rules, _perturbed(rng, routes))
                padded, lengths = pad_routes(sol)
                insts.append(inst)
                solutions.append((sol, bool(replay(rules, padded, lengths).all())))
    batch = jax.tree.map(lambda *xs: jnp.stack(xs), *insts)
    checks = checker.check_routes(batch, [flat(sol) for sol, _ in solutions])
    ours = [ok for _, ok in solutions]
    assert [c.feasible for c in checks] == ours
    assert 0.2 < np.mean(ours) < 0.8          # both verdicts well represented


@pytest.mark.parametrize("variant", ["CVRP", "OVRPBLTW", "VRPBL"])
@pytest.mark.parametrize("neighbours", [None, 4])
def test_each_moves_cost_change_is_the_recomputed_one(starts, variant, neighbours):
    rng = np.random.default_rng(1)
    for inst, routes in starts[(variant, "paper")]:
        rules = RouteRules.from_instance(inst)
        near = None if neighbours is None else moves.nearest(rules.dist, neighbours)
        coords = np.asarray(inst.locs, np.float64)
        is_open = bool(inst.is_open)
        layout = moves.Layout.from_routes(routes, N)
        before = checker.tours_cost(coords, routes, is_open)
        for kind in moves.KINDS:
            cands = moves.generate(kind, layout, rules.arc, 1, near)
            assert len(cands.delta) > 0, kind
            pick = cands.take(rng.choice(len(cands.delta), size=min(40, len(cands.delta)), replace=False))
            rows, first, second = moves.build(layout, pick)
            a, a_len = moves.splice(layout, first)
            b, b_len = moves.splice(layout, second)
            for c in range(len(pick.delta)):
                new = layout.routes_by_row()
                new[rows[c, 0]] = a[c, :a_len[c]].tolist()
                if rows[c, 1] >= 0:
                    new[rows[c, 1]] = b[c, :b_len[c]].tolist()
                assert sorted(v for t in new for v in t) == list(range(1, N + 1)), kind
                after = checker.tours_cost(coords, [t for t in new if t], is_open)
                assert pick.delta[c] == pytest.approx(after - before, abs=1e-5), (kind, pick.params[c])


@pytest.mark.parametrize("variant,rule", CASES)
def test_improved_solutions_pass_the_checker_and_are_never_worse(starts, variant, rule):
    for inst, routes in starts[(variant, rule)]:
        rules = RouteRules.from_instance(inst)
        start = solution_order(rules, routes)
        before = checked(inst, start)
        assert before.feasible
        result = local_search.improve(rules, routes)
        after = checked(inst, result.routes)
        assert after.feasible, (after.violation, after.position, result.routes)
        assert after.cost <= before.cost
        assert result.cost <= result.start_cost
        assert result.cost == pytest.approx(checker.tours_cost(np.asarray(inst.locs, np.float64), result.routes,
                                                               bool(inst.is_open)), abs=1e-5)
        assert result.local_optimum
        assert local_search.improve(rules, routes).routes == result.routes              # deterministic
        again = local_search.improve(rules, result.routes)                              # a local optimum
        assert again.routes == result.routes and sum(again.applied.values()) == 0
        granular = local_search.improve(rules, routes, neighbours=4)                    # a small neighbourhood
        assert checked(inst, granular.routes).feasible and granular.cost <= granular.start_cost
        assert granular.local_optimum


def test_the_search_improves_nearest_neighbour_starts(starts):
    gains = [local_search.improve(RouteRules.from_instance(inst), routes) for found in starts.values()
             for inst, routes in found]
    assert np.mean([g.cost < g.start_cost - 1e-3 for g in gains]) > 0.9
    assert {k for g in gains for k, v in g.applied.items() if v} == set(moves.KINDS)


@pytest.mark.parametrize("variant,rule", [("VRPBTW", "classic"), ("OVRPBLTW", "mixed"), ("VRPLTW", "paper")])
def test_a_round_looks_past_the_replay_cap_for_a_feasible_move(starts, variant, rule, monkeypatch):
    """Improving candidates are replayed a capped number at a time; where every one of a batch is infeasible the
    round goes on to the next batch, so with a cap of one candidate the search still stops only at a local
    optimum of every kind (which the uncapped search then confirms)."""
    for inst, routes in starts[(variant, rule)]:
        rules = RouteRules.from_instance(inst)
        monkeypatch.setattr(descent, "MAX_REPLAYED", 1)
        capped = local_search.improve(rules, routes)
        assert capped.local_optimum and checked(inst, capped.routes).feasible
        monkeypatch.undo()
        again = local_search.improve(rules, capped.routes)
        assert sum(again.applied.values()) == 0 and again.routes == capped.routes


def test_the_time_limit_stops_a_round_that_finds_nothing_without_claiming_an_optimum(starts, monkeypatch):
    """Every batch of candidates refused (a stand-in replay that finds nothing, 0.3 s a batch of one): without a
    time limit the round looks at every improving candidate and the start is a local optimum; with 0.5 s it stops
    after the batch that passes the limit and does not call the start one."""
    import time

    inst, routes = starts[("VRPB", "classic")][0]
    rules = RouteRules.from_instance(inst)
    calls = []

    def refuse_all(*args):
        calls.append(time.perf_counter())
        time.sleep(0.3 if limited else 0.0)
        return {}, []

    monkeypatch.setattr(descent, "MAX_REPLAYED", 1)
    monkeypatch.setattr(descent, "_apply_batch", refuse_all)
    limited = False
    full = local_search.improve(rules, routes)
    assert full.local_optimum and full.rounds == 1 and len(calls) > 3
    calls.clear()
    limited = True
    stopped = local_search.improve(rules, routes, time_limit=0.5)
    assert not stopped.local_optimum and stopped.rounds == 1 and 2 <= len(calls) <= 3
    assert checked(inst, stopped.routes).feasible


def test_a_move_breaking_the_classic_order_is_refused():
    """Depot (0, 0); a linehaul at (1, 0) and a backhaul at (0.5, 0): the shortest order serves the backhaul first,
    which the classic rule forbids; under the mixed rule the search takes it."""
    locs = [[0.0, 0.0], [0.5, 0.0], [1.0, 0.0]]
    for rule, best in ((1, [[2, 1]]), (2, [[1, 2]])):
        inst = tiny(locs, [0.0, -0.2, 0.3], is_open=jnp.asarray(True), backhaul_rule=jnp.int8(rule))
        result = local_search.improve(RouteRules.from_instance(inst), [[2, 1]])
        assert result.routes == best, rule
        assert checked(inst, result.routes).feasible


@pytest.mark.parametrize("routes,message", [([[1, 2]], "serve every customer once"),
                                            ([[1, 2, 3], [3]], "serve every customer once")])
def test_a_start_that_is_not_a_solution_is_refused(routes, message):
    inst = tiny([[0, 0], [0.1, 0], [0.2, 0], [0.3, 0]], [0.0, 0.1, 0.1, 0.1])
    with pytest.raises(local_search.StartInfeasibleError, match=message):
        local_search.improve(RouteRules.from_instance(inst), routes)


def test_an_infeasible_start_is_refused_naming_the_route():
    inst = tiny([[0, 0], [0.1, 0], [0.2, 0], [0.3, 0]], [0.0, 0.6, 0.6, 0.1])
    with pytest.raises(local_search.StartInfeasibleError, match=r"route 0: \[1, 2\]"):
        local_search.improve(RouteRules.from_instance(inst), [[1, 2], [3]])


def test_nearest_lists_each_customers_k_nearest_others():
    inst = jax.tree.map(lambda x: x[0], instances.generate(jax.random.key(5), 1, N, "CVRP"))
    dist = RouteRules.from_instance(inst).dist
    near = moves.nearest(dist, 4)
    assert near.shape == (N + 1, 4)
    for u in range(1, N + 1):
        others = [v for v in range(1, N + 1) if v != u]
        assert sorted(dist[u, near[u]].tolist()) == sorted(sorted(dist[u, others].tolist())[:4])
        assert u not in near[u] and 0 not in near[u]
    assert moves.nearest(dist, 100).shape == (N + 1, N - 1)          # capped at every other customer


INTER = ("relocate", "exchange", "two_opt_star")


@pytest.mark.parametrize("variant", ["CVRP", "OVRPBLTW"])
def test_granular_candidates_are_full_ones_once_each_adding_a_near_arc(starts, variant):
    """With K neighbours every granular candidate is one of the full enumeration's, listed once, and adds an arc
    between a customer and one of its K nearest or opens a route (an exchange swaps two such customers); with
    every other customer as a neighbour the granular enumeration is the full one."""
    for inst, routes in starts[(variant, "paper")]:
        rules = RouteRules.from_instance(inst)
        layout = moves.Layout.from_routes(routes, N)
        for k in (N - 1, 4):
            near = moves.nearest(rules.dist, k)
            is_near = np.zeros((N + 1, N + 1), bool)
            for u in range(1, N + 1):
                is_near[u, near[u]] = True
            for kind in INTER:
                full = {tuple(c) for c in moves.generate(kind, layout, rules.arc, 3).params.tolist()}
                granular = moves.generate(kind, layout, rules.arc, 3, near)
                listed = [tuple(c) for c in granular.params.tolist()]
                assert len(set(listed)) == len(listed) and set(listed) <= full, (kind, k)
                if k == N - 1:
                    assert set(listed) == full, kind
                rows, first, second = moves.build(layout, granular)
                a, a_len = moves.splice(layout, first)
                b, b_len = moves.splice(layout, second)
                old_arcs = {(t[m], t[m + 1]) for t in layout.rows.tolist() for m in range(len(t) - 1)}
                for c in range(len(listed)):
                    if kind == "exchange":
                        r, i, s_, j = listed[c][:4]
                        u, v = layout.rows[r, i], layout.rows[s_, j]
                        assert is_near[u, v] or is_near[v, u], (k, listed[c])
                        continue
                    new_routes = [a[c, :a_len[c]].tolist(), b[c, :b_len[c]].tolist()]
                    added = {(p, q) for t in new_routes if t for p, q in zip([0, *t], [*t, 0])} - old_arcs
                    near_arc = any(p and q and (is_near[p, q] or is_near[q, p]) for p, q in added)
                    opens = rows[c, 1] == len(layout.sizes) - 1
                    assert near_arc or opens, (kind, k, listed[c])
