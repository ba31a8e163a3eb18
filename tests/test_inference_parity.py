"""evaluate.py's path reproduces the PyTorch reference's greedy results on the fixture checkpoints, under the
execution plans of every preset (mvmoe_jax/execution.py)."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import REPO_ROOT, TEST_XLA_FLAGS
from mvmoe_jax import cli, problems
from configs import mvmoe, mvmoe_light, pomo_mtl

CONFIGS = {"mtl": pomo_mtl, "moe": mvmoe, "moe_light": mvmoe_light}

EVALUATION_SCRIPT = r"""
import json, sys, types
from mvmoe_jax import cli
from configs import mvmoe, mvmoe_light, pomo_mtl
config = {"mtl": pomo_mtl, "moe": mvmoe, "moe_light": mvmoe_light}[sys.argv[1]].get_config()
print("RESULT" + json.dumps(cli.run_evaluation(config, types.SimpleNamespace(**json.loads(sys.argv[2])))))
"""


def _evaluate(name, flags):
    """``cli.run_evaluation`` of a fixture model over the fixture datasets, in a process whose XLA code is
    optimised as a user's is (the suite's is not, tests/conftest.py): 1,600 instances x 8 copies compute more than
    they compile."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip())
    proc = subprocess.run([sys.executable, "-c", EVALUATION_SCRIPT, name, json.dumps(vars(flags))], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def _flags(torch_fixtures, name, **kw):
    base = dict(checkpoint=str(torch_fixtures / "checkpoints" / f"{name}_n20_fixture.pt"), problems="ALL",
                data_dir=str(torch_fixtures / "data"), size=20, aug=8, num_instances=None, batch_size=100,
                pomo_size=None, vrplib_dir=None, bks=None, reference=None, seed=11, progress=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture(scope="module")
def evaluations(torch_fixtures):
    """Run each fixture checkpoint over all 16 fixture datasets once per execution preset (shared by the tests
    below)."""
    cache = {}

    def get(name, preset="cpu"):
        if (name, preset) not in cache:
            cache[name, preset] = _evaluate(name, _flags(torch_fixtures, name, execution=preset))
        return cache[name, preset]

    return get


def _assert_per_instance_parity(ours, torch_fixtures, name, label):
    """98% of each variant's objectives (with and without augmentation) within 1e-4 of the reference's
    greedy results for the ``name`` checkpoint, and the means within 5e-4."""
    ref = json.loads((torch_fixtures / "results" / f"{name}.json").read_text())
    assert set(ours) == set(problems.VARIANT_NAMES)
    for variant in problems.VARIANT_NAMES:
        for key, ref_key in (("obj", "aug"), ("obj_no_aug", "no_aug")):
            a, b = np.array(ours[variant][key]), np.array(ref[variant][ref_key])
            close = np.abs(a - b) / b < 1e-4
            assert close.mean() >= 0.98, f"{label} {variant} {key}: {close.mean():.1%} within 1e-4"
            assert abs(a.mean() - b.mean()) / b.mean() < 5e-4, f"{label} {variant} {key} mean"
        assert ours[variant]["gap"] is None            # the fixture datasets have no reference solutions


# The gpu preset runs with the slow tests: on a CPU it is a combination no user runs, and each of its fields is
# checked against the reference in tests/test_execution_plan.py. So does POMO-MTL under the reference plan: its
# model is MVMoE's without the MoE layers, and MVMoE runs that plan in the default suite (and POMO-MTL the cpu one).
@pytest.mark.parametrize("name,preset", [
    ("mtl", "cpu"), pytest.param("mtl", "reference", marks=pytest.mark.slow),
    pytest.param("mtl", "gpu", marks=pytest.mark.slow),
    ("moe", "cpu"), ("moe", "reference"), pytest.param("moe", "gpu", marks=pytest.mark.slow)])
def test_per_instance_parity(torch_fixtures, evaluations, name, preset):
    _assert_per_instance_parity(evaluations(name, preset), torch_fixtures, name, f"{name} ({preset} plan)")


def test_per_instance_parity_with_score_bounds(torch_fixtures):
    """The same with every decoding step's softmax offset by the query fusion's score bounds (the cpu plan
    uses them for chunks of one instance only, and these hold 100)."""
    flags = _flags(torch_fixtures, "moe", execution="cpu", execution_overrides="score_bound_instances=1000")
    _assert_per_instance_parity(_evaluate("moe", flags), torch_fixtures, "moe", "moe with the score bounds")


# The reference plan with the slow tests: MVMoE runs it above, and MVMoE-L's own part, its gate, runs the cpu plan here.
@pytest.mark.parametrize("preset", ["cpu", pytest.param("reference", marks=pytest.mark.slow)])
def test_light_model_means(torch_fixtures, evaluations, preset):
    """MVMoE-L samples its dense-or-sparse gate at every step, in evaluation too: compare means."""
    ours = evaluations("moe_light", preset)
    ref = json.loads((torch_fixtures / "results" / "moe_light.json").read_text())
    for variant in problems.VARIANT_NAMES:
        for key, ref_key in (("obj", "aug"), ("obj_no_aug", "no_aug")):
            a, b = np.mean(ours[variant][key]), np.mean(ref[variant][ref_key])
            assert abs(a - b) / b < 0.01, f"moe_light {variant} {key}: {a:.4f} vs {b:.4f}"


def test_evaluate_py_command_line(torch_fixtures, tmp_path):
    """The documented command line, on two variants and a few instances, writes the JSON contract."""
    out = tmp_path / "results.json"
    cmd = [sys.executable, "evaluate.py", "--config=configs/pomo_mtl.py",
           f"--checkpoint={torch_fixtures / 'checkpoints' / 'mtl_n20_fixture.pt'}", "--problems=CVRP,VRPBLTW",
           f"--data_dir={torch_fixtures / 'data'}", "--size=20", "--aug=8", "--num_instances=10",
           "--batch_size=4", f"--output={out}", "--noprogress"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    ref = json.loads((torch_fixtures / "results" / "mtl.json").read_text())
    assert set(res) == {"CVRP", "VRPBLTW"}
    for v in res:
        assert set(res[v]) >= {"obj", "obj_no_aug", "mean", "gap", "seconds", "compile_seconds"}
        np.testing.assert_allclose(res[v]["obj"], ref[v]["aug"][:10], rtol=1e-4)
        assert res[v]["mean"] == pytest.approx(np.mean(res[v]["obj"]))
    assert "VRPBLTW" in proc.stdout and "gap" in proc.stdout


def test_evaluate_py_refuses_a_checkpoint_of_another_model(torch_fixtures):
    cmd = [sys.executable, "evaluate.py", "--config=configs/mvmoe.py",
           f"--checkpoint={torch_fixtures / 'checkpoints' / 'mtl_n20_fixture.pt'}", "--problems=CVRP",
           f"--data_dir={torch_fixtures / 'data'}", "--size=20", "--noprogress"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "holds a 'pomo_mtl' model" in proc.stderr and "'mvmoe'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_evaluate_py_unknown_variant(torch_fixtures):
    cmd = [sys.executable, "evaluate.py", "--config=configs/pomo_mtl.py",
           f"--checkpoint={torch_fixtures / 'checkpoints' / 'mtl_n20_fixture.pt'}", "--problems=CVRP,VRPZ",
           f"--data_dir={torch_fixtures / 'data'}", "--size=20", "--noprogress"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown VRP variant 'VRPZ'" in proc.stderr


def test_evaluate_py_without_config_uses_the_checkpoints_model(torch_fixtures, tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "evaluate.py", f"--checkpoint={torch_fixtures / 'checkpoints' / 'moe_n20_fixture.pt'}",
           "--problems=OVRPBL", f"--data_dir={torch_fixtures / 'data'}", "--size=20", "--num_instances=6",
           f"--output={out}", "--noprogress"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "model mvmoe" in proc.stdout
    ref = json.loads((torch_fixtures / "results" / "moe.json").read_text())
    np.testing.assert_allclose(json.loads(out.read_text())["OVRPBL"]["obj"], ref["OVRPBL"]["aug"][:6], rtol=1e-4)


def test_reference_file_gaps_and_errors(torch_fixtures, tmp_path):
    from mvmoe_jax import io
    flags = _flags(torch_fixtures, "mtl", problems="CVRP", num_instances=4, batch_size=4)
    ours = cli.run_evaluation(CONFIGS["mtl"].get_config(), flags)["CVRP"]
    ref = tmp_path / "ref.pkl"
    io.save_paper_solutions(ref, [c * 0.9 for c in ours["obj"]], [[1]] * 4)
    flags.reference = str(ref)
    res = cli.run_evaluation(CONFIGS["mtl"].get_config(), flags)["CVRP"]
    assert res["gap"] == pytest.approx(100 * (1 / 0.9 - 1), rel=1e-6)
    io.save_paper_solutions(ref, ours["obj"][:2], [[1]] * 2)
    with pytest.raises(ValueError, match="has 2 solutions for 4 instances"):
        cli.run_evaluation(CONFIGS["mtl"].get_config(), flags)
    flags.reference = str(tmp_path / "missing.pkl")
    with pytest.raises(FileNotFoundError, match="--reference: no solution file"):
        cli.run_evaluation(CONFIGS["mtl"].get_config(), flags)
