"""The training recipe per CPU-hour: train MVMoE/4E from scratch under each recipe (arm) for the same CPU time,
several seeds each, and compare the validation gap (greedy from all starts, no augmentation, all 16 variants
on fixed sets with reference solutions) against CPU seconds and against instances.

    python scripts/make_validation_sets.py benchmarks/data/validation_n20 --size=20 --instances=100
    python benchmarks/recipe_study.py --runs_dir=/tmp/recipe_study --epochs=5 --seeds=1,2 \
        --output=benchmarks/results/recipe_study_n20.json

Each run is ``train.py`` with ``configs/mvmoe_paper.py`` and the arm's config fields, pinned to one core
(``taskset``, one XLA thread), ``--parallel`` runs at a time; runs are compared at equal training CPU seconds
(the process's CPU time, which other load on the machine does not inflate as it does wall time). A run whose workdir already holds its last epoch is not run again (``--summarize_only`` runs none),
so an interrupted study continues. The report holds every validation point of every run, and per arm the
mean over seeds at the last point all its seeds reached, with the seeds' spread; a plot of the gap against
CPU seconds is written beside it (``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine import cpu_model, write_report  # noqa: E402
from mvmoe_jax import problems  # noqa: E402

# RouteFinder's recipe (its configs): Adam 3e-4, batch 256, variants mixed in every batch, rewards divided by a
# per-variant exponential moving mean cost (alpha 0.25), gradient norm clipped at 1.0.
ROUTEFINDER = dict(batch_size=256, learning_rate=3e-4, mixed_batches=True, reward_normalization_alpha=0.25,
                   grad_clip_norm=1.0)


def arm_overrides(name: str, problem_size: int) -> dict:
    """The config fields an arm sets on top of configs/mvmoe_paper.py (the paper's recipe)."""
    arms = {
        "paper": {},
        "routefinder": ROUTEFINDER,
        # A larger rate with a warm-up over the first tenth of the run and a cosine decay to 1 % at its end.
        "rf_warmup_cosine": dict(ROUTEFINDER, learning_rate=1e-3, lr_schedule="warmup_cosine",
                                 warmup_fraction=0.1, final_lr_fraction=0.01),
        # Half the POMO starts per training instance: half the decoding per instance.
        "rf_half_starts": dict(ROUTEFINDER, train_pomo_size=problem_size // 2),
        # The leader reward (Wang et al., 2024): the best start's advantage x (1 + alpha), alpha = 2.
        "rf_leader": dict(ROUTEFINDER, leader_advantage=3.0),
    }
    if name not in arms:
        raise ValueError(f"unknown arm {name!r}; arms: {', '.join(arms)}")
    return arms[name]


ARMS = ("paper", "routefinder", "rf_warmup_cosine", "rf_half_starts", "rf_leader")


def run_command(arm: str, seed: int, args) -> tuple[list[str], str, int]:
    """(train.py command, workdir, epochs) of one run: ``args.epochs`` epochs of ``args.epoch_instances``, an
    arm that halves the cost of an instance (fewer starts) twice as many, so that every arm reaches the CPU
    time at which the arms are compared."""
    epochs = args.epochs * (2 if arm_overrides(arm, args.problem_size).get("train_pomo_size") else 1)
    fields = dict(seed=seed, problem_size=args.problem_size, pomo_size=args.problem_size,
                  train_episodes=args.epoch_instances, epochs=epochs, validation_problems="ALL",
                  validation_instances=args.validation_instances, validation_batch_size=args.validation_instances,
                  validate_every_epochs=1, data_dir=args.data_dir, keep_checkpoints=1, progress_bar=False)
    fields.update(arm_overrides(arm, args.problem_size))
    workdir = os.path.join(args.runs_dir, f"{arm}_seed{seed}")
    cmd = [sys.executable, str(REPO / "train.py"), f"--config={REPO / 'configs' / 'mvmoe_paper.py'}",
           f"--config.workdir={workdir}", "--config.execution.cpu_devices=1"]
    cmd += [f"--config.{k}={v}" for k, v in fields.items()]
    return cmd, workdir, epochs


def finished(workdir: str) -> bool:
    """Whether a run has ended: ``done.json`` is written when its train.py exits cleanly (run again, train.py
    would resume it and train on)."""
    return os.path.exists(os.path.join(workdir, "done.json"))


def run_all(runs: list[tuple[str, int]], args) -> None:
    """Run the unfinished runs, ``args.parallel`` at a time, each pinned to its own core."""
    pending = [(arm, seed) for arm, seed in runs if not finished(run_command(arm, seed, args)[1])]
    active: dict[int, tuple[subprocess.Popen, str, str]] = {}
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    while pending or active:
        for core in range(args.parallel):
            if core not in active and pending:
                arm, seed = pending.pop(0)
                cmd, workdir, _ = run_command(arm, seed, args)
                os.makedirs(workdir, exist_ok=True)
                log = open(os.path.join(workdir, "train.log"), "a")
                print(f"core {core}: {arm} seed {seed} -> {workdir}", flush=True)
                proc = subprocess.Popen(["taskset", "-c", str(core), "nice", "-n", str(args.nice)] + cmd,
                                        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
                active[core] = (proc, workdir, f"{arm} seed {seed}")
        time.sleep(5)
        for core, (proc, workdir, name) in list(active.items()):
            if proc.poll() is not None:
                del active[core]
                if proc.returncode != 0:
                    print(f"{name} failed (exit {proc.returncode}); see {workdir}/train.log", flush=True)
                    continue
                with open(os.path.join(workdir, "done.json"), "w") as f:
                    json.dump({"cpu": cpu_model(), "finished": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
                print(f"{name} done", flush=True)


def run_points(workdir: str) -> list[dict]:
    """Every validation point of a run: epoch, instances, cumulative training CPU seconds (the process's, all
    its threads; compilation included), mean gap over the training variants, the unseen ones and all, and
    the gap per variant."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
    trained = set(problems.TRAIN_VARIANTS)
    seconds = instances = 0.0
    points = []
    for r in rows:
        t = r.get("time", {})
        seconds += t.get("train_cpu_seconds", 0.0)
        instances += t.get("instances_per_second", 0.0) * t.get("train_seconds", 0.0)
        if "val" not in r:
            continue
        gaps = {k: v["gap"] for k, v in r["val"].items()}
        if any(g is None for g in gaps.values()):
            raise ValueError(f"{workdir}: validation without reference solutions; build the sets with "
                             "scripts/make_validation_sets.py")
        mean = lambda names: sum(gaps[n] for n in names) / len(names)   # noqa: E731
        seen = [n for n in gaps if n in trained]
        unseen = [n for n in gaps if n not in trained]
        points.append({"epoch": r["epoch"], "instances": round(instances), "train_seconds": round(seconds, 1),
                       "trained": mean(seen), "unseen": mean(unseen), "all": mean(list(gaps)), "gaps": gaps})
    return points


def summarize(runs: list[tuple[str, int]], args) -> dict:
    by_arm: dict[str, dict[int, list[dict]]] = {}
    for arm, seed in runs:
        workdir = run_command(arm, seed, args)[1]
        if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
            by_arm.setdefault(arm, {})[seed] = run_points(workdir)
    arms = {}
    for arm, seeds in by_arm.items():
        # Compare at the CPU time every seed of every arm reached, and at each run's own last point.
        finals = {seed: pts[-1] for seed, pts in seeds.items() if pts}
        arms[arm] = {"overrides": arm_overrides(arm, args.problem_size), "seeds": sorted(seeds),
                     "last": {k: _mean_spread([p[k] for p in finals.values()])
                              for k in ("trained", "unseen", "all", "train_seconds", "instances")}}
    common = min((pts[-1]["train_seconds"] for seeds in by_arm.values() for pts in seeds.values() if pts),
                 default=0.0)
    for arm, seeds in by_arm.items():
        at = [_at_seconds(pts, common) for pts in seeds.values() if pts]
        arms[arm]["at_common_seconds"] = {k: _mean_spread([p[k] for p in at]) for k in ("trained", "unseen", "all")}
    return {"problem_size": args.problem_size, "epochs": args.epochs, "epoch_instances": args.epoch_instances,
            "cpu": cpu_model(),
            "data_dir": args.data_dir, "common_seconds": common, "arms": arms,
            "runs": {arm: {str(s): pts for s, pts in seeds.items()} for arm, seeds in by_arm.items()}}


def _mean_spread(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def _at_seconds(points: list[dict], seconds: float) -> dict:
    """The gaps at ``seconds`` of training, interpolated linearly between the validation points around it."""
    before = [p for p in points if p["train_seconds"] <= seconds]
    after = [p for p in points if p["train_seconds"] >= seconds]
    if not before or not after:
        return (before or after)[-1 if before else 0]
    a, b = before[-1], after[0]
    w = 0.0 if b["train_seconds"] == a["train_seconds"] else (seconds - a["train_seconds"]) / (
        b["train_seconds"] - a["train_seconds"])
    return {k: a[k] + w * (b[k] - a[k]) for k in ("trained", "unseen", "all")}


def markdown(report: dict) -> str:
    lines = [f"Training recipes at n = {report['problem_size']}, MVMoE/4E from scratch, one core per run "
             f"({report['cpu']}); greedy gap % (all starts, no augmentation) over 6 trained / 10 unseen variants, "
             "mean over seeds (min-max).", "",
             f"| arm | at {report['common_seconds']:.0f} CPU s: trained | unseen | last point: CPU s | instances "
             "| trained | unseen |", "|---|---|---|---|---|---|---|"]
    fmt = lambda d: f"{d['mean']:.2f} ({d['min']:.2f}-{d['max']:.2f})"    # noqa: E731
    for arm, a in sorted(report["arms"].items(), key=lambda kv: kv[1]["at_common_seconds"]["trained"]["mean"]):
        c, last = a["at_common_seconds"], a["last"]
        lines.append(f"| {arm} | {fmt(c['trained'])} | {fmt(c['unseen'])} | {last['train_seconds']['mean']:.0f} | "
                     f"{last['instances']['mean']:.0f} | {fmt(last['trained'])} | {fmt(last['unseen'])} |")
    return "\n".join(lines) + "\n"


def gap_figure():
    """A figure of two panels, trained and unseen variants' gap against CPU-hours: (fig, axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, 2, figsize=(11, 4))


def save_gap_figure(fig, axes, title: str, path: str) -> None:
    """Labels the panels of ``gap_figure`` (title: what precedes each panel's variant group) and saves it."""
    import matplotlib.pyplot as plt

    for ax, key in zip(axes, ("6 trained variants", "10 unseen variants")):
        ax.set_xlabel("CPU-hours (one core, compilation included)")
        ax.set_ylabel("greedy gap % (no augmentation)")
        ax.set_title(f"{title}: {key}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(report: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, axes = gap_figure()
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, seeds) in enumerate(sorted(report["runs"].items())):
        for j, pts in enumerate(seeds.values()):
            pts = [p for p in pts if p["epoch"] > 0]     # the untrained start (about 100 %) would flatten the rest
            for ax, key in zip(axes, ("trained", "unseen")):
                ax.plot([p["train_seconds"] / 3600 for p in pts], [p[key] for p in pts], color=colours[i % 10],
                        alpha=0.8, label=arm if j == 0 else None)
    save_gap_figure(fig, axes, f"n = {report['problem_size']}", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs_dir", required=True, help="one workdir per run is made here")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--problem_size", type=int, default=20)
    p.add_argument("--epochs", type=int, default=5, help="epochs per run (twice as many for fewer starts)")
    p.add_argument("--epoch_instances", type=int, default=5120)
    p.add_argument("--validation_instances", type=int, default=100)
    p.add_argument("--data_dir", default=str(REPO / "benchmarks" / "data" / "validation_n20"))
    p.add_argument("--parallel", type=int, default=2, help="runs at a time, one core each")
    p.add_argument("--nice", type=int, default=0, help="the runs' priority (nice); negative needs root")
    p.add_argument("--summarize_only", action="store_true")
    p.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "recipe_study_n20.json"))
    args = p.parse_args(argv)
    runs = [(arm, int(s)) for s in args.seeds.split(",") for arm in args.arms.split(",")]
    for arm, _ in runs:
        arm_overrides(arm, args.problem_size)               # an unknown arm fails before anything runs
    if not args.summarize_only:
        run_all(runs, args)
    report = summarize(runs, args)
    write_report(report, args.output, markdown(report))
    plot(report, os.path.splitext(args.output)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
