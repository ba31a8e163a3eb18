"""Mixture-of-experts layers of MVMoE (ICML 2024) in Flax linen.

Behavioural reference: ``models/MOELayer.py`` of RoyalSkye/Routing-MVMoE (itself derived from
davidmrau/mixture-of-experts), as used by ``models/MOEModel.py`` (MVMoE) and ``models/MOEModel_Light.py``
(MVMoE-L). The released checkpoints use node-level noisy top-k ("input choice") routing with 4 experts and
k = 2: that path reproduces the reference numerics, quirks included. The other routing methods follow the
reference where it is well defined; where this module deliberately differs it is said below.

Public API
----------
``MoE(output_dim, num_experts=4, k=2, hidden_dim=None, expert_type='mlp', routing='input_choice',
level='node', noisy_gating=True, capacity_factor=None, dispatch='dense', temperature=1.0, loss_coef=1e-3,
slots_per_expert=1, expert_choice_softmax='experts', zero_output_eps=True, dtype=float32,
param_dtype=float32, precision=None)``

    ``y, aux_loss = moe(x, train)`` with ``x`` of shape ``(batch, tokens, d_in)`` or ``(tokens, d_in)``
    (node level accepts any number of leading axes) and ``y`` of shape ``x.shape[:-1] + (output_dim,)``.
    ``aux_loss`` is a float32 scalar (zero for every routing except input choice at node/instance level).
    Randomness (gating noise in training, random routing) comes from the flax rng stream ``'gating'``.

``HierarchicalGate(temperature=1.0)``: the dense-or-MoE gate of MVMoE-L; ``probs = gate(x)`` (or
``gate(pooled=mean)`` for a batch pooled in chunks), shape (2,).
``sample_branch(key, probs) -> (choice, scale)``: one draw of the branch, as the reference does every step.
``DenseOrMoE(output_dim, ...)``: the MVMoE-L decoder's ``multi_head_combine``: gate, MoE branch, dense
branch, run through ``nn.cond`` so that only the sampled branch is computed.
``torch_to_flax_moe(state, prefix, num_experts, expert_type)`` and ``torch_to_flax_dense_or_moe(state,
prefix, num_experts)``: build the Flax parameter subtrees from a flat torch ``state_dict`` (numpy arrays).

Parameter tree of ``MoE`` (E = num_experts, d = d_in, h = hidden_dim, o = output_dim)
------------------------------------------------------------------------------------
=================  ================  ===============================================
name               shape             torch source (``<prefix>`` + ...)
=================  ================  ===============================================
``w_gate``         (d, E)            ``w_gate``  (used as ``x @ w_gate``, no transpose)
                   (d, E*slots)      ... for ``routing='soft'``
``w_noise``        (d, E)            ``w_noise`` (always present, as in the reference)
``experts_w1``     (E, d, h)         ``experts.{j}.fc1.weight`` (h, d), transposed    [mlp]
``experts_b1``     (E, h)            ``experts.{j}.fc1.bias``                          [mlp]
``experts_w2``     (E, h, o)         ``experts.{j}.fc2.weight`` (o, h), transposed    [mlp]
``experts_b2``     (E, o)            ``experts.{j}.fc2.bias``                          [mlp]
``experts_w``      (E, d, o)         ``experts.{j}.weight`` (o, d), transposed        [linear]
``experts_b``      (E, o)            ``experts.{j}.bias``                              [linear]
=================  ================  ===============================================

The torch buffers ``mean`` / ``std`` (the standard normal used by the load estimate) carry no information
and are not imported. Parameters are created in ``param_dtype`` (float32); expert matmuls run in ``dtype``;
gate logits, softmaxes and the auxiliary loss are always computed in float32 because top-k selection is
sensitive to rounding.

Initialisation follows torch: experts like ``nn.Linear`` (weight and bias ~ U(+-1/sqrt(fan_in))); ``w_gate``
and ``w_noise`` zeros for node/instance input choice; otherwise ``w_gate`` gets torch's
``kaiming_uniform_(a=sqrt(5))`` which, torch taking ``size(1)`` of the (d, E) matrix as fan-in, is
U(+-1/sqrt(E)) (U(+-1/sqrt(E*slots)) for soft MoE).

Reference behaviours reproduced
-------------------------------
* Noisy top-k (``routing='input_choice'``): ``clean = g @ w_gate``; in training (and only then, and only if
  ``noisy_gating``) ``logits = clean + N(0,1) * (softplus(g @ w_noise) + 1e-2)``. The top ``min(k+1, E)``
  logits are taken, the first k are softmaxed with temperature ``T`` (``softmax(top_k / T)``, T = 1.0 in
  every reference model) and scattered into a dense (units, E) gate matrix.
  ``importance = gates.sum(0)``; ``load`` = sum over units of P(expert in top-k under re-sampled noise)
  (threshold = the (k+1)-th noisy logit if the expert is in, the k-th if it is out; standard normal CDF of
  ``(clean - threshold) / noise_std``) when training with noise and ``k < E``, else the count of units with
  a positive gate. ``aux_loss = loss_coef * (cv2(importance) + cv2(load))`` with ``loss_coef = 1e-3`` (the
  default of the reference ``forward``; nobody overrides it) and ``cv2(v) = var(v, ddof=1) / (mean(v)**2 +
  1e-10)``, 0 when E == 1. Top-k ties break towards the lower expert index (``jax.lax.top_k``); torch leaves
  that unspecified, so exact ties (e.g. the zero-initialised gate in evaluation) may route differently.
* The reference's sparse combine overwrites every exactly-zero output element with float64 eps
  (2.22e-16) (``combined[combined == 0] = eps``). This applies to node/instance input-choice and random
  routing only; ``zero_output_eps=True`` (default) reproduces it (including the zero gradient there).
* Levels. ``node``: all leading axes are flattened and every token is routed on its own (loss statistics
  over all batch*tokens). ``instance``: the gate input is ``x.mean(1)`` (mean over an instance's tokens),
  one routing decision per instance, the chosen experts are applied to all of its tokens and their outputs
  weighted by the instance's gates; loss statistics over instances. ``problem``: gate input
  ``x.mean(0).mean(0)`` (batch mean, then token mean), one deterministic top-k for the whole batch (no
  noise, aux loss 0); ``output = sum_j gate_j * expert_{i_j}(x)``. At problem level the reference ignores
  the routing method except ``random`` (so ``expert_choice`` also uses top-k there); soft MoE is broken
  there in the reference and raises here.
* Random routing: per unit, k distinct experts from ``argsort(uniform(E))[:k]``, gates 1/k; at problem
  level ``permutation(E)[:k]``. The reference samples in training and evaluation alike; here the
  ``'gating'`` stream is used whenever it is provided. Deterministic fallback (documented choice): in
  evaluation without a ``'gating'`` rng the fixed key ``PRNGKey(0)`` is used, so evaluation stays
  reproducible and still spreads units over experts; training without the stream raises.
* Expert choice: scores ``softmax(g @ w_gate)``; each expert takes its top-c units by score,
  ``c = int(units * cf / E)`` with ``cf = capacity_factor`` or, if None, ``k`` (the reference reads ``k`` as
  the capacity factor), clamped to [1, units]; ``output[u] = sum over (expert, slot) choosing u of
  score * expert(x_u)``; units chosen by no expert get 0; aux loss 0. DIFFERENCE: the reference softmaxes
  over *tokens* (``dim=0``); the paper (Zhou et al. 2022) and this module's default softmax over
  *experts*. ``expert_choice_softmax='tokens'`` reproduces the reference.
* Soft MoE (Puigcerver et al. 2023): ``logits = g @ w_gate`` (units, E*slots); slot inputs are
  ``softmax(logits, over units).T @ x``; expert ``i`` processes slots ``[i*slots, (i+1)*slots)``; outputs
  are combined with ``softmax(logits, over slots)``; aux loss 0. At instance level the units are whole
  instances. DIFFERENCE: the reference uses ``k`` slots per expert; here ``slots_per_expert`` (default 1)
  - set it to ``k`` to match the reference (and its ``w_gate`` shape).

Execution strategies (``dispatch``; input choice, random and expert choice)
---------------------------------------------------------------------------
The policy sets the strategy from its execution plan (``mvmoe_jax.execution``): ``dense`` in the reference
and GPU plans, ``grouped_mlp`` in the CPU plan.

* ``'grouped_mlp'``: ``'grouped'`` for token choice's MLP experts from ``grouped_min_assignments`` (unit,
  expert) assignments per sort group on, ``'dense'`` otherwise (``resolve_dispatch``).
* ``'dense'`` (the layer's default): every expert runs on every unit and the outputs are mixed with the
  dense gate matrix. No token is ever dropped. As cheap as a no-drop sparse dispatch (capacity = units
  means E*units expert evaluations either way). For token choice the experts run side by side, weighted
  inside the second matmul (``gated_experts_forward``): two large matmuls, the accelerators' choice.
* ``'sparse'``: GShard-style fixed-capacity expert buffers (E, C, ...), filled by scatter and read back
  by gather (memory O(E*C*d + units*k)). Assignments beyond an expert's capacity are dropped (zero
  output from that expert). Priority: all first choices (in unit order) before all second choices, etc.
* ``'grouped'``: only the chosen experts run, and nothing is dropped: the (unit, expert) assignments are
  sorted by expert into blocks of ``group_block`` units, each block runs through its expert's weights
  (one block after another, the weights read in place; outside training mode expert by expert, each
  expert's weights handed to a loop over its blocks), and the weighted outputs are summed back per unit
  (``engines.grouped_experts``). About k/E of the dense FLOPs plus under one block of padding per expert.
  MLP experts have a written-out backward pass; with ``sort_groups=G`` (training on G devices) the sort runs
  within G groups of consecutive units. Token choice only; elsewhere it behaves as ``'sparse'``, and it
  ignores ``capacity_factor``.
* ``'einsum'``: the same routing expressed with Mesh-TensorFlow/GShard one-hot ``dispatch`` (units, E, C)
  and weighted ``combine`` (units, E, C) tensors (see ``dispatch_combine_tensors``). O(units*E*C) memory:
  for small inputs and for checking ``'sparse'``.
Capacity for token choice: ``C = units`` if ``capacity_factor`` is None (nothing is ever dropped), else
``clamp(ceil(capacity_factor * units * k / E), 1, units)``. With expert choice, ``'sparse'`` gathers each
expert's c units and ``'einsum'`` is the same as ``'sparse'``. Soft MoE has a single strategy. At problem
level ``'sparse'``/``'einsum'`` gather the k chosen experts' parameters and run only those.

Diagnostics are sowed into the ``'intermediates'`` collection (pass ``mutable=['intermediates']``):
``dropped_assignments`` (int32: (unit, expert) assignments that exceeded capacity) and ``dropped_tokens``
(int32: routed units that got no expert at all, i.e. zero output; for expert choice: units chosen by no
expert). Both are always sowed (zeros when nothing can be dropped) so the tree structure is static.

MVMoE-L hierarchical gate (``models/MOEModel_Light.py``, decoder)
----------------------------------------------------------------
The decoder owns ``dense_or_moe = nn.Linear(head_num*qkv_dim, 2, bias=False)``, a linear-expert MoE
``multi_head_combine_moe`` and a dense ``multi_head_combine_dense`` (both d -> embedding_dim, with bias).
The probabilities ``softmax(dense_or_moe(out_concat.mean(0).mean(0)) / T)`` (``out_concat``: the
multi-head attention output (batch, pomo, d); T = 1.0) are computed ONCE, at the first decoding step that
runs the decoder (``selected_count == 2``; steps 0 and 1 pick the depot and the POMO start node without
the decoder), and reused at every later step of that rollout. At EVERY decoding step, in training and in
evaluation alike, one branch is sampled from those probabilities (``multinomial``): 1 -> MoE branch (its
aux loss is added), 0 -> dense branch (aux 0); the chosen branch's output is multiplied by the chosen
probability, which is how the gate receives gradient (through the step-2 probabilities, at every step).
``DenseOrMoE.__call__(x, train, probs=None, key=None)`` returns ``(y, aux_loss, probs)``: pass
``probs=None`` at the first decoder step and the returned ``probs`` at every later one; ``key`` defaults
to the ``'gating'`` stream (needed in evaluation too).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mvmoe_jax.engines import gates_by_rank as rank_gates
from mvmoe_jax.engines import grouped_experts
from mvmoe_jax.nn.layers import Dense, torch_uniform_init

__all__ = [
    "NOISE_EPSILON",
    "DEFAULT_LOSS_COEF",
    "CV_SQUARED_EPS",
    "MoE",
    "HierarchicalGate",
    "DenseOrMoE",
    "sample_branch",
    "cv_squared",
    "normal_cdf",
    "prob_in_top_k",
    "top_k_gates",
    "noisy_top_k_gating",
    "expert_capacity",
    "expert_choice_capacity",
    "assign_slots",
    "dispatch_combine_tensors",
    "experts_forward",
    "gated_experts_forward",
    "torch_to_flax_moe",
    "torch_to_flax_dense_or_moe",
]

Array = jax.Array

# Constants of the reference implementation.
NOISE_EPSILON = 1e-2  # added to softplus(x @ w_noise): keeps the noise std strictly positive
DEFAULT_LOSS_COEF = 1e-3  # default ``loss_coef`` of the reference MoE.forward (never overridden)
CV_SQUARED_EPS = 1e-10
# The reference writes numpy float64 eps into exactly-zero combined outputs (stored as float32).
ZERO_OUTPUT_EPS = float(np.finfo(np.float64).eps)
# Key used by random routing in evaluation when no 'gating' rng is supplied.
FALLBACK_SEED = 0

_EXPERT_TYPES = ("mlp", "linear")
_ROUTINGS = ("input_choice", "expert_choice", "soft", "random")
_LEVELS = ("node", "instance", "problem")
DISPATCHES = ("dense", "grouped_mlp", "grouped", "sparse", "einsum")
def resolve_dispatch(dispatch: str, *, expert_type: str, num_assignments: int, min_assignments: int = 0,
                     sort_groups: int = 1) -> str:
    """The execution strategy of one token-choice call: ``dispatch``, except that ``grouped_mlp`` means
    ``grouped`` for MLP experts and ``dense`` for linear ones, and that a grouped call with fewer than
    ``min_assignments`` (unit, expert) assignments per sort group runs ``dense`` (there the padding blocks
    outweigh the saved work). Resolved at trace time: shapes are static."""
    if dispatch == "grouped_mlp":
        dispatch = "grouped" if expert_type == "mlp" else "dense"
    if dispatch == "grouped" and num_assignments // sort_groups < min_assignments:
        return "dense"
    return dispatch

# --------------------------------------------------------------------------------------------------
# Initialisers (torch defaults, so that freshly initialised models behave like the reference's)
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# Gating math (pure functions; shapes: U = routing units, E = experts)
# --------------------------------------------------------------------------------------------------


def cv_squared(v: Array) -> Array:
    """Squared coefficient of variation ``var(v, ddof=1) / (mean(v)**2 + 1e-10)`` of a 1-D vector; 0 for a
    single element (one expert), as in the reference."""
    v = jnp.asarray(v, jnp.float32)
    if v.shape[0] == 1:
        return jnp.zeros((), jnp.float32)
    return jnp.var(v, ddof=1) / (jnp.mean(v) ** 2 + CV_SQUARED_EPS)


def normal_cdf(z: Array) -> Array:
    """Standard normal CDF written as torch's ``Normal(0, 1).cdf`` (erf form)."""
    return 0.5 * (1.0 + jax.scipy.special.erf(z / math.sqrt(2.0)))


def prob_in_top_k(clean: Array, noisy: Array, noise_std: Array, top_values: Array, k: int) -> Array:
    """Smooth estimate of P(expert e is in unit u's top-k) under re-sampled noise.

    Args:
      clean, noisy, noise_std: (U, E) clean logits, noisy logits, noise standard deviation.
      top_values: (U, m) the m >= k+1 largest noisy logits, descending.
    Returns:
      (U, E) probabilities. An expert currently in the top-k stays there if its noisy logit beats the
      (k+1)-th value; one that is out needs to beat the k-th value.
    """
    threshold_if_in = top_values[:, k : k + 1]
    threshold_if_out = top_values[:, k - 1 : k]
    is_in = noisy > threshold_if_in
    prob_if_in = normal_cdf((clean - threshold_if_in) / noise_std)
    prob_if_out = normal_cdf((clean - threshold_if_out) / noise_std)
    return jnp.where(is_in, prob_if_in, prob_if_out)


def small_top_k(x: Array, m: int) -> tuple[Array, Array]:
    """``jax.lax.top_k(x, m)`` over the last axis (same values, indices and tie order: lower index first;
    only -0.0 and 0.0, which lax.top_k orders, count as a tie here), as m argmax passes when the axis is short
    (a few experts). On a CPU ``lax.top_k`` lowers to a sort per row, several times the cost of these passes
    (see docs/performance.md, "Gates by rank")."""
    num = x.shape[-1]
    if num > 16:
        return jax.lax.top_k(x, m)
    values, indices = [], []
    for _ in range(m):
        i = jnp.argmax(x, axis=-1)
        values.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
        indices.append(i.astype(jnp.int32))
        x = jnp.where(jax.nn.one_hot(i, num, dtype=bool), -jnp.inf, x)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def top_k_gates(logits: Array, k: int, temperature: float = 1.0, by_rank: bool = False):
    """Top-k softmax gating.

    Args:
      logits: (U, E) float32.
      by_rank: the dense gates by ``gates_by_rank`` (k <= 2 only) instead of a one-hot sum over ``top_idx``.
    Returns:
      gates: (U, E) dense gate matrix, zero outside each unit's top-k.
      top_idx: (U, k) int32 chosen experts, best first (ties: lower index first).
      top_gate: (U, k) their gates, ``softmax(top_k_logits / temperature)``.
      top_values: (U, min(k+1, E)) largest logits, descending (the load estimate needs the (k+1)-th).
    """
    num_experts = logits.shape[-1]
    top_values, top_all = small_top_k(logits, min(k + 1, num_experts))
    top_idx = top_all[:, :k]
    top_gate = jax.nn.softmax(top_values[:, :k] / temperature, axis=-1)
    if by_rank:
        return rank_gates.gates_by_rank(logits, k, temperature), top_idx, top_gate, top_values
    # One-hot sum instead of a scatter: the k indices of a unit are distinct, and this stays a plain
    # differentiable contraction.
    gates = jnp.einsum("uk,uke->ue", top_gate, jax.nn.one_hot(top_idx, num_experts, dtype=top_gate.dtype))
    return gates, top_idx, top_gate, top_values


def noisy_top_k_gating(
    gate_in: Array,
    w_gate: Array,
    w_noise: Array,
    noise: Optional[Array],
    k: int,
    temperature: float = 1.0,
    loss_coef: float = DEFAULT_LOSS_COEF,
    precision: Any = None,
    by_rank: bool = False,
):
    """The reference's noisy top-k gating and its load-balancing loss (``by_rank``: see ``top_k_gates``).

    Args:
      gate_in: (U, d) gate inputs (tokens, or per-instance means).
      w_gate, w_noise: (d, E).
      noise: (U, E) standard normal draws, or None for no noise (evaluation, or ``noisy_gating=False``).
    Returns:
      gates (U, E), top_idx (U, k), top_gate (U, k), aux_loss (), load (E,).
    """
    gate_in = gate_in.astype(jnp.float32)
    clean = jnp.dot(gate_in, w_gate.astype(jnp.float32), precision=precision)
    num_experts = clean.shape[-1]
    if noise is not None:
        noise_std = jax.nn.softplus(jnp.dot(gate_in, w_noise.astype(jnp.float32), precision=precision))
        noise_std = noise_std + NOISE_EPSILON
        logits = clean + noise * noise_std
    else:
        logits = clean
    gates, top_idx, top_gate, top_values = top_k_gates(logits, k, temperature, by_rank)
    if noise is not None and k < num_experts:
        load = prob_in_top_k(clean, logits, noise_std, top_values, k).sum(0)
    else:
        load = (gates > 0).sum(0).astype(jnp.float32)
    importance = gates.sum(0)
    aux_loss = (cv_squared(importance) + cv_squared(load)) * loss_coef
    return gates, top_idx, top_gate, aux_loss, load


# --------------------------------------------------------------------------------------------------
# Capacity and dispatch (GShard style)
# --------------------------------------------------------------------------------------------------


def expert_capacity(num_units: int, k: int, num_experts: int, capacity_factor: Optional[float]) -> int:
    """Per-expert buffer size for token choice: all units if ``capacity_factor`` is None (nothing can be
    dropped), else ``ceil(capacity_factor * units * k / E)`` clamped to [1, units]."""
    if capacity_factor is None:
        return num_units
    cap = math.ceil(capacity_factor * num_units * k / num_experts)
    return int(min(max(cap, 1), num_units))


def expert_choice_capacity(num_units: int, num_experts: int, capacity_factor: Optional[float], k: int) -> int:
    """Units per expert for expert choice: ``int(units * cf / E)`` with cf defaulting to k, as the
    reference (which reads k as the capacity factor); clamped to [1, units]."""
    cf = k if capacity_factor is None else capacity_factor
    return int(min(max(int(num_units * cf / num_experts), 1), num_units))


def assign_slots(expert_index: Array, active: Array, num_experts: int, capacity: int):
    """Buffer slot of every (unit, choice) assignment.

    Args:
      expert_index: (U, k) int, the experts chosen by each unit (choice 0 = best).
      active: (U, k) bool, assignments that are routed at all (the reference only dispatches
        positive gates).
    Returns:
      slot: (U, k) int32 position in the expert's buffer (meaningful where active).
      keep: (U, k) bool, active and within capacity.
    Priority: every unit's first choice (in unit order) before any second choice, and so on, so a
    congested expert keeps first choices over second choices.
    """
    num_units, k = expert_index.shape
    onehot = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.int32) * active[..., None]  # (U, k, E)
    choice_major = jnp.swapaxes(onehot, 0, 1).reshape(k * num_units, num_experts)
    position = jnp.cumsum(choice_major, axis=0) - 1  # running count per expert, in priority order
    position = jnp.swapaxes(position.reshape(k, num_units, num_experts), 0, 1)
    slot = jnp.sum(position * onehot, axis=-1).astype(jnp.int32)
    keep = active & (slot < capacity)
    return slot, keep


def dispatch_combine_tensors(
    expert_index: Array, slot: Array, keep: Array, weights: Array, num_experts: int, capacity: int
):
    """Mesh-TensorFlow/GShard routing tensors.

    Args:
      expert_index, slot, keep: (U, k) from the gate and ``assign_slots``.
      weights: (U, k) gate value of each assignment.
    Returns:
      dispatch: (U, E, C) one-hot float32, 1 where unit u sits in slot c of expert e.
      combine: (U, E, C) float32, ``dispatch`` times the unit's gate for that expert.
    """
    keep_f = keep.astype(jnp.float32)
    expert_oh = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32)  # (U, k, E)
    slot_oh = jax.nn.one_hot(jnp.where(keep, slot, capacity), capacity, dtype=jnp.float32)  # (U, k, C)
    dispatch = jnp.einsum("uk,uke,ukc->uec", keep_f, expert_oh, slot_oh)
    combine = jnp.einsum("uk,uke,ukc->uec", keep_f * weights.astype(jnp.float32), expert_oh, slot_oh)
    return dispatch, combine


# --------------------------------------------------------------------------------------------------
# Experts
# --------------------------------------------------------------------------------------------------


def experts_forward(params: Mapping[str, Array], x: Array, *, per_expert: bool, dtype=jnp.float32,
                    precision: Any = None) -> Array:
    """Run stacked experts.

    Args:
      params: ``{'w1','b1','w2','b2'}`` (mlp: Linear -> ReLU -> Linear) or ``{'w','b'}`` (linear), each
        with a leading expert axis of size E'.
      x: (E', N, d) with ``per_expert=True`` (each expert its own inputs) or (N, d) shared by all experts.
    Returns:
      (E', N, o).
    """
    first = "end,edh->enh" if per_expert else "nd,edh->enh"

    def affine(spec, h, w, b):
        out = jnp.einsum(spec, h, w.astype(dtype), precision=precision)
        return out + b.astype(dtype)[:, None, :]

    x = x.astype(dtype)
    if "w1" in params:
        hidden = jax.nn.relu(affine(first, x, params["w1"], params["b1"]))
        return affine("enh,eho->eno", hidden, params["w2"], params["b2"])
    return affine(first, x, params["w"], params["b"])


def gated_experts_forward(params: Mapping[str, Array], x: Array, gates: Array, *, dtype=jnp.float32,
                          precision: Any = None) -> Array:
    """Every expert on every token, mixed by the gates, with the experts side by side in two matmuls.

    ``sum_e gates[:, e] * expert_e(x)`` equals, for MLP experts, ``[gates_e * relu(x @ W1_e + b1_e)]_e @
    [W2_e]_e + gates @ b2`` (hidden layers concatenated along features, (d, E*h) and (E*h, o)), and for
    linear experts ``sum_e gates_e (x @ [W_e]_e)`` + ``gates @ b``. The dense execution's FLOPs, but as two
    large plain matmuls instead of E small ones and an E-way mix. Its (T, E*h) activations grow with T out
    of a CPU's cache, where ``grouped_experts_forward`` keeps to blocks (see docs/performance.md, "Dense
    experts side by side" and "Grouped MoE experts").

    Args:
      params: stacked expert parameters (see ``experts_forward``), leading axis E.
      x: (T, d) tokens. gates: (T, E) mixing weights (zero for experts a token did not choose).
    Returns:
      (T, o).
    """
    num_tokens = x.shape[0]
    num_experts = gates.shape[-1]
    x = x.astype(dtype)
    g = gates.astype(jnp.float32)

    def side_by_side(w):                                        # (E, d, h) -> (d, E*h)
        return jnp.moveaxis(w, 0, 1).reshape(w.shape[1], -1).astype(dtype)

    if "w1" in params:
        hidden_dim = params["w1"].shape[-1]
        hidden = jnp.matmul(x, side_by_side(params["w1"]), precision=precision,
                            preferred_element_type=jnp.float32) + params["b1"].reshape(-1)
        hidden = jax.nn.relu(hidden).reshape(num_tokens, num_experts, hidden_dim) * g[:, :, None]
        out = jnp.matmul(hidden.reshape(num_tokens, -1).astype(dtype),
                         params["w2"].reshape(-1, params["w2"].shape[-1]).astype(dtype), precision=precision,
                         preferred_element_type=jnp.float32)
        return out + jnp.matmul(g, params["b2"].astype(jnp.float32), precision=precision)
    per_expert = jnp.matmul(x, side_by_side(params["w"]), precision=precision,
                            preferred_element_type=jnp.float32).reshape(num_tokens, num_experts, -1)
    return (jnp.einsum("te,teo->to", g, per_expert, precision=precision)
            + jnp.matmul(g, params["b"].astype(jnp.float32), precision=precision))


# --------------------------------------------------------------------------------------------------
# The MoE layer
# --------------------------------------------------------------------------------------------------


class MoE(nn.Module):
    """Mixture of experts usable in place of a Linear (``expert_type='linear'``) or an FFN
    (``'mlp'``). See the module docstring for semantics, parameter tree and reference behaviours.

    Attributes:
      output_dim: output features o.
      num_experts: E.
      k: experts per unit (top-k); also the default capacity factor of expert choice.
      hidden_dim: hidden width h of mlp experts (required for ``'mlp'``).
      expert_type: ``'mlp'`` | ``'linear'``.
      routing: ``'input_choice'`` | ``'expert_choice'`` | ``'soft'`` | ``'random'``.
      level: ``'node'`` | ``'instance'`` | ``'problem'``.
      noisy_gating: add the learned gating noise in training (input choice only).
      capacity_factor: None = no-drop capacity; see ``expert_capacity`` / ``expert_choice_capacity``.
      dispatch: ``'dense'`` | ``'grouped_mlp'`` | ``'grouped'`` | ``'sparse'`` | ``'einsum'`` execution
        strategy (``resolve_dispatch``); the policy sets it and the next four from its execution plan.
      grouped_min_assignments: grouped calls with fewer (unit, expert) assignments per sort group run dense.
      grouped_by_expert: outside training mode, grouped MLP experts run expert by expert.
      sort_groups: the grouped sort runs within this many groups of consecutive units (one per device).
      blocks_as_one_product: the grouped blocks traced as one product (FLOP counting only).
      gates_by_rank: outside training mode, top-1/top-2 dense gates computed elementwise.
      temperature: T of the top-k softmax.
      loss_coef: multiplier of the load-balancing loss (reference default 1e-3).
      slots_per_expert: soft-MoE slots per expert (reference: k).
      expert_choice_softmax: ``'experts'`` (paper) or ``'tokens'`` (reference) axis of the EC scores.
      zero_output_eps: reproduce the reference's eps in exactly-zero outputs (input choice / random).
      dtype: computation dtype of the expert matmuls.
      param_dtype: parameter dtype.
      precision: ``jax.lax.Precision`` for matmuls (e.g. ``'highest'`` to avoid TF32 on GPUs).
    """

    output_dim: int
    num_experts: int = 4
    k: int = 2
    hidden_dim: Optional[int] = None
    expert_type: str = "mlp"
    routing: str = "input_choice"
    level: str = "node"
    noisy_gating: bool = True
    capacity_factor: Optional[float] = None
    dispatch: str = "dense"
    grouped_min_assignments: int = 0
    grouped_by_expert: bool = False
    sort_groups: int = 1
    blocks_as_one_product: bool = False
    gates_by_rank: bool = False
    temperature: float = 1.0
    loss_coef: float = DEFAULT_LOSS_COEF
    slots_per_expert: int = 1
    expert_choice_softmax: str = "experts"
    zero_output_eps: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    precision: Any = None

    # ---------------------------------------------------------------- configuration and parameters

    def _check_config(self) -> None:
        def one_of(name, value, allowed):
            if value not in allowed:
                raise ValueError(f"MoE.{name} must be one of {allowed}, got {value!r}")

        one_of("expert_type", self.expert_type, _EXPERT_TYPES)
        one_of("routing", self.routing, _ROUTINGS)
        one_of("level", self.level, _LEVELS)
        one_of("dispatch", self.dispatch, DISPATCHES)
        one_of("expert_choice_softmax", self.expert_choice_softmax, ("experts", "tokens"))
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"MoE needs 1 <= k <= num_experts, got k={self.k}, E={self.num_experts}")
        if self.expert_type == "mlp" and not self.hidden_dim:
            raise ValueError("MoE with expert_type='mlp' needs hidden_dim")
        if self.routing == "soft" and self.level == "problem":
            raise ValueError("soft MoE is not defined at problem level (the reference breaks there too)")
        if self.slots_per_expert < 1:
            raise ValueError("slots_per_expert must be >= 1")

    def _gate_params(self, d_in: int):
        """``w_gate`` (d, E) or (d, E*slots) and ``w_noise`` (d, E)."""
        gate_cols = self.num_experts * (self.slots_per_expert if self.routing == "soft" else 1)
        zero_init = self.routing == "input_choice" and self.level in ("node", "instance")
        gate_init = nn.initializers.zeros_init() if zero_init else torch_uniform_init(gate_cols)
        w_gate = self.param("w_gate", gate_init, (d_in, gate_cols), self.param_dtype)
        w_noise = self.param("w_noise", nn.initializers.zeros_init(), (d_in, self.num_experts), self.param_dtype)
        return w_gate, w_noise

    def _expert_params(self, d_in: int) -> dict:
        """Stacked expert parameters, keyed for ``experts_forward``."""
        e, o = self.num_experts, self.output_dim
        if self.expert_type == "mlp":
            h = self.hidden_dim
            return {
                "w1": self.param("experts_w1", torch_uniform_init(d_in), (e, d_in, h), self.param_dtype),
                "b1": self.param("experts_b1", torch_uniform_init(d_in), (e, h), self.param_dtype),
                "w2": self.param("experts_w2", torch_uniform_init(h), (e, h, o), self.param_dtype),
                "b2": self.param("experts_b2", torch_uniform_init(h), (e, o), self.param_dtype),
            }
        return {
            "w": self.param("experts_w", torch_uniform_init(d_in), (e, d_in, o), self.param_dtype),
            "b": self.param("experts_b", torch_uniform_init(d_in), (e, o), self.param_dtype),
        }

    def _run_experts(self, params, x, per_expert: bool):
        """(E, N, ..., d) per expert, or (N, ..., d) shared -> (E, N, ..., o)."""
        lead = x.shape[1:-1] if per_expert else x.shape[:-1]
        if per_expert:
            flat = x.reshape(x.shape[0], -1, x.shape[-1])
        else:
            flat = x.reshape(-1, x.shape[-1])
        out = experts_forward(params, flat, per_expert=per_expert, dtype=self.dtype, precision=self.precision)
        return out.reshape(out.shape[:1] + lead + (self.output_dim,))

    def _rng(self, train: bool):
        """Key of the 'gating' stream; in evaluation without the stream, the documented fixed key."""
        if train or self.has_rng("gating"):
            return self.make_rng("gating")
        return jax.random.PRNGKey(FALLBACK_SEED)

    # ---------------------------------------------------------------- entry point

    def gating_noise(self, num_units: int) -> Array:
        """(num_units, E) float32: the standard normal draws that a training call on ``num_units`` units takes
        for its noisy gating, from the same 'gating' stream (its first draw in this module), so that a caller
        can draw them for a whole batch once and give each part of the batch its rows (``noise=``)."""
        return jax.random.normal(self.make_rng("gating"), (num_units, self.num_experts), jnp.float32)

    @nn.compact
    def __call__(self, x: Array, train: bool, gates_only: bool = False, noise: Optional[Array] = None
                 ) -> tuple[Array, Array]:
        """x: (batch, tokens, d) or (tokens, d) -> (y with output_dim last, float32 scalar aux loss).

        ``gates_only=True`` (node-level input choice or random routing, linear experts): return the
        per-token gate matrix ``(..., E)`` instead of y, without running the experts, for callers that
        apply the experts' linear maps themselves (``y = sum_e gates_e (x @ experts_w[e] + experts_b[e])``).
        ``noise``: the (tokens, E) draws of noisy node-level gating in training (``gating_noise``), instead of
        drawing them here.
        """
        self._check_config()
        x = jnp.asarray(x)
        if x.ndim < 2:
            raise ValueError(f"MoE expects at least (tokens, d) input, got shape {x.shape}")
        d_in = x.shape[-1]
        w_gate, w_noise = self._gate_params(d_in)
        params = self._expert_params(d_in)
        out_shape = x.shape[:-1] + (self.output_dim,)
        if gates_only:
            if not self.supports_gates_only:
                raise ValueError("gates_only needs linear experts with node-level input_choice or random "
                                 f"routing, got {self.expert_type}/{self.level}/{self.routing}")
            gates, _, _, aux = self._token_gates(x.reshape(-1, d_in), train, noise)
            return gates.reshape(x.shape[:-1] + (self.num_experts,)), jnp.asarray(aux, jnp.float32)

        if self.level == "problem":
            y, aux, stats = self._problem_level(x, w_gate, params, train)
        else:
            if self.level == "node":
                units = x.reshape(-1, 1, d_in)  # (U, 1, d): every token is a unit
                gate_in = units[:, 0]
            else:
                if x.ndim > 3:
                    raise ValueError(f"instance-level routing expects (batch, tokens, d), got {x.shape}")
                units = x if x.ndim == 3 else x[None]  # (B, n, d); a 2-D input is one instance
                gate_in = units.mean(1)  # the reference routes an instance by its mean token
            if self.routing in ("input_choice", "random"):
                y, aux, stats = self._token_choice(units, gate_in, params, train, noise)
            elif self.routing == "expert_choice":
                y, aux, stats = self._expert_choice(units, gate_in, w_gate, params)
            else:
                y, aux, stats = self._soft(units, gate_in, w_gate, params)

        self.sow("intermediates", "dropped_assignments", stats[0])
        self.sow("intermediates", "dropped_tokens", stats[1])
        return y.reshape(out_shape), jnp.asarray(aux, jnp.float32)

    # ---------------------------------------------------------------- routing methods

    @property
    def supports_gates_only(self) -> bool:
        return (self.expert_type == "linear" and self.level == "node"
                and self.routing in ("input_choice", "random"))

    def _token_gates(self, gate_in, train, given_noise=None):
        """Token choice gating of units' gate inputs (U, d): (gates (U, E), top_idx (U, k), top_gate (U, k),
        aux ()). Parameters are read from the scope ``__call__`` created. ``given_noise``: the noisy gating's
        (U, E) draws (``gating_noise``), else drawn here."""
        num_units, e, k = gate_in.shape[0], self.num_experts, self.k
        if given_noise is not None and given_noise.shape != (num_units, e):
            raise ValueError(f"gating noise of shape {given_noise.shape} for {num_units} units of {e} experts")
        if self.routing == "input_choice":
            noise = None
            if self.noisy_gating and train:
                noise = self.gating_noise(num_units) if given_noise is None else given_noise
            gates, top_idx, top_gate, aux, _ = noisy_top_k_gating(
                gate_in, self.get_variable("params", "w_gate"), self.get_variable("params", "w_noise"), noise,
                k, self.temperature, self.loss_coef, self.precision, by_rank=self.gates_by_rank and k <= 2 and not train
            )
        else:
            uniform = jax.random.uniform(self._rng(train), (num_units, e))
            top_idx = jnp.argsort(uniform, axis=-1)[:, :k].astype(jnp.int32)
            top_gate = jnp.full((num_units, k), 1.0 / k, jnp.float32)
            gates = jnp.einsum("uk,uke->ue", top_gate, jax.nn.one_hot(top_idx, e, dtype=jnp.float32))
            aux = jnp.zeros((), jnp.float32)
        return gates, top_idx, top_gate, aux

    def _token_choice(self, units, gate_in, params, train, noise=None):
        """Input choice (noisy top-k) or random routing of units (U, R, d) -> (U, R, o)."""
        num_units, e, k = units.shape[0], self.num_experts, self.k
        gates, top_idx, top_gate, aux = self._token_gates(gate_in, train, noise)
        num_assignments = num_units * units.shape[1] * k
        strategy = resolve_dispatch(self.dispatch, expert_type=self.expert_type, num_assignments=num_assignments,
                                    min_assignments=self.grouped_min_assignments, sort_groups=self.sort_groups)

        if strategy == "dense":
            r = units.shape[1]
            y = gated_experts_forward(params, units.reshape(num_units * r, -1), jnp.repeat(gates, r, axis=0),
                                      dtype=self.dtype, precision=self.precision)
            y = y.reshape(num_units, r, -1).astype(self.dtype)     # outputs in the compute dtype, as elsewhere
            stats = (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
        elif strategy == "grouped":
            # Training keeps the block-by-block loop: its groups (one per device) run vmapped, where every
            # group's loops would run to the longest, and its sampling pass must compute what its backward
            # pass recomputes.
            block = grouped_experts.group_block(num_assignments // self.sort_groups)
            y = grouped_experts.grouped_experts_forward(
                params, units, top_idx, top_gate, top_gate > 0, block=max(1, min(block // units.shape[1], num_units)),
                dtype=self.dtype, precision=self.precision, by_expert=self.grouped_by_expert and not train,
                sort_groups=self.sort_groups, blocks_as_one_product=self.blocks_as_one_product)
            stats = (jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
        else:
            capacity = expert_capacity(num_units, k, e, self.capacity_factor)
            active = top_gate > 0  # the reference dispatches positive gates only
            slot, keep = assign_slots(top_idx, active, e, capacity)
            if strategy == "sparse":
                y = self._sparse_combine(units, params, top_idx, slot, keep, top_gate, capacity)
            else:
                dispatch, combine = dispatch_combine_tensors(top_idx, slot, keep, top_gate, e, capacity)
                buffers = jnp.einsum("uec,urd->ecrd", dispatch.astype(self.dtype), units.astype(self.dtype),
                                     precision=self.precision)
                expert_out = self._run_experts(params, buffers, per_expert=True)  # (E, C, R, o)
                y = jnp.einsum("uec,ecro->uro", combine.astype(expert_out.dtype), expert_out,
                               precision=self.precision)
            dropped = jnp.sum(active & ~keep).astype(jnp.int32)
            lost = jnp.sum(jnp.any(active, -1) & ~jnp.any(keep, -1)).astype(jnp.int32)
            stats = (dropped, lost)

        if self.zero_output_eps:
            y = jnp.where(y == 0, jnp.asarray(ZERO_OUTPUT_EPS, y.dtype), y)
        return y, aux, stats

    def _sparse_combine(self, units, params, top_idx, slot, keep, top_gate, capacity):
        """Scatter units into (E, C, R, d) buffers, run the experts, gather back and mix: (U, R, o)."""
        num_units, k = top_idx.shape
        # Dropped assignments get an out-of-range slot, which mode='drop' discards.
        write_slot = jnp.where(keep, slot, capacity)
        payload = jnp.broadcast_to(units[:, None], (num_units, k) + units.shape[1:]).astype(self.dtype)
        buffers = jnp.zeros((self.num_experts, capacity) + units.shape[1:], self.dtype)
        buffers = buffers.at[top_idx, write_slot].set(payload, mode="drop")
        expert_out = self._run_experts(params, buffers, per_expert=True)  # (E, C, R, o)
        picked = expert_out[top_idx, jnp.minimum(slot, capacity - 1)]  # (U, k, R, o)
        weight = jnp.where(keep, top_gate, 0.0).astype(picked.dtype)
        return jnp.einsum("uk,ukro->uro", weight, picked, precision=self.precision)

    def _expert_choice(self, units, gate_in, w_gate, params):
        """Each expert picks its top-c units by score: (U, R, d) -> (U, R, o)."""
        num_units, e = units.shape[0], self.num_experts
        logits = jnp.dot(gate_in.astype(jnp.float32), w_gate.astype(jnp.float32), precision=self.precision)
        axis = -1 if self.expert_choice_softmax == "experts" else 0
        scores = jax.nn.softmax(logits, axis=axis)  # (U, E)
        c = expert_choice_capacity(num_units, e, self.capacity_factor, self.k)
        chosen_score, chosen = jax.lax.top_k(scores.T, c)  # (E, c): each expert's units, best first

        if self.dispatch in ("dense", "grouped_mlp"):    # grouped is for token choice only
            # top_k indices are distinct per expert, so a set builds the (U, E) combine weights exactly.
            weights = jnp.zeros((num_units, e), jnp.float32).at[chosen, jnp.arange(e)[:, None]].set(chosen_score)
            expert_out = self._run_experts(params, units, per_expert=False)  # (E, U, R, o)
            y = jnp.einsum("ue,euro->uro", weights.astype(expert_out.dtype), expert_out, precision=self.precision)
        else:
            expert_out = self._run_experts(params, units[chosen], per_expert=True)  # (E, c, R, o)
            contrib = chosen_score.astype(expert_out.dtype)[..., None, None] * expert_out
            y = jnp.zeros((num_units,) + expert_out.shape[2:], expert_out.dtype).at[chosen].add(contrib)

        picked = jnp.zeros((num_units,), jnp.bool_).at[chosen.reshape(-1)].set(True)
        stats = (jnp.zeros((), jnp.int32), jnp.sum(~picked).astype(jnp.int32))
        return y, jnp.zeros((), jnp.float32), stats

    def _soft(self, units, gate_in, w_gate, params):
        """Soft MoE: experts process convex combinations of units: (U, R, d) -> (U, R, o)."""
        e, s = self.num_experts, self.slots_per_expert
        logits = jnp.dot(gate_in.astype(jnp.float32), w_gate.astype(jnp.float32), precision=self.precision)
        dispatch = jax.nn.softmax(logits, axis=0)  # (U, E*s): each slot averages over units
        combine = jax.nn.softmax(logits, axis=-1)  # (U, E*s): each unit averages over slots
        slot_in = jnp.einsum("us,urd->srd", dispatch.astype(self.dtype), units.astype(self.dtype),
                             precision=self.precision)
        slot_in = slot_in.reshape((e, s) + slot_in.shape[1:])  # expert i owns slots [i*s, (i+1)*s)
        slot_out = self._run_experts(params, slot_in, per_expert=True)  # (E, s, R, o)
        slot_out = slot_out.reshape((e * s,) + slot_out.shape[2:])
        y = jnp.einsum("us,sro->uro", combine.astype(slot_out.dtype), slot_out, precision=self.precision)
        zero = jnp.zeros((), jnp.int32)
        return y, jnp.zeros((), jnp.float32), (zero, zero)

    def _problem_level(self, x, w_gate, params, train):
        """One top-k (or random) choice of experts for the whole batch: (B, n, d) -> (B*n, o)."""
        if x.ndim > 3:
            raise ValueError(f"problem-level routing expects (batch, tokens, d), got {x.shape}")
        x3 = x if x.ndim == 3 else x[None]
        e, k = self.num_experts, self.k
        if self.routing == "random":
            idx = jax.random.permutation(self._rng(train), e)[:k].astype(jnp.int32)
            gate = jnp.full((k,), 1.0 / k, jnp.float32)
        else:
            pooled = x3.astype(jnp.float32).mean(0).mean(0)  # batch mean first, as the reference
            logits = jnp.dot(pooled, w_gate.astype(jnp.float32), precision=self.precision)  # (E,)
            top, idx = jax.lax.top_k(logits, k)
            gate = jax.nn.softmax(top / self.temperature)
        tokens = x3.reshape(-1, x3.shape[-1])
        if self.dispatch in ("dense", "grouped_mlp"):
            dense_gate = jnp.zeros((e,), jnp.float32).at[idx].set(gate)
            expert_out = self._run_experts(params, tokens, per_expert=False)  # (E, N, o)
            y = jnp.einsum("e,eno->no", dense_gate.astype(expert_out.dtype), expert_out, precision=self.precision)
        else:
            chosen = jax.tree_util.tree_map(lambda p: p[idx], params)  # only the k chosen experts run
            expert_out = self._run_experts(chosen, tokens, per_expert=False)  # (k, N, o)
            y = jnp.einsum("k,kno->no", gate.astype(expert_out.dtype), expert_out, precision=self.precision)
        zero = jnp.zeros((), jnp.int32)
        return y, jnp.zeros((), jnp.float32), (zero, zero)


# --------------------------------------------------------------------------------------------------
# MVMoE-L hierarchical (dense-or-MoE) gate
# --------------------------------------------------------------------------------------------------


class HierarchicalGate(nn.Module):
    """``softmax((mean over batch, then tokens, of x) @ kernel / T)``, shape (2,): P(dense), P(MoE).

    Parameter: ``kernel`` (d, 2), no bias (torch ``dense_or_moe.weight`` (2, d), transposed). Name the
    module ``dense_or_moe`` in the parent to mirror the torch state dict. Callers that pool a batch
    processed in chunks pass the pooled (d,) vector as ``pooled=`` instead of ``x``.
    """

    temperature: float = 1.0
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, x: Optional[Array] = None, *, pooled: Optional[Array] = None) -> Array:
        if (x is None) == (pooled is None):
            raise ValueError("HierarchicalGate takes exactly one of x and pooled")
        if pooled is None:
            pooled = x.astype(jnp.float32)
            while pooled.ndim > 1:  # reference: out_concat.mean(0).mean(0), one axis at a time
                pooled = pooled.mean(0)
        d = pooled.shape[-1]
        kernel = self.param("kernel", torch_uniform_init(d), (d, 2), self.param_dtype)
        logits = jnp.dot(pooled.astype(jnp.float32), kernel.astype(jnp.float32), precision=self.precision)
        return jax.nn.softmax(logits / self.temperature)


def sample_branch(key: Array, probs: Array) -> tuple[Array, Array]:
    """Draw the branch (int32 scalar: 0 dense, 1 MoE) from ``probs`` (2,) and return it with its
    probability, the factor the chosen branch's output is scaled by."""
    choice = jax.random.categorical(key, jnp.log(probs)).astype(jnp.int32)
    return choice, probs[choice]


class DenseOrMoE(nn.Module):
    """MVMoE-L decoder ``multi_head_combine``: a sampled choice between a linear-expert MoE and a dense
    layer, scaled by the chosen probability. Only the sampled branch runs (``nn.cond``).

    Submodules (named as the torch decoder's attributes): ``dense_or_moe`` (HierarchicalGate),
    ``multi_head_combine_moe`` (MoE, linear experts), ``multi_head_combine_dense`` (nn.Dense with bias).
    ``__call__(x, train, probs=None, key=None) -> (y, aux_loss, probs)``; see the module docstring for the
    reference's timing (probabilities computed at the first decoder step and reused; a branch sampled at
    every step, evaluation included). The sampled branch is sowed as ``intermediates/branch``.
    """

    output_dim: int
    num_experts: int = 4
    k: int = 2
    routing: str = "input_choice"
    level: str = "node"
    noisy_gating: bool = True
    capacity_factor: Optional[float] = None
    dispatch: str = "dense"
    gates_by_rank: bool = False
    loss_coef: float = DEFAULT_LOSS_COEF
    gate_temperature: float = 1.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    precision: Any = None

    def setup(self):
        self.dense_or_moe = HierarchicalGate(self.gate_temperature, self.param_dtype, self.precision)
        self.multi_head_combine_moe = MoE(
            output_dim=self.output_dim,
            num_experts=self.num_experts,
            k=self.k,
            expert_type="linear",
            routing=self.routing,
            level=self.level,
            noisy_gating=self.noisy_gating,
            capacity_factor=self.capacity_factor,
            dispatch=self.dispatch,
            gates_by_rank=self.gates_by_rank,
            loss_coef=self.loss_coef,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
        )
        self.multi_head_combine_dense = Dense(self.output_dim, dtype=self.dtype, param_dtype=self.param_dtype,
                                              precision=self.precision)

    def __call__(self, x: Array, train: bool, probs: Optional[Array] = None, key: Optional[Array] = None,
                 gates_only: bool = False):
        """-> (y, aux_loss, probs); with ``gates_only`` (see ``MoE``) -> (choice int32 () 0 dense / 1 MoE,
        scale (), MoE gates (..., E), aux_loss, probs): the caller applies the chosen branch's linear maps."""
        if probs is None:
            probs = self.dense_or_moe(x)
        if self.is_initializing():
            # nn.cond needs both branches' variables to exist already: create them outside it.
            self.multi_head_combine_dense(x)
            y, aux = self.multi_head_combine_moe(x, train)
            return y * probs[1].astype(y.dtype), aux, probs

        choice, scale = sample_branch(self.make_rng("gating") if key is None else key, probs)
        self.sow("intermediates", "branch", choice)
        if gates_only:
            # The gating is cheap (x @ w_gate): computed whatever the branch; its loss counts only when
            # the MoE branch was drawn, as when the branch runs.
            gates, aux = self.multi_head_combine_moe(x, train, gates_only=True)
            return choice, scale, gates, jnp.where(choice == 1, aux, 0.0), probs

        def moe_branch(mdl, h):
            return mdl.multi_head_combine_moe(h, train)

        def dense_branch(mdl, h):
            out = mdl.multi_head_combine_dense(h)
            return out, jnp.zeros((), jnp.float32)

        # Only params enter the branches: a sow inside one branch would give the two branches different
        # variable structures, which lax.cond rejects (the MoE's drop counters are therefore not sowed).
        y, aux = nn.cond(choice == 1, moe_branch, dense_branch, self, x, variables="params")
        return y * scale.astype(y.dtype), aux, probs


# --------------------------------------------------------------------------------------------------
# torch state dict -> Flax params
# --------------------------------------------------------------------------------------------------


def _prefixed(prefix: str) -> str:
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def torch_to_flax_moe(state: Mapping[str, np.ndarray], prefix: str, num_experts: int, expert_type: str) -> dict:
    """Flax params of one ``MoE`` from a flat torch state dict (numpy arrays).

    Args:
      state: e.g. ``{k: v.numpy() for k, v in checkpoint['model_state_dict'].items()}``.
      prefix: the torch module path, e.g. ``'encoder.layers.0.feedForward'`` (trailing dot optional).
      expert_type: ``'mlp'`` (torch ``moe_model='MLP'``) or ``'linear'`` (``'Linear'``).
    Returns:
      ``{'w_gate', 'w_noise', 'experts_w1', 'experts_b1', 'experts_w2', 'experts_b2'}`` (mlp) or
      ``{'w_gate', 'w_noise', 'experts_w', 'experts_b'}`` (linear), float32 numpy arrays; torch Linear
      weights (out, in) are transposed to (in, out).
    """
    p = _prefixed(prefix)
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731

    def stack(name: str, transpose: bool) -> np.ndarray:
        arrays = [f32(state[f"{p}experts.{j}.{name}"]) for j in range(num_experts)]
        return np.stack([a.T if transpose else a for a in arrays])

    out = {"w_gate": f32(state[p + "w_gate"]), "w_noise": f32(state[p + "w_noise"])}
    if expert_type == "mlp":
        out.update(
            experts_w1=stack("fc1.weight", True),
            experts_b1=stack("fc1.bias", False),
            experts_w2=stack("fc2.weight", True),
            experts_b2=stack("fc2.bias", False),
        )
    elif expert_type == "linear":
        out.update(experts_w=stack("weight", True), experts_b=stack("bias", False))
    else:
        raise ValueError(f"expert_type must be 'mlp' or 'linear', got {expert_type!r}")
    return out


def torch_to_flax_dense_or_moe(state: Mapping[str, np.ndarray], prefix: str, num_experts: int) -> dict:
    """Flax params of ``DenseOrMoE`` from the MVMoE-L decoder's torch keys under ``prefix`` (e.g.
    ``'decoder'``): ``dense_or_moe.weight``, ``multi_head_combine_moe.*``, ``multi_head_combine_dense.*``."""
    p = _prefixed(prefix)
    return {
        "dense_or_moe": {"kernel": np.asarray(state[p + "dense_or_moe.weight"], np.float32).T},
        "multi_head_combine_moe": torch_to_flax_moe(state, p + "multi_head_combine_moe", num_experts, "linear"),
        "multi_head_combine_dense": {
            "kernel": np.asarray(state[p + "multi_head_combine_dense.weight"], np.float32).T,
            "bias": np.asarray(state[p + "multi_head_combine_dense.bias"], np.float32),
        },
    }
