"""Efficient active search (``--search=eas``): the teacher-forced replay reproduces the sampled rollouts'
log-likelihood, EAS is never worse than greedy and improves on it, repeats exactly by seed, its routes pass the
checker at their stated cost, ``--save_adapted`` round-trips, and bad settings are refused clearly.

Like tests/test_solve.py, most tests use its small freshly initialised model; the test that EAS improves on
greedy uses the briefly trained n = 20 fixture from ../shared.
"""

from __future__ import annotations

import json
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mvmoe_jax import checker, execution, instances, rollout
from mvmoe_jax.io import save_npz
from mvmoe_jax.nn.policy import Policy, PolicyConfig
from mvmoe_jax.solve import api, eas, search
from mvmoe_jax.solve.__main__ import main

from conftest import require_shared
from test_solve import N, SMALL, generated, shipped_small, small_params  # noqa: F401, F811  (fixtures)

SMALL_LIGHT = PolicyConfig(model="mvmoe_light", embedding_dim=32, num_heads=4, num_layers=2, ff_hidden_dim=64,
                           expert_loc=("Enc0", "Dec"))


@pytest.mark.parametrize("cfg", [SMALL, SMALL_LIGHT], ids=["mvmoe", "mvmoe_light"])
def test_the_forced_replay_reproduces_the_sampled_log_likelihood_and_the_stepwise_gradient_its_own(cfg):
    """Replayed along its own sampled trajectories, with the rollout's step keys, the decoder (in the
    differentiable form, without the query tables) gives each trajectory the log-likelihood the sampling pass
    summed, MVMoE-L's gate draws included; ``eas_gradient`` agrees with jax.grad through that replay."""
    batch = generated("VRPBLTW", 2, seed=11)
    plan = execution.default_plan("cpu")
    policy = Policy(cfg, plan)
    params = jax.jit(Policy(cfg, execution.reference()).init)({"params": jax.random.key(3), "gating": jax.random.key(4)},
                                                              batch)
    key = jax.random.key(9)

    @jax.jit
    def run(params, batch):
        emb, _ = rollout.encode_nodes(policy, params, batch, key)
        out = rollout.rollout(policy, params, batch, pomo_size=N, decode_type="sampling", rng=key,
                              encoded=(policy.apply(params, emb, method=Policy.precompute), jnp.float32(0.0)))
        cache = policy.apply(params, emb, False, method=Policy.precompute)
        _, keys = rollout.decoding_keys(key, 2 * N)
        ll, ok = eas.forced_log_likelihood(policy, params, cache, batch, out.actions, keys, N)
        # The stepwise gradient of a weighted sum of the log-likelihoods against jax.grad of the replay.
        weights = jax.random.normal(jax.random.key(5), ll.shape)
        stepwise = eas.eas_gradient(policy, params, emb, batch, out.actions, weights, keys, N)
        replayed = jax.grad(lambda e: jnp.sum(weights * eas.forced_log_likelihood(
            policy, params, policy.apply(params, e, False, method=Policy.precompute), batch, out.actions, keys,
            N)[0]))(emb)
        return out, ll, ok, stepwise, replayed

    out, ll, ok, stepwise, replayed = run(params, batch)
    assert bool(jnp.all(out.finished)) and bool(jnp.all(ok))
    np.testing.assert_allclose(np.asarray(ll), np.asarray(out.log_likelihood), rtol=1e-4, atol=1e-3)
    assert float(jnp.max(jnp.abs(replayed))) > 0
    np.testing.assert_allclose(np.asarray(stepwise), np.asarray(replayed), rtol=1e-3,
                               atol=1e-4 * float(jnp.max(jnp.abs(replayed))))


def test_a_forbidden_forced_move_stops_the_log_likelihood_with_a_finite_gradient(small_params):
    """An incumbent whose move a copy's mask forbids (here: a customer visited twice) is flagged, its
    log-likelihood stops there, and the loss's gradient stays finite."""
    batch = generated("CVRP", 1, seed=12)
    policy = Policy(SMALL, execution.default_plan("cpu"))
    emb, _ = rollout.encode_nodes(policy, small_params, batch, jax.random.key(0))
    tour = np.zeros((1, 2, 2 * N + 1), np.int32)
    tour[0, 0, :3] = [1, 2, 0]                    # then the depot again: forbidden with customers left
    tour[0, 1, :4] = [1, 2, 2, 0]                 # customer 2 again: forbidden
    keys = rollout.decoding_keys(jax.random.key(1), 2 * N)[1]

    def second(emb):
        cache = policy.apply(small_params, emb, False, method=Policy.precompute)
        ll, ok = eas.forced_log_likelihood(policy, small_params, cache, batch, jnp.asarray(tour), keys, 1)
        return ll[0, 1], (ll, ok)

    grad, (ll, ok) = jax.grad(second, has_aux=True)(emb)
    assert np.asarray(ok).tolist() == [[False, False]]          # the first never returns to serve the rest
    assert np.all(np.isfinite(np.asarray(ll))) and np.all(np.isfinite(np.asarray(grad)))
    # Both first move to customer 2; the first then counts its move to the depot too, the second stops there.
    assert float(ll[0, 0]) < float(ll[0, 1]) < 0.0
    stepwise = eas.eas_gradient(policy, small_params, emb, batch, jnp.asarray(tour), jnp.asarray([[0.0, 1.0]]), keys, 1)
    np.testing.assert_allclose(np.asarray(stepwise), np.asarray(grad), rtol=1e-4, atol=1e-6)


def test_eas_is_never_worse_than_greedy_repeats_by_seed_and_its_routes_pass_the_checker(small_params):
    batch = generated("OVRPBLTW", 8, seed=7)
    greedy = api.solve_instances(SMALL, small_params, batch)
    first = api.solve_instances(SMALL, small_params, batch, search="eas", rounds=4, seed=3, keep_adapted=True)
    again = api.solve_instances(SMALL, small_params, batch, search="eas", rounds=4, seed=3)
    other = api.solve_instances(SMALL, small_params, batch, search="eas", rounds=4, seed=4)
    for g, s, t in zip(greedy, first, again):
        assert g.feasible and s.feasible and s.rounds == 4 and s.search == "eas"
        assert s.greedy_cost == pytest.approx(g.cost, rel=1e-12)
        assert s.cost <= g.cost
        assert (t.cost, t.routes) == (s.cost, s.routes)
        assert s.adapted.shape == (8, N + 1, SMALL.embedding_dim) and t.adapted is None
    assert sum(s.cost for s in first) < sum(g.cost for g in greedy)
    assert [s.routes for s in other] != [s.routes for s in first]          # the seed matters
    for i, s in enumerate(first):
        report = checker.check_route(jax.tree.map(lambda x: x[i], batch), [c for r in s.routes for c in (*r, 0)])
        assert report.feasible and report.cost == pytest.approx(s.cost, rel=1e-5)
    # A time limit too short for one iteration leaves greedy's routes.
    short = api.solve_instances(SMALL, small_params, batch, search="eas", time_limit=1e-6)
    assert [s.rounds for s in short] == [0] * 8 and [s.cost for s in short] == [g.cost for g in greedy]


def test_eas_adapts_the_same_whether_instances_go_one_or_several_at_a_time(small_params):
    """Each instance has its own key, embeddings and Adam state: adapting the batch one instance at a time or
    all at once gives the same solutions (embeddings equal to float rounding)."""
    batch = generated("CVRP", 4, seed=13)
    cfg, plan = SMALL, execution.default_plan("cpu")
    decoder = search.Decoder(cfg, small_params, search.Settings(), plan)
    key = jax.random.key(2)
    greedy = search.greedy_search(decoder, batch, key, 4)
    out = {}
    for chunk in (1, 4):
        copies, state = eas.start(cfg, plan, small_params, batch, key, greedy.cost, greedy.actions,
                                  learning_rate=eas.LEARNING_RATE)
        step = partial(eas.adapt_iteration, cfg, plan, small_params, starts=N, chunk=chunk, num_devices=1,
                       learning_rate=eas.LEARNING_RATE, imitation_weight=eas.IMITATION_WEIGHT)
        for r in range(3):
            state = step(copies, state, jax.random.fold_in(key, r))
        out[chunk] = jax.device_get(state)
    assert out[1].best_cost.tolist() == out[4].best_cost.tolist()
    assert np.array_equal(out[1].best_actions, out[4].best_actions)
    np.testing.assert_allclose(out[1].embeddings, out[4].embeddings, atol=1e-5)
    initial = eas.start(cfg, plan, small_params, batch, key, greedy.cost, greedy.actions,
                        learning_rate=eas.LEARNING_RATE)[1].embeddings
    assert not np.allclose(out[1].embeddings, initial)                   # they were adapted


def test_eas_improves_on_greedy_with_the_trained_fixture():
    ckpt = require_shared("fixtures", "torch-reference", "checkpoints", "moe_n20_fixture.pt")
    from mvmoe_jax import checkpoints
    cfg, params = checkpoints.load_policy(str(ckpt))
    batch = instances.take(instances.generate(jax.random.key(0), 8, N, "CVRP"), np.arange(4))
    greedy = api.solve_instances(cfg, params, batch)
    found = api.solve_instances(cfg, params, batch, search="eas", rounds=30, seed=0)
    assert all(s.feasible and s.cost <= g.cost for g, s in zip(greedy, found))
    assert sum(s.cost for s in found) < sum(g.cost for g in greedy)


def test_the_command_runs_eas_under_a_time_limit_and_saves_the_adapted_embeddings(tmp_path, shipped_small, capsys):
    save_npz(tmp_path / "d.npz", generated("CVRP", 8, seed=14))            # the shapes of the tests above
    (tmp_path / "tiny.json").write_text(json.dumps(
        {"name": "tiny", "capacity": 5, "depot": [0, 0], "customers": [[3, 4], [6, 8], [1, 7]], "demand": [1, 2, 2]}))
    out, adapted = tmp_path / "out", tmp_path / "adapted.weights"
    code = main([str(tmp_path / "d.npz"), str(tmp_path / "tiny.json"), "--search=eas", "--time_limit=0.5",
                 f"--output={out}", f"--save_adapted={adapted}", "--no_progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "instances (8 copies each) decoded at a time" in captured.out
    assert f"adapted embeddings: {adapted}" in captured.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["search"] == "eas" and summary["adapted_file"] == str(adapted)
    assert summary["settings"]["eas_learning_rate"] == eas.LEARNING_RATE
    for s in summary["instances"]:
        assert s["feasible"] and s["cost"] <= s["greedy_cost"] and s["seconds"] > 0
    with np.load(adapted, allow_pickle=False) as z:              # plain arrays, the name as given
        assert sorted(z.files) == ["copies", "embeddings_n20", "embeddings_n3", "method", "model_n20", "model_n3",
                                   "names_n20", "names_n3", "sources_n20", "sources_n3"]
        assert z["names_n20"].tolist() == [f"d-{i}" for i in range(8)] and z["names_n3"].tolist() == ["tiny"]
        assert z["embeddings_n20"].shape == (8, 8, N + 1, SMALL.embedding_dim) and z["embeddings_n20"].dtype == np.float32
        assert z["embeddings_n3"].shape == (1, 8, 4, SMALL.embedding_dim)
        assert str(z["model_n20"]) == "small_n20" and str(z["method"]) == "eas-emb"
        assert z["copies"].tolist()[:2] == ["(x, y)", "(1-x, y)"]
        assert z["sources_n20"].tolist() == [f"{tmp_path / 'd.npz'}#{i}" for i in range(8)]
        assert np.all(np.isfinite(z["embeddings_n20"]))


@pytest.mark.parametrize("settings, message", [
    (dict(rounds=-3), "--rounds must be a positive integer, got -3"),
    (dict(rounds=0), "--rounds must be a positive integer, got 0"),
    (dict(eas_learning_rate=0.0), "--eas_learning_rate must be a positive number, got 0.0"),
    (dict(eas_learning_rate=float("nan")), "--eas_learning_rate must be a positive number"),
    (dict(eas_imitation_weight=-0.1), "--eas_imitation_weight must be a number >= 0, got -0.1"),
    (dict(time_limit=-1.0), "--time_limit must be a positive number of seconds, got -1.0"),
])
def test_bad_eas_settings_are_refused_with_a_clear_error(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        search.Settings(**settings)


def test_the_command_refuses_bad_eas_options(tmp_path, shipped_small, capsys):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"capacity": 5, "depot": [0, 0], "customers": [[3, 4]], "demand": [1]}))
    assert main([str(path), "--search=eas", "--rounds=-2", f"--output={tmp_path / 'out'}"]) == 2
    assert "error: --rounds must be a positive integer, got -2" in capsys.readouterr().err
    assert main([str(path), f"--save_adapted={tmp_path / 'a.npz'}", f"--output={tmp_path / 'out'}"]) == 2
    assert "error: --save_adapted needs --search=eas: only EAS adapts parameters (search is 'greedy')" \
        in capsys.readouterr().err
    assert main([str(path), "--search=eas", "--eas_learning_rate=-1", f"--output={tmp_path / 'out'}"]) == 2
    assert "error: --eas_learning_rate must be a positive number, got -1.0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "a.npz").exists()
