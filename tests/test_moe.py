"""Tests of mvmoe_jax.nn.moe against hand computations and numpy re-computations of the reference
(RoyalSkye/Routing-MVMoE models/MOELayer.py) semantics, and of its faster executions against the dense one:
the MoE layer attributes that the execution plan's MoE fields set (``moe_dispatch``, ``grouped_min_assignments``,
``grouped_by_expert``, ``moe_sort_groups``, ``grouped_blocks_as_one_product``, ``gates_by_rank``; engines in
mvmoe_jax/engines/grouped_experts.py and gates_by_rank.py), and the presets' values of those fields."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mvmoe_jax import execution
from mvmoe_jax.engines import grouped_experts as G
from mvmoe_jax.engines.gates_by_rank import gates_by_rank
from mvmoe_jax.nn import moe as M
from mvmoe_jax.nn.policy import moe_execution

EPS64 = float(np.finfo(np.float64).eps)


# --------------------------------------------------------------------------------------------------
# numpy helpers: independent re-computations of the reference semantics (float64)
# --------------------------------------------------------------------------------------------------


def np_softmax(z, axis=-1):
    z = np.asarray(z, np.float64)
    z = z - z.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def np_cv2(v):
    v = np.asarray(v, np.float64)
    if v.shape[0] == 1:
        return 0.0
    return v.var(ddof=1) / (v.mean() ** 2 + 1e-10)


def np_top_k(logits, k):
    """Descending top-k, ties to the lower index (as jax.lax.top_k)."""
    idx = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(logits, idx, -1), idx


def np_experts(params, x):
    """Stacked Flax-layout expert params, x (N, d) -> (E, N, o) in float64."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    if "experts_w1" in p:
        h = np.maximum(np.einsum("nd,edh->enh", x, p["experts_w1"]) + p["experts_b1"][:, None], 0)
        return np.einsum("enh,eho->eno", h, p["experts_w2"]) + p["experts_b2"][:, None]
    return np.einsum("nd,edo->eno", x, p["experts_w"]) + p["experts_b"][:, None]


def np_reference_token_choice(x_units, gate_in, params, k, temperature=1.0, loss_coef=1e-3):
    """Evaluation-mode noisy top-k MoE as the reference runs it: per-expert sub-batches combined in
    expert-index order, zeros replaced by eps. x_units (U, R, d), gate_in (U, d) -> (U, R, o), loss."""
    x_units = np.asarray(x_units, np.float64)
    logits = np.asarray(gate_in, np.float64) @ np.asarray(params["w_gate"], np.float64)
    top, idx = np_top_k(logits, k)
    g = np_softmax(top / temperature)
    gates = np.zeros_like(logits)
    np.put_along_axis(gates, idx, g, -1)
    u, r, d = x_units.shape
    out = np_experts(params, x_units.reshape(-1, d)).reshape(gates.shape[1], u, r, -1)
    y = np.zeros(out.shape[1:])
    for e in range(gates.shape[1]):
        sel = gates[:, e] > 0
        y[sel] += gates[sel, e][:, None, None] * out[e, sel]
    y[y == 0] = EPS64
    loss = (np_cv2(gates.sum(0)) + np_cv2((gates > 0).sum(0))) * loss_coef
    return y, loss, gates


def init_moe(module, x, seed=0, gate_scale=0.5):
    """Random Flax-layout parameters made in numpy. (``module.init`` compiles the PRNG for every new
    shape, slow on a small CPU; the real init is checked in ``test_init_parameter_tree``.)"""
    d, e, o, h = x.shape[-1], module.num_experts, module.output_dim, module.hidden_dim
    rng = np.random.default_rng(seed)

    def r(*shape, scale):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    cols = e * (module.slots_per_expert if module.routing == "soft" else 1)
    params = {"w_gate": r(d, cols, scale=gate_scale), "w_noise": r(d, e, scale=0.3)}
    if module.expert_type == "mlp":
        params.update(experts_w1=r(e, d, h, scale=d**-0.5), experts_b1=r(e, h, scale=0.1),
                      experts_w2=r(e, h, o, scale=h**-0.5), experts_b2=r(e, o, scale=0.1))
    else:
        params.update(experts_w=r(e, d, o, scale=d**-0.5), experts_b=r(e, o, scale=0.1))
    return params


def abstract_init(module, x, train=False):
    """Parameter shapes without running (and compiling) the initialisers."""
    kwargs = {} if train is None else {"train": train}
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), x, **kwargs))["params"]


def random_like(shape_tree, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda leaf: (scale * rng.standard_normal(leaf.shape)).astype(np.float32), shape_tree)


def apply_moe(module, params, x, train=False, seed=None, intermediates=False):
    """Eager apply: op-by-op compilations are cached per shape and shared by all configurations."""
    rngs = {} if seed is None else {"gating": jax.random.PRNGKey(seed)}
    if intermediates:
        (y, aux), state = module.apply({"params": params}, x, train=train, rngs=rngs, mutable=["intermediates"])
        return np.asarray(y), float(aux), jax.tree_util.tree_map(int, state["intermediates"])
    y, aux = module.apply({"params": params}, x, train=train, rngs=rngs)
    return np.asarray(y), float(aux)


def rand_x(shape, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# --------------------------------------------------------------------------------------------------
# gating math
# --------------------------------------------------------------------------------------------------


def test_cv_squared_by_hand():
    assert float(M.cv_squared(jnp.array([1.0, 2.0, 3.0]))) == pytest.approx(1.0 / (4.0 + 1e-10), rel=1e-6)
    assert float(M.cv_squared(jnp.array([5.0]))) == 0.0  # one expert: no imbalance
    assert float(M.cv_squared(jnp.zeros(4))) == 0.0


def test_top_k_gates_tiny_example():
    logits = jnp.array([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    gates, idx, top_gate, top_values = M.top_k_gates(logits, k=2)
    s = 1.0 / (1.0 + math.e)
    np.testing.assert_array_equal(idx, [[1, 2], [2, 3], [0, 1]])  # ties -> lower index first
    np.testing.assert_allclose(top_gate, [[1 - s, s], [0.5, 0.5], [0.5, 0.5]], rtol=1e-6)
    np.testing.assert_allclose(gates, [[0, 1 - s, s, 0], [0, 0, 0.5, 0.5], [0.5, 0.5, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(top_values, [[3, 2, 1], [5, 5, 0], [0, 0, 0]])  # k+1 values kept
    np.testing.assert_allclose(gates.sum(-1), 1.0, rtol=1e-6)
    # Temperature divides the kept logits before the softmax.
    _, _, tg, _ = M.top_k_gates(logits[:1], k=2, temperature=0.5)
    np.testing.assert_allclose(tg, [np_softmax(np.array([6.0, 4.0]))], rtol=1e-6)


@pytest.mark.parametrize("num_experts,k,temperature", [(4, 2, 1.0), (4, 1, 1.0), (8, 2, 0.5), (3, 2, 2.0)])
def test_gates_by_rank_equal_the_top_k_gates(num_experts, k, temperature):
    """The elementwise gates choose the same experts as ``top_k_gates`` (ties: lower index first) with the same
    values, to the last bit of the exponential."""
    x = jax.random.normal(jax.random.key(0), (400, num_experts)) * 3
    x = x.at[:60].set(jnp.round(x[:60]) + 0.0)         # many exact ties
    x = x.at[60].set(0.0)                              # a row of equal values
    want = np.asarray(jax.jit(lambda x: M.top_k_gates(x, k, temperature)[0])(x))
    got = np.asarray(jax.jit(lambda x: gates_by_rank(x, k, temperature))(x))
    np.testing.assert_array_equal(got > 0, want > 0)
    assert ((got > 0).sum(-1) == k).all()
    np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)
    np.testing.assert_array_equal(np.asarray(M.top_k_gates(x, k, temperature, by_rank=True)[0]), got)


def test_gates_by_rank_refuse_more_than_two_experts_and_are_the_cpus_choice_outside_training():
    """The engine refuses k > 2; the CPU preset asks for it (``gates_by_rank``), the others do not; a layer
    given it computes its gates by rank outside training mode only, and for k <= 2 only (top-3 runs the
    one-hot product instead of refusing)."""
    with pytest.raises(ValueError, match="top-1 and top-2"):
        gates_by_rank(jnp.zeros((2, 4)), 3)
    assert execution.cpu().gates_by_rank
    assert not execution.gpu().gates_by_rank and not execution.reference().gates_by_rank
    x = rand_x((3, 4, 8), seed=22)
    kwargs = dict(output_dim=5, expert_type="linear")
    params = init_moe(M.MoE(**kwargs), x, gate_scale=1.0)

    def program(by_rank, train, k=2):
        layer = M.MoE(**kwargs, k=k, gates_by_rank=by_rank)
        return str(jax.make_jaxpr(lambda p: layer.apply({"params": p}, x, train=train, gates_only=True,
                                                        rngs={"gating": jax.random.key(0)}))(params))

    assert program(True, False) != program(False, False)
    assert program(True, True) == program(False, True)
    assert program(True, False, k=3) == program(False, False, k=3)
    by_rank, one_hot = (np.asarray(M.MoE(**kwargs, gates_by_rank=b).apply({"params": params}, x, train=False,
                                                                          gates_only=True)[0]) for b in (True, False))
    np.testing.assert_allclose(by_rank, one_hot, rtol=3e-7, atol=0)


@pytest.mark.parametrize("num_experts,m", [(4, 3), (4, 2), (8, 3), (3, 3)])
def test_small_top_k_equals_lax_top_k_with_ties_and_gradients(num_experts, m):
    """The argmax passes give lax.top_k's values, indices (ties: lower index first) and gradients."""
    x = jax.random.normal(jax.random.key(0), (300, num_experts))
    # Many exact ties (+ 0.0 turns -0.0 into 0.0: lax.top_k orders -0.0 below 0.0, argmax calls them equal).
    x = x.at[:40].set(jnp.round(x[:40]) + 0.0)
    x = x.at[40].set(0.0)                              # a row of equal values
    values, indices = M.small_top_k(x, m)
    want_v, want_i = jax.lax.top_k(x, m)
    np.testing.assert_array_equal(values, want_v)
    np.testing.assert_array_equal(indices, want_i)
    w = jax.random.normal(jax.random.key(1), (300, m))
    got_g = jax.grad(lambda x: jnp.sum(M.small_top_k(x, m)[0] * w))(x)
    want_g = jax.grad(lambda x: jnp.sum(jax.lax.top_k(x, m)[0] * w))(x)
    np.testing.assert_array_equal(got_g, want_g)


def test_moe_tiny_known_weights_output_and_loss():
    """Linear experts that output the constant j: y = sum_j gate_j * j, checked by hand."""
    moe = M.MoE(output_dim=3, num_experts=4, k=2, expert_type="linear")
    x = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    params = {
        "w_gate": np.array([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.0]], np.float32),
        "w_noise": np.zeros((2, 4), np.float32),
        "experts_w": np.zeros((4, 2, 3), np.float32),
        "experts_b": np.repeat(np.arange(4, dtype=np.float32)[:, None], 3, axis=1),
    }
    y, aux = apply_moe(moe, params, x)
    g = math.e / (1 + math.e)  # softmax of logits one apart
    expected = np.array([1 * g + 2 * (1 - g), 2 * g + 3 * (1 - g)])
    np.testing.assert_allclose(y, np.repeat(expected[:, None], 3, 1), rtol=1e-6)
    importance = np.array([0.0, g, (1 - g) + g, 1 - g])
    load = np.array([0.0, 1.0, 2.0, 1.0])
    assert aux == pytest.approx(1e-3 * (np_cv2(importance) + np_cv2(load)), rel=1e-5)


def _np_noisy_gating(x, w_gate, w_noise, noise, k):
    clean = x @ w_gate
    std = np.log1p(np.exp(x @ w_noise)) + 1e-2
    noisy = clean + noise * std
    top, idx = np_top_k(noisy, min(k + 1, w_gate.shape[1]))
    gates = np.zeros_like(noisy)
    np.put_along_axis(gates, idx[:, :k], np_softmax(top[:, :k]), -1)
    phi = np.vectorize(lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2))))
    thr_in, thr_out = top[:, k : k + 1], top[:, k - 1 : k]
    prob = np.where(noisy > thr_in, phi((clean - thr_in) / std), phi((clean - thr_out) / std))
    load = prob.sum(0)
    return gates, load, 1e-3 * (np_cv2(gates.sum(0)) + np_cv2(load))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_noisy_gating_loss_matches_numpy(k):
    rng = np.random.default_rng(k)
    x, w_gate, w_noise = rng.standard_normal((7, 5)), rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    noise = rng.standard_normal((7, 4))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    gates, idx, top_gate, aux, load = M.noisy_top_k_gating(f32(x), f32(w_gate), f32(w_noise), f32(noise), k)
    ref_gates, ref_load, ref_aux = _np_noisy_gating(x, w_gate, w_noise, noise, k)
    np.testing.assert_allclose(gates, ref_gates, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(load, ref_load, rtol=1e-4, atol=1e-5)
    assert float(aux) == pytest.approx(ref_aux, rel=1e-4)
    # Without noise the load is the count of positive gates.
    gates0, _, _, aux0, load0 = M.noisy_top_k_gating(f32(x), f32(w_gate), f32(w_noise), None, k)
    np.testing.assert_array_equal(load0, (np.asarray(gates0) > 0).sum(0))
    assert float(aux0) == pytest.approx(1e-3 * (np_cv2(np.asarray(gates0).sum(0)) + np_cv2(load0)), rel=1e-5)


def test_load_is_count_when_k_equals_num_experts():
    x, w = jnp.ones((3, 2)), jnp.ones((2, 2))
    _, _, _, _, load = M.noisy_top_k_gating(x, w, w, jnp.ones((3, 2)), k=2)
    np.testing.assert_array_equal(load, [3.0, 3.0])


# --------------------------------------------------------------------------------------------------
# node / instance / problem levels against numpy
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expert_type", ["mlp", "linear"])
def test_node_level_matches_reference_recomputation(expert_type):
    x = rand_x((3, 4, 8))
    moe = M.MoE(output_dim=5, hidden_dim=12, expert_type=expert_type)
    params = init_moe(moe, x, gate_scale=1.0)
    y, aux = apply_moe(moe, params, x)
    units = np.asarray(x, np.float64).reshape(-1, 1, 8)
    ref_y, ref_loss, _ = np_reference_token_choice(units, units[:, 0], params, k=2)
    np.testing.assert_allclose(y, ref_y.reshape(3, 4, 5), rtol=2e-5, atol=2e-6)
    assert aux == pytest.approx(ref_loss, rel=1e-4)


def test_instance_level_routes_whole_instances():
    x = rand_x((3, 4, 8), seed=2)
    moe = M.MoE(output_dim=5, hidden_dim=12, level="instance")
    params = init_moe(moe, x, gate_scale=1.0)
    y, aux = apply_moe(moe, params, x)
    xn = np.asarray(x, np.float64)
    ref_y, ref_loss, gates = np_reference_token_choice(xn, xn.mean(1), params, k=2)
    np.testing.assert_allclose(y, ref_y, rtol=2e-5, atol=2e-6)
    assert aux == pytest.approx(ref_loss, rel=1e-4)
    assert gates.shape == (3, 4)  # one decision per instance


@pytest.mark.parametrize("dispatch", ["dense", "sparse"])
def test_problem_level_matches_numpy(dispatch):
    x = rand_x((3, 4, 8), seed=3)
    moe = M.MoE(output_dim=5, hidden_dim=12, level="problem", dispatch=dispatch)
    params = init_moe(moe, x)
    y, aux = apply_moe(moe, params, x, train=True, seed=0)  # no noise, no loss at problem level
    xn = np.asarray(x, np.float64)
    logits = xn.mean(0).mean(0) @ params["w_gate"]
    top, idx = np_top_k(logits, 2)
    out = np_experts(params, xn.reshape(-1, 8))
    ref = np.einsum("k,kno->no", np_softmax(top), out[idx]).reshape(3, 4, 5)
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-6)
    assert aux == 0.0


def test_two_dimensional_inputs():
    x = rand_x((6, 8), seed=4)
    for level in ["node", "instance", "problem"]:
        moe = M.MoE(output_dim=5, hidden_dim=12, level=level)
        params = init_moe(moe, x, gate_scale=1.0)
        y, _ = apply_moe(moe, params, x)
        assert y.shape == (6, 5)
        y3, _ = apply_moe(moe, params, x[None])
        np.testing.assert_allclose(y, y3[0], rtol=1e-6)  # (tokens, d) is one instance


# --------------------------------------------------------------------------------------------------
# capacity and sparse execution
# --------------------------------------------------------------------------------------------------


def test_assign_slots_priority_and_capacity():
    # Four units all want expert 0 first; their second choices are experts 1, 1, 2, 2.
    top_idx = jnp.array([[0, 1], [0, 1], [0, 2], [0, 2]])
    active = jnp.ones((4, 2), bool).at[1, 1].set(False)  # a zero gate takes no slot
    slot, keep = M.assign_slots(top_idx, active, num_experts=4, capacity=2)
    np.testing.assert_array_equal(slot[:, 0], [0, 1, 2, 3])  # first choices first, in unit order
    np.testing.assert_array_equal(slot[[0, 2, 3], 1], [0, 0, 1])  # then second choices
    np.testing.assert_array_equal(keep, [[True, True], [True, False], [False, True], [False, True]])


def _congested_moe_params():
    """Four tokens; every token's first choice is expert 0, second choices: 1, 1, 2, 2."""
    w_gate = np.zeros((4, 4), np.float32)
    w_gate[:, 0] = 5.0
    w_gate[[0, 1], 1] = 2.0
    w_gate[[2, 3], 2] = 2.0
    rng = np.random.default_rng(0)
    return {
        "w_gate": w_gate,
        "w_noise": np.zeros((4, 4), np.float32),
        "experts_w": rng.standard_normal((4, 4, 3)).astype(np.float32),
        "experts_b": rng.standard_normal((4, 3)).astype(np.float32),
    }


@pytest.mark.parametrize("dispatch", ["sparse", "einsum"])
def test_capacity_drops_exactly_the_expected_tokens(dispatch):
    x = jnp.eye(4)  # token t activates gate row t
    params = _congested_moe_params()
    kwargs = dict(output_dim=3, expert_type="linear", zero_output_eps=False)
    dense = M.MoE(**kwargs)
    # capacity = ceil(1.0 * 4 tokens * k=2 / 4 experts) = 2: expert 0 keeps tokens 0 and 1 only.
    sparse = M.MoE(**kwargs, dispatch=dispatch, capacity_factor=1.0)
    y_dense, aux_dense = apply_moe(dense, params, x)
    y_sparse, aux_sparse, stats = apply_moe(sparse, params, x, intermediates=True)
    assert stats == {"dropped_assignments": (2,), "dropped_tokens": (0,)}
    np.testing.assert_allclose(y_sparse[:2], y_dense[:2], rtol=1e-6)  # untouched tokens
    gates, _, _, _ = M.top_k_gates(x @ params["w_gate"], 2)
    out = np_experts(params, np.eye(4))  # (E, 4, 3)
    expected = np.asarray(gates)[2:, 2:3] * out[2, 2:]  # tokens 2, 3 keep only expert 2's share
    np.testing.assert_allclose(y_sparse[2:], expected, rtol=1e-5)
    assert aux_sparse == aux_dense  # the loss is computed before dispatch

    # k = 1: tokens 2 and 3 lose their only expert and get exactly zero.
    k1 = M.MoE(**kwargs, k=1, dispatch=dispatch, capacity_factor=2.0)  # capacity ceil(2*4/4) = 2
    y1, _, stats1 = apply_moe(k1, params, x, intermediates=True)
    assert stats1 == {"dropped_assignments": (2,), "dropped_tokens": (2,)}
    np.testing.assert_array_equal(y1[2:], 0.0)
    np.testing.assert_allclose(y1[:2], out[0, :2], rtol=1e-5)
    # With the reference's eps fill, dropped outputs become eps instead of 0.
    y1e, _ = apply_moe(M.MoE(**{**kwargs, "zero_output_eps": True}, k=1, dispatch=dispatch,
                             capacity_factor=2.0), params, x)
    np.testing.assert_array_equal(y1e[2:], np.float32(EPS64))


def test_default_capacity_never_drops_in_eval():
    x = rand_x((3, 4, 4))
    moe = M.MoE(output_dim=3, expert_type="linear", dispatch="sparse")
    params = _congested_moe_params()
    params["w_gate"] = np.tile(params["w_gate"][:1], (4, 1))  # everyone wants expert 0 then 1
    _, _, stats = apply_moe(moe, params, x, intermediates=True)
    assert stats == {"dropped_assignments": (0,), "dropped_tokens": (0,)}


def test_dispatch_combine_tensors_are_one_hot():
    top_idx = jnp.array([[0, 1], [0, 2], [0, 1]])
    gates = jnp.array([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]])
    slot, keep = M.assign_slots(top_idx, jnp.ones((3, 2), bool), 3, capacity=2)
    dispatch, combine = M.dispatch_combine_tensors(top_idx, slot, keep, gates, 3, 2)
    assert dispatch.shape == combine.shape == (3, 3, 2)
    np.testing.assert_array_equal(dispatch.sum((0,)), [[1, 1], [1, 1], [1, 0]])  # each slot used once
    np.testing.assert_array_equal(dispatch[2, 0], [0, 0])  # third token overflowed expert 0
    np.testing.assert_allclose(combine.sum((1, 2)), [1.0, 1.0, 0.1], rtol=1e-6)


SHAPES = [(3, 4, 8), (2, 5, 8)]  # 2-D inputs: test_two_dimensional_inputs


@pytest.mark.parametrize("routing", ["input_choice", "random", "expert_choice"])
@pytest.mark.parametrize("level", ["node", "instance", "problem"])
def test_sparse_einsum_and_grouped_equal_dense_when_nothing_dropped(routing, level):
    # Two shapes for input choice, one for the others: compilations dominate this file's run time.
    for i, shape in enumerate(SHAPES if routing == "input_choice" else SHAPES[:1]):
        x = rand_x(shape, seed=10 + i)
        outs = {}
        for dispatch in ("dense", "sparse", "einsum", "grouped"):
            moe = M.MoE(output_dim=5, hidden_dim=12, routing=routing, level=level, dispatch=dispatch)
            params = init_moe(moe, x, seed=i, gate_scale=1.0)
            # Training only changes input choice (noise); the same key gives the same noise / choices.
            for train in (False, True) if routing == "input_choice" else (False,):
                outs[dispatch, train] = apply_moe(moe, params, x, train=train, seed=7, intermediates=True)
        for (dispatch, train), (y, aux, stats) in outs.items():
            y_ref, aux_ref, _ = outs["dense", train]
            assert y.shape == shape[:-1] + (5,)
            np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6, err_msg=f"{dispatch} {shape} {train}")
            assert aux == pytest.approx(aux_ref, rel=1e-6)
            assert stats["dropped_assignments"] == (0,)


@pytest.mark.parametrize("num", [1, 127, 128, 300, 13056])
def test_ranks_within_groups_are_a_stable_sorts_places(num):
    """The grouped execution's slots: each element's place within its key's group under a stable sort by key,
    and the group sizes, for lengths inside one tile, at a tile's edge and over many tiles."""
    keys = np.asarray(jax.random.randint(jax.random.key(num), (num,), 0, 5))
    rank, counts = G.ranks_within_groups(jnp.asarray(keys), 5)
    # The FLOP count's sorted form (``blocks_as_one_product``): the same ranks.
    rank_sorted, counts_sorted = G.ranks_within_groups(jnp.asarray(keys), 5, by_sort=True)
    np.testing.assert_array_equal(np.asarray(rank_sorted), np.asarray(rank))
    np.testing.assert_array_equal(np.asarray(counts_sorted), np.asarray(counts))
    order = np.argsort(keys, kind="stable")
    expected = np.empty(num, np.int64)
    start = np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=5))[:-1]])
    expected[order] = np.arange(num) - start[keys[order]]
    np.testing.assert_array_equal(np.asarray(rank), expected)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(keys, minlength=5))


@pytest.mark.parametrize("expert_type", ["mlp", "linear"])
def test_grouped_and_side_by_side_executions_values_and_gradients(expert_type):
    """Hundreds of units over several blocks per expert, some assignments inactive: the grouped execution
    and the side-by-side one (experts concatenated, gates inside the second matmul) give the per-expert
    dense result and the same gradients."""
    rng = np.random.default_rng(5)
    params = {"w1": rng.standard_normal((4, 8, 16)).astype(np.float32) / 3,
              "b1": rng.standard_normal((4, 16)).astype(np.float32),
              "w2": rng.standard_normal((4, 16, 6)).astype(np.float32) / 4,
              "b2": rng.standard_normal((4, 6)).astype(np.float32)}
    if expert_type == "linear":
        params = {"w": params["w1"][..., :6], "b": params["b2"]}
    units = jnp.asarray(rng.standard_normal((300, 1, 8)), jnp.float32)
    index = jnp.asarray(np.stack([rng.permutation(4)[:2] for _ in range(300)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (300, 2)), jnp.float32)
    active = jnp.asarray(rng.uniform(size=(300, 2)) > 0.2)

    def dense(p, x, w=weights):
        out = M.experts_forward(p, x[:, 0], per_expert=False)                      # (E, U, o)
        gates = jnp.einsum("uk,uke->ue", jnp.where(active, w, 0.0), jax.nn.one_hot(index, 4))
        return jnp.einsum("ue,euo->uo", gates, out)[:, None]

    def grouped(p, x, w=weights):
        return G.grouped_experts_forward(p, x, index, w, active, block=32)

    def grouped_by_expert(p, x, w=weights):
        return G.grouped_experts_forward(p, x, index, w, active, block=32, by_expert=True)

    def side_by_side(p, x, w=weights):
        gates = jnp.einsum("uk,uke->ue", jnp.where(active, w, 0.0), jax.nn.one_hot(index, 4))
        return M.gated_experts_forward(p, x[:, 0], gates)[:, None]

    def grouped_in_three_sorts(p, x, w=weights):          # 3 sorts of 100 units
        return G.grouped_experts_forward(p, x, index, w, active, block=32, sort_groups=3)

    # An independent float64 recomputation: sum over experts of gate * expert(x).
    gates64 = np.einsum("uk,uke->ue", np.where(active, weights, 0.0), np.eye(4)[np.asarray(index)])
    expected = np.einsum("ue,euo->uo", gates64, np_experts({f"experts_{k}": v for k, v in params.items()},
                                                           np.asarray(units[:, 0], np.float64)))[:, None]
    # jit: one compilation each, against hundreds of op-by-op ones for the eager gradients. The gradient
    # in the gates too (what the gating learns from), zero for inactive assignments.
    def gradient(forward):
        return jax.jit(jax.grad(lambda p, x, w: jnp.sum(jnp.sin(forward(p, x, w))), argnums=(0, 1, 2)))(
            params, units, weights)

    g_dense = gradient(dense)
    assert not np.asarray(g_dense[2])[~np.asarray(active)].any() and np.abs(g_dense[2]).max() > 0
    for forward in (grouped, grouped_by_expert, side_by_side, grouped_in_three_sorts):
        np.testing.assert_allclose(jax.jit(forward)(params, units), expected, rtol=1e-5, atol=1e-5)
        g = gradient(forward)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_dense)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("out_dim", [6, 8])
def test_expert_by_expert_blocks_equal_the_block_by_block_loop_and_its_gradients(out_dim):
    """The same products expert by expert: bitwise the block-by-block outputs up to the last expert's end,
    past it zeros (padding, whose rows carry zero weight) or, computed in place (output width = input
    width, out_dim 8), the inputs unchanged; the same gradients, also through a batched ``lax.map`` (where a
    custom-vjp output's batch axis must be the same in its primal and forward rule)."""
    # Blocks as ``_grouped_experts_forward`` lays them out: 4 experts' consecutive blocks (expert 2 has none),
    # then two blocks past the last expert's end.
    rng = np.random.default_rng(11)
    params = tuple(jnp.asarray(rng.standard_normal(shape) / 3, jnp.float32)
                   for shape in ((4, 8, 24), (4, 24), (4, 24, out_dim), (4, out_dim)))
    block_end = jnp.asarray([2, 5, 5, 7], jnp.int32)
    block_expert = jnp.asarray([0, 0, 1, 1, 1, 3, 3, 3, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((9, 16, 8)), jnp.float32)
    looped = jax.jit(G.mlp_expert_blocks)(*params, x, block_expert)
    by_expert = jax.jit(G.mlp_expert_blocks_by_expert)(*params, x, block_expert, block_end)
    np.testing.assert_array_equal(np.asarray(by_expert[:7]), np.asarray(looped[:7]))
    past_the_end = np.asarray(x[7:]) if out_dim == 8 else np.zeros_like(np.asarray(looped[7:]))
    np.testing.assert_array_equal(np.asarray(by_expert[7:]), past_the_end)
    assert np.asarray(looped[7:]).any()

    # Cotangents only on the run blocks, as the weighting by the gates gives the padding.
    probe = jnp.asarray(np.random.default_rng(2).standard_normal(looped.shape), jnp.float32).at[7:].set(0.0)

    def loss(blocks_fn, *extra):
        return lambda p, xs: jnp.sum(jnp.tanh(blocks_fn(*p, xs, block_expert, *extra)) * probe)

    g_looped = jax.jit(jax.grad(loss(G.mlp_expert_blocks), argnums=(0, 1)))(params, x)
    g_by_expert = jax.jit(jax.grad(loss(G.mlp_expert_blocks_by_expert, block_end), argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree.leaves(g_by_expert), jax.tree.leaves(g_looped)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    # Value and gradient of a loss over four scaled copies of the input, mapped two at a time with the
    # weights closed over (as training's replay maps its steps): the mapped call is staged first and
    # differentiated later.
    scales = jnp.asarray([1.0, -0.5, 2.0, 0.25], jnp.float32)

    def mapped_loss(blocks_fn, *extra):
        def total(p):
            out = jax.lax.map(lambda c: blocks_fn(*p, x * c, block_expert, *extra), scales, batch_size=2)
            return jnp.sum(jnp.tanh(out) * probe)
        return total

    value, grad = jax.jit(jax.value_and_grad(mapped_loss(G.mlp_expert_blocks_by_expert, block_end)))(params)
    np.testing.assert_allclose(value, jax.jit(mapped_loss(G.mlp_expert_blocks_by_expert, block_end))(params),
                               rtol=1e-5)
    value_looped, grad_looped = jax.jit(jax.value_and_grad(mapped_loss(G.mlp_expert_blocks)))(params)
    np.testing.assert_allclose(value, value_looped, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_looped)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_combine_assignments_sums_each_units_weighted_active_slots():
    """Each unit's active assignments, gathered from their slots and weighted, against a float64 loop. An
    inactive assignment's slot may lie out of range (the grouped execution passes the sentinel L) and slots
    no active assignment reads may hold anything, NaN included, without reaching the result."""
    rng = np.random.default_rng(5)
    out = rng.standard_normal((40, 2, 6)).astype(np.float32)
    position = rng.integers(1, 39, (25, 3))                  # active assignments read slots 1..38
    weights = rng.uniform(0.1, 1.0, (25, 3)).astype(np.float32)
    active = rng.uniform(size=(25, 3)) > 0.3
    active[0] = False                                        # a unit with nothing routed: zeros
    position[~active] = 40                                   # the sentinel, out of range (clipped to 39)
    out[[0, 39]] = np.nan                                    # unread slots: padding, blocks past the end
    expected = np.zeros((25, 2, 6))
    for u in range(25):
        for j in range(3):
            if active[u, j]:
                expected[u] += weights[u, j] * out[position[u, j]].astype(np.float64)
    got = np.asarray(jax.jit(G.combine_assignments)(out, position, weights, active))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert not got[0].any()


def test_moe_layer_runs_its_experts_expert_by_expert_outside_training_only():
    """Outside training mode the grouped MoE layer given ``grouped_by_expert`` takes the expert-by-expert loops
    (its program has no block-by-block map), in training mode the block loop; both give the dense layer's
    outputs. The CPU preset asks for it, the others do not."""
    assert execution.cpu().grouped_by_expert
    assert not execution.gpu().grouped_by_expert and not execution.reference().grouped_by_expert
    x = rand_x((1200, 8), seed=41)
    layers = {by_expert: M.MoE(output_dim=5, hidden_dim=12, dispatch="grouped", grouped_by_expert=by_expert)
              for by_expert in (True, False)}
    dense = M.MoE(output_dim=5, hidden_dim=12, dispatch="dense")
    params = init_moe(dense, x, seed=3, gate_scale=1.0)

    def calls(train, by_expert):
        layer = layers[by_expert]
        jaxpr = jax.make_jaxpr(lambda p: layer.apply({"params": p}, x, train,
                                                     rngs={"gating": jax.random.key(0)}))(params)
        return str(jaxpr).count("while[")

    # Expert by expert: a scan over the experts around a loop over each one's blocks; block by block: one scan.
    assert calls(False, True) == 1 and calls(False, False) == 0
    assert calls(True, True) == 0
    y, _ = jax.jit(lambda p: layers[True].apply({"params": p}, x, False))(params)
    y_dense, _ = jax.jit(lambda p: dense.apply({"params": p}, x, False))(params)
    np.testing.assert_allclose(y, y_dense, rtol=1e-5, atol=1e-6)


def test_blocks_as_one_product_counts_every_block_for_the_same_result():
    """XLA's cost analysis counts a loop body once: the grouped blocks' loop shows about one block's
    products; traced as one product (``blocks_as_one_product``, plan field ``grouped_blocks_as_one_product``) it
    shows every block's, and the result is the loop's."""
    rng = np.random.default_rng(7)
    d, h, o, e, block = 32, 64, 32, 4, 32
    params = {"w1": jnp.asarray(rng.standard_normal((e, d, h)), jnp.float32),
              "b1": jnp.asarray(rng.standard_normal((e, h)), jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((e, h, o)), jnp.float32),
              "b2": jnp.asarray(rng.standard_normal((e, o)), jnp.float32)}
    units = jnp.asarray(rng.standard_normal((200, 1, d)), jnp.float32)
    index = jnp.asarray(np.stack([rng.permutation(e)[:2] for _ in range(200)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (200, 2)), jnp.float32)
    active = jnp.ones((200, 2), bool)

    def grouped(p, x, as_one_product=False):
        return G.grouped_experts_forward(p, x, index, weights, active, block=block,
                                         blocks_as_one_product=as_one_product)

    def flops(compiled):
        cost = compiled.cost_analysis()
        return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]

    looped = jax.jit(grouped).lower(params, units).compile()
    counted = jax.jit(lambda p, x: grouped(p, x, as_one_product=True)).lower(params, units).compile()
    num_blocks = -(-(200 * 2 + e * (block - 1)) // block)          # grouped_experts_forward's static count
    block_products = 2 * block * (d * h + h * o)
    assert flops(counted) >= num_blocks * block_products
    assert flops(looped) < num_blocks * block_products / 2
    np.testing.assert_allclose(counted(params, units), looped(params, units), rtol=1e-5, atol=1e-5)


CPU_MIN_ASSIGNMENTS = execution.cpu().grouped_min_assignments


def test_grouped_mlp_dispatch_groups_mlp_experts_in_the_cpu_preset_only():
    """The CPU preset runs only the chosen experts (``grouped_mlp``) where that was measured faster: MLP
    experts, in evaluation and training, from its ``grouped_min_assignments`` (256) assignments per sort group
    on; dense everywhere else, and in the other presets. Other strategies pass through (``grouped`` too is
    dense below the minimum)."""
    cpu, gpu, reference = execution.cpu(), execution.gpu(), execution.reference()
    assert (cpu.moe_dispatch, cpu.grouped_min_assignments) == ("grouped_mlp", 256)
    assert gpu.moe_dispatch == reference.moe_dispatch == "dense"
    big = CPU_MIN_ASSIGNMENTS
    resolve = functools.partial(M.resolve_dispatch, "grouped_mlp", min_assignments=big)
    assert resolve(expert_type="mlp", num_assignments=big) == "grouped"
    assert resolve(expert_type="mlp", num_assignments=big - 1) == "dense"
    assert resolve(expert_type="linear", num_assignments=big) == "dense"
    # The threshold counts the assignments of one sort.
    assert resolve(expert_type="mlp", num_assignments=big, sort_groups=2) == "dense"
    assert resolve(expert_type="mlp", num_assignments=2 * big, sort_groups=2) == "grouped"
    with pytest.raises(ValueError, match="moe_sort_groups"):
        cpu.replace(moe_sort_groups=0)
    for explicit in M.DISPATCHES:
        if explicit != "grouped_mlp":
            assert M.resolve_dispatch(explicit, expert_type="mlp", num_assignments=1) == explicit
    assert M.resolve_dispatch("grouped", expert_type="linear", num_assignments=big, min_assignments=big) == "grouped"
    assert M.resolve_dispatch("grouped", expert_type="mlp", num_assignments=1, min_assignments=big) == "dense"
    assert G.group_block(G.GROUP_BLOCK_SMALL_BELOW - 1) == G.GROUP_BLOCK_SMALL
    assert G.group_block(G.GROUP_BLOCK_SMALL_BELOW) == G.GROUP_BLOCK
    assert G.group_block(G.GROUP_BLOCK_LARGE_FROM - 1) == G.GROUP_BLOCK
    assert G.group_block(G.GROUP_BLOCK_LARGE_FROM) == G.GROUP_BLOCK_LARGE


@pytest.mark.parametrize("tokens, block", [(CPU_MIN_ASSIGNMENTS // 2 + 50, G.GROUP_BLOCK_SMALL),
                                           (G.GROUP_BLOCK_LARGE_FROM // 2 + 50, G.GROUP_BLOCK_LARGE)],
                         ids=["small-blocks", "large-blocks"])
def test_cpu_preset_dispatch_gives_the_dense_result_with_the_grouped_execution(tokens, block):
    """Layers large enough for the CPU preset's MoE attributes (``policy.moe_execution``) to group, in the
    small blocks and in the large ones: the same outputs as dense, and the grouped program is what runs
    (its blocks are a loop; dense has none)."""
    assert G.group_block(2 * tokens) == block                # top-2: two assignments per token
    x = rand_x((tokens, 8), seed=31)
    layers = {"cpu": M.MoE(output_dim=5, hidden_dim=12, **moe_execution(execution.cpu())),
              "dense": M.MoE(output_dim=5, hidden_dim=12, dispatch="dense")}
    params = init_moe(layers["dense"], x, seed=3, gate_scale=1.0)
    y_cpu, aux_cpu = jax.jit(lambda p: layers["cpu"].apply({"params": p}, x, False))(params)
    y_dense, aux_dense = jax.jit(lambda p: layers["dense"].apply({"params": p}, x, False))(params)
    np.testing.assert_allclose(y_cpu, y_dense, rtol=1e-5, atol=1e-6)
    assert float(aux_cpu) == pytest.approx(float(aux_dense), rel=1e-6)

    def has_loop(layer, train):
        jaxpr = jax.make_jaxpr(lambda p: layer.apply({"params": p}, x, train, rngs={"gating": jax.random.key(0)}))
        return "scan" in str(jaxpr(params))

    assert has_loop(layers["cpu"], False) and not has_loop(layers["dense"], False)
    assert has_loop(layers["cpu"], True)              # training groups too


def test_gates_only_returns_the_gate_matrix_the_layer_mixes_with():
    x = rand_x((3, 4, 8), seed=21)
    moe = M.MoE(output_dim=5, expert_type="linear")
    params = init_moe(moe, x, gate_scale=1.0)
    gates, aux = moe.apply({"params": params}, x, train=False, gates_only=True)
    assert gates.shape == (3, 4, 4)
    np.testing.assert_allclose(np.asarray(gates).sum(-1), 1.0, rtol=1e-6)
    assert ((np.asarray(gates) > 0).sum(-1) == 2).all()
    g = np.asarray(gates, np.float64)
    per_expert = (np.einsum("btd,edo->beto", np.asarray(x, np.float64), params["experts_w"])
                  + params["experts_b"][None, :, None])
    y_manual = np.einsum("bte,beto->bto", g, per_expert)
    y, aux_y = apply_moe(moe, params, x)
    np.testing.assert_allclose(y_manual, y, rtol=1e-5, atol=1e-5)
    assert float(aux) == pytest.approx(aux_y)
    with pytest.raises(ValueError, match="gates_only"):
        M.MoE(output_dim=5, hidden_dim=6).apply({"params": init_moe(M.MoE(output_dim=5, hidden_dim=6), x)}, x,
                                               train=False, gates_only=True)


# --------------------------------------------------------------------------------------------------
# expert choice, soft MoE, random routing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", ["experts", "tokens"])
@pytest.mark.parametrize("dispatch", ["dense", "sparse"])
def test_expert_choice_picks_each_experts_top_c(axis, dispatch):
    x = rand_x((3, 4, 8), seed=5)  # 12 tokens; c = int(12 * k=2 / 4) = 6
    moe = M.MoE(output_dim=5, hidden_dim=12, routing="expert_choice", expert_choice_softmax=axis,
                dispatch=dispatch)
    params = init_moe(moe, x, gate_scale=1.0)
    y, aux, stats = apply_moe(moe, params, x, intermediates=True)
    xn = np.asarray(x, np.float64).reshape(-1, 8)
    scores = np_softmax(xn @ params["w_gate"], axis=-1 if axis == "experts" else 0)
    out = np_experts(params, xn)
    ref = np.zeros((12, 5))
    picked = np.zeros(12, bool)
    for e in range(4):
        chosen = np.argsort(-scores[:, e], kind="stable")[:6]
        ref[chosen] += scores[chosen, e][:, None] * out[e, chosen]
        picked[chosen] = True
    np.testing.assert_allclose(y.reshape(12, 5), ref, rtol=2e-5, atol=2e-6)
    assert aux == 0.0
    assert stats["dropped_tokens"] == (int((~picked).sum()),)
    # capacity_factor overrides k as the capacity factor: c = int(12 * 1 / 4) = 3.
    moe3 = M.MoE(output_dim=5, hidden_dim=12, routing="expert_choice", capacity_factor=1.0,
                 expert_choice_softmax=axis, dispatch=dispatch)
    y3, _ = apply_moe(moe3, params, x)
    ref3 = np.zeros((12, 5))
    for e in range(4):
        chosen = np.argsort(-scores[:, e], kind="stable")[:3]
        ref3[chosen] += scores[chosen, e][:, None] * out[e, chosen]
    np.testing.assert_allclose(y3.reshape(12, 5), ref3, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("level", ["node", "instance"])
@pytest.mark.parametrize("slots", [1, 2])
def test_soft_moe_matches_numpy(level, slots):
    x = rand_x((3, 4, 8), seed=6)
    moe = M.MoE(output_dim=5, hidden_dim=12, routing="soft", level=level, slots_per_expert=slots)
    params = init_moe(moe, x)
    assert params["w_gate"].shape == (8, 4 * slots)
    y, aux = apply_moe(moe, params, x)
    xn = np.asarray(x, np.float64)
    units = xn.reshape(12, 1, 8) if level == "node" else xn  # (U, R, d)
    logits = units.mean(1) @ params["w_gate"]
    slot_in = np.einsum("us,urd->srd", np_softmax(logits, 0), units)  # (E*s, R, d)
    slot_out = np.stack([  # expert i on its own slots
        np_experts(params, slot_in[i * slots:(i + 1) * slots].reshape(-1, 8))[i].reshape(slots, units.shape[1], 5)
        for i in range(4)
    ]).reshape(4 * slots, units.shape[1], 5)
    ref = np.einsum("us,sro->uro", np_softmax(logits, -1), slot_out).reshape(3, 4, 5)
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-6)
    assert aux == 0.0


@pytest.mark.parametrize("level", ["node", "instance"])
def test_random_routing(level):
    x = rand_x((3, 4, 8), seed=8)
    moe = M.MoE(output_dim=5, expert_type="linear", routing="random", level=level, zero_output_eps=False)
    params = init_moe(moe, x)
    y_a, aux = apply_moe(moe, params, x, seed=1)
    y_b, _ = apply_moe(moe, params, x, seed=2)
    assert aux == 0.0 and not np.allclose(y_a, y_b)
    # Eval without a 'gating' rng: the documented fixed fallback key, so repeated calls agree.
    np.testing.assert_array_equal(apply_moe(moe, params, x)[0], apply_moe(moe, params, x)[0])
    with pytest.raises(Exception):  # training needs the stream
        apply_moe(moe, params, x, train=True)
    # Each unit is the mean of exactly k = 2 distinct experts' outputs.
    xn = np.asarray(x, np.float64)
    out = np_experts(params, xn.reshape(-1, 8)).reshape(4, 3, 4, 5)
    pair_means = {(a, b): (out[a] + out[b]) / 2 for a in range(4) for b in range(a + 1, 4)}
    for u in range(3):
        toks = [slice(t, t + 1) for t in range(4)] if level == "node" else [slice(0, 4)]
        for t in toks:
            assert any(np.allclose(y_a[u, t], m[u, t], rtol=1e-5, atol=1e-6) for m in pair_means.values())


# --------------------------------------------------------------------------------------------------
# training vs evaluation, jit
# --------------------------------------------------------------------------------------------------


def test_noise_only_in_training():
    x = rand_x((3, 4, 8), seed=9)
    moe = M.MoE(output_dim=5, hidden_dim=12)
    params = init_moe(moe, x, gate_scale=0.3)
    e1, l1 = apply_moe(moe, params, x, seed=1)
    e2, l2 = apply_moe(moe, params, x, seed=2)
    e3, _ = apply_moe(moe, params, x)  # no rng needed in evaluation
    np.testing.assert_array_equal(e1, e2)
    np.testing.assert_array_equal(e1, e3)
    assert l1 == l2
    t1, tl1 = apply_moe(moe, params, x, train=True, seed=1)
    t1b, tl1b = apply_moe(moe, params, x, train=True, seed=1)
    t2, tl2 = apply_moe(moe, params, x, train=True, seed=2)
    np.testing.assert_array_equal(t1, t1b)
    assert tl1 == tl1b
    assert not np.allclose(t1, t2) and tl1 != tl2
    # noisy_gating=False: training is as deterministic as evaluation.
    quiet = M.MoE(output_dim=5, hidden_dim=12, noisy_gating=False)
    np.testing.assert_array_equal(apply_moe(quiet, params, x, train=True, seed=3)[0], e1)
    with pytest.raises(Exception):  # noisy training without the 'gating' stream
        apply_moe(moe, params, x, train=True)


def test_jit_and_grad():
    x = rand_x((2, 5, 8), seed=11)
    moe = M.MoE(output_dim=5, hidden_dim=12, dispatch="sparse", capacity_factor=1.25)
    params = init_moe(moe, x, gate_scale=1.0)

    def loss(p, x, key):
        y, aux = moe.apply({"params": p}, x, train=True, rngs={"gating": key})
        return jnp.mean(y**2) + aux

    key = jax.random.PRNGKey(3)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, x, key)
    assert np.isfinite(float(value))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
    assert np.abs(grads["w_gate"]).sum() > 0 and np.abs(grads["w_noise"]).sum() > 0
    # Same numbers eagerly and compiled.
    np.testing.assert_allclose(float(loss(params, x, key)), float(value), rtol=1e-5)


def test_bfloat16_compute_keeps_float32_params():
    x = rand_x((3, 4, 8), seed=12)
    moe = M.MoE(output_dim=5, hidden_dim=12, dtype=jnp.bfloat16)
    params = init_moe(moe, x, gate_scale=1.0)
    y, aux = moe.apply({"params": params}, x, train=False)
    assert y.dtype == jnp.bfloat16 and aux.dtype == jnp.float32
    y32, aux32 = apply_moe(M.MoE(output_dim=5, hidden_dim=12), params, x)
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=0.05, atol=0.05)
    assert float(aux) == aux32  # gating stays in float32


def test_init_parameter_tree():
    x = rand_x((3, 4, 8), seed=17)
    shapes = lambda tree: jax.tree_util.tree_map(np.shape, tree)  # noqa: E731
    mlp = M.MoE(output_dim=5, hidden_dim=12)
    # An RBG key: initialisers compile much faster than with threefry on CPU.
    params = mlp.init(jax.random.key(0, impl="rbg"), x, train=False)["params"]
    assert shapes(params) == {"w_gate": (8, 4), "w_noise": (8, 4), "experts_w1": (4, 8, 12), "experts_b1": (4, 12),
                              "experts_w2": (4, 12, 5), "experts_b2": (4, 5)}
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
    # Reference init: zero gates for node/instance input choice; experts like torch nn.Linear.
    assert not np.any(params["w_gate"]) and not np.any(params["w_noise"])
    assert np.abs(params["experts_w1"]).max() <= 8**-0.5 and np.abs(params["experts_w2"]).max() <= 12**-0.5
    # All-zero logits tie: top-2 = experts 0 and 1 (lower index first), half each.
    y, aux = apply_moe(mlp, params, x)
    out = np_experts(params, np.asarray(x, np.float64).reshape(-1, 8)).reshape(4, 3, 4, 5)
    np.testing.assert_allclose(y, 0.5 * (out[0] + out[1]), rtol=1e-5, atol=1e-6)
    assert aux == pytest.approx(1e-3 * (np_cv2([6, 6, 0, 0]) + np_cv2([12, 12, 0, 0])), rel=1e-5)
    # Elsewhere the gate gets torch's kaiming_uniform(a=sqrt(5)) with fan-in = #columns.
    linear = M.MoE(output_dim=5, expert_type="linear", level="problem")
    params = linear.init(jax.random.key(1, impl="rbg"), x, train=False)["params"]
    assert shapes(params) == {"w_gate": (8, 4), "w_noise": (8, 4), "experts_w": (4, 8, 5), "experts_b": (4, 5)}
    assert 0 < np.abs(params["w_gate"]).max() <= 4**-0.5
    soft = M.MoE(output_dim=5, expert_type="linear", routing="soft", slots_per_expert=2)
    assert shapes(abstract_init(soft, x))["w_gate"] == (8, 8)  # E * slots columns


def test_invalid_configurations_raise():
    x = rand_x((2, 3, 4))
    for kwargs in [dict(expert_type="mlp"), dict(k=5, expert_type="linear"), dict(routing="nope", hidden_dim=4),
                   dict(routing="soft", level="problem", hidden_dim=4), dict(dispatch="x", hidden_dim=4)]:
        with pytest.raises(ValueError):
            M.MoE(output_dim=3, **kwargs).init(jax.random.PRNGKey(0), x, train=False)


# --------------------------------------------------------------------------------------------------
# MVMoE-L hierarchical gate
# --------------------------------------------------------------------------------------------------


def test_hierarchical_gate_probs_and_sampling():
    x = rand_x((3, 4, 8), seed=13)
    gate = M.HierarchicalGate()
    params = random_like(abstract_init(gate, x, train=None), seed=13)
    assert params["kernel"].shape == (8, 2)
    probs = gate.apply({"params": params}, x)
    ref = np_softmax(np.asarray(x, np.float64).mean(0).mean(0) @ np.asarray(params["kernel"], np.float64))
    np.testing.assert_allclose(probs, ref, rtol=1e-5)
    keys = jax.random.split(jax.random.PRNGKey(1), 4000)
    choices, scales = jax.vmap(lambda k: M.sample_branch(k, probs))(keys)
    assert abs(float(choices.mean()) - float(probs[1])) < 0.03  # frequency follows the probabilities
    np.testing.assert_allclose(scales, np.asarray(probs)[np.asarray(choices)])


def test_dense_or_moe_runs_only_the_sampled_branch():
    x = rand_x((3, 4, 8), seed=14)
    layer = M.DenseOrMoE(output_dim=5)
    params = random_like(abstract_init(layer, x), seed=14)
    assert set(params) == {"dense_or_moe", "multi_head_combine_moe", "multi_head_combine_dense"}
    probs = jnp.asarray(np_softmax(np.asarray(x, np.float64).mean((0, 1)) @ params["dense_or_moe"]["kernel"]),
                        jnp.float32)

    # Unoptimised XLA: this test is about control flow and gradients, and compiles three times.
    @functools.partial(jax.jit, static_argnames="train", compiler_options={"xla_backend_optimization_level": 0})
    def step(p, key, probs=None, train=False):
        """Outputs and parameter gradients of one decoding step, under one compilation."""

        def loss(p):
            (y, aux, p_out), state = layer.apply({"params": p}, x, train=train, probs=probs, key=key,
                                                 rngs={"gating": jax.random.PRNGKey(9)}, mutable=["intermediates"])
            return jnp.sum(y**2) + aux, (y, aux, p_out, state["intermediates"]["branch"][0])

        return jax.grad(loss, has_aux=True)(p)

    moe_y, moe_aux = apply_moe(M.MoE(output_dim=5, expert_type="linear"), params["multi_head_combine_moe"], x)
    dense_p = params["multi_head_combine_dense"]
    dense_y = np.asarray(x) @ np.asarray(dense_p["kernel"]) + np.asarray(dense_p["bias"])
    norm = lambda t: sum(float(jnp.abs(g).sum()) for g in jax.tree_util.tree_leaves(t))  # noqa: E731
    seen = set()
    for seed in range(6):
        key = jax.random.PRNGKey(seed)
        expected_choice = int(M.sample_branch(key, probs)[0])
        grads, (y, aux, p_out, branch) = step(params, key)
        assert int(branch) == expected_choice
        np.testing.assert_allclose(p_out, probs, rtol=1e-6)
        branch_y = moe_y if expected_choice == 1 else dense_y
        np.testing.assert_allclose(y, probs[expected_choice] * branch_y, rtol=1e-5, atol=1e-6)
        assert float(aux) == (pytest.approx(moe_aux) if expected_choice == 1 else 0.0)
        chosen, other = (("multi_head_combine_moe", "multi_head_combine_dense") if expected_choice == 1
                         else ("multi_head_combine_dense", "multi_head_combine_moe"))
        assert norm(grads[chosen]) > 0 and norm(grads[other]) == 0.0
        assert norm(grads["dense_or_moe"]) > 0  # through the probability scaling
        seen.add(expected_choice)
    assert seen == {0, 1}
    # Probabilities passed in (later decoding steps) are reused as they are; the gate is not consulted.
    fixed = jnp.array([0.25, 0.75])
    grads, (y, _, p_out, branch) = step(params, jax.random.PRNGKey(0), fixed)
    np.testing.assert_array_equal(p_out, fixed)
    assert int(branch) == int(M.sample_branch(jax.random.PRNGKey(0), fixed)[0])
    np.testing.assert_allclose(y, fixed[int(branch)] * (moe_y if int(branch) == 1 else dense_y), rtol=1e-5, atol=1e-6)
    assert norm(grads["dense_or_moe"]) == 0.0
    # A real conditional, not a select that computes both branches.
    jaxpr = str(jax.make_jaxpr(lambda p: layer.apply({"params": p}, x, train=False, key=jax.random.PRNGKey(0)))(params))
    assert "cond[" in jaxpr
    # Training: the MoE branch draws its noise from the 'gating' stream inside the conditional.
    grads, (y_t, _, _, _) = step(params, jax.random.PRNGKey(1), train=True)
    assert np.isfinite(np.asarray(y_t)).all()


# --------------------------------------------------------------------------------------------------
# torch state dict import
# --------------------------------------------------------------------------------------------------


def _fake_torch_moe_state(prefix, num_experts, expert_type, d=8, h=12, o=5, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    state = {f"{prefix}.w_gate": r(d, num_experts), f"{prefix}.w_noise": r(d, num_experts),
             f"{prefix}.mean": np.zeros(1, np.float32), f"{prefix}.std": np.ones(1, np.float32)}
    for j in range(num_experts):
        if expert_type == "mlp":
            state.update({f"{prefix}.experts.{j}.fc1.weight": r(h, d), f"{prefix}.experts.{j}.fc1.bias": r(h),
                          f"{prefix}.experts.{j}.fc2.weight": r(o, h), f"{prefix}.experts.{j}.fc2.bias": r(o)})
        else:
            state.update({f"{prefix}.experts.{j}.weight": r(o, d), f"{prefix}.experts.{j}.bias": r(o)})
    return state


def _torch_layout_reference(state, prefix, x, expert_type, k=2):
    """Node-level evaluation computed straight from torch-layout weights (y = x W^T + b)."""
    E = state[f"{prefix}.w_gate"].shape[1]
    if expert_type == "mlp":
        experts = [lambda z, j=j: np.maximum(z @ state[f"{prefix}.experts.{j}.fc1.weight"].T.astype(np.float64)
                                             + state[f"{prefix}.experts.{j}.fc1.bias"], 0)
                   @ state[f"{prefix}.experts.{j}.fc2.weight"].T.astype(np.float64)
                   + state[f"{prefix}.experts.{j}.fc2.bias"] for j in range(E)]
    else:
        experts = [lambda z, j=j: z @ state[f"{prefix}.experts.{j}.weight"].T.astype(np.float64)
                   + state[f"{prefix}.experts.{j}.bias"] for j in range(E)]
    xs = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = xs @ state[f"{prefix}.w_gate"].astype(np.float64)
    top, idx = np_top_k(logits, k)
    gates = np.zeros_like(logits)
    np.put_along_axis(gates, idx, np_softmax(top), -1)
    y = sum(gates[:, j:j + 1] * experts[j](xs) for j in range(E))
    y[y == 0] = EPS64
    return y.reshape(x.shape[:-1] + (-1,))


@pytest.mark.parametrize("expert_type", ["mlp", "linear"])
def test_torch_to_flax_moe(expert_type):
    prefix = "encoder.layers.0.feedForward"
    state = _fake_torch_moe_state(prefix, 4, expert_type)
    params = M.torch_to_flax_moe(state, prefix + ".", 4, expert_type)  # trailing dot optional
    moe = M.MoE(output_dim=5, hidden_dim=12, expert_type=expert_type)
    x = rand_x((3, 4, 8), seed=15)
    init = abstract_init(moe, x)
    assert jax.tree_util.tree_map(np.shape, init) == jax.tree_util.tree_map(np.shape, params)
    y, _ = apply_moe(moe, params, x)
    np.testing.assert_allclose(y, _torch_layout_reference(state, prefix, x, expert_type), rtol=2e-5, atol=1e-5)


def test_torch_to_flax_dense_or_moe_structure():
    state = _fake_torch_moe_state("decoder.multi_head_combine_moe", 4, "linear")
    rng = np.random.default_rng(1)
    state.update({"decoder.dense_or_moe.weight": rng.standard_normal((2, 8)).astype(np.float32),
                  "decoder.multi_head_combine_dense.weight": rng.standard_normal((5, 8)).astype(np.float32),
                  "decoder.multi_head_combine_dense.bias": rng.standard_normal(5).astype(np.float32)})
    params = M.torch_to_flax_dense_or_moe(state, "decoder", 4)
    x = rand_x((2, 5, 8))
    init = abstract_init(M.DenseOrMoE(output_dim=5), x)
    assert jax.tree_util.tree_map(np.shape, init) == jax.tree_util.tree_map(np.shape, params)
    np.testing.assert_array_equal(params["dense_or_moe"]["kernel"], state["decoder.dense_or_moe.weight"].T)


def test_checkpoint_moe_layers_import(torch_fixtures):
    """Real MVMoE / MVMoE-L fixture weights: names and shapes map, and node-level routing with the
    trained gates matches the computation from torch-layout weights."""
    torch = pytest.importorskip("torch")
    for name in ["moe_n20_fixture.pt", "moe_light_n20_fixture.pt"]:
        ckpt = torch.load(torch_fixtures / "checkpoints" / name, map_location="cpu", weights_only=True)
        state = {k: v.numpy() for k, v in ckpt["model_state_dict"].items()}
        prefix = "encoder.layers.0.feedForward"
        params = M.torch_to_flax_moe(state, prefix, 4, "mlp")
        assert params["experts_w1"].shape == (4, 128, 512) and params["experts_w2"].shape == (4, 512, 128)
        x = rand_x((2, 6, 128), seed=16)
        y, _ = apply_moe(M.MoE(output_dim=128, hidden_dim=512), params, x)
        np.testing.assert_allclose(y, _torch_layout_reference(state, prefix, x, "mlp"), rtol=1e-4, atol=1e-4)
        if "light" in name:
            tree = M.torch_to_flax_dense_or_moe(state, "decoder", 4)
            assert tree["dense_or_moe"]["kernel"].shape == (128, 2)
        else:
            dec = M.torch_to_flax_moe(state, "decoder.multi_head_combine", 4, "linear")
            y, _ = apply_moe(M.MoE(output_dim=128, expert_type="linear"), dec, x)
            np.testing.assert_allclose(y, _torch_layout_reference(state, "decoder.multi_head_combine", x, "linear"),
                                       rtol=1e-4, atol=1e-4)
