"""Each feasibility rule and the cost, on small hand-built instances, and the route checker."""

import jax
import numpy as np
import pytest

from mvmoe_jax import checker, env, instances


def _single(variant, xy, demand, capacity=10.0, **kw):
    xy = np.asarray(xy, np.float32)
    b = instances.from_arrays(xy[:1], xy[None, 1:], np.asarray(demand, np.float32)[None], capacity,
                              variant=variant, **kw)
    return jax.tree.map(lambda x: x[0], b)


def _rules(state):
    v = np.asarray(env.violations(state))
    return {name: v[i] for i, name in enumerate(env.RULES)}


LINE = [[0, 0], [0.3, 0], [0.6, 0], [0.9, 0]]   # depot at 0, customers on a line


def test_capacity_and_refill():
    inst = _single("CVRP", LINE, [6, 5, 4])
    s = env.step(env.reset(inst), 1)
    np.testing.assert_allclose(float(s.load), 0.4, atol=1e-6)
    r = _rules(s)
    assert r["capacity"].tolist() == [False, True, True, False]   # 0.4 left: 0.6 and 0.5 too big
    s = env.step(env.step(s, 0), 2)
    np.testing.assert_allclose(float(s.load), 0.5, atol=1e-6)


def test_backhaul_cannot_open_a_route_and_overload():
    # customer 1 linehaul 6, customer 2 backhaul 5, customer 3 backhaul 8.
    inst = _single("VRPB", LINE, [6, -5, -8])
    s = env.reset(inst)
    assert _rules(s)["backhaul_overload"].tolist() == [False, False, True, True]
    s = env.step(s, 1)                  # load 0.4: backhaul 5 fits (0.9 <= 1), 8 does not (1.2 > 1)
    assert _rules(s)["backhaul_overload"].tolist() == [False, False, False, True]
    s = env.step(s, 0)                  # only backhauls left: leave empty
    assert float(s.load) == 0.0
    assert env.action_mask(s).tolist() == [False, False, True, True]


def test_route_limit_closed_and_open():
    xy = [[0, 0], [1.0, 0], [0, 1.2]]
    closed = env.reset(_single("VRPL", xy, [1, 1], route_limit=2.1))
    assert _rules(closed)["route_limit"].tolist() == [False, False, True]     # 1.2 + 1.2 > 2.1
    opened = env.reset(_single("OVRPL", xy, [1, 1], route_limit=1.1))
    assert _rules(opened)["route_limit"].tolist() == [False, False, True]     # 1.2 > 1.1, return free
    s = env.step(opened, 1)
    assert not _rules(s)["route_limit"][0]                                    # depot never limited


def test_time_windows_and_depot_closing():
    xy = [[0, 0], [0.5, 0], [0, 1.0]]
    kw = dict(service_time=[[0.2, 0.2]], tw_start=[[1.0, 0.0]], tw_end=[[1.5, 0.9]])
    s = env.reset(_single("VRPTW", xy, [1, 1], **kw))
    assert _rules(s)["time_window"].tolist() == [False, False, True]          # arrive 1.0 > 0.9
    s = env.step(s, 1)                                                          # wait to 1.0, leave 1.2
    np.testing.assert_allclose(float(s.time), 1.2, atol=1e-6)
    kw = dict(service_time=[[0.2, 0.2]], tw_start=[[2.5, 0.0]], tw_end=[[2.9, 3.0]])
    s = env.reset(_single("VRPTW", xy, [1, 1], **kw))
    # customer 1: start 2.5 + 0.2 + 0.5 back = 3.2 > 3: closed routes must reach the depot in time.
    assert _rules(s)["depot_closing"].tolist() == [False, True, False]
    s_open = env.reset(_single("OVRPTW", xy, [1, 1], **kw))
    assert not _rules(s_open)["depot_closing"].any()


def test_open_route_cost_and_finish():
    inst = _single("OVRP", LINE, [1, 1, 1])
    s = env.reset(inst)
    for a in [1, 2, 0, 3, 0]:
        assert env.action_mask(s)[a]
        s = env.step(s, a)
    assert bool(env.done(s))
    np.testing.assert_allclose(float(env.cost(s)), 0.3 + 0.3 + 0.9, atol=1e-6)   # returns are free
    assert env.action_mask(s).tolist() == [True, False, False, False]
    s2 = env.step(s, 0)
    assert float(env.cost(s2)) == float(env.cost(s))


def test_checker_reports_first_violation_and_cost():
    inst = _single("CVRP", LINE, [6, 5, 4])
    ok = checker.check_route(inst, [1, 0, 2, 3])
    assert ok.feasible and ok.violation is None
    np.testing.assert_allclose(ok.cost, 0.6 + 1.8, atol=1e-6)
    bad = checker.check_route(inst, [1, 2, 0, 3])
    assert not bad.feasible and bad.violation == "capacity" and bad.position == 1 and bad.node == 2
    np.testing.assert_allclose(bad.cost, 0.3 + 0.3 + 0.6 + 1.8, atol=1e-6)
    unserved = checker.check_route(inst, [1, 0, 2])
    assert not unserved.feasible and unserved.violation == "unserved_customers"
    twice = checker.check_route(inst, [1, 0, 1, 0, 2, 3])
    assert twice.violation == "visited" and twice.position == 2
    assert checker.check_route(inst, [0, 1, 0, 2, 3, 0]).feasible      # leading / trailing depots ok


def test_checker_rejects_bad_input():
    inst = _single("CVRP", LINE, [1, 1, 1])
    with pytest.raises(ValueError, match="node index 7 out of range 0..3"):
        checker.check_route(inst, [1, 7, 2])
    batch = jax.tree.map(lambda x: x[None], inst)
    with pytest.raises(ValueError, match="2 routes for 1 instances"):
        checker.check_routes(batch, [[1, 2, 3], [1]])


def test_from_arrays_rejects_inconsistent_input():
    with pytest.raises(ValueError, match="negative .*backhaul"):
        _single("CVRP", LINE, [1, -1, 1])
    with pytest.raises(ValueError, match="needs service_time"):
        _single("VRPTW", LINE, [1, 1, 1])
    with pytest.raises(ValueError, match="needs a route_limit"):
        _single("VRPL", LINE, [1, 1, 1])
    with pytest.raises(ValueError, match="node_xy holds non-finite"):
        _single("CVRP", [[0, 0], [0.3, np.nan], [0.6, 0], [0.9, 0]], [1, 1, 1])
    with pytest.raises(ValueError, match="depot_xy holds non-finite"):
        _single("CVRP", [[np.inf, 0], [0.3, 0], [0.6, 0], [0.9, 0]], [1, 1, 1])
    with pytest.raises(ValueError, match="demand holds non-finite"):
        _single("CVRP", LINE, [1, np.nan, 1])
    with pytest.raises(ValueError, match="tw_end holds non-finite"):
        _single("VRPTW", LINE, [1, 1, 1], service_time=[0.1] * 3, tw_start=[0.0] * 3, tw_end=[1.0, np.nan, 1.0])


def test_actions_to_route_round_trip():
    assert checker.actions_to_route([3, 1, 0, 2, 0, 0, 0]) == [3, 1, 0, 2]
    assert checker.split_subtours([3, 1, 0, 2]) == [[3, 1], [2]]


@pytest.mark.parametrize("num_nodes", [21, 51, 101])
def test_distance_matrix_rounds_like_the_reference(num_nodes):
    """Every distance is sqrt(dx*dx + dy*dy) with each operation rounded to float32, as the reference
    computes one move (numpy's float32 arithmetic, no fused multiply-add), bit for bit, at the sizes
    XLA:CPU compiles differently; batched input gives the same matrices."""
    locs = np.asarray(jax.random.uniform(jax.random.key(num_nodes), (3, num_nodes, 2)), np.float32)
    diff = locs[:, None, :, :] - locs[:, :, None, :]
    squares = diff * diff
    expected = np.sqrt(squares[..., 0] + squares[..., 1])
    np.testing.assert_array_equal(np.asarray(jax.jit(env.distance_matrix)(locs[0])), expected[0])
    np.testing.assert_array_equal(np.asarray(jax.jit(env.distance_matrix)(locs)), expected)
