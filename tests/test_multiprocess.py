"""Training over several processes (``jax.distributed``) on this machine: ``train.py`` started as two
processes of one CPU device each (a loopback coordinator, JAX's CPU collectives) against one process
with two CPU devices; checkpoints carried between the two launches; a process killed mid-run."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO_ROOT
from configs import demo
from mvmoe_jax import checkpoints, distributed, training, training_loop, training_validation
from test_train_cli import TINY_FLAGS

# Seconds a process may go silent before the others count it as dead (jax.distributed's heartbeat).
HEARTBEAT = 10
# 2 steps of 8 instances per epoch; validation in 2 batches of 4, one per process.
RUN_FLAGS = ["--config.train_episodes=16", "--config.batch_size=8", "--config.validation_instances=8",
             "--config.validation_batch_size=4", "--config.validation_problems=CVRP,VRPTW",
             "--config.progress_bar=False", *TINY_FLAGS]
PROCESS_TIMEOUT = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")


def _command(workdir, *flags) -> list[str]:
    return [sys.executable, "train.py", "--config=configs/demo.py", f"--config.workdir={workdir}", *RUN_FLAGS,
            *flags]


_LAUNCHES = itertools.count()


class Launch:
    """``train.py`` as ``num`` processes of one CPU device each; their output goes to files beside the
    workdir, apart for each launch (``out(p)``, ``err(p)``). ``only``: flags given to one process alone."""

    def __init__(self, workdir, *flags, num: int = 2, only: dict[int, tuple[str, ...]] | None = None):
        self.workdir = workdir
        port = _free_port()
        n = next(_LAUNCHES)
        self.logs = [(f"{workdir}.{n}.{p}.out", f"{workdir}.{n}.{p}.err") for p in range(num)]
        common = ["--config.distributed=True", f"--config.coordinator_address=127.0.0.1:{port}",
                  f"--config.num_processes={num}", f"--config.heartbeat_timeout_seconds={HEARTBEAT}",
                  "--config.execution.cpu_devices=1", *flags]
        self.procs = []
        for p, (out, err) in enumerate(self.logs):
            with open(out, "w") as fo, open(err, "w") as fe:
                own = (only or {}).get(p, ())
                self.procs.append(subprocess.Popen(_command(workdir, *common, *own, f"--config.process_id={p}"),
                                                   cwd=REPO_ROOT, env=_env(), stdout=fo, stderr=fe))

    def out(self, p: int) -> str:
        with open(self.logs[p][0]) as f:
            return f.read()

    def err(self, p: int) -> str:
        with open(self.logs[p][1]) as f:
            return f.read()

    def wait(self, timeout: float = PROCESS_TIMEOUT) -> list[int]:
        """Every process's exit code; all are killed, and the test fails, past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            return [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in self.procs]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the processes did not end within {timeout} s; last output:\n"
                        + "\n".join(self.err(p)[-1500:] for p in range(len(self.procs))))
        finally:
            self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)

    def finish(self) -> None:
        codes = self.wait()
        assert codes == [0] * len(codes), "\n".join(f"process {p} exit {c}:\n{self.err(p)[-3000:]}"
                                                    for p, c in enumerate(codes))


def _one_process(workdir, *flags, devices: int = 2) -> str:
    """``train.py`` as one process with ``devices`` CPU devices; its stdout."""
    proc = subprocess.run(_command(workdir, f"--config.execution.cpu_devices={devices}", *flags), cwd=REPO_ROOT,
                          env=_env(), capture_output=True, text=True, timeout=PROCESS_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _assert_same_parameters(workdir_a, workdir_b) -> None:
    """The same parameters up to float summation order: within 1e-5 of the largest parameter."""
    _, a = checkpoints.load_policy(str(workdir_a))
    _, b = checkpoints.load_policy(str(workdir_b))
    scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(a))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=0, atol=1e-5 * scale),
                 a, b)


def _records(workdir) -> list[dict]:
    """metrics.jsonl without the timings."""
    rows = training_validation.read_metrics(os.path.join(workdir, "metrics.jsonl"))
    return [{k: v for k, v in r.items() if k != "time"} for r in rows]


def _run_lines(text: str, workdir=None) -> list[str]:
    """What a run printed of its progress (training, epochs, validation), without its workdir's name and
    its timings."""
    return [re.sub(r"\s+[\d.]+ inst/s\s+\([\d.]+s\)", "", line.replace(str(workdir), "WORKDIR"))
            for line in text.splitlines() if line.startswith(("epoch ", "  validation", "training "))]


# ----------------------------------------------------------------------------------------------------
# Two processes against one
# ----------------------------------------------------------------------------------------------------

def test_two_processes_train_as_one_process_with_two_devices(tmp_path):
    """Two processes of one device each compute what one process with two devices does: the same
    batches (each process generating its own half), the same all-reduced gradient, the same validation
    (each process evaluating one of the two batches); only process 0 writes metrics and logs."""
    two = Launch(tmp_path / "two", "--config.epochs=1")
    one = _one_process(tmp_path / "one", "--config.epochs=1")
    two.finish()
    _assert_same_parameters(tmp_path / "one", tmp_path / "two")
    assert _records(tmp_path / "two") == _records(tmp_path / "one")
    assert [r["epoch"] for r in _records(tmp_path / "two")] == [0, 1]
    assert "with 2 device(s)" in two.out(0) and "with 2 device(s)" in one
    assert _run_lines(two.out(0), tmp_path / "two") == _run_lines(one, tmp_path / "one")
    assert _run_lines(two.out(1)) == []                 # process 1 says nothing of the run ...
    assert os.path.exists(tmp_path / "two" / "validation.png")
    with training_loop.checkpoint_manager(str(tmp_path / "two")) as mngr:
        assert mngr.latest_step() == 1                  # ... and the checkpoint both save is complete


@pytest.mark.slow       # four launches, ~6 minutes on 2 busy cores
def test_checkpoints_move_between_two_processes_and_one(tmp_path):
    """A run stopped after epoch 1 by two processes continues in one process with two devices, and the
    reverse; both end where an uninterrupted one-process run ends."""
    _one_process(tmp_path / "straight", "--config.epochs=2")
    Launch(tmp_path / "two_then_one", "--config.epochs=2", "--config.stop_after_epoch=1").finish()
    assert "resuming" in _one_process(tmp_path / "two_then_one", "--config.epochs=2")
    _one_process(tmp_path / "one_then_two", "--config.epochs=2", "--config.stop_after_epoch=1")
    resumed = Launch(tmp_path / "one_then_two", "--config.epochs=2")
    resumed.finish()
    assert "resuming" in resumed.out(0)
    for workdir in ("two_then_one", "one_then_two"):
        _assert_same_parameters(tmp_path / "straight", tmp_path / workdir)
        assert _records(tmp_path / workdir) == _records(tmp_path / "straight")


@pytest.mark.slow       # one launch of three epochs, ~2 minutes on 2 busy cores
def test_process_zeros_time_limit_stops_every_process_after_the_same_epoch(tmp_path):
    """Only process 0 is given a wall-clock budget (one that any epoch overruns): both processes save
    epoch 1 and stop together, without error, instead of one waiting for the other."""
    run = Launch(tmp_path / "run", "--config.epochs=3", only={0: ("--config.time_limit_seconds=0.001",)})
    run.finish()
    assert "stopping after epoch 1: time_limit_seconds=0.001" in run.out(0)
    assert [r["epoch"] for r in _records(tmp_path / "run")] == [0, 1]
    with training_loop.checkpoint_manager(str(tmp_path / "run")) as mngr:
        assert mngr.all_steps() == [1]


EVALUATION_SCRIPT = r"""
import json, sys, jax, numpy as np
from mvmoe_jax import distributed, evaluation, instances, training
from mvmoe_jax.nn.policy import PolicyConfig
if len(sys.argv) > 1:
    port, process = sys.argv[1:]
    distributed.initialize(distributed.Launch(f"127.0.0.1:{port}", 2, int(process), heartbeat_timeout_seconds=10))
cfg = PolicyConfig(model="mvmoe", embedding_dim=16, num_heads=2, num_layers=1, ff_hidden_dim=32,
                   expert_loc=("Enc0", "Dec"))
params = training.init_params(cfg, jax.random.key(0))
inst = instances.generate(jax.random.key(1), 10, 20, ["CVRP", "VRPTW", "OVRPB"])
res = evaluation.evaluate_dataset(cfg, params, inst, batch_size=4, progress=False)
print("RESULT" + json.dumps({"obj": res.obj.tolist(), "obj_no_aug": res.obj_no_aug.tolist(), "routes": res.routes,
                             "processes": jax.process_count()}))
"""


def _evaluation(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", EVALUATION_SCRIPT, *map(str, args)], cwd=REPO_ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow       # three processes compiling the evaluation, ~30 s on 2 idle cores
def test_evaluation_over_two_processes_equals_one_process():
    """10 instances in 3 batches of 4 (the last padded): process 0 decodes batches 0 and 2, process 1
    batch 1; both return every instance's objective and route, exactly one process's."""
    port = _free_port()
    procs = [_evaluation(port, 0), _evaluation(port, 1), _evaluation()]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=PROCESS_TIMEOUT)
            assert proc.returncode == 0, err[-3000:]
            outs.append(json.loads(out.split("RESULT", 1)[1]))
    finally:
        for proc in procs:
            proc.kill()
    two_0, two_1, one = outs
    assert [two_0["processes"], two_1["processes"], one["processes"]] == [2, 2, 1]
    for got in (two_0, two_1):
        assert got["obj"] == one["obj"] and got["obj_no_aug"] == one["obj_no_aug"] and got["routes"] == one["routes"]
    assert len(one["obj"]) == 10 and all(len(r) > 20 for r in one["routes"])


# ----------------------------------------------------------------------------------------------------
# A process that dies
# ----------------------------------------------------------------------------------------------------

def _kill_when_saved(launch: Launch, victim: int, epoch: int, timeout: float = PROCESS_TIMEOUT) -> float:
    """SIGKILL process ``victim`` once the checkpoint of ``epoch`` is complete; the time of the kill."""
    folder = os.path.join(launch.workdir, "checkpoints", str(epoch))
    t0 = time.monotonic()
    while not os.path.isdir(folder):
        assert all(p.poll() is None for p in launch.procs), "a process ended before it could be killed"
        assert time.monotonic() - t0 < timeout, f"epoch {epoch} was never saved"
        time.sleep(0.01)
    launch.procs[victim].send_signal(signal.SIGKILL)
    return time.monotonic()


@pytest.mark.slow       # three launches, ~4 minutes on 2 busy cores
@pytest.mark.parametrize("victim", [1, 0], ids=["worker_killed", "coordinator_killed"])
def test_when_a_process_dies_the_other_stops_and_a_restart_resumes_exactly(tmp_path, victim):
    """Process ``victim`` killed after the first checkpoint: the other stops on its own with an error
    within a bounded time (the heartbeat's 10 s and a margin) instead of waiting forever; the same two
    commands started again resume from the checkpoint and end with an uninterrupted run's parameters."""
    _one_process(tmp_path / "straight", "--config.epochs=3")
    run = Launch(tmp_path / "run", "--config.epochs=3")
    killed_at = _kill_when_saved(run, victim, epoch=1)
    survivor = 1 - victim
    try:
        code = run.procs[survivor].wait(timeout=HEARTBEAT + 120)
        waited = time.monotonic() - killed_at
    except subprocess.TimeoutExpired:
        pytest.fail(f"process {survivor} still runs {HEARTBEAT + 120} s after process {victim} was killed")
    finally:
        run.kill()
    err = run.err(survivor)
    # Stopped in an exchange with the lost process: train.py's error; elsewhere: jax.distributed's
    # heartbeat check ends the process (SIGABRT) with its own message.
    if code == 3:
        assert f"error: process {survivor} of 2: a computation failed" in err
        assert "most often another process having stopped" in err and "The last checkpoint is epoch 1" in err
    else:
        assert code == -signal.SIGABRT and "This most likely indicates that another task died" in err, err[-3000:]
    print(f"process {survivor} stopped {waited:.1f} s after process {victim} was killed (exit {code})")

    again = Launch(tmp_path / "run", "--config.epochs=3")
    again.finish()
    assert "resuming" in again.out(0)
    _assert_same_parameters(tmp_path / "straight", tmp_path / "run")
    assert _records(tmp_path / "run") == _records(tmp_path / "straight")


# ----------------------------------------------------------------------------------------------------
# Launch settings, shares (no processes started)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    (dict(process_id=1), "process_id given without coordinator_address, num_processes"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2), "given without process_id"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2),
     "process_id must be between 0 and num_processes - 1 = 1, got 2"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=0, process_id=0), "num_processes must be >= 1"),
    (dict(coordinator_address="127.0.0.1", num_processes=2, process_id=0), "must be host:port"),
])
def test_inconsistent_launch_settings_are_refused_naming_them(fields, message):
    config = demo.get_config()
    config.distributed = True
    for k, v in fields.items():
        config[k] = v
    with pytest.raises(ValueError, match=message):
        distributed.launch_from_config(config)


def test_launch_settings_need_distributed_and_none_means_detected():
    config = demo.get_config()
    assert distributed.launch_from_config(config) is None
    config.num_processes = 2
    with pytest.raises(ValueError, match="num_processes set but distributed is False"):
        distributed.launch_from_config(config)
    config.num_processes = None
    config.distributed = True
    assert distributed.launch_from_config(config) == distributed.Launch(heartbeat_timeout_seconds=100)


@pytest.mark.parametrize("command", [
    _command("unused", "--config.distributed=True", "--config.process_id=0"),
    [sys.executable, "evaluate.py", "--checkpoint=unused", "--distributed", "--process_id=0"]],
    ids=["train.py", "evaluate.py"])
def test_the_entry_points_refuse_a_partial_launch(command):
    proc = subprocess.run(command, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=PROCESS_TIMEOUT)
    assert proc.returncode == 2
    assert "error: distributed launch: process_id given without coordinator_address, num_processes" in proc.stderr


def test_validation_batches_are_shared_out_whole():
    """Every batch is evaluated by exactly one process."""
    for num_batches in (1, 2, 5, 8):
        for processes in (1, 2, 3):
            shares = [list(distributed.process_batches(num_batches, p, processes)) for p in range(processes)]
            assert sorted(sum(shares, [])) == list(range(num_batches))


def test_a_single_process_generates_the_whole_batch():
    mesh = training.make_mesh()
    position, devices = training.process_row_devices(mesh)
    assert position == 0 and devices == list(mesh.devices.flat)
    assert json.dumps(distributed.sum_over_processes(np.array([1.5, 2.0])).tolist()) == "[1.5, 2.0]"
