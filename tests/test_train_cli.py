"""train.py as a user runs it: a tiny end-to-end run (training, validation, the checkpoint evaluate.py then
reads) and bad input answered with exit code 2 and a one-line message. Separate from test_training.py so
that the test runner can give these subprocess runs to another worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, SHARED_DIR, xla_flags_env
from mvmoe_jax import checkpoints


TINY_FLAGS = ["--config.model.embedding_dim=16", "--config.model.num_heads=2", "--config.model.num_layers=1",
              "--config.model.ff_hidden_dim=32", "--config.model.expert_loc=Enc0,Dec"]


def _train_py(*args, env=None):
    return subprocess.run([sys.executable, "train.py", "--config=configs/demo.py", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600, env=env)


def test_train_py_end_to_end(tmp_path):
    workdir = tmp_path / "wd"
    proc = _train_py(f"--config.workdir={workdir}", "--config.epochs=1", "--config.train_episodes=16",
                     "--config.batch_size=8", "--config.validation_instances=8",
                     "--config.validation_batch_size=8", "--config.progress_bar=False", *TINY_FLAGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 1/1" in proc.stdout and "validation:" in proc.stdout
    # train.py runs a CPU's cores as devices (the cpu plan's cpu_devices = 0): on the 2-core CI machine the
    # checkpoint below is written by a 2-device run and restored in this 1-device process.
    from mvmoe_jax import devices
    assert f"with {devices.largest_divisor_at_most(devices.usable_cores(), 8)} device(s)" in proc.stdout
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1]
    assert set(rows[1]["val"]) == {"CVRP", "OVRP", "VRPB", "VRPL", "VRPTW", "OVRPTW"}
    assert (workdir / "validation.png").stat().st_size > 0
    cfg, params = checkpoints.load_policy(workdir)
    assert cfg.model == "mvmoe" and cfg.embedding_dim == 16
    # It ends by saying where its results are and how to use the checkpoint.
    tail = proc.stdout.strip().splitlines()[-6:]
    assert tail[:3] == [f"checkpoint: {workdir / 'checkpoints'}", f"metrics:    {workdir / 'metrics.jsonl'}",
                        f"plot:       {workdir / 'validation.png'}"]
    assert tail[4].startswith(f"  python evaluate.py --checkpoint={workdir} ") and "--size=50" in tail[4]
    assert tail[5].startswith("  python -m mvmoe_jax.solve ") and tail[5].endswith(f"--checkpoint={workdir} --plot")

    fixtures = SHARED_DIR / "fixtures" / "torch-reference" / "data"
    if fixtures.exists():
        ev = subprocess.run([sys.executable, "evaluate.py", "--config=configs/demo.py", *TINY_FLAGS,
                             f"--checkpoint={workdir}", f"--data_dir={fixtures}", "--size=20", "--aug=1",
                             "--problems=CVRP", "--num_instances=4", "--noprogress"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600)
        assert ev.returncode == 0, ev.stderr[-3000:]
        assert "CVRP" in ev.stdout


@pytest.mark.parametrize("args, message", [
    (["--config.train_problems=CVRP,VRPZ"], "unknown VRP variant 'VRPZ'"),
    (["--config.batch_size=7"], "cannot be split over 2 devices"),
    (["--config.problem_size=30"], "problem_size must be one of"),
    (["--config.no_such_field=1"], "unknown config field 'no_such_field'"),
    (["--config.batch_size=abc"], "batch_size"),
    (["--config.finetune_from=/no/such/run"], "finetune_from: no checkpoint at /no/such/run"),
])
def test_train_py_bad_input(tmp_path, args, message):
    env = xla_flags_env("--xla_force_host_platform_device_count=2")
    proc = _train_py(f"--config.workdir={tmp_path / 'wd'}", *args, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
