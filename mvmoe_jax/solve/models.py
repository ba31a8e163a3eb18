"""Which model solves which instances: the checkpoint given, or else the shipped model whose training size is
closest to the instance size (``mvmoe_jax.shipped``); and with which distance-aware decoding options
(``nn/locality.py``), how many POMO starts and whether the local search follows, by instance size, where the
user names none."""

from __future__ import annotations

import dataclasses
import re

from mvmoe_jax import checkpoints, shipped
from mvmoe_jax.nn.policy import PolicyConfig, refuse_fixed_bias_on_learned

# Between shipped models equally close in size: the paper's MVMoE first.
_PREFERENCE = ("mvmoe", "mvmoe_light", "pomo_mtl", "pomo")


# The distance bias used by default on instances at least BIAS_FROM_SIZE_RATIO times the model's training size
# (docs/results.md, "Distance-aware decoding": chosen on validation instances of n = 200, CVRP and VRPTW alike,
# and measured from n = 100 to 1,000).
SIZE_DEFAULT_DISTANCE_BIAS = 1.0
BIAS_FROM_SIZE_RATIO = 2
# Larger instances decode from at most SIZE_DEFAULT_MAX_STARTS POMO starts by default, and from fewer as they grow:
# at most STARTS_TIMES_CUSTOMERS / n (200 at n = 250, 100 at 500, 50 at 1,000). At n = 1,000 with the distance
# bias, greedy from 50 starts is 0.24-0.87 % dearer than from 200, in 9 s against 22-25 s an instance, time the
# local search turns into far more (docs/results.md).
SIZE_DEFAULT_MAX_STARTS = 200
STARTS_TIMES_CUSTOMERS = 50_000


class CheckpointRequiredError(ValueError):
    """No checkpoint was given and no shipped model can stand in."""


def trained_size(name: str) -> int | None:
    """The problem size a shipped model was trained at: its card's config ``problem_size``, else the
    ``_n<size>`` ending of its name; None when neither says."""
    card = shipped.card(name)
    for fields in (card.get("config"), card):
        size = fields.get("problem_size") if isinstance(fields, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    m = re.search(r"_n(\d+)$", name)
    return int(m.group(1)) if m else None


def closest_shipped(num_customers: int) -> str:
    """The shipped model trained closest to ``num_customers`` (ties: MVMoE before MVMoE-L before POMO-MTL,
    then the smaller size, then by name). CheckpointRequiredError when none ships."""
    names = shipped.names()
    if not names:
        raise CheckpointRequiredError(
            "--checkpoint is required: no models ship with this installation yet (shipped models: none); give "
            "an orbax checkpoint, a training workdir or an original .pt file")

    def rank(name):
        size = trained_size(name)
        model = shipped.architecture(name).model
        pref = _PREFERENCE.index(model) if model in _PREFERENCE else len(_PREFERENCE)
        return (abs(size - num_customers) if size else float("inf"), pref, size or 0, name)

    return min(names, key=rank)


class Models:
    """Loads each model once. ``checkpoint``: a shipped name or a path for every size; None: per size, the
    closest shipped model."""

    def __init__(self, checkpoint: str | None = None):
        self.checkpoint = checkpoint
        self._loaded: dict[str, tuple[PolicyConfig, dict]] = {}

    def name_for(self, num_customers: int) -> str:
        return self.checkpoint if self.checkpoint else closest_shipped(num_customers)

    def load(self, name: str) -> tuple[PolicyConfig, dict]:
        if name not in self._loaded:
            self._loaded[name] = checkpoints.load_policy(name)
        return self._loaded[name]


def trained_size_of(name: str) -> int | None:
    """``trained_size`` for a shipped model's name; None for a checkpoint path (its training size is not known)."""
    return trained_size(name) if name in shipped.names() else None


def beyond_training_size(trained: int | None, num_customers: int) -> bool:
    """Whether ``num_customers`` is at least ``BIAS_FROM_SIZE_RATIO`` times a known training size ``trained``:
    where the distance bias and the local search apply by default."""
    return trained is not None and num_customers >= BIAS_FROM_SIZE_RATIO * trained


def size_default_decoding(trained: int | None, num_customers: int) -> dict[str, float]:
    """The decoding options used by default for ``num_customers`` with a model trained at ``trained`` customers:
    the distance bias from ``BIAS_FROM_SIZE_RATIO`` times the training size on; none below it or when the training
    size is unknown."""
    return {"distance_bias": SIZE_DEFAULT_DISTANCE_BIAS} if beyond_training_size(trained, num_customers) else {}


def decoding_for(cfg: PolicyConfig, trained: int | None, num_customers: int, given: dict
                 ) -> tuple[PolicyConfig, list[str]]:
    """(the config to decode ``num_customers`` customers with, the option names set by the size default). A model
    with no decoding options of its own gets ``size_default_decoding``; the options ``given`` (the user's,
    ``{"distance_bias": ..., "candidates": ...}``) override both. A model that learned its distance bias decodes
    with it: it has no size default, and a given distance_bias is refused (ValueError)."""
    refuse_fixed_bias_on_learned(cfg, given.get("distance_bias"))
    options = {} if cfg.uses_locations else size_default_decoding(trained, num_customers)
    by_size = [k for k in options if k not in given]
    return dataclasses.replace(cfg, **{**options, **given}), by_size


def size_default_max_starts(num_customers: int) -> int | None:
    """The POMO starts decoded at most by default for ``num_customers`` customers: above
    ``SIZE_DEFAULT_MAX_STARTS`` customers, that many or ``STARTS_TIMES_CUSTOMERS // num_customers`` if fewer; else
    None (all)."""
    if num_customers <= SIZE_DEFAULT_MAX_STARTS:
        return None
    return min(SIZE_DEFAULT_MAX_STARTS, STARTS_TIMES_CUSTOMERS // num_customers)


def size_default_improve(trained: int | None, num_customers: int) -> str:
    """The improvement run by default after the search on ``num_customers`` customers with a model trained at
    ``trained``: the local search (``ls``) from ``BIAS_FROM_SIZE_RATIO`` times the training size on, where the
    policy alone is furthest from good solutions; ``none`` below it or when the training size is unknown."""
    return "ls" if beyond_training_size(trained, num_customers) else "none"


def size_default_note(option: str) -> str:
    """Why a size default set ``option`` (``distance_bias``, ``max_starts`` or ``improve``), and how to change it."""
    if option == "distance_bias":
        return f"the default from {BIAS_FROM_SIZE_RATIO}x the training size; --distance_bias=0 turns it off"
    if option == "improve":
        return f"the default from {BIAS_FROM_SIZE_RATIO}x the training size; --improve=none turns it off"
    return (f"the default above {SIZE_DEFAULT_MAX_STARTS} customers, at most {STARTS_TIMES_CUSTOMERS:,} / n; "
            "--max_starts=N to change")
