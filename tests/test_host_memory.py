"""The huge-page restart (mvmoe_jax/host_memory.py): the environment it builds and the restart itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from mvmoe_jax import host_memory


def test_environment_appends_the_tunable_once_and_keeps_others():
    env = host_memory.environment_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "1"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert env["A"] == "1"
    assert host_memory.huge_pages_requested(env)
    again = host_memory.environment_with_huge_pages(env)
    assert again["GLIBC_TUNABLES"] == env["GLIBC_TUNABLES"]
    assert host_memory.environment_with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    # A user's own value of the tunable is respected, not overridden.
    own = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert host_memory.environment_with_huge_pages(own) == own
    assert not host_memory.huge_pages_requested({"GLIBC_TUNABLES": "glibc.malloc.hugetlbx=1"})


@pytest.mark.parametrize("modes, usable", [("always [madvise] never", True), ("[always] madvise never", True),
                                           ("always madvise [never]", False)])
def test_kernel_mode_decides_availability(tmp_path, modes, usable):
    if not sys.platform.startswith("linux") or (host_memory._glibc_version() or (0,)) < (2, 35):
        pytest.skip("needs Linux with glibc >= 2.35")
    f = tmp_path / "enabled"
    f.write_text(modes + "\n")
    assert host_memory.transparent_huge_pages_available(str(f)) is usable
    assert not host_memory.transparent_huge_pages_available(str(tmp_path / "missing"))


RESTART = ("import sys; from mvmoe_jax import host_memory; jax_before = 'jax' in sys.modules; "
           "host_memory.restart_with_huge_pages(); import os; "
           "print(os.environ.get('GLIBC_TUNABLES'), jax_before, sys.argv[1:])")


def _environment_without_the_setting(**extra) -> dict[str, str]:
    """This process's environment without GLIBC_TUNABLES or the opt-out, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host_memory.OPT_OUT)}
    env.update(extra)
    return env


def _run(extra_env):
    env = _environment_without_the_setting(**extra_env)
    out = subprocess.run([sys.executable, "-c", RESTART, "--flag=1"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_restart_sets_the_tunable_keeps_arguments_and_can_be_declined():
    if not host_memory.transparent_huge_pages_available():
        pytest.skip("transparent huge pages are not available to malloc here (Linux, glibc >= 2.35, THP on)")
    # The restarted process has the setting and the same arguments; the restart happens before JAX loads.
    assert _run({}) == "glibc.malloc.hugetlb=1 False ['--flag=1']"
    assert _run({host_memory.OPT_OUT: "0"}) == "None False ['--flag=1']"
    assert _run({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == "glibc.malloc.hugetlb=0 False ['--flag=1']"


# Runs an entry script as `python SCRIPT ARGS` would, reporting the tunable the process ends with (the
# restart replaces the process image and runs this command again, so the report comes from the last one).
ENTRY = ("import atexit, os, runpy, sys; "
         "atexit.register(lambda: print('tunables:', os.environ.get('GLIBC_TUNABLES'))); "
         "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("script", ["train.py", "evaluate.py"])
def test_entry_scripts_run_under_the_tunable(script, tmp_path):
    """train.py and evaluate.py restart under the tunable before doing anything else (here they then stop at
    a checkpoint that does not exist)."""
    if not host_memory.transparent_huge_pages_available():
        pytest.skip("transparent huge pages are not available to malloc here (Linux, glibc >= 2.35, THP on)")
    env = _environment_without_the_setting()
    missing = str(tmp_path / "no-such-checkpoint")
    args = {"train.py": ["--config=configs/demo.py", f"--config.workdir={tmp_path / 'w'}",
                         f"--config.finetune_from={missing}"],
            "evaluate.py": [f"--checkpoint={missing}"]}[script]
    out = subprocess.run([sys.executable, "-c", ENTRY, script] + args, cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "tunables: glibc.malloc.hugetlb=1" in out.stdout
