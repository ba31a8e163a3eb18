"""train.py killed with SIGKILL while it writes a checkpoint, then started again with the same command,
ends with exactly the parameters of a run that was never interrupted."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from conftest import REPO_ROOT
from mvmoe_jax import checkpoints
from test_train_cli import TINY_FLAGS

RUN_FLAGS = ["--config.epochs=4", "--config.train_episodes=16", "--config.batch_size=8",
             "--config.validation_instances=8", "--config.validation_batch_size=8", "--config.validate_every_epochs=2",
             "--config.progress_bar=False", "--config.execution.cpu_devices=1", *TINY_FLAGS]


def _command(workdir):
    return [sys.executable, "train.py", "--config=configs/demo.py", f"--config.workdir={workdir}", *RUN_FLAGS]


def _run(workdir):
    proc = subprocess.run(_command(workdir), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _entries(folder) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _kill_when(workdir, reached, timeout: float = 600) -> None:
    """Start the run and SIGKILL it the moment ``reached(names in <workdir>/checkpoints)`` holds."""
    proc = subprocess.Popen(_command(workdir), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = os.path.join(workdir, "checkpoints")
    t0 = time.monotonic()
    try:
        while not (os.path.isdir(folder) and reached(_entries(folder))):
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() - t0 < timeout, "the run never reached the point to kill it at"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)


def test_runs_killed_while_checkpointing_resume_to_the_same_parameters(tmp_path):
    straight = tmp_path / "straight"
    _run(straight)

    killed = tmp_path / "killed"
    # Killed before its first checkpoint, then the moment the second one's folder appears (orbax writes
    # into a temporary folder that it renames when complete); each time the same command goes on from the
    # last complete checkpoint.
    _kill_when(killed, lambda names: True)
    _kill_when(killed, lambda names: any(n.startswith("2") for n in names))
    assert any(n.startswith("2") for n in _entries(killed / "checkpoints"))
    out = _run(killed)
    assert "resuming" in out

    _, want = checkpoints.load_policy(str(straight))
    _, got = checkpoints.load_policy(str(killed))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(b), np.asarray(a)), want, got)
    epochs = [line.split("/")[0] for line in out.splitlines() if line.startswith("epoch ")]
    assert epochs[-1] == "epoch 4"
