"""A training run's latest checkpoint as a few flat files, and back into a workdir that resumes from it.

For carrying a run between machines whose transfers are limited in file count and size (an accelerator
lent for minutes, say): MVMoE/4E's parameters are ~15 MB and Adam's moments twice that, so the state is
split into files of at most ``max_file_bytes``.

    python -m mvmoe_jax.portable_state export WORKDIR OUT_DIR [--max_file_mib=15]
    python -m mvmoe_jax.portable_state import IN_DIR WORKDIR

``OUT_DIR`` holds ``meta.json`` (the run's config, epoch, step and PRNG key, its metrics records so far, and for
every leaf of the training state its tree path, shape, dtype and file) and ``state_00.npz``, ``state_01.npz``, ...
(read with ``allow_pickle=False``). ``import`` writes an ordinary orbax checkpoint into a new workdir: running
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
from mvmoe_jax.io.npz_sizes import read_arrays
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
    return plan.policy, training.create_train_state(params, plan.optimizer.build(), plan.num_cost_scales())


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


def _read_meta(in_dir: str) -> dict:
    """The exported ``meta.json`` of ``in_dir``, checked for the fields and types ``import_state`` uses; a
    ValueError naming the file and the first problem otherwise."""
    path = os.path.join(in_dir, META_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: no readable exported training state ({type(e).__name__}: {e})") from None
    if not isinstance(stored, dict) or stored.get("format") != FORMAT:
        found = stored.get("format") if isinstance(stored, dict) else type(stored).__name__
        raise ValueError(f"{path}: not an exported training state of this version ({found!r})")
    problem = _meta_problem(stored)
    if problem:
        raise ValueError(f"{path}: malformed exported training state: {problem}")
    return stored


def _meta_problem(stored: dict) -> str | None:
    """What in an exported meta.json is missing or of the wrong type, in words; None when nothing is."""
    meta, files, leaves, metrics = (stored.get(k) for k in ("train_meta", "files", "leaves", "metrics"))
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        return "'train_meta' must be an object holding the run's 'config'"
    epoch, step = meta.get("epoch"), meta.get("step")
    if not (type(epoch) is int and type(step) is int and epoch >= 0 and step >= 0):
        return f"'train_meta' must give 'epoch' and 'step' as non-negative integers, got {epoch!r} and {step!r}"
    # Plain names only: a path would read a file outside the exported folder.
    if not isinstance(files, list) or not all(
            isinstance(f, str) and f == os.path.basename(f) and f not in ("", ".", "..") for f in files):
        return "'files' must be a list of file names in the exported folder"
    if not isinstance(leaves, list) or not all(
            isinstance(r, dict) and isinstance(r.get("path"), str) and isinstance(r.get("key"), str)
            and type(r.get("file")) is int and 0 <= r["file"] < len(files) for r in leaves):
        return "'leaves' must be a list of {path, key, file} records, each file an index into 'files'"
    if not isinstance(metrics or [], list) or not all(isinstance(m, dict) for m in metrics or []):
        return "'metrics' must be a list of records"
    return None


def import_state(in_dir: str, workdir: str) -> int:
    """Write the state exported in ``in_dir`` as a checkpoint of a new training workdir; returns its epoch.

    A ValueError naming the file and the problem for a missing or malformed ``meta.json``, a state file that
    is not a readable archive of plain arrays (``npz_sizes.read_arrays``: truncated, pickled objects, sizes the
    file cannot hold), a missing array, an array of another shape or dtype than the config's state, or NaN or
    infinite values; nothing is written then."""
    stored = _read_meta(in_dir)
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
        file = os.path.join(in_dir, stored["files"][r["file"]])
        if r["file"] not in arrays:
            arrays[r["file"]] = read_arrays(file)
        if r["key"] not in arrays[r["file"]]:
            raise ValueError(f"{file}: no array {r['key']!r} (leaf {name})")
        value = arrays[r["file"]][r["key"]]
        if value.shape != like.shape or value.dtype != like.dtype:
            raise ValueError(f"{file}: leaf {name} is {value.dtype}{list(value.shape)}, expected "
                             f"{like.dtype}{list(like.shape)}")
        if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
            raise ValueError(f"{file}: leaf {name} holds non-finite values (NaN or infinity)")
        values.append(value)
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), values)
    with checkpoint_manager(workdir) as mngr:
        if mngr.latest_step() is not None:
            raise ValueError(f"{workdir} already holds checkpoints; import into a new workdir")
        save_checkpoint(mngr, meta["epoch"], state, cfg, meta)
        mngr.wait_until_finished()
    for row in stored.get("metrics") or []:
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
