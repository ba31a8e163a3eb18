"""Simulation-guided beam search (``--search=sgbs``) and SGBS + EAS (``--search=sgbs_eas``): every route passes the
checker at its stated cost on all 16 variants and every backhaul rule, never worse than greedy, the beam's
bookkeeping agrees with an independent replay, results repeat by seed and do not depend on how many instances are
searched at once, the time limit and bad settings are handled clearly.

Like tests/test_eas.py, most tests use tests/test_solve.py's small freshly initialised model with a small beam;
the test that SGBS improves on greedy uses the briefly trained n = 20 fixture from ../shared.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mvmoe_jax import checker, env, execution, instances, problems
from mvmoe_jax.io import save_npz
from mvmoe_jax.solve import api, eas, search, sgbs
from mvmoe_jax.solve.__main__ import main

from conftest import REPO_ROOT, require_shared, xla_flags_env
from test_solve import N, SMALL, generated, shipped_small, small_params  # noqa: F401, F811  (fixtures)

BEAM = dict(beam_width=2, expansion=3)          # small beams: cheap, and still several children per node


def every_variant() -> instances.Instance:
    """One instance of each of the 16 variants; those with backhauls under each of the three rules in turn (classic
    only without time windows: under it an untrained model's rollouts can end in dead ends that never finish)."""
    without_tw, with_tw = iter(["paper", "classic", "mixed", "classic"]), iter(["mixed", "paper"] * 2)
    picked = []
    for i, v in enumerate(problems.VARIANTS):
        rule = "paper" if not v.backhaul else next(with_tw if v.tw else without_tw)
        batch = instances.generate(jax.random.key(100 + i), 8, N, v.name, backhaul_rule=rule)
        picked.append(jax.tree.map(lambda x: x[0], batch))
    return instances.stack(picked)


def assert_checked(batch, solutions):
    """Each solution replayed through the checker on its own instance: feasible, at the cost stated."""
    for i, s in enumerate(solutions):
        assert s.feasible, (i, s.violation)
        report = checker.check_route(jax.tree.map(lambda x: x[i], batch), [c for r in s.routes for c in (*r, 0)])
        assert report.feasible and report.cost == pytest.approx(s.cost, rel=1e-5), (i, report)


@pytest.mark.parametrize("method", ["sgbs", "sgbs_eas"])
def test_every_route_passes_the_checker_on_every_variant_and_rule_and_never_loses_to_greedy(small_params, method):
    batch = every_variant()
    assert sorted(instances.variant_names(batch)) == sorted(v.name for v in problems.VARIANTS)
    greedy = api.solve_instances(SMALL, small_params, batch, batch_size=8)
    found = api.solve_instances(SMALL, small_params, batch, search=method, rounds=1, seed=1, batch_size=8, **BEAM)
    assert_checked(batch, found)
    for g, s in zip(greedy, found):
        assert s.search == method and s.rounds == 1 and 1 <= s.depths <= 2 * N
        assert s.greedy_cost == pytest.approx(g.cost, rel=1e-12)
        assert s.cost <= g.cost
    assert sum(s.cost for s in found) < sum(g.cost for g in greedy)          # the search does find better routes


@jax.jit
def replayed(copies, completion, moves):
    """The states (B, A, W) reached from the depot by the first ``moves`` entries of each completion (B, A, W, T + 1),
    stepped one by one through env.step on each node's copy (B, A)."""
    def one(inst, route):
        def body(state, xs):
            k, action = xs
            moved = env.step(state, action)
            return jax.tree.map(lambda x, y: jnp.where(k < moves, x, y), moved, state), None
        return jax.lax.scan(body, env.reset(inst), (jnp.arange(route.shape[0]), route))[0]
    return jax.vmap(jax.vmap(jax.vmap(one, in_axes=(None, 0))))(copies, completion)


def test_the_beam_nodes_completions_replay_to_their_states_and_values(small_params):
    """After each depth every beam node's known completion is a feasible route set (checker) whose cost is the
    node's value, its first moves lead to the node's state (an independent replay through env.step), the beam's
    best value never rises, and the incumbent is a feasible route set at its cost, no worse than any node's."""
    batch = generated("VRPBLTW", 2, seed=21)
    plan, width, key = execution.default_plan("cpu"), 3, jax.random.key(4)
    copies, emb = eas.encoded_copies(SMALL, plan, small_params, batch, key)
    first = sgbs.first_rollouts(SMALL, plan, small_params, copies, emb, key, starts=N, chunk=1, num_devices=1)
    t1 = first.actions.shape[-1]
    incumbent = (jnp.full((2,), jnp.inf), jnp.zeros((2, t1), jnp.int32))
    beam, cost, actions = sgbs.initial_beam(copies, first, jnp.int32(0), *incumbent, width=width)
    assert np.array_equal(cost, np.min(np.asarray(first.cost).reshape(2, -1), axis=1))
    best = np.asarray(beam.value).min(-1)
    nodes = jax.tree.map(lambda x: jnp.repeat(x.reshape((16,) + x.shape[2:]), width, axis=0), copies)
    for depth in range(5):
        beam, cost, actions, _ = sgbs.depth_step(SMALL, plan, small_params, copies, emb, beam, cost, actions,
                                                 jnp.int32(depth), key, expansion=3, chunk=1, num_devices=1)
        value = np.asarray(beam.value)
        assert np.all(value.min(-1) <= best) and np.all(np.asarray(cost) <= value.min((1, 2)))
        best = value.min(-1)
        state = replayed(copies, beam.completion, depth + 2)          # the start node, then depth + 1 moves
        for field in ("current", "visited", "finished"):
            assert np.array_equal(getattr(state, field), getattr(beam.states, field)), field
        np.testing.assert_allclose(state.cost, beam.states.cost, rtol=1e-6)
        routes = [checker.actions_to_route(r) for r in np.asarray(beam.completion).reshape(-1, t1)]
        for check, v in zip(checker.check_routes(nodes, routes), value.reshape(-1)):
            assert (check.feasible and check.cost == pytest.approx(float(v), rel=1e-5)) or np.isinf(v)
        assert np.isfinite(value).any()
    for i, check in enumerate(checker.check_routes(batch, [checker.actions_to_route(a) for a in np.asarray(actions)])):
        assert check.feasible and check.cost == pytest.approx(float(cost[i]), rel=1e-5)
    # Both instances searched at once: the same beams and incumbents.
    beam2, cost2, actions2 = sgbs.initial_beam(copies, first, jnp.int32(0), *incumbent, width=width)
    for depth in range(5):
        beam2, cost2, actions2, _ = sgbs.depth_step(SMALL, plan, small_params, copies, emb, beam2, cost2, actions2,
                                                    jnp.int32(depth), key, expansion=3, chunk=2, num_devices=1)
    assert np.array_equal(beam2.completion, beam.completion) and np.array_equal(beam2.value, beam.value)
    assert np.array_equal(actions2, actions) and np.array_equal(cost2, cost)


def test_sgbs_gives_the_same_routes_whether_instances_go_one_or_several_at_a_time(small_params):
    batch = generated("CVRP", 8, seed=13)
    together = api.solve_instances(SMALL, small_params, batch, search="sgbs", rounds=2, **BEAM)
    alone = api.solve_instances(SMALL, small_params, batch, search="sgbs", rounds=2, batch_size=1, **BEAM)
    assert [(s.cost, s.routes, s.depths) for s in alone] == [(s.cost, s.routes, s.depths) for s in together]
    assert all(s.rounds == 2 for s in together)


def test_sgbs_eas_repeats_by_seed_and_the_seed_matters(small_params):
    batch = generated("OVRPBLTW", 8, seed=7)
    first = api.solve_instances(SMALL, small_params, batch, search="sgbs_eas", rounds=2, seed=3, **BEAM)
    again = api.solve_instances(SMALL, small_params, batch, search="sgbs_eas", rounds=2, seed=3, **BEAM)
    other = api.solve_instances(SMALL, small_params, batch, search="sgbs_eas", rounds=2, seed=4, **BEAM)
    assert [(s.cost, s.routes, s.depths) for s in again] == [(s.cost, s.routes, s.depths) for s in first]
    assert [s.routes for s in other] != [s.routes for s in first]
    plain = api.solve_instances(SMALL, small_params, batch, search="sgbs", rounds=1, seed=3, **BEAM)
    replain = api.solve_instances(SMALL, small_params, batch, search="sgbs", rounds=1, seed=9, **BEAM)
    assert [(s.cost, s.routes) for s in replain] == [(s.cost, s.routes) for s in plain]     # draws nothing
    assert_checked(batch, first)
    assert_checked(batch, plain)


def test_a_time_limit_too_short_for_a_depth_leaves_greedys_routes(small_params):
    batch = generated("OVRPBLTW", 8, seed=7)
    greedy = api.solve_instances(SMALL, small_params, batch)
    for method in ("sgbs", "sgbs_eas"):
        short = api.solve_instances(SMALL, small_params, batch, search=method, time_limit=1e-6, **BEAM)
        assert [(s.rounds, s.depths) for s in short] == [(0, 0)] * 8
        assert [s.routes for s in short] == [g.routes for g in greedy]


TWO_DEVICES = """
import json, sys
sys.path.insert(0, "tests")
import jax
from test_sgbs import BEAM, SMALL, generated, small_model
from mvmoe_jax.solve import api
assert len(jax.devices()) == 2
params, batch = small_model(), generated("VRPBTW", 3, seed=5)
out = {s: [(x.cost, x.routes, x.depths) for x in api.solve_instances(SMALL, params, batch, search=s, rounds=2, seed=1,
                                                                       **BEAM)]
       for s in ("sgbs", "sgbs_eas")}
print(json.dumps(out))
"""


def small_model():
    """tests/test_solve.py's ``small_params``, outside pytest."""
    from mvmoe_jax.nn.policy import Policy
    return jax.jit(Policy(SMALL, execution.reference()).init)({"params": jax.random.key(1),
                                                               "gating": jax.random.key(2)}, generated("CVRP", 1))


@pytest.mark.slow
def test_two_devices_search_as_one_does(small_params):
    """With the instances dealt out over two devices (the command's default on a 2-core CPU) SGBS and SGBS + EAS
    give what one device gives."""
    env = xla_flags_env("--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", TWO_DEVICES], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(proc.stdout.strip().splitlines()[-1])
    batch = generated("VRPBTW", 3, seed=5)
    for method in ("sgbs", "sgbs_eas"):
        one = api.solve_instances(SMALL, small_params, batch, search=method, rounds=2, seed=1, **BEAM)
        assert [[x.cost, x.routes, x.depths] for x in one] == two[method]


@pytest.mark.slow
def test_sgbs_improves_on_greedy_with_the_trained_fixture():
    ckpt = require_shared("fixtures", "torch-reference", "checkpoints", "moe_n20_fixture.pt")
    from mvmoe_jax import checkpoints
    cfg, params = checkpoints.load_policy(str(ckpt))
    batch = instances.take(instances.generate(jax.random.key(0), 8, N, "CVRP"), np.arange(4))
    greedy = api.solve_instances(cfg, params, batch)
    found = api.solve_instances(cfg, params, batch, search="sgbs", rounds=1)
    assert_checked(batch, found)
    assert all(s.cost <= g.cost for g, s in zip(greedy, found))
    assert sum(s.cost for s in found) < sum(g.cost for g in greedy)


def test_the_command_runs_sgbs_under_a_time_limit_and_reports_its_depths(tmp_path, shipped_small, capsys):
    save_npz(tmp_path / "one.npz", generated("VRPTW", 1, seed=3))
    out = tmp_path / "out"
    code = main([str(tmp_path / "one.npz"), "--search=sgbs", "--time_limit=30", "--rounds=2", "--beam_width=2",
                 "--expansion=3", f"--output={out}", "--no_progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "n=20 sgbs: all 20 POMO starts, 1 of 1 instances (8 copies each) decoded at a time" in captured.out, \
        captured.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["search"] == "sgbs" and summary["settings"]["beam_width"] == 2
    [s] = summary["instances"]
    # Two passes, each until the beam has finished: at least n moves after the start, at most 2n.
    assert s["feasible"] and s["cost"] <= s["greedy_cost"] and s["rounds"] == 2
    assert 2 * N <= s["depths"] <= 2 * 2 * N


@pytest.mark.parametrize("settings, message", [
    (dict(beam_width=0), "--beam_width must be a positive integer, got 0"),
    (dict(expansion=1), "--expansion must be an integer >= 2 (the greedy child and at least one other), got 1"),
    (dict(expansion=2.5), "--expansion must be an integer >= 2"),
])
def test_bad_beam_settings_are_refused_with_a_clear_error(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        search.Settings(**settings)


def test_the_command_refuses_a_bad_expansion(tmp_path, capsys):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"capacity": 5, "depot": [0, 0], "customers": [[3, 4]], "demand": [1]}))
    assert main([str(path), "--search=sgbs", "--expansion=1", f"--output={tmp_path / 'out'}"]) == 2
    assert "error: --expansion must be an integer >= 2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
