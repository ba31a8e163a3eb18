"""A training run's latest checkpoint as a few flat files, and back into a workdir that resumes from it.

For carrying a run between machines whose transfers are limited in file count and size (an accelerator
lent for minutes, say): MVMoE/4E's parameters are ~15 MB and Adam's moments twice that, so the state is
split into files of at most ``max_file_bytes``.

    python -m mvmoe_jax.portable_state export WORKDIR OUT_DIR [--max_file_mib=15]
    python -m mvmoe_jax.portable_state import IN_DIR WORKDIR

``OUT_DIR`` holds ``meta.json`` (the run's config, epoch, step and PRNG key, its metrics records so far,
and for every leaf of the training state its tree path, shape, dtype and file) and ``state_00.npz``, ``state_01.npz``, ... (read with
``allow_pickle=False``). ``import`` writes an ordinary orbax checkpoint into a new workdir: running
``train.py`` with the same config and that workdir then continues exactly as the original run would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import ml_collections
import numpy as np

from mvmoe_jax import training
from mvmoe_jax.io.npz_sizes import check_npz_sizes
from mvmoe_jax.training_loop import (METRICS_FILE, check_config, checkpoint_manager, restore_checkpoint,
                                     save_checkpoint)
from mvmoe_jax.training_validation import append_metrics, read_metrics

META_FILE = "meta.json"
FORMAT = "mvmoe-jax training state 1"
DEFAULT_MAX_FILE_BYTES = 15 * 2**20


def _template(config: ml_collections.ConfigDict):
    """(policy config, a TrainState of the run's structure) built from its config alone."""
    plan = check_config(config)
    params = training.init_params(plan.policy, jax.random.key(0))
    return plan.policy, training.create_train_state(params, plan.optimizer.build())


def _leaves(state) -> list[tuple[str, np.ndarray]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in flat]


def export_state(workdir: str, out_dir: str, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> list[str]:
    """Write the latest checkpoint of ``workdir`` into ``out_dir``; returns the files written."""
    with checkpoint_manager(workdir) as mngr:
        epoch = mngr.latest_step()
        if epoch is None:
            raise FileNotFoundError(f"{workdir} holds no checkpoint to export")
        import orbax.checkpoint as ocp
        meta = mngr.restore(epoch, args=ocp.args.Composite(train_meta=ocp.args.JsonRestore()))["train_meta"]
        config = ml_collections.ConfigDict(meta["config"])
        cfg, template = _template(config)
        state, meta = restore_checkpoint(mngr, template, cfg, epoch)
    os.makedirs(out_dir, exist_ok=True)
    files: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    records = []
    for name, value in _leaves(state):
        if value.nbytes > max_file_bytes:
            raise ValueError(f"leaf {name} ({value.nbytes} bytes) is larger than a file may be ({max_file_bytes})")
        if sizes[-1] + value.nbytes > max_file_bytes:
            files.append({})
            sizes.append(0)
        key = f"leaf_{len(records)}"
        files[-1][key] = value
        sizes[-1] += value.nbytes
        records.append({"path": name, "key": key, "file": len(files) - 1, "shape": list(value.shape),
                        "dtype": str(value.dtype)})
    written = []
    for i, arrays in enumerate(files):
        path = os.path.join(out_dir, f"state_{i:02d}.npz")
        np.savez(path, **arrays)
        written.append(path)
    metrics = [r for r in read_metrics(os.path.join(workdir, METRICS_FILE)) if r.get("epoch", 0) <= epoch]
    with open(os.path.join(out_dir, META_FILE), "w") as f:
        json.dump({"format": FORMAT, "train_meta": meta, "leaves": records, "metrics": metrics,
                   "files": [os.path.basename(p) for p in written]}, f)
    return written + [os.path.join(out_dir, META_FILE)]


def import_state(in_dir: str, workdir: str) -> int:
    """Write the state exported in ``in_dir`` as a checkpoint of a new training workdir; returns its epoch."""
    try:
        with open(os.path.join(in_dir, META_FILE)) as f:
            stored = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{in_dir} holds no readable exported training state: {e}") from None
    if stored.get("format") != FORMAT:
        raise ValueError(f"{in_dir}: not an exported training state of this version ({stored.get('format')!r})")
    meta = stored["train_meta"]
    config = ml_collections.ConfigDict(meta["config"])
    cfg, template = _template(config)
    want = _leaves(template)
    records = stored["leaves"]
    if [r["path"] for r in records] != [name for name, _ in want]:
        raise ValueError(f"{in_dir}: the stored state does not have this version's structure for its config")
    arrays: dict[int, dict[str, np.ndarray]] = {}
    values = []
    for r, (name, like) in zip(records, want):
        if r["file"] not in arrays:
            file = os.path.join(in_dir, stored["files"][r["file"]])
            check_npz_sizes(file)
            with np.load(file, allow_pickle=False) as f:
                arrays[r["file"]] = {k: f[k] for k in f.files}
        value = arrays[r["file"]][r["key"]]
        if value.shape != like.shape or value.dtype != like.dtype:
            raise ValueError(f"{in_dir}: leaf {name} is {value.dtype}{list(value.shape)}, expected "
                             f"{like.dtype}{list(like.shape)}")
        values.append(value)
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), values)
    with checkpoint_manager(workdir) as mngr:
        if mngr.latest_step() is not None:
            raise ValueError(f"{workdir} already holds checkpoints; import into a new workdir")
        save_checkpoint(mngr, meta["epoch"], state, cfg, meta)
        mngr.wait_until_finished()
    for row in stored.get("metrics", []):
        append_metrics(os.path.join(workdir, METRICS_FILE), row)
    return int(meta["epoch"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mvmoe_jax.portable_state", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="a workdir's latest checkpoint -> flat files")
    exp.add_argument("workdir")
    exp.add_argument("out_dir")
    exp.add_argument("--max_file_mib", type=float, default=DEFAULT_MAX_FILE_BYTES / 2**20)
    imp = sub.add_parser("import", help="flat files -> a checkpoint of a new workdir")
    imp.add_argument("in_dir")
    imp.add_argument("workdir")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            for path in export_state(args.workdir, args.out_dir, int(args.max_file_mib * 2**20)):
                print(f"{path}  {os.path.getsize(path) / 2**20:.1f} MiB")
        else:
            print(f"{args.workdir}: checkpoint of epoch {import_state(args.in_dir, args.workdir)}")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
