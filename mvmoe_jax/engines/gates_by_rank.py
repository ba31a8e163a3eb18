"""Top-1 / top-2 dense gates computed elementwise (plan field ``gates_by_rank``; reference:
``nn.moe.top_k_gates``'s top-k, softmax over the chosen and one-hot sum).

Only callers that read the dense (U, E) gates pay for either form (MVMoE's decoder, whose readout mixes its
maps by them). Used outside training mode for k <= 2: training keeps the one-hot product, whose backward pass
was measured with it (docs/performance.md, "Gates by rank").
"""

from __future__ import annotations

from functools import reduce

import jax
import jax.numpy as jnp

Array = jax.Array


def gates_by_rank(logits: Array, k: int, temperature: float = 1.0) -> Array:
    """``top_k_gates``'s dense gates (U, E) for k <= 2, elementwise over the E logit columns: expert e is chosen
    when fewer than k others rank above it (a larger logit, or an equal one at a lower index: ``small_top_k``'s
    order), and its gate is ``exp(x_e - max x) / sum over the chosen``, x = logits / temperature, as the softmax
    over the top k computes it (its division too, as a product with the reciprocal of the sum).

    Why: the top-k passes, their gathers, the softmax and the one-hot product are ~10 small operations per
    decoding step; these are elementwise, and XLA:CPU runs them as 5 small loops a step in MVMoE/4E's decoder.
    The gates agree with ``top_k_gates``'s to the last bit of the exponential (XLA's and YNNPACK's differ by an
    ulp, and which one runs depends on the fusion). With k > 2 the sum's order would depend on the ranks: not
    offered."""
    if k > 2:
        raise ValueError(f"gates_by_rank handles top-1 and top-2 gating, got k = {k}")
    cols = [logits[:, j] for j in range(logits.shape[-1])]
    chosen = [sum(((other >= col) if j < i else (other > col)).astype(jnp.int32)
                  for j, other in enumerate(cols) if j != i) < k for i, col in enumerate(cols)]
    scaled = [col / temperature for col in cols]
    top = reduce(jnp.maximum, scaled)
    unnormalised = [jnp.where(c, jnp.exp(x - top), 0.0) for c, x in zip(chosen, scaled)]
    inverse = 1.0 / reduce(jnp.add, unnormalised)
    return jnp.stack([u * inverse for u in unnormalised], axis=-1)
