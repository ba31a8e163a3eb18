"""The execution plan's shortcuts (mvmoe_jax/execution.py) give the results of the plain computation: the decoder's
readout and query fusions (plan fields ``fused_readout``, ``readout_column_multiple``, ``fused_query``,
``query_table_multiple``, ``query_table_max_columns``, ``score_bound_instances``, ``mix_maps_elementwise``), the
attention engines (``attention_vjp``, ``products_against_transposes``, ``keys_major_weights``,
``row_sums_from_output``, ``merge_heads_by_slices``, ``normalise_after_product``), the greedy and sampling
reductions in lanes (``lane_reductions``), chunked greedy evaluation (``eval_chunk_trajectories``,
``encoder_tokens``; MVMoE-L's batch-pooled gate included) and the grouped MoE execution in the policy
(``moe_dispatch``). Each is compared, on and off, with the plan that differs from it in that field only; the
presets' values of the fields that encode a platform's choice are checked too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO_ROOT, TEST_XLA_FLAGS
from mvmoe_jax import devices, env, execution, instances, rollout, training
from mvmoe_jax.engines import attention as attention_engines
from mvmoe_jax.engines import lane_reductions, query_tables
from mvmoe_jax.engines import readout as readout_engines
from mvmoe_jax.nn import attention
from mvmoe_jax.nn import policy as policy_lib
from mvmoe_jax.nn.policy import Policy, PolicyConfig

N = 20
SMALL = dict(embedding_dim=32, num_heads=4, num_layers=2, ff_hidden_dim=48)
MODELS = ["pomo_mtl", "mvmoe", "mvmoe_light"]
# The CPU preset, every shortcut on (its attention layouts those of this machine's CPU); tests turn fields off.
CPU = execution.cpu()


def small_config(model: str, **kw) -> PolicyConfig:
    loc = ("Enc0", "Enc1", "Dec")
    return PolicyConfig(model=model, expert_loc=loc, **SMALL, **kw)


def perturbed_params(cfg: PolicyConfig, seed: int = 0):
    """Initial parameters with the (zero-initialised) gates made random, so that routing varies."""
    params = training.init_params(cfg, jax.random.key(seed), N)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    out = [jnp.asarray(rng.standard_normal(x.shape), x.dtype) if "w_gate" in jax.tree_util.keystr(path) else x
           for path, x in leaves]
    return jax.tree_util.tree_unflatten(tree, out)


def mixed_batch(size: int, seed: int = 1):
    variants = ["CVRP", "VRPBLTW", "OVRPTW", "VRPL"]
    parts = [instances.generate(jax.random.key(seed + i), size // len(variants), N, v)
             for i, v in enumerate(variants)]
    return jax.tree.map(lambda *x: jnp.concatenate(x), *parts)


def states_two_moves_in(inst):
    """(states, mask, dynamic features) two uniformly random feasible moves into a rollout of ``inst``."""
    states, _, _ = rollout.initial_states(inst, N)
    for step in range(2):
        logp = jnp.log(env.batch_action_mask(states).astype(jnp.float32))
        states = env.batch_step(states, rollout.sample_actions(jax.random.key(step), logp))
    return states, env.batch_action_mask(states), rollout.dynamic_features(states)


@pytest.mark.parametrize("fusion,cache_field", [("fused_readout", "readout"), ("fused_query", "node_scores"),
                                                ("hoisted_query", "node_queries")])
@pytest.mark.parametrize("model", MODELS)
def test_fusions_give_the_plain_log_probabilities(model, fusion, cache_field):
    """Each decoder fusion (readout: the combining maps folded into the node embeddings; query: every
    possible query's attention scores precomputed; hoisted query: the query projection's node part
    precomputed, training's differentiable form) gives the log-probabilities of the plan without it (the
    field ``fused_readout`` or ``fused_query`` off), two steps into a rollout (varied current nodes and
    dynamic features)."""
    cfg = small_config(model)
    plain_plan = CPU.replace(**{"fused_query" if fusion == "hoisted_query" else fusion: False})
    params = perturbed_params(cfg)
    inst = mixed_batch(8)
    fused, plain = Policy(cfg, CPU), Policy(cfg, plain_plan)
    assert fused.fuses_readout and policy_lib.fuses_readout(cfg, CPU) and CPU.fused_query
    states, mask, dyn = states_two_moves_in(inst)
    assert float(jnp.abs(dyn[..., :3]).max()) > 0 and len(np.unique(np.asarray(states.current))) > 3
    outs = []
    for policy in (fused, plain):
        emb, _ = rollout.encode_nodes(policy, params, inst, jax.random.key(0))
        cache = policy.apply(params, emb, fusion != "hoisted_query", method=Policy.precompute)
        assert (getattr(cache, cache_field) is not None) == (policy is fused)
        outs.append(policy.apply(params, cache, states.current, dyn, mask, None, False, method=Policy.decode,
                                 rngs={"gating": jax.random.key(3)}))
    (lp_f, aux_f, probs_f), (lp_p, aux_p, probs_p) = outs
    finite = np.isfinite(np.asarray(lp_p))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lp_f)), finite)
    np.testing.assert_allclose(np.asarray(lp_f)[finite], np.asarray(lp_p)[finite], rtol=1e-5, atol=1e-5)
    assert float(aux_f) == pytest.approx(float(aux_p), rel=1e-5, abs=1e-8)
    if cfg.hierarchical:
        np.testing.assert_allclose(probs_f, probs_p, rtol=1e-6)


@pytest.mark.parametrize("given", ["", "scores_from_tables", "sampling_record"],
                         ids=["hoisted", "scores_from_tables", "sampling_record"])
@pytest.mark.parametrize("model", MODELS)
def test_hoisted_query_gives_the_plain_gradient(model, given):
    """The training backward's hoisted query projection (``DecoderCache.node_queries``) differentiates to
    the plain path's gradient: encoder, precomputation and one decoding step in training mode, the
    log-probabilities weighted at random. Also with the attention scores gathered from the query fusion's
    tables, given without gradient (what ``sample_and_train_step`` passes its backward pass): the gradient
    then flows through the hoisted query and the keys (``attention_with_given_scores``). And with the
    step's attention and readout products taken from the record of a forward-only pass over the same
    inputs (the sampling pass's ``DecoderRecord``, ``reuses_sampling_pass``): the gradient flows through
    ``attention_with_given_weights`` and ``readout_product_given``. Against the plan with ``fused_query`` off."""
    cfg = small_config(model)
    params = perturbed_params(cfg, seed=3)
    inst = mixed_batch(8, seed=2)
    states, mask, dyn = states_two_moves_in(inst)
    weights = jax.random.normal(jax.random.key(5), mask.shape)
    grads, values = [], []
    for policy in (Policy(cfg, CPU), Policy(cfg, CPU.replace(fused_query=False))):
        def objective(p):
            emb, aux = rollout.encode_nodes(policy, p, inst, jax.random.key(0), True)
            cache = policy.apply(p, emb, False, method=Policy.precompute)
            assert (cache.node_queries is not None) == policy.plan.fused_query
            record = None
            if given == "scores_from_tables" and policy.plan.fused_query:
                tables = jax.lax.stop_gradient(policy.apply(p, cache, method=Policy.with_query_scores))
                cache = cache.with_given_scores(tables.node_scores, tables.feature_scores)
            if given == "sampling_record" and policy.plan.fused_query:
                sampling_cache = policy.apply(p, cache, method=Policy.with_query_scores)
                *sampled, record = jax.lax.stop_gradient(policy.apply(
                    p, sampling_cache, states.current, dyn, mask, None, True, True, True, method=Policy.decode,
                    rngs={"gating": jax.random.key(3)}))
                weights_shape = mask.shape[:1] + (cfg.num_heads,) + mask.shape[1:]
                assert attention_engines.kept_layout(record.attention_weights, policy.plan).shape == weights_shape
            logp, aux_t, _ = policy.apply(p, cache, states.current, dyn, mask, None, True, given=record,
                                          method=Policy.decode, rngs={"gating": jax.random.key(3)})
            recorded_logp = logp if record is None else sampled[0]
            return jnp.sum(jnp.where(mask, logp * weights, 0.0)) + aux + aux_t, (logp, recorded_logp)

        (value, (logp, recorded_logp)), grad = jax.value_and_grad(objective, has_aux=True)(params)
        # The record's pass computed these log-probabilities too.
        np.testing.assert_allclose(np.where(mask, logp, 0), np.where(mask, recorded_logp, 0), atol=1e-6)
        values.append(float(value))
        grads.append(grad)
    assert values[0] == pytest.approx(values[1], rel=1e-5)
    hoisted, plain = (jax.tree_util.tree_flatten_with_path(g)[0] for g in grads)
    wq = [np.asarray(x) for path, x in hoisted if "Wq_last" in jax.tree_util.keystr(path)]
    assert wq and float(np.abs(wq[0]).max()) > 1e-3
    # float32 rounding, relative to the gradient's scale: some leaves are zero but for rounding (the biases
    # that an instance norm follows)
    scale = max(float(np.abs(b).max()) for _, b in plain)
    for (path, a), (_, b) in zip(hoisted, plain):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


# MVMoE-L in the default suite: its batch-pooled gate is the one thing chunking could change.
@pytest.mark.parametrize("model", [pytest.param("pomo_mtl", marks=pytest.mark.slow),
                                   pytest.param("mvmoe", marks=pytest.mark.slow), "mvmoe_light"])
def test_chunked_greedy_evaluation_equals_one_batch(model):
    """The CPU plan's greedy evaluation in chunks (encoded in groups of chunks) gives the whole batch's results."""
    cfg = small_config(model)
    params = perturbed_params(cfg, seed=2)
    inst = mixed_batch(8, seed=5)
    whole = rollout.greedy_evaluate(cfg, params, inst, jax.random.key(4), pomo_size=N, chunk_size=10_000, plan=CPU)
    # 64 augmented instances in chunks of 5: 13 chunks, the last one padded.
    chunked = rollout.greedy_evaluate(cfg, params, inst, jax.random.key(4), pomo_size=N, chunk_size=5, plan=CPU)
    assert chunked.chunk_steps.shape == (13,) and whole.chunk_steps.shape == (1,)
    assert int(chunked.num_steps) == int(whole.num_steps) == int(np.max(chunked.chunk_steps))
    np.testing.assert_allclose(chunked.obj, whole.obj, rtol=1e-6)
    np.testing.assert_allclose(chunked.obj_no_aug, whole.obj_no_aug, rtol=1e-6)
    np.testing.assert_array_equal(chunked.best_actions, whole.best_actions)
    assert bool(np.all(chunked.all_finished))


def test_cpu_chunks_shrink_with_the_problem_size():
    """The CPU preset's chunks: about 100 trajectories per chunk (2 instances at n = 50, 5 at n = 20), one
    instance from 51 starts on; never fewer than one instance. The other presets decode the whole batch at once."""
    trajectories = CPU.eval_chunk_trajectories
    assert trajectories == 100
    sizes = [1, 20, 33, 50, 51, 60, 100, 200, 1000]
    chunks = [rollout.chunk_instances(p, trajectories) for p in sizes]
    assert chunks == [100, 5, 3, 2, 1, 1, 1, 1, 1]
    assert all(a >= b >= 1 for a, b in zip(chunks, chunks[1:]))
    assert all(c * p <= trajectories or c == 1 for c, p in zip(chunks, sizes))
    for plan in (execution.gpu(), execution.reference()):
        assert plan.eval_chunk_trajectories == 0 and rollout.chunk_instances(20, plan.eval_chunk_trajectories) is None


def test_encoder_groups_fill_a_token_budget_and_divide_the_chunks():
    """The chunks a device decodes are encoded in groups: the largest divisor of their count within the
    plan's ``encoder_tokens`` tokens, one chunk at least."""
    budget = CPU.encoder_tokens
    assert budget == 3264
    for num_chunks, chunk, nodes in [(16, 16, 51), (256, 1, 101), (13, 5, 11), (7, 3, 201), (4, 1, 101),
                                     (1, 16, 51), (9, 400, 51)]:
        group = rollout.encoder_group_size(num_chunks, chunk, nodes, budget)
        assert num_chunks % group == 0 and group >= 1
        assert group == 1 or group * chunk * nodes <= budget
        # Largest: no larger divisor fits.
        assert all(num_chunks % g or g * chunk * nodes > budget for g in range(group + 1, num_chunks + 1))
    assert rollout.encoder_group_size(9, 400, 51, budget) == 1          # one chunk alone exceeds the budget
    assert rollout.encoder_group_size(256, 1, 101, budget=6528) == 64
    assert rollout.encoder_group_size(256, 1, 101, budget=3264) == 32
    assert rollout.encoder_group_size(256, 1, 101, budget=0) == 1
    # Only an encoder with MoE layers that may run grouped is encoded in groups.
    assert rollout.encoder_token_budget(PolicyConfig(model="mvmoe"), CPU) == budget
    grouped = CPU.replace(moe_dispatch="grouped")
    assert rollout.encoder_token_budget(PolicyConfig(model="mvmoe_light"), grouped) == budget
    assert rollout.encoder_token_budget(PolicyConfig(model="mvmoe"), CPU.replace(moe_dispatch="dense")) == 0
    assert rollout.encoder_token_budget(PolicyConfig(model="pomo_mtl"), CPU) == 0
    assert rollout.encoder_token_budget(PolicyConfig(model="mvmoe", expert_loc=("Dec",)), CPU) == 0
    # The other presets run their MoE layers dense and encode per chunk.
    for plan in (execution.gpu(), execution.reference()):
        assert plan.encoder_tokens == 0 and rollout.encoder_token_budget(PolicyConfig(model="mvmoe"), plan) == 0


def test_chunk_size_must_be_positive():
    cfg = small_config("pomo_mtl")
    params = training.init_params(cfg, jax.random.key(0), N)
    with pytest.raises(ValueError, match="chunk_size"):
        rollout.greedy_evaluate(cfg, params, mixed_batch(4), jax.random.key(0), pomo_size=N, chunk_size=0)


DEVICES_SCRIPT = """
import json, sys
from mvmoe_jax import devices
assert devices.use_cpu_cores_as_devices(2) == 2
import jax, numpy as np
sys.path.insert(0, "tests")
from test_fast_paths import CPU, N, mixed_batch, perturbed_params, rollout, small_config
out = {"devices": len(jax.devices())}
for model in ("pomo_mtl", "mvmoe_light"):      # the plain path, and the gate pooled across devices
    cfg = small_config(model)
    # Inputs committed to one device (as a restored checkpoint's are) are copied where they are needed.
    params, inst = jax.device_put((perturbed_params(cfg), mixed_batch(8)), jax.devices()[0])
    res = rollout.greedy_evaluate(cfg, params, inst, jax.random.key(4), pomo_size=N, chunk_size=5, plan=CPU)
    out[model] = {k: np.asarray(getattr(res, k)).tolist() for k in ("obj", "obj_no_aug", "best_actions", "chunk_steps")}
    if model == "pomo_mtl":     # parameters replicated once (as evaluate_dataset does) are used where they are
        placed = rollout.replicated(params)
        leaves, again = jax.tree.leaves(placed), jax.tree.leaves(rollout.replicated(placed))
        out["replicated_devices"] = sorted({len(x.sharding.device_set) for x in leaves})
        out["replicated_again_is_no_copy"] = all(
            sa.data.unsafe_buffer_pointer() == sb.data.unsafe_buffer_pointer()
            for a, b in zip(leaves, again) for sa, sb in zip(a.addressable_shards, b.addressable_shards))
        out["replicated_again_returns_them"] = all(a is b for a, b in zip(leaves, again))
        # Beside arrays still to place (the batch), the placed parameters are not handed to device_put again
        # (which returned them as they were, but took ~5 ms for MVMoE's 112 on two CPU cores).
        put_leaves, device_put = [], jax.device_put
        def counting_put(x, *a, **k):
            put_leaves.append(len(jax.tree.leaves(x)))
            return device_put(x, *a, **k)
        jax.device_put = counting_put
        try:
            mixed_params, mixed_inst = rollout.replicated((placed, inst))
        finally:
            jax.device_put = device_put
        out["replicated_mixed_put_leaves"] = sum(put_leaves)
        out["inst_leaves"] = len(jax.tree.leaves(inst))
        out["replicated_mixed_keeps_placed"] = all(a is b for a, b in zip(leaves, jax.tree.leaves(mixed_params)))
        out["replicated_mixed_places_rest"] = sorted({len(x.sharding.device_set) for x in jax.tree.leaves(mixed_inst)})
        res2 = rollout.greedy_evaluate(cfg, placed, inst, jax.random.key(4), pomo_size=N, chunk_size=5, plan=CPU)
        out["replicated_same_obj"] = bool(np.array_equal(res.obj, res2.obj))
try:
    devices.use_cpu_cores_as_devices(3)
except RuntimeError as e:
    out["late"] = str(e)
import os
out["xla_flags"] = os.environ.get("XLA_FLAGS", "")
print("RESULT" + json.dumps(out))
"""


def test_greedy_evaluation_over_two_cpu_devices_equals_one_device():
    """The chunks dealt out over two devices (a CPU's two cores as JAX devices, in a subprocess) give
    exactly this process's one-device results, MVMoE-L's gate pooled across devices included; asking for
    other devices once JAX runs is a clear error. (The one-device runs are test_chunked_greedy_evaluation_
    equals_one_batch's, compiled once.)"""
    proc = subprocess.run([sys.executable, "-c", DEVICES_SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, XLA_FLAGS=TEST_XLA_FLAGS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["devices"] == 2 and len(jax.devices()) == 1
    for model in ("pomo_mtl", "mvmoe_light"):
        cfg = small_config(model)
        one = rollout.greedy_evaluate(cfg, perturbed_params(cfg), mixed_batch(8), jax.random.key(4), pomo_size=N,
                                      chunk_size=5, plan=CPU)
        # 64 augmented instances in chunks of 5: 13 chunks, padded to 14 for two devices.
        assert one.chunk_steps.shape == (13,) and len(out[model]["chunk_steps"]) == 14
        for field in ("obj", "obj_no_aug", "best_actions"):
            np.testing.assert_array_equal(np.asarray(out[model][field]), np.asarray(getattr(one, field)),
                                          err_msg=f"{model} {field}")
    assert "already started with 2" in out["late"]
    # 512-bit vectors asked for on an AVX-512 CPU only; on one, the equalities above hold with them.
    assert ("--xla_cpu_prefer_vector_width=512" in out["xla_flags"]) == devices.cpu_has_avx512()
    assert out["replicated_devices"] == [2] and out["replicated_again_is_no_copy"]
    assert out["replicated_again_returns_them"] and out["replicated_same_obj"]
    assert out["replicated_mixed_keeps_placed"] and out["replicated_mixed_places_rest"] == [2]
    assert out["replicated_mixed_put_leaves"] == out["inst_leaves"]


def test_wide_vectors_are_asked_for_on_avx512_only_and_never_over_a_given_width():
    wide = "--xla_cpu_prefer_vector_width=512"
    assert devices.xla_flags_with_wide_vectors("", avx512=True) == wide
    assert devices.xla_flags_with_wide_vectors("--xla_dump_to=/tmp/d", avx512=True) == f"--xla_dump_to=/tmp/d {wide}"
    assert devices.xla_flags_with_wide_vectors("--xla_dump_to=/tmp/d", avx512=False) == "--xla_dump_to=/tmp/d"
    own = "--xla_cpu_prefer_vector_width=256"
    assert devices.xla_flags_with_wide_vectors(own, avx512=True) == own
    assert devices.xla_flags_with_wide_vectors(wide, avx512=True) == wide     # not added twice


def test_largest_divisor_at_most():
    assert devices.largest_divisor_at_most(2, 64) == 2
    assert devices.largest_divisor_at_most(2, 64, 7) == 1
    assert devices.largest_divisor_at_most(8, 24, 12) == 6
    assert devices.largest_divisor_at_most(0, 5) == 1
    with pytest.raises(ValueError, match="at least 1"):
        devices.use_cpu_cores_as_devices(0)


def test_grouped_and_dense_dispatch_agree_in_the_policy():
    """The plan's ``moe_dispatch`` grouped (every MoE layer, from one assignment on) and dense give the same
    greedy objectives; an unknown dispatch is refused."""
    cfg = small_config("mvmoe")
    grouped = CPU.replace(moe_dispatch="grouped", grouped_min_assignments=0)
    dense = CPU.replace(moe_dispatch="dense")
    params = perturbed_params(cfg, seed=6)
    inst = mixed_batch(8, seed=9)
    a = rollout.greedy_evaluate(cfg, params, inst, jax.random.key(0), pomo_size=N, plan=grouped)
    b = rollout.greedy_evaluate(cfg, params, inst, jax.random.key(0), pomo_size=N, plan=dense)
    np.testing.assert_allclose(a.obj, b.obj, rtol=1e-5)
    with pytest.raises(ValueError, match="moe_dispatch"):
        CPU.replace(moe_dispatch="fast")


def test_first_argmax_agrees_with_argmax_on_ties_and_masked_nodes():
    """Greedy choices use ``first_argmax``: the first maximum, like ``jnp.argmax``, with -inf (masked) entries."""
    x = jnp.array([[1.0, 3.0, 3.0, -jnp.inf], [-jnp.inf, -jnp.inf, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0],
                   [-jnp.inf, -jnp.inf, -jnp.inf, 5.0]])
    np.testing.assert_array_equal(rollout.first_argmax(x), [1, 2, 0, 3])
    rand = jnp.round(jax.random.normal(jax.random.key(0), (6, 40, 21)) * 2)    # rounding makes ties common
    rand = jnp.where(jax.random.uniform(jax.random.key(1), rand.shape) < 0.3, -jnp.inf, rand)
    np.testing.assert_array_equal(rollout.first_argmax(rand), jnp.argmax(rand, axis=-1))
    assert rollout.first_argmax(rand).dtype == jnp.int32
    # A row with every node masked picks 0, as argmax; wide rows (indices held as floats) stay exact.
    np.testing.assert_array_equal(rollout.first_argmax(jnp.full((2, 7), -jnp.inf)), [0, 0])
    wide = jnp.round(jax.random.normal(jax.random.key(2), (8, 5001)) * 3)
    np.testing.assert_array_equal(rollout.first_argmax(wide), jnp.argmax(wide, axis=-1))
    flags = jnp.array([[False, True, True], [False, False, False], [True, False, True]])
    np.testing.assert_array_equal(rollout.first_true(flags), [1, 3, 0])      # N where none


@pytest.mark.parametrize("lanes", [True, False])
def test_first_argmax_and_first_true_in_lanes_equal_the_plain_reductions(lanes):
    """The greedy choice and sampling's first index, with their reductions in lanes (plan field
    ``lane_reductions``, ``engines.lane_reductions``) or plain, against ``jnp.argmax`` on rows of every width
    around the lanes' multiples, with ties, masked (-inf) nodes, rows masked whole and, in lanes, rows with a
    NaN: no entry equals their maximum. (The plain maximum of XLA:CPU ignores a NaN at some widths and keeps it
    at others, so a NaN row has no defined choice there; a finite model's log-probabilities hold none.)"""
    for width in (31, 32, 33, 47, 48, 51, 101, 201):
        x = jnp.round(jax.random.normal(jax.random.key(width), (3, 40, width)) * 2)
        x = jnp.where(jax.random.uniform(jax.random.key(width + 1), x.shape) < 0.4, -jnp.inf, x)
        x = x.at[0, 0].set(-jnp.inf).at[0, 1, width - 1].set(jnp.nan)
        want = jnp.argmax(x, axis=-1).at[0, 1].set(width)           # a NaN row: no entry equals its maximum
        got = jax.jit(rollout.first_argmax, static_argnums=1)(x, lanes)
        defined = np.ones(want.shape, bool)
        defined[0, 1] = lanes                                       # the NaN row: in lanes only
        np.testing.assert_array_equal(np.asarray(got)[defined], np.asarray(want)[defined])
        assert got.dtype == jnp.int32
        flags = x > 2
        want_first = jnp.where(flags.any(-1), jnp.argmax(flags, axis=-1), width)
        np.testing.assert_array_equal(jax.jit(rollout.first_true, static_argnums=1)(flags, lanes), want_first)
    for op, plain in ((jnp.maximum, jnp.max), (jnp.minimum, jnp.min)):
        x = jax.random.normal(jax.random.key(0), (5, 101))
        np.testing.assert_array_equal(lane_reductions.lane_reduce(x, op), plain(x, axis=-1, keepdims=True))
    assert lane_reductions.reduces_in_lanes(101, lanes) == lanes and not lane_reductions.reduces_in_lanes(31, lanes)


def test_greedy_rollout_without_log_likelihood_decodes_the_same_tours():
    """``log_likelihood=False`` skips only the log-softmax: same actions and costs; refused for sampling."""
    cfg = small_config("mvmoe")
    params, inst = perturbed_params(cfg), mixed_batch(4)
    policy = Policy(cfg, CPU)
    run = jax.jit(lambda p, i, ll: rollout.rollout(policy, p, i, pomo_size=N, log_likelihood=ll),
                  static_argnums=2)
    full, fast = run(params, inst, True), run(params, inst, False)
    np.testing.assert_array_equal(full.actions, fast.actions)
    np.testing.assert_array_equal(full.cost, fast.cost)
    assert np.all(np.asarray(full.log_likelihood)[np.asarray(full.valid)] < 0)
    assert np.all(np.asarray(fast.log_likelihood) == 0)
    with pytest.raises(ValueError, match="sampling needs the log-probabilities"):
        rollout.rollout(policy, params, inst, pomo_size=N, decode_type="sampling", log_likelihood=False)


def test_bounded_softmax_equals_the_softmax_also_when_a_bound_fails(monkeypatch):
    """``attention_from_bounded_scores`` with any upper bound up to ~46 above each row's maximum gives
    ``attention_from_scores``'s output; so it does when one row's bound lies so far above its scores that its
    exponentials underflow, by the fallback branch, which then calls for the scores a second time."""
    rng = np.random.default_rng(17)
    b, h, m, n, d = 2, 4, 6, 9, 5
    score = jnp.asarray(rng.standard_normal((b, h, m, n)) * 5, jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32)
    mask = jnp.asarray(rng.random((b, m, n)) < 0.6).at[:, :, 0].set(True)
    row_max = jnp.max(jnp.where(mask[:, None], score, -jnp.inf), axis=-1, keepdims=True)
    bound = row_max + jnp.asarray(rng.uniform(0, 40, row_max.shape), jnp.float32)
    want = attention_engines.attention_from_scores(score, v, mask, CPU)
    def bounded(s, v, bound):               # traced anew at each call
        return jax.jit(lambda s, v, bound: attention_engines.attention_from_bounded_scores(
            lambda: s, v, mask, bound, CPU))(s, v, bound)

    np.testing.assert_allclose(bounded(score, v, bound), want, rtol=2e-5, atol=2e-6)

    loose = bound.at[1, 2, 3, 0].add(100.0)              # batch 1, head 2, query 3: e^-100 underflows
    got = bounded(score, v, loose)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    # Without the fallback that row would be NaN (0 / 0): what the branch repairs.
    monkeypatch.setattr(jax.lax, "switch", lambda index, branches, *operands: branches[0](*operands))
    assert np.all(np.isnan(np.asarray(bounded(score, v, loose)[1, 3, 2 * d:3 * d])))


@pytest.mark.parametrize("model", ["pomo_mtl", "mvmoe"])
def test_score_bound_bounds_every_score_of_a_step(model):
    """``query_tables.score_bound`` is at least every node's attention score in the query fusion's form
    (``node_scores[current] + sum_f dynamic_f feature_scores[f]``), for dynamic features of either sign, and
    the row's maximum itself when the dynamic features are zero."""
    cfg = small_config(model)
    params = perturbed_params(cfg, seed=4)
    inst = mixed_batch(8, seed=5)
    policy = Policy(cfg, CPU)
    emb, _ = rollout.encode_nodes(policy, params, inst, jax.random.key(0))
    cache = policy.apply(params, emb, method=Policy.precompute)
    current = jax.random.randint(jax.random.key(1), (8, N), 0, N + 1)
    dynamic = jax.random.normal(jax.random.key(2), (8, N, 4)) * 2
    bound = query_tables.score_bound(cache, current, dynamic)                                   # (B, H, P, 1)
    nodes = N + 1                                                   # the tables' padding columns left out
    rows = jax.vmap(lambda table, cur: table[:, cur, :nodes])(cache.node_scores, current)        # (B, H, P, N)
    scores = rows + jnp.einsum("bpf,bhfn->bhpn", dynamic, cache.feature_scores[..., :nodes])
    top = jnp.max(scores, axis=-1, keepdims=True)
    assert bound.shape == top.shape
    assert np.all(np.asarray(bound) >= np.asarray(top) - 1e-4)
    # Without dynamic features the bound is the row's maximum itself.
    tight = query_tables.score_bound(cache, current, jnp.zeros_like(dynamic))
    np.testing.assert_allclose(tight, jnp.max(rows, axis=-1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("model", ["pomo_mtl", "mvmoe_light"])
def test_rollouts_with_failing_score_bounds_decode_as_without_them(monkeypatch, model):
    """Greedy and sampled rollouts decode the same tours with the softmax score bounds as without, also when
    every bound fails (each raised by 200, so that every exponential underflows and every step takes the
    fallback)."""
    cfg = small_config(model)
    params, inst = perturbed_params(cfg, seed=8), mixed_batch(8, seed=6)
    # 8 instances at once: the CPU preset (score_bound_instances = 1) would not use the bounds.
    policy = Policy(cfg, CPU.replace(score_bound_instances=1000))

    def run(drop_bounds, decode_type):
        def go(p, i):
            cache, aux = rollout.encode(policy, p, i, jax.random.key(2))
            assert cache.node_score_max is not None
            if drop_bounds:
                cache = cache.replace(node_score_max=None, feature_score_range=None)
            return rollout.rollout(policy, p, i, pomo_size=N, decode_type=decode_type, rng=jax.random.key(2),
                                   encoded=(cache, aux))
        return jax.jit(go)(params, inst)

    for decode_type in ("greedy", "sampling"):
        exact, bounded = run(True, decode_type), run(False, decode_type)
        score_bound = query_tables.score_bound
        monkeypatch.setattr(query_tables, "score_bound", lambda *args: score_bound(*args) + 200.0)
        failing = run(False, decode_type)
        monkeypatch.setattr(query_tables, "score_bound", score_bound)
        for out in (bounded, failing):
            np.testing.assert_array_equal(out.actions, exact.actions)
            np.testing.assert_allclose(out.cost, exact.cost, rtol=1e-6)
            np.testing.assert_allclose(out.log_likelihood, exact.log_likelihood, rtol=1e-4, atol=1e-4)


def test_score_bounds_are_the_cpu_presets_for_single_instances():
    """The CPU preset offsets the softmax by the score bounds one instance at a time (``score_bound_instances``
    1), the others never; a forward step over more instances than the field takes the maximum (its program
    has no fallback branch)."""
    assert CPU.score_bound_instances == 1
    assert execution.gpu().score_bound_instances == 0 and execution.reference().score_bound_instances == 0
    cfg = small_config("pomo_mtl")
    params, inst = perturbed_params(cfg), mixed_batch(4)
    policy = Policy(cfg, CPU)

    def has_branch(instances):
        """Whether encoding ``instances`` instances and their first decoding step (traced only) has a branch."""
        def first_step(p, part):
            states, _, _ = rollout.initial_states(part, N)
            cache = policy.apply(p, rollout.encode_nodes(policy, p, part, jax.random.key(0))[0],
                                 method=Policy.precompute)
            return policy.apply(p, cache, states.current, rollout.dynamic_features(states),
                                env.batch_action_mask(states), method=Policy.decode)

        return "cond[" in str(jax.make_jaxpr(first_step)(params, jax.tree.map(lambda x: x[:instances], inst)))

    assert has_branch(1) and not has_branch(2)


@pytest.mark.parametrize("nodes,maps,padded", [(51, (1,), 64), (51, (4,), 52), (51, (1, 4), 64), (21, (5,), 32),
                                               (64, (1,), 64)])
def test_readout_padding_makes_16_column_products(nodes, maps, padded):
    """The fused readout's node axis padded to the presets' ``readout_column_multiple`` (16 columns per
    product); the reference's multiple 1 leaves it as it is."""
    assert CPU.readout_column_multiple == execution.gpu().readout_column_multiple == 16
    assert readout_engines.padded_readout_nodes(nodes, maps, 16) == padded
    assert readout_engines.padded_readout_nodes(nodes, maps, execution.reference().readout_column_multiple) == nodes


def test_readout_product_gradients_equal_autodiff():
    """The fused readout's hand-written backward pass (the input's cotangent against a transposed readout)
    gives autodiff's gradients of the plain product."""
    readout_product = readout_engines.readout_product
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)
    readout = jnp.asarray(rng.standard_normal((3, 16, 24)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((3, 5, 24)), jnp.float32)

    def loss(product):
        return lambda a, b: jnp.sum(jnp.sin(product(a, b)) * weights)

    plain = lambda a, b: jnp.einsum("bpd,bdx->bpx", a, b)
    np.testing.assert_allclose(readout_product(x, readout), plain(x, readout), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(loss(readout_product), argnums=(0, 1)))(x, readout)
    want = jax.grad(loss(plain), argnums=(0, 1))(x, readout)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("against_transposes", [True, False])
def test_attention_gradients_equal_autodiff_either_way_of_writing_the_products(against_transposes):
    """The attention's hand-written backward pass (plan field ``attention_vjp``) gives autodiff's gradients of
    plain masked softmax attention, with its key and value products written against explicit transposes or
    left to XLA as transposed-operand products (``products_against_transposes``, chosen by the CPU)."""
    plan = execution.reference().replace(attention_vjp=True, products_against_transposes=against_transposes)
    rng = np.random.default_rng(5)
    b, h, m, n, d = 2, 3, 5, 7, 4
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, h, m, d), (b, h, n, d), (b, h, n, d)))
    mask = jnp.asarray(rng.random((b, m, n)) < 0.7).at[:, :, 0].set(True)   # every query sees a node
    weights = jnp.asarray(rng.standard_normal((b, m, h * d)), jnp.float32)

    def plain(q, k, v):
        score = jnp.einsum("bhmd,bhnd->bhmn", q, k) / jnp.sqrt(jnp.float32(d))
        score = jnp.where(mask[:, None], score, -jnp.inf)
        return attention.merge_heads(jnp.einsum("bhmn,bhnd->bhmd", jax.nn.softmax(score, axis=-1), v))

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * weights)

    ours = lambda q, k, v: attention.multi_head_attention(q, k, v, mask, plan=plan)
    np.testing.assert_allclose(ours(q, k, v), plain(q, k, v), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalise_after", [True, False])
def test_attention_outside_training_equals_plain_attention_either_way(normalise_after):
    """``multi_head_attention(..., differentiable=False)`` (the encoder outside training mode) gives plain
    masked softmax attention whether it normalises after the value product or before it (plan field
    ``normalise_after_product``), with a mask or without, and so does the differentiable form; the
    non-differentiable form's autodiff gradient is the plain attention's too."""
    plan = CPU.replace(normalise_after_product=normalise_after)
    rng = np.random.default_rng(7)
    b, h, m, n, d = 3, 4, 6, 9, 8
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) * 3
               for shape in ((b, h, m, d), (b, h, n, d), (b, h, n, d)))
    mask = jnp.asarray(rng.random((b, m, n)) < 0.5).at[:, :, 2].set(True)

    def plain(q, mask):
        score = jnp.einsum("bhmd,bhnd->bhmn", q, k) / jnp.sqrt(jnp.float32(d))
        if mask is not None:
            score = jnp.where(mask[:, None], score, -jnp.inf)
        return attention.merge_heads(jnp.einsum("bhmn,bhnd->bhmd", jax.nn.softmax(score, axis=-1), v))

    for given_mask in (mask, None):
        for differentiable in (False, True):
            got = jax.jit(lambda q: attention.multi_head_attention(q, k, v, given_mask, plan=plan,
                                                                   differentiable=differentiable))(q)
            assert got.shape == (b, m, h * d)
            np.testing.assert_allclose(got, plain(q, given_mask), rtol=1e-5, atol=1e-5)
    weights = jnp.asarray(rng.standard_normal((b, m, h * d)), jnp.float32)
    got = jax.grad(lambda q: jnp.sum(attention.multi_head_attention(q, k, v, mask, plan=plan, differentiable=False)
                                     * weights))(q)
    want = jax.grad(lambda q: jnp.sum(plain(q, mask) * weights))(q)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_attention_value_is_the_same_under_a_gradient_in_a_batched_map():
    """``multi_head_attention`` inside ``jax.lax.map(..., batch_size=...)`` with its keys and values closed
    over (training's replay of the decoder) has the same value under ``jax.value_and_grad`` as without a
    gradient, under the CPU preset (the written backward pass, ``attention_vjp``). JAX's vmap of a custom-vjp
    call takes the outputs' batch axis from the primal function and reads the forward rule's outputs at that
    axis when the call is differentiated later; a primal whose batched output lands on another axis than the
    rule's (a primal normalising after the value product: axis 0 against 2) scrambles the values, silently
    where the shapes agree (as here: 4 instances, a map batch of 4)."""
    rng = np.random.default_rng(3)
    t, b, h, m, n, d = 8, 4, 2, 4, 6, 8
    qs = jnp.asarray(rng.standard_normal((t, b, h, m, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32)
    masks = jnp.asarray(rng.random((t, b, m, n)) < 0.7).at[..., 0].set(True)
    weights = jnp.asarray(rng.standard_normal((t, b, m, h * d)), jnp.float32)

    def loss(k):
        out = jax.lax.map(lambda a: attention.multi_head_attention(a[0], k, v, a[1], plan=CPU), (qs, masks),
                          batch_size=4)
        return jnp.sum(out * weights)

    value, grad = jax.jit(jax.value_and_grad(loss))(k)
    np.testing.assert_allclose(value, jax.jit(loss)(k), rtol=1e-5)

    # Value and gradient are the plain attention's too.
    def plain_loss(k):
        score = jnp.einsum("tbhmd,bhnd->tbhmn", qs, k) / jnp.sqrt(jnp.float32(d))
        score = jnp.where(masks[:, :, None], score, -jnp.inf)
        out = jnp.einsum("tbhmn,bhnd->tbhmd", jax.nn.softmax(score, axis=-1), v)
        return jnp.sum(jnp.moveaxis(out, 2, 3).reshape(t, b, m, h * d) * weights)

    np.testing.assert_allclose(value, plain_loss(k), rtol=1e-5)
    np.testing.assert_allclose(grad, jax.grad(plain_loss)(k), rtol=1e-4, atol=1e-4)


def test_attention_normalises_after_its_value_product_in_the_cpu_preset():
    assert CPU.normalise_after_product
    assert not execution.gpu().normalise_after_product and not execution.reference().normalise_after_product


def test_training_mode_encoder_keeps_the_differentiable_attention():
    """The encoder in training mode runs the differentiable attention whatever the plan's
    ``normalise_after_product`` says (training's sampling pass must compute what its backward pass
    recomputes, bit for bit: see ``engines.attention.attention_normalised_after_product``), and outside
    training mode the form the plan chooses."""
    cfg = small_config("mvmoe")
    params, inst = perturbed_params(cfg), mixed_batch(8)
    encoded = {}
    for train in (True, False):
        for normalise_after in (True, False):
            policy = Policy(cfg, CPU.replace(normalise_after_product=normalise_after))
            encoded[train, normalise_after] = np.asarray(policy.apply(
                params, inst, train, method=Policy.encode, rngs={"gating": jax.random.key(0)})[0])
    np.testing.assert_array_equal(encoded[True, True], encoded[True, False])
    np.testing.assert_allclose(encoded[False, True], encoded[False, False], rtol=1e-4, atol=1e-4)
    assert not np.array_equal(encoded[False, True], encoded[False, False])


def test_attention_from_scores_merges_heads_the_same_either_way():
    """The decoder's head merge by concatenated slices (plan field ``merge_heads_by_slices``, chosen on a
    CPU) builds the very array the transpose does, and the attention from given scores is bitwise the same
    either way, weights included; both equal plain masked softmax attention."""
    rng = np.random.default_rng(11)
    b, h, m, n, d = 2, 4, 6, 9, 5
    x = jnp.asarray(rng.standard_normal((b, h, m, d)), jnp.float32)
    np.testing.assert_array_equal(attention_engines.merge_heads_by_slices(x), attention.merge_heads(x))
    assert attention_engines.merge_heads_by_slices(x).shape == (b, m, h * d)

    score = jnp.asarray(rng.standard_normal((b, h, m, n)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32)
    mask = jnp.asarray(rng.random((b, m, n)) < 0.6).at[:, :, 0].set(True)
    results = {}
    for by_slices in (True, False):
        plan = execution.reference().replace(merge_heads_by_slices=by_slices)
        results[by_slices] = jax.jit(lambda s, v: attention_engines.attention_from_scores(s, v, mask, plan, True))(
            score, v)
    (out, weights), (other_out, other_weights) = results[True], results[False]
    np.testing.assert_array_equal(out, other_out)
    np.testing.assert_array_equal(weights, other_weights)
    plain = jax.nn.softmax(jnp.where(mask[:, None], score, -jnp.inf), axis=-1)
    np.testing.assert_allclose(out, attention.merge_heads(jnp.einsum("bhmn,bhnd->bhmd", plain, v)),
                               rtol=1e-5, atol=1e-5)


def test_heads_merge_by_slices_in_the_cpu_preset():
    assert CPU.merge_heads_by_slices
    assert not execution.gpu().merge_heads_by_slices and not execution.reference().merge_heads_by_slices


@pytest.mark.parametrize("avx512", [True, False])
def test_recorded_weights_keys_major_where_transposed_operand_products_are_left_to_xla(avx512):
    """The CPU preset keeps the record's softmax weights keys-major exactly where the backward's products with a
    transposed operand are left to XLA (AVX-512 CPUs; with AVX2 it writes them against explicit transposes);
    the GPU preset writes them against transposes and keeps the weights queries-major.
    ``attention_from_scores(..., with_weights=True)`` returns the weights in the plan's layout, the same
    weights either way."""
    plan = execution.cpu(avx512=avx512)
    assert plan.keys_major_weights is avx512 and plan.products_against_transposes is (not avx512)
    gpu = execution.gpu()
    assert gpu.products_against_transposes and not gpu.keys_major_weights
    against_transposes = plan.products_against_transposes
    rng = np.random.default_rng(17)
    b, h, m, n, d = 2, 3, 4, 6, 5
    score = jnp.asarray(rng.standard_normal((b, h, m, n)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, h, n, d)), jnp.float32)
    mask = jnp.asarray(rng.random((b, m, n)) < 0.6).at[:, :, 0].set(True)
    _, kept = attention_engines.attention_from_scores(score, v, mask, plan, with_weights=True)
    assert kept.shape == ((b, h, m, n) if against_transposes else (b, h, n, m))
    plain = jax.nn.softmax(jnp.where(mask[:, None], score, -jnp.inf), axis=-1)
    np.testing.assert_allclose(attention_engines.kept_layout(kept, plan), plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("keys_major", [True, False])
@pytest.mark.parametrize("from_output", [True, False])
def test_attention_given_weights_gradients_equal_autodiff(from_output, keys_major):
    """The backward pass of the attention whose weights and output are given (training's decoding steps)
    gives autodiff's gradients of plain masked softmax attention, with the softmax backward's row sums
    taken from the recorded output and its cotangent (plan field ``row_sums_from_output``,
    ``engines.attention.output_row_sums``) or from the weights, the weights given keys-major or queries-major
    (``keys_major_weights``)."""
    plan = CPU.replace(row_sums_from_output=from_output, keys_major_weights=keys_major)
    rng = np.random.default_rng(13)
    b, h, m, n, d = 2, 4, 5, 7, 3
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, h, m, d), (b, h, n, d), (b, h, n, d)))
    mask = jnp.asarray(rng.random((b, m, n)) < 0.6).at[:, :, 0].set(True)
    cotangent_weights = jnp.asarray(rng.standard_normal((b, m, h * d)), jnp.float32)

    def plain(q, k, v):
        score = jnp.einsum("bhmd,bhnd->bhmn", q, k) / jnp.sqrt(jnp.float32(d))
        return jax.nn.softmax(jnp.where(mask[:, None], score, -jnp.inf), axis=-1)

    weights = plain(q, k, v)
    out = attention.merge_heads(jnp.einsum("bhmn,bhnd->bhmd", weights, v))
    kept = attention_engines.kept_layout(weights, plan)
    assert kept.shape == ((b, h, n, m) if keys_major else (b, h, m, n))
    np.testing.assert_array_equal(attention_engines.kept_layout(kept, plan), weights)
    given = lambda q, k, v: attention_engines.attention_with_given_weights(q, k, v, kept, out, plan)
    reference = lambda q, k, v: attention.merge_heads(jnp.einsum("bhmn,bhnd->bhmd", plain(q, k, v), v))
    loss = lambda fn: (lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * cotangent_weights))
    got = jax.jit(jax.grad(loss(given), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    # The row sums from the output are the weights' own.
    g_split = attention.split_heads(jnp.cos(out) * cotangent_weights, h)
    d_weights = jnp.einsum("bhmd,bhnd->bhmn", g_split, v)
    np.testing.assert_allclose(attention_engines.output_row_sums(jnp.cos(out) * cotangent_weights, out, h),
                               jnp.sum(d_weights * weights, axis=-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_query_table_width_rounds_up_to_the_multiple():
    """The CPU preset pads the tables to a multiple of 8 columns up to 128 columns; the other presets leave
    them as they are; without a cap (``query_table_max_columns`` 0) the multiple applies at every size."""
    sizes = (21, 51, 101, 104, 121, 128, 129, 201)
    assert tuple(query_tables.query_table_width(n, CPU) for n in sizes) == (24, 56, 104, 104, 128, 128, 129, 201)
    for plan in (execution.gpu(), execution.reference()):
        assert tuple(query_tables.query_table_width(n, plan) for n in sizes) == sizes
    uncapped = CPU.replace(query_table_multiple=16, query_table_max_columns=0)
    assert (query_tables.query_table_width(101, uncapped), query_tables.query_table_width(201, uncapped)) == (112, 208)
    with pytest.raises(ValueError, match="query_table_multiple"):
        CPU.replace(query_table_multiple=0)


@pytest.mark.parametrize("model", MODELS)
def test_padded_query_tables_decode_as_unpadded(model):
    """The forward-only cache's score tables and values widened to 24 columns (21 nodes; masked padding; plan
    field ``query_table_multiple`` 8 against 1) give the log-probabilities and greedy choices of the N-wide
    ones (to float32 rounding: the row sums and value products add the same terms in another order), with
    the softmax offset by the score bounds and by the maximum (``score_bound_instances`` 1000 and 0); a step
    that keeps its record takes N-wide scores from the padded tables and records the same weights bitwise;
    training's tables stay N wide."""
    cfg = small_config(model)
    params = perturbed_params(cfg, seed=6)
    inst = mixed_batch(8, seed=3)
    policy = Policy(cfg, CPU)
    states, mask, dyn = states_two_moves_in(inst)
    emb, _ = rollout.encode_nodes(policy, params, inst, jax.random.key(0))

    def cache_with(multiple):
        return Policy(cfg, CPU.replace(query_table_multiple=multiple)).apply(params, emb, method=Policy.precompute)

    plain, padded = cache_with(1), cache_with(8)
    assert plain.padded_values is None and plain.node_scores.shape[-1] == N + 1
    assert padded.node_scores.shape[-1] == padded.feature_scores.shape[-1] == padded.padded_values.shape[-2] == 24
    np.testing.assert_array_equal(padded.padded_values[..., :N + 1, :], plain.values)
    assert not np.any(np.asarray(padded.padded_values[..., N + 1:, :]))
    np.testing.assert_array_equal(padded.node_scores[..., :N + 1], plain.node_scores)
    training_tables = policy.apply(params, plain, method=Policy.with_query_scores)
    assert training_tables.padded_values is None and training_tables.node_scores.shape[-1] == N + 1

    def decode(cache, *flags, policy=policy):
        return policy.apply(params, cache, states.current, dyn, mask, None, False, *flags, method=Policy.decode,
                            rngs={"gating": jax.random.key(3)})

    for bounds in (True, False):
        bounded = Policy(cfg, CPU.replace(score_bound_instances=1000 if bounds else 0))
        got, want = np.asarray(decode(padded, policy=bounded)[0]), np.asarray(decode(plain, policy=bounded)[0])
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=3e-6)
        np.testing.assert_array_equal(rollout.first_argmax(jnp.asarray(got)), rollout.first_argmax(jnp.asarray(want)))
    with_record = [decode(c, True, True) for c in (padded, plain)]
    np.testing.assert_array_equal(with_record[0][0], with_record[1][0])
    np.testing.assert_array_equal(with_record[0][3].attention_weights, with_record[1][3].attention_weights)


@pytest.mark.parametrize("model", MODELS)
def test_first_step_in_the_loop_decodes_as_the_peeled_one(model):
    """A rollout that keeps no record runs its first decoding step inside the loop (MVMoE-L: when given its gate
    probabilities); one that keeps a record peels it off. Both sample the same tours with the same
    log-likelihoods, auxiliary loss and step count."""
    cfg = small_config(model)
    params, inst = perturbed_params(cfg, seed=9), mixed_batch(8, seed=7)
    policy = Policy(cfg, CPU)
    probs = jnp.asarray([0.3, 0.7], jnp.float32) if cfg.hierarchical else None

    def run(record):
        return jax.jit(lambda p, i: rollout.rollout(policy, p, i, pomo_size=N, decode_type="sampling",
                                                    rng=jax.random.key(4), train=True, record=record,
                                                    gate_probs=probs))(params, inst)

    looped, peeled = run(False), run(True)
    np.testing.assert_array_equal(looped.actions, peeled.actions)
    np.testing.assert_array_equal(looped.log_likelihood, peeled.log_likelihood)
    np.testing.assert_array_equal(looped.cost, peeled.cost)
    assert int(looped.num_steps) == int(peeled.num_steps)
    assert float(looped.aux_loss) == pytest.approx(float(peeled.aux_loss), rel=1e-6, abs=1e-9)


def test_cache_without_query_fusion_projects_the_same_attention():
    """``DecoderCache.without_query_fusion`` drops the tables, their bounds and padded values; the attention its
    steps compute by projecting the query (as MVMoE-L's pooled gate does) is the tables' to float32 rounding."""
    cfg = small_config("mvmoe_light")
    params, inst = perturbed_params(cfg, seed=10), mixed_batch(8, seed=8)
    policy = Policy(cfg, CPU)
    states, mask, dyn = states_two_moves_in(inst)
    emb, _ = rollout.encode_nodes(policy, params, inst, jax.random.key(0))
    fused = policy.apply(params, emb, method=Policy.precompute)
    projected = fused.without_query_fusion()
    assert fused.node_scores is not None
    assert all(getattr(projected, f) is None for f in ("node_scores", "feature_scores", "node_score_max",
                                                      "feature_score_range", "padded_values"))
    attn = [policy.apply(params, c, states.current, dyn, mask, method=Policy.decoder_attention)
            for c in (fused, projected)]
    np.testing.assert_allclose(attn[1], attn[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["mvmoe", "mvmoe_light"])
def test_readout_maps_mixed_elementwise_give_the_products_log_probabilities(model):
    """The gated readout's per-map scores mixed by a written-out sum (plan field ``mix_maps_elementwise``) give
    the log-probabilities of the (1 x M) @ (M x N) product, two steps into a rollout with varied routing."""
    cfg = small_config(model)
    params = perturbed_params(cfg)
    inst = mixed_batch(8)
    policy = Policy(cfg, CPU)
    states, mask, dyn = states_two_moves_in(inst)
    emb, _ = rollout.encode_nodes(policy, params, inst, jax.random.key(0))
    cache = policy.apply(params, emb, method=Policy.precompute)
    outs = []
    for elementwise in (True, False):
        mixed = Policy(cfg, CPU.replace(mix_maps_elementwise=elementwise))
        outs.append(np.asarray(mixed.apply(params, cache, states.current, dyn, mask, None, False,
                                           method=Policy.decode, rngs={"gating": jax.random.key(3)})[0]))
    finite = np.isfinite(outs[1])
    assert finite.sum() > finite.size // 4
    np.testing.assert_array_equal(np.isfinite(outs[0]), finite)
    np.testing.assert_allclose(outs[0][finite], outs[1][finite], rtol=1e-6, atol=1e-6)


def test_readout_maps_mixed_elementwise_in_the_cpu_preset_outside_training_only():
    """The CPU preset mixes the maps elementwise, the others by the product; in training mode the field
    changes nothing: a training step's program is the same with it on and off."""
    assert CPU.mix_maps_elementwise
    assert not execution.gpu().mix_maps_elementwise and not execution.reference().mix_maps_elementwise
    cfg = small_config("mvmoe")
    params, inst = perturbed_params(cfg), mixed_batch(4)

    def step(elementwise, train):
        """The program (traced only) of encoding and a first decoding step."""
        policy = Policy(cfg, CPU.replace(mix_maps_elementwise=elementwise))

        def first_step(p):
            states, _, _ = rollout.initial_states(inst, N)
            emb, _ = rollout.encode_nodes(policy, p, inst, jax.random.key(0), train)
            cache = policy.apply(p, emb, not train, method=Policy.precompute)
            return policy.apply(p, cache, states.current, rollout.dynamic_features(states),
                                env.batch_action_mask(states), None, train, method=Policy.decode,
                                rngs={"gating": jax.random.key(3)})

        return str(jax.make_jaxpr(first_step)(params))

    assert step(True, True) == step(False, True)
    assert step(True, False) != step(False, False)
