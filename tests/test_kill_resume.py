"""train.py killed with SIGKILL while it writes a checkpoint, then started again with the same command,
ends with exactly the parameters of a run that was never interrupted."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO_ROOT
from mvmoe_jax import checkpoints
from mvmoe_jax.training_validation import read_metrics, truncate_metrics
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


class _Crash(Exception):
    """Stands for a kill in the middle of a write."""


def test_a_restart_shortens_the_metrics_whole_or_not_at_all(tmp_path, monkeypatch):
    """A restart drops the metrics records past its checkpoint and a last line cut short by a kill; killed
    while it does so, it leaves the old records whole (the shortened file is renamed over them complete)."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"epoch": e, "loss": e / 3} for e in range(4)]
    before = "".join(json.dumps(r) + "\n" for r in rows) + '{"epoch": 4, "lo'
    path.write_text(before)

    def crash(*args):
        raise _Crash

    with monkeypatch.context() as m:
        m.setattr(os, "replace", crash)
        with pytest.raises(_Crash):
            truncate_metrics(str(path), 2)
    assert path.read_text() == before
    truncate_metrics(str(path), 2)
    assert read_metrics(str(path)) == rows[:3]
    truncate_metrics(str(path), 5)          # nothing to drop: the file is left as it is
    assert read_metrics(str(path)) == rows[:3]


def _private_mounts_work(folder) -> bool:
    """Whether this machine lets an unprivileged process mount a small tmpfs in a mount namespace of its own."""
    try:
        probe = subprocess.run(["unshare", "--map-root-user", "--mount", "sh", "-c",
                                f"mount -t tmpfs -o size=1M tmpfs {folder}"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.slow      # three short runs and an uninterrupted one: ~3-5 minutes on 2 cores
def test_a_full_disk_during_a_save_stops_clearly_and_the_same_command_resumes(tmp_path):
    """The workdir on a 16 MB tmpfs (a private mount namespace): after the first checkpoint the disk is filled
    but for 64 KB, and the same command stops with an error naming the workdir, the full disk and the intact epoch 1; with
    space freed, the same command goes on from epoch 1 to exactly the parameters of an uninterrupted run."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _private_mounts_work(disk):
        pytest.skip("this machine does not allow a private tmpfs mount (unshare --map-root-user --mount)")
    straight = tmp_path / "straight"
    _run(straight)

    workdir, out = disk / "w", tmp_path / "out"
    out.mkdir()
    # Without validation there is no plot to write: the 64 KB left free after filling take each epoch's
    # metrics line but not a checkpoint (~300 KB), so the save is what the full disk refuses.
    command = " ".join(_command(workdir) + ["--config.validate_every_epochs=0"])
    script = "\n".join([
        f"mount -t tmpfs -o size=16M tmpfs {disk} || exit 90",
        f"{command} --config.stop_after_epoch=1 > {out}/first.log 2>&1 || exit 91",
        f"dd if=/dev/zero of={disk}/filler bs=64k 2> /dev/null; truncate -s -64K {disk}/filler",
        f"{command} > {out}/full.log 2>&1; echo $? > {out}/full.rc",
        f"ls {workdir}/checkpoints > {out}/after_full.txt",
        f"rm {disk}/filler",
        f"{command} > {out}/resumed.log 2>&1 || exit 92",
        f"cp -r {workdir} {out}/workdir",
    ])
    proc = subprocess.run(["unshare", "--map-root-user", "--mount", "bash", "-c", script], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:],
                                  *[p.read_text()[-2000:] for p in out.glob("*.log")])

    full = (out / "full.log").read_text()
    assert (out / "full.rc").read_text().strip() == "1"
    assert (f"error: could not write a checkpoint in {workdir}: No space left on device; the checkpoint of "
            "epoch 1 is complete") in full
    # Only epoch 1 is a complete checkpoint; the refused save left at most its temporary folder.
    assert [n for n in (out / "after_full.txt").read_text().split() if n.isdigit()] == ["1"]
    resumed = (out / "resumed.log").read_text()
    assert "resuming" in resumed and "from epoch 1" in resumed
    _, want = checkpoints.load_policy(str(straight))
    _, got = checkpoints.load_policy(str(out / "workdir"))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(b), np.asarray(a)), want, got)
