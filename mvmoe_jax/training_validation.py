"""Validation during training, the metrics file and the plot of the validation curves.

Validation is greedy POMO decoding (optionally x8 augmentation) of the first ``validation_instances`` of
the paper's test set of each validated variant at ``<data_dir>/<VARIANT>/<variant><n>_uniform.pkl``, with
the gap to the paper's reference solutions (or a set's ``reference_`` solutions) where they exist. A variant without a paper set at this size
(n = 20, say) is validated on a fixed generated set (seeded by ``validation_seed``) and reports the
objective only. Every set has the same shapes, so ``rollout.greedy_evaluate`` compiles once per run.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from mvmoe_jax import distributed, evaluation, io, problems
from mvmoe_jax.instances import Instance, generate
from mvmoe_jax.nn.policy import PolicyConfig
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.rollout import greedy_evaluate


def reference_path(data_dir: str, variant, num_customers: int) -> str | None:
    """The reference solutions validation compares against: the paper's (its solver's file name), else a
    ``reference_`` file (sets built by scripts/make_validation_sets.py); None when neither exists."""
    for solver in (None, "reference"):
        path = io.reference_solution_path(data_dir, variant, num_customers, solver=solver)
        if os.path.exists(path):
            return path
    return None


class Validator:
    """Fixed validation sets of one run and their evaluation."""

    def __init__(self, cfg: PolicyConfig, *, variants, num_customers: int, pomo_size: int, num_instances: int,
                 batch_size: int, data_dir: str | None, augment: bool, seed: int, sharding=None,
                 plan: ExecutionPlan | None = None):
        self.cfg = cfg
        self.plan = plan              # the execution plan (None: the default backend's)
        self.sharding = sharding      # batch sharding over a device mesh, or None
        self.pomo_size = pomo_size
        self.batch_size = max(1, min(batch_size, num_instances))
        self.augment = augment
        self.sets: dict[str, tuple[Instance, np.ndarray | None, str]] = {}
        for i, var in enumerate(problems.parse_variants(variants)):
            path = io.dataset_path(data_dir, var, num_customers) if data_dir else ""
            if path and os.path.exists(path):
                inst = io.load_paper_instances(path, var, num_instances=num_instances)
                ref_path = reference_path(data_dir, var, num_customers)
                ref = None
                if ref_path is not None:
                    ref, _ = io.load_paper_solutions(ref_path, num_instances=inst.locs.shape[0])
                    ref = ref if len(ref) == inst.locs.shape[0] else None
                self.sets[var.name] = (inst, ref, path)
            else:
                key = jax.random.fold_in(jax.random.key(seed), i)
                self.sets[var.name] = (generate(key, num_instances, num_customers, var), None,
                                       f"generated (seed {seed})")

    def describe(self) -> str:
        return "; ".join(f"{name}: {inst.locs.shape[0]} from {src}" + (" with reference" if ref is not None else "")
                         for name, (inst, ref, src) in self.sets.items())

    def __call__(self, params) -> dict[str, dict]:
        """{variant: {"obj": mean objective, "gap": mean gap % or None}}. With several processes each one
        evaluates its share of the batches (``distributed.process_batches``) and every process returns the whole
        result, the same as one process's."""
        params = jax.device_get(params) if jax.process_count() > 1 else params
        out = {}
        for name, (inst, ref, _) in self.sets.items():
            obj = self._objectives(params, inst)
            gap = evaluation.gap_percent(obj, ref) if ref is not None else None
            out[name] = {"obj": float(np.mean(obj)), "gap": gap}
        return out

    def _objectives(self, params, inst: Instance) -> np.ndarray:
        """float64 (K,): each instance's objective, this process's batches evaluated here, the others'
        gathered."""
        objs = np.zeros(inst.locs.shape[0], np.float32)
        mine = distributed.my_batches(-(-inst.locs.shape[0] // self.batch_size))
        for i, (lo, hi, batch) in enumerate(evaluation.padded_batches(inst, self.batch_size)):
            if i not in mine:
                continue
            if self.sharding is not None:
                batch = jax.device_put(batch, self.sharding)
            res = greedy_evaluate(self.cfg, params, batch, jax.random.fold_in(jax.random.key(0), i),
                                  pomo_size=self.pomo_size, augment=self.augment, plan=self.plan)
            res = jax.device_get(res)
            objs[lo:hi] = (res.obj if self.augment else res.obj_no_aug)[: hi - lo]
        return distributed.sum_over_processes(objs).astype(np.float64)


# ----------------------------------------------------------------------------------------------------
# Metrics file and plot
# ----------------------------------------------------------------------------------------------------

def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, last_epoch: int) -> None:
    """Drop the records of epochs after ``last_epoch`` (written before a crash, after the checkpoint) and a
    last line that a crash cut short. The shortened file is written beside the old one and renamed over it,
    so a crash here leaves the old records or the new ones, never a part of them."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    whole = [line for line in lines if line.endswith("\n")]     # only the last line can lack its newline
    keep = [line for line in whole if line.strip() and json.loads(line).get("epoch", 0) <= last_epoch]
    if keep != lines:
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)


def append_metrics(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def plot_validation(metrics_path: str, out_path: str) -> bool:
    """Objective (and gap, where known) per validated variant against the epoch. False if nothing to plot."""
    rows = [r for r in read_metrics(metrics_path) if r.get("val")]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(v for r in rows for v in r["val"]))
    has_gap = any(r["val"][v].get("gap") is not None for r in rows for v in r["val"])
    fig, axes = plt.subplots(1, 2 if has_gap else 1, figsize=(11 if has_gap else 6, 4), squeeze=False)
    for name in names:
        pts = [(r["epoch"], r["val"][name]) for r in rows if name in r["val"]]
        axes[0, 0].plot([e for e, _ in pts], [v["obj"] for _, v in pts], marker=".", label=name)
        if has_gap:
            gaps = [(e, v["gap"]) for e, v in pts if v.get("gap") is not None]
            axes[0, 1].plot([e for e, _ in gaps], [g for _, g in gaps], marker=".", label=name)
    axes[0, 0].set(xlabel="epoch", ylabel="objective (greedy)", title="validation objective")
    if has_gap:
        axes[0, 1].set(xlabel="epoch", ylabel="gap %", title="validation gap")
    save_figure(fig, axes[0], out_path)
    return True


def save_figure(fig, axes, path: str) -> str:
    """Grid and legend on each of ``axes``, then ``fig`` written to ``path`` (PNG) and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
