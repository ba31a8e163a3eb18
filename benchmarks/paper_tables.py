"""The paper's result tables re-measured for trained models: one command, JSON and markdown out.

For each model (a shipped name, orbax checkpoint or original ``.pt``), greedy from every start with x8
augmentation, as the paper evaluates:

* ``n50``: the paper's n = 50 test sets of all 16 variants, objective and gap against the paper's reference
  solver, with the paper's Table 1 gap of the same model beside it (``--paper_model`` per model), and the
  means over the 6 training variants and the 10 unseen ones;
* ``n100``: the n = 100 test sets that exist (zero-shot from n = 50 models), likewise, beside the paper's
  figure for its model trained at n = 100;
* ``setx`` and ``solomon``: CVRPLIB Set-X and Solomon, gaps to the best-known values, by size group and by
  Solomon class;
* ``--curves NAME=SOURCE,...``: the learning curves (mean validation gap over the trained and the unseen
  variants against training instances) as a PNG, each from a training run's metrics.jsonl or a shipped
  model's card.

Every table records the machine, the evaluation seconds and the commit. The JSON holds the tables only;
``--per_instance`` adds every instance's evaluation output (about 850 KB for one model on the n = 50 sets).

    python benchmarks/paper_tables.py --models=mvmoe_4e_n50,pomo_mtl_n50 \\
        --paper_models="MVMoE/4E,POMO-MTL" --sections=n50,n100,setx,solomon
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import types

import numpy as np

import machine  # benchmarks/machine.py (this folder is sys.path[0] when run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from mvmoe_jax import shipped  # noqa: E402  (the repository root is on the path now)
from mvmoe_jax.training_validation import save_figure  # noqa: E402

DEFAULT_DATA = os.path.join(os.path.dirname(REPO), "shared", "data", "mvmoe-paper")
SECTIONS = ("n50", "n100", "setx", "solomon")
TRAINED = ("CVRP", "OVRP", "VRPB", "VRPL", "VRPTW", "OVRPTW")
# Set-X size groups (customers), as in the paper's CVRPLIB table.
SETX_GROUPS = ((100, 200), (200, 300), (300, 1001))


def _flags(**values) -> types.SimpleNamespace:
    """The flags ``cli.run_evaluation`` reads, at evaluate.py's defaults, with ``values``."""
    base = dict(checkpoint=None, problems="ALL", data_dir=None, size=50, aug=8, num_instances=None, batch_size=None,
                pomo_size=None, vrplib_dir=None, bks=None, reference=None, seed=0, progress=False,
                matmul_precision=None, compute_dtype=None, execution="auto", execution_overrides="", chunk_size=None)
    base.update(values)
    return types.SimpleNamespace(**base)


def paper_gap(paper: dict, variant: str, model: str | None, size: int) -> float | None:
    """The paper's Table 1/2 gap (percent) of ``model`` on ``variant`` at ``size``; None where it has none."""
    try:
        gap = paper[variant][model][f"n{size}"]["gap"]
    except (KeyError, TypeError):
        return None
    try:
        return float(gap)
    except (TypeError, ValueError):
        return None


def dataset_rows(results: dict, paper: dict, paper_model: str | None, size: int) -> list[dict]:
    """One row per variant evaluated: our mean objective, gap and seconds, the paper's gap."""
    return [{"variant": v, "obj": r["mean"], "gap": r["gap"], "seconds": r["seconds"],
             "paper_gap": paper_gap(paper, v, paper_model, size)} for v, r in results.items()]


def group_means(rows: list[dict]) -> dict:
    """Mean gap (ours and the paper's) over the trained and the unseen variants present in ``rows``."""
    out = {}
    for group, members in (("trained", [r for r in rows if r["variant"] in TRAINED]),
                           ("unseen", [r for r in rows if r["variant"] not in TRAINED])):
        ours = [r["gap"] for r in members if r["gap"] is not None]
        paper = [r["paper_gap"] for r in members if r["paper_gap"] is not None]
        out[group] = {"variants": len(members), "gap": float(np.mean(ours)) if ours else None,
                      "paper_gap": float(np.mean(paper)) if len(paper) == len(members) and paper else None}
    return out


def setx_groups(results: dict) -> list[dict]:
    """Set-X gaps grouped by customers (``SETX_GROUPS``): instances, mean gap, mean seconds."""
    rows = []
    for lo, hi in SETX_GROUPS:
        members = [r for r in results.values() if lo <= r["n"] < hi and r["gap"] is not None]
        if members:
            rows.append({"group": f"{lo} <= n < {hi}", "instances": len(members),
                         "gap": float(np.mean([r["gap"] for r in members])),
                         "seconds": float(np.mean([r["seconds"] for r in members]))})
    return rows


def solomon_classes(results: dict) -> list[dict]:
    """Solomon gaps by class (C1, C2, R1, R2, RC1, RC2)."""
    classes: dict[str, list[dict]] = {}
    for name, r in results.items():
        match = re.match(r"(RC|R|C)(\d)", name.upper())
        if match and r["gap"] is not None:
            classes.setdefault(match.group(1) + match.group(2), []).append(r)
    return [{"class": c, "instances": len(rs), "gap": float(np.mean([r["gap"] for r in rs])),
             "seconds": float(np.mean([r["seconds"] for r in rs]))} for c, rs in sorted(classes.items())]


def _curve_point(epoch: int, instances: int | None, gaps: dict[str, float | None]) -> dict:
    """One validated epoch: the mean gap (percent) over the trained and over the unseen variants of ``gaps``."""
    groups = {g: [gap for variant, gap in gaps.items() if (variant in TRAINED) == (g == "trained") and gap is not None]
              for g in ("trained", "unseen")}
    return {"epoch": epoch, "instances": instances,
            **{g: float(np.mean(x)) if x else None for g, x in groups.items()}}


def curve_points(source: str, instances_per_epoch: int | None = None) -> list[dict]:
    """(training instances, mean validation gap over the trained and the unseen variants) per validated epoch.

    ``source`` is a training run's metrics.jsonl (instances: the record's ``instances`` where present, else
    epoch x ``instances_per_epoch``) or a shipped model's name (the learning curve on its card)."""
    if not os.path.exists(source) and shipped.looks_like_name(source):
        return [_curve_point(r["epoch"], r["instances"], r["gap"]) for r in shipped.card(source)["learning_curve"]]
    points = []
    with open(source) as f:
        for line in f:
            record = json.loads(line)
            val = record.get("val")
            if not val:
                continue
            seen = record.get("instances") or (record["epoch"] * instances_per_epoch if instances_per_epoch else None)
            points.append(_curve_point(record["epoch"], seen, {k: v.get("gap") for k, v in val.items()}))
    return points


def plot_curves(curves: dict[str, list[dict]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, points) in enumerate(curves.items()):  # one colour per model, solid: trained, dashed: unseen
        x = [p["instances"] if p["instances"] is not None else p["epoch"] for p in points]
        for group, style in (("trained", "-"), ("unseen", "--")):
            ax.plot(x, [p[group] for p in points], style, color=f"C{i}", marker=".", label=f"{name} ({group} variants)")
    # Log scale: the untrained model's gaps (about 200 %) would otherwise flatten the curves' tails.
    ax.set(xlabel="training instances", ylabel="mean validation gap % (greedy, no augmentation)",
           title="learning curves, n = 50", yscale="log")
    return save_figure(fig, [ax], path)


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    """The report's tables as markdown."""
    lines = [f"Machine: {report['machine']}; commit {report['commit']}; {report['date']}; "
             f"instances per set: {report['num_instances'] or 'all'}.", ""]
    for size in (50, 100):
        key = f"n{size}"
        if not any(key in m for m in report["models"].values()):
            continue
        names = [n for n, m in report["models"].items() if key in m]
        # The paper trained a model per size: its n = 100 figure is for a model trained at n = 100.
        paper_note = "paper's figure in brackets" if size == 50 else "the paper's n = 100-trained model in brackets"
        lines += [f"### n = {size} (greedy x8; gap % to the paper's reference solver; {paper_note})", "",
                  "| variant | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        variants = list(dict.fromkeys(r["variant"] for n in names for r in report["models"][n][key]["rows"]))
        for v in variants:
            cells = []
            for n in names:
                row = next((r for r in report["models"][n][key]["rows"] if r["variant"] == v), None)
                cells.append("-" if row is None else f"{_fmt(row['gap'])} ({_fmt(row['paper_gap'])})")
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        for group in ("trained", "unseen"):
            cells = [f"{_fmt(report['models'][n][key]['means'][group]['gap'])} "
                     f"({_fmt(report['models'][n][key]['means'][group]['paper_gap'])})" for n in names]
            lines.append(f"| mean, {group} | " + " | ".join(cells) + " |")
        secs = [f"{sum(r['seconds'] for r in report['models'][n][key]['rows']):.0f}" for n in names]
        lines += [f"| seconds (all sets) | " + " | ".join(secs) + " |", ""]
    for key, title, label in (("setx", "CVRPLIB Set-X (gap % to best known)", "group"),
                              ("solomon", "Solomon (gap % to best known)", "class")):
        names = [n for n, m in report["models"].items() if key in m]
        if not names:
            continue
        lines += [f"### {title}", "", f"| {label} | instances | " + " | ".join(names) + " | seconds / instance |",
                  "|---|---|" + "---|" * len(names) + "---|"]
        for i, row in enumerate(report["models"][names[0]][key]["rows"]):
            cells = [_fmt(report["models"][n][key]["rows"][i]["gap"]) for n in names]
            lines.append(f"| {row[label]} | {row['instances']} | " + " | ".join(cells) + f" | {row['seconds']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def parse_models(text: str) -> list[tuple[str, str]]:
    """``--models``: a comma list of checkpoints, each a shipped name or a path, optionally labelled
    ``LABEL=CHECKPOINT``; (label, checkpoint) pairs, the checkpoint its own label when none is given."""
    pairs = []
    for item in (m for m in text.split(",") if m):
        label, _, checkpoint = item.rpartition("=")
        pairs.append((label or checkpoint, checkpoint))
    labels = [label for label, _ in pairs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--models: a label appears twice in {labels}")
    return pairs


def run(models: list[tuple[str, str]], paper_models: list[str | None], sections: list[str], data_dir: str,
        num_instances: int | None, execution: str = "auto", per_instance: bool = False) -> dict:
    """Evaluate every (label, checkpoint) of ``models`` on the sections; the JSON-ready report (see ``markdown``),
    each section with the evaluation's per-instance outputs under ``"results"`` when ``per_instance``."""
    from mvmoe_jax import cli

    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    with open(os.path.join(data_dir, "paper_results.json")) as f:
        paper = json.load(f)["results"]

    def kept(outputs: dict) -> dict:
        return {"results": outputs} if per_instance else {}

    report = {"machine": machine.jax_device(),
              "commit": machine.repository_commit(), "date": datetime.date.today().isoformat(), "num_instances": num_instances,
              "data_dir": data_dir, "models": {}}
    for (label, model), paper_model in zip(models, paper_models):
        entry = report["models"][label] = {"checkpoint": model, "paper_model": paper_model}
        for size in (50, 100):
            if f"n{size}" in sections:
                res = cli.run_evaluation(None, _flags(checkpoint=model, data_dir=data_dir, size=size,
                                                      num_instances=num_instances, execution=execution))
                rows = dataset_rows(res, paper, paper_model, size)
                entry[f"n{size}"] = {"rows": rows, "means": group_means(rows), **kept(res)}
        if "setx" in sections:
            res = cli.run_evaluation(None, _flags(checkpoint=model, vrplib_dir=os.path.join(data_dir, "CVRP-LIB"),
                                                  bks=os.path.join(data_dir, "BKS.json"), num_instances=num_instances,
                                                  execution=execution))
            entry["setx"] = {"rows": setx_groups(res), **kept(res)}
        if "solomon" in sections:
            res = cli.run_evaluation(None, _flags(checkpoint=model,
                                                  vrplib_dir=os.path.join(data_dir, "Vrp-Set-Solomon"),
                                                  bks=os.path.join(data_dir, "BKS.json"), num_instances=num_instances,
                                                  execution=execution))
            entry["solomon"] = {"rows": solomon_classes(res), **kept(res)}
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", required=True,
                   help="comma list: shipped names or checkpoint paths, each optionally LABEL=CHECKPOINT")
    p.add_argument("--paper_models", default="",
                   help="comma list, one per model: its column in the paper's tables (e.g. MVMoE/4E,POMO-MTL)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--data_dir", default=DEFAULT_DATA)
    p.add_argument("--num_instances", type=int, default=None, help="first K instances of each set (default all)")
    p.add_argument("--execution", default="auto", help="execution plan preset")
    p.add_argument("--per_instance", action="store_true",
                   help="keep every instance's evaluation output in the JSON (left out by default)")
    p.add_argument("--curves", default="",
                   help="NAME=SOURCE,... learning curves to plot; SOURCE: metrics.jsonl or a shipped name")
    p.add_argument("--instances_per_epoch", type=int, default=20000,
                   help="training instances per epoch, for metrics without an instance count")
    p.add_argument("--output", default=None, help="JSON path (markdown and PNG beside it); default "
                   "benchmarks/results/paper_tables_<date>.json")
    args = p.parse_args(argv)
    try:
        models = parse_models(args.models)
    except ValueError as e:
        p.error(str(e))
    paper_models = [m or None for m in args.paper_models.split(",")] if args.paper_models else [None] * len(models)
    if len(paper_models) != len(models):
        p.error(f"--paper_models names {len(paper_models)} columns for {len(models)} models")
    output = args.output or machine.default_output("paper_tables")
    curves = {}  # read before the evaluations, so that a bad source fails at once
    for item in filter(None, args.curves.split(",")):
        name, _, source = item.partition("=")
        if not name or not source:
            p.error(f"--curves takes NAME=SOURCE items, got {item!r}")
        try:
            curves[name] = curve_points(source, args.instances_per_epoch)
        except (OSError, ValueError) as e:  # a missing file, an unknown shipped name, a malformed line
            print(f"error: learning curve {name!r}: {e}", file=sys.stderr)
            return 2
    try:
        report = run(models, paper_models, [s for s in args.sections.split(",") if s], args.data_dir,
                     args.num_instances, args.execution, args.per_instance)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stem = os.path.splitext(output)[0]
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    if curves:
        report["curves"] = curves
        report["curves_png"] = plot_curves(curves, stem + "_curves.png")
    machine.write_report(report, output, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
