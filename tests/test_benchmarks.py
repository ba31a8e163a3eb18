"""Smoke tests: the benchmark scripts run on a tiny size and write their JSON (no timing asserted)."""

import dataclasses
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT


def _run(args, timeout=900):
    proc = subprocess.run([sys.executable] + args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _assert_ran_as_the_entry_scripts_run(recorded_tunables: str) -> None:
    """A benchmark's recorded ``GLIBC_TUNABLES``: glibc's huge-page tunable where the entry scripts restart
    under it (host_memory.py: the platform allows it, not declined, not already set), else this process's own."""
    from mvmoe_jax import host_memory
    restarts = (host_memory.transparent_huge_pages_available() and os.environ.get(host_memory.OPT_OUT, "1") != "0"
                and not host_memory.huge_pages_requested())
    if restarts:
        assert "glibc.malloc.hugetlb=1" in recorded_tunables
    else:
        assert recorded_tunables == os.environ.get("GLIBC_TUNABLES", "")


def test_throughput_contract(tmp_path):
    out = tmp_path / "t.json"
    _run(["benchmarks/throughput.py", "--model=pomo_mtl", "--size=20", "--batch=2", "--mode=infer", "--rounds=2",
          f"--output={out}"])
    res = json.loads(out.read_text())
    assert res["instances_per_second"] > 0 and res["compile_seconds"] > 0 and res["device"]
    # Measured as evaluate.py runs.
    _assert_ran_as_the_entry_scripts_run(res["glibc_tunables"])
    # The XLA flags it ran with are recorded: 512-bit vectors on an AVX-512 CPU (devices.prefer_wide_vectors).
    from mvmoe_jax import devices
    assert res["xla_flags"] == devices.xla_flags_with_wide_vectors(os.environ.get("XLA_FLAGS", ""),
                                                                 devices.cpu_has_avx512())
    # Two rounds measured; the fastest is reported.
    assert len(res["rounds_instances_per_second"]) == 2
    assert res["instances_per_second"] == max(res["rounds_instances_per_second"])
    assert res["flops_per_instance"] > 0 and 0 < res["fraction_of_matmul_peak"]
    assert res["seconds_over_flop_limit"] == pytest.approx(
        res["seconds"] * res["matmul_peak_gflops"] * 1e9 / (res["flops_per_instance"] * res["batch"]))
    # Held to the highest peak measured in the run: at its start or after the workload.
    assert res["matmul_peak_gflops"] == max(res["matmul_peak_gflops_at_start"],
                                            res["matmul_peak_gflops_after_workload"])
    # The model's FLOPs (query projection and head combination at every step) exceed what the program runs
    # with its per-rollout precomputations.
    assert 0 < res["executed_flops_per_instance"] < res["flops_per_instance"]
    assert res["decode_steps"] >= 20 and res["weights"]
    # XLA's memory analysis of the program: at least its arguments, the float32 parameters among them.
    assert res["program_memory_bytes"] >= 4 * _parameter_count("pomo_mtl")


def _parameter_count(model: str) -> int:
    from mvmoe_jax import training
    from mvmoe_jax.nn.policy import PolicyConfig
    import jax
    return sum(x.size for x in jax.tree.leaves(training.init_params(PolicyConfig(model=model), jax.random.key(0))))


@pytest.mark.slow      # four compilations in a subprocess; the search itself is tested without them below
def test_throughput_finds_the_largest_batch_that_fits(tmp_path):
    """--batches=...,max doubles the batch from the largest listed while the compiled program fits the memory
    budget and the batch is at most --max_batch, then measures the largest found (here the cap, 4)."""
    out = tmp_path / "m.json"
    stdout = _run(["benchmarks/throughput.py", "--model=pomo_mtl", "--size=20", "--batches=2,max", "--max_batch=4",
                   "--mode=infer", f"--output={out}"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [2, 4]
    search = rows[1]["largest_batch_search"]
    assert search["largest"] == 4 and [t["batch"] for t in search["tried"]] == [2, 4]
    assert search["tried"][1]["program_memory_bytes"] > search["tried"][0]["program_memory_bytes"]
    assert rows[1]["program_memory_bytes"] == search["tried"][1]["program_memory_bytes"]
    assert "largest batch that fits" in stdout and rows[1]["compile_seconds"] > 0.5   # compiled afresh


def test_throughput_rejects_bad_batches_and_precisions():
    for flag, message in (("--batches=1,many", "--batches must list positive integers"),
                          ("--matmul_precision=fp8", "argument --matmul_precision: invalid choice"),
                          ("--train_warmup=0", "--train_steps and --train_warmup must be at least 1")):
        proc = subprocess.run([sys.executable, "benchmarks/throughput.py", flag], cwd=REPO_ROOT,
                              capture_output=True, text=True)
        assert proc.returncode == 2 and message in proc.stderr, (flag, proc.stderr[-300:])


def test_largest_batch_search_stops_at_the_budget_and_the_cap():
    throughput = _benchmarks_module("throughput")
    need = lambda mode, model, size, batch, **kw: 100 + 10 * batch      # noqa: E731  (bytes per batch)
    best, tried = throughput.largest_batch("infer", "mvmoe", 50, 1, budget=500, max_batch=1024, memory=need)
    assert best == 32 and [b for b, _ in tried] == [1, 2, 4, 8, 16, 32, 64]
    assert throughput.largest_batch("infer", "mvmoe", 50, 1, budget=500, max_batch=8, memory=need)[0] == 8
    with pytest.raises(ValueError, match="batch 64 needs .* over the budget"):
        throughput.largest_batch("train", "mvmoe", 50, 64, budget=500, max_batch=1024, memory=need)


@pytest.mark.slow      # two training compilations; test_env_and_train_benchmarks checks the figure's floor
def test_training_program_memory_grows_with_the_batch():
    """StepFunctions.memory_bytes from the compiled step: at least the optimiser state (parameters and
    Adam's two moments), and more for a larger batch."""
    train_throughput = _benchmarks_module("train_throughput")
    small = train_throughput.program_memory("pomo_mtl", 20, 20, 2, problems="CVRP")
    large = train_throughput.program_memory("pomo_mtl", 20, 20, 8, problems="CVRP")
    assert small >= 3 * 4 * _parameter_count("pomo_mtl") and large > small


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
    result = json.loads(out.read_text())
    row = result["rows"][0]
    assert row["instances_per_second"] > 0 and row["timed_steps"] == 1
    # Measured as train.py runs.
    _assert_ran_as_the_entry_scripts_run(result["glibc_tunables"])
    # The compiled step's memory holds at least the parameters and Adam's two moments.
    assert row["program_memory_bytes"] >= 3 * 4 * row["params"]


def _benchmarks_module(name):
    """benchmarks/<name>.py, imported in this process."""
    if str(REPO_ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    return importlib.import_module(name)


def _authors_peer():
    """benchmarks/authors_peer.py (it imports without torch)."""
    return _benchmarks_module("authors_peer")


def test_authors_peer_runs_the_authors_code_on_tiny_instances():
    """benchmarks/authors_peer.py on the authors' own PyTorch code (a local checkout of
    RoyalSkye/Routing-MVMoE named by $MVMOE_AUTHORS_CODE): 2 instances of n = 20, without and with x8."""
    code = os.environ.get("MVMOE_AUTHORS_CODE")
    if not code:
        pytest.skip("set MVMOE_AUTHORS_CODE to a checkout of RoyalSkye/Routing-MVMoE to run the authors' peer")
    pytest.importorskip("torch", reason="the authors' code needs PyTorch (the optional [torch] extra)")
    authors_peer = _authors_peer()

    rng = np.random.default_rng(0)
    locs = rng.random((2, 21, 2), dtype=np.float32)
    demand = np.concatenate([np.zeros((2, 1)), rng.integers(1, 10, (2, 20)) / 30.0], axis=1).astype(np.float32)
    for aug in (1, 8):
        res = authors_peer.authors_infer("mvmoe", locs, demand, code, aug=aug, repeats=1)
        assert res["framework"] == "pytorch/authors" and res["model"] == "mvmoe"
        assert (res["num_customers"], res["batch"], res["aug"]) == (20, 2, aug)
        assert res["seconds"] > 0 and res["instances_per_second"] > 0 and len(res["all_seconds"]) == 1
        assert np.isfinite(res["mean_objective"]) and res["mean_objective"] > 0
        assert res["mean_objective"] <= res["no_aug_mean_objective"] + 1e-6      # best over more candidates
        assert res["feasible"] and 20 <= res["decode_steps"] <= 40
        assert res["threads"] >= 1 and res["torch_version"]


def test_authors_peer_rejects_a_folder_that_is_not_the_authors_code(tmp_path):
    authors_peer = _authors_peer()
    with pytest.raises(ValueError, match="Routing-MVMoE"):
        authors_peer.authors_infer("mvmoe", np.zeros((1, 21, 2)), np.zeros((1, 21)), str(tmp_path))
    with pytest.raises(ValueError, match="--code"):
        authors_peer.authors_infer("mvmoe", np.zeros((1, 21, 2)), np.zeros((1, 21)), None)


def test_authors_peer_reports_a_commit_only_for_the_checkout_itself(tmp_path):
    """A copy of the authors' code without its .git, inside another repository (as gpu_prepare.sh makes
    one), must not report the outer repository's commit as the authors'."""
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    authors_peer = _authors_peer()

    def commit_in(repo):
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t"}
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        subprocess.run(["git", "-C", str(repo), "commit", "-q", "--allow-empty", "-m", "x"], check=True, env=env)
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()

    outer = tmp_path / "outer"
    copy = outer / ".gpu" / "Routing-MVMoE"
    copy.mkdir(parents=True)
    commit_in(outer)
    assert authors_peer._git_commit(copy) is None
    own = commit_in(copy)
    assert authors_peer._git_commit(copy) == own
    assert authors_peer._git_commit(tmp_path / "missing") is None


def test_authors_peer_device_errors_name_the_problem():
    """--device: only cpu or cuda, and cuda only where torch sees a GPU (a stand-in torch without one)."""
    import types

    authors_peer = _authors_peer()
    no_gpu = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    assert authors_peer._check_device(no_gpu, "cpu") == "cpu"
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        authors_peer._check_device(no_gpu, "cuda")
    with pytest.raises(ValueError, match="cpu or cuda"):
        authors_peer._check_device(no_gpu, "tpu")


def test_model_flops_count_the_plain_model_with_its_k_chosen_experts():
    """The FLOP limit's basis, against a count by hand of MVMoE/4E's matrix products (n = 20, top-2 of 4
    experts, 30 decoding steps of 20 starts): at least those products, and not much more (the softmaxes,
    norms and masks); every expert computed would be over 1.3x the count."""
    import jax
    from mvmoe_jax import instances, training
    from mvmoe_jax.nn.policy import PolicyConfig
    throughput = _benchmarks_module("throughput")
    cfg = PolicyConfig(model="mvmoe")
    plain = throughput.plain_formulation(cfg)
    assert plain.num_experts == 2 and dataclasses.replace(plain, num_experts=cfg.num_experts) == cfg
    n, steps = 20, 30
    inst = instances.generate(jax.random.key(0), 2, n, "CVRP")
    flops = throughput.model_flops_per_instance(cfg, n, inst, n, 2, np.array([steps]), 1)
    nodes, d, hidden, k = n + 1, cfg.embedding_dim, cfg.ff_hidden_dim, cfg.topk
    layer = 4 * 2 * nodes * d * d + 2 * 2 * nodes * nodes * d + k * 2 * nodes * 2 * d * hidden
    precompute = 2 * 2 * nodes * d * d
    step = 2 * (d + 4) * d + 3 * 2 * nodes * d + k * 2 * d * d        # query; scores, values, readout; experts
    by_hand = cfg.num_layers * layer + precompute + steps * n * step
    assert by_hand <= flops < 1.2 * by_hand
    every_expert = by_hand + cfg.num_layers * (cfg.num_experts - k) * 2 * nodes * 2 * d * hidden
    assert every_expert > 1.3 * by_hand       # so the upper bound above would catch it


def test_per_step_speedup_normalises_by_decoding_steps():
    throughput = _benchmarks_module("throughput")
    ours = {"seconds": 2.0, "decode_steps": [60, 62, 64]}          # training: one count per timed step
    peer = {"seconds_per_step": 3.0, "decode_steps": [50, 50, 50]}
    assert throughput.per_step_speedup(ours, peer) == pytest.approx((3.0 / 50) / (2.0 / 62))
    assert throughput.per_step_speedup({"seconds": 1.0, "decode_steps": 40},
                                       {"seconds": 1.0, "decode_steps": 80}) == pytest.approx(0.5)


def test_every_workload_is_held_to_the_runs_highest_matmul_peak():
    """The FLOP limit of every row comes from the highest peak of the run, also where a later measurement
    raised it; rows without FLOPs (training) only record the peak."""
    throughput = _benchmarks_module("throughput")
    rows = [{"batch": 64, "seconds": 1.2, "flops_per_instance": 5e9, "achieved_gflops": 5e9 * 64 / 1.2 / 1e9},
            {"batch": 1, "seconds": 0.05, "step_seconds": 0.05}]
    throughput.hold_to_peak(rows, 300.0)
    assert rows[0]["seconds_over_flop_limit"] == pytest.approx(1.2 / (5e9 * 64 / 300e9))
    throughput.hold_to_peak(rows, 360.0)
    assert rows[0]["flop_limit_seconds"] == pytest.approx(5e9 * 64 / 360e9)
    assert rows[0]["seconds_over_flop_limit"] == pytest.approx(1.2 * 360e9 / (5e9 * 64))
    assert rows[0]["fraction_of_matmul_peak"] == pytest.approx(5e9 * 64 / 1.2 / 360e9)
    assert rows[1]["matmul_peak_gflops"] == 360.0 and "seconds_over_flop_limit" not in rows[1]


def test_rl4co_feasibility_check_runs_once_and_covers_rounds_with_the_same_tours(monkeypatch):
    """RL4CO's slow feasibility check runs in the first inference round only; a later round is marked
    feasible only when it decoded the same tours (equal objective and steps), never by default."""
    throughput = _benchmarks_module("throughput")
    checks = []

    def fake_torch_row(mode, model, size, batch, aug, check_solution=True, **timing):
        checks.append(check_solution)
        seconds = 2.0 if check_solution else 1.0            # the unchecked round is the fastest
        return {"instances_per_second": batch / seconds, "seconds": seconds, "decode_steps": 30,
                "mean_objective": 7.5, "feasible": True if check_solution else None}

    ours = {"instances_per_second": 4.0, "seconds": 0.5, "decode_steps": 30, "compile_seconds": 1.0}
    monkeypatch.setattr(throughput, "torch_row", fake_torch_row)
    monkeypatch.setattr(throughput, "measure_infer", lambda *a, **k: dict(ours))
    row = throughput.run("infer", "pomo_mtl", 20, 2, None, with_torch=True, rounds=3)
    assert checks == [True, False, False]
    assert row["torch"]["seconds"] == 1.0 and row["torch"]["feasible"] is True

    rows = [{"mean_objective": 7.5, "decode_steps": 30, "feasible": True},
            {"mean_objective": 7.6, "decode_steps": 30, "feasible": None},      # other tours
            {"mean_objective": 7.5, "decode_steps": 31, "feasible": None}]
    throughput.carry_feasibility(rows)
    assert [r["feasible"] for r in rows] == [True, None, None]
    unchecked = [{"mean_objective": 7.5, "decode_steps": 30, "feasible": None}]
    throughput.carry_feasibility(unchecked)
    assert unchecked[0]["feasible"] is None


def test_peers_refuse_a_training_run_without_warm_up():
    """Both PyTorch peers refuse zero warm-up steps by name, before importing torch or the authors' code."""
    for module, train in (("torch_peer", "torch_train"), ("authors_peer", "authors_train")):
        fn = getattr(_benchmarks_module(module), train)
        args = ("mvmoe", 20, 2) + (("/nonexistent",) if module == "authors_peer" else ())
        with pytest.raises(ValueError, match="warmup must be at least 1 step, got 0"):
            fn(*args, warmup=0)


def test_training_benchmark_starts_from_the_given_checkpoint(tmp_path):
    from conftest import require_shared
    checkpoints = require_shared("fixtures", "torch-reference", "checkpoints")
    train_throughput = _benchmarks_module("train_throughput")
    row = train_throughput.measure("pomo_mtl", 20, 20, 4, 1, problems="CVRP",
                                   weights=str(checkpoints / "mtl_n20_fixture.pt"), warmup=2)
    assert row["weights"] == "mtl_n20_fixture.pt" and row["timed_steps"] == 1 and row["warmup_steps"] == 2
    assert row["steps_run"] == 3                                  # the compiling step, one more untimed, one timed
    assert row["instances_per_second"] > 0 and len(row["decode_steps"]) == 1
    with pytest.raises(ValueError, match="warmup counts the first .compiling. step: at least 1, got 0"):
        train_throughput.measure("pomo_mtl", 20, 20, 4, 1, warmup=0)
    # A checkpoint of another model is refused by name, not run.
    from mvmoe_jax.checkpoints import CheckpointMismatchError
    with pytest.raises(CheckpointMismatchError, match="holds a 'mvmoe' model.*asks for 'pomo_mtl'"):
        train_throughput.measure("pomo_mtl", 20, 20, 4, 1, problems="CVRP",
                                 weights=str(checkpoints / "moe_n20_fixture.pt"))


@pytest.mark.slow      # ~45 s; a diagnostic of the machine, not of this library's code paths
def test_batched_matmul_benchmark(tmp_path):
    out = tmp_path / "m.json"
    _run(["benchmarks/batched_matmul.py", "--repeats=1", f"--output={out}"])
    res = json.loads(out.read_text())
    shapes = _benchmarks_module("batched_matmul").SHAPES
    assert [r["shape"] for r in res["rows"]] == [s[0] for s in shapes] and res["device"]
    for r in res["rows"]:
        flops = 2.0 * r["m"] * r["k"] * r["n"] * float(np.prod(r["batch"]))
        assert r["seconds"] > 0 and r["gflops"] * 1e9 * r["seconds"] == pytest.approx(flops)


def test_paper_tables_group_and_format_the_evaluations(tmp_path):
    """benchmarks/paper_tables.py: trained and unseen means (the paper's only where it has every variant),
    Set-X size groups and Solomon classes from per-instance results, learning curves from a metrics file,
    and the markdown naming every model and section."""
    tables = _benchmarks_module("paper_tables")
    paper = {"CVRP": {"MVMoE/4E": {"n50": {"gap": "0.896"}}}, "OVRPBLTW": {"MVMoE/4E": {"n50": {"gap": "*"}}}}
    results = {"CVRP": {"mean": 10.5, "gap": 2.0, "seconds": 3.0}, "VRPTW": {"mean": 16.0, "gap": 4.0, "seconds": 4.0},
               "OVRPBLTW": {"mean": 9.0, "gap": 7.0, "seconds": 5.0}}
    rows = tables.dataset_rows(results, paper, "MVMoE/4E", 50)
    assert [r["paper_gap"] for r in rows] == [pytest.approx(0.896), None, None]
    means = tables.group_means(rows)
    assert means["trained"] == {"variants": 2, "gap": pytest.approx(3.0), "paper_gap": None}
    assert means["unseen"]["gap"] == pytest.approx(7.0) and means["unseen"]["paper_gap"] is None
    setx = tables.setx_groups({"X-n101-k25": {"n": 100, "gap": 2.0, "seconds": 1.0},
                               "X-n190-k8": {"n": 189, "gap": 4.0, "seconds": 3.0},
                               "X-n251-k28": {"n": 250, "gap": 9.0, "seconds": 5.0},
                               "X-n106-k14": {"n": 105, "gap": None, "seconds": 1.0}})
    assert [(g["instances"], g["gap"]) for g in setx] == [(2, pytest.approx(3.0)), (1, pytest.approx(9.0))]
    classes = tables.solomon_classes({"RC101": {"gap": 1.0, "seconds": 1.0}, "R101": {"gap": 3.0, "seconds": 1.0},
                                      "R102": {"gap": 5.0, "seconds": 1.0}, "C101": {"gap": None, "seconds": 1.0}})
    assert [(c["class"], c["instances"], c["gap"]) for c in classes] == [("R1", 2, pytest.approx(4.0)),
                                                                         ("RC1", 1, pytest.approx(1.0))]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in [
        {"epoch": 1, "train": {}},
        {"epoch": 2, "val": {"CVRP": {"obj": 1, "gap": 10.0}, "VRPTW": {"obj": 1, "gap": 20.0},
                             "OVRPB": {"obj": 1, "gap": 30.0}}}]) + "\n")
    assert tables.curve_points(str(metrics), 20000) == [{"epoch": 2, "instances": 40000, "trained": 15.0,
                                                         "unseen": 30.0}]
    assert os.path.getsize(tables.plot_curves({"m": tables.curve_points(str(metrics), 20000)},
                                              str(tmp_path / "c.png"))) > 0
    report = {"machine": "m", "commit": "c", "date": "d", "num_instances": 5,
              "models": {"ours": {"n50": {"rows": rows, "means": means}, "setx": {"rows": setx}}}}
    text = tables.markdown(report)
    assert "| CVRP | 2.00 (0.90) |" in text and "| mean, trained | 3.00 (-) |" in text
    assert "| 100 <= n < 200 | 2 | 3.00 | 2.00 |" in text and "Solomon" not in text
    assert tables.parse_models("mvmoe_4e_n50,ours=runs/a,runs/b") == [
        ("mvmoe_4e_n50", "mvmoe_4e_n50"), ("ours", "runs/a"), ("runs/b", "runs/b")]
    with pytest.raises(ValueError, match="a label appears twice"):
        tables.parse_models("m=runs/a,m=runs/b")


def test_paper_tables_keep_per_instance_outputs_only_when_asked(tmp_path, monkeypatch):
    """benchmarks/paper_tables.py run(): the report holds the tables; the evaluation's per-instance outputs are
    added under each section only with per_instance. The evaluation itself is replaced by a recorder here."""
    from mvmoe_jax import cli

    tables = _benchmarks_module("paper_tables")
    (tmp_path / "paper_results.json").write_text(json.dumps(
        {"results": {"CVRP": {"MVMoE/4E": {"n50": {"gap": "0.896"}}}}}))
    outputs = {"CVRP": {"mean": 10.5, "gap": 2.0, "seconds": 3.0, "objectives": [10.0, 11.0]}}
    calls = []
    monkeypatch.setattr(cli, "run_evaluation", lambda _, flags: calls.append(flags.checkpoint) or outputs)
    args = ([("m", "runs/m")], ["MVMoE/4E"], ["n50"], str(tmp_path), 2)
    lean = tables.run(*args)["models"]["m"]["n50"]
    full = tables.run(*args, per_instance=True)["models"]["m"]["n50"]
    assert calls == ["runs/m", "runs/m"]
    assert "results" not in lean and full["results"] == outputs
    assert lean["rows"] == full["rows"] and lean["rows"][0]["gap"] == pytest.approx(2.0)


def test_paper_tables_curves_from_a_shipped_card_and_bad_sources_refused(tmp_path, monkeypatch, capsys):
    """--curves takes a shipped model's name (the learning curve on its card) as well as a metrics.jsonl; an
    unknown name or a missing file is refused before any evaluation runs."""
    from mvmoe_jax import cli, shipped

    tables = _benchmarks_module("paper_tables")
    name = shipped.names()[0]
    card_curve = shipped.card(name)["learning_curve"]
    points = tables.curve_points(name)
    assert [(p["epoch"], p["instances"]) for p in points] == [(r["epoch"], r["instances"]) for r in card_curve]
    last = card_curve[-1]["gap"]
    assert points[-1]["trained"] == pytest.approx(np.mean([last[v] for v in tables.TRAINED]))
    assert points[-1]["unseen"] == pytest.approx(np.mean([g for v, g in last.items() if v not in tables.TRAINED]))
    monkeypatch.setattr(cli, "run_evaluation", lambda *_: pytest.fail("evaluated despite a bad --curves"))
    for curves, message in (("m=no_such_model", "is not a shipped model"),
                            (f"m={tmp_path / 'missing.jsonl'}", "No such file")):
        assert tables.main(["--models=runs/m", f"--curves={curves}", f"--output={tmp_path / 'r.json'}"]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tables.main(["--models=runs/m", "--curves=only_a_name", f"--output={tmp_path / 'r.json'}"])


def test_large_instances_report_plans_memory_and_checked_costs(tmp_path):
    """benchmarks/large_instances.py on one generated n = 200 instance with at most 20 starts: the plan within
    its budget, the checker agreeing with every cost, the report written; a size without a capacity refused."""
    from conftest import require_shared
    ckpt = require_shared("fixtures", "torch-reference", "checkpoints", "moe_n20_fixture.pt")
    large = _benchmarks_module("large_instances")
    out = tmp_path / "large.json"
    large.main([f"--checkpoint={ckpt}", "--sizes=200", "--variants=OVRPBLTW", "--num_instances=1",
                "--max_starts=20", "--ls_seconds=2", f"--output={out}"])
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert (row["n"], row["variant"], row["starts"]) == (200, "OVRPBLTW", 20)
    assert row["plan"].startswith("20 of 200 POMO starts") and 0 < row["plan_bytes"] <= row["budget_bytes"]
    assert row["feasible"] == 1 and row["cost_agrees"] and row["gap"] is None and "routes" not in row
    # The local search after greedy: checked, its cost the checker's, never worse, within its limit (plus a round).
    assert row["ls_feasible"] == 1 and row["ls_cost_agrees"] and row["ls_mean_cost"] <= row["mean_cost"] + 1e-9
    assert row["ls_limit_seconds"] == 2 and row["ls_gap"] is None
    text = (tmp_path / "large.md").read_text()
    assert "| 200 | OVRPBLTW | 20 of 200 POMO starts" in text and "| 200 | OVRPBLTW | plain |" in text
    with pytest.raises(SystemExit, match="size 300 has no defined capacity"):
        large.main([f"--checkpoint={ckpt}", "--sizes=300", f"--output={out}"])


def test_size_training_compares_arms_on_the_same_instances_with_their_training_cpu_time(tmp_path):
    """benchmarks/size_training.py: arms parsed, a workdir's CPU time summed from its metrics up to the epoch named,
    one n = 20 instance decoded by two arms of one checkpoint (plain, and with a bias) against a stored reference,
    every route checked; an alpha for a model that learned its own, and a workdir without its epoch, refused."""
    from conftest import require_shared
    ckpt = require_shared("fixtures", "torch-reference", "checkpoints", "moe_n20_fixture.pt")
    st = _benchmarks_module("size_training")
    assert st.parse_arm("a b=/runs/x@4:1.5") == {"label": "a b", "source": "/runs/x", "epoch": 4, "alpha": 1.5}
    assert st.parse_arm("s=mvmoe_4e_n50") == {"label": "s", "source": "mvmoe_4e_n50", "epoch": None, "alpha": None}
    with pytest.raises(SystemExit, match="expected LABEL=SOURCE"):
        st.parse_arm("no_label")
    workdir = tmp_path / "run"
    workdir.mkdir()
    rows = [{"epoch": 0}] + [{"epoch": e, "time": {"train_cpu_seconds": 100.0 * e}} for e in (1, 2, 3)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert st.training_cpu_seconds(str(workdir), 2) == 300.0
    with pytest.raises(SystemExit, match="metrics of 3 of its first 5 epochs"):
        st.training_cpu_seconds(str(workdir), 5)
    with pytest.raises(SystemExit, match=r"name the epoch of workdir .* \(@EPOCH\)"):
        st.load_arm(st.parse_arm(f"w={workdir}"))
    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps({"references": {"20 CVRP 1 60": {"costs": [4.0]}}}))
    out = tmp_path / "st.json"
    st.main([f"--arms=plain={ckpt},biased={ckpt}:20", "--sizes=20", "--variants=CVRP", "--num_instances=1",
             f"--references_from={refs}", f"--output={out}"])
    report = json.loads(out.read_text())
    assert [(a["label"], a["distance_bias"], a["learned"], a["training_cpu_hours"]) for a in report["arms"]] == [
        ("plain", 0.0, False, 0.0), ("biased", 20.0, False, 0.0)]
    plain, biased = report["rows"]
    for row in (plain, biased):
        assert row["feasible"] == 1 and row["cost_agrees"] and row["n"] == 20
        assert row["gap"] == pytest.approx((row["mean_cost"] - 4.0) / 4.0 * 100, rel=1e-6)
    assert plain["mean_cost"] != biased["mean_cost"]            # a near-greedy-by-distance decoder
    assert "| biased | 0.00 | 20.000 | 20 | CVRP | 1 |" in (tmp_path / "st.md").read_text()
    # benchmarks/large_instances.py keeps a learned bias and refuses a constant one for it.
    from mvmoe_jax.nn.policy import PolicyConfig
    large = _benchmarks_module("large_instances")
    learned = PolicyConfig(distance_bias=0.5, learned_distance_bias=True)
    assert large.with_decoding(learned, 0.0, 7) == PolicyConfig(distance_bias=0.5, learned_distance_bias=True,
                                                                 candidates=7)
    with pytest.raises(SystemExit, match="learned its distance bias; give ALPHA 0"):
        large.with_decoding(learned, 1.0, 0)


def test_search_vs_time_runs_each_search_asked_at_each_limit_and_lists_sgbs_depths(monkeypatch):
    """benchmarks/search_vs_time.py's policy rows: greedy once, then each search asked (SGBS and SGBS + EAS among
    them) at each time limit, in the report's order; an SGBS row keeps its mean depths, which the table shows
    beside the rounds. The searches themselves are replaced by a recorder (they are tested in test_sgbs.py)."""
    import types

    import mvmoe_jax.solve

    svt = _benchmarks_module("search_vs_time")
    calls = []

    def solve_instances(cfg, params, batch, *, search, seed, time_limit=None):
        calls.append((search, time_limit))
        depths = [40, 45] if search.startswith("sgbs") else [None, None]
        return [types.SimpleNamespace(cost=c, seconds=0.5, feasible=True, rounds=2, samples=None, depths=d)
                for c, d in zip((1.1, 2.2), depths)]

    monkeypatch.setattr(mvmoe_jax.solve, "solve_instances", solve_instances, raising=False)
    reference = np.array([1.0, 2.0])
    rows = svt.policy_rows(None, params=None, batch=None, reference=reference, time_limits=[0.5, 2.0], seed=0,
                           methods=["greedy", "sgbs_eas", "eas", "sgbs"])
    assert calls == [("greedy", None), ("eas", 0.5), ("sgbs", 0.5), ("sgbs_eas", 0.5), ("eas", 2.0), ("sgbs", 2.0),
                     ("sgbs_eas", 2.0)]
    assert [r["method"] for r in rows] == ["greedy x8", "eas", "sgbs", "sgbs_eas", "eas", "sgbs", "sgbs_eas"]
    assert rows[2]["depths"] == 42.5 and "depths" not in rows[1] and rows[2]["gap"] == pytest.approx(10.0)
    text = svt.markdown({"checkpoint": "m", "num_instances": 2, "workers": 2,
                         "variants": {"CVRP": {"machine": "cpu", "commit": "abc", "date": "2026-12-07", "rows": rows}}})
    assert "| CVRP | sgbs | 0.5 | 10.00 | 0.50 | - | 2/2 | 2 (42) |" in text
    assert "| CVRP | eas | 2 | 10.00 | 0.50 | - | 2/2 | 2 |" in text
    assert "| CVRP | greedy x8 | - | 10.00 | 0.50 | - | 2/2 | - |" in text


def test_search_vs_time_resumes_its_report_measuring_only_the_missing_variants(tmp_path, monkeypatch):
    """benchmarks/search_vs_time.py: every variant's rows saved with the machine that measured them; --resume
    measures only what the report lacks and refuses a report made with other settings. The methods themselves
    are replaced by recorders here (sampling and EAS are tested in test_solve.py and test_eas.py)."""
    from conftest import require_shared
    from mvmoe_jax import checkpoints, problems

    data_dir = require_shared("data", "mvmoe-paper")
    svt = _benchmarks_module("search_vs_time")
    measured = []

    def policy_rows(cfg, params, batch, reference, time_limits, seed, methods, improve):
        measured.append(("policy", len(reference), tuple(time_limits), tuple(methods)))
        costs = np.asarray(reference) * 1.1
        return [svt._row("greedy x8", None, costs, reference, 1.0, len(costs))]

    def baseline_rows(batch, variant, reference, time_limits, workers, solvers):
        measured.append(("baselines", variant, tuple(solvers)))
        return [svt._row("ortools", t, np.asarray(reference), reference, 2.0, len(reference)) for t in time_limits]

    monkeypatch.setattr(svt, "policy_rows", policy_rows)
    monkeypatch.setattr(svt, "baseline_rows", baseline_rows)
    monkeypatch.setattr(checkpoints, "load_policy", lambda name: (None, None))
    out = tmp_path / "svt.json"
    common = ["--checkpoint=m", "--num_instances=3", "--time_limits=0.5,2", "--solvers=ortools", "--workers=2",
              f"--data_dir={data_dir}", f"--output={out}"]
    svt.main(common + ["--variants=CVRP"])
    assert measured == [("policy", 3, (0.5, 2.0), ("greedy", "sampling", "eas")), ("baselines", "CVRP", ("ortools",))]
    first = json.loads(out.read_text())["variants"]["CVRP"]
    assert first["machine"] and first["commit"] and [r["method"] for r in first["rows"]] == ["greedy x8", "ortools",
                                                                                          "ortools"]
    assert first["rows"][0]["gap"] == pytest.approx(10.0, rel=1e-6) and first["rows"][1]["gap"] == pytest.approx(0.0)

    measured.clear()
    svt.main(common + ["--variants=CVRP,VRPBL", "--resume"])
    assert measured == [("policy", 3, (0.5, 2.0), ("greedy", "sampling", "eas")), ("baselines", "VRPBL", ("ortools",))]
    report = json.loads(out.read_text())
    assert list(report["variants"]) == ["CVRP", "VRPBL"] and report["variants"]["CVRP"] == first
    text = (tmp_path / "svt.md").read_text()
    assert "- CVRP, VRPBL: " in text and "| VRPBL | ortools | 2 | 0.00 | 0.67 | - | 3/3 |" in text
    assert (tmp_path / "svt.png").read_bytes()[:4] == b"\x89PNG"

    with pytest.raises(SystemExit, match=r"other settings \(num_instances: report 3, now 4\)"):
        svt.main([a if not a.startswith("--num_instances") else "--num_instances=4" for a in common] + ["--resume"])
    with pytest.raises(SystemExit, match=r"\(methods: report \['greedy', 'sampling', 'eas'\], now \['eas'\]\)"):
        svt.main(common + ["--methods=eas", "--resume"])
    with pytest.raises(SystemExit, match="no report to continue"):
        svt.main(common[:-1] + [f"--output={tmp_path / 'none.json'}", "--resume"])
    with pytest.raises(SystemExit, match="--methods: unknown beam; the policy's searches are greedy, sampling, eas"):
        svt.main(common + ["--methods=greedy,beam"])
    with pytest.raises(SystemExit, match="--improve: unknown 2opt; choose from none, ls, ortools_ls"):
        svt.main(common + ["--improve=ls,2opt"])

    # Every variant at one limit, EAS and OR-Tools alone: a grid of panels, one per variant.
    measured.clear()
    every = tmp_path / "every.json"
    svt.main([a for a in common if not a.startswith(("--output", "--time_limits"))]
             + ["--variants=ALL", "--time_limits=2", "--methods=greedy,eas", f"--output={every}"])
    assert {m[3] for m in measured if m[0] == "policy"} == {("greedy", "eas")}
    assert len(measured) == 32 and list(json.loads(every.read_text())["variants"]) == list(problems.VARIANT_NAMES)
    assert (tmp_path / "every.png").read_bytes()[:4] == b"\x89PNG"


def test_search_vs_time_improves_routes_by_the_local_search_and_by_ortools():
    """The rows of --improve: routes improved by our local search and by OR-Tools' from the same start (one route
    per customer), checked by the environment's checker, never worse than the start."""
    import jax

    from mvmoe_jax import checker, instances

    svt = _benchmarks_module("search_vs_time")
    batch = instances.take(instances.generate(jax.random.key(3), 8, 20, "VRPBLTW"), np.arange(2))
    routes = [[[c] for c in range(1, 21)]] * 2
    start = np.array([checker.tours_cost(np.asarray(batch.locs[i], np.float64), routes[i], False) for i in range(2)])
    for improvement in ("ls", "ortools_ls"):
        costs, seconds, feasible = svt.improved_routes(batch, routes, improvement)
        assert feasible == 2 and np.all(costs < start) and np.all(seconds > 0), improvement
    with pytest.raises(ValueError, match="unknown improvement 'x'"):
        svt.improved_routes(batch, routes, "x")


def test_vrpb_queiroga_reports_rounded_costs_gaps_and_both_verdicts(tmp_path, monkeypatch):
    """benchmarks/vrpb_queiroga.py on a tiny VRPB file: the rounded cost and the gap to the .sol's cost recomputed
    here, both checkers' verdicts, the local search's row never worse, a resumed run measuring nothing again.
    The model's search is replaced by a stand-in (one route per linehaul, each backhaul after one of them);
    OR-Tools runs for real, briefly."""
    import math

    vq = _benchmarks_module("vrpb_queiroga")
    coords = [(50, 50), (10, 50), (90, 50), (50, 90), (50, 10), (20, 55), (80, 45), (55, 85), (45, 15), (30, 50)]
    delivery = [0, 4, 3, 5, 2, 0, 0, 0, 0, 0]
    pickup = [0, 0, 0, 0, 0, 3, 4, 2, 5, 3]
    rows = lambda v: "".join(f"{i + 1}\t{x}\n" for i, x in enumerate(v))
    (tmp_path / "T-n10.vrp").write_text(
        "NAME: T-n10\nTYPE: VRPB\nDIMENSION: 10\nCAPACITY: 10\nEDGE_WEIGHT_TYPE: EUC_2D\nNODE_COORD_SECTION\n"
        + "".join(f"{i + 1}\t{x}\t{y}\n" for i, (x, y) in enumerate(coords)) + "DEMAND_SECTION\n" + rows(delivery)
        + "BACKHAUL_SECTION\n" + rows(pickup) + "DEPOT_SECTION\n1\n-1\nEOF\n")
    (tmp_path / "T-n10.sol").write_text("Route #1: 1 8 4\nCost: 200\n")

    def rounded(routes):
        return sum(math.floor(math.dist(coords[a], coords[b]) + 0.5)
                   for r in routes for a, b in zip([0, *r], [*r, 0]))

    stand_in = [[1, 9], [2, 6], [3, 7], [4, 5, 8]]       # customers 1..9 = file nodes 2..10
    calls = []

    def neural(path, search, **kwargs):
        calls.append(search)
        return stand_in, 0.25, {"starts": 4}

    monkeypatch.setattr(vq, "neural", neural)
    out = tmp_path / "report.json"
    argv = [f"--data_dir={tmp_path}", "--methods=greedy,ortools", "--improve=ls", "--seconds=0.3",
            f"--output={out}"]
    assert vq.main(argv) == 0
    report = json.loads(out.read_text())
    (entry,) = report["instances"]
    assert entry["name"] == "T-n10" and entry["n"] == 9 and entry["bks"] == 200
    by = {r["method"]: r for r in entry["rows"]}
    assert list(by) == ["greedy", "greedy+ls", "ortools"]
    assert by["greedy"]["cost"] == rounded(stand_in)
    for r in by.values():
        assert r["checker_feasible"] and r["pyvrp_feasible"], r
        assert r["cost"] == rounded(r["solution"]) == r["pyvrp_distance"]
        assert r["gap"] == pytest.approx((r["cost"] - 200) / 200 * 100)
    assert by["greedy+ls"]["cost"] <= by["greedy"]["cost"]
    text = (tmp_path / "report.md").read_text()
    assert f"| T-n10 | 9 | 200 | greedy x8 | {rounded(stand_in)} |" in text and report["machine"]
    assert vq.main(argv + ["--resume"]) == 0 and calls == ["greedy"]
    with pytest.raises(SystemExit, match="other settings"):
        vq.main(argv[:-2] + ["--seconds=1", f"--output={out}", "--resume"])
    with pytest.raises(SystemExit, match="unknown 'sgbs'"):
        vq.main(argv + ["--methods=sgbs"])


def test_backhaul_rules_zero_shot_compares_greedy_with_ortools_under_each_rule(tmp_path, monkeypatch):
    """benchmarks/backhaul_rules_zero_shot.py: servable instances under each rule, the gap over the instances both
    solved (greedy replaced by a stand-in that costs 10 % more than OR-Tools on one instance and dead-ends on the
    other), OR-Tools for real and checked, the report written."""
    import jax

    from mvmoe_jax import checker, checkpoints

    zs = _benchmarks_module("backhaul_rules_zero_shot")
    batch, drawn = zs.servable_batch("VRPBTW", "classic", 20, 3, seed=0)
    assert batch.locs.shape[0] == 3 and drawn >= 3
    assert not np.asarray(checker.unreachable_customers(batch)).any()
    assert np.all(np.asarray(batch.backhaul_rule) == 1)
    seen = {}

    def greedy(cfg, params, b):
        costs = zs.ortools(b, 0.1) * 1.1
        costs[1] = np.inf
        seen[int(b.backhaul_rule[0])] = costs
        return costs, 0.5

    monkeypatch.setattr(zs, "greedy", greedy)
    monkeypatch.setattr(checkpoints, "load_policy", lambda name: (None, None))
    out = tmp_path / "zs.json"
    assert zs.main(["--n=20", "--num_instances=2", "--variants=VRPB", "--rules=classic,mixed",
                    "--ortools_seconds=0.1", f"--output={out}"]) == 0
    report = json.loads(out.read_text())
    assert [(r["rule"], r["variant"]) for r in report["rows"]] == [("classic", "VRPB"), ("mixed", "VRPB")]
    for r in report["rows"]:
        assert r["greedy_solved"] == 1 and r["ortools_solved"] == 2
        # OR-Tools runs twice (stand-in and row) within 0.1 s each: its two costs may differ slightly.
        assert r["gap"] == pytest.approx((r["greedy_costs"][0] / r["ortools_costs"][0] - 1) * 100)
        assert r["greedy_costs"][1] is None
    assert "| classic | VRPB |" in (tmp_path / "zs.md").read_text()
    # Another model on the same references: OR-Tools' costs read back, not solved again.
    monkeypatch.setattr(zs, "ortools", lambda b, seconds: pytest.fail("OR-Tools solved again"))
    monkeypatch.setattr(zs, "greedy", lambda cfg, params, b: (np.array([1.0, np.inf]), 0.5))
    again = tmp_path / "again.json"
    assert zs.main(["--n=20", "--num_instances=2", "--variants=VRPB", "--rules=classic,mixed", "--ortools_seconds=0.1",
                    f"--ortools_from={out}", "--trained_rules=paper,mixed", f"--output={again}"]) == 0
    reused = json.loads(again.read_text())
    assert [r["ortools_costs"] for r in reused["rows"]] == [r["ortools_costs"] for r in report["rows"]]
    assert "trained under the paper, mixed rule(s)" in (tmp_path / "again.md").read_text()
    with pytest.raises(SystemExit, match="differ from this run's"):
        zs.main(["--n=20", "--num_instances=3", "--variants=VRPB", "--rules=mixed", "--ortools_seconds=0.1",
                 f"--ortools_from={out}", f"--output={again}"])
    with pytest.raises(SystemExit, match="no backhauls"):
        zs.main(["--variants=CVRP", f"--output={out}"])


def test_setx_by_size_picks_files_across_each_group_and_reports_each_configuration(tmp_path, monkeypatch):
    """benchmarks/setx_by_size.py: files spread over each size group, best-known values from their .sol files, one
    solve with the size defaults, one without the local search and one without it and the distance bias (a
    stand-in here), the report by group with the local search's seconds counted."""
    import types

    from mvmoe_jax import solve

    sx = _benchmarks_module("setx_by_size")
    for nodes in (101, 106, 110, 125, 303, 1001):
        (tmp_path / f"X-n{nodes}-k5.vrp").write_text("unused\n")
        (tmp_path / f"X-n{nodes}-k5.sol").write_text(f"Route #1: 1 2\nCost {10 * nodes}\n")
    (tmp_path / "X-n120-k5.vrp").write_text("no .sol beside it\n")
    assert sx.choose_files(str(tmp_path), [(100, 299), (300, 599), (600, 1000)], 3) == {
        (100, 299): ["X-n101-k5", "X-n110-k5", "X-n125-k5"], (300, 599): ["X-n303-k5"], (600, 1000): ["X-n1001-k5"]}
    calls = []

    def fake_solve(paths, *, checkpoint, bks, **options):
        table = json.loads(open(bks).read())["Set-X"]
        calls.append(options)
        names = [os.path.basename(p)[:-4] for p in paths]
        extra = 0.3 if options.get("distance_bias") == 0.0 else 0.2 if options.get("improve") == "none" else 0.1
        ls = 0.0 if options.get("improve") == "none" else 2.0
        sols = [types.SimpleNamespace(name=n, gap=extra * 100, feasible=True, seconds=1.0, improve_seconds=ls,
                                      starts=50, convention_cost=table[n] * (1 + extra)) for n in names]
        return types.SimpleNamespace(solutions=sols)

    monkeypatch.setattr(solve, "solve", fake_solve)
    out = tmp_path / "setx.json"
    assert sx.main([f"--data_dir={tmp_path}", "--per_group=2", "--groups=100-299,400-500,600-1000",
                    f"--output={out}"]) == 0
    assert calls == [{}, {"improve": "none"}, {"improve": "none", "distance_bias": 0.0}]
    report = json.loads(out.read_text())
    assert [g["group"] for g in report["groups"]] == ["100-299", "600-1000"]      # 400-500 holds no file
    first = report["groups"][0]
    assert first["instances"] == ["X-n101-k5", "X-n125-k5"] and first["feasible"] == 6
    assert first["defaults"]["mean_gap"] == pytest.approx(10.0)
    assert first["defaults"]["seconds_per_instance"] == pytest.approx(3.0)
    assert first["no local search"]["mean_gap"] == pytest.approx(20.0)
    assert first["neither"]["mean_gap"] == pytest.approx(30.0)
    assert "| 100-299 | X-n101-k5, X-n125-k5 | 10.00 | 3.0 | 20.00 | 1.0 | 30.00 | 1.0 | 6/6 |" in (
        tmp_path / "setx.md").read_text()
    for bad in ("100", "300-200", "a-b"):
        with pytest.raises(SystemExit, match="expected LOW-HIGH"):
            sx.main([f"--data_dir={tmp_path}", f"--groups={bad}"])
    with pytest.raises(SystemExit, match="falls in --groups"):
        sx.main([f"--data_dir={tmp_path}", "--groups=2000-3000"])


def test_vrptw_classes_groups_files_by_class_with_their_best_known_values(tmp_path, monkeypatch):
    """benchmarks/vrptw_classes.py: files grouped into the six classes in order of number (Solomon and
    Gehring-Homberger names), best-known values from .sol files or BKS.json, the defaults and the run without the
    local search per class (a stand-in solve), classes without a best-known value reported without a gap."""
    import types

    from mvmoe_jax import solve

    vc = _benchmarks_module("vrptw_classes")
    assert [vc.instance_class(n) for n in ("C101", "c208", "R1_10_3", "RC2_10_10", "rc105")] == [
        "C1", "C2", "R1", "RC2", "RC1"]
    data = tmp_path / "set"
    data.mkdir()
    for name in ("C110", "C102", "C101", "R201", "RC101"):
        (data / f"{name}.txt").write_text("unused\n")
    (data / "C101.sol").write_text("Route #1: 1\nCost 100.0\n")
    (tmp_path / "BKS.json").write_text(json.dumps({"Set-Solomon": {"C102": 200.0, "RC101": 400.0}}))
    assert vc.choose_files(str(data), 2) == {"C1": [str(data / "C101.txt"), str(data / "C102.txt")],
                                             "R2": [str(data / "R201.txt")], "RC1": [str(data / "RC101.txt")]}
    calls = []

    def fake_solve(paths, *, checkpoint, bks, **options):
        table = json.loads(open(bks).read())["solomon"]
        calls.append(options)
        extra = 0.2 if options.get("improve") == "none" else 0.1
        sols = []
        for p in paths:
            name = os.path.basename(p)[:-4]
            cost = table.get(name, 1000.0) * (1 + extra)
            sols.append(types.SimpleNamespace(name=name, convention_cost=cost, feasible=True, seconds=1.0,
                                              improve_seconds=0.0 if extra == 0.2 else 0.5,
                                              gap=extra * 100 if name in table else None))
        return types.SimpleNamespace(solutions=sols)

    monkeypatch.setattr(solve, "solve", fake_solve)
    out = tmp_path / "classes.json"
    assert vc.main([f"--data_dir={data}", "--per_class=2", f"--output={out}"]) == 0
    assert calls == [{}, {"improve": "none"}]
    rows = {r["class"]: r for r in json.loads(out.read_text())["classes"]}
    assert set(rows) == {"C1", "R2", "RC1"} and rows["C1"]["files"] == 2
    assert rows["C1"]["defaults"]["with_bks"] == 2 and rows["C1"]["defaults"]["mean_gap"] == pytest.approx(10.0)
    assert rows["C1"]["no local search"]["mean_gap"] == pytest.approx(20.0)
    assert rows["C1"]["defaults"]["seconds_per_instance"] == pytest.approx(1.5)
    assert rows["R2"]["defaults"]["mean_gap"] is None and rows["R2"]["defaults"]["with_bks"] == 0
    text = (tmp_path / "classes.md").read_text()
    assert "| C1 | 2 | 2 | 10.00 | 1.5 | 20.00 | 1.0 | 4/4 |" in text and "| R2 | 1 | 0 | - | 1.5 | - | 1.0 | 2/2 |" in text
    with pytest.raises(SystemExit, match="no such folder"):
        vc.main([f"--data_dir={tmp_path / 'missing'}"])


def test_setx_search_puts_each_search_beside_or_tools_at_equal_wall_time(tmp_path, monkeypatch):
    """benchmarks/setx_search.py: greedy and each search named through mvmoe_jax.solve (a stand-in here, recording
    the time limit it was given), OR-Tools for real with workers x seconds per instance, gaps to the .sol costs and
    every OR-Tools route checked, costs in the file's convention."""
    import math
    import types

    from mvmoe_jax import solve

    ss = _benchmarks_module("setx_search")
    xy = [(0, 0), (10, 0), (0, 10), (-10, 0), (0, -10), (7, 7)]
    text = ("NAME : X-n6-k2\nTYPE : CVRP\nDIMENSION : 6\nEDGE_WEIGHT_TYPE : EUC_2D\nCAPACITY : 10\nNODE_COORD_SECTION\n"
            + "".join(f"{i + 1} {x} {y}\n" for i, (x, y) in enumerate(xy))
            + "DEMAND_SECTION\n1 0\n2 4\n3 4\n4 4\n5 4\n6 2\nDEPOT_SECTION\n1\n-1\nEOF\n")
    (tmp_path / "X-n6-k2.vrp").write_text(text)
    (tmp_path / "X-n6-k2.sol").write_text("Route #1: 1 5 2\nRoute #2: 3 4\nCost 50\n")
    calls = []

    def fake_solve(paths, *, checkpoint, bks, **options):
        calls.append(options)
        best = json.loads(open(bks).read())["Set-X"]["X-n6-k2"]
        return types.SimpleNamespace(solutions=[types.SimpleNamespace(
            name="X-n6-k2", convention_cost=55.0, gap=(55.0 - best) / best * 100, seconds=0.2, improve_seconds=0.1,
            feasible=True, rounds=3)])

    monkeypatch.setattr(solve, "solve", fake_solve)
    out = tmp_path / "search.json"
    assert ss.main([f"--data_dir={tmp_path}", "--group=1-10", "--count=1", "--seconds=0.25", "--workers=1",
                    f"--output={out}"]) == 0
    assert calls == [{}, {"search": "sgbs_eas", "time_limit": 0.25}]
    report = json.loads(out.read_text())
    assert report["methods"]["sgbs_eas"]["X-n6-k2"]["gap"] == pytest.approx(10.0)
    assert report["summary"]["greedy"]["seconds_per_instance"] == pytest.approx(0.3)
    ortools = report["methods"]["OR-Tools"]["X-n6-k2"]
    assert ortools["feasible"]
    assert sorted(v for v in ortools["route"] if v) == [1, 2, 3, 4, 5]
    seq = [0, *ortools["route"], 0]
    rounded = sum(math.floor(math.dist(xy[a], xy[b]) + 0.5) for a, b in zip(seq, seq[1:]) if a or b)
    assert ortools["cost"] == pytest.approx(rounded) and ortools["gap"] == pytest.approx((rounded - 50) / 50 * 100)
    assert "| mean | **10.00** |" in (tmp_path / "search.md").read_text()
