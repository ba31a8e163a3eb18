"""Local search under the environment's rules: improve a feasible solution of any of the 16 variants.

    from mvmoe_jax import local_search
    result = local_search.improve_instance(inst, [[3, 7], [12, 5]])     # one Instance, routes of customers
    result.routes, result.cost, result.applied

Moves: 2-opt and or-opt within a route; relocate, exchange and 2-opt* between routes (``moves``). Every
candidate route is replayed under the environment's rules (``route_rules``: capacity under the instance's
backhaul rule, time windows, route limits, open routes), so whatever the checker accepts and only that is
accepted; the descent (``descent``) applies improving moves until none is left. Inter-route moves are granular
(``neighbours``: only those adding an arc between a customer and one of its 40 nearest; None: every candidate).
"""

from __future__ import annotations

from typing import Sequence

from mvmoe_jax.local_search.descent import Improvement, StartInfeasibleError, improve, solution_cost32
from mvmoe_jax.local_search.moves import KINDS
from mvmoe_jax.local_search.route_rules import RouteRules, solution_order

__all__ = ["improve", "improve_instance", "Improvement", "StartInfeasibleError", "RouteRules", "KINDS",
           "solution_order", "solution_cost32"]


def improve_instance(instance, routes: Sequence[Sequence[int]], **options) -> Improvement:
    """``descent.improve`` on one (unbatched) Instance; ``routes``: lists of customers 1..n, or one flat route
    with 0 between routes (the paper's format)."""
    from mvmoe_jax.checker import split_subtours

    if len(routes) and not isinstance(routes[0], (list, tuple)) and not hasattr(routes[0], "__len__"):
        routes = split_subtours(routes)
    return improve(RouteRules.from_instance(instance), routes, **options)
