"""Which model solves which instances: the checkpoint given, or else the shipped model whose training size is
closest to the instance size (``mvmoe_jax.shipped``)."""

from __future__ import annotations

import re

from mvmoe_jax import checkpoints, shipped
from mvmoe_jax.nn.policy import PolicyConfig

# Between shipped models equally close in size: the paper's MVMoE first.
_PREFERENCE = ("mvmoe", "mvmoe_light", "pomo_mtl", "pomo")


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
