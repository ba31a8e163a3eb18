"""Does our training learn like the authors' code? Both trained from the same initial weights, compared.

For each seed, the authors' PyTorch model (their ``MOEModel`` / ``MTLModel``) is initialised by torch and
written in their ``.pt`` format; both codes then train from exactly those weights on the paper's six
training variants (one variant per batch, their REINFORCE/POMO loss plus the MoE load-balancing loss,
Adam), each with its own random streams for data and sampling; by default both follow one order of
variants (ours), since which variants come first moves the early objectives by several per cent (measured
in docs/results.md, "Training fidelity"). Snapshots taken after the same
numbers of training instances are all evaluated by one evaluator, ours (greedy from all starts, no
augmentation), on fixed generated validation sets of all 16 variants, so that the only difference between
the two columns is the training code. ``--arm NAME:FIELD=VALUE,...`` adds runs of our code with config
fields changed (the load-balancing weight, say), to find what explains a difference::

    python benchmarks/training_fidelity.py --code=/path/to/Routing-MVMoE --model=mvmoe --seeds=0,1,2 \\
        --arm ours_alpha1e-3:aux_loss_coef=0.001 --output=benchmarks/results/fidelity.json

The authors' code runs in a subprocess of its own (one torch thread) beside ours. Their training step is
their ``Trainer._train_one_batch``, called on their env and model; the optimiser is theirs (Adam, lr 1e-4,
weight decay 1e-6 unless changed). The report gives, per variant and point, the mean objective of each arm
over the seeds, the seed-to-seed standard deviation, and each arm's mean relative difference to the
authors' with its standard error (paired by seed: same initial weights).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))    # configs/
import authors_peer  # noqa: E402  (benchmarks/ on the path)
import machine  # noqa: E402

TRAIN_VARIANTS = ("CVRP", "OVRP", "VRPB", "VRPL", "VRPTW", "OVRPTW")
AUTHORS_ARM = "authors"
OURS_ARM = "ours"


def _snapshot_path(workdir: pathlib.Path, arm: str, seed: int, instances: int) -> pathlib.Path:
    return workdir / arm / f"seed{seed}" / f"after{instances:07d}.pt"


def _init_path(workdir: pathlib.Path, seed: int) -> pathlib.Path:
    return workdir / "init" / f"seed{seed}.pt"


# ----------------------------------------------------------------------------------------------------
# The authors' side (its own process: torch, their modules on sys.path)
# ----------------------------------------------------------------------------------------------------

def authors_side(args) -> None:
    """Writes every seed's initial weights first (our side waits for them), then trains their model from
    each and writes a snapshot in their format at every point."""
    authors = authors_peer._import_authors(args.code)
    torch = authors.torch
    torch.set_num_threads(1)
    import importlib
    envs = importlib.import_module("utils").get_env("Train_ALL")
    assert [e.__name__ for e in envs] == [f"{v}Env" for v in TRAIN_VARIANTS], envs
    workdir = pathlib.Path(args.workdir)
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        path = _init_path(workdir, seed)
        if not path.exists():
            net, _, _ = authors_peer.build_model(authors, args.model, "random", seed=seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            _save(torch, net, path.with_suffix(".tmp"), 0)
            os.replace(path.with_suffix(".tmp"), path)
    points = sorted(int(p) for p in args.points.split(","))
    for seed in seeds:
        if _snapshot_path(workdir, AUTHORS_ARM, seed, points[-1]).exists():
            continue
        net, params, _ = authors_peer.build_model(authors, args.model, str(_init_path(workdir, seed)))
        optimizer = authors.Optimizer(net.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        trainer = argparse.Namespace(model=net, model_params=params, optimizer=optimizer,
                                     device=torch.device("cpu"))
        # Their Trainer draws the variant with Python's random and the data and samples with torch's. With
        # --paired_variants the variant of each batch is ours instead (same order in both codes).
        random.seed(seed)
        torch.manual_seed(seed + 1)
        order = _read_variant_order(workdir, seed) if args.paired_variants else None
        seen, step, t0 = 0, 0, time.perf_counter()
        while seen < points[-1]:
            size = min(args.batch, points[-1] - seen)
            env_class = envs[TRAIN_VARIANTS.index(order[step])] if order else random.sample(envs, 1)[0]
            step += 1
            env = env_class(problem_size=args.size, pomo_size=args.size, device=torch.device("cpu"))
            data = env.get_random_problems(size, args.size)
            authors.train_one_batch(trainer, data, env)
            seen += size
            if seen in points:
                out = _snapshot_path(workdir, AUTHORS_ARM, seed, seen)
                out.parent.mkdir(parents=True, exist_ok=True)
                _save(torch, net, out, seen)
        print(f"authors seed {seed}: {points[-1]} instances in {time.perf_counter() - t0:.0f} s", flush=True)


def _variant_order_path(workdir: pathlib.Path, seed: int) -> pathlib.Path:
    return workdir / "variant_order" / f"seed{seed}.json"


def _read_variant_order(workdir: pathlib.Path, seed: int) -> list[str]:
    return json.loads(_variant_order_path(workdir, seed).read_text())


def write_variant_order(args, seed: int) -> None:
    """The training variant of each of our batches for ``seed`` (our step keys decide it), for the
    authors' side to follow."""
    import jax

    from mvmoe_jax import training

    steps = -(-max(int(p) for p in args.points.split(",")) // args.batch)
    order = []
    for step in range(steps):
        k_data, _ = jax.random.split(training.step_key(jax.random.key(seed), step))    # as StepFunctions.step
        index = training.batch_variants(k_data, len(TRAIN_VARIANTS), args.batch, mixed=False)[0]
        order.append(TRAIN_VARIANTS[int(index)])
    path = _variant_order_path(pathlib.Path(args.workdir), seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(order))


def _save(torch, net, path: pathlib.Path, instances: int) -> None:
    torch.save({"epoch": instances, "problem": "Train_ALL",
                "model_state_dict": {k: v.detach().clone() for k, v in net.state_dict().items()}}, path)


# ----------------------------------------------------------------------------------------------------
# Our side
# ----------------------------------------------------------------------------------------------------

def _our_config(args, overrides: dict):
    import importlib
    config = importlib.import_module(f"configs.{'mvmoe' if args.model == 'mvmoe' else 'pomo_mtl'}").get_config()
    config.problem_size = args.size
    config.pomo_size = args.size
    config.batch_size = args.batch
    config.learning_rate = args.lr
    config.weight_decay = args.weight_decay
    config.lr_decay_epoch_fraction = 1.0          # no decay inside the compared budget (theirs: epoch 4501)
    config.train_problems = ",".join(TRAIN_VARIANTS)
    for field, value in overrides.items():
        config[field] = type(config[field])(value)
    return config


def ours_side(args, arm: str, overrides: dict) -> None:
    """Trains our model from each seed's initial weights with our training step, keeping snapshots."""
    import jax

    from mvmoe_jax import checkpoints, shipped, training, training_loop

    workdir = pathlib.Path(args.workdir)
    points = sorted(int(p) for p in args.points.split(","))
    config = _our_config(args, overrides)
    plan = training_loop.check_config(config)
    mesh = training.make_mesh(None)
    fns = training_loop.step_functions(config, plan, mesh)
    for seed in [int(s) for s in args.seeds.split(",")]:
        if _snapshot_path(workdir, arm, seed, points[-1]).with_suffix(".npz").exists():
            continue
        init = _init_path(workdir, seed)
        while not init.exists():                      # written by the authors' process
            time.sleep(2)
        _, params = checkpoints.load_policy(str(init), plan.policy)
        state = fns.init_state(params)
        run_key = jax.random.key(seed)
        seen, step, t0 = 0, 0, time.perf_counter()
        while seen < points[-1]:
            size = min(args.batch, points[-1] - seen)
            state, metrics = fns.step(state, training.step_key(run_key, step), size)
            if not bool(jax.device_get(metrics["finite"])):
                raise RuntimeError(f"{arm} seed {seed}: non-finite loss at step {step}")
            seen, step = seen + size, step + 1
            if seen in points:
                out = _snapshot_path(workdir, arm, seed, seen).with_suffix(".npz")
                out.parent.mkdir(parents=True, exist_ok=True)
                shipped.write_params(out, jax.device_get(state.params))
        fns.release_buffers()
        print(f"{arm} seed {seed}: {points[-1]} instances in {time.perf_counter() - t0:.0f} s", flush=True)


def evaluate_all(args, arms: list[str]) -> dict:
    """{arm: {seed: {instances: {variant: mean objective}}}}, every snapshot by our greedy evaluation."""
    from mvmoe_jax import checkpoints, problems, shipped
    from mvmoe_jax.training_validation import Validator

    workdir = pathlib.Path(args.workdir)
    points = [0] + sorted(int(p) for p in args.points.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    config = _our_config(args, {})
    from mvmoe_jax import training_loop
    cfg = training_loop.check_config(config).policy
    validator = Validator(cfg, variants=",".join(v.name for v in problems.VARIANTS), num_customers=args.size,
                          pomo_size=args.size, num_instances=args.val_instances, batch_size=args.val_batch,
                          data_dir=None, augment=False, seed=args.val_seed)
    tag = f"val{args.val_instances}_seed{args.val_seed}"

    def validate(path: pathlib.Path, load) -> dict:
        """The snapshot's validation objectives, kept beside it (a rerun with more arms reuses them)."""
        cached = path.with_name(f"{path.stem}.{tag}.json")
        if cached.exists():
            return json.loads(cached.read_text())
        val = {k: v["obj"] for k, v in validator(load()).items()}
        cached.write_text(json.dumps(val))
        return val

    results: dict = {arm: {} for arm in arms}
    for seed in seeds:
        init = _init_path(workdir, seed)
        init_val = validate(init, lambda: checkpoints.load_policy(str(init), cfg)[1])
        for arm in arms:
            per_point = {0: init_val}
            for p in points[1:]:
                path = _snapshot_path(workdir, arm, seed, p)
                if arm == AUTHORS_ARM:
                    per_point[p] = validate(path, lambda: checkpoints.load_policy(str(path), cfg)[1])
                else:
                    per_point[p] = validate(path, lambda: shipped.read_params(path.with_suffix(".npz")))
            results[arm][seed] = per_point
            print(f"evaluated {arm} seed {seed}", flush=True)
    return results


def summarise(results: dict, arms: list[str]) -> dict:
    """Per arm, point and variant: mean over seeds, seed std, and the mean paired relative difference (%)
    to the authors' with its standard error."""
    seeds = sorted(results[AUTHORS_ARM])
    points = sorted(results[AUTHORS_ARM][seeds[0]])
    variants = list(results[AUTHORS_ARM][seeds[0]][points[0]])
    out: dict = {}
    for arm in arms:
        out[arm] = {}
        for p in points:
            row = {}
            for v in variants:
                objs = np.array([results[arm][s][p][v] for s in seeds])
                ref = np.array([results[AUTHORS_ARM][s][p][v] for s in seeds])
                rel = 100.0 * (objs - ref) / ref
                row[v] = {"mean": float(objs.mean()), "seed_std": float(objs.std(ddof=1)) if len(seeds) > 1 else None,
                          "rel_to_authors_pct": float(rel.mean()),
                          "rel_se_pct": float(rel.std(ddof=1) / np.sqrt(len(seeds))) if len(seeds) > 1 else None}
            trained = [v for v in variants if v in TRAIN_VARIANTS]
            unseen = [v for v in variants if v not in TRAIN_VARIANTS]
            for name, group in (("mean_trained", trained), ("mean_unseen", unseen)):
                rel = np.array([[100.0 * (results[arm][s][p][v] - results[AUTHORS_ARM][s][p][v])
                                 / results[AUTHORS_ARM][s][p][v] for v in group] for s in seeds]).mean(axis=1)
                row[name] = {"rel_to_authors_pct": float(rel.mean()),
                             "rel_se_pct": float(rel.std(ddof=1) / np.sqrt(len(seeds))) if len(seeds) > 1 else None}
            out[arm][p] = row
    return out


def print_table(summary: dict, arms: list[str]) -> None:
    points = sorted(summary[AUTHORS_ARM])
    variants = [v for v in summary[AUTHORS_ARM][points[0]] if not v.startswith("mean_")]
    cols = ["mean_trained", "mean_unseen", *variants]
    for arm in arms:
        if arm == AUTHORS_ARM:
            continue
        print(f"\n{arm} against the authors' code: relative difference of the validation objective, % "
              "(mean over seeds +- standard error; + is worse)")
        print(f"{'instances':>9s} " + " ".join(f"{c.replace('mean_', ''):>12s}" for c in cols))
        for p in points[1:]:
            cells = []
            for c in cols:
                d = summary[arm][p][c]
                se = d["rel_se_pct"]
                cells.append(f"{d['rel_to_authors_pct']:+6.2f}" + (f"+-{se:4.2f}" if se is not None else "      "))
            print(f"{p:9d} " + " ".join(f"{c:>12s}" for c in cells))
    print("\nauthors' mean objective (seed std) per point:")
    for p in points:
        print(f"{p:9d} " + " ".join(f"{v}={summary[AUTHORS_ARM][p][v]['mean']:.3f}({summary[AUTHORS_ARM][p][v]['seed_std'] or 0:.3f})"
                                     for v in ("CVRP", "VRPTW", "OVRPBLTW")))


def _parse_arm(text: str) -> tuple[str, dict]:
    name, _, fields = text.partition(":")
    if not name or name in (AUTHORS_ARM, OURS_ARM):
        raise argparse.ArgumentTypeError(f"an arm needs a name other than {AUTHORS_ARM!r} and {OURS_ARM!r}: {text!r}")
    overrides = {}
    for item in filter(None, fields.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"arm fields are FIELD=VALUE, got {item!r}")
        overrides[key] = value
    return name, overrides


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", default=os.environ.get("MVMOE_AUTHORS_CODE"), help="checkout of Routing-MVMoE")
    parser.add_argument("--model", choices=("mvmoe", "pomo_mtl"), default="mvmoe")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--size", type=int, default=20)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=1e-6)
    parser.add_argument("--points", default="640,2560,5120,10240,20480",
                        help="training instances after which both codes' weights are evaluated")
    parser.add_argument("--val_instances", type=int, default=1000)
    parser.add_argument("--val_batch", type=int, default=500)
    parser.add_argument("--val_seed", type=int, default=2024)
    parser.add_argument("--arm", action="append", type=_parse_arm, default=[],
                        help="NAME:FIELD=VALUE,... another run of our code with config fields changed")
    parser.add_argument("--paired_variants", action=argparse.BooleanOptionalAction, default=True,
                        help="the authors' code trains on our order of variants (one per batch), so that the "
                             "comparison is not blurred by which variants each drew first")
    parser.add_argument("--workdir", default="fidelity_runs")
    parser.add_argument("--side", choices=("all", "authors"), default="all", help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    try:
        authors_peer._checkout(args.code)
    except ValueError as e:
        parser.error(str(e))
    points = sorted(int(p) for p in args.points.split(","))
    if any(p % args.batch for p in points):
        parser.error(f"every point must be a multiple of the batch size {args.batch}")
    if args.side == "authors":
        authors_side(args)
        return {}
    os.makedirs(args.workdir, exist_ok=True)
    from mvmoe_jax import devices
    devices.use_cpu_devices(0, args.batch)
    t0 = time.perf_counter()
    if args.paired_variants:
        for seed in args.seeds.split(","):
            write_variant_order(args, int(seed))
    cmd = [sys.executable, __file__, "--side=authors", f"--{'' if args.paired_variants else 'no-'}paired_variants", f"--code={args.code}", f"--model={args.model}",
           f"--seeds={args.seeds}", f"--size={args.size}", f"--batch={args.batch}", f"--lr={args.lr}",
           f"--weight_decay={args.weight_decay}", f"--points={args.points}", f"--workdir={args.workdir}"]
    authors_proc = subprocess.Popen(cmd)
    arms = [(OURS_ARM, {})] + list(args.arm)
    try:
        for name, overrides in arms:
            ours_side(args, name, overrides)
    finally:
        if authors_proc.wait() != 0:
            raise SystemExit(f"the authors' side failed (exit {authors_proc.returncode})")
    train_seconds = time.perf_counter() - t0
    names = [AUTHORS_ARM] + [n for n, _ in arms]
    results = evaluate_all(args, names)
    summary = summarise(results, names)
    print_table(summary, names)
    import torch
    report = {"benchmark": "training_fidelity", "model": args.model, "size": args.size, "batch": args.batch,
              "lr": args.lr, "weight_decay": args.weight_decay, "seeds": args.seeds, "points": points,
              "paired_variants": args.paired_variants,
              "validation": {"instances_per_variant": args.val_instances, "seed": args.val_seed,
                             "decoding": "greedy, all starts, no augmentation"},
              "arms": {n: o for n, o in arms}, "authors_commit": authors_peer._git_commit(pathlib.Path(args.code)),
              "torch_version": torch.__version__, "machine": machine.cpu_model(),
              "training_seconds": train_seconds, "date": time.strftime("%Y-%m-%d"),
              "summary": summary, "per_seed": results}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
