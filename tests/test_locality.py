"""Distance-aware decoding (``mvmoe_jax/nn/locality.py``; ``PolicyConfig.distance_bias`` and ``candidates``):
the candidate set against a brute-force one, the bias exactly where it is documented, k >= n decoding the full
decoder's tours bit for bit, every route feasible at n = 100 and 200 with the options on (greedy, sampling and
EAS), a finite gradient, and the command-line flags with their reports and errors. That every execution plan
carries the options is in tests/test_execution_plan.py."""

from __future__ import annotations

import dataclasses
import json
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mvmoe_jax import checker, checkpoints, cli, execution, instances, rollout, shipped, training
from mvmoe_jax.nn import locality, policy as policy_lib
from mvmoe_jax.nn.policy import Policy, PolicyConfig
from mvmoe_jax.solve import api, models
from mvmoe_jax.solve.__main__ import main
from test_fast_paths import perturbed_params

N = 20
CFG = PolicyConfig(model="mvmoe", embedding_dim=16, num_heads=2, num_layers=1, ff_hidden_dim=32,
                   expert_loc=("Enc0", "Dec"))
REFERENCE = execution.reference()


@pytest.fixture(scope="module")
def params():
    """Initial parameters with the (zero-initialised) gates made random, so that routing varies."""
    return perturbed_params(CFG)


def mixed_batch(n: int, variants=("CVRP", "VRPBLTW", "OVRPTW", "VRPL"), seed: int = 0):
    parts = [instances.generate(jax.random.key(seed + i), 1, n, v) for i, v in enumerate(variants)]
    return jax.tree.map(lambda *x: jnp.concatenate(x), *parts)


def with_options(**options) -> PolicyConfig:
    return dataclasses.replace(CFG, **options)


def brute_force_candidates(mask: np.ndarray, dist: np.ndarray, k: int) -> np.ndarray:
    """Row by row: the depot's entry, and the k feasible customers first by (distance, index)."""
    out = np.zeros_like(mask)
    for idx in np.ndindex(mask.shape[:-1]):
        out[idx + (0,)] = mask[idx + (0,)]
        feasible = sorted((dist[idx + (j,)], j) for j in range(1, mask.shape[-1]) if mask[idx + (j,)])
        for _, j in feasible[:k]:
            out[idx + (j,)] = True
    return out


@pytest.mark.parametrize("k", [1, 3, 11, 40])
def test_the_candidates_are_the_k_nearest_feasible_customers_and_the_depot(k):
    rng = np.random.default_rng(k)
    locs = rng.random((3, 12, 2)).astype(np.float32)
    locs[1, 4] = locs[1, 3]                                          # two customers at one place: a tie
    current = rng.integers(0, 12, (3, 5))
    current[1, 1] = 5
    mask = rng.random((3, 5, 12)) < 0.5
    mask[0, 0, 1:] = False                                          # a row where only the depot may be feasible
    mask[1, 1, 3] = mask[1, 1, 4] = True
    here = np.take_along_axis(locs, current[..., None], axis=1)                                 # (B, P, 2)
    dist = ((locs[:, None] - here[:, :, None]) ** 2).sum(-1)                                    # squared: same order
    ranks = locality.current_ranks(locality.neighbour_ranks(jnp.asarray(locs)), jnp.asarray(current))
    want_ranks = np.argsort(np.argsort(dist, axis=-1, kind="stable"), axis=-1, kind="stable")
    np.testing.assert_array_equal(np.asarray(ranks), want_ranks)
    got = np.asarray(locality.candidate_mask(jnp.asarray(mask), ranks, k))
    np.testing.assert_array_equal(got, brute_force_candidates(mask, dist, k))
    assert not (got & ~mask).any()                                  # never a node the rules forbid
    assert (got[..., 1:].sum(-1) == np.minimum(mask[..., 1:].sum(-1), k)).all()   # empty only without a feasible one
    if k >= 11:
        np.testing.assert_array_equal(got, mask)


def test_the_options_are_checked_and_read_from_older_configs():
    assert not CFG.uses_locations and CFG.distance_bias == 0.0 and CFG.candidates == 0
    old = {k: v for k, v in CFG.to_dict().items() if k not in ("distance_bias", "candidates")}
    assert PolicyConfig.from_dict(old) == CFG                       # configs stored before the options: off
    assert with_options(candidates=5).uses_locations and with_options(distance_bias=0.5).uses_locations
    for bad, match in ((dict(distance_bias=-1.0), "distance_bias must be a number >= 0, got -1.0"),
                       (dict(distance_bias=float("inf")), "distance_bias must be a number >= 0"),
                       (dict(candidates=-2), r"candidates must be a whole number of nodes >= 0 \(0: all\), got -2"),
                       (dict(candidates=2.5), "candidates must be a whole number")):
        with pytest.raises(ValueError, match=match):
            with_options(**bad)
    with pytest.raises(ValueError, match="candidates must be a positive number of nodes, got 0"):
        locality.candidate_mask(jnp.ones((1, 1, 3), bool), jnp.arange(3.0)[None, None], 0)


def _step_scores(cfg, params, batch, current):
    """A decoding step's clipped, masked logits (B, P, N) from ``current`` (B, P), the env's mask at the start."""
    policy = Policy(cfg, REFERENCE)
    emb, _ = rollout.encode_nodes(policy, params, batch, jax.random.key(0))
    cache = policy.apply(params, emb, locs=batch.locs, method=Policy.precompute)
    states, _, _ = rollout.initial_states(batch, current.shape[1])
    mask = jnp.ones(current.shape + (batch.locs.shape[1],), bool).at[..., 2].set(False)
    logits, _, _ = policy.apply(params, cache, current, rollout.dynamic_features(states), mask, None, False, False,
                                method=Policy.decode, rngs={"gating": jax.random.key(1)})
    return np.asarray(logits), np.asarray(mask), cache


def test_the_bias_is_added_to_the_clipped_logits_of_the_choice(params):
    batch = mixed_batch(N)
    current = jnp.asarray(np.random.default_rng(0).integers(0, N + 1, (4, 6)), jnp.int32)
    plain, mask, cache_off = _step_scores(CFG, params, batch, current)
    alpha = 0.7
    biased, _, cache_on = _step_scores(with_options(distance_bias=alpha), params, batch, current)
    assert cache_off.locs is None and cache_on.locs is not None     # off: the cache is the one decoding had before
    assert cache_off.neighbour_ranks is None and cache_on.neighbour_ranks is None
    locs = np.asarray(batch.locs, np.float64)
    here = np.take_along_axis(locs, np.asarray(current)[..., None], axis=1)                    # (B, P, 2)
    dist = np.linalg.norm(locs[:, None] - here[:, :, None], axis=-1)                           # (B, P, N)
    want = plain - alpha * math.log2(N) * dist
    np.testing.assert_allclose(np.where(mask, biased, 0.0), np.where(mask, want, 0.0), rtol=1e-5, atol=1e-5)
    assert np.isneginf(biased[~mask]).all()


def with_alpha(params, alpha: float) -> dict:
    """``params`` with a learned distance bias of ``alpha``."""
    return {"params": {**params["params"], "distance_bias_alpha": jnp.float32(alpha)}}


def test_a_learned_bias_starts_at_the_configured_alpha_and_decodes_as_that_constant(params):
    learned = with_options(distance_bias=0.7, learned_distance_bias=True)
    assert learned.uses_locations and with_options(learned_distance_bias=True).uses_locations
    initial = training.init_params(learned, jax.random.key(0))["params"]["distance_bias_alpha"]
    assert float(initial) == pytest.approx(0.7)
    batch = mixed_batch(N)
    current = jnp.asarray(np.random.default_rng(3).integers(0, N + 1, (4, 6)), jnp.int32)
    for alpha in (0.7, 0.3, 0.0):
        got, _, cache = _step_scores(learned, with_alpha(params, alpha), batch, current)
        want, _, _ = _step_scores(with_options(distance_bias=alpha), params, batch, current)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert cache.locs is not None
    assert policy_lib.distance_bias_of(learned, with_alpha(params, 0.3)) == pytest.approx(0.3)
    assert policy_lib.distance_bias_of(with_options(distance_bias=0.4), params) == 0.4
    with pytest.raises(ValueError, match="learned_distance_bias must be True or False"):
        with_options(learned_distance_bias=1)


def test_a_model_learning_its_bias_starts_from_weights_without_one(tmp_path, shipped_small, params):
    learned = with_options(distance_bias=0.6, learned_distance_bias=True)
    start = checkpoints.starting_weights("small_n20", learned)
    assert float(start["params"]["distance_bias_alpha"]) == pytest.approx(0.6)
    rest = {k: v for k, v in start["params"].items() if k != "distance_bias_alpha"}
    jax.tree.map(np.testing.assert_array_equal, rest, params["params"])
    shipped.export(shipped_small / "learned_n20", with_alpha(params, 0.25), learned, {"config": {"problem_size": 20}})
    kept = checkpoints.starting_weights("learned_n20", learned)               # a source with the bias keeps its own
    assert float(kept["params"]["distance_bias_alpha"]) == pytest.approx(0.25)
    assert checkpoints.starting_weights("small_n20", CFG)["params"].keys() == params["params"].keys()
    with pytest.raises(checkpoints.CheckpointMismatchError, match="missing parameters"):
        checkpoints.starting_weights("small_n20", dataclasses.replace(learned, num_layers=2))


def _greedy(cfg, params, batch, plan=REFERENCE, pomo_size=N):
    return jax.device_get(rollout.greedy_evaluate(cfg, params, batch, jax.random.key(4), pomo_size=pomo_size,
                                                  plan=plan, num_devices=1))


@pytest.mark.parametrize("k", [N, pytest.param(N + 7, marks=pytest.mark.slow)])
def test_candidates_of_n_or_more_decode_the_full_decoders_tours_bit_for_bit(params, k):
    batch = mixed_batch(N)
    full, restricted = _greedy(CFG, params, batch), _greedy(with_options(candidates=k), params, batch)
    np.testing.assert_array_equal(restricted.best_actions, full.best_actions)
    np.testing.assert_array_equal(restricted.obj, full.obj)
    np.testing.assert_array_equal(restricted.obj_no_aug, full.obj_no_aug)
    sampled = [jax.device_get(rollout.rollout(Policy(cfg, REFERENCE), params, batch, pomo_size=N,
                                              decode_type="sampling", rng=jax.random.key(9)))
               for cfg in (CFG, with_options(candidates=k))]
    np.testing.assert_array_equal(sampled[1].actions, sampled[0].actions)
    np.testing.assert_array_equal(sampled[1].log_likelihood, sampled[0].log_likelihood)


def test_few_candidates_and_the_bias_change_the_tours(params):
    """The options act: a few candidates or a strong bias make the tours shorter than this untrained policy's."""
    batch = mixed_batch(N)
    full = _greedy(CFG, params, batch)
    for options in (dict(candidates=2), dict(distance_bias=3.0)):
        assert _greedy(with_options(**options), params, batch).obj.mean() < full.obj.mean(), options


@pytest.mark.parametrize("n,variants", [(100, ("CVRP", "VRPBLTW", "OVRPTW", "OVRPBL")),
                                        pytest.param(200, ("CVRP", "VRPTW"), marks=pytest.mark.slow)])
def test_every_route_passes_the_checker_with_the_options_on(params, n, variants):
    """Greedy x8 from 8 starts with the bias and 3 candidates, and with a single candidate: every route feasible
    under its instance's rules, at the cost reported."""
    batch = mixed_batch(n, variants, seed=n)
    for options in (dict(distance_bias=1.0, candidates=3), dict(candidates=1)):
        res = _greedy(with_options(**options), params, batch, execution.cpu(), pomo_size=8)
        assert res.all_finished.all()
        routes = [checker.actions_to_route(a) for a in res.best_actions]
        checks = checker.verify_routes(batch, routes, res.obj, source=f"n={n} {options}")
        assert all(c.feasible for c in checks)


@pytest.mark.parametrize("search", [pytest.param("sampling", marks=pytest.mark.slow), "eas", "sgbs"])
def test_the_searches_keep_the_options_and_their_routes_are_feasible(params, search):
    batch = mixed_batch(N, seed=3)
    solutions = api.solve_instances(with_options(distance_bias=1.0, candidates=4), params, batch, search=search,
                                    rounds=2)
    assert all(s.feasible and s.cost <= s.greedy_cost for s in solutions)
    greedy = _greedy(with_options(distance_bias=1.0, candidates=4), params, batch, execution.cpu())
    np.testing.assert_allclose([s.greedy_cost for s in solutions], greedy.obj, rtol=1e-5)


def test_the_bias_is_differentiable(params):
    """A decoding step's log-probabilities of chosen nodes have a finite gradient in the parameters with the
    options on, and another than without them (training a whole step under every plan with them:
    tests/test_execution_plan.py)."""
    batch = mixed_batch(N)
    current = jnp.asarray(np.random.default_rng(1).integers(0, N + 1, (4, 6)), jnp.int32)
    chosen = jnp.asarray(np.random.default_rng(2).integers(3, N + 1, (4, 6)), jnp.int32)

    def gradient(cfg):
        policy = Policy(cfg, REFERENCE)
        states, _, _ = rollout.initial_states(batch, 6)
        mask = jnp.ones((4, 6, N + 1), bool).at[..., 1:3].set(False)

        def picked(p):
            emb, _ = policy.apply(p, batch, True, method=Policy.encode, rngs={"gating": jax.random.key(0)})
            cache = policy.apply(p, emb, False, locs=batch.locs, method=Policy.precompute)
            logp = policy.apply(p, cache, current, rollout.dynamic_features(states), mask, None, True,
                                method=Policy.decode, rngs={"gating": jax.random.key(1)})[0]
            return jnp.sum(jnp.where(jnp.isfinite(logp), logp, 0.0) * jax.nn.one_hot(chosen, N + 1))
        return jax.jit(jax.grad(picked))(params)

    on, off = gradient(with_options(distance_bias=1.0, candidates=5)), gradient(CFG)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(on))
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off)))


def test_the_decoder_cache_needs_the_coordinates_when_the_options_read_them(params):
    policy = Policy(with_options(candidates=3), REFERENCE)
    emb, _ = rollout.encode_nodes(policy, params, mixed_batch(N), jax.random.key(0))
    with pytest.raises(ValueError, match=r"read the node coordinates: precompute\(..., locs=instances.locs\)"):
        policy.apply(params, emb, method=Policy.precompute)


# ----------------------------------------------------------------------------------------------------
# The command lines
# ----------------------------------------------------------------------------------------------------

@pytest.fixture
def shipped_small(tmp_path, monkeypatch, params):
    root = tmp_path / "shipped"
    shipped.export(root / "small_n20", params, CFG, {"config": {"problem_size": 20}})
    shipped.export(root / "small_n10", params, CFG, {"config": {"problem_size": 10}})
    monkeypatch.setattr(shipped, "SHIPPED_DIR", root)
    return root


def _vrp_file(path, inst):
    """A CVRPLIB-style file of one n = 20 CVRP instance, coordinates in units of 1/1000."""
    xy = np.rint(np.asarray(inst.locs) * 1000).astype(int)
    demand = np.rint(np.asarray(inst.demand) * 30).astype(int)
    lines = ["NAME : small", "TYPE : CVRP", f"DIMENSION : {len(xy)}", "EDGE_WEIGHT_TYPE : EUC_2D", "CAPACITY : 30",
             "NODE_COORD_SECTION", *[f"{i + 1} {x} {y}" for i, (x, y) in enumerate(xy)], "DEMAND_SECTION",
             *[f"{i + 1} {d}" for i, d in enumerate(demand)], "DEPOT_SECTION", "1", "-1", "EOF"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_solve_command_takes_the_options_and_reports_them(tmp_path, shipped_small, capsys):
    path = _vrp_file(tmp_path / "small.vrp", jax.tree.map(lambda x: x[0], instances.generate(jax.random.key(5), 1, N, "CVRP")))
    out = tmp_path / "out"
    assert main([str(path), f"--output={out}", "--no_progress", "--distance_bias=0.5", "--candidates=4"]) == 0
    assert "n = 20: model small_n20, decoding with distance_bias 0.5, candidates 4\n" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["decoding"] == {"20": {"model": "small_n20", "distance_bias": 0.5, "learned_distance_bias": False,
                                          "candidates": 4, "max_starts": None, "improve": "none", "size_default": []}}
    assert summary["instances"][0]["feasible"]
    assert main([str(path), f"--output={tmp_path / 'plain'}", "--no_progress"]) == 0
    assert "n = 20: model small_n20\n" in capsys.readouterr().out
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert plain["decoding"] == {"20": {"model": "small_n20", "distance_bias": 0.0, "learned_distance_bias": False,
                                        "candidates": 0, "max_starts": None, "improve": "none", "size_default": []}}
    assert main([str(path), "--no_progress", "--candidates=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: candidates must be a whole number of nodes >= 0 (0: all), got -1"]


def test_instances_twice_the_training_size_get_the_distance_bias_and_the_local_search_unless_told_otherwise(
        tmp_path, shipped_small, capsys):
    """small_n10 was trained at n = 10: on n = 20 the solver decodes with the size default's distance bias and then
    runs the local search, says so and records it; options given on the command line win over it."""
    path = _vrp_file(tmp_path / "small.vrp", jax.tree.map(lambda x: x[0], instances.generate(jax.random.key(5), 1, N, "CVRP")))
    assert main([str(path), "--checkpoint=small_n10", f"--output={tmp_path / 'biased'}", "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert ("n = 20: model small_n10, decoding with distance_bias 1 (the default from 2x the training size; "
            "--distance_bias=0 turns it off), then the local search (the default from 2x the training size; "
            "--improve=none turns it off)") in out
    assert "local search: " in out
    biased = json.loads((tmp_path / "biased" / "summary.json").read_text())
    assert biased["decoding"] == {"20": {"model": "small_n10", "distance_bias": models.SIZE_DEFAULT_DISTANCE_BIAS,
                                         "learned_distance_bias": False, "candidates": 0, "max_starts": None,
                                         "improve": "ls",
                                         "size_default": ["distance_bias", "improve"]}}
    solution = biased["instances"][0]
    assert solution["feasible"] and solution["improve"] == "ls" and biased["improve"] == "ls"
    assert solution["cost"] <= solution["searched_cost"] + 1e-9
    assert main([str(path), "--checkpoint=small_n10", "--distance_bias=0", "--candidates=5", "--improve=none",
                 f"--output={tmp_path / 'told'}", "--no_progress"]) == 0
    told = json.loads((tmp_path / "told" / "summary.json").read_text())
    assert told["decoding"]["20"] == {"model": "small_n10", "distance_bias": 0.0, "learned_distance_bias": False,
                                      "candidates": 5, "max_starts": None,
                                      "improve": "none", "size_default": []}
    assert told["instances"][0]["improve"] == "none" and told["improve"] == "none"


def test_large_instances_decode_from_fewer_starts_unless_told(tmp_path, shipped_small, monkeypatch, capsys):
    """Above SIZE_DEFAULT_MAX_STARTS customers (here lowered to 12) the solver decodes from that many starts, says
    so and records it; --max_starts given wins."""
    monkeypatch.setattr(models, "SIZE_DEFAULT_MAX_STARTS", 12)
    path = _vrp_file(tmp_path / "small.vrp", jax.tree.map(lambda x: x[0], instances.generate(jax.random.key(5), 1, N, "CVRP")))
    assert main([str(path), f"--output={tmp_path / 'capped'}", "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert ("n = 20: model small_n20, decoding with max_starts 12 (the default above 12 customers, at most 50,000 / "
            "n; --max_starts=N to change)") in out and "n=20 greedy: 12 of 20 POMO starts" in out
    capped = json.loads((tmp_path / "capped" / "summary.json").read_text())
    assert capped["decoding"]["20"]["max_starts"] == 12 and capped["decoding"]["20"]["size_default"] == ["max_starts"]
    assert capped["instances"][0]["starts"] == 12 and capped["instances"][0]["feasible"]
    assert main([str(path), "--max_starts=20", f"--output={tmp_path / 'all'}", "--no_progress"]) == 0
    everything = json.loads((tmp_path / "all" / "summary.json").read_text())
    assert everything["instances"][0]["starts"] == 20 and everything["decoding"]["20"]["size_default"] == []
    assert models.size_default_max_starts(12) is None


def test_the_default_starts_shrink_with_the_size_and_the_local_search_follows_the_training_size():
    assert models.size_default_max_starts(200) is None
    assert [models.size_default_max_starts(n) for n in (201, 250, 500, 1000, 2000)] == [200, 200, 100, 50, 25]
    assert [models.size_default_improve(50, n) for n in (50, 99, 100, 1000)] == ["none", "none", "ls", "ls"]
    assert models.size_default_improve(None, 1000) == "none"          # a checkpoint of unknown training size


def test_the_size_default_follows_the_training_size_and_yields_to_the_model_and_the_user():
    assert models.size_default_decoding(50, 99) == {} and models.size_default_decoding(None, 1000) == {}
    assert models.size_default_decoding(50, 100) == {"distance_bias": models.SIZE_DEFAULT_DISTANCE_BIAS}
    cfg, by_size = models.decoding_for(CFG, 50, 200, {"candidates": 30})
    assert (cfg.distance_bias, cfg.candidates, by_size) == (models.SIZE_DEFAULT_DISTANCE_BIAS, 30, ["distance_bias"])
    own = dataclasses.replace(CFG, distance_bias=0.3)
    assert models.decoding_for(own, 50, 200, {}) == (own, [])          # a model with options of its own keeps them
    cfg, by_size = models.decoding_for(CFG, 50, 200, {"distance_bias": 0.0})
    assert (cfg.distance_bias, by_size) == (0.0, [])


def test_a_model_with_a_learned_bias_decodes_with_it_says_so_and_refuses_a_given_one(tmp_path, shipped_small,
                                                                                     params, capsys):
    """No size default replaces a learned bias (small_l10 was trained at n = 10: n = 20 is twice that); the solve
    command and evaluate report its value, and a --distance_bias given for it is refused in one line."""
    learned = with_options(distance_bias=0.9, learned_distance_bias=True)
    shipped.export(shipped_small / "small_l10", with_alpha(params, 0.35), learned, {"config": {"problem_size": 10}})
    path = _vrp_file(tmp_path / "small.vrp", jax.tree.map(lambda x: x[0], instances.generate(jax.random.key(5), 1, N, "CVRP")))
    assert main([str(path), "--checkpoint=small_l10", "--improve=none", f"--output={tmp_path / 'out'}",
                 "--no_progress"]) == 0
    assert "n = 20: model small_l10, decoding with distance_bias 0.35 (learned)\n" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["decoding"]["20"]["distance_bias"] == pytest.approx(0.35)
    assert summary["decoding"]["20"]["learned_distance_bias"] and summary["decoding"]["20"]["size_default"] == []
    assert summary["instances"][0]["feasible"]
    assert main([str(path), "--checkpoint=small_l10", "--distance_bias=1", "--no_progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: this model learned its distance bias; a given distance_bias (1) applies only to models without one"]
    cfg, _ = models.decoding_for(learned, 10, 1000, {"candidates": 7})
    assert cfg == dataclasses.replace(learned, candidates=7)
    folder = tmp_path / "files"
    folder.mkdir()
    _vrp_file(folder / "small.vrp", jax.tree.map(lambda x: x[0], instances.generate(jax.random.key(6), 1, N, "CVRP")))
    flags = types.SimpleNamespace(checkpoint="small_l10", vrplib_dir=str(folder), bks=None, aug=1, batch_size=None,
                                  num_instances=None, pomo_size=None, seed=0, chunk_size=None, execution="cpu",
                                  distance_bias=None, candidates=None)
    got = cli.run_evaluation(None, flags)["small"]
    assert got["distance_bias"] == pytest.approx(0.35) and got["learned_distance_bias"]
    with pytest.raises(ValueError, match="learned its distance bias"):
        cli.run_evaluation(None, types.SimpleNamespace(**dict(vars(flags), distance_bias=0.5)))


def test_evaluation_takes_the_options_and_reports_them(tmp_path, shipped_small):
    folder = tmp_path / "files"
    folder.mkdir()
    _vrp_file(folder / "small.vrp", jax.tree.map(lambda x: x[0], instances.generate(jax.random.key(6), 1, N, "CVRP")))
    flags = types.SimpleNamespace(checkpoint="small_n20", vrplib_dir=str(folder), bks=None, aug=8, batch_size=None,
                                  num_instances=None, pomo_size=None, seed=0, chunk_size=None, execution="cpu",
                                  distance_bias=0.5, candidates=4)
    got = cli.run_evaluation(None, flags)["small"]
    assert (got["distance_bias"], got["candidates"]) == (0.5, 4)
    plain = cli.run_evaluation(None, types.SimpleNamespace(**dict(vars(flags), distance_bias=None, candidates=None)))
    assert (plain["small"]["distance_bias"], plain["small"]["candidates"]) == (0.0, 0)      # the model's own: off
