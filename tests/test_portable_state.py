"""A run carried between machines as flat files continues exactly; a wall-clock budget ends a run cleanly."""

import json
import os

import jax
import numpy as np
import pytest

from mvmoe_jax import checkpoints, portable_state, training_loop, training_validation
from test_training import tiny_config


def _epochs(workdir):
    return [r["epoch"] for r in training_validation.read_metrics(os.path.join(workdir, "metrics.jsonl"))]


def test_an_exported_run_continues_exactly_where_it_is_imported(tmp_path):
    original = tiny_config(tmp_path / "original", stop_after_epoch=2)
    training_loop.train_and_evaluate(original)

    whole = portable_state.export_state(original.workdir, str(tmp_path / "whole"), max_file_bytes=2**30)
    assert len([f for f in whole if f.endswith(".npz")]) == 1
    leaves = json.loads((tmp_path / "whole" / portable_state.META_FILE).read_text())["leaves"]
    limit = max(int(np.prod(r["shape"])) * np.dtype(r["dtype"]).itemsize for r in leaves)    # the largest leaf
    files = portable_state.export_state(original.workdir, str(tmp_path / "carried"), max_file_bytes=limit)
    npz = [f for f in files if f.endswith(".npz")]
    assert len(npz) > 1 and all(os.path.getsize(f) <= limit + 4096 for f in npz)   # + the zip headers
    assert portable_state.import_state(str(tmp_path / "carried"), str(tmp_path / "moved")) == 2

    moved = tiny_config(tmp_path / "moved", stop_after_epoch=0)
    original.stop_after_epoch = 0
    training_loop.train_and_evaluate(original)
    last = training_loop.train_and_evaluate(moved)
    assert last["epoch"] == 4 and _epochs(moved.workdir) == [0, 1, 2, 3, 4]     # the curve travels too
    _, p1 = checkpoints.load_policy(original.workdir)
    _, p2 = checkpoints.load_policy(moved.workdir)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), p1, p2)


def test_import_refuses_a_used_workdir_and_damaged_files(tmp_path):
    run = tiny_config(tmp_path / "run", epochs=1)
    training_loop.train_and_evaluate(run)
    out = tmp_path / "carried"
    portable_state.export_state(run.workdir, str(out))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        portable_state.import_state(str(out), run.workdir)
    meta = json.loads((out / portable_state.META_FILE).read_text())
    meta["leaves"][0]["path"] = "['params']['no_such_layer']"
    (out / portable_state.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="structure"):
        portable_state.import_state(str(out), str(tmp_path / "other"))
    (out / portable_state.META_FILE).write_text("{")
    with pytest.raises(ValueError, match="no readable exported training state"):
        portable_state.import_state(str(out), str(tmp_path / "other2"))
    assert portable_state.main(["import", str(out), str(tmp_path / "other3")]) == 2


def test_a_time_limit_ends_the_run_after_an_epoch_with_its_checkpoint(tmp_path, capsys):
    run = tiny_config(tmp_path / "budget", time_limit_seconds=1e-3)
    last = training_loop.train_and_evaluate(run)
    assert last["epoch"] == 1 and _epochs(run.workdir) == [0, 1]
    with training_loop.checkpoint_manager(run.workdir) as mngr:
        assert mngr.latest_step() == 1
    assert "time_limit_seconds" in capsys.readouterr().out
