"""Random instances of all 16 variants, mixed batches and edge cases through the rollout: every route the
policy returns is feasible by the checker and costs what a plain recomputation from the coordinates says;
an instance with a customer no route can serve is refused, by name, before any decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mvmoe_jax import checker, evaluation, problems, training
from mvmoe_jax.instances import concatenate, generate, take
from mvmoe_jax.io.json_instances import parse_instance
from mvmoe_jax.nn.policy import PolicyConfig
from mvmoe_jax.rollout import greedy_evaluate

N = 20
BATCH = 2
SMALL = PolicyConfig(model="mvmoe", embedding_dim=32, num_heads=4, num_layers=2, ff_hidden_dim=64,
                     expert_loc=("Enc0", "Enc1", "Dec"))
EDGE_CASES = ("as generated", "all backhauls but one", "all backhauls", "demands equal to the capacity", "coincident customers",
              "windows that only just admit", "limits that only just allow the round trip")


@pytest.fixture(scope="module")
def params():
    return training.init_params(SMALL, jax.random.key(0))


def _distances_to_depot(inst):
    return jnp.sqrt(jnp.sum((inst.locs[:, 1:] - inst.locs[:, :1]) ** 2, axis=-1))       # (B, n)


def _edge_case(inst, case: str):
    """The batch changed into one of the edge cases (each keeps every customer servable)."""
    demand = inst.demand
    if case in ("all backhauls but one", "all backhauls"):
        back = -jnp.abs(demand)
        if case == "all backhauls but one":
            back = back.at[:, 1].set(jnp.abs(demand[:, 1]))
        return inst.replace(demand=jnp.where(inst.has_backhaul[:, None], back, demand))
    if case == "demands equal to the capacity":
        return inst.replace(demand=jnp.sign(demand))
    if case == "coincident customers":        # customers 2..n on the depot (any window is reached in time)
        return inst.replace(locs=inst.locs.at[:, 2:].set(inst.locs[:, :1]))
    if case == "windows that only just admit":
        d0 = _distances_to_depot(inst)
        tws = inst.tw_start.at[:, 1:].set(jnp.where(inst.has_tw[:, None], d0, inst.tw_start[:, 1:]))
        twe = inst.tw_end.at[:, 1:].set(jnp.where(inst.has_tw[:, None], d0, inst.tw_end[:, 1:]))
        return inst.replace(tw_start=tws, tw_end=twe)
    if case == "limits that only just allow the round trip":
        limit = 2 * _distances_to_depot(inst).max(axis=1)
        return inst.replace(route_limit=jnp.where(inst.has_limit, limit, inst.route_limit))
    return inst


def _plain_cost(locs: np.ndarray, route: list[int], is_open: bool) -> float:
    """The tour length recomputed from coordinates alone (float64)."""
    return checker.tours_cost(np.asarray(locs, np.float64), checker.split_subtours(route), is_open)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(variants=st.lists(st.sampled_from([v.name for v in problems.VARIANTS]), min_size=1, max_size=2),
       seed=st.integers(0, 2**31 - 1), case=st.sampled_from(EDGE_CASES))
def test_every_returned_route_is_feasible_and_costs_what_it_says(params, variants, seed, case):
    inst = _edge_case(generate(jax.random.key(seed), BATCH, N, variants), case)
    assert not np.asarray(checker.unreachable_customers(inst)).any(), case        # the edge case is solvable
    res = jax.device_get(greedy_evaluate(SMALL, params, inst, jax.random.key(1), pomo_size=N))
    assert res.all_finished.all()
    routes = [checker.actions_to_route(a) for a in res.best_actions]
    checks = checker.check_routes(inst, routes)
    for b, (route, check) in enumerate(zip(routes, checks)):
        assert check.feasible, (variants, case, b, check)
        assert sorted(v for v in route if v) == list(range(1, N + 1))              # every customer once
        plain = _plain_cost(inst.locs[b], route, bool(inst.is_open[b]))
        np.testing.assert_allclose(res.obj[b], plain, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(check.cost, plain, rtol=1e-5, atol=1e-6)
        assert res.obj[b] <= res.obj_no_aug[b] + 1e-6                               # x8 keeps the best


@settings(max_examples=20, deadline=None)
@given(variant=st.sampled_from([v.name for v in problems.VARIANTS]), seed=st.integers(0, 2**31 - 1),
       fault=st.sampled_from(["window closed before arrival", "route limit shorter than a round trip",
                              "demand over the capacity"]))
def test_an_unservable_customer_is_refused_before_any_decoding(variant, seed, fault):
    var = problems.get_variant(variant)
    inst = generate(jax.random.key(seed), BATCH, N, variant)
    if fault == "window closed before arrival" and var.tw:
        d0 = _distances_to_depot(inst)
        inst = inst.replace(tw_start=inst.tw_start.at[1, 3].set(0.0), tw_end=inst.tw_end.at[1, 3].set(d0[1, 2] / 2))
    elif fault == "route limit shorter than a round trip" and var.limit and not var.open:
        inst = inst.replace(route_limit=inst.route_limit.at[1].set(2 * _distances_to_depot(inst)[1].max() * 0.9))
    else:
        inst = inst.replace(demand=inst.demand.at[1, 3].set(1.5 * jnp.sign(inst.demand[1, 3])))
    with pytest.raises(checker.InfeasibleInstanceError, match=r"hostile batch: 1 instance\(s\).*instance 1: customers \["):
        evaluation.evaluate_dataset(SMALL, None, inst, desc="hostile batch", progress=False)


@pytest.mark.parametrize("variant", ["VRPB", "OVRPBLTW"])
def test_an_instance_of_backhauls_only_is_solved(params, variant):
    """No linehaul to start from: the routes start at backhauls (the vehicle leaves the depot empty)."""
    inst = _edge_case(generate(jax.random.key(4), BATCH, N, variant), "all backhauls")
    assert (np.asarray(inst.demand)[:, 1:] < 0).all()
    res = jax.device_get(greedy_evaluate(SMALL, params, inst, jax.random.key(1), pomo_size=N))
    routes = [checker.actions_to_route(a) for a in res.best_actions]
    checker.verify_routes(inst, routes, res.obj, source=variant)
    assert np.isfinite(res.obj).all()


def _classic_square(second_pickup: float) -> dict:
    """One delivery of 3 and pickups of 20 and ``second_pickup`` on a capacity of 30 under the classic rule: the
    delivery opens the only route the pickups may use, so with a second pickup of 20 no solution exists."""
    return {"capacity": 30, "depot": [0, 0], "customers": [[0, 10], [10, 10], [5, 5]],
            "demand": [3, -20, -second_pickup], "backhauls": "classic"}


def test_a_dataset_instance_no_rollout_finishes_is_unsolved_and_the_rest_are_checked(params):
    """Dataset evaluation goes on past an instance every rollout of which dead-ends (no exception): its objective
    is +inf and it is left out of the mean, while the solved instance's route is checked and costed."""
    stuck, _ = parse_instance(_classic_square(20), "stuck", "stuck")
    fine, _ = parse_instance(_classic_square(5), "fine", "fine")
    res = evaluation.evaluate_dataset(SMALL, params, concatenate([stuck, fine]), batch_size=2, progress=False)
    assert res.solved.tolist() == [False, True]
    assert np.isinf(res.obj[0]) and np.isfinite(res.obj[1])
    assert res.mean == res.obj[1]
    check = checker.check_routes(take(concatenate([stuck, fine]), np.array([1])), [res.routes[1]])[0]
    assert check.feasible and sorted(v for v in res.routes[1] if v) == [1, 2, 3]
    np.testing.assert_allclose(check.cost, res.obj[1], rtol=1e-5)
