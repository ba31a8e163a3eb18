"""Training: the sampled rollout and its differentiable replay, the REINFORCE loss, one optimiser step,
resume, the sharded step and non-finite losses (train.py's command line: test_train_cli.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from conftest import REPO_ROOT, xla_flags_env
from configs import demo
from configs.common import model_config
from mvmoe_jax import (checkpoints, execution, instances, reinforce, rollout, training, training_loop,
                       training_validation)
from mvmoe_jax.engines import attention as attention_engines, stepwise_backward
from mvmoe_jax.nn.policy import Policy, PolicyConfig

# The CPU preset: the fast paths whose gradients these tests compare with the replay's.
CPU = execution.cpu()

N = 20
TINY = dict(embedding_dim=16, num_heads=2, num_layers=1, ff_hidden_dim=32, expert_loc=("Enc0", "Dec"))


def tiny_policy(model: str) -> PolicyConfig:
    return PolicyConfig(model=model, **TINY)


def tiny_config(workdir, **overrides):
    """The demo config shrunk to seconds per epoch."""
    c = demo.get_config()
    c.workdir = str(workdir)
    c.model = model_config(model="mvmoe", **TINY)
    c.train_problems = "CVRP,VRPB,OVRPTW"
    c.batch_size = 8
    c.train_episodes = 16
    c.epochs = 4
    c.validation_instances = 8
    c.validation_batch_size = 8
    c.progress_bar = False
    for k, v in overrides.items():
        c[k] = v
    return c


def mixed_batch(size=8, seed=2):
    # Backhaul variants have 16 of 20 starts: the padded starts must stay out of baseline and loss.
    return instances.generate(jax.random.key(seed), size, N, ["CVRP", "VRPB", "OVRPTW", "VRPBLTW"])


def loop_functions(config):
    """The step functions train_and_evaluate builds for ``config`` (cached: the tests share compilations)."""
    plan = training_loop.check_config(config)
    return training_loop.step_functions(config, plan, training.make_mesh()), plan


@pytest.mark.parametrize("model", [
    pytest.param("pomo", marks=pytest.mark.slow), pytest.param("pomo_mtl", marks=pytest.mark.slow),
    pytest.param("mvmoe", marks=pytest.mark.slow), "mvmoe_light"])
def test_sampler_is_the_rollout_and_replay_reproduces_it(model):
    """Recording the decoder's inputs does not change the rollout (same actions, log-likelihoods, aux
    loss); the teacher-forced replay with the same keys (MoE gating noise, MVMoE-L's branch draws) gives
    the same log-likelihood and aux loss, also over steps past the end of the batch (which must
    contribute nothing) and with a partial last chunk."""
    cfg = tiny_policy(model)
    policy = Policy(cfg, CPU)
    params = training.init_params(cfg, jax.random.key(1))
    inst, rng = mixed_batch(), jax.random.key(3)
    ref = jax.jit(lambda p, i, r: rollout.rollout(policy, p, i, pomo_size=N, decode_type="sampling", rng=r,
                                                  train=True))(params, inst, rng)
    # 44 recorded steps (2n = 40 suffice), replayed in chunks of 8: a remainder chunk and padded steps.
    traj = jax.jit(lambda p, i, r: reinforce.sample_trajectories(policy, p, i, r, pomo_size=N, max_steps=44))(
        params, inst, rng)
    t = int(traj.num_steps)
    assert t <= 40
    np.testing.assert_array_equal(traj.actions[..., :t + 1], ref.actions[..., :t + 1])
    np.testing.assert_array_equal(traj.log_likelihood, ref.log_likelihood)
    np.testing.assert_array_equal(traj.aux_loss, ref.aux_loss)
    np.testing.assert_array_equal(traj.valid, ref.valid)
    assert not traj.valid.all()
    ll, aux = jax.jit(lambda p, i, tr, r: reinforce.replay(policy, p, i, tr, r, num_steps=44, steps_at_once=8))(
        params, inst, traj, rng)
    np.testing.assert_allclose(ll, traj.log_likelihood, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(aux, traj.aux_loss, rtol=1e-5, atol=1e-9)
    assert (float(traj.aux_loss) > 0) == cfg.uses_moe


@pytest.mark.parametrize("model,recorded,bias", [
    pytest.param("pomo_mtl", False, "no_bias", marks=pytest.mark.slow),
    pytest.param("pomo_mtl", True, "no_bias", marks=pytest.mark.slow),
    pytest.param("mvmoe", False, "no_bias", marks=pytest.mark.slow), ("mvmoe", True, "learned_bias"),
    ("mvmoe_light", False, "no_bias"), pytest.param("mvmoe_light", True, "no_bias", marks=pytest.mark.slow)],
    ids=lambda v: {False: "recomputed", True: "decoder_record"}.get(v, v))
def test_stepwise_gradients_equal_the_gradient_of_the_replayed_loss(model, recorded, bias):
    """The stepwise backward (one step's vjp at a time, MVMoE-L's gate cotangents summed and passed back
    through step 0) gives the gradient that jax.grad takes through the whole replayed loss, for every
    parameter, and the same log-likelihood and aux loss; its loss weights are the loss's own
    derivatives. Also when it takes each step's attention and readout products from the sampling pass's
    decoder record instead of computing them (``reuses_sampling_pass``): a record off by a step, or a
    backward pass that dropped a product's cotangent, would fail here. With a learned distance bias its
    parameter gets its gradient too."""
    cfg = tiny_policy(model)
    if bias == "learned_bias":
        cfg = dataclasses.replace(cfg, distance_bias=0.5, learned_distance_bias=True)
    policy = Policy(cfg, CPU)
    params = training.init_params(cfg, jax.random.key(1))
    inst, rng = mixed_batch(), jax.random.key(3)
    traj = jax.jit(lambda p, i, r: reinforce.sample_trajectories(policy, p, i, r, pomo_size=N, max_steps=40,
                                                                record_decoder=recorded))(params, inst, rng)
    assert (traj.decoder is not None) == recorded
    coef = 10.0

    def replayed_loss(p):
        ll, aux = reinforce.replay(policy, p, inst, traj, rng, num_steps=40, steps_at_once=8)
        return reinforce.reinforce_loss(ll, traj.cost, traj.valid, aux, coef)[0]

    def stepwise(p):
        w_ll, w_aux = jax.grad(lambda ll, aux: reinforce.reinforce_loss(ll, traj.cost, traj.valid, aux, coef)[0],
                               argnums=(0, 1))(traj.log_likelihood, traj.aux_loss)
        return stepwise_backward.stepwise_gradients(policy, p, inst, traj, rng, w_ll, w_aux)

    expected = jax.jit(jax.grad(replayed_loss))(params)
    grads, ll, aux = jax.jit(stepwise)(params)
    np.testing.assert_allclose(ll, traj.log_likelihood, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(aux, traj.aux_loss, rtol=1e-5, atol=1e-9)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    if cfg.hierarchical:   # the gate's gradient arrives only through the probabilities of step 0
        gate = expected["params"]["multi_head_combine"]["dense_or_moe"]["kernel"]
        assert float(jnp.max(jnp.abs(gate))) > 1e-3 * scale
    if cfg.learned_distance_bias:
        assert abs(float(expected["params"]["distance_bias_alpha"])) > 1e-3 * scale


def test_decoder_record_size_and_when_it_is_kept():
    """The sampling pass's decoder record has the size ``decoder_record_bytes`` predicts (MVMoE-L: its two
    groups of readout maps, padded to the wider); ``auto`` keeps it on a CPU within the budget only, and
    only for MVMoE/4E; ``always`` and ``never`` decide, and without the readout fusion there is nothing to
    reuse."""
    cfg = tiny_policy("mvmoe_light")
    policy = Policy(cfg, CPU)
    params = training.init_params(cfg, jax.random.key(1))
    traj = jax.jit(lambda p, i, r: reinforce.sample_trajectories(policy, p, i, r, pomo_size=N, max_steps=40,
                                                                record_decoder=True))(params, mixed_batch(), jax.random.key(3))
    recorded = sum(x.nbytes for x in jax.tree.leaves(traj.decoder))
    assert recorded == training.decoder_record_bytes(cfg, CPU, 8 * N, N + 1, 40)
    weights = attention_engines.kept_layout(traj.decoder.attention_weights, CPU)
    assert weights.shape == (40, 8, cfg.num_heads, N, N + 1)
    # Unrun steps stay zero; run steps hold softmax weights (rows summing to one where a trajectory was active).
    t = int(traj.num_steps)
    assert t < 40 and not np.asarray(weights[t:]).any()
    sums = np.asarray(weights[:t].sum(-1))
    np.testing.assert_allclose(sums, 1.0, rtol=1e-5)

    def reuses(mode, trajectories=8 * N, model_cfg=tiny_policy("mvmoe"), plan=CPU):
        return training.reuses_sampling_pass(Policy(model_cfg, plan.replace(reuse_sampling=mode)),
                                             trajectories_per_device=trajectories, num_nodes=N + 1, max_steps=40)

    over = training.DECODER_RECORD_BUDGET_BYTES // training.decoder_record_bytes(
        tiny_policy("mvmoe"), CPU, 1, N + 1, 40) + 1
    assert reuses("auto") and not reuses("auto", trajectories=over)
    assert reuses("always", over) and not reuses("never")
    assert execution.gpu().reuse_sampling == "never" and execution.reference().reuse_sampling == "never"
    assert not reuses("auto", model_cfg=cfg) and reuses("always", model_cfg=cfg)
    assert not reuses("auto", model_cfg=tiny_policy("pomo_mtl")) and reuses("always", model_cfg=tiny_policy("pomo_mtl"))
    unfused = CPU.replace(fused_readout=False)
    assert not reuses("always", model_cfg=cfg, plan=unfused)
    # Storage for the record must fit it, and is only for a rollout that keeps one.
    wrong = jax.tree.map(lambda x: jnp.zeros((x.shape[0] - 1,) + x.shape[1:], x.dtype), traj.decoder)
    with pytest.raises(ValueError, match="decoder_buffers do not fit this rollout's record"):
        rollout.rollout(policy, params, mixed_batch(), pomo_size=N, decode_type="sampling", train=True,
                        max_steps=40, record=True, record_decoder=True, decoder_buffers=wrong)
    with pytest.raises(ValueError, match="pass record_decoder=True"):
        rollout.rollout(policy, params, mixed_batch(), pomo_size=N, max_steps=40, record=True,
                        decoder_buffers=traj.decoder)
    with pytest.raises(ValueError, match="needs the readout fusion"):
        Policy(cfg, unfused).apply(params, Policy(cfg, unfused).apply(params, jnp.zeros((1, N + 1, cfg.embedding_dim)),
                                                                      method=Policy.precompute),
                              jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1, 4)), jnp.ones((1, 1, N + 1), bool),
                              None, False, True, True, method=Policy.decode)


def test_one_program_step_equals_sampling_then_update_and_bad_backward_is_rejected(tmp_path):
    """The single program that ``step`` runs (sampling and the stepwise update sharing one encoder pass)
    takes the optimiser step that sampling followed by the separate update takes, from the same number of
    decoding steps; an unknown backward or reuse_sampling setting is refused with the accepted values."""
    base = tiny_config(tmp_path)
    inst, rng = mixed_batch(), jax.random.key(5)
    plan = training_loop.check_config(tiny_config(tmp_path))
    # Plain SGD: Adam would turn float noise in gradients that are zero in exact arithmetic (the biases
    # before an instance norm) into lr-sized steps, and the two programs round differently (each backward
    # pass takes the products its own sampling pass recorded).
    settings = training.StepSettings(pomo_size=N, aux_loss_coef=10.0)
    fns = training.StepFunctions(plan.policy, CPU, optax.sgd(1e-2), settings, num_customers=N,
                                 variants=("CVRP", "VRPB", "OVRPTW"), mixed=True, mesh=training.make_mesh())
    assert not fns.replays
    state = fns.init_state(training.init_params(plan.policy, jax.random.key(1)))
    traj = fns.sample(state.params, inst, rng)
    assert traj.decoder is not None          # CPU, a small batch: reuses_sampling_pass
    two_state, two = jax.device_get(fns.update(state, inst, traj, rng))
    one_state, one = jax.device_get(fns.sample_and_update(state, inst, rng))
    assert int(one["decode_steps"]) == int(traj.num_steps)
    for k in ("loss", "pg_loss", "aux_loss", "grad_norm", "score"):
        assert one[k] == pytest.approx(two[k], rel=1e-4, abs=1e-7), k
    for a, b in zip(jax.tree.leaves(one_state.params), jax.tree.leaves(two_state.params)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # The one-program step wrote its decoder record into buffers it keeps, and the next step writes into
    # them over whatever they hold. Poisoned with NaN, they must give exactly the step taken on fresh zeros:
    # nothing beyond the steps the batch runs (and so overwrites) may be read.
    kept = fns._record_buffers
    assert kept is not None and kept.attention_weights.shape[0] == fns.max_steps
    assert int(one["decode_steps"]) < fns.max_steps
    poisoned = jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan, x.dtype, device=x.sharding), kept)
    fns._record_buffers = poisoned
    again_state, again = jax.device_get(fns.sample_and_update(state, inst, rng))
    assert poisoned.attention_weights.is_deleted()       # donated: written in place
    for k in ("loss", "pg_loss", "aux_loss", "grad_norm", "score", "decode_steps"):
        assert again[k] == one[k], k
    for a, b in zip(jax.tree.leaves(again_state.params), jax.tree.leaves(one_state.params)):
        np.testing.assert_array_equal(a, b)
    fns.release_buffers()
    assert fns._record_buffers is None
    base.execution.backward = "reverse"
    with pytest.raises(ValueError, match=r"backward must be one of \('stepwise', 'replay'\), got 'reverse'"):
        training_loop.check_config(base)
    with pytest.raises(ValueError, match="backward must be one of"):
        CPU.replace(backward="reverse")
    base.execution.backward, base.execution.reuse_sampling = None, "sometimes"
    with pytest.raises(ValueError, match=r"reuse_sampling must be one of \('never', 'always', 'auto'\), got 'sometimes'"):
        training_loop.check_config(base)
    with pytest.raises(ValueError, match="reuse_sampling must be one of"):
        CPU.replace(reuse_sampling="sometimes")
    base.execution.reuse_sampling, base.execution.preset = None, "fastest"
    with pytest.raises(ValueError, match="unknown execution preset 'fastest'"):
        training_loop.check_config(base)


@pytest.mark.slow     # ~100 s on 2 cores; the gradients' equality stays in the default suite (MVMoE-L above)
def test_stepwise_and_replay_updates_agree(tmp_path):
    """train.py's two backward settings take the same optimiser step (the stepwise one without a replay
    length), and the replay refuses to run as the single sampling-and-update program."""
    inst, rng = mixed_batch(), jax.random.key(5)
    results = {}
    for backward in ("stepwise", "replay"):
        config = tiny_config(tmp_path)
        config.execution.backward = backward
        fns, plan = loop_functions(config)
        assert fns.replays == (backward == "replay")
        state = fns.init_state(training.init_params(plan.policy, jax.random.key(1)))
        traj = fns.sample(state.params, inst, rng)
        results[backward] = jax.device_get(fns.update(state, inst, traj, rng))[1]
        if backward == "replay":
            with pytest.raises(ValueError, match="stepwise"):
                fns.sample_and_update(state, inst, rng)
    for k in ("loss", "pg_loss", "aux_loss", "grad_norm", "score"):
        assert results["replay"][k] == pytest.approx(results["stepwise"][k], rel=1e-4, abs=1e-7), k


def test_sampled_actions_follow_the_policy_and_never_take_a_masked_node():
    """Inversion sampling: frequencies over 20,000 draws match the probabilities (including a row with a
    single feasible node and rows of near-zero probabilities), and no masked node is ever drawn."""
    n = 12
    logits = jax.random.normal(jax.random.key(0), (3, n)) * 3
    mask = jnp.array([[True] * n, [i % 3 == 0 for i in range(n)], [i == 7 for i in range(n)]])
    logp = jax.nn.log_softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    draws = 20000
    keys = jax.random.split(jax.random.key(1), draws)
    actions = np.asarray(jax.jit(jax.vmap(lambda k: rollout.sample_actions(k, logp)))(keys))     # (draws, 3)
    assert actions.dtype == np.int32
    probs = np.exp(np.asarray(logp, np.float64))
    for row in range(3):
        assert mask[row][actions[:, row]].all()
        freq = np.bincount(actions[:, row], minlength=n) / draws
        # 5 standard errors of a binomial frequency (and exact for the single feasible node).
        tol = 5 * np.sqrt(probs[row] * (1 - probs[row]) / draws) + 1e-12
        assert np.all(np.abs(freq - probs[row]) <= tol), (row, freq, probs[row])
    # A row with nothing feasible (all -inf) draws node 0, as an argmax over no candidates would.
    none = jnp.full((2, n), -jnp.inf)
    np.testing.assert_array_equal(rollout.sample_actions(jax.random.key(2), none), [0, 0])


def test_loss_matches_an_independent_recomputation_and_a_step_lowers_it(tmp_path):
    config = tiny_config(tmp_path)
    fns, plan = loop_functions(config)
    state = fns.init_state(training.init_params(plan.policy, jax.random.key(1)))
    inst, rng = mixed_batch(), jax.random.key(5)
    traj = fns.sample(state.params, inst, rng)

    # The loss recomputed in numpy from the sampled rollout's costs and log-likelihoods (float64).
    cost, ll, valid = (np.asarray(traj.cost, np.float64), np.asarray(traj.log_likelihood, np.float64),
                       np.asarray(traj.valid))
    assert not valid.all()
    terms = []
    for b in range(cost.shape[0]):
        reward = -cost[b, valid[b]]
        terms.extend(-(reward - reward.mean()) * ll[b, valid[b]])
    alpha = config.aux_loss_coef / 1e-3   # the config's alpha over the MoE layers' own 1e-3 weighting
    expected = np.mean(terms) + alpha * float(traj.aux_loss)

    new_state, m = fns.update(state, inst, traj, rng)
    assert bool(m["finite"]) and int(new_state.step) == 1
    # The replay's log-likelihood equals the sampling pass's to ~1e-5 (summation order), hence the rel.
    assert float(m["loss"]) == pytest.approx(expected, rel=1e-4)
    assert float(m["score"]) == pytest.approx(np.mean(np.where(valid, cost, np.inf).min(1)), rel=1e-6)
    assert float(m["replay_error"]) < 1e-3

    # The same trajectories scored with the updated parameters: the REINFORCE surrogate went down.
    _, m_after = fns.update(new_state, inst, traj, rng)
    assert float(m_after["loss"]) < float(m["loss"]) - 1e-3, (float(m["loss"]), float(m_after["loss"]))

    # A non-finite loss leaves the state as it was and says so.
    poisoned = state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))
    kept, m_nan = fns.update(poisoned, inst, traj, rng)
    assert not bool(m_nan["finite"]) and int(kept.step) == 0


def _strip_time(rows):
    return [{k: v for k, v in r.items() if k != "time"} for r in rows]


# Every field of the recipe beyond the paper's (tests/test_recipe.py), so that resuming is exact under each: the
# reward normalisation's running scales, the schedule, the starts and the size curriculum's switch (n = 20 for
# epochs 1-3, then the run's n = 50). The paper's recipe resumes in test_kill_resume.py.
RECIPE = dict(grad_clip_norm=1.0, lr_schedule="warmup_cosine", warmup_fraction=0.25, train_pomo_size=10,
              leader_advantage=3.0, reward_normalization_alpha=0.25, mixed_batches=True, size_curriculum="20:3",
              problem_size=50, pomo_size=50, validation_problems="CVRP,OVRPTW")


def test_resume_continues_exactly(tmp_path):
    straight = tiny_config(tmp_path / "straight", **RECIPE)
    training_loop.train_and_evaluate(straight)
    resumed = tiny_config(tmp_path / "resumed", **RECIPE)
    resumed.stop_after_epoch = 2
    training_loop.train_and_evaluate(resumed)                                 # stopped after epoch 2
    with training_loop.checkpoint_manager(resumed.workdir) as mngr:
        assert mngr.latest_step() == 2
    training_loop.train_and_evaluate(resumed)                                 # already there: no epoch runs
    with training_loop.checkpoint_manager(resumed.workdir) as mngr:
        assert mngr.latest_step() == 2
    rows = training_validation.read_metrics(os.path.join(resumed.workdir, "metrics.jsonl"))
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    resumed.stop_after_epoch = 0
    last = training_loop.train_and_evaluate(resumed)                          # continued to the end
    assert last["epoch"] == 4

    _, p1 = checkpoints.load_policy(straight.workdir)
    _, p2 = checkpoints.load_policy(resumed.workdir)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), p1, p2)
    rows1 = training_validation.read_metrics(os.path.join(straight.workdir, "metrics.jsonl"))
    rows2 = training_validation.read_metrics(os.path.join(resumed.workdir, "metrics.jsonl"))
    assert [r["epoch"] for r in rows2] == [0, 1, 2, 3, 4]
    assert _strip_time(rows1) == _strip_time(rows2)
    assert os.path.getsize(os.path.join(resumed.workdir, "validation.png")) > 0

    # Fine-tuning starts from the trained parameters (its first validation is the source run's last)
    # with a fresh optimiser.
    tuned = tiny_config(tmp_path / "tuned", stop_after_epoch=1, finetune_from=straight.workdir, **RECIPE)
    training_loop.train_and_evaluate(tuned)
    rows3 = training_validation.read_metrics(os.path.join(tuned.workdir, "metrics.jsonl"))
    assert rows3[0]["val"] == rows1[-1]["val"] and rows3[-1]["step"] == 2
    # The cosine decayed; the reward normalisation's scales were saved, one per training variant.
    assert rows1[-1]["lr"] < rows1[1]["lr"]
    with training_loop.checkpoint_manager(resumed.workdir) as mngr:
        meta = mngr.restore(4, args=ocp.args.Composite(train_meta=ocp.args.JsonRestore()))["train_meta"]
    assert len(meta["cost_scale"]) == 3 and min(meta["cost_scale"]) > 0

    # Another model in the same workdir is refused, and so is another recipe, naming the field.
    other = tiny_config(tmp_path / "resumed", epochs=5, **RECIPE)
    other.model.embedding_dim = 32
    with pytest.raises(ValueError, match="another model"):
        training_loop.train_and_evaluate(other)
    with pytest.raises(ValueError, match="leader_advantage"):
        training_loop.train_and_evaluate(tiny_config(tmp_path / "resumed", **dict(RECIPE, leader_advantage=2.0)))


def test_a_size_cycle_with_a_learned_bias_resumes_exactly_and_moves_the_bias(tmp_path):
    """Steps cycle through n = 20 and 50 (8 instances, then 8 x (20/50)^2 -> 1; one step an epoch), the distance
    bias a parameter starting at 0.5: a run stopped after epoch 1 and continued ends where an uninterrupted one
    does, the bias has moved, and the reward normalisation keeps one block of scales per size."""
    def config(workdir, **overrides):
        c = tiny_config(workdir, train_sizes="20,50", reward_normalization_alpha=0.25, mixed_batches=True, epochs=2,
                        train_episodes=8, validation_problems="CVRP", **overrides)
        c.model.distance_bias, c.model.learned_distance_bias = 0.5, True
        return c

    straight = config(tmp_path / "straight")
    training_loop.train_and_evaluate(straight)
    resumed = config(tmp_path / "resumed", stop_after_epoch=1)
    training_loop.train_and_evaluate(resumed)
    resumed.stop_after_epoch = 0
    assert training_loop.train_and_evaluate(resumed)["epoch"] == 2
    cfg, p1 = checkpoints.load_policy(straight.workdir)
    _, p2 = checkpoints.load_policy(resumed.workdir)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), p1, p2)
    assert cfg.learned_distance_bias and float(p1["params"]["distance_bias_alpha"]) != 0.5
    rows = training_validation.read_metrics(os.path.join(straight.workdir, "metrics.jsonl"))
    assert _strip_time(rows) == _strip_time(training_validation.read_metrics(
        os.path.join(resumed.workdir, "metrics.jsonl")))
    assert rows[-1]["distance_bias_alpha"] == pytest.approx(float(p1["params"]["distance_bias_alpha"]))
    with training_loop.checkpoint_manager(straight.workdir) as mngr:
        meta = mngr.restore(2, args=ocp.args.Composite(train_meta=ocp.args.JsonRestore()))["train_meta"]
    at_20, at_50 = np.asarray(meta["cost_scale"][:3]), np.asarray(meta["cost_scale"][3:])
    assert len(meta["cost_scale"]) == 6 and at_20.min() > 0 and at_50.max() > at_20.max()


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    config = tiny_config(tmp_path / "run", epochs=1)
    training_loop.train_and_evaluate(config)
    _, good = checkpoints.load_policy(config.workdir)

    original = training.StepFunctions.step

    def diverging(self, state, key, size):        # what the jitted step reports for a NaN loss
        new, m = original(self, state, key, size)
        return state, dict(m, finite=np.bool_(False), loss=np.float32(np.nan))

    monkeypatch.setattr(training.StepFunctions, "step", diverging)
    config = tiny_config(tmp_path / "run", epochs=2)
    with pytest.raises(training.NonFiniteError, match=r"non-finite loss or gradient at step 2 \(epoch 2.*"
                                                      r"last good checkpoint is epoch 1"):
        training_loop.train_and_evaluate(config)
    with training_loop.checkpoint_manager(config.workdir) as mngr:
        assert mngr.latest_step() == 1
    _, after = checkpoints.load_policy(config.workdir)
    jax.tree.map(np.testing.assert_array_equal, good, after)


SHARDED_SCRIPT = r"""
import dataclasses, json, sys, jax, numpy as np, optax
from mvmoe_jax import execution, training, training_loop
from mvmoe_jax.engines import stepwise_backward
from mvmoe_jax.nn.policy import PolicyConfig
base = PolicyConfig(model="mvmoe_light", embedding_dim=16, num_heads=2, num_layers=1, ff_hidden_dim=32,
                    expert_loc=("Enc0", "Dec"))
out = {"devices": len(jax.devices())}
# The encoder's MoE layer as the cpu plan runs it at this size (dense) and grouped (on the mesh: one sort
# per device's share of the batch, the plan's moe_sort_groups); and POMO-MTL, whose decoding steps run per
# device. The grouped MVMoE-L and one POMO-MTL run take the backward's products from the sampling pass's record.
pomo = PolicyConfig(model="pomo_mtl", embedding_dim=16, num_heads=2, num_layers=1, ff_hidden_dim=32, expert_loc=())
cpu = execution.cpu()
cases = {"sgd": (base, cpu), "sgd_grouped": (base, cpu.replace(moe_dispatch="grouped", reuse_sampling="always")),
         "sgd_pomo": (pomo, cpu), "sgd_pomo_record": (pomo, cpu.replace(reuse_sampling="always"))}
for opt_name in sys.argv[1].split(","):
    cfg, plan = cases[opt_name]
    opt = optax.sgd(1e-2)
    params = training.init_params(cfg, jax.random.key(0))
    res = {}
    for name, devs in (("one", jax.devices()[:1]), ("all", jax.devices())):
        settings = training.StepSettings(pomo_size=20, aux_loss_coef=10.0)
        fns = training.StepFunctions(cfg, plan, opt, settings,
                                     num_customers=20, variants=("CVRP", "VRPB", "OVRPTW"), mixed=True,
                                     mesh=training.make_mesh(devs), replay_bucket_size=40)
        state, m = fns.step(fns.init_state(params), jax.random.key(7), 8)
        res[name] = (jax.device_get(state), jax.device_get(m))
        sharding = state.params["params"]["Wk"]["kernel"].sharding
    (s1, m1), (s2, m2) = res["one"], res["all"]
    out[opt_name] = {
        "param_diff": max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(s1.params),
                                                                     jax.tree.leaves(s2.params))),
        "score": [float(m1["score"]), float(m2["score"])], "loss": [float(m1["loss"]), float(m2["loss"])],
        "replicated": sharding.is_fully_replicated, "mesh": str(sharding.mesh.shape),
        "per_device": [stepwise_backward.steps_run_per_device(cfg, training.make_mesh(d))
                       for d in (jax.devices()[:1], jax.devices())],
        "record": training.records_decoder(fns.policy, fns.settings, fns.batch(jax.random.key(7), 8),
                                           fns.max_steps, fns.mesh)}
try:
    fns.batch(jax.random.key(0), 7)
except ValueError as e:
    out["odd_batch"] = str(e)
print("RESULT" + json.dumps(out))
"""


def _sharded_steps(cases):
    """SHARDED_SCRIPT's results for these cases, in a process with two CPU devices."""
    env = xla_flags_env("--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, ",".join(cases)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["devices"] == 2
    for name in cases:
        r = out[name]
        assert r["score"][0] == pytest.approx(r["score"][1], rel=1e-6), name     # the same trajectories
        # The loss is a small difference of O(1) terms (advantage-weighted log-likelihoods summed over ~40
        # steps) whose summation order changes when the batch is split: agreement to ~1e-5 of its size.
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-4), name
        assert r["replicated"] and "2" in r["mesh"]
        # The same gradient, hence (plain SGD) the same parameters. Adam is left out on purpose: it divides
        # by sqrt(second moment), which turns ~1e-8 float noise in gradients that are zero in exact
        # arithmetic (the bias before an instance norm) into lr-sized steps whichever way sums are ordered.
        assert r["param_diff"] < 1e-6, name
    assert "cannot be split over 2 devices" in out["odd_batch"]
    return out


def test_sharded_step_equals_the_single_device_step():
    """One loop over the sharded batch (MVMoE-L: its decoder MoE and gate use whole-batch statistics at
    every step; grouped encoder MoE sorted per device; the backward from the sampling pass's record), and
    POMO-MTL's steps run per device on the two-device mesh (the single-device step is the reference)."""
    out = _sharded_steps(("sgd_grouped", "sgd_pomo"))
    assert out["sgd_grouped"]["per_device"] == [False, False]
    assert out["sgd_pomo"]["per_device"] == [False, True]
    assert [out[k]["record"] for k in ("sgd_grouped", "sgd_pomo")] == [True, False]


@pytest.mark.slow      # four more training programs compiled in a subprocess, ~2 minutes on 2 cores
def test_sharded_step_with_and_without_the_record_and_grouping():
    out = _sharded_steps(("sgd", "sgd_grouped", "sgd_pomo", "sgd_pomo_record"))
    assert out["sgd"]["per_device"] == [False, False]
    assert out["sgd_pomo"]["per_device"] == out["sgd_pomo_record"]["per_device"] == [False, True]
    assert [out[k]["record"] for k in ("sgd", "sgd_grouped", "sgd_pomo", "sgd_pomo_record")] == [False, True, False, True]
    # With the record or without, the same step.
    assert out["sgd_pomo"]["loss"][0] == pytest.approx(out["sgd_pomo_record"]["loss"][0], rel=1e-4)
    # Grouped or dense, the same step.
    assert out["sgd"]["loss"][0] == pytest.approx(out["sgd_grouped"]["loss"][0], rel=1e-4)


def test_resuming_with_other_run_settings_is_refused_naming_them(tmp_path, capsys):
    first = tiny_config(tmp_path / "run", stop_after_epoch=1)
    training_loop.train_and_evaluate(first)
    changed = tiny_config(tmp_path / "run", batch_size=16, learning_rate=5e-4)
    with pytest.raises(ValueError, match=r"other settings \(batch_size: stored 8, command 16; learning_rate: "):
        training_loop.train_and_evaluate(changed)
    # What may change between calls does not stop it: where to stop, the budget, the validation cadence.
    again = tiny_config(tmp_path / "run", stop_after_epoch=2, time_limit_seconds=3600.0, validate_every_epochs=2)
    assert training_loop.train_and_evaluate(again)["epoch"] == 2
    # Nor does extending the run with a schedule of its own: the rate drops from the epoch the new pair says.
    capsys.readouterr()
    longer = tiny_config(tmp_path / "run", epochs=8, lr_decay_epoch_fraction=0.25, stop_after_epoch=4)
    assert training_loop.train_and_evaluate(longer)["epoch"] == 4
    assert "learning rate 0.001, x0.1 from epoch 4" in capsys.readouterr().out
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rates = {r["epoch"]: r["lr"] for r in map(json.loads, f) if "lr" in r}
    assert rates[3] == pytest.approx(1e-3) and rates[4] == pytest.approx(1e-4)


@pytest.fixture(scope="module")
def straight_and_stopped_runs(tmp_path_factory):
    """A run trained straight through its 4 epochs and the same run stopped after epoch 2 (their workdirs), for
    the tests below to copy: a workdir may move between calls."""
    root = tmp_path_factory.mktemp("runs")
    training_loop.train_and_evaluate(tiny_config(root / "straight"))
    training_loop.train_and_evaluate(tiny_config(root / "stopped", stop_after_epoch=2))
    return root / "straight", root / "stopped"


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_damaged_latest_checkpoint_is_named_and_the_run_goes_on_from_the_one_before(
        tmp_path, capsys, damage, straight_and_stopped_runs):
    straight_dir, stopped_dir = straight_and_stopped_runs
    shutil.copytree(stopped_dir, tmp_path / "run")
    run = tiny_config(tmp_path / "run", stop_after_epoch=2)
    with training_loop.checkpoint_manager(run.workdir) as mngr:
        assert mngr.latest_step() == 2
    data = [os.path.join(root, f) for root, _, files in os.walk(os.path.join(run.workdir, "checkpoints", "2", "params"))
            for f in files if os.sep + "d" + os.sep in os.path.join(root, f)]
    assert data
    for path in data:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            if damage == "truncated":
                f.truncate(size // 2)
            else:
                f.write(b"\xff" * size)
    capsys.readouterr()
    run.stop_after_epoch = 0
    last = training_loop.train_and_evaluate(run)
    out = capsys.readouterr().out
    assert f"the checkpoint of epoch 2 ({os.path.join(run.workdir, 'checkpoints', '2')}) cannot be read" in out
    assert "falling back to epoch 1" in out and "resuming" in out and last["epoch"] == 4
    _, p1 = checkpoints.load_policy(str(straight_dir))
    _, p2 = checkpoints.load_policy(run.workdir)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), p1, p2)
