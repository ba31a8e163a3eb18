"""Parity of the environment with the PyTorch reference and with the paper's reference solutions."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mvmoe_jax import checker, env, io, problems


def _replay_masks(inst, actions):
    def body(state, a):
        return env.step(state, a), env.action_mask(state)

    final, masks = jax.lax.scan(body, env.reset(inst), actions)
    return masks, final.cost, final.finished


_replay_batch = jax.jit(jax.vmap(_replay_masks))


@pytest.mark.parametrize("variant", problems.VARIANT_NAMES)
def test_trace_parity(torch_fixtures, variant):
    """Replaying the reference's recorded actions gives its feasibility mask at every step and its cost."""
    var = problems.get_variant(variant)
    batch = io.load_paper_instances(torch_fixtures / "data" / var.name / f"{var.lower}20_uniform.pkl", var)
    trace = np.load(torch_fixtures / "traces" / f"{var.lower}20_trace.npz")
    masks, cost, finished = jax.device_get(_replay_batch(batch, jnp.asarray(trace["actions"])))
    mismatch = np.argwhere(masks != trace["feasible"])
    assert mismatch.size == 0, f"{variant}: first mask mismatch (instance, step, node) = {mismatch[0]}"
    assert finished.all()
    np.testing.assert_allclose(cost, trace["cost"], rtol=1e-5)


def test_public_contract_single_instance(torch_fixtures):
    """The documented one-instance API: reset / action_mask / step / done / cost."""
    batch = io.load_paper_instances(torch_fixtures / "data/VRPBLTW/vrpbltw20_uniform.pkl", "VRPBLTW")
    trace = np.load(torch_fixtures / "traces/vrpbltw20_trace.npz")
    i = 3
    inst = jax.tree.map(lambda x: x[i], batch)
    s = env.reset(inst)
    for t, a in enumerate(trace["actions"][i]):
        m = env.action_mask(s)
        assert m.shape == (21,)
        np.testing.assert_array_equal(np.asarray(m), trace["feasible"][i, t])
        s = env.step(s, a)
    assert bool(env.done(s))
    np.testing.assert_allclose(float(env.cost(s)), trace["cost"][i], rtol=1e-5)


def test_batched_form_matches_single(torch_fixtures):
    """batch_reset / batch_step / batch_action_mask on a (batch, pomo) grid equal the per-trajectory API."""
    batch = io.load_paper_instances(torch_fixtures / "data/OVRPLTW/ovrpltw20_uniform.pkl", "OVRPLTW",
                                    num_instances=4)
    trace = np.load(torch_fixtures / "traces/ovrpltw20_trace.npz")
    actions = jnp.asarray(trace["actions"][:4])          # (4, T); use the same route for 2 POMO copies
    states = env.batch_reset(batch, 2)
    step = jax.jit(env.batch_step)
    mask = jax.jit(env.batch_action_mask)
    for t in range(actions.shape[1]):
        m = np.asarray(mask(states))
        assert m.shape == (4, 2, 21)
        np.testing.assert_array_equal(m[:, 0], trace["feasible"][:4, t])
        np.testing.assert_array_equal(m[:, 1], trace["feasible"][:4, t])
        states = step(states, jnp.stack([actions[:, t]] * 2, axis=1))
    np.testing.assert_allclose(np.asarray(states.cost)[:, 0], trace["cost"][:4], rtol=1e-5)
    assert np.asarray(states.finished).all()


def _reference_files(paper_dir):
    for var in problems.VARIANTS:
        for size in (50, 100):
            data = paper_dir / var.name / f"{var.lower}{size}_uniform.pkl"
            if data.exists():
                for sol in sorted((paper_dir / var.name).glob(f"*_{var.lower}{size}_uniform.pkl")):
                    yield var, data, sol


def test_every_paper_solution_cost_reproduced(paper_dir):
    """All 1,000 routes of every stored reference solution: recomputed cost equals the stored cost."""
    checked = 0
    for var, data, sol in _reference_files(paper_dir):
        inst = io.load_paper_instances(data, var)
        stored, routes = io.load_paper_solutions(sol)
        results = checker.check_routes(inst, routes)
        ours = np.array([r.cost for r in results])
        np.testing.assert_allclose(ours, stored, rtol=1e-5, err_msg=sol.name)
        checked += len(results)
    assert checked >= 60_000, f"only {checked} reference routes found"


# Infeasible routes among the first 200 at n = 50, for the solver the paper computes gaps against
# (shared/data/mvmoe-paper/README.md): the backhaul variants' OR-Tools routes solve a looser problem.
EXPECTED_INFEASIBLE_N50 = {"CVRP": 0, "OVRP": 0, "VRPL": 0, "OVRPTW": 0, "OVRPL": 0, "VRPLTW": 0,
                           "OVRPLTW": 0, "VRPTW": 6, "VRPB": 108, "VRPBL": 113, "OVRPB": 162,
                           "OVRPBL": 166, "VRPBTW": 199, "OVRPBTW": 198, "VRPBLTW": 198, "OVRPBLTW": 199}


def test_reference_feasibility_counts_n50(paper_dir):
    counts = {}
    reasons = collections.Counter()
    for var in problems.VARIANTS:
        inst = io.load_paper_instances(io.dataset_path(paper_dir, var, 50), var, num_instances=200)
        _, routes = io.load_paper_solutions(io.reference_solution_path(paper_dir, var, 50), num_instances=200)
        results = checker.check_routes(inst, routes)
        counts[var.name] = sum(not r.feasible for r in results)
        reasons.update(r.violation for r in results if not r.feasible)
    assert counts == EXPECTED_INFEASIBLE_N50
    # Backhaul routes fail because they start with a backhaul or overload on pickup, never for other rules.
    assert set(reasons) <= {"backhaul_overload", "time_window", "depot_closing"}
