"""POMO multi-start decoding under ``jax.lax``: greedy and sampling, with x8 augmentation.

A rollout runs on a (batch, pomo) grid. After the forced first move to the depot, start ``p`` moves to
the p-th start node: customers 1..P in index order, or for backhaul variants the first P linehaul
customers, P = min(pomo, n) (P = min(pomo, floor(0.8 n)) with B), as the reference does. Batches that mix
variants pad the shorter start lists; padded starts are flagged invalid and never win.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mvmoe_jax import env
from mvmoe_jax.devices import DATA_AXIS, local_mesh, program_memory_bytes
from mvmoe_jax.engines import lane_reductions
from mvmoe_jax.execution import ExecutionPlan, default_plan
from mvmoe_jax.instances import BACKHAUL_RATIO, Instance, augment_8
from mvmoe_jax.nn.policy import DecoderCache, DecoderRecord, Policy, PolicyConfig


@struct.dataclass
class RolloutOutput:
    """actions int32 (B, P, T): the start node then every decoded node (depot-padded after finishing);
    log_likelihood (B, P): summed log-probability of the decoded actions (the forced start excluded);
    cost (B, P): tour length (+inf for invalid starts); valid bool (B, P): real POMO starts;
    finished bool (B, P); aux_loss (): MoE auxiliary loss summed over encoder and decoding steps;
    num_steps int32 (): decoding steps run (until every trajectory finished).

    With ``record=True`` the decoder's inputs at every step t < T are kept for a teacher-forced replay
    (unrun steps look like finished trajectories): masks bool (T, B, P, N), dynamic f32 (T, B, P, 4),
    active bool (T, B, P) (the trajectory had not finished before step t). Otherwise they are None.
    With ``record_decoder=True`` too, decoder: the ``DecoderRecord`` of every step, each array with a
    leading step axis (T, B, ...), so that the backward pass need not recompute them (zeros past the last
    step run)."""

    actions: jax.Array
    log_likelihood: jax.Array
    cost: jax.Array
    valid: jax.Array
    finished: jax.Array
    aux_loss: jax.Array
    num_steps: jax.Array
    masks: jax.Array | None = None
    dynamic: jax.Array | None = None
    active: jax.Array | None = None
    decoder: DecoderRecord | None = None


def trajectory_shardings(mesh: Mesh, decoder: bool = False) -> RolloutOutput:
    """Batch-sharded placement of a recorded rollout (the batch axis is 0, or 1 after a step axis), with
    or without the decoder record (``rollout(..., record_decoder=True)``)."""
    batch0, batch1, rep = (NamedSharding(mesh, P(DATA_AXIS)), NamedSharding(mesh, P(None, DATA_AXIS)),
                           NamedSharding(mesh, P()))
    return RolloutOutput(actions=batch0, log_likelihood=batch0, cost=batch0, valid=batch0, finished=batch0,
                         aux_loss=rep, num_steps=rep, masks=batch1, dynamic=batch1, active=batch1,
                         decoder=DecoderRecord(batch1, batch1, batch1) if decoder else None)


def num_starts(num_customers: int, has_backhaul, pomo_size: int):
    """Number of POMO starts per instance (int array broadcast like ``has_backhaul``)."""
    full = min(pomo_size, num_customers)
    with_b = min(pomo_size, int(num_customers * (1 - BACKHAUL_RATIO)))
    return jnp.where(has_backhaul, with_b, full)


def start_nodes(inst: Instance, pomo_size: int) -> tuple[jax.Array, jax.Array]:
    """(starts int32 (B, P), valid bool (B, P)): the first P linehaul customers of each instance.

    Without backhauls every customer is a linehaul, so this is customers 1..P. An instance of backhauls
    only starts at its first backhauls (the vehicle leaves the depot empty; the reference's generator
    never makes one). Invalid (padded) starts repeat the first start.
    """
    n = inst.locs.shape[-2] - 1
    p = min(pomo_size, n)
    linehaul = inst.demand[:, 1:] > 0                                          # (B, n)
    first = jnp.where(linehaul.any(-1, keepdims=True), linehaul, True)         # where a route may begin
    # Stable ordering: those customers first, in index order.
    order = jnp.argsort(~first, axis=-1, stable=True)[:, :p] + 1               # (B, P)
    count = jnp.minimum(num_starts(n, inst.has_backhaul, pomo_size), first.sum(-1))
    valid = jnp.arange(p)[None, :] < count[:, None]
    starts = jnp.where(valid, order, order[:, :1])
    return starts.astype(jnp.int32), valid


def dynamic_features(states: env.State) -> jax.Array:
    """(B, P, 4) decoder inputs (load, time, length, open)."""
    is_open = jnp.broadcast_to(states.instance.is_open[:, None], states.load.shape)
    return jnp.stack([states.load, states.time, states.length, is_open.astype(jnp.float32)], axis=-1)


def decoding_keys(rng: jax.Array, num_steps: int) -> tuple[jax.Array, jax.Array]:
    """(encoder key, per-step keys (num_steps,)): every key a rollout draws from ``rng``.

    Step t's key drives its MoE gating noise, MVMoE-L's branch draw and the sampled action, so a replay
    with the same keys reproduces the rollout exactly.
    """
    k_enc, k_loop = jax.random.split(rng)
    keys = jax.vmap(lambda t: jax.random.fold_in(k_loop, t))(jnp.arange(num_steps))
    return k_enc, keys


def step_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(gating key, choice key) of one decoding step's key (one of ``decoding_keys``): the first drives the
    step's MoE gating noise and MVMoE-L's branch draw, the second the sampled choice (``choice_uniforms``).
    Every pass that must reproduce a rollout's draws (the replays, training's chunked sampling) splits here."""
    k_gate, k_pick = jax.random.split(key)
    return k_gate, k_pick


def choice_uniforms(k_pick: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The uniforms (``shape``: one per trajectory) that ``sample_actions`` draws from a step's choice key."""
    return jax.random.uniform(k_pick, shape)


def first_true(condition: jax.Array, lanes: bool = False) -> jax.Array:
    """int32 (...,): the index of the first True along the last axis of ``condition`` (..., N); N where none.

    A float min over the indices (exact below 2**24), one vectorised reduction on XLA:CPU, where argmax's
    two-operand reduction is not and an int32 min is split into several reduce-windows; in lanes with
    ``lanes`` (the plan's ``lane_reductions``).
    """
    n = condition.shape[-1]
    index = jnp.where(condition, jnp.arange(n, dtype=jnp.float32), jnp.float32(n))
    return lane_reductions.node_reduce(index, jnp.minimum, lanes).astype(jnp.int32)


def first_argmax(x: jax.Array, lanes: bool = False) -> jax.Array:
    """int32 (...,): the index of the first maximum along the last axis of ``x`` (..., N), as ``jnp.argmax``.

    A max, then ``first_true`` over the entries that reach it: two plain reductions, which XLA:CPU
    vectorises together with the elementwise work fused into them (the logit clipping's tanh), where
    argmax's two-operand reduction does not (see docs/performance.md, "Greedy choice without argmax").
    Both reductions run in lanes with ``lanes`` (the plan's ``lane_reductions``). A row holding a NaN has no
    defined choice: in lanes it gives N; XLA:CPU's plain maximum ignores the NaN at some widths.
    """
    return first_true(x == lane_reductions.node_reduce(x, jnp.maximum, lanes)[..., None], lanes)


def sample_actions(key: jax.Array, logp: jax.Array, uniform: jax.Array | None = None, lanes: bool = False
                   ) -> jax.Array:
    """One node per row drawn from ``exp(logp)`` (..., N) by inversion: int32 (...,).

    One uniform per row instead of ``jax.random.categorical``'s Gumbel draw per node, several times faster
    on a CPU (see docs/performance.md, "Greedy choice without argmax"). The prefix sums come from a product with
    a triangular matrix; since rounding may leave them not exactly monotone, the draw takes the first
    node of positive probability whose prefix sum exceeds the threshold, so a masked node (probability 0)
    is never drawn. ``uniform``: the (...,) uniform draws ``key`` gives (``sampling_uniforms``), given.
    """
    n = logp.shape[-1]
    p = jnp.exp(logp)
    cdf = p @ jnp.triu(jnp.ones((n, n), p.dtype))
    possible = p > 0
    total = jnp.max(jnp.where(possible, cdf, 0.0), axis=-1)
    if uniform is None:
        uniform = choice_uniforms(key, logp.shape[:-1])
    threshold = uniform * total
    first = first_true(possible & (cdf > threshold[..., None]), lanes)
    return jnp.where(first < n, first, 0)      # no such node (nothing possible): 0, as argmax


def encode_nodes(policy: Policy, params, inst: Instance, rng: jax.Array, train: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
    """(node embeddings (B, N, D), encoder MoE auxiliary loss) of a batch, with the encoder key ``rollout``
    uses."""
    k_enc = jax.random.split(rng)[0]           # = decoding_keys(rng, .)[0]
    return policy.apply(params, inst, train, method=Policy.encode, rngs={"gating": k_enc})


def encode(policy: Policy, params, inst: Instance, rng: jax.Array, train: bool = False
           ) -> tuple[DecoderCache, jax.Array]:
    """(decoder cache, encoder MoE auxiliary loss) of a batch, with the encoder key ``rollout`` uses."""
    emb, aux = encode_nodes(policy, params, inst, rng, train)
    return policy.apply(params, emb, locs=inst.locs, method=Policy.precompute), aux


def initial_states(inst: Instance, pomo_size: int) -> tuple[env.State, jax.Array, jax.Array]:
    """(states (B, P) after the move to each start node, starts int32 (B, P), valid bool (B, P))."""
    starts, valid = start_nodes(inst, pomo_size)
    states = env.batch_step(env.batch_reset(inst, starts.shape[1]), starts)
    return states, starts, valid


def rollout(policy: Policy, params, inst: Instance, *, pomo_size: int, decode_type: str = "greedy",
            rng: jax.Array | None = None, train: bool = False, max_steps: int | None = None,
            record: bool = False, encoded: tuple[DecoderCache, jax.Array] | None = None,
            gate_probs: jax.Array | None = None, log_likelihood: bool = True,
            record_decoder: bool = False, decoder_buffers: DecoderRecord | None = None) -> RolloutOutput:
    """Decode every start of every instance (batched Instance, B) until all finish.

    decode_type: 'greedy' (argmax) or 'sampling'. ``rng`` drives sampling, MoE gating noise in training
    and MVMoE-L's dense-or-sparse draws (which the reference samples in evaluation too); see
    ``decoding_keys``. ``record`` keeps the decoder's inputs for a replay (see RolloutOutput).
    ``encoded``: ``encode(policy, params, inst, rng, train)`` computed beforehand; ``gate_probs``: MVMoE-L's
    dense-or-MoE probabilities (2,) when they come from a larger batch than ``inst`` (see
    ``greedy_evaluate``), else computed at the first step from this batch. ``log_likelihood=False``
    (greedy only) skips the per-step log-softmax, which greedy choices do not need; the output's
    log_likelihood is then zero. ``record_decoder`` (with ``record``) also keeps each step's
    ``DecoderRecord`` (see RolloutOutput; memory: ``decoder_record_bytes``). ``decoder_buffers``: storage
    for that record, each array (max_steps,) + a step's shape, whose contents are ignored (a previous
    call's record, passed in with its buffers donated): the record is then written in place rather than
    into freshly zeroed memory, which on a CPU costs a pass over the whole record (see
    ``training.StepFunctions``). jit-compatible (policy, pomo_size, decode_type, train, max_steps, record,
    log_likelihood, record_decoder static).
    """
    if decode_type not in ("greedy", "sampling"):
        raise ValueError(f"decode_type must be 'greedy' or 'sampling', got {decode_type!r}")
    if not log_likelihood and decode_type != "greedy":
        raise ValueError("sampling needs the log-probabilities: log_likelihood=False is for greedy decoding")
    if record_decoder and not record:
        raise ValueError("record_decoder=True needs record=True")
    if decoder_buffers is not None and not record_decoder:
        raise ValueError("decoder_buffers are storage for the decoder record: pass record_decoder=True")
    rng = jax.random.key(0) if rng is None else rng
    n = inst.locs.shape[-2] - 1
    steps = 2 * n if max_steps is None else max_steps      # a depot visit per customer at most
    _, keys = decoding_keys(rng, steps)

    cache, aux = encode(policy, params, inst, rng, train) if encoded is None else encoded
    states, starts, valid = initial_states(inst, pomo_size)
    b, p = starts.shape

    decode_step = partial(decode_one_step, policy, params, cache, decode_type=decode_type, train=train,
                          log_likelihood=log_likelihood, record_decoder=record_decoder)

    def write(buffers, t, action, record_t):
        actions = jax.lax.dynamic_update_slice_in_dim(buffers[0], action[..., None], t + 1, axis=2)
        if not record:
            return (actions,)
        return (actions,) + jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, t, axis=0),
                                         buffers[1:], record_t)

    buffers = (jnp.zeros((b, p, steps + 1), jnp.int32).at[:, :, 0].set(starts),)
    if record or (gate_probs is None and policy.cfg.hierarchical):
        # The first decoding step peeled off the loop: MVMoE-L computes its gate probabilities there, and the
        # record's buffers take their shapes from it.
        states, a0, ll, aux_t, gate_probs, record_0 = decode_step(states, gate_probs, keys[0])
        if gate_probs is None:
            gate_probs = jnp.zeros((2,), jnp.float32)
        aux, first_in_loop = aux + aux_t, 1
        if record:
            # Unrun steps look like finished trajectories: only the depot feasible.
            n1 = inst.locs.shape[-2]
            buffers += (jnp.zeros((steps, b, p, n1), bool).at[..., 0].set(True),
                        jnp.zeros((steps, b, p, 4), jnp.float32), jnp.zeros((steps, b, p), bool))
            if record_decoder:
                buffers += (decoder_storage(record_0[3], steps, decoder_buffers),)
        buffers = write(buffers, 0, a0, record_0)
    else:
        # Otherwise the loop runs it: peeled, XLA:CPU fused the query fusion's table construction into that
        # step's score gather, which then ran far slower than a step in the loop (see docs/performance.md,
        # "Chunked greedy decoding").
        ll = jnp.zeros((b, p), jnp.float32)
        gate_probs = jnp.zeros((2,), jnp.float32) if gate_probs is None else gate_probs
        first_in_loop = 0

    def cond(carry):
        t, states = carry[0], carry[1]
        return (t < steps) & ~jnp.all(states.finished)

    def body(carry):
        t, states, buffers, ll, aux, gate_probs = carry
        states, a, chosen, aux_t, gate_probs, record_t = decode_step(states, gate_probs, keys[t])
        return t + 1, states, write(buffers, t, a, record_t), ll + chosen, aux + aux_t, gate_probs

    carry = (jnp.int32(first_in_loop), states, buffers, ll, aux, gate_probs)
    t, states, buffers, ll, aux, _ = jax.lax.while_loop(cond, body, carry)
    cost = jnp.where(valid, states.cost, jnp.inf)
    recorded = dict(zip(("masks", "dynamic", "active", "decoder"), buffers[1:]))
    return RolloutOutput(actions=buffers[0], log_likelihood=ll, cost=cost, valid=valid,
                         finished=states.finished, aux_loss=aux, num_steps=t, **recorded)


def decode_one_step(policy: Policy, params, cache: DecoderCache, states: env.State, gate_probs, key: jax.Array, *,
                    decode_type: str, train: bool, log_likelihood: bool, record_decoder: bool,
                    gating_noise: jax.Array | None = None, uniform: jax.Array | None = None):
    """One decoding step of ``rollout`` from step key ``key``: (next states, action, its log-probability, aux
    loss, gate_probs, (mask, dynamic features, active, *decoder record) of this step). ``gating_noise`` and
    ``uniform``: the draws that ``key`` gives the decoder MoE and the sampled choice, given instead
    (``chunked_sampling``, which takes them from the whole batch's)."""
    k_gate, k_pick = step_keys(key)
    mask = env.batch_action_mask(states)
    dyn = dynamic_features(states)
    noise = {} if gating_noise is None else {"gating_noise": gating_noise}
    logp, aux_t, gate_probs, *decoder_t = policy.apply(
        params, cache, states.current, dyn, mask, gate_probs, train, log_likelihood, record_decoder, **noise,
        method=Policy.decode, rngs={"gating": k_gate})
    lanes = policy.plan.lane_reductions
    if decode_type == "greedy":
        action = first_argmax(logp, lanes)
    else:
        action = sample_actions(k_pick, logp, uniform, lanes)
    if log_likelihood:
        chosen = jnp.take_along_axis(logp, action[..., None], axis=-1)[..., 0]
        # Finished trajectories only stay at the depot: no log-probability.
        chosen = jnp.where(states.finished, 0.0, chosen)
    else:
        chosen = jnp.zeros(action.shape, jnp.float32)
    record_t = (mask, dyn, ~states.finished, *decoder_t)
    return env.batch_step(states, action), action, chosen, aux_t, gate_probs, record_t


def decoder_storage(first: DecoderRecord, steps: int, given: DecoderRecord | None) -> DecoderRecord:
    """Buffers for ``steps`` steps of the decoder record whose first step is ``first`` (arrays or shapes):
    ``given`` after checking its shapes, else zeros."""
    wanted = jax.tree.map(lambda x: jax.ShapeDtypeStruct((steps,) + x.shape, x.dtype), first)
    if given is None:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), wanted)
    have = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), given)
    if jax.tree.structure(have) != jax.tree.structure(wanted) or have != wanted:
        raise ValueError(f"decoder_buffers do not fit this rollout's record: got {have}, need {wanted}")
    return given


def chunk_instances(pomo_size: int, trajectories: int) -> int | None:
    """Instances in about ``trajectories`` trajectories of ``pomo_size`` starts, at least one (2 at n = 50,
    5 at n = 20 for 100 trajectories); None for ``trajectories`` 0 (no chunking).

    Why chunks: on a CPU a decoding step whose working set (attention scores and weights, masks, readout
    scores) stays in the core's cache runs faster per trajectory than one over a whole augmented batch, while
    fewer, larger chunks pay the per-step fixed costs less often (docs/performance.md, "Chunked greedy
    decoding"); accelerators' throughput grows with the batch (the plan's chunk fields are 0 there)."""
    if not trajectories:
        return None
    return max(1, trajectories // max(pomo_size, 1))


def encoder_token_budget(cfg: PolicyConfig, plan: ExecutionPlan) -> int:
    """Tokens per encoder call in ``_chunked_greedy_rollout``: the plan's ``encoder_tokens`` when the encoder
    has MoE layers that may run grouped, else 0 (one chunk per call). The grouped blocks prefer thousands of
    tokens where a decoding step prefers a few hundred trajectories; plain feed-forward layers gain nothing
    (docs/performance.md, "Encoder token groups")."""
    grouped = plan.moe_dispatch in ("grouped_mlp", "grouped")
    has_encoder_moe = any(cfg.moe_at(f"Enc{i}") for i in range(cfg.num_layers))
    return plan.encoder_tokens if grouped and has_encoder_moe else 0


def encoder_group_size(num_chunks: int, chunk: int, num_nodes: int, budget: int) -> int:
    """Decoding chunks encoded together by ``_chunked_greedy_rollout``: the largest divisor of
    ``num_chunks`` whose tokens (chunks x chunk x num_nodes) stay within ``budget`` (at least one chunk)."""
    fit = max(1, budget // (chunk * num_nodes))
    return max(g for g in range(1, min(fit, num_chunks) + 1) if num_chunks % g == 0)


@struct.dataclass
class GreedyResult:
    """Per instance (B,): best cost over starts without augmentation and over starts x 8 augmentations,
    and the best route's actions (B, T) (from the augmented run when augmenting); num_steps: decoding
    steps the batch needed (the longest chunk); chunk_steps int32 (C,): the steps each chunk ran."""

    obj_no_aug: jax.Array
    obj: jax.Array
    best_actions: jax.Array
    all_finished: jax.Array
    num_steps: jax.Array
    chunk_steps: jax.Array


def _chunked_greedy_rollout(policy: Policy, params, inst: Instance, rng: jax.Array, pomo_size: int,
                            chunk: int, mesh: Mesh | None = None) -> tuple[BestStarts, jax.Array]:
    """Greedy rollouts of M instances, ``chunk`` at a time (``lax.map``); same results as one rollout.

    Every chunk uses the same ``rng``, so step t draws the same keys in every chunk as in a single batch.
    The encoder runs on ``encoder_group_size`` chunks at a time (``encoder_token_budget``), which then
    decode one after another.
    MVMoE-L's dense-or-MoE probabilities come from the first step's attention pooled over all M instances
    (as the reference computes them over its batch): a first pass encodes every chunk and pools, the
    second decodes from the stored node embeddings. With a ``mesh`` (one ``'data'`` axis) the chunks are dealt
    out over its devices, each running its own share one after another (padded to a whole number of
    chunks per device with copies of the first instance). Returns each instance's best start
    (``best_starts``, (M, ...)) and the steps of each chunk (C,), padding chunks included.
    """
    m = inst.locs.shape[0]
    num_devices = 1 if mesh is None else mesh.devices.size
    num_chunks = -(-m // chunk)
    num_chunks = -(-num_chunks // num_devices) * num_devices
    idx = jnp.concatenate([jnp.arange(m), jnp.zeros(num_chunks * chunk - m, jnp.int32)])
    chunks = jax.tree.map(lambda x: x[idx].reshape((num_chunks, chunk) + x.shape[1:]), inst)
    real = (jnp.arange(num_chunks * chunk) < m).reshape(num_chunks, chunk)
    starts_per_instance = min(pomo_size, inst.locs.shape[-2] - 1)          # P of start_nodes

    num_nodes = inst.locs.shape[-2]
    budget = encoder_token_budget(policy.cfg, policy.plan)

    def decode_chunks(params, chunks, real):
        """(C', ...) outputs of this device's C' chunks, encoded ``group`` chunks at a time."""
        num_local = chunks.locs.shape[0]
        group = encoder_group_size(num_local, chunk, num_nodes, budget)
        decode = partial(rollout, policy, params, pomo_size=pomo_size, decode_type="greedy", rng=rng,
                         log_likelihood=False)

        def encode_group(g_chunks):
            """The group's chunks encoded as one batch: (node embeddings (group, chunk, N, D), the encoder's
            auxiliary loss shared out evenly over the chunks (group,); greedy evaluation does not report it)."""
            flat = jax.tree.map(lambda x: x.reshape((group * chunk,) + x.shape[2:]), g_chunks)
            emb, aux = encode_nodes(policy, params, flat, rng)
            return emb.reshape((group, chunk) + emb.shape[1:]), jnp.full((group,), aux / group)

        def precompute(emb, c_inst):
            """A chunk's decoder cache, computed where the chunk decodes. Stacked for a whole group (or, for
            MVMoE-L, for all the device's chunks) instead, the caches were written out and read back per
            chunk, which cost more (see docs/performance.md, "Chunked greedy decoding")."""
            return policy.apply(params, emb, locs=c_inst.locs, method=Policy.precompute)

        def by_group(x):
            return x.reshape((num_local // group, group) + x.shape[1:])

        def by_chunk(x):
            return x.reshape((num_local,) + x.shape[2:])

        if not policy.cfg.hierarchical:
            def encode_and_decode(g_chunks):
                emb, aux = encode_group(g_chunks)
                return jax.lax.map(lambda a: decode(a[0], encoded=(precompute(a[1], a[0]), a[2])),
                                   (g_chunks, emb, aux))

            return jax.tree.map(by_chunk, jax.lax.map(encode_and_decode, jax.tree.map(by_group, chunks)))

        def encode_and_pool(args):
            g_chunks, g_real = args
            emb, aux = encode_group(g_chunks)

            def pool(c_args):
                c_inst, c_real, c_emb = c_args
                states, _, _ = initial_states(c_inst, pomo_size)
                # The query projected, not gathered from the tables: built in the same program, their
                # construction was fused into this one-off gather, far slower than a decoding step's (see
                # docs/performance.md, "Chunked greedy decoding"). Only the keys and values of the cache are
                # used here; XLA drops the rest.
                attn = policy.apply(params, precompute(c_emb, c_inst).without_query_fusion(), states.current,
                                    dynamic_features(states), env.batch_action_mask(states),
                                    method=Policy.decoder_attention)
                return jnp.sum(jnp.where(c_real[:, None, None], attn, 0.0), axis=(0, 1))

            return (emb, aux), jax.lax.map(pool, (g_chunks, g_real, emb))

        (emb, aux), sums = jax.lax.map(encode_and_pool, (jax.tree.map(by_group, chunks), by_group(real)))
        emb, aux = by_chunk(emb), by_chunk(aux)
        total = sums.sum((0, 1)) if mesh is None else jax.lax.psum(sums.sum((0, 1)), DATA_AXIS)
        probs = policy.apply(params, total / (m * starts_per_instance), method=Policy.hierarchical_gate_probs)
        return jax.lax.map(lambda a: decode(a[0], encoded=(precompute(a[1], a[0]), a[2]), gate_probs=probs),
                           (chunks, emb, aux))

    def summarise_chunks(params, chunks, real):
        """This device's chunks decoded, as packed best starts (C' x chunk, 3 + T) float32."""
        outs = decode_chunks(params, chunks, real)
        rows = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), outs.replace(aux_loss=None, num_steps=None))
        return pack_best_starts(best_starts(rows), jnp.repeat(outs.num_steps, chunk))

    def gathered_summaries(params, chunks, real):
        """Every device's packed summaries on every device, in one collective. After it the rest of the
        program runs replicated; left to the partitioner, the reductions over the augmentations (spread over
        the devices) took seven collectives (see docs/performance.md, "One collective per evaluation")."""
        return jax.lax.all_gather(summarise_chunks(params, chunks, real), DATA_AXIS, tiled=True, to="invarying")

    if mesh is None:
        packed = summarise_chunks(params, chunks, real)
    else:
        packed = jax.shard_map(gathered_summaries, mesh=mesh, in_specs=(P(), P(DATA_AXIS), P(DATA_AXIS)),
                               out_specs=P())(params, chunks, real)
    best, row_steps = unpack_best_starts(packed)
    return jax.tree.map(lambda x: x[:m], best), row_steps[::chunk]


@struct.dataclass
class BestStarts:
    """Per rollout row (an instance copy), M rows: cost (M,) the best over its finished starts (+inf when none
    is valid and finished), actions int32 (M, T) that start's (the first best), done bool (M,) some valid start
    finished (so the best one did). A start stuck in a dead end (the classic backhaul rule, env.action_mask)
    never finishes and never wins."""

    cost: jax.Array
    actions: jax.Array
    done: jax.Array


def best_starts(out: RolloutOutput) -> BestStarts:
    """Each row's best start of a rollout's (M, P) output."""
    cost = jnp.where(out.finished, out.cost, jnp.inf)
    best = jnp.argmin(cost, axis=-1)
    actions = jnp.take_along_axis(out.actions, best[:, None, None], axis=1)[:, 0]
    return BestStarts(cost=cost.min(-1), actions=actions, done=jnp.any(out.finished & out.valid, axis=-1))


def pack_best_starts(best: BestStarts, steps: jax.Array) -> jax.Array:
    """``best`` and the decoding steps of each row's chunk (M,) as one (M, 3 + T) float32 array, to move in
    one collective: actions and steps are integers below 2^24, exact in float32."""
    columns = [best.cost[:, None], best.done[:, None], steps[:, None], best.actions]
    return jnp.concatenate([c.astype(jnp.float32) for c in columns], axis=-1)


def unpack_best_starts(packed: jax.Array) -> tuple[BestStarts, jax.Array]:
    """(BestStarts, steps int32 (M,)) from ``pack_best_starts``' array."""
    best = BestStarts(cost=packed[:, 0], actions=packed[:, 3:].astype(jnp.int32), done=packed[:, 1] > 0)
    return best, packed[:, 2].astype(jnp.int32)


def augmented_batch(inst: Instance) -> Instance:
    """The 8 symmetric copies of a batch (B) flattened into one batch (8B), augmentation-major."""
    aug = augment_8(inst)                                                          # (8, B, ...)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), aug)


def effective_chunk_size(chunk_size: int | None, pomo_size: int, flat: Instance, plan: ExecutionPlan,
                         num_devices: int = 1) -> int:
    """Instances ``greedy_evaluate`` decodes at once for the (augmented) batch ``flat``: ``chunk_size``
    or the plan's (``chunk_instances``), capped at the batch (the whole batch when there is no chunking) and,
    over several devices, at an even share of it, so that every device has a chunk."""
    m = flat.locs.shape[0]
    if chunk_size is None:
        chunk_size = chunk_instances(min(pomo_size, flat.locs.shape[-2] - 1), plan.eval_chunk_trajectories)
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of instances, got {chunk_size}")
    share = -(-m // num_devices)
    return share if chunk_size is None else min(chunk_size, share)


def greedy_evaluate(cfg: PolicyConfig, params, inst: Instance, rng: jax.Array, *, pomo_size: int,
                    augment: bool = True, chunk_size: int | None = None,
                    num_devices: int | None = None, plan: ExecutionPlan | None = None) -> GreedyResult:
    """Greedy POMO evaluation of a batch, optionally with x8 augmentation (one pass over 8B instances).

    chunk_size: instances decoded at once (the 8B augmented instances are processed in sequential chunks
    of this many; results do not depend on it). None: the plan's (``chunk_instances``).
    plan: the execution plan (None: ``execution.default_plan()``, the preset of the default backend).
    num_devices: the chunks are dealt out over this process's first ``num_devices`` devices, which decode
    their shares at the same time (None: all of them; see ``devices.use_cpu_cores_as_devices`` for a
    CPU's cores as devices). Results do not depend on it. Inputs are copied to those devices as needed.
    Compiled once per (cfg, shapes, options); ``compile_greedy_evaluate`` compiles ahead of the first call.
    """
    num_devices = local_mesh(num_devices).devices.size
    params, inst, rng = replicated((params, inst, rng), num_devices)
    return _greedy_evaluate(cfg, params, inst, rng, pomo_size=pomo_size, augment=augment, chunk_size=chunk_size,
                            num_devices=num_devices, plan=plan or default_plan())


def compile_greedy_evaluate(cfg: PolicyConfig, params, inst: Instance, rng: jax.Array, *, pomo_size: int,
                            augment: bool = True, chunk_size: int | None = None,
                            num_devices: int | None = None, plan: ExecutionPlan | None = None
                            ) -> "CompiledGreedyEvaluate":
    """``greedy_evaluate`` compiled for the shapes of (params, inst, rng) (for timing compilation apart):
    called as (params, inst, rng) -> GreedyResult for batches of those shapes."""
    num_devices = local_mesh(num_devices).devices.size
    compiled = _greedy_evaluate.lower(cfg, *replicated((params, inst, rng), num_devices), pomo_size=pomo_size,
                                      augment=augment, chunk_size=chunk_size, num_devices=num_devices,
                                      plan=plan or default_plan()).compile()
    return CompiledGreedyEvaluate(compiled, num_devices)


@dataclasses.dataclass(frozen=True)
class CompiledGreedyEvaluate:
    """A compiled greedy evaluation: call it as ``greedy_evaluate`` for batches of the shapes it was
    compiled for; ``memory_bytes()`` is what the program needs on each device."""

    compiled: Any                 # jax.stages.Compiled
    num_devices: int

    def __call__(self, params, inst: Instance, rng: jax.Array) -> GreedyResult:
        return self.compiled(*replicated((params, inst, rng), self.num_devices))

    def memory_bytes(self) -> int:
        return program_memory_bytes(self.compiled)

    def output_spec(self) -> GreedyResult:
        """Shapes and dtypes of a call's result (``jax.ShapeDtypeStruct`` leaves)."""
        return self.compiled.out_info


def replicated(tree, num_devices: int | None = None):
    """``tree`` replicated over the first ``num_devices`` local devices (None: all), as ``greedy_evaluate``
    places its inputs; a no-op for arrays already placed so, and on one device. Arrays committed to one
    device (e.g. restored from a checkpoint) cannot enter a program that runs on several. Evaluating many
    batches with the same parameters, replicate them once with this rather than at every call."""
    mesh = local_mesh(num_devices)
    if mesh.devices.size == 1:
        return tree
    target = NamedSharding(mesh, P())
    # Checked leaf by leaf rather than left to device_put, which passed all of MVMoE's already-placed
    # parameter arrays again whenever only the instances beside them needed placing, milliseconds a call (see
    # docs/performance.md, "One collective per evaluation").
    leaves, treedef = jax.tree.flatten(tree)
    missing = [i for i, x in enumerate(leaves)
               if not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim))]
    if missing:
        placed = jax.device_put([leaves[i] for i in missing], target)
        for i, x in zip(missing, placed):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


@partial(jax.jit, static_argnames=("cfg", "pomo_size", "augment", "chunk_size", "num_devices", "plan"))
def _greedy_evaluate(cfg: PolicyConfig, params, inst: Instance, rng: jax.Array, *, pomo_size: int,
                     augment: bool, chunk_size: int | None, num_devices: int, plan: ExecutionPlan) -> GreedyResult:
    """``greedy_evaluate``'s program; the inputs are on the devices of ``local_mesh(num_devices)``."""
    b = inst.locs.shape[0]
    flat = augmented_batch(inst) if augment else inst
    m = flat.locs.shape[0]
    mesh = local_mesh(num_devices)
    chunk = effective_chunk_size(chunk_size, pomo_size, flat, plan, num_devices)
    policy = Policy(cfg, plan)
    if chunk == m:
        out = rollout(policy, params, flat, pomo_size=pomo_size, decode_type="greedy", rng=rng,
                      log_likelihood=False)
        best, chunk_steps = best_starts(out), out.num_steps[None]
    else:
        best, chunk_steps = _chunked_greedy_rollout(policy, params, flat, rng, pomo_size, chunk,
                                                    mesh if num_devices > 1 else None)
    # Rows are augmentation-major: (A, B). The best augmentation is the first with the lowest cost, and its
    # best start the first there: the first minimum over (augmentation, start) in that order.
    cost = best.cost.reshape(-1, b)
    best_aug = jnp.argmin(cost, axis=0)
    actions = best.actions.reshape(-1, b, best.actions.shape[-1])
    best_actions = jnp.take_along_axis(actions, best_aug[None, :, None], axis=0)[0]
    return GreedyResult(obj_no_aug=cost[0], obj=cost.min(0), best_actions=best_actions,
                        all_finished=best.done.reshape(-1, b).all(0), num_steps=chunk_steps.max(),
                        chunk_steps=chunk_steps)
