"""Training on a machine without ../shared: scripts/gpu_train.sh (a run under a wall-clock budget, exported as
flat files and continued from them) and scripts/copy_validation_sets.py (the test sets that travel with it)."""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

from conftest import script_module
from mvmoe_jax.nn.policy import PolicyConfig
from mvmoe_jax.training_validation import Validator

REPO = pathlib.Path(__file__).resolve().parent.parent
SMALL_RUN = ["--config.train_episodes=64", "--config.validate_every_epochs=0"]


def _train(out: pathlib.Path, state: str, tmp_path: pathlib.Path) -> str:
    """One call of the script on the demo config with a 5 s budget (one epoch); its printed output."""
    env = {**os.environ, "DATA_DIR": str(tmp_path / "no-data"),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "compilation-cache")}
    done = subprocess.run(["bash", "scripts/gpu_train.sh", "configs/demo.py", "5", str(out), state, *SMALL_RUN],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_a_budgeted_run_continues_from_its_exported_state(tmp_path):
    first = tmp_path / "first"
    _train(first, "-", tmp_path)
    meta = json.loads((first / "state" / "meta.json").read_text())
    assert meta["train_meta"]["epoch"] == 1
    assert any((tmp_path / "compilation-cache").iterdir()), "compiled programs were not kept for the next call"

    second = tmp_path / "second"
    log = _train(second, str(first / "state"), tmp_path)
    assert "from epoch 1" in log
    meta = json.loads((second / "state" / "meta.json").read_text())
    assert meta["train_meta"]["epoch"] == 2
    epochs = [json.loads(line)["epoch"] for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2]


def _copy_validation_sets(*args):
    return script_module("scripts/copy_validation_sets.py").copy_validation_sets(*args)


def test_copied_validation_sets_are_what_validation_reads(paper_dir, tmp_path):
    copied = _copy_validation_sets(paper_dir, tmp_path / "data", 50, "TRAIN")
    assert len(copied) == 2 * 6   # a test set and its reference solutions per training variant
    kwargs = dict(variants="TRAIN", num_customers=50, pomo_size=50, num_instances=5, batch_size=5,
                  augment=False, seed=0)
    from_copy = Validator(PolicyConfig(), data_dir=str(tmp_path / "data"), **kwargs)
    from_paper = Validator(PolicyConfig(), data_dir=str(paper_dir), **kwargs)
    for name, (instances, reference, source) in from_copy.sets.items():
        assert source.startswith(str(tmp_path)) and reference is not None, name
        paper_instances, paper_reference, _ = from_paper.sets[name]
        np.testing.assert_array_equal(reference, paper_reference)
        np.testing.assert_array_equal(instances.locs, paper_instances.locs)


def test_a_missing_test_set_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="OVRPTW at n = 50"):
        _copy_validation_sets(tmp_path, tmp_path / "data", 50, "OVRPTW")
