"""Smoke tests: the benchmark scripts run on a tiny size and write their JSON (no timing asserted)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT


def _run(args, timeout=900):
    proc = subprocess.run([sys.executable] + args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_throughput_contract(tmp_path):
    out = tmp_path / "t.json"
    _run(["benchmarks/throughput.py", "--model=pomo_mtl", "--size=20", "--batch=2", "--mode=infer",
          f"--output={out}"])
    res = json.loads(out.read_text())
    assert res["instances_per_second"] > 0 and res["compile_seconds"] > 0 and res["device"]
    assert res["flops_per_instance"] > 0 and 0 < res["fraction_of_matmul_peak"]
    assert res["seconds_over_flop_limit"] > 1.0      # nothing runs faster than its FLOPs at the peak
    assert res["decode_steps"] >= 20 and res["weights"]


def test_torch_peer_runs_rl4co_on_our_instances(tmp_path):
    pytest.importorskip("rl4co", reason="RL4CO is the optional [torch] extra")
    out = tmp_path / "p.json"
    _run(["benchmarks/torch_peer.py", "--model=mvmoe", "--size=20", "--batch=2", "--repeats=1",
          f"--output={out}"])
    res = json.loads(out.read_text())
    assert res["instances_per_second"] > 0 and res["feasible"] and 20 <= res["decode_steps"] <= 41


def test_env_and_train_benchmarks(tmp_path):
    out = tmp_path / "e.json"
    _run(["benchmarks/env_throughput.py", "--sizes=20", "--batch=4", "--variants=CVRP;ALL", f"--output={out}"])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["steps_per_second"] > 0 for r in rows)
    out = tmp_path / "tr.json"
    _run(["benchmarks/train_throughput.py", "--configs=demo", "--size=20", "--batch=8", "--steps=1",
          f"--output={out}"])
    row = json.loads(out.read_text())["rows"][0]
    assert row["instances_per_second"] > 0 and row["timed_steps"] == 1
