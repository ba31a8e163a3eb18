"""A PNG of one solution (matplotlib, no display needed).

The depot is a black square, customers circles (linehaul customers, where there are backhaul customers,
which are triangles); each route has its own colour, distinct however many routes there are (``route_styles``;
an open route stops at its last customer). Where time windows bind, the customer is ringed: red
where the vehicle arrives with less than 1% of the depot's horizon left before the window closes, orange
where it waits for the window to open. Routes within 1% of the route limit are drawn thicker and named in
the legend with their length. The title gives the instance, variant (with its backhaul rule), cost and the gap to a best-known value.
"""

from __future__ import annotations

import math

import numpy as np

from mvmoe_jax.solve.outputs import variant_label

CONVENTION_WORDS = {"nint": "rounded edges", "dimacs": "edges truncated to 0.1"}
TIGHT = 0.01          # a window or limit binds when less than this fraction of its scale is left


QUALITATIVE = 20          # up to this many routes take tab20's colours; more sample a continuous colormap
LINE_STYLES = ("-", "--", "-.", ":")


def route_styles(count: int) -> list[tuple[tuple[float, float, float, float], str]]:
    """(RGBA colour, line style) of each of ``count`` routes, no two alike: tab20's colours for up to 20 routes,
    else ``turbo`` sampled at ``count`` points (distinct colours, neighbours told apart by cycling line styles)."""
    import matplotlib

    if count <= QUALITATIVE:
        cmap = matplotlib.colormaps["tab20"]
        return [(cmap(k), "-") for k in range(count)]
    cmap = matplotlib.colormaps["turbo"]
    return [(cmap(k / (count - 1)), LINE_STYLES[k % len(LINE_STYLES)]) for k in range(count)]


def route_timing(coords: np.ndarray, tour, tw_start, tw_end, service) -> list[tuple[int, float, float]]:
    """(customer, arrival, service start) along one route from the depot at time 0, in the coordinates' units."""
    t, here, out = 0.0, 0, []
    for c in tour:
        arrive = t + math.dist(coords[here], coords[c])
        start = max(arrive, tw_start[c])
        out.append((c, arrive, start))
        t, here = start + service[c], c
    return out


def plot_solution(path: str, problem, solution) -> str:
    """Write the PNG of ``solution`` (a ``Solution``) for ``problem`` (its ``Problem``) to ``path``."""
    solution_figure(problem, solution).savefig(path, dpi=110, bbox_inches="tight")
    return path


def solution_figure(problem, solution):
    """The matplotlib Figure of ``solution`` for ``problem``: one Axes, its legend and title as described above."""
    from matplotlib.figure import Figure

    inst = problem.instance
    coords = problem.coords
    scale = problem.scale
    demand = np.asarray(inst.demand)
    is_open, has_tw, has_limit = bool(inst.is_open), bool(inst.has_tw), bool(inst.has_limit)
    tw_start, tw_end = np.asarray(inst.tw_start, np.float64) * scale, np.asarray(inst.tw_end, np.float64) * scale
    service = np.asarray(inst.service_time, np.float64) * scale
    limit = float(inst.route_limit) * scale

    fig = Figure(figsize=(7.5, 7.5))
    ax = fig.add_subplot()
    styles = route_styles(len(solution.routes))
    late, waits = [], []
    for k, tour in enumerate(solution.routes):
        seq = [0, *tour] + ([] if is_open else [0])
        xy = coords[seq]
        length = sum(math.dist(coords[a], coords[b]) for a, b in zip(seq[:-1], seq[1:]))
        tight = has_limit and length >= (1 - TIGHT) * limit
        label = f"route {k + 1}: length {length:.4g} of limit {limit:.4g}" if tight else None
        colour, style = styles[k]
        ax.plot(xy[:, 0], xy[:, 1], style, color=colour, lw=2.6 if tight else 1.2, label=label, zorder=1)
        if has_tw:
            horizon = tw_end[0]
            for c, arrive, start in route_timing(coords, tour, tw_start, tw_end, service):
                if tw_end[c] - arrive <= TIGHT * horizon:
                    late.append(c)
                elif start > arrive:
                    waits.append(c)
    line = np.flatnonzero(demand > 0)
    back = np.flatnonzero(demand < 0)
    ax.scatter(coords[line, 0], coords[line, 1], s=18, c="tab:blue", marker="o",
               label="linehaul customer" if back.size else "customer", zorder=2)
    if back.size:
        ax.scatter(coords[back, 0], coords[back, 1], s=30, c="tab:green", marker="^", label="backhaul customer",
                   zorder=2)
    for nodes, colour, label in ((late, "red", "arrives as its time window closes"),
                                 (waits, "orange", "waits for its time window to open")):
        if nodes:
            ax.scatter(coords[nodes, 0], coords[nodes, 1], s=90, facecolors="none", edgecolors=colour, lw=1.4,
                       label=label, zorder=3)
    ax.scatter(coords[:1, 0], coords[:1, 1], s=90, c="black", marker="s", label="depot", zorder=4)
    variant = variant_label(solution.variant, getattr(solution, "backhaul_rule", "paper"))
    title = f"{solution.name}: {variant}, n = {solution.num_customers}, cost {solution.cost:.6g}"
    if solution.cost_convention != "exact":
        title += f" ({solution.convention_cost:.6g} with {CONVENTION_WORDS[solution.cost_convention]})"
    if solution.best_known is not None:
        title += f"\ngap {solution.gap:+.2f}% to the best known {solution.best_known:.6g}"
    ax.set_title(title, fontsize=10)
    ax.set_aspect("equal")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
