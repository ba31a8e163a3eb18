"""train.py killed with SIGKILL while it writes a checkpoint, or at random moments, then started again with
the same command, ends with exactly the parameters of a run that was never interrupted."""

import json
import os
import signal
import subprocess
import sys
import threading
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


def _command(workdir, *overrides):
    """train.py with RUN_FLAGS, each flag named in ``overrides`` replaced by its value there."""
    names = {o.split("=")[0] for o in overrides}
    flags = [f for f in RUN_FLAGS if f.split("=")[0] not in names]
    return [sys.executable, "train.py", "--config=configs/demo.py", f"--config.workdir={workdir}", *flags,
            *overrides]


def _run(workdir, *overrides):
    proc = subprocess.run(_command(workdir, *overrides), cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600)
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


# ----------------------------------------------------------------------------------------------------
# Kills at random moments
# ----------------------------------------------------------------------------------------------------

# 16 epochs of 6 steps, a checkpoint after each (3 kept: older ones are deleted as the run goes), validated
# after epochs 1, 2, 4, ..., 16 on 3 batches a variant. Once compiled, an epoch lasts a fraction of a second
# and orbax writes its checkpoint while the next one trains, so kills past the compilation land in an
# epoch's steps (with a write under way), its validation, or between them.
RANDOM_KILL_EPOCHS = 16
RANDOM_KILL_FLAGS = (f"--config.epochs={RANDOM_KILL_EPOCHS}", "--config.train_episodes=48",
                     "--config.validate_every_epochs=2",
                     "--config.validation_instances=24", "--config.checkpoint_every_epochs=1",
                     "--config.keep_checkpoints=3")
TMP_SUFFIX = ".orbax-checkpoint-tmp"     # orbax writes <epoch>.orbax-checkpoint-tmp, renamed to <epoch> when complete


class _Watched:
    """train.py started with the random-kill command: the lines it prints (with the time each was read) and
    the checkpoint folders it writes, as seen by ``poll``."""

    def __init__(self, workdir, log):
        self.folder = os.path.join(workdir, "checkpoints")
        self.resumed_from = max((int(n) for n in _entries(self.folder) if n.isdigit()), default=None)
        self.started = time.time()
        self.t0 = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.writes: dict[str, float] = {}       # temporary folder -> when first seen
        self.saved: dict[int, float] = {}        # epoch saved by this process -> when first seen complete
        self.log = open(log, "w")
        self.proc = subprocess.Popen(_command(workdir, *RANDOM_KILL_FLAGS), cwd=REPO_ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=self.log)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def finish(self) -> list[str]:
        """Wait for the process to end; its printed lines."""
        self.proc.wait(timeout=600)
        self.reader.join(timeout=60)
        self.log.close()
        return [line for _, line in self.lines]

    def stderr_tail(self) -> str:
        with open(self.log.name) as f:
            return f.read()[-3000:]

    def writing(self) -> list[str]:
        """The temporary checkpoint folders this process has written into (created or changed since it started;
        an earlier run's leftover is not counted until orbax removes it to write that epoch again)."""
        out = []
        for name in _entries(self.folder):
            try:
                if name.endswith(TMP_SUFFIX) and os.stat(os.path.join(self.folder, name)).st_mtime >= self.started:
                    out.append(name)
            except FileNotFoundError:
                pass
        return out

    def poll(self) -> None:
        now = time.monotonic()
        for name in self.writing():
            self.writes.setdefault(name, now)
        for name in _entries(self.folder):
            if name.isdigit() and (self.resumed_from is None or int(name) > self.resumed_from):
                self.saved.setdefault(int(name), now)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def since_line(self, prefix: str, k: int = 1) -> float:
        """Seconds since this process printed its k-th line starting with ``prefix`` (-1 before that)."""
        times = [t for t, line in list(self.lines) if line.startswith(prefix)]
        return time.monotonic() - times[k - 1] if len(times) >= k else -1.0

    def since_saved(self, k: int) -> float:
        """Seconds since the k-th checkpoint this process saved appeared complete (-1 before that)."""
        times = sorted(self.saved.values())
        return time.monotonic() - times[k - 1] if len(times) >= k else -1.0

    def writing_for(self, k: int) -> float:
        """Seconds for which a temporary folder, the k-th or a later one this process wrote, has been present
        (-1 when none is present now)."""
        order = sorted(self.writes, key=self.writes.get)[k - 1:]
        now = [name for name in self.writing() if name in order]
        return max((time.monotonic() - self.writes[name] for name in now), default=-1.0)


def _all_threads_stopped(pid: int) -> bool:
    try:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:          # a thread ended while being listed: look again
        return False
    return all(state in "tT" for state in states)


def _kill_at(run: _Watched, ready, forced: bool, context: str, timeout: float = 400) -> dict:
    """Poll ``run`` until ``ready(run)``, then freeze it (SIGSTOP), note what is on disk, and SIGKILL it: the
    kill lands at the moment of the stop. A ``forced`` kill must land during a checkpoint write: when the
    write completed before the stop, the run goes on (SIGCONT) until ``ready`` holds again."""
    proc = run.proc
    while True:
        run.poll()
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the kill; {context}\n" \
                                    f"{run.stderr_tail()}"
        assert run.elapsed() < timeout, f"the run never reached the moment to kill it at; {context}"
        if ready(run):
            proc.send_signal(signal.SIGSTOP)
            stop = time.monotonic()
            while not _all_threads_stopped(proc.pid):
                assert time.monotonic() - stop < 30, f"SIGSTOP did not stop the run; {context}"
                time.sleep(0.001)
            on_disk, writing = sorted(_entries(run.folder)), run.writing()
            if writing or not forced:
                proc.send_signal(signal.SIGKILL)
                break
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    at = run.elapsed()
    return {"at": round(at, 2), "on_disk": on_disk, "writing": writing, "lines": run.finish()}


def _phase(kill: dict, validated: set[int]) -> str:
    """What the killed run was doing, from what it had printed, and whether a checkpoint write was under way
    (orbax writes while the next epoch trains)."""
    lines = kill["lines"]
    if not any(line.startswith("training ") for line in lines):
        doing = "startup"                 # imports, the config, restoring the latest checkpoint
    elif not any(line.startswith("epoch ") for line in lines):
        doing = "compilation"             # the first validation and step compile, then that first epoch
    elif lines[-1].startswith("epoch ") and int(lines[-1].split()[1].split("/")[0]) in validated:
        doing = "validation"
    else:
        doing = "epoch steps"             # or the metrics and plot written between them
    return f"checkpoint write ({doing})" if kill["writing"] else doing


def _without_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in rows]


@pytest.mark.slow      # an uninterrupted run, five killed ones and the resumed one: 4-6 minutes on 2 loaded cores
def test_runs_killed_at_random_moments_resume_to_the_same_parameters_and_metrics(tmp_path):
    """Five SIGKILLs at moments drawn from a seeded generator (MVMOE_KILL_SEED=<seed> draws the same ones):
    in the startup, the compilation, after an epoch's line or a new checkpoint, and two forced into a
    checkpoint write. After each, the newest complete checkpoint loads and metrics.jsonl holds the
    uninterrupted run's records; the same command then ends with the uninterrupted run's parameters (bitwise),
    metrics (each epoch once) and checkpoints."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to see that a stopped process's threads have all stopped")
    seed = int(os.environ.get("MVMOE_KILL_SEED") or np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    t_start = time.monotonic()

    run = _Watched(tmp_path / "straight", tmp_path / "straight.log")
    lines = run.finish()
    assert run.proc.returncode == 0, run.stderr_tail()
    # The phases' lengths on this machine scale the drawn delays.
    epochs = [t - run.t0 for t, line in run.lines if line.startswith("epoch ")]
    to_training = next(t - run.t0 for t, line in run.lines if line.startswith("training "))
    compiling = epochs[0] - to_training
    epoch_s = (epochs[-1] - epochs[1]) / (len(epochs) - 2)
    validated = {int(a.split()[1].split("/")[0]) for a, b in zip(lines, lines[1:])
                 if a.startswith("epoch ") and b.startswith("  validation:")}
    want_rows = _without_time(read_metrics(tmp_path / "straight" / "metrics.jsonl"))

    plans = [
        ("a delay after the start", lambda r, d=rng.uniform(0.1, 1.0) * to_training: r.elapsed() >= d, False),
        # At the latest at this process's second epoch: a resumed run compiles faster than a new one.
        ("a delay after the 'training' line", lambda r, d=rng.uniform(0, 1.0) * compiling:
         r.since_line("training ") >= d or r.since_line("epoch ", 2) >= 0, False),
        ("a delay after an 'epoch' line or a new checkpoint",
         lambda r, by_line=bool(rng.integers(2)), k=int(rng.integers(1, 3)), d=rng.uniform(0, 1.2) * epoch_s:
         (r.since_line("epoch ", k) if by_line else r.since_saved(k)) >= d, False),
        # In a process's second or third write: orbax starts one when the one before is complete, so
        # the run always has a checkpoint to resume from at the end.
        *[("within a checkpoint write", lambda r, k=int(rng.integers(2, 4)), d=rng.uniform(0, 0.05):
           r.writing_for(k) >= d, True) for _ in range(2)],
    ]
    killed = tmp_path / "killed"
    kills: list[dict] = []

    def context():
        return (f"seed {seed} (MVMOE_KILL_SEED={seed} draws the same moments); kills: "
                + "; ".join(f"{k['plan']} -> {k['phase']} at {k['at']} s, on disk {k['on_disk']}" for k in kills))

    for i in rng.permutation(len(plans)):
        plan, ready, forced = plans[i]
        run = _Watched(killed, tmp_path / f"kill{len(kills)}.log")
        kill = _kill_at(run, ready, forced, context())
        kill.update(plan=plan, phase=_phase(kill, validated))
        kills.append(kill)
        printed = kill["lines"]
        # A started run resumes from the newest complete checkpoint, and no kill leaves one unreadable.
        resumed = [line for line in printed if line.startswith("resuming ")]
        if run.resumed_from is None:
            assert not resumed, (resumed, context())
        elif any(line.startswith("training ") for line in printed):
            assert len(resumed) == 1 and f"from epoch {run.resumed_from} (step" in resumed[0], (resumed, context())
        assert not any("cannot be read" in line for line in printed), (printed, context())
        if any(name.isdigit() for name in _entries(killed / "checkpoints")):
            checkpoints.load_policy(str(killed))
        # Records of epochs past the newest checkpoint may stay until the next start: all are the uninterrupted run's.
        rows = _without_time(read_metrics(killed / "metrics.jsonl"))
        assert rows == want_rows[:len(rows)], context()

    newest = max(int(n) for n in _entries(killed / "checkpoints") if n.isdigit())
    out = _run(killed, *RANDOM_KILL_FLAGS)
    assert f"from epoch {newest} (step" in out, (out[-2000:], context())

    _, want = checkpoints.load_policy(str(tmp_path / "straight"))
    _, got = checkpoints.load_policy(str(killed))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=context()),
                 want, got)
    rows = _without_time(read_metrics(killed / "metrics.jsonl"))
    assert [r["epoch"] for r in rows] == list(range(RANDOM_KILL_EPOCHS + 1)), context()
    assert rows == want_rows, context()
    assert sorted(_entries(killed / "checkpoints")) == sorted(_entries(tmp_path / "straight" / "checkpoints")), \
        context()
    phases = [k["phase"] for k in kills]
    assert sum(phase.startswith("checkpoint write") for phase in phases) >= 2, context()
    print(f"\n{context()}\n{time.monotonic() - t_start:.0f} s in all")
