"""The encoder-decoder policy; POMO, POMO-MTL, MVMoE and MVMoE-L are configurations of it.

Encoder: the depot's (x, y) and each customer's (x, y, d, e, l) are embedded linearly (or by a MoE of
linear experts at position ``Raw``), then ``num_layers`` blocks of multi-head self-attention -> add &
instance norm -> feed-forward (or MoE of MLP experts at position ``Enc<i>``) -> add & instance norm.

Decoder (one call per decoding step, keys and values precomputed once): the query is
``[embedding of the current node, load, time, length, open]`` (D + 4); multi-head attention over the
feasible nodes, the combining projection (a MoE of linear experts at position ``Dec``; for MVMoE-L a
hierarchical gate choosing between a dense projection and that MoE), then single-head scores
``emb_node . h / sqrt(D)``, clipped by ``C tanh``, masked, and a log-softmax over nodes.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from mvmoe_jax.engines import decoder_attention as decoder_attention_engine, query_tables
from mvmoe_jax.engines.readout import padded_readout_nodes, readout_product, readout_product_given
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.instances import Instance
from mvmoe_jax.nn import locality, moe as moe_lib
from mvmoe_jax.nn.attention import InstanceNorm, multi_head_attention, split_heads
from mvmoe_jax.nn.layers import Dense

MODELS = ("pomo", "pomo_mtl", "mvmoe", "mvmoe_light")
ALL_POSITIONS = ("Raw",) + tuple(f"Enc{i}" for i in range(6)) + ("Dec",)
# Fields that earlier versions kept in the architecture and the execution plan now holds: dropped when read.
EXECUTION_FIELDS = ("moe_dispatch", "fused_readout", "fused_query")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Architecture of one policy. The defaults are the paper's MVMoE/4E."""

    model: str = "mvmoe"
    embedding_dim: int = 128
    num_heads: int = 8
    num_layers: int = 6
    ff_hidden_dim: int = 512
    logit_clipping: float = 10.0
    num_experts: int = 4
    topk: int = 2
    routing_method: str = "input_choice"      # input_choice | expert_choice | soft | random
    routing_level: str = "node"               # node | instance | problem
    expert_loc: tuple[str, ...] = ("Enc0", "Enc1", "Enc2", "Enc3", "Enc4", "Enc5", "Dec")
    capacity_factor: float | None = None      # None: no token is ever dropped (with the plan's sparse or
                                              # einsum MoE execution, tokens past capacity are)
    compute_dtype: str = "float32"            # float32 | bfloat16 (matmul inputs; params stay float32)
    # Distance-aware decoding (nn/locality.py), for instances larger than the training ones; off by default.
    distance_bias: float = 0.0                # alpha: -alpha * log2(n) * d(current, j) added to the logits
    candidates: int = 0                       # k: the choice among the k nearest feasible customers (0: all)
    # The bias's alpha a trained parameter (``distance_bias_alpha``) starting at ``distance_bias``, not a constant.
    learned_distance_bias: bool = False

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; expected one of {MODELS}")
        if self.embedding_dim % self.num_heads:
            raise ValueError(f"embedding_dim {self.embedding_dim} not divisible by num_heads {self.num_heads}")
        bad = [p for p in self.expert_loc if p not in ALL_POSITIONS[:1] + tuple(
            f"Enc{i}" for i in range(self.num_layers)) + ("Dec",)]
        if bad:
            raise ValueError(f"unknown MoE positions {bad}; expected Raw, Enc0..Enc{self.num_layers - 1}, Dec")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if not (isinstance(self.distance_bias, numbers.Real) and 0 <= self.distance_bias < float("inf")):
            raise ValueError(f"distance_bias must be a number >= 0, got {self.distance_bias!r}")
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or self.candidates < 0:
            raise ValueError(f"candidates must be a whole number of nodes >= 0 (0: all), got {self.candidates!r}")
        if not isinstance(self.learned_distance_bias, bool):
            raise ValueError(f"learned_distance_bias must be True or False, got {self.learned_distance_bias!r}")

    @property
    def biases_distance(self) -> bool:
        """Whether decoding adds the distance bias: a constant alpha > 0, or a learned one."""
        return bool(self.distance_bias) or self.learned_distance_bias

    @property
    def uses_locations(self) -> bool:
        """Whether decoding reads the node coordinates (the distance bias or ``candidates`` on): the decoder
        cache then holds them (``Policy.precompute(..., locs=...)``)."""
        return self.biases_distance or bool(self.candidates)

    @property
    def uses_moe(self) -> bool:
        return self.model in ("mvmoe", "mvmoe_light") and self.num_experts > 1

    @property
    def hierarchical(self) -> bool:
        return self.model == "mvmoe_light" and self.moe_at("Dec")

    def moe_at(self, position: str) -> bool:
        return self.uses_moe and position in self.expert_loc

    @property
    def readout_map_counts(self) -> tuple[int, ...]:
        """The combining projection's linear maps, counted per group that a decoding step applies
        together (``Policy._map_groups``): (1,) the dense map; (E,) a decoder MoE's experts; (1, E)
        MVMoE-L's dense map and its experts, the two branches of its gate."""
        if self.hierarchical:
            return (1, self.num_experts)
        return (self.num_experts,) if self.moe_at("Dec") else (1,)

    @property
    def dtype(self):
        return jnp.bfloat16 if self.compute_dtype == "bfloat16" else jnp.float32

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["expert_loc"] = list(self.expert_loc)
        return d

    @classmethod
    def from_dict(cls, d) -> "PolicyConfig":
        d = {k: v for k, v in dict(d).items() if k not in EXECUTION_FIELDS}
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown policy config fields: {sorted(unknown)}")
        if "expert_loc" in d:
            d["expert_loc"] = tuple(d["expert_loc"])
        return cls(**d)


def distance_bias_of(cfg: PolicyConfig, params) -> float:
    """The alpha that a policy of ``cfg`` with ``params`` ({"params": ...}) decodes with: its learned parameter
    (``learned_distance_bias``) or the config's constant."""
    if cfg.learned_distance_bias:
        return float(params["params"]["distance_bias_alpha"])
    return float(cfg.distance_bias)


def refuse_fixed_bias_on_learned(cfg: PolicyConfig, distance_bias: float | None) -> None:
    """A ValueError where a constant distance bias is asked of a model that learned its own."""
    if cfg.learned_distance_bias and distance_bias is not None:
        raise ValueError(f"this model learned its distance bias; a given distance_bias ({distance_bias:g}) applies "
                         "only to models without one")


def fuses_readout(cfg: PolicyConfig, plan: ExecutionPlan) -> bool:
    """Whether the plan's readout fusion applies to ``cfg``: to a dense combining projection, or a MoE of
    linear experts whose gates are per token (node-level input choice or random routing). Token dropping (a
    capacity factor with sparse or einsum execution) is not reproduced by it."""
    if not plan.fused_readout:
        return False
    return not cfg.moe_at("Dec") or (cfg.routing_level == "node" and cfg.routing_method in ("input_choice", "random")
                                     and (cfg.capacity_factor is None
                                          or plan.moe_dispatch in ("dense", "grouped_mlp", "grouped")))


def decoder_record_floats(cfg: PolicyConfig, plan: ExecutionPlan, num_nodes: int) -> int:
    """float32 values per trajectory in one step's ``DecoderRecord``: H x N attention weights, the D-wide
    attention output and the widest group's padded per-map readout scores."""
    multiple = plan.readout_column_multiple
    width = max(m * padded_readout_nodes(num_nodes, (m,), multiple) for m in cfg.readout_map_counts)
    return cfg.num_heads * num_nodes + cfg.embedding_dim + width


@struct.dataclass
class DecoderCache:
    """Per-instance decoder inputs computed once per rollout.

    embeddings: (B, N, D) node embeddings (also the single-head keys).
    keys, values: (B, H, N, D/H) multi-head keys and values.
    readout: the node embeddings pulled through the linear maps of the decoder's combining projection, so
      that a step's scores are ``sum_m mix_m (attn @ readout[m] + readout_bias[m])``: a tuple with one
      (B, D, M_g, N_g) array per group of maps that a step applies together (the dense map; the E
      experts; or MVMoE-L's dense map and its experts as two groups, so that the branch a step draws
      reads its own array rather than a slice copied out of a shared one); readout_bias the matching
      (B, M_g, N_g) arrays. The node axis is zero-padded to N_g >= N (``padded_readout_nodes``); scores
      keep the first N. None without the fusion (the plan's ``fused_readout`` off or not applicable,
      or initialising).
    node_scores: (B, H, N, W) the scaled attention scores of the query part that embeds node i (the
      current node) against every key j; feature_scores (B, H, F, W) those of each dynamic feature (F = 4)
      at value 1. A step's scores are ``node_scores[current] + sum_f dynamic_f feature_scores[f]``.
      None without the query fusion (the plan's ``fused_query`` off, or not requested). W = N, or
      ``engines.query_tables.query_table_width(N, plan)`` where ``precompute`` pads them for forward-only
      decoding (zero columns past N; ``padded_values`` is then set).
    padded_values: (B, H, W, D/H) the values with W - N zero rows appended, read by the forward-only steps
      in place of ``values`` when the tables are padded; None otherwise.
    node_queries: (B, N, D) the query projection's node part, ``embeddings @ Wq[:D]``: the query fusion's
      differentiable form, which training's backward pass asks for (``precompute(..., fuse_query=False)``).
      A step's query is then ``node_queries[current] + dynamic @ Wq[D:]``: a row gather, whose cotangent is
      a row scatter, instead of a (D + F) x D projection per trajectory, its input cotangent and its
      weight cotangent. None without the query fusion. With node_scores too (training's backward pass,
      the tables given without gradient), a step's scores are gathered from the tables and its gradient
      flows through the query and the keys (``attention_with_given_scores``): no per-step query-key product.
    node_score_max: (B, H, N) the largest entry of each node_scores row; feature_score_range (B, H, F, 2) the
      smallest and largest of each feature_scores row. From them a step bounds its largest score from above
      without a pass over its scores (``engines.query_tables.score_bound``). None without node_scores.
    locs: (B, N, 2) the node coordinates, for the distance bias (``PolicyConfig.biases_distance``); None otherwise.
    neighbour_ranks: (B, N, N) each node's neighbours ranked by distance (``nn.locality.neighbour_ranks``),
      for the candidate sets (``PolicyConfig.candidates``); None otherwise.
    attention: how a step attends, one of ``engines.decoder_attention.PATHS``, set where the cache is built:
      "projected" (the reference), "hoisted_query" (node_queries), "score_tables" (forward only, the tables)
      or "given_scores" (the backward pass: scores from the tables, gradient through node_queries).
    """

    embeddings: jax.Array
    keys: jax.Array
    values: jax.Array
    readout: tuple[jax.Array, ...] | None = None
    readout_bias: tuple[jax.Array, ...] | None = None
    node_scores: jax.Array | None = None
    feature_scores: jax.Array | None = None
    node_queries: jax.Array | None = None
    node_score_max: jax.Array | None = None
    feature_score_range: jax.Array | None = None
    padded_values: jax.Array | None = None
    locs: jax.Array | None = None
    neighbour_ranks: jax.Array | None = None
    attention: str = struct.field(pytree_node=False, default="projected")

    def without_query_fusion(self) -> "DecoderCache":
        """This cache without the query fusion's tables (and their bounds and padded values): its steps then
        project their query (``node_queries`` where present, else the plain projection)."""
        return self.replace(node_scores=None, feature_scores=None, node_score_max=None, feature_score_range=None,
                            padded_values=None,
                            attention="projected" if self.node_queries is None else "hoisted_query")

    def with_given_scores(self, node_scores: jax.Array, feature_scores: jax.Array) -> "DecoderCache":
        """This cache (with ``node_queries``) given the query fusion's N-wide score tables, which the backward
        pass's steps gather their scores from while the gradient flows through the hoisted query."""
        if self.node_queries is None:
            raise ValueError("given scores need the hoisted query projection (precompute(..., fuse_query=False))")
        return self.replace(node_scores=node_scores, feature_scores=feature_scores, attention="given_scores")


@struct.dataclass
class DecoderRecord:
    """What a decoding step computed that its backward pass needs again, recorded by the sampling pass so
    that training's backward pass does not recompute it (``Policy.decode(..., keep_record=True)``, then
    ``given=``; see ``engines.stepwise_backward.stepwise_gradients``).

    attention_weights: the softmax weights of the multi-head attention, float32, (B, H, N, P) or (B, H, P, N)
      as records keep them (``engines.attention.kept_layout``).
    attention: (B, P, D) its output, the combining projection's input.
    readout_scores: (B, P, X) the fused readout's per-map scores ``attn @ readout[m]`` of the group of maps
      the step applied, flattened (M_g * N_g) and zero-padded to the widest group's X (MVMoE-L's steps
      apply either group).
    """

    attention_weights: jax.Array
    attention: jax.Array
    readout_scores: jax.Array


def node_features(inst: Instance) -> tuple[jax.Array, jax.Array]:
    """Static features: depot (B, 1, 2) = (x, y); customers (B, n, 5) = (x, y, d, e, l)."""
    depot = inst.locs[..., :1, :]
    cust = jnp.concatenate([inst.locs[..., 1:, :], inst.demand[..., 1:, None],
                            inst.tw_start[..., 1:, None], inst.tw_end[..., 1:, None]], axis=-1)
    return depot, cust


class FeedForward(nn.Module):
    hidden_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(Dense(self.hidden_dim, dtype=self.dtype, name="W1")(x))
        return Dense(x.shape[-1], dtype=self.dtype, name="W2")(h)


def _moe(cfg: PolicyConfig, plan: ExecutionPlan, output_dim: int, expert_type: str, name: str,
         hidden_dim: int | None = None):
    return moe_lib.MoE(num_experts=cfg.num_experts, k=cfg.topk, output_dim=output_dim,
                       hidden_dim=hidden_dim, expert_type=expert_type, routing=cfg.routing_method,
                       level=cfg.routing_level, capacity_factor=cfg.capacity_factor, dtype=cfg.dtype, name=name,
                       **moe_execution(plan))


def moe_execution(plan: ExecutionPlan) -> dict:
    """The MoE layers' execution attributes from the plan."""
    return dict(dispatch=plan.moe_dispatch, grouped_min_assignments=plan.grouped_min_assignments,
                grouped_by_expert=plan.grouped_by_expert, sort_groups=plan.moe_sort_groups,
                blocks_as_one_product=plan.grouped_blocks_as_one_product, gates_by_rank=plan.gates_by_rank)


class EncoderLayer(nn.Module):
    cfg: PolicyConfig
    plan: ExecutionPlan
    index: int

    @nn.compact
    def __call__(self, x, train: bool):
        cfg = self.cfg
        h = cfg.num_heads
        q = split_heads(Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype, name="Wq")(x), h)
        k = split_heads(Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype, name="Wk")(x), h)
        v = split_heads(Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype, name="Wv")(x), h)
        # Training mode keeps the differentiable form in every pass, the sampling pass included: its backward
        # pass recomputes the encoder and must find what the sampling pass found.
        attn = Dense(cfg.embedding_dim, dtype=cfg.dtype, name="multi_head_combine")(
            multi_head_attention(q, k, v, plan=self.plan, differentiable=train))
        out1 = InstanceNorm(name="norm1")(x + attn)
        if cfg.moe_at(f"Enc{self.index}"):
            moe = _moe(cfg, self.plan, cfg.embedding_dim, "mlp", "feed_forward", cfg.ff_hidden_dim)
            ff, aux = moe(out1, train=train)
        else:
            ff, aux = FeedForward(cfg.ff_hidden_dim, cfg.dtype, name="feed_forward")(out1), jnp.float32(0.0)
        return InstanceNorm(name="norm2")(out1 + ff), aux


class Policy(nn.Module):
    """Encoder-decoder policy. Use ``encode`` once per batch, ``precompute`` once, ``decode`` per step.

    ``cfg`` is the model (its parameters follow from it); ``plan`` how its computations run
    (``mvmoe_jax.execution``): results do not depend on it, and, as a field of the module, it is part of the
    jit cache key of every function the policy is static in."""

    cfg: PolicyConfig
    plan: ExecutionPlan

    @property
    def fuses_readout(self) -> bool:
        """Whether ``precompute`` folds the combining projection into a readout (``fuses_readout``)."""
        return fuses_readout(self.cfg, self.plan)

    def setup(self):
        cfg = self.cfg
        if cfg.moe_at("Raw"):
            self.embedding_depot = _moe(cfg, self.plan, cfg.embedding_dim, "linear", "embedding_depot")
            self.embedding_node = _moe(cfg, self.plan, cfg.embedding_dim, "linear", "embedding_node")
        else:
            self.embedding_depot = Dense(cfg.embedding_dim, dtype=cfg.dtype)
            self.embedding_node = Dense(cfg.embedding_dim, dtype=cfg.dtype)
        self.layers = [EncoderLayer(cfg, self.plan, i, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.Wq_last = Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype)
        self.Wk = Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype)
        self.Wv = Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype)
        if cfg.hierarchical:
            self.multi_head_combine = moe_lib.DenseOrMoE(
                output_dim=cfg.embedding_dim, num_experts=cfg.num_experts, k=cfg.topk,
                routing=cfg.routing_method, level=cfg.routing_level, capacity_factor=cfg.capacity_factor,
                dispatch=self.plan.moe_dispatch, gates_by_rank=self.plan.gates_by_rank, dtype=cfg.dtype)
        elif cfg.moe_at("Dec"):
            self.multi_head_combine = _moe(cfg, self.plan, cfg.embedding_dim, "linear", "multi_head_combine")
        else:
            self.multi_head_combine = Dense(cfg.embedding_dim, dtype=cfg.dtype)
        if cfg.learned_distance_bias:
            self.distance_bias_alpha = self.param("distance_bias_alpha",
                                                  lambda _: jnp.float32(cfg.distance_bias))

    def __call__(self, inst: Instance, train: bool = False):
        """Initialisation entry point: encode, then one decoding step from the depot."""
        emb, aux = self.encode(inst, train)
        cache = self.precompute(emb, locs=inst.locs)
        b, n1 = emb.shape[:2]
        logp, aux2, _ = self.decode(cache, jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1, 4)),
                                    jnp.ones((b, 1, n1), bool), None, train)
        return logp, aux + aux2

    def _embed(self, module, x, train):
        if self.cfg.moe_at("Raw"):
            return module(x, train=train)
        return module(x), jnp.float32(0.0)

    def encode(self, inst: Instance, train: bool = False) -> tuple[jax.Array, jax.Array]:
        """Instance (batched, B) -> node embeddings (B, n+1, D) and the encoder's MoE auxiliary loss."""
        depot, cust = node_features(inst)
        e_depot, aux_d = self._embed(self.embedding_depot, depot, train)
        e_cust, aux_c = self._embed(self.embedding_node, cust, train)
        x = jnp.concatenate([e_depot, e_cust], axis=-2)
        aux = aux_d + aux_c
        for layer in self.layers:
            x, a = layer(x, train)
            aux = aux + a
        return x, aux

    def precompute(self, embeddings: jax.Array, fuse_query: bool = True, locs: jax.Array | None = None
                   ) -> DecoderCache:
        """Per-rollout decoder inputs: multi-head keys and values, (the readout fusion) the single-head
        scores' keys pushed through the combining projection's linear maps, and (the query fusion, when
        ``fuse_query`` and ``cfg.fused_query``) the attention scores of every possible query. ``locs``
        (B, N, 2): the instances' coordinates, kept where the config's decoding options read distances
        (``PolicyConfig.uses_locations``; required then).

        Why the fusion: a step's scores are ``(sum_m mix_m (attn @ W_m + b_m)) . emb_n``; computing
        ``W_m @ emb_n`` once per rollout turns the per-step (D x D per map, then D x N) work into D x N per
        map, about 2.8x fewer FLOPs for MVMoE's 4 experts and 3.5x for a dense projection, and one
        instance-batched matmul instead of three contractions. Results agree to float32 rounding.

        Why the query fusion: a step's query is ``[emb_current, dynamic] @ Wq``, linear in its parts, and
        the current node is one of N. Scoring every node's embedding part against the keys once per
        rollout (N x N per head) leaves a step a row gather and four multiply-adds instead of the query
        projection and the per-head products (see docs/performance.md, "Fused readout and query").
        Training's backward pass asks for ``fuse_query=False``: the cotangent of that gather would be a
        scatter into the (B, H, N, N) table at every step, far slower, so there only the projection of the
        node part is hoisted (``DecoderCache.node_queries``), whose gather's cotangent is a scatter of D-wide
        rows; ``stepwise_gradients`` adds the tables without gradient, to gather the scores from (see
        ``DecoderCache``).
        """
        cfg = self.cfg
        h = cfg.num_heads
        if cfg.uses_locations and locs is None:
            raise ValueError("distance_bias and candidates read the node coordinates: "
                             "precompute(..., locs=instances.locs)")
        cache = DecoderCache(embeddings=embeddings, keys=split_heads(self.Wk(embeddings), h),
                             values=split_heads(self.Wv(embeddings), h),
                             locs=locs if cfg.biases_distance else None,
                             neighbour_ranks=locality.neighbour_ranks(locs) if cfg.candidates else None)
        if self.is_initializing():
            return cache        # initialisation goes through the plain path, which creates the params
        if self.plan.fused_query:
            cache = self.with_query_scores(cache, padded=True) if fuse_query else self.with_node_queries(cache)
        if not fuses_readout(cfg, self.plan):
            return cache
        emb = embeddings.astype(cfg.dtype)
        n = embeddings.shape[-2]
        readouts, readout_biases = [], []
        for maps, biases in self._map_groups():                                          # (M_g, D, D), (M_g, D)
            readout = jnp.einsum("mdo,bno->bdmn", maps.astype(cfg.dtype), emb, preferred_element_type=jnp.float32)
            bias = jnp.einsum("mo,bno->bmn", biases.astype(cfg.dtype), emb, preferred_element_type=jnp.float32)
            pad = padded_readout_nodes(n, (maps.shape[0],), self.plan.readout_column_multiple) - n
            readouts.append(jnp.pad(readout, ((0, 0), (0, 0), (0, 0), (0, pad))))
            readout_biases.append(jnp.pad(bias, ((0, 0), (0, 0), (0, pad))))
        return cache.replace(readout=tuple(readouts), readout_bias=tuple(readout_biases))

    def with_query_scores(self, cache: DecoderCache, padded: bool = False) -> DecoderCache:
        """``cache`` with the query fusion's score tables (``engines.query_tables.with_score_tables``) added to a
        cache that ``precompute(..., fuse_query=False)`` made. ``padded``: the tables widened for forward-only
        decoding (training's passes take them N wide)."""
        return query_tables.with_score_tables(cache, self.query_kernel(), self.cfg.num_heads, self.cfg.dtype,
                                              self.plan if padded else None)

    def query_kernel(self) -> jax.Array:
        """The query projection's (D + F, D) kernel in the compute dtype: the node embedding's rows, then the
        dynamic features'."""
        return self.Wq_last.variables["params"]["kernel"].astype(self.cfg.dtype)

    def with_node_queries(self, cache: DecoderCache) -> DecoderCache:
        """``cache`` with node_queries (see DecoderCache): the query projection's node part, once per
        rollout."""
        cfg = self.cfg
        node_queries = jnp.matmul(cache.embeddings.astype(cfg.dtype), self.query_kernel()[:cfg.embedding_dim],
                                  preferred_element_type=jnp.float32)
        return cache.replace(node_queries=node_queries, attention="hoisted_query")

    def _map_groups(self) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """The combining projection's linear maps (M_g, D, D) and biases (M_g, D), one pair per group of
        maps that a step applies together: the dense map; the E experts; or MVMoE-L's dense map and its
        experts (the two branches of its gate): ``cfg.readout_map_counts`` in that order."""
        params = self.multi_head_combine.variables["params"]
        if self.cfg.hierarchical:
            dense, moe = params["multi_head_combine_dense"], params["multi_head_combine_moe"]
            groups = (dense["kernel"][None], dense["bias"][None]), (moe["experts_w"], moe["experts_b"])
        elif self.cfg.moe_at("Dec"):
            groups = ((params["experts_w"], params["experts_b"]),)
        else:
            groups = ((params["kernel"][None], params["bias"][None]),)
        assert tuple(maps.shape[0] for maps, _ in groups) == self.cfg.readout_map_counts
        return groups

    def decode(self, cache: DecoderCache, current: jax.Array, dynamic: jax.Array, mask: jax.Array,
               gate_probs: jax.Array | None = None, train: bool = False, normalise: bool = True,
               keep_record: bool = False, given: DecoderRecord | None = None,
               gating_noise: jax.Array | None = None):
        """One decoding step for every (instance, start).

        current int (B, P); dynamic (B, P, 4) = (load, time, length, open); mask bool (B, P, N).
        gate_probs: MVMoE-L's dense-or-sparse probabilities (2,), None at the first decoding step
        (they are computed there, from the batch mean, and reused for the whole rollout).
        Returns log-probabilities (B, P, N) (-inf where masked), the MoE auxiliary loss, gate_probs. The
        config's distance bias (constant or learned) and ``candidates`` (``nn.locality``) act on the clipped
        logits and on the mask of the choice (the attention reads ``mask`` as given).
        ``normalise=False`` returns the clipped logits instead of their log-softmax (same argmax, same
        -inf): all that greedy decoding needs when the log-likelihood is not wanted.

        ``keep_record=True`` (forward only) also returns the step's ``DecoderRecord``; ``given``: that
        record, from a pass over the same inputs, whose attention and readout products this call takes
        instead of computing them (differentiable: their backward passes are the products'). Both need the
        readout fusion (``DecoderCache.readout``). ``gating_noise``: the decoder MoE's (B x P, E) gating noise
        in training (``decoder_gating_noise``), instead of drawing it (not for MVMoE-L).
        """
        cfg = self.cfg
        if gating_noise is not None and not (cfg.moe_at("Dec") and not cfg.hierarchical):
            raise ValueError(f"gating_noise is for a decoder MoE without MVMoE-L's gate; {cfg.model} has none")
        if (keep_record or given is not None) and cache.readout is None:
            raise ValueError("a decoder record needs the readout fusion (policy.fuses_readout)")
        attn, weights = self._decoder_attention(cache, current, dynamic, mask, keep_record, given)  # (B, P, D)
        readout_scores = None
        if cache.readout is not None:
            score, aux, gate_probs, readout_scores = self._fused_scores(cache, attn, train, gate_probs,
                                                                        keep_record, given, gating_noise)
        else:
            score, aux, gate_probs = self._scores(cache, attn, train, gate_probs, gating_noise)
        score = cfg.logit_clipping * jnp.tanh(score / jnp.sqrt(jnp.float32(cfg.embedding_dim)))
        if cfg.biases_distance:
            alpha = self.distance_bias_alpha if cfg.learned_distance_bias else cfg.distance_bias
            score = score + locality.distance_bias(locality.current_distances(cache.locs, current), alpha)
        if cfg.candidates:
            mask = locality.candidate_mask(mask, locality.current_ranks(cache.neighbour_ranks, current),
                                           cfg.candidates)
        score = jnp.where(mask, score, -jnp.inf)
        logp = jax.nn.log_softmax(score, axis=-1) if normalise else score
        if keep_record:
            return logp, aux, gate_probs, DecoderRecord(weights, attn, readout_scores)
        return logp, aux, gate_probs

    def _scores(self, cache: DecoderCache, attn: jax.Array, train: bool, gate_probs, gating_noise=None):
        """Unclipped single-head scores (B, P, N): the combining projection, then dot products."""
        cfg = self.cfg
        emb = cache.embeddings
        aux = jnp.float32(0.0)
        if cfg.hierarchical:
            out, aux, gate_probs = self.multi_head_combine(attn, train, gate_probs)
        elif cfg.moe_at("Dec"):
            out, aux = self.multi_head_combine(attn, train=train, noise=gating_noise)
        else:
            out = self.multi_head_combine(attn)
        score = jnp.einsum("bpd,bnd->bpn", out.astype(cfg.dtype), emb.astype(cfg.dtype),
                           preferred_element_type=jnp.float32)
        return score, aux, gate_probs

    def _fused_scores(self, cache: DecoderCache, attn: jax.Array, train: bool, gate_probs,
                      keep_record: bool = False, given: DecoderRecord | None = None, gating_noise=None):
        """The same scores as ``_scores`` from the precomputed readout (see ``precompute``), and (with
        ``keep_record``, else None) the per-map scores of the record (see ``DecoderRecord``)."""
        cfg = self.cfg
        x = attn.astype(cfg.dtype)
        num_nodes = cache.embeddings.shape[-2]
        width = max(r.shape[2] * r.shape[3] for r in cache.readout)

        def mixed(weights, group):
            """sum over the group's maps m of weights[..., m] (x @ readout[m] + bias[m]); one map: plain."""
            readout, bias = cache.readout[group], cache.readout_bias[group]
            b, d, m, n = readout.shape
            flat = readout.reshape(b, d, m * n).astype(cfg.dtype)
            if given is not None:
                flat_scores = readout_product_given(x, flat, given.readout_scores[..., :m * n])
            else:
                flat_scores = readout_product(x, flat)
            per_map = flat_scores.reshape(x.shape[:2] + (m, n))
            if weights is None:
                score = per_map[:, :, 0] + bias[:, None, 0]
            elif self.plan.mix_maps_elementwise and not train:
                # Written out, XLA:CPU computes the mix, the padding cut, the clipping and the mask in one loop,
                # where the product left a bias pass, a small dot and the clipping's loop (docs/performance.md,
                # "Readout mix written out"). Not bitwise the product's sums; the same tours.
                w = weights.astype(jnp.float32)
                score = sum(w[..., j, None] * (per_map[:, :, j] + bias[:, None, j]) for j in range(m))
            else:
                score = jnp.einsum("bpm,bpmn->bpn", weights.astype(jnp.float32), per_map + bias[:, None])
            kept = jnp.pad(flat_scores, ((0, 0), (0, 0), (0, width - m * n))) if keep_record else None
            return score[..., :num_nodes], kept          # the readout's padding columns dropped

        if cfg.hierarchical:
            choice, scale, gates, aux, gate_probs = self.multi_head_combine(attn, train, gate_probs,
                                                                            gates_only=True)
            # Only the drawn branch's maps are applied (the point of MVMoE-L): group 0 dense, group 1 MoE.
            score, kept = jax.lax.cond(choice == 1, lambda: mixed(gates, 1), lambda: mixed(None, 0))
            return score * scale, aux, gate_probs, kept
        if cfg.moe_at("Dec"):
            gates, aux = self.multi_head_combine(attn, train=train, gates_only=True, noise=gating_noise)
            score, kept = mixed(gates, 0)
            return score, aux, gate_probs, kept
        score, kept = mixed(None, 0)
        return score, jnp.float32(0.0), gate_probs, kept

    def decoder_attention(self, cache: DecoderCache, current: jax.Array, dynamic: jax.Array,
                          mask: jax.Array) -> jax.Array:
        """The decoder's multi-head attention output (B, P, D), before the combining projection, on the path
        the cache names (``DecoderCache.attention``)."""
        return self._decoder_attention(cache, current, dynamic, mask)[0]

    def _decoder_attention(self, cache: DecoderCache, current: jax.Array, dynamic: jax.Array, mask: jax.Array,
                           keep_weights: bool = False, given: DecoderRecord | None = None):
        """``decoder_attention`` and (``keep_weights``, forward only; else None) its softmax weights. With
        ``given`` the output and weights are the record's, and only the query is computed, for the
        backward pass. The reference path is ``projected_attention``; the others are
        ``engines.decoder_attention``'s."""
        if cache.attention == "projected" and not keep_weights and given is None:
            return self.projected_attention(cache, current, dynamic, mask), None
        return decoder_attention_engine.attend(self, cache, current, dynamic, mask, keep_weights, given)

    def projected_query(self, embeddings: jax.Array, current: jax.Array, dynamic: jax.Array) -> jax.Array:
        """(B, P, D) a step's query: the projection of ``[embedding of the current node, dynamic features]``.
        embeddings (B, N, D); current int (B, P); dynamic (B, P, F)."""
        last = jnp.take_along_axis(embeddings, current[..., None].astype(jnp.int32), axis=1)      # (B, P, D)
        return self.Wq_last(jnp.concatenate([last, dynamic.astype(embeddings.dtype)], axis=-1))

    def projected_attention(self, cache: DecoderCache, current: jax.Array, dynamic: jax.Array,
                            mask: jax.Array) -> jax.Array:
        """The reference decoder attention (B, P, D): the projected query attends over the feasible nodes'
        keys and values (``mask`` (B, P, N), True = feasible)."""
        q = split_heads(self.projected_query(cache.embeddings, current, dynamic), self.cfg.num_heads)
        return multi_head_attention(q, cache.keys, cache.values, mask, plan=self.plan)

    def decoder_gating_noise(self, num_units: int) -> jax.Array:
        """(num_units, E): the gating noise that a training-mode ``decode`` of ``num_units`` (instance, start)
        pairs draws from the same 'gating' key, for the decoder MoE of MVMoE/4E (see ``decode``)."""
        if not self.cfg.moe_at("Dec") or self.cfg.hierarchical:
            raise ValueError(f"{self.cfg.model} has no decoder MoE outside MVMoE-L's gate")
        return self.multi_head_combine.gating_noise(num_units)

    def hierarchical_gate_probs(self, pooled: jax.Array) -> jax.Array:
        """MVMoE-L's dense-or-MoE probabilities (2,) from the first step's attention output pooled over
        the whole batch (D,); lets a batch decoded in chunks use the probabilities of the full batch."""
        if not self.cfg.hierarchical:
            raise ValueError(f"{self.cfg.model} has no hierarchical gate")
        return self.multi_head_combine.dense_or_moe(pooled=pooled)
