"""Import of the original .pt checkpoints, orbax round trips and refusal of checkpoints that do not fit."""

import dataclasses

import jax
import numpy as np
import pytest

from mvmoe_jax import checkpoints, io
from mvmoe_jax.checker import InfeasibleInstanceError, validate_instances
from mvmoe_jax.nn.policy import PolicyConfig
from mvmoe_jax.rollout import greedy_evaluate

EXPECTED = {"mtl": ("pomo_mtl", 1_254_656), "moe": ("mvmoe", 3_682_176), "moe_light": ("mvmoe_light", 3_698_944)}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_import_original_checkpoint(torch_fixtures, name):
    cfg, params = checkpoints.import_torch_checkpoint(torch_fixtures / "checkpoints" / f"{name}_n20_fixture.pt")
    model, count = EXPECTED[name]
    assert cfg.model == model
    # The README's counts include 14 constant MoE buffers (mean/std), which carry no parameters.
    assert sum(x.size for x in jax.tree.leaves(params)) == count
    if model != "pomo_mtl":
        assert cfg.num_experts == 4 and cfg.expert_loc == tuple(f"Enc{i}" for i in range(6)) + ("Dec",)


def test_orbax_round_trip_gives_identical_results(torch_fixtures, tmp_path):
    cfg, params = checkpoints.import_torch_checkpoint(torch_fixtures / "checkpoints/moe_n20_fixture.pt")
    checkpoints.save_policy(tmp_path / "ckpt", params, cfg)
    cfg2, params2 = checkpoints.load_policy(tmp_path / "ckpt")
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    inst = io.load_paper_instances(torch_fixtures / "data/VRPLTW/vrpltw20_uniform.pkl", num_instances=4)
    r1 = greedy_evaluate(cfg, params, inst, jax.random.key(0), pomo_size=20)
    r2 = greedy_evaluate(cfg2, params2, inst, jax.random.key(0), pomo_size=20)
    np.testing.assert_array_equal(np.asarray(r1.obj), np.asarray(r2.obj))


def test_checkpoint_of_another_model_is_refused(torch_fixtures, tmp_path):
    pt = torch_fixtures / "checkpoints/mtl_n20_fixture.pt"
    with pytest.raises(checkpoints.CheckpointMismatchError, match="holds a 'pomo_mtl' model"):
        checkpoints.load_policy(pt, PolicyConfig(model="mvmoe"))
    moe_pt = torch_fixtures / "checkpoints/moe_n20_fixture.pt"
    with pytest.raises(checkpoints.CheckpointMismatchError, match="num_experts: checkpoint 4, config 8"):
        checkpoints.load_policy(moe_pt, PolicyConfig(model="mvmoe", num_experts=8))
    with pytest.raises(checkpoints.CheckpointMismatchError, match="num_layers: checkpoint 6, config 7"):
        checkpoints.load_policy(moe_pt, PolicyConfig(model="mvmoe", num_layers=7))
    cfg, params = checkpoints.import_torch_checkpoint(pt)
    checkpoints.save_policy(tmp_path / "mtl", params, cfg)
    with pytest.raises(checkpoints.CheckpointMismatchError, match="holds a 'pomo_mtl' model"):
        checkpoints.load_policy(tmp_path / "mtl", PolicyConfig(model="mvmoe_light"))
    with pytest.raises(checkpoints.CheckpointMismatchError, match=r"shape mismatches: .*W1/kernel"):
        checkpoints.load_policy(tmp_path / "mtl", dataclasses.replace(cfg, ff_hidden_dim=256))


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoints.load_policy(tmp_path / "nothing.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint steps"):
        checkpoints.load_policy(tmp_path / "empty")


def test_infeasible_instance_is_named(torch_fixtures):
    inst = io.load_paper_instances(torch_fixtures / "data/VRPTW/vrptw20_uniform.pkl", num_instances=3)
    validate_instances(inst)
    # Close customer 5's window of instance 1 before anyone can arrive.
    bad = inst.replace(tw_end=inst.tw_end.at[1, 5].set(0.0), tw_start=inst.tw_start.at[1, 5].set(0.0))
    with pytest.raises(InfeasibleInstanceError, match=r"instance 1: customers \[5\]"):
        validate_instances(bad)
