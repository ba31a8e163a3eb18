"""The grouped execution of MoE experts (plan field ``moe_dispatch``: ``grouped_mlp`` or ``grouped``; reference:
``nn.moe.gated_experts_forward``, every expert on every token mixed by the gates).

Only the chosen experts run, and nothing is dropped: the (unit, expert) assignments are sorted by expert into
blocks, each block runs through its expert's weights, and the weighted outputs are summed back per unit:
about k/E of the dense FLOPs plus under one block of padding per expert. MLP experts have a written-out
backward pass (``mlp_expert_blocks``). Where the units are a batch split over devices, the sort runs within
``sort_groups`` groups of consecutive units, one per device, so that no device gathers another's units.
On a CPU from a few hundred assignments on the dense execution's (tokens, E x hidden) activations leave the
cache while the blocks stay in it (docs/performance.md, "Grouped MoE experts").
"""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping

import jax
import jax.numpy as jnp

Array = jax.Array

# Units per block of the grouped execution: large enough for efficient matmuls on a CPU, small enough that
# the padding (< one block per expert) stays a small fraction of the work: 32 below 1,024 assignments, where
# the padding dominates, 128 up to 8,192 (above the encoder calls of rollout.CPU_ENCODER_TOKENS), 256 from
# there (see docs/performance.md, "Grouped MoE experts").
GROUP_BLOCK_SMALL = 32
GROUP_BLOCK_SMALL_BELOW = 1024         # assignments (tokens x k)
GROUP_BLOCK = 128
GROUP_BLOCK_LARGE = 256
GROUP_BLOCK_LARGE_FROM = 8192          # assignments (tokens x k)


def group_block(num_assignments: int) -> int:
    """Units per block of ``grouped_experts_forward`` for this many assignments (see GROUP_BLOCK)."""
    if num_assignments < GROUP_BLOCK_SMALL_BELOW:
        return GROUP_BLOCK_SMALL
    return GROUP_BLOCK_LARGE if num_assignments >= GROUP_BLOCK_LARGE_FROM else GROUP_BLOCK


def grouped_experts_forward(params: Mapping[str, Array], units: Array, expert_index: Array, weights: Array,
                            active: Array, *, block: int = GROUP_BLOCK, dtype=jnp.float32,
                            precision: Any = None, by_expert: bool = False, sort_groups: int = 1,
                            blocks_as_one_product: bool = False) -> Array:
    """Run only the chosen experts: sort the (unit, expert) assignments by expert, pad each expert's group
    to whole blocks of ``block`` units, run every block through its expert, and sum the weighted outputs
    back per unit. Nothing is dropped; the work is that of the assignments plus at most E - 1 padding
    blocks, about k/E of the dense execution for large inputs.

    Args:
      params: stacked expert parameters (see ``nn.moe.experts_forward``), leading axis E.
      units: (U, R, d). expert_index, weights, active: (U, k) chosen experts, their gates, and which
        assignments are routed at all (inactive ones contribute nothing).
      by_expert: MLP experts' blocks run expert by expert (``mlp_expert_blocks_by_expert``) rather than
        block by block (``mlp_expert_blocks``), and the outputs combined by gathering each unit's
        assignments (``combine_assignments``); the same outputs up to float32 rounding. Not under
        ``sort_groups``, whose groups run vmapped, where every group's loops would run to the longest.
      sort_groups: sort and run the assignments within this many equal groups of consecutive units (when the
        units divide evenly; otherwise as one group). Results do not depend on it.
      blocks_as_one_product: trace the blocks as one batched product rather than a loop, so that XLA's cost
        analysis (which counts a loop body once) counts every block: for FLOP counting only, slower to run.
    Returns:
      (U, R, o), ``sum_j weights[u, j] * expert_{index[u, j]}(units[u])`` over active j.
    """
    groups = sort_groups
    if groups > 1 and units.shape[0] % groups == 0 and units.shape[0] > groups:
        def split(a):
            return a.reshape((groups, a.shape[0] // groups) + a.shape[1:])

        run = partial(_grouped_experts_forward, params, block=block, dtype=dtype, precision=precision,
                      blocks_as_one_product=blocks_as_one_product)
        out = jax.vmap(run)(split(units), split(expert_index), split(weights), split(active))
        return out.reshape((units.shape[0],) + out.shape[2:])
    return _grouped_experts_forward(params, units, expert_index, weights, active, block=block, dtype=dtype,
                                    precision=precision, by_expert=by_expert,
                                    blocks_as_one_product=blocks_as_one_product)


_RANK_TILE = 128


def ranks_within_groups(keys: Array, num_groups: int, by_sort: bool = False) -> tuple[Array, Array]:
    """Counting in place of a sort, for a few distinct keys.

    Args:
      keys: int (A,), values in [0, num_groups).
    Returns:
      rank: int32 (A,), how many earlier elements (lower index) hold the same key: the element's place
        within its key's group under a stable sort by key.
      counts: int32 (num_groups,), the elements holding each key.

    The counts come from one-hot tiles of 128 elements: within a tile, a product with a strictly lower
    triangular matrix (0/1 values and sums below 128, exact in float32); across tiles, an integer running
    sum of the tiles' totals. It replaces XLA:CPU's stable sort of a layer's expert assignments, which is
    slower; the grouped execution's slots computed this way are the same (see docs/performance.md, "Grouped
    MoE experts"). ``by_sort``: the same ranks by a stable sort (for FLOP counting, so that the count holds
    the model's products only, not these bookkeeping ones).
    """
    num = keys.shape[0]
    if by_sort:
        order = jnp.argsort(keys, stable=True)
        counts = jnp.bincount(keys, length=num_groups).astype(jnp.int32)
        start = jnp.cumsum(counts) - counts
        rank = jnp.zeros((num,), jnp.int32).at[order].set(jnp.arange(num, dtype=jnp.int32) - start[keys[order]])
        return rank, counts
    pad = (-num) % _RANK_TILE
    padded = jnp.pad(keys.astype(jnp.int32), (0, pad), constant_values=num_groups)   # padding: no group
    tiles = (padded[:, None] == jnp.arange(num_groups)).astype(jnp.float32)
    tiles = tiles.reshape(-1, _RANK_TILE, num_groups)                                 # (R, T, G)
    earlier = jnp.tril(jnp.ones((_RANK_TILE, _RANK_TILE), jnp.float32), -1)          # [i, j]: j before i
    within = jnp.einsum("ij,rjg->rig", earlier, tiles, precision=jax.lax.Precision.HIGHEST).astype(jnp.int32)
    totals = tiles.sum(1).astype(jnp.int32)                                          # (R, G)
    before = jnp.cumsum(totals, axis=0) - totals
    rank = jnp.sum((within + before[:, None, :]) * tiles.astype(jnp.int32), axis=-1).reshape(-1)[:num]
    return rank, totals.sum(0)


def _grouped_experts_forward(params: Mapping[str, Array], units: Array, expert_index: Array, weights: Array,
                             active: Array, *, block: int, dtype, precision: Any, by_expert: bool = False,
                             blocks_as_one_product: bool = False) -> Array:
    """``grouped_experts_forward`` on one group of units."""
    num_units, k = expert_index.shape
    num_experts = next(iter(params.values())).shape[0]
    num_assign = num_units * k
    expert = jnp.where(active, expert_index, num_experts).reshape(num_assign)   # inactive: sentinel group
    unit = jnp.repeat(jnp.arange(num_units, dtype=jnp.int32), k)
    # Each assignment's slot: its expert's first padded slot plus its rank among that expert's assignments
    # in unit order, the place a stable sort by expert would give it.
    rank, counts = ranks_within_groups(expert, num_experts + 1, by_sort=blocks_as_one_product)
    counts = counts[:num_experts]
    padded = -(-counts // block) * block
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    # Static size: every assignment plus, per expert, an unfilled block at most.
    length = -(-(num_assign + num_experts * (block - 1)) // block) * block
    num_blocks = length // block
    safe = jnp.minimum(expert, num_experts - 1)
    position = jnp.where(expert < num_experts, padded_start[safe] + rank, length)
    slot_unit = jnp.zeros((length,), jnp.int32).at[position].set(unit, mode="drop")
    # Expert of each block (blocks past the last group hold only zero-weight padding).
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_blocks) * block, side="right"),
                               num_experts - 1)
    x = units[slot_unit].astype(dtype)                                              # (L, R, d)
    x = x.reshape((num_blocks, block * x.shape[1], x.shape[2]))

    mlp = tuple(jnp.asarray(params[name]) for name in ("w1", "b1", "w2", "b2")) if "w1" in params else None

    def run_block(args):
        """One block through its expert; the expert's weights are read in place (a dynamic index), not
        gathered into a (blocks, d, h) copy, which at thousands of units cost more than the products."""
        h, e = args
        if mlp is not None:
            return _mlp_block(*(p[e] for p in mlp), h, dtype, precision)[0]
        w, b = jnp.asarray(params["w"])[e].astype(dtype), jnp.asarray(params["b"])[e].astype(dtype)
        return jnp.matmul(h, w, precision=precision) + b

    if mlp is not None and not blocks_as_one_product:
        if by_expert:        # each expert's blocks are consecutive and end at its padded end
            out = mlp_expert_blocks_by_expert(*mlp, x, block_expert, (padded_end // block).astype(jnp.int32),
                                              dtype, precision)
            out = out.reshape((length,) + units.shape[1:2] + out.shape[-1:])
            return combine_assignments(out, position.reshape(num_units, k), weights, active)
        out = mlp_expert_blocks(*mlp, x, block_expert, dtype, precision)
    else:
        out = jax.lax.map(run_block, (x, block_expert),
                          batch_size=num_blocks if blocks_as_one_product else None)
    out = out.reshape((length,) + units.shape[1:2] + out.shape[-1:])
    # Weighted as a product rather than a broadcast multiply: the gate's cotangent is then a (L, R x o)
    # contraction, where the multiply's was a multiply and a minor-axis sum that XLA:CPU runs slowly (see
    # docs/performance.md, "Grouped MoE experts").
    slot_weight = jnp.zeros((length,), jnp.float32).at[position].set(
        weights.reshape(num_assign).astype(jnp.float32), mode="drop")
    out = jnp.einsum("lro,l->lro", out, slot_weight.astype(out.dtype))
    return jax.ops.segment_sum(out, slot_unit, num_segments=num_units)


def combine_assignments(out: Array, position: Array, weights: Array, active: Array) -> Array:
    """Each unit's weighted sum of its assignments' expert outputs, gathered from their slots.

    Args: out (L, R, o) the slots' outputs; position int (U, k) each assignment's slot (any value where
    inactive); weights (U, k); active bool (U, k). Returns (U, R, o), ``sum_j weights[u, j] *
    out[position[u, j]]`` over active j, added in assignment order.

    The grouped execution's combination outside training: one loop fusion (the k gathers, the weighting, the
    sum and whatever elementwise consumer follows) where weighting every slot and scatter-adding the slots
    into zeroed units took three passes, and slots never gathered (padding, blocks past the last expert's)
    may hold anything (see docs/performance.md, "Grouped MoE experts"). Training keeps the weighting product
    and the scatter-add: there the gates' cotangent through this form is a reduction over the output's minor
    axis, which XLA:CPU runs slowly (see ``_grouped_experts_forward``). Not bitwise the scatter-add's sum:
    XLA may fuse a weighting and an addition into one multiply-add."""
    total = None
    for j in range(position.shape[1]):
        rows = out[jnp.clip(position[:, j], 0, out.shape[0] - 1)]
        term = jnp.where(active[:, j, None, None], rows * weights[:, j, None, None].astype(out.dtype), 0)
        total = term if total is None else total + term
    return total


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def mlp_expert_blocks(w1: Array, b1: Array, w2: Array, b2: Array, x: Array, block_expert: Array, dtype=jnp.float32,
                      precision: Any = None) -> Array:
    """Blocks of units, each through its expert's MLP: ``relu(x[i] @ w1[e] + b1[e]) @ w2[e] + b2[e]`` with
    ``e = block_expert[i]``, one block after another, the weights read in place.

    Args: w1 (E, d, h), b1 (E, h), w2 (E, h, o), b2 (E, o); x (blocks, rows, d); block_expert int (blocks,).
    Returns (blocks, rows, o) in ``dtype``.

    The backward pass is written out (``_mlp_expert_blocks_bwd``). Left to autodiff, the loop's cotangent
    of the weights is a full (E, d, h) array per block (the transpose of the dynamic index), added up
    block after block, which made the grouped execution slower than the dense one in training (see
    docs/performance.md, "Grouped MoE experts").
    """
    return _mlp_expert_blocks_fwd(w1, b1, w2, b2, x, block_expert, dtype, precision)[0]


def _mlp_block(w1, b1, w2, b2, xb, dtype, precision):
    """One block (rows, d) through one expert's MLP (w1 (d, h), b1 (h,), w2 (h, o), b2 (o,)): (output
    (rows, o), hidden layer (rows, h))."""
    hidden = jax.nn.relu(jnp.matmul(xb.astype(dtype), w1.astype(dtype), precision=precision) + b1.astype(dtype))
    return jnp.matmul(hidden, w2.astype(dtype), precision=precision) + b2.astype(dtype), hidden


def _mlp_expert_blocks_fwd(w1, b1, w2, b2, x, block_expert, dtype, precision):
    def run_block(args):
        xb, e = args
        return _mlp_block(w1[e], b1[e], w2[e], b2[e], xb, dtype, precision)

    out, hidden = jax.lax.map(run_block, (x, block_expert))
    return out, (w1, w2, x, hidden, block_expert)


def _mlp_expert_blocks_bwd(dtype, precision, residuals, g):
    """One pass over the blocks: each block's input and hidden cotangents against its expert, and its weight
    gradients added into its expert's (a scan carrying per-expert sums).

    Every product is a plain (untransposed-operand) one, which XLA:CPU runs in its fast matmul library: the
    experts' weights are transposed once, the block's small (rows x d) input and (rows x o) cotangent are
    transposed explicitly, and the second layer's weight gradient is summed transposed, (o, h), then turned
    once at the end. As ``x_b^T @ dh`` and ``h_b^T @ g_b`` those two ran as slower transposed-operand
    dots."""
    w1, w2, x, hidden, block_expert = residuals
    num_experts = w1.shape[0]
    w1_t, w2_t = (jnp.swapaxes(w, 1, 2).astype(dtype) for w in (w1, w2))
    f32 = jnp.float32
    sums = (jnp.zeros(w1.shape, f32), jnp.zeros((num_experts, w1.shape[2]), f32),
            jnp.zeros((num_experts, w2.shape[2], w2.shape[1]), f32), jnp.zeros((num_experts, w2.shape[2]), f32))

    def block(carry, args):
        dw1, db1, dw2_t, db2 = carry
        xb, hb, gb, e = args
        gb = gb.astype(dtype)
        # optimization_barrier keeps XLA from folding the transposes back into the products.
        xb_t, gb_t = jax.lax.optimization_barrier((xb.astype(dtype).T, gb.T))
        dh = jnp.matmul(gb, w2_t[e], precision=precision) * (hb > 0).astype(dtype)
        dx = jnp.matmul(dh, w1_t[e], precision=precision)
        carry = (dw1.at[e].add(jnp.matmul(xb_t, dh, precision=precision, preferred_element_type=f32)),
                 db1.at[e].add(dh.sum(0).astype(f32)),
                 dw2_t.at[e].add(jnp.matmul(gb_t, hb, precision=precision, preferred_element_type=f32)),
                 db2.at[e].add(gb.sum(0).astype(f32)))
        return carry, dx

    (dw1, db1, dw2_t, db2), dx = jax.lax.scan(block, sums, (x, hidden, g, block_expert))
    return (dw1.astype(w1.dtype), db1.astype(w1.dtype), jnp.swapaxes(dw2_t, 1, 2).astype(w2.dtype),
            db2.astype(w2.dtype), dx.astype(x.dtype), None)


mlp_expert_blocks.defvjp(_mlp_expert_blocks_fwd, _mlp_expert_blocks_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def mlp_expert_blocks_by_expert(w1: Array, b1: Array, w2: Array, b2: Array, x: Array, block_expert: Array,
                                block_end: Array, dtype=jnp.float32, precision: Any = None) -> Array:
    """``mlp_expert_blocks`` run expert by expert: a scan over the E experts hands each expert's weights to a
    loop over its own blocks, ``block_end[e - 1]`` (0 for the first) up to ``block_end[e]``.

    Args: as ``mlp_expert_blocks``, and block_end int (E,), non-decreasing: the end (exclusive) of each
    expert's blocks, which must be consecutive and agree with ``block_expert``. Returns (blocks, rows, o)
    in ``dtype``: the blocks up to ``block_end[-1]`` as ``mlp_expert_blocks`` computes them (the same
    products), the blocks past it (only padding) zero, or their inputs unchanged where the call computes in
    place: undifferentiated, with o = d and ``x`` in ``dtype``.

    Why: the block-by-block loop reads its expert's weights by a dynamic index, which XLA:CPU copies out for
    every block (a d x h and an h x o matrix); here the scan slices them once per expert and the blocks past
    the last expert's padding are not run. Writing out the hidden layer as well (the residual the backward
    pass needs) made the call slower, so it is written only by the forward rule, under differentiation. In
    place, each block's output goes over its input: no zeroed output buffer (see docs/performance.md,
    "Grouped MoE experts"). The result keeps its batch axis where the primal puts it, since both carry the
    output through the same loops (see ``engines.attention.attention_normalised_after_product`` for why that matters).
    """
    return _expert_by_expert(w1, b1, w2, b2, x, block_end, dtype, precision, keep_hidden=False)[0]


def _expert_by_expert(w1, b1, w2, b2, x, block_end, dtype, precision, keep_hidden):
    """(output (blocks, rows, o), hidden layer (blocks, rows, h) or None) of ``mlp_expert_blocks_by_expert``."""
    num_blocks, rows = x.shape[:2]
    # In place where the shapes allow it (outside differentiation, o = d): each block's output overwrites its
    # own input, which nothing reads afterwards, so the loops carry the gathered units themselves rather than
    # a zeroed (blocks, rows, o) buffer that XLA writes afresh for every layer.
    in_place = not keep_hidden and x.shape[-1] == w2.shape[2] and x.dtype == dtype
    # Made like x, so that under shard_map they vary over the mesh as the loops' outputs do.
    buffers = [x if in_place else jnp.zeros_like(x, dtype, shape=(num_blocks, rows, w2.shape[2]))]
    if keep_hidden:
        buffers.append(jnp.zeros_like(x, dtype, shape=(num_blocks, rows, w1.shape[2])))

    def expert(carry, args):
        buffers, start = carry
        *weights, end = args

        def run_block(i, buffers):
            results = _mlp_block(*weights, (buffers[0] if in_place else x)[i], dtype, precision)
            return [buf.at[i].set(r) for buf, r in zip(buffers, results)]

        return (jax.lax.fori_loop(start, end, run_block, buffers), end), None

    (buffers, _), _ = jax.lax.scan(expert, (buffers, jnp.zeros_like(block_end[0])), (w1, b1, w2, b2, block_end))
    return buffers[0], (buffers[1] if keep_hidden else None)


def _mlp_expert_blocks_by_expert_fwd(w1, b1, w2, b2, x, block_expert, block_end, dtype, precision):
    out, hidden = _expert_by_expert(w1, b1, w2, b2, x, block_end, dtype, precision, keep_hidden=True)
    return out, (w1, w2, x, hidden, block_expert)


def _mlp_expert_blocks_by_expert_bwd(dtype, precision, residuals, g):
    """``mlp_expert_blocks``'s backward pass; the blocks past the last expert's, zero in the forward pass and
    in the hidden layer kept, add nothing (their output cotangents are zero: padding carries zero weight)."""
    return _mlp_expert_blocks_bwd(dtype, precision, residuals, g) + (None,)


mlp_expert_blocks_by_expert.defvjp(_mlp_expert_blocks_by_expert_fwd, _mlp_expert_blocks_by_expert_bwd)
