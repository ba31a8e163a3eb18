"""The execution plan (mvmoe_jax/execution.py): every field, turned on against the ``reference`` plan (with the
others in two combined plans; alone with the slow tests), decodes the same tours in inference and takes the same
training step (equal gradients within float tolerance); the presets, the overrides and their errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mvmoe_jax import execution, instances, rollout, training
from mvmoe_jax.nn.policy import PolicyConfig
from test_fast_paths import perturbed_params

N = 20
CFG = PolicyConfig(model="mvmoe", embedding_dim=16, num_heads=2, num_layers=1, ff_hidden_dim=32,
                   expert_loc=("Enc0", "Dec"))
REFERENCE = execution.reference()

# One line per field: the field at a value that changes the computation for CFG's batches, with what it
# needs to take effect (a layout of the recorded weights needs the stepwise backward that records them).
# Sizes: 4 instances x 21 nodes x top-2 = 168 expert assignments per encoder call; 5 instances per
# 100-trajectory chunk of 20 starts.
RECORD = dict(attention_vjp=True, fused_readout=True, backward="stepwise", reuse_sampling="always")
FIELD_CASES = {
    "moe_dispatch": dict(moe_dispatch="grouped"),
    "grouped_min_assignments": dict(moe_dispatch="grouped_mlp", grouped_min_assignments=100),
    "grouped_by_expert": dict(moe_dispatch="grouped", grouped_by_expert=True),
    "grouped_blocks_as_one_product": dict(moe_dispatch="grouped", grouped_blocks_as_one_product=True),
    "moe_sort_groups": dict(moe_dispatch="grouped", moe_sort_groups=2),
    "gates_by_rank": dict(gates_by_rank=True),
    "fused_readout": dict(fused_readout=True),
    "readout_column_multiple": dict(fused_readout=True, readout_column_multiple=16),
    "fused_query": dict(fused_query=True),
    "query_table_multiple": dict(fused_query=True, query_table_multiple=8),
    "query_table_max_columns": dict(fused_query=True, query_table_multiple=8, query_table_max_columns=16),
    "score_bound_instances": dict(fused_query=True, score_bound_instances=1000),
    "mix_maps_elementwise": dict(fused_readout=True, mix_maps_elementwise=True),
    "lane_reductions": dict(lane_reductions=True),
    "attention_vjp": dict(attention_vjp=True),
    "products_against_transposes": dict(attention_vjp=True, products_against_transposes=True),
    "keys_major_weights": dict(RECORD, keys_major_weights=True),
    "row_sums_from_output": dict(RECORD, row_sums_from_output=True),
    "merge_heads_by_slices": dict(fused_query=True, merge_heads_by_slices=True),
    "normalise_after_product": dict(normalise_after_product=True),
    "eval_chunk_trajectories": dict(eval_chunk_trajectories=100),
    "encoder_tokens": dict(eval_chunk_trajectories=100, moe_dispatch="grouped_mlp", encoder_tokens=3264),
    "sampling_chunk_trajectories": dict(backward="stepwise", sampling_chunk_trajectories=40),
    "backward": dict(backward="stepwise"),
    "reuse_sampling": dict(RECORD),
    "replay_steps_at_once": dict(replay_steps_at_once=3),
    "replay_remat": dict(replay_remat=True),
}
# Set before JAX starts, outside any program: the devices and the allocator (tests/test_host_memory.py and
# the multi-device tests cover them).
PROCESS_FIELDS = ("cpu_devices", "huge_pages")


def test_every_field_has_a_case():
    """A new plan field needs its line above: this fails until it has one."""
    assert set(FIELD_CASES) | set(PROCESS_FIELDS) == set(execution.FIELDS)
    for name, changes in FIELD_CASES.items():
        assert getattr(REFERENCE.replace(**changes), name) != getattr(REFERENCE, name), name


@pytest.fixture(scope="module")
def params():
    """Initial parameters with the (zero-initialised) gates made random, so that routing varies."""
    return perturbed_params(CFG)


@pytest.fixture(scope="module")
def batch():
    variants = ["CVRP", "VRPBLTW", "OVRPTW", "VRPL"]
    parts = [instances.generate(jax.random.key(i), 1, N, v) for i, v in enumerate(variants)]
    return jax.tree.map(lambda *x: jnp.concatenate(x), *parts)


def _greedy(plan, params, batch):
    res = rollout.greedy_evaluate(CFG, params, batch, jax.random.key(4), pomo_size=N, plan=plan, num_devices=1)
    return jax.device_get(res)


@pytest.fixture(scope="module")
def reference_greedy(params, batch):
    return _greedy(REFERENCE, params, batch)


def _assert_the_reference_tours(plan, params, batch, reference_greedy):
    """Greedy x8 from every start: the same best tour of every instance, the same costs to float rounding."""
    got = _greedy(plan, params, batch)
    np.testing.assert_array_equal(got.best_actions, reference_greedy.best_actions)
    np.testing.assert_allclose(got.obj, reference_greedy.obj, rtol=1e-6)
    np.testing.assert_allclose(got.obj_no_aug, reference_greedy.obj_no_aug, rtol=1e-6)


# Every field alone is a compilation of its own, so the default suite runs the fields together, in the two plans
# below, and each field alone with the slow tests. The plans split the fields by what they need: A the grouped
# experts and the replayed backward, B the grouped MLP and the stepwise backward with its decoder record.
COMBINED_PLANS = {
    "A": dict(moe_dispatch="grouped", grouped_by_expert=True, grouped_blocks_as_one_product=True, moe_sort_groups=2,
              gates_by_rank=True, fused_readout=True, readout_column_multiple=16, mix_maps_elementwise=True,
              fused_query=True, query_table_multiple=8, query_table_max_columns=16, score_bound_instances=1000,
              merge_heads_by_slices=True, normalise_after_product=True, eval_chunk_trajectories=100,
              attention_vjp=True, products_against_transposes=True, replay_steps_at_once=3, replay_remat=True),
    "B": dict(RECORD, moe_dispatch="grouped_mlp", grouped_min_assignments=100, encoder_tokens=3264,
              eval_chunk_trajectories=100, keys_major_weights=True, row_sums_from_output=True,
              sampling_chunk_trajectories=40, lane_reductions=True),
}
# Fields that a plan's other fields make inert (the replay's fields under the stepwise backward).
REPLAY_ONLY = ("replay_steps_at_once", "replay_remat")


def test_every_field_is_on_in_a_combined_plan():
    """Each field's case holds in one of the combined plans, and in a plan where nothing makes it inert."""
    for name, changes in FIELD_CASES.items():
        homes = [key for key, plan in COMBINED_PLANS.items() if changes.items() <= plan.items()]
        assert homes, f"{name}: no combined plan turns it on as its case does"
        if name in REPLAY_ONLY:
            assert any(COMBINED_PLANS[key].get("backward", REFERENCE.backward) == "replay" for key in homes), name


@pytest.mark.parametrize("combined", sorted(COMBINED_PLANS))
def test_the_combined_fields_decode_the_reference_tours(combined, params, batch, reference_greedy):
    _assert_the_reference_tours(REFERENCE.replace(**COMBINED_PLANS[combined]), params, batch, reference_greedy)


@pytest.mark.slow
@pytest.mark.parametrize("field", sorted(FIELD_CASES))
def test_one_field_decodes_the_reference_tours(field, params, batch, reference_greedy):
    _assert_the_reference_tours(REFERENCE.replace(**FIELD_CASES[field]), params, batch, reference_greedy)


def _training_step(plan, params, batch, cfg=CFG):
    """(the sampled tours' mean best cost, the gradient) of one training step: plain SGD at rate 1 makes the
    parameter update the negative gradient."""
    settings = training.StepSettings(pomo_size=N, aux_loss_coef=10.0)
    fns = training.StepFunctions(cfg, plan, optax.sgd(1.0), settings, num_customers=N,
                                 variants=("CVRP", "VRPBLTW", "OVRPTW", "VRPL"), mixed=True,
                                 mesh=training.make_mesh(jax.devices()[:1]))
    state = fns.init_state(params)
    rng = jax.random.key(5)
    if fns.replays:
        traj = fns.sample(state.params, batch, rng)
        new, metrics = fns.update(state, batch, traj, rng)
    else:
        new, metrics = fns.sample_and_update(state, batch, rng)
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), state.params, jax.device_get(new.params))
    return float(metrics["score"]), grads


@pytest.fixture(scope="module")
def reference_step(params, batch):
    return _training_step(REFERENCE, params, batch)


def _assert_the_reference_step(plan, params, batch, reference_step):
    """The same sampled tours (equal mean cost) and, for every parameter, the reference's gradient."""
    score, grads = _training_step(plan, params, batch)
    want_score, want = reference_step
    assert score == pytest.approx(want_score, rel=1e-6)
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want))
    for (path, expected), got in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-5 * scale,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("combined", sorted(COMBINED_PLANS))
def test_the_combined_fields_take_the_reference_training_step(combined, params, batch, reference_step):
    _assert_the_reference_step(REFERENCE.replace(**COMBINED_PLANS[combined]), params, batch, reference_step)


@pytest.mark.slow
@pytest.mark.parametrize("field", sorted(FIELD_CASES))
def test_one_field_takes_the_reference_training_step(field, params, batch, reference_step):
    _assert_the_reference_step(REFERENCE.replace(**FIELD_CASES[field]), params, batch, reference_step)


def test_presets():
    """The presets hold the choices docs/performance.md measured: the CPU's attention backward layouts follow
    its vector width; accelerators keep whole batches and the products as written; the reference runs
    nothing but the plain computation."""
    assert execution.cpu(avx512=True).keys_major_weights and not execution.cpu(avx512=True).products_against_transposes
    assert execution.cpu(avx512=False).products_against_transposes and not execution.cpu(avx512=False).keys_major_weights
    gpu = execution.gpu()
    assert gpu.moe_dispatch == "dense" and gpu.eval_chunk_trajectories == 0 and gpu.sampling_chunk_trajectories == 0
    assert gpu.fused_readout and gpu.fused_query and gpu.backward == "stepwise" and gpu.reuse_sampling == "never"
    assert REFERENCE == execution.ExecutionPlan() and not REFERENCE.attention_vjp and REFERENCE.backward == "replay"
    assert execution.plan_for("auto", "cpu") == execution.cpu() and execution.plan_for("auto", "gpu") == gpu
    assert execution.plan_for("auto", "tpu") == gpu


def test_overrides_and_their_errors():
    """Overrides parse by the field's type; unknown fields, bad values and unknown presets are refused with
    the accepted ones named."""
    assert execution.parse_overrides("backward=replay, cpu_devices=1,fused_query=false") == dict(
        backward="replay", cpu_devices=1, fused_query=False)
    assert execution.plan_for("cpu", None, score_bound_instances=None).score_bound_instances == 1  # None: unset
    with pytest.raises(ValueError, match="FIELD=VALUE with FIELD one of moe_dispatch, "):
        execution.parse_overrides("fast=true")
    with pytest.raises(ValueError, match="fused_query takes true or false"):
        execution.parse_overrides("fused_query=yes")
    with pytest.raises(ValueError, match="cpu_devices takes an integer"):
        execution.parse_overrides("cpu_devices=two")
    with pytest.raises(ValueError, match=r"moe_dispatch must be one of \('dense', 'grouped_mlp'"):
        REFERENCE.replace(moe_dispatch="auto")
    with pytest.raises(ValueError, match="eval_chunk_trajectories must be >= 0"):
        REFERENCE.replace(eval_chunk_trajectories=-1)
    with pytest.raises(ValueError, match="unknown execution plan fields \\['speed'\\]"):
        REFERENCE.replace(speed=1)
    with pytest.raises(ValueError, match="unknown execution preset 'tpu'; expected auto or one of"):
        execution.plan_for("tpu")
    assert execution.process_settings("reference", {}) == (1, False)
    assert execution.process_settings("auto", {"cpu_devices": 2}) == (2, True)


def test_the_plan_is_part_of_the_jit_cache_key(params, batch):
    """Two plans, one jitted evaluation function: each traced on its own (a field read at trace time but left
    out of the key would make the second call reuse the first plan's program)."""
    before = rollout._greedy_evaluate._cache_size()
    two = REFERENCE.replace(eval_chunk_trajectories=40)             # chunks of two instances
    three = dataclasses.replace(two, eval_chunk_trajectories=60)     # of three: values no other test uses
    _greedy(two, params, batch)
    _greedy(three, params, batch)
    assert rollout._greedy_evaluate._cache_size() == before + 2
    _greedy(dataclasses.replace(three, eval_chunk_trajectories=60), params, batch)     # an equal plan: cached
    assert rollout._greedy_evaluate._cache_size() == before + 2


# The distance-aware decoding options (PolicyConfig.distance_bias and candidates, nn/locality.py) act on a step's
# logits and choice after every engine has run, so every plan carries them; here each preset against the reference,
# for greedy evaluation (MVMoE and MVMoE-L, whose gate takes its own pass over the chunks) and a training step.
DECODING = dict(distance_bias=1.5, candidates=4)


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_the_decoding_options_hold_under_every_preset(preset, params, batch):
    cfg = dataclasses.replace(CFG, **DECODING)
    plan = execution.plan_for(preset, cpu_devices=1, huge_pages=False)
    want = rollout.greedy_evaluate(cfg, params, batch, jax.random.key(4), pomo_size=N, plan=REFERENCE, num_devices=1)
    got = rollout.greedy_evaluate(cfg, params, batch, jax.random.key(4), pomo_size=N, plan=plan, num_devices=1)
    plain = _greedy(REFERENCE, params, batch)
    assert not np.array_equal(want.best_actions, plain.best_actions)          # the options change the tours
    np.testing.assert_array_equal(got.best_actions, want.best_actions)
    np.testing.assert_allclose(got.obj, want.obj, rtol=1e-6)
    light = dataclasses.replace(cfg, model="mvmoe_light")
    light_params = training.init_params(light, jax.random.key(1), N)
    want, got = (rollout.greedy_evaluate(light, light_params, batch, jax.random.key(4), pomo_size=N, plan=p,
                                         num_devices=1) for p in (REFERENCE, plan))
    np.testing.assert_array_equal(got.best_actions, want.best_actions)

    want_score, want_grads = _training_step(REFERENCE, params, batch, cfg)
    score, grads = _training_step(plan, params, batch, cfg)
    assert score == pytest.approx(want_score, rel=1e-6)
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want_grads))
    for expected, g in zip(jax.tree.leaves(want_grads), jax.tree.leaves(grads)):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, expected, rtol=1e-3, atol=1e-5 * scale)
