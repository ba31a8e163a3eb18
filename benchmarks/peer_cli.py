"""What the benchmark scripts and the PyTorch peers' command lines share (``throughput.py``,
``torch_peer.py``, ``authors_peer.py``, ``bf16_quality.py``): the reference fixture checkpoints, the CVRP
workload of ``throughput.py`` and the JSON they print and write. Imports neither jax nor torch at load."""

from __future__ import annotations

import json
import pathlib

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE_DIR = REPO_ROOT.parent / "shared" / "fixtures" / "torch-reference" / "checkpoints"
# The briefly trained checkpoints of the original implementation, one per model of the paper.
FIXTURE_CHECKPOINTS = {"pomo_mtl": "mtl_n20_fixture.pt", "mvmoe": "moe_n20_fixture.pt",
                       "mvmoe_light": "moe_light_n20_fixture.pt"}


def fixture_checkpoint(model: str) -> str | None:
    """The path of ``model``'s fixture checkpoint in ../shared, None where shared/ is absent."""
    path = FIXTURE_DIR / FIXTURE_CHECKPOINTS[model]
    return str(path) if path.is_file() else None


def cvrp_workload(seed: int, batch: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(locs (B, n+1, 2), demand (B, n+1)) of the CVRP batch ``throughput.py`` generates for ``seed``."""
    import jax

    from mvmoe_jax import instances

    inst = instances.generate(jax.random.key(seed), batch, size, "CVRP")
    return np.asarray(inst.locs), np.asarray(inst.demand)


def check_warmup(warmup: int) -> None:
    """Refuses a peer training run with fewer than one untimed warm-up step (its first step pays one-off
    allocation and caching, which no timed step may include)."""
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 step, got {warmup}")


def emit(result: dict, output: str | None) -> dict:
    """Print ``result`` as JSON, also write it to ``output`` when given; return it."""
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        with open(output, "w") as f:
            f.write(text + "\n")
    return result
