"""Make a training run's latest checkpoint a shipped model: ``mvmoe_jax/pretrained/<name>/`` with its
parameters (float32 ``params.npz``), its card (``card.json``) and its learning curve (``curve.png``).

    python scripts/ship_model.py --workdir=RUNS/mvmoe_n50 --name=mvmoe_4e_n50 \\
        --results=benchmarks/results/paper_tables_mvmoe_4e_n50.json --commit=b39b242 \\
        --command="scripts/train_shipped.sh RUNS 100 --config.data_dir=..."

The card records what ``mvmoe_jax.shipped`` documents: the training command and config (as stored in the
checkpoint), the commit, instances seen, the hardware and wall time (summed from ``metrics.jsonl``), the
validation gaps of every validated epoch, the results table (a ``benchmarks/paper_tables.py`` report, its
evaluation outputs left out) and ``check``: per-instance objectives that the tests reproduce.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import orbax.checkpoint as ocp  # noqa: E402

from mvmoe_jax import checkpoints, shipped, training_validation  # noqa: E402  (the repository root is on the path now)

# The card's check: 4 generated instances of each of the 16 variants at n = 50, greedy with x8 augmentation.
CHECK = dict(seed=0, num_instances=4, num_customers=50, variants="ALL")


def run_config(workdir: str) -> tuple[int, dict]:
    """The run's latest checkpoint: its step (the epoch) and the training config stored with it."""
    with ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"),
                               item_handlers={"train_meta": ocp.JsonCheckpointHandler()}) as mngr:
        step = mngr.latest_step()
        meta = mngr.restore(step, args=ocp.args.Composite(train_meta=ocp.args.JsonRestore()))
    return step, meta["train_meta"]["config"]


def learning_curve(records: list[dict], instances_per_epoch: int) -> list[dict]:
    """Per validated epoch: training instances seen and the validation gap (percent) of every variant."""
    return [{"epoch": r["epoch"], "instances": r["epoch"] * instances_per_epoch,
             "gap": {variant: round(v["gap"], 4) for variant, v in r["val"].items() if v.get("gap") is not None}}
            for r in records if r.get("val")]


def wall_seconds(records: list[dict]) -> float:
    """Training and validation seconds of the whole run, summed over its epochs (resumes included)."""
    return float(sum(r.get("time", {}).get("train_seconds", 0.0) + r.get("time", {}).get("validation_seconds", 0.0)
                     for r in records))


def results_table(paths: list[str], name: str, workdir: str) -> dict:
    """The paper_tables reports at ``paths`` merged, for the model labelled ``name`` in each (or the only model
    of a report of one), without per-instance outputs.

    Each section (``n50``, ``setx``, ...) carries the checkpoint evaluated and the machine, commit and date of
    the report that measured it; the other fields (``paper_model``) must agree. A section measured on
    ``workdir`` itself, before it shipped, names the checkpoint by its shipped name: the weights are the same."""
    table = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        models = report.get("models", {})
        if name in models:
            entry = models[name]
        elif len(models) == 1:
            (entry,) = models.values()
        else:
            raise ValueError(f"{path}: no model labelled {name!r} among {sorted(models)}")
        checkpoint = entry.get("checkpoint")
        if checkpoint and os.path.abspath(checkpoint) == os.path.abspath(workdir):
            checkpoint = name
        measured = {"checkpoint": checkpoint, "machine": report.get("machine"),
                    "commit": report.get("commit"), "date": report.get("date"),
                    "num_instances": report.get("num_instances")}
        for key, value in entry.items():
            if key == "checkpoint":
                continue
            if not isinstance(value, dict):
                if table.get(key, value) != value:
                    raise ValueError(f"{path}: {key} is {value!r}, another report has {table[key]!r}")
                table[key] = value
                continue
            if key in table:
                raise ValueError(f"{path}: section {key!r} is in two of the reports")
            table[key] = {**{k: v for k, v in value.items() if k != "results"}, **measured}
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="the training run's workdir (checkpoints/ and metrics.jsonl)")
    p.add_argument("--name", required=True, help="the shipped name, e.g. mvmoe_4e_n50")
    p.add_argument("--results", required=True,
                   help="comma list of benchmarks/paper_tables.py JSON reports of this checkpoint (their sections "
                        "merged; in a report of several models, the one labelled --name)")
    p.add_argument("--command", required=True, help="the command that trained it")
    p.add_argument("--commit", required=True, help="the commit of the code that trained it")
    p.add_argument("--hardware", required=True, help="what it was trained on")
    p.add_argument("--out_root", default=str(shipped.SHIPPED_DIR), help="folder of shipped models")
    args = p.parse_args(argv)

    last_epoch, stored = run_config(args.workdir)
    # The parameters of the same step as the config and metrics read above.
    cfg, params = checkpoints.restore_policy(os.path.join(args.workdir, "checkpoints"), step=last_epoch)
    # Only the epochs up to the shipped checkpoint (a run may have gone on since it was saved).
    records = [r for r in training_validation.read_metrics(os.path.join(args.workdir, "metrics.jsonl"))
               if r["epoch"] <= last_epoch]
    instances = last_epoch * stored["train_episodes"]
    print(f"{args.name}: epoch {last_epoch}, {instances:,} instances; computing the card's check ...")
    check = shipped.check_objectives(cfg, params, **CHECK)
    card = {"command": args.command, "commit": args.commit, "config": stored, "epochs": last_epoch,
            "instances": instances, "hardware": args.hardware, "wall_seconds": round(wall_seconds(records), 1),
            "results": results_table(args.results.split(","), args.name, args.workdir),
            "learning_curve": learning_curve(records, stored["train_episodes"]),
            "check": {**CHECK, "objectives": check}}
    folder = shipped.export(pathlib.Path(args.out_root) / args.name, params, cfg, card)
    png = os.path.join(args.workdir, "validation.png")
    if os.path.exists(png):
        shutil.copyfile(png, folder / "curve.png")
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
