"""The training recipe's fields beyond the paper's: reward normalisation, the leader advantage, gradient clipping,
the warm-up and cosine schedule, fewer training starts and the size curriculum: each changes what it says
(a run using all of them resumes exactly: test_training.py; benchmarks/recipe_study.py compares them per
CPU-hour)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import script_module
from configs import mvmoe_paper, mvmoe_sizes
from mvmoe_jax import problems, training, training_loop, training_validation
from mvmoe_jax.reinforce import reinforce_loss
from test_training import loop_functions, mixed_batch, tiny_config

COST = np.array([[3.0, 2.0, 4.0, 9.0], [10.0, 14.0, 12.0, 11.0]])
VALID = np.array([[True, True, True, False], [True, True, True, True]])
LL = np.array([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, -0.6, -0.8]])


def expected_policy_loss(cost, valid, ll, divisor=None, leader=1.0):
    """The policy-gradient loss recomputed in numpy, instance by instance."""
    terms = []
    for b in range(cost.shape[0]):
        reward = -cost[b, valid[b]] / (1.0 if divisor is None else divisor[b])
        advantage = reward - reward.mean()
        advantage[np.argmax(reward)] *= leader
        terms.extend(-advantage * ll[b, valid[b]])
    return np.sum(terms) / valid.sum()


def loss_of(**options):
    return float(reinforce_loss(jnp.asarray(LL), jnp.asarray(COST), jnp.asarray(VALID), jnp.float32(0.0), 0.0,
                                **options)[1])


def test_plain_normalised_and_leader_losses_match_a_recomputation():
    assert loss_of() == pytest.approx(expected_policy_loss(COST, VALID, LL), rel=1e-6)
    divisor = np.array([3.0, 12.0])
    assert loss_of(cost_divisor=jnp.asarray(divisor)) == pytest.approx(
        expected_policy_loss(COST, VALID, LL, divisor), rel=1e-6)
    assert loss_of(leader_advantage=3.0) == pytest.approx(expected_policy_loss(COST, VALID, LL, leader=3.0), rel=1e-6)
    # The leader is the best valid start: the padded start 3 of instance 0 (cost 9) never is, and the
    # leader's larger advantage changes the loss.
    assert loss_of(leader_advantage=3.0) != pytest.approx(loss_of(), rel=1e-3)


def test_the_variant_cost_scale_starts_at_the_first_draw_then_moves_by_alpha():
    table = jnp.asarray(problems.flags_array(["CVRP", "VRPTW", "OVRP"]))
    flags = jnp.asarray(problems.flags_array(["CVRP", "VRPTW"]))     # two instances; OVRP not drawn
    cost, valid = jnp.asarray(COST), jnp.asarray(VALID)
    scale0 = jnp.zeros(3)
    scale1, div1 = training.variant_cost_scale(scale0, table, flags, cost, valid, 0.25)
    np.testing.assert_allclose(scale1, [3.0, 11.75, 0.0], rtol=1e-6)      # each drawn variant's mean valid cost
    np.testing.assert_allclose(div1, [3.0, 11.75], rtol=1e-6)
    scale2, div2 = training.variant_cost_scale(scale1, table, flags, 2 * cost, valid, 0.25)
    np.testing.assert_allclose(scale2, [0.75 * 3.0 + 0.25 * 6.0, 0.75 * 11.75 + 0.25 * 23.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(div2, scale2[:2], rtol=1e-6)
    # An instance of no listed variant keeps its rewards as they are.
    _, div3 = training.variant_cost_scale(scale2[:1], table[:1], flags, cost, valid, 0.25)
    np.testing.assert_allclose(div3, [scale2[0] * 0.75 + 0.25 * 3.0, 1.0], rtol=1e-6)


def test_clipping_bounds_the_update_and_the_warmup_cosine_rates():
    params = {"w": jnp.ones(3)}
    grad = {"w": jnp.array([30.0, 40.0, 0.0])}           # norm 50
    clipped = training.OptimizerSettings(1e-3, clip_norm=1.0).build()
    plain = training.OptimizerSettings(1e-3).build()
    upd_c, _ = clipped.update(grad, clipped.init(params), params)
    upd_p, _ = plain.update(jax.tree.map(lambda g: g / 50.0, grad), plain.init(params), params)
    np.testing.assert_allclose(upd_c["w"], upd_p["w"], rtol=1e-6)    # Adam of the gradient scaled to norm 1
    assert optax.tree.norm(clipped.update({"w": grad["w"] / 100}, clipped.init(params), params)[0]) > 0

    opt = training.OptimizerSettings(2e-3, schedule="warmup_cosine", warmup_steps=10, total_steps=110,
                                     final_fraction=0.01)
    rates = [opt.learning_rate_at(s) for s in (0, 5, 10, 60, 110, 200)]
    np.testing.assert_allclose(rates, [0.0, 1e-3, 2e-3, 2e-3 * (0.01 + 0.99 * 0.5), 2e-5, 2e-5], rtol=1e-5)
    step = training.OptimizerSettings(1e-4, decay_step=7, decay_factor=0.1)
    assert [step.learning_rate_at(s) for s in (6, 7)] == [1e-4, pytest.approx(1e-5)]
    with pytest.raises(ValueError, match="lr_schedule"):
        training.OptimizerSettings(1e-4, schedule="linear")
    with pytest.raises(ValueError, match="warmup_steps"):
        training.OptimizerSettings(1e-4, schedule="warmup_cosine", warmup_steps=10, total_steps=10)


def test_the_size_curriculum_and_the_training_starts_by_epoch():
    config = tiny_config("unused", size_curriculum="20:3, 50:5", problem_size=100, pomo_size=100,
                         train_pomo_size=30)
    run = training_loop.check_config(config)
    assert [run.size_at(e) for e in range(1, 8)] == [20, 20, 20, 50, 50, 100, 100]
    assert [training_loop.train_starts(config, n) for n in (20, 50, 100)] == [20, 30, 30]
    config.train_pomo_size = 0
    assert [training_loop.train_starts(config, n) for n in (20, 100)] == [20, 100]
    for bad, match in [("20", "SIZE:LAST_EPOCH"), ("30:2", "no defined vehicle capacity"),
                       ("20:3,50:3", "increase"), ("20:0", "increase")]:
        with pytest.raises(ValueError, match=match):
            training_loop.check_config(tiny_config("unused", size_curriculum=bad, problem_size=100, pomo_size=100))
    for field, value, match in [("grad_clip_norm", -1.0, "grad_clip_norm"), ("leader_advantage", 0.0, "leader"),
                                ("reward_normalization_alpha", 1.5, "reward_normalization_alpha"),
                                ("train_pomo_size", -2, "train_pomo_size"), ("lr_schedule", "exp", "lr_schedule"),
                                ("final_lr_fraction", 2.0, "final_lr_fraction"),
                                ("warmup_fraction", 1.0, "warmup_fraction")]:
        with pytest.raises(ValueError, match=match):
            training_loop.check_config(tiny_config("unused", **{field: value}))


def test_a_size_cycle_gives_each_step_its_size_and_a_batch_of_about_the_same_work():
    run = training_loop.check_config(mvmoe_sizes.get_config())
    assert run.sizes == (50, 100, 200) and run.policy.learned_distance_bias and run.policy.distance_bias == 1.0
    assert [run.size_of_step(1, s) for s in range(5)] == [50, 100, 200, 50, 100]
    assert [run.instances_at(256, n) for n in (50, 100, 200)] == [256, 64, 16]
    assert run.instances_at(8, 200) == 1                      # never an empty batch
    assert run.num_cost_scales() == 6 * 3                     # the 6 training variants, per size
    assert training_loop.check_config(tiny_config("unused", train_sizes="50, 100,200")).sizes == (50, 100, 200)
    plain = training_loop.check_config(tiny_config("unused"))
    assert plain.sizes == () and plain.instances_at(256, 100) == 256 and plain.size_of_step(1, 7) == 20
    for bad, match in [("50,x", "comma-separated sizes"), ("50,30", "defined vehicle capacity"),
                       ("50,50", "given twice")]:
        with pytest.raises(ValueError, match=match):
            training_loop.check_config(tiny_config("unused", train_sizes=bad))
    with pytest.raises(ValueError, match="not both"):
        training_loop.check_config(tiny_config("unused", train_sizes="20,50", size_curriculum="20:2",
                                               problem_size=50, pomo_size=50))


def test_a_step_samples_the_training_starts_and_updates_the_cost_scales(tmp_path):
    config = tiny_config(tmp_path, train_pomo_size=8, reward_normalization_alpha=0.25, mixed_batches=True)
    fns, run = loop_functions(config)
    state = fns.init_state(training.init_params(run.policy, jax.random.key(1)))
    assert state.cost_scale.shape == (3,) and not state.cost_scale.any()
    inst = mixed_batch()
    traj = fns.sample(state.params, inst, jax.random.key(5))
    assert traj.cost.shape == (8, 8)
    new, m = fns.update(state, inst, traj, jax.random.key(5))
    drawn = np.asarray(problems.flags_array(["CVRP", "VRPB", "OVRPTW"]))
    flags = np.asarray(inst.flags)
    for v in range(3):
        member = (flags == drawn[v]).all(-1)
        cost, valid = np.asarray(traj.cost)[member], np.asarray(traj.valid)[member]
        want = (np.where(valid, cost, 0).sum(-1) / valid.sum(-1)).mean() if member.any() else 0.0
        assert float(new.cost_scale[v]) == pytest.approx(want, rel=1e-5)


def test_validation_sets_with_reference_solutions_give_gaps(tmp_path):
    """scripts/make_validation_sets.py writes a set and its references that validation reads back with gaps."""
    make = script_module("scripts/make_validation_sets.py")
    assert make.main([str(tmp_path), "--size=20", "--instances=3", "--variants=CVRP,VRPBL",
                      "--time_limit=0.1"]) == 0
    record = json.loads((tmp_path / "references.json").read_text())
    assert set(record) == {"CVRP", "VRPBL"} and record["VRPBL"]["solver"] == "ortools"
    run = training_loop.check_config(tiny_config(tmp_path))
    params = training.init_params(run.policy, jax.random.key(0))
    validator = training_validation.Validator(run.policy, variants="CVRP,VRPBL", num_customers=20, pomo_size=20,
                                              num_instances=3, batch_size=3, data_dir=str(tmp_path),
                                              augment=False, seed=0)
    val = validator(params)
    assert all(v["gap"] is not None and v["gap"] > -1e-3 for v in val.values())   # the references are feasible


def test_every_study_arm_is_a_valid_run_config_and_points_are_read_back(tmp_path):
    study = script_module("benchmarks/recipe_study.py")
    args = study.main.__globals__["argparse"].Namespace(
        problem_size=20, epochs=2, epoch_instances=1280, validation_instances=10,
        data_dir=str(tmp_path), runs_dir=str(tmp_path))
    for arm in study.ARMS:
        cmd, workdir, _ = study.run_command(arm, 1, args)
        config = mvmoe_paper.get_config()
        for a in cmd:
            if a.startswith("--config.") and not a.startswith("--config.execution"):
                key, value = a[len("--config."):].split("=", 1)
                config[key] = type(config[key])(value) if not isinstance(config[key], bool) else value == "True"
        training_loop.check_config(config)
    assert [study.run_command(arm, 1, args)[2] for arm in ("paper", "rf_half_starts")] == [2, 4]
    work = tmp_path / "paper_seed1"
    work.mkdir()
    gaps = {v: 1.0 + i for i, v in enumerate(problems.VARIANT_NAMES)}
    rows = [{"epoch": 0, "step": 0, "time": {}, "val": {v: {"obj": 1, "gap": g} for v, g in gaps.items()}},
            {"epoch": 1, "step": 10, "time": {"train_seconds": 20.0, "instances_per_second": 64.0,
                                                     "train_cpu_seconds": 19.0},
             "val": {v: {"obj": 1, "gap": g / 2} for v, g in gaps.items()}}]
    (work / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    points = study.run_points(str(work))
    trained = [gaps[v] for v in problems.TRAIN_VARIANTS]
    assert points[1]["instances"] == 1280 and points[1]["train_seconds"] == 19.0
    assert points[1]["trained"] == pytest.approx(np.mean(trained) / 2)
    assert points[0]["all"] == pytest.approx(np.mean(list(gaps.values())))


def test_the_confirmation_compares_runs_at_the_cpu_time_all_reached(tmp_path):
    confirmation = script_module("benchmarks/recipe_confirmation.py")
    gaps = {v: 2.0 for v in problems.VARIANT_NAMES}

    def write_run(name, seconds_and_scale):
        work = tmp_path / name
        work.mkdir()
        rows = [{"epoch": 0, "step": 0, "time": {}, "val": {v: {"obj": 1, "gap": g} for v, g in gaps.items()}}]
        for epoch, (seconds, scale) in enumerate(seconds_and_scale, 1):
            rows.append({"epoch": epoch, "step": epoch, "time": {"train_cpu_seconds": seconds},
                         "val": {v: {"obj": 1, "gap": g * scale} for v, g in gaps.items()}})
        (work / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return f"{name}={work}"

    runs = confirmation.parse_runs([write_run("fast", [(100.0, 0.5), (100.0, 0.25)]),
                                    write_run("slow", [(300.0, 1.5)])])
    report = confirmation.summarize(runs, 50)
    assert report["common_seconds"] == 200.0 and report["start"]["trained"] == pytest.approx(2.0)
    assert report["at_common_seconds"]["fast"]["trained"] == pytest.approx(0.5)
    assert report["at_common_seconds"]["slow"]["unseen"] == pytest.approx(2.0 + (3.0 - 2.0) * 200 / 300)
    with pytest.raises(SystemExit, match="NAME=WORKDIR"):
        confirmation.parse_runs(["no_name"])
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        confirmation.parse_runs([f"x={tmp_path}"])
