"""scripts/gpu_train.sh: a run under a wall-clock budget, exported as flat files and continued from them."""

import json
import os
import pathlib
import subprocess

import pytest

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
