"""Trained models that ship inside the package, loadable by name.

Each shipped model is a folder ``mvmoe_jax/pretrained/<name>/`` with two files:

``params.npz``
    The parameters only, float32, one array per parameter named by its path in the Flax tree
    (``layers_0/feed_forward/experts_w1``). Read with ``allow_pickle=False``: loading runs no code.
``card.json``
    What the model is and how it was made: ``architecture`` (the PolicyConfig fields that shape the
    parameters), ``params_sha256`` (of ``params.npz``), the training ``command``, ``config``, commit,
    instances seen, hardware and wall time, its learning curve and results, and ``check``: per-instance
    greedy objectives on a few generated instances, which the tests reproduce.

``load("mvmoe_4e_n50")`` returns ``(PolicyConfig, {"params": ...})`` like ``checkpoints.load_policy``, which
accepts a shipped name wherever it accepts a path. ``export`` writes a folder from trained parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from mvmoe_jax.io.npz_sizes import read_arrays
from mvmoe_jax.nn.policy import PolicyConfig

SHIPPED_DIR = pathlib.Path(__file__).resolve().parent / "pretrained"
PARAMS_FILE = "params.npz"
CARD_FILE = "card.json"
# The PolicyConfig fields that decide the parameter tree; the others choose how a model is executed.
ARCHITECTURE_FIELDS = ("model", "embedding_dim", "num_heads", "num_layers", "ff_hidden_dim", "logit_clipping",
                       "num_experts", "topk", "routing_method", "routing_level", "expert_loc", "learned_distance_bias")


class ShippedModelError(ValueError):
    """A shipped model that is unknown, missing a file, or damaged."""


def names(root: pathlib.Path | None = None) -> list[str]:
    """The names of the shipped models, sorted."""
    root = SHIPPED_DIR if root is None else root
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / CARD_FILE).is_file())


def looks_like_name(text: str) -> bool:
    """True for a bare model name (no folder, no file suffix), as opposed to a path."""
    return bool(text) and os.sep not in text and "/" not in text and "." not in text


def describe_available(root: pathlib.Path | None = None) -> str:
    shipped = names(root)
    return ("shipped models: " + ", ".join(shipped)) if shipped else "no models ship with this installation"


def _folder(name: str, root: pathlib.Path | None) -> pathlib.Path:
    root = SHIPPED_DIR if root is None else root
    if name not in names(root):
        raise ShippedModelError(f"{name!r} is not a shipped model ({describe_available(root)})")
    return root / name


def card(name: str, root: pathlib.Path | None = None) -> dict[str, Any]:
    """The model card of a shipped model."""
    path = _folder(name, root) / CARD_FILE
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ShippedModelError(f"the card of shipped model {name!r} ({path}) cannot be read: {e}") from None


def architecture(name: str, root: pathlib.Path | None = None) -> PolicyConfig:
    fields = card(name, root).get("architecture")
    if not isinstance(fields, dict) or "model" not in fields:
        raise ShippedModelError(f"the card of shipped model {name!r} has no architecture")
    return PolicyConfig.from_dict({k: v for k, v in fields.items() if k in ARCHITECTURE_FIELDS})


def sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load(name: str, cfg: PolicyConfig | None = None, root: pathlib.Path | None = None
         ) -> tuple[PolicyConfig, dict]:
    """(config, {"params": ...}) of a shipped model. With ``cfg`` given, it must be the same architecture
    (its execution fields are kept); a ShippedModelError for a damaged or missing file."""
    from mvmoe_jax.checkpoints import CheckpointMismatchError, check_params_fit

    folder = _folder(name, root)
    stored = architecture(name, root)
    if cfg is None:
        cfg = stored
    else:
        want = {f: getattr(cfg, f) for f in ARCHITECTURE_FIELDS}
        have = {f: getattr(stored, f) for f in ARCHITECTURE_FIELDS}
        diff = [f"{f}: shipped {have[f]!r}, requested {want[f]!r}" for f in ARCHITECTURE_FIELDS if want[f] != have[f]]
        if diff:
            raise CheckpointMismatchError(f"shipped model {name!r} is another architecture: " + "; ".join(diff))
    path = folder / PARAMS_FILE
    if not path.is_file():
        raise ShippedModelError(f"shipped model {name!r} is missing its weights file {path}; reinstall the package")
    expected = card(name, root).get("params_sha256")
    if expected and sha256(path) != expected:
        raise ShippedModelError(f"the weights of shipped model {name!r} ({path}) are damaged (checksum mismatch); "
                                "reinstall the package")
    try:
        params = read_params(path)
    except (OSError, ValueError) as e:
        reason = str(e).removeprefix(f"{path}: ")     # the path is named once, here
        raise ShippedModelError(f"the weights of shipped model {name!r} ({path}) cannot be read: {reason}") from None
    check_params_fit(params["params"], cfg, f"shipped model {name!r}")
    return cfg, params


def write_params(path: str | os.PathLike, params: dict) -> int:
    """Write ``params`` ({"params": ...}) as one float32 array per parameter, named by its tree path
    (``layers_0/feed_forward/experts_w1``), into the ``.npz`` file ``path``; returns the parameter count."""
    flat = {"/".join(k): np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(params["params"]).items()}
    np.savez(path, **flat)
    return int(sum(v.size for v in flat.values()))


def read_params(path: str | os.PathLike) -> dict:
    """``{"params": ...}`` from a file ``write_params`` wrote (no pickles: loading runs no code). A
    ValueError for a file that is not such an archive (``npz_sizes.read_arrays``), an array that is not
    float32, or one holding NaN or infinities (a model with them decodes silently meaningless routes)."""
    flat = read_arrays(path)
    bad = [k for k, v in flat.items() if v.dtype != np.float32]
    if bad:
        raise ValueError(f"parameters not float32: {', '.join(bad[:4])}")
    bad = [k for k, v in flat.items() if not np.all(np.isfinite(v))]
    if bad:
        raise ValueError(f"parameters holding non-finite values (NaN or infinity): {', '.join(bad[:4])}")
    return {"params": traverse_util.unflatten_dict({tuple(k.split("/")): jnp.asarray(v) for k, v in flat.items()})}


def export(folder: str | os.PathLike, params: dict, cfg: PolicyConfig, card_fields: dict[str, Any]) -> pathlib.Path:
    """Write ``params`` ({"params": ...}) and a card into ``folder`` (created). Returns the folder."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    num_params = write_params(folder / PARAMS_FILE, params)
    arch = {k: v for k, v in dataclasses.asdict(cfg).items() if k in ARCHITECTURE_FIELDS}
    arch["expert_loc"] = list(arch["expert_loc"])
    body = {"name": folder.name, "architecture": arch, "params_sha256": sha256(folder / PARAMS_FILE),
            "num_params": num_params, **card_fields}
    with open(folder / CARD_FILE, "w") as f:
        json.dump(body, f, indent=1)
        f.write("\n")
    return folder


def check_objectives(cfg: PolicyConfig, params: dict, *, seed: int = 0, num_instances: int = 4,
                     num_customers: int = 50, variants=None) -> dict[str, list[float]]:
    """Per-instance greedy objectives (all starts, x8 augmentation) on ``num_instances`` generated instances
    of each variant (``jax.random.key(seed)`` folded with the variant's index): the card's ``check``, which
    a user or a test can reproduce without any data set."""
    import jax

    from mvmoe_jax import problems
    from mvmoe_jax.instances import generate
    from mvmoe_jax.rollout import greedy_evaluate

    out = {}
    for i, var in enumerate(problems.parse_variants(variants or "ALL")):
        batch = generate(jax.random.fold_in(jax.random.key(seed), i), num_instances, num_customers, var)
        res = greedy_evaluate(cfg, params, batch, jax.random.key(0), pomo_size=num_customers, augment=True)
        out[var.name] = [float(x) for x in np.asarray(res.obj)]
    return out
