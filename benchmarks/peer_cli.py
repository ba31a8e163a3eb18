"""What the PyTorch peers' command lines share (``torch_peer.py``, ``authors_peer.py``): the CVRP
workload of ``throughput.py`` and the JSON they print and write."""

from __future__ import annotations

import json

import numpy as np


def cvrp_workload(seed: int, batch: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(locs (B, n+1, 2), demand (B, n+1)) of the CVRP batch ``throughput.py`` generates for ``seed``."""
    import jax

    from mvmoe_jax import instances

    inst = instances.generate(jax.random.key(seed), batch, size, "CVRP")
    return np.asarray(inst.locs), np.asarray(inst.demand)


def emit(result: dict, output: str | None) -> dict:
    """Print ``result`` as JSON, also write it to ``output`` when given; return it."""
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        with open(output, "w") as f:
            f.write(text + "\n")
    return result
