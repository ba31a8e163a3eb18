"""The moves of the local search, every candidate of a kind enumerated at once with its cost change.

The current routes are a ``Layout``: int (R, W) rows ``[0, c_1, ..., c_m, 0, ...]`` (the depot, the route's
customers, then depot padding), the last row an empty route, which lets a move open a new route. A move
rewrites one route (intra-route moves) or two (inter-route moves); each new route is described by up to
four *pieces*, slices of the current rows ``(row, first position, count, reversed)``, so that ``splice``
builds the candidates' routes for ``route_rules.replay`` in one vectorised pass.

Kinds (positions are indices into a row; a route of m customers has them at 1..m):

- ``two_opt``      (intra) reverse the customers at i..j.
- ``or_opt``       (intra) move the segment of 1 to 3 customers at i..i+k-1 elsewhere in its route, in
                   either direction.
- ``relocate``     (inter) move a segment of 1 to ``max_segment`` customers into another route (or a new
                   one) between two neighbours, in either direction.
- ``exchange``     (inter) swap two customers of different routes.
- ``two_opt_star`` (inter) swap the tails of two routes (or split a route, with the empty row).

The cost change of each candidate is computed from the four to six arcs it removes and adds (``arc``: the
cost of each arc, open routes' arcs into the depot free), float64.

Granular neighbourhoods: given ``near`` (int (n+1, K), each customer's K nearest customers, ``nearest``), the
inter-route moves enumerate only candidates that add an arc from a customer to one of its K nearest (relocate:
the segment's head after a neighbour or its tail before one, or the segment alone in a new route; exchange: a
customer and one of its neighbours; 2-opt*: a new arc (x, y') with y' near x, or a route split), which cuts the
candidates of a round from O(n^2) to O(nK). Without ``near`` every candidate is enumerated.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("two_opt", "or_opt", "relocate", "exchange", "two_opt_star")
INTRA = ("two_opt", "or_opt")
OR_OPT_SEGMENT = 3


def nearest(dist: np.ndarray, k: int) -> np.ndarray:
    """int32 (n+1, k): each customer's k nearest other customers by ``dist`` (float (n+1, n+1)), nearest first
    (ties by index); the depot's row is unused (zeros). k is capped at n - 1."""
    n = dist.shape[0] - 1
    k = max(0, min(k, n - 1))
    d = np.array(dist[1:, 1:], np.float64)
    np.fill_diagonal(d, np.inf)
    order = np.argsort(d, axis=1, kind="stable")[:, :k] + 1
    return np.concatenate([np.zeros((1, k), np.int64), order]).astype(np.int32)


def _is_near(near: np.ndarray) -> np.ndarray:
    """bool (n+1, n+1): [u, v] when v is one of u's neighbours (never for the depot)."""
    out = np.zeros((near.shape[0], near.shape[0]), bool)
    out[np.repeat(np.arange(1, near.shape[0]), near.shape[1]), near[1:].ravel()] = True
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """The current routes. rows int32 (R, W): depot, customers, depot padding, the last row empty;
    sizes int32 (R,) customers per row; route_of, position int32 (n+1,): each customer's row and position
    (the depot's entries are -1)."""

    rows: np.ndarray
    sizes: np.ndarray
    route_of: np.ndarray
    position: np.ndarray

    @classmethod
    def from_routes(cls, routes, num_customers: int) -> "Layout":
        """From lists of customers (non-empty); an empty row is appended."""
        sizes = np.array([len(t) for t in routes] + [0], np.int32)
        rows = np.zeros((len(sizes), int(sizes.max()) + 2), np.int32)
        route_of = np.full(num_customers + 1, -1, np.int32)
        position = np.full(num_customers + 1, -1, np.int32)
        for r, t in enumerate(routes):
            rows[r, 1:len(t) + 1] = t
            route_of[np.asarray(t)] = r
            position[np.asarray(t)] = np.arange(1, len(t) + 1)
        return cls(rows, sizes, route_of, position)

    def routes_by_row(self) -> list[list[int]]:
        """Each row's customers (the last row's list empty)."""
        return [self.rows[r, 1:s + 1].tolist() for r, s in enumerate(self.sizes)]


@dataclasses.dataclass
class Candidates:
    """Candidates of one kind (C of them): delta float64 (C,), the cost change; params int (C, 6), what
    ``build`` needs to write them out."""

    kind: str
    delta: np.ndarray
    params: np.ndarray

    def take(self, idx: np.ndarray) -> "Candidates":
        return Candidates(self.kind, self.delta[idx], self.params[idx])


def _params(*cols) -> np.ndarray:
    cols = list(np.broadcast_arrays(*cols))
    cols += [np.zeros_like(cols[0])] * (6 - len(cols))
    return np.stack(cols, axis=1).astype(np.int32)


def _pieces(*pieces) -> np.ndarray:
    """Pieces (row, start, count, reversed), each an array (C,) or scalar, -> int (C, 4, 4), padded with empty
    pieces."""
    cols = [np.stack(np.broadcast_arrays(*p), axis=-1) for p in pieces]
    out = np.stack(cols, axis=1).astype(np.int32)
    if out.shape[1] < 4:
        out = np.concatenate([out, np.zeros((out.shape[0], 4 - out.shape[1], 4), np.int32)], axis=1)
    return out


def _none(count: int) -> np.ndarray:
    return np.zeros((count, 4, 4), np.int32)


def splice(layout: Layout, pieces: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Build routes from pieces int (C, 4, 4) -> (customers int32 (C, L) padded with the depot, lengths (C,))."""
    counts = pieces[..., 2]
    lengths = counts.sum(axis=1)
    width = max(int(lengths.max(initial=0)), 1)
    offsets = np.cumsum(counts, axis=1) - counts                                  # (C, 4)
    t = np.arange(width)
    k = (t[None, :, None] >= offsets[:, None, :]).sum(-1) - 1                    # (C, L) the piece of slot t
    piece = np.take_along_axis(pieces, k[..., None], axis=1)                     # (C, L, 4)
    local = t[None, :] - np.take_along_axis(offsets, k, axis=1)
    pos = np.where(piece[..., 3] == 1, piece[..., 1] + piece[..., 2] - 1 - local, piece[..., 1] + local)
    pos = np.clip(pos, 0, layout.rows.shape[1] - 1)
    nodes = layout.rows[piece[..., 0], pos]
    return np.where(t[None, :] < lengths[:, None], nodes, 0).astype(np.int32), lengths.astype(np.int32)


def two_opt(layout: Layout, arc: np.ndarray) -> Candidates:
    rows, sizes = layout.rows, layout.sizes
    r, i, j = np.nonzero(np.ones((len(sizes), rows.shape[1], rows.shape[1]), bool))
    keep = (i >= 1) & (i < j) & (j <= sizes[r])
    r, i, j = r[keep], i[keep], j[keep]
    a, u, v, b = rows[r, i - 1], rows[r, i], rows[r, j], rows[r, j + 1]
    delta = arc[a, v] + arc[u, b] - arc[a, u] - arc[v, b]
    return Candidates("two_opt", delta, _params(r, i, j))


def _build_two_opt(layout: Layout, r, i, j, *_):
    m = layout.sizes[r]
    return _pieces((r, 1, i - 1, 0), (r, i, j - i + 1, 1), (r, j + 1, m - j, 0)), None


def _segments(layout: Layout, max_len: int):
    """Every segment of 1..max_len customers of a route, and whether it is taken reversed (segments of one
    customer only forwards): row, first position, count, reversed, each int (S,)."""
    sizes = layout.sizes
    r, i, k, rev = np.nonzero(np.ones((len(sizes), layout.rows.shape[1], max_len + 1, 2), bool))
    keep = (i >= 1) & (k >= 1) & (i + k - 1 <= sizes[r]) & ((rev == 0) | (k >= 2))
    return r[keep], i[keep], k[keep], rev[keep]


def _segment_arcs(layout: Layout, arc: np.ndarray, r, i, k, rev):
    """For segments: (removal's cost change, the segment's first and last customer in insertion order)."""
    rows = layout.rows
    a, f, l, b = rows[r, i - 1], rows[r, i], rows[r, i + k - 1], rows[r, i + k]
    removal = arc[a, b] - arc[a, f] - arc[l, b]
    head, tail = np.where(rev == 1, l, f), np.where(rev == 1, f, l)
    return removal, head, tail


def or_opt(layout: Layout, arc: np.ndarray, max_len: int = OR_OPT_SEGMENT) -> Candidates:
    rows, sizes = layout.rows, layout.sizes
    r, i, k, rev = _segments(layout, max_len)
    s_idx, p = np.nonzero(np.ones((len(r), rows.shape[1]), bool))
    r, i, k, rev = r[s_idx], i[s_idx], k[s_idx], rev[s_idx]
    m = sizes[r]
    keep = (p <= m) & ((p < i - 1) | (p >= i + k))
    r, i, k, rev, p, m = r[keep], i[keep], k[keep], rev[keep], p[keep], m[keep]
    removal, head, tail = _segment_arcs(layout, arc, r, i, k, rev)
    x, y = rows[r, p], rows[r, p + 1]
    delta = removal + arc[x, head] + arc[tail, y] - arc[x, y]
    return Candidates("or_opt", delta, _params(r, i, k, rev, p))


def _build_or_opt(layout: Layout, r, i, k, rev, p, _):
    m = layout.sizes[r]
    before = p < i - 1
    first = np.where(before[:, None, None],
                     _pieces((r, 1, p, 0), (r, i, k, rev), (r, p + 1, i - 1 - p, 0), (r, i + k, m - i - k + 1, 0)),
                     _pieces((r, 1, i - 1, 0), (r, i + k, np.maximum(p - i - k + 1, 0), 0), (r, i, k, rev),
                             (r, p + 1, m - p, 0)))
    return first, None


def relocate(layout: Layout, arc: np.ndarray, max_len: int = 1, near: np.ndarray | None = None) -> Candidates:
    rows, sizes = layout.rows, layout.sizes
    r, i, k, rev = _segments(layout, max_len)
    if near is None:
        # Insertion slots: between positions p and p + 1 of row s, p = 0..size.
        s_all, p_all = np.nonzero(np.arange(rows.shape[1])[None, :] <= sizes[:, None])
        seg, slot = np.nonzero(r[:, None] != s_all[None, :])
        s, p = s_all[slot], p_all[slot]
    else:
        seg, s, p = _near_slots(layout, near, r, i, k, rev)
    r, i, k, rev = r[seg], i[seg], k[seg], rev[seg]
    # A whole route moved into the empty row changes nothing.
    keep = ~((sizes[s] == 0) & (k == sizes[r]))
    r, i, k, rev, s, p = r[keep], i[keep], k[keep], rev[keep], s[keep], p[keep]
    removal, head, tail = _segment_arcs(layout, arc, r, i, k, rev)
    x, y = rows[s, p], rows[s, p + 1]
    delta = removal + arc[x, head] + arc[tail, y] - arc[x, y]
    return Candidates("relocate", delta, _params(r, i, k, rev, s, p))


def _near_slots(layout: Layout, near: np.ndarray, r, i, k, rev):
    """Granular insertion slots of segments (row, first position, count, reversed): each segment after a
    neighbour of its head, before a neighbour of its tail, and alone in the empty row; (segment index, row,
    position p: between p and p + 1), each once, in other routes than the segment's."""
    rows = layout.rows
    f, l = rows[r, i], rows[r, i + k - 1]
    head, tail = np.where(rev == 1, l, f), np.where(rev == 1, f, l)
    count, width = len(r), near.shape[1]
    seg = np.repeat(np.arange(count), width)
    after, before = near[head].ravel(), near[tail].ravel()
    s_after, p_after = layout.route_of[after], layout.position[after]
    s_before, p_before = layout.route_of[before], layout.position[before] - 1
    # A slot both after a neighbour of the head and before one of the tail is listed once, as the former.
    once = ~_is_near(near)[head[seg], rows[s_before, p_before]]
    empty = len(layout.sizes) - 1
    seg = np.concatenate([seg, seg[once], np.arange(count)])
    s = np.concatenate([s_after, s_before[once], np.full(count, empty)])
    p = np.concatenate([p_after, p_before[once], np.zeros(count, np.int32)])
    keep = s != r[seg]
    return seg[keep], s[keep], p[keep]


def _build_relocate(layout: Layout, r, i, k, rev, s, p):
    m_r, m_s = layout.sizes[r], layout.sizes[s]
    return (_pieces((r, 1, i - 1, 0), (r, i + k, m_r - i - k + 1, 0)),
            _pieces((s, 1, p, 0), (r, i, k, rev), (s, p + 1, m_s - p, 0)))


def exchange(layout: Layout, arc: np.ndarray, near: np.ndarray | None = None) -> Candidates:
    rows, sizes, route_of, position = layout.rows, layout.sizes, layout.route_of, layout.position
    if near is None:
        u, v = np.nonzero(route_of[:, None] < route_of[None, :])
        keep = (u >= 1) & (route_of[u] >= 0)
        u, v = u[keep], v[keep]
    else:       # a customer and one of its neighbours (a mutual pair once), the one of the lower route first
        a = np.repeat(np.arange(1, len(route_of)), near.shape[1])
        b = near[1:].ravel()
        keep = (route_of[a] != route_of[b]) & ~(_is_near(near)[b, a] & (b < a))
        a, b = a[keep], b[keep]
        first = route_of[a] < route_of[b]
        u, v = np.where(first, a, b), np.where(first, b, a)
    r, i, s, j = route_of[u], position[u], route_of[v], position[v]
    a_u, b_u, a_v, b_v = rows[r, i - 1], rows[r, i + 1], rows[s, j - 1], rows[s, j + 1]
    delta = (arc[a_u, v] + arc[v, b_u] - arc[a_u, u] - arc[u, b_u]
             + arc[a_v, u] + arc[u, b_v] - arc[a_v, v] - arc[v, b_v])
    return Candidates("exchange", delta, _params(r, i, s, j))


def _build_exchange(layout: Layout, r, i, s, j, *_):
    sizes = layout.sizes
    return (_pieces((r, 1, i - 1, 0), (s, j, 1, 0), (r, i + 1, sizes[r] - i, 0)),
            _pieces((s, 1, j - 1, 0), (r, i, 1, 0), (s, j + 1, sizes[s] - j, 0)))


def two_opt_star(layout: Layout, arc: np.ndarray, near: np.ndarray | None = None) -> Candidates:
    rows, sizes = layout.rows, layout.sizes
    if near is None:
        r, s, i, j = np.nonzero(np.ones((len(sizes), len(sizes), rows.shape[1], rows.shape[1]), bool))
    else:
        r, s, i, j = _near_tail_swaps(layout, near)
    keep = (r < s) & (i <= sizes[r]) & (j <= sizes[s]) & (sizes[r] > 0)
    # Cutting both routes at their ends (or both at their starts) leaves them as they are.
    keep &= ~((i == sizes[r]) & (j == sizes[s])) & ~((i == 0) & (j == 0))
    r, s, i, j = r[keep], s[keep], i[keep], j[keep]
    x, x1, y, y1 = rows[r, i], rows[r, i + 1], rows[s, j], rows[s, j + 1]
    delta = arc[x, y1] + arc[y, x1] - arc[x, x1] - arc[y, y1]
    return Candidates("two_opt_star", delta, _params(r, i, s, j))


def _near_tail_swaps(layout: Layout, near: np.ndarray):
    """Granular 2-opt* candidates (row r, cut i, row s, cut j) with r < s: those adding an arc (x, w) or (w, x)
    between a customer x and one of its neighbours w, and every split of a route into the empty row; each
    once."""
    rows, route_of, position, sizes = layout.rows, layout.route_of, layout.position, layout.sizes
    is_near = _is_near(near)
    x = np.repeat(np.arange(1, len(route_of)), near.shape[1])
    w = near[1:].ravel()
    back = ~is_near[w, x]                 # the arc (w, x) where x is not also w's neighbour (else listed from w)
    tail, head = np.concatenate([x, w[back]]), np.concatenate([w, x[back]])      # the arc (tail, head) added
    r, i = route_of[tail], position[tail]
    s, j = route_of[head], position[head] - 1
    swap = r > s
    r, s, i, j = np.where(swap, s, r), np.where(swap, r, s), np.where(swap, j, i), np.where(swap, i, j)
    # A candidate adds two arcs, (x, y') and (y, x'); when both are near ones, keep it from the first only.
    first_tail, first_head = rows[r, i], rows[s, j + 1]
    second = (first_tail != tail) | (first_head != head)
    listed = (first_tail > 0) & (first_head > 0) & (is_near[first_tail, first_head] | is_near[first_head, first_tail])
    keep = ~(second & listed)
    r, s, i, j = r[keep], s[keep], i[keep], j[keep]
    split_r, split_i = np.nonzero(np.arange(rows.shape[1])[None, :] < sizes[:, None])
    empty = len(sizes) - 1
    return (np.concatenate([r, split_r]), np.concatenate([s, np.full(len(split_r), empty)]),
            np.concatenate([i, split_i]), np.concatenate([j, np.zeros(len(split_r), np.int64)]))


def _build_two_opt_star(layout: Layout, r, i, s, j, *_):
    sizes = layout.sizes
    return (_pieces((r, 1, i, 0), (s, j + 1, sizes[s] - j, 0)),
            _pieces((s, 1, j, 0), (r, i + 1, sizes[r] - i, 0)))


# The rows each kind rewrites (params' columns), and its new routes.
_ROWS = {"two_opt": (0,), "or_opt": (0,), "relocate": (0, 4), "exchange": (0, 2), "two_opt_star": (0, 2)}
_BUILDERS = {"two_opt": _build_two_opt, "or_opt": _build_or_opt, "relocate": _build_relocate,
             "exchange": _build_exchange, "two_opt_star": _build_two_opt_star}


def build(layout: Layout, cands: Candidates) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates written out: (rows int (C, 2), the rows they rewrite, the second -1 for intra-route moves;
    first, second int (C, 4, 4), the pieces of the routes replacing them, ``second`` empty for intra-route
    moves)."""
    cols = _ROWS[cands.kind]
    rows = np.full((len(cands.delta), 2), -1, np.int32)
    for n, c in enumerate(cols):
        rows[:, n] = cands.params[:, c]
    first, second = _BUILDERS[cands.kind](layout, *cands.params.T)
    return rows, first, _none(len(cands.delta)) if second is None else second


GENERATORS = {"two_opt": two_opt, "or_opt": or_opt, "relocate": relocate, "exchange": exchange,
              "two_opt_star": two_opt_star}


def generate(kind: str, layout: Layout, arc: np.ndarray, max_segment: int = 1,
             near: np.ndarray | None = None) -> Candidates:
    """The candidates of ``kind``: relocate's segments of at most ``max_segment``; the inter-route kinds
    restricted to ``near`` (granular) when given; the intra-route kinds always whole."""
    if kind == "relocate":
        return relocate(layout, arc, max_segment, near)
    if kind in INTRA:
        return GENERATORS[kind](layout, arc)
    return GENERATORS[kind](layout, arc, near)
