"""The 16 VRP variants as attribute flags over {C, O, B, L, TW}.

C (capacity) is always on. A variant's name is ``[O]VRP[B][L][TW]``, with ``CVRP`` for C alone. The
paper trains on six variants and evaluates the other ten zero-shot.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Variant:
    """One VRP variant. ``flags`` is the order used for flag arrays everywhere: (O, B, L, TW)."""

    name: str
    open: bool
    backhaul: bool
    limit: bool
    tw: bool

    @property
    def flags(self) -> tuple[bool, bool, bool, bool]:
        return (self.open, self.backhaul, self.limit, self.tw)

    @property
    def lower(self) -> str:
        """The lower-case spelling the paper uses in file names (``vrpbltw50_uniform.pkl``)."""
        return self.name.lower()

    def __str__(self) -> str:
        return self.name


class UnknownVariantError(ValueError):
    """Raised for a variant name that is not one of the 16."""


def _name_from_flags(open_: bool, backhaul: bool, limit: bool, tw: bool) -> str:
    if not (open_ or backhaul or limit or tw):
        return "CVRP"
    return ("O" if open_ else "") + "VRP" + ("B" if backhaul else "") + ("L" if limit else "") + (
        "TW" if tw else "")


# The paper's order: the six training variants first, then the ten unseen ones.
_ORDER = ("CVRP", "OVRP", "VRPB", "VRPL", "VRPTW", "OVRPTW", "OVRPB", "OVRPL", "VRPBL", "VRPBTW",
          "VRPLTW", "OVRPBL", "OVRPBTW", "OVRPLTW", "VRPBLTW", "OVRPBLTW")

_BY_NAME: dict[str, Variant] = {}
for _o in (False, True):
    for _b in (False, True):
        for _l in (False, True):
            for _t in (False, True):
                _v = Variant(_name_from_flags(_o, _b, _l, _t), _o, _b, _l, _t)
                _BY_NAME[_v.name] = _v

VARIANTS: tuple[Variant, ...] = tuple(_BY_NAME[n] for n in _ORDER)
VARIANT_NAMES: tuple[str, ...] = _ORDER
TRAIN_VARIANTS: tuple[str, ...] = _ORDER[:6]
UNSEEN_VARIANTS: tuple[str, ...] = _ORDER[6:]


def get_variant(name: str | Variant) -> Variant:
    """Look a variant up by name (case-insensitive). Raises UnknownVariantError naming the valid ones."""
    if isinstance(name, Variant):
        return name
    if not isinstance(name, str):
        raise UnknownVariantError(f"variant must be a name such as 'VRPBLTW', got {type(name).__name__}")
    key = name.strip().upper()
    if key == "VRP":
        key = "CVRP"
    try:
        return _BY_NAME[key]
    except KeyError:
        raise UnknownVariantError(
            f"unknown VRP variant {name!r}; expected one of: {', '.join(VARIANT_NAMES)}") from None


def variant_from_flags(open_: bool, backhaul: bool, limit: bool, tw: bool) -> Variant:
    return _BY_NAME[_name_from_flags(bool(open_), bool(backhaul), bool(limit), bool(tw))]


def parse_variants(spec: str | Sequence[str]) -> list[Variant]:
    """Parse ``ALL``, ``TRAIN``, ``UNSEEN`` or a comma-separated list of names into variants."""
    if isinstance(spec, str):
        key = spec.strip().upper()
        if key == "ALL":
            return list(VARIANTS)
        if key == "TRAIN":
            return [get_variant(n) for n in TRAIN_VARIANTS]
        if key in ("UNSEEN", "ZERO_SHOT", "ZEROSHOT"):
            return [get_variant(n) for n in UNSEEN_VARIANTS]
        items: Iterable[str] = [s for s in spec.split(",") if s.strip()]
    else:
        items = spec
    out = [get_variant(s) for s in items]
    if not out:
        raise UnknownVariantError(f"no variant given in {spec!r}; expected ALL, TRAIN, UNSEEN or a comma "
                                  f"list of: {', '.join(VARIANT_NAMES)}")
    return out


def flags_array(variants: Sequence[str | Variant]) -> np.ndarray:
    """bool (len(variants), 4) array of (O, B, L, TW) flags."""
    return np.array([get_variant(v).flags for v in variants], dtype=bool)


# ----------------------------------------------------------------------------------------------------
# Backhaul rules (docs/environment.md, "Backhaul rules"): how linehauls and backhauls share a route. An
# Instance holds the rule's index (``backhaul_rule``, int8) beside the variant flags.
# ----------------------------------------------------------------------------------------------------

# paper: the MVMoE paper's rule (the vehicle leaves full; a pickup frees room for later deliveries).
# classic: Toth & Vigo's VRPB (VRPLIB, PyVRP): linehauls before backhauls, a route starts with a linehaul,
#          deliveries and pickups each fit the capacity.
# mixed: RouteFinder's mixed backhauls: any order; the vehicle leaves with the route's deliveries and the
#        load on board never exceeds the capacity.
BACKHAUL_RULES: tuple[str, ...] = ("paper", "classic", "mixed")
PAPER_RULE, CLASSIC_RULE, MIXED_RULE = 0, 1, 2


def backhaul_rule_index(rule: str | int) -> int:
    """The index of a backhaul rule given by name (case-insensitive) or index; ValueError naming the valid ones."""
    if isinstance(rule, (int, np.integer)) and not isinstance(rule, bool) and 0 <= int(rule) < len(BACKHAUL_RULES):
        return int(rule)
    if isinstance(rule, str) and rule.strip().lower() in BACKHAUL_RULES:
        return BACKHAUL_RULES.index(rule.strip().lower())
    raise ValueError(f"unknown backhaul rule {rule!r}; expected one of: {', '.join(BACKHAUL_RULES)}")


def backhaul_rule_name(rule: str | int) -> str:
    """The name of a backhaul rule given by name or index."""
    return BACKHAUL_RULES[backhaul_rule_index(rule)]
