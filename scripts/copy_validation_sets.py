"""Copy the paper's test sets that training validates on (instances and reference solutions of one size) into a
folder laid out like the paper's data, to carry to a machine without ``../shared``:

    python scripts/copy_validation_sets.py .gpu/data --size=50 --variants=TRAIN
    DATA_DIR=.gpu/data bash scripts/gpu_train.sh ...

All 16 variants at n = 50 take 38 MB, the 6 training variants 13 MB (what travels to an accelerator machine is
at most 64 MiB, the carried training state included).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from mvmoe_jax import problems  # noqa: E402  (the repository root is on the path now)
from mvmoe_jax.io import paper  # noqa: E402

DEFAULT_DATA = REPO.parent / "shared" / "data" / "mvmoe-paper"


def copy_validation_sets(source: str | os.PathLike, destination: str | os.PathLike, size: int,
                         variants: str) -> list[pathlib.Path]:
    """Copy each variant's test set of ``size`` and its reference solutions; the copied paths. A missing test
    set is an error naming it; a missing reference is skipped, as validation then reports objectives only."""
    copied = []
    for var in problems.parse_variants(variants):
        instances = pathlib.Path(paper.dataset_path(source, var, size))
        if not instances.exists():
            raise FileNotFoundError(f"no test set of {var.name} at n = {size}: {instances} does not exist")
        folder = pathlib.Path(destination) / var.name
        folder.mkdir(parents=True, exist_ok=True)
        for path in (instances, pathlib.Path(paper.reference_solution_path(source, var, size))):
            if path.exists():
                copied.append(pathlib.Path(shutil.copy(path, folder)))
    return copied


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("destination")
    p.add_argument("--size", type=int, default=50)
    p.add_argument("--variants", default="ALL", help="comma list, TRAIN or ALL (validation_problems)")
    p.add_argument("--data_dir", default=str(DEFAULT_DATA), help="the paper's data")
    args = p.parse_args(argv)
    copied = copy_validation_sets(args.data_dir, args.destination, args.size, args.variants)
    megabytes = sum(path.stat().st_size for path in copied) / 1e6
    print(f"copied {len(copied)} files, {megabytes:.1f} MB, to {args.destination}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
