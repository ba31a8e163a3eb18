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
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from mvmoe_jax.instances import Instance
from mvmoe_jax.nn import moe as moe_lib
from mvmoe_jax.nn.attention import InstanceNorm, multi_head_attention, split_heads
from mvmoe_jax.nn.layers import Dense

MODELS = ("pomo", "pomo_mtl", "mvmoe", "mvmoe_light")
ALL_POSITIONS = ("Raw",) + tuple(f"Enc{i}" for i in range(6)) + ("Dec",)


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
    moe_dispatch: str = "dense"               # dense (every expert, gate-weighted) | sparse (capacity
                                              # buffers, scatter/gather) | einsum (dispatch/combine tensors)
    capacity_factor: float | None = None      # None: no token is ever dropped
    compute_dtype: str = "float32"            # float32 | bfloat16 (matmul inputs; params stay float32)

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

    @property
    def uses_moe(self) -> bool:
        return self.model in ("mvmoe", "mvmoe_light") and self.num_experts > 1

    @property
    def hierarchical(self) -> bool:
        return self.model == "mvmoe_light" and self.moe_at("Dec")

    def moe_at(self, position: str) -> bool:
        return self.uses_moe and position in self.expert_loc

    @property
    def dtype(self):
        return jnp.bfloat16 if self.compute_dtype == "bfloat16" else jnp.float32

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["expert_loc"] = list(self.expert_loc)
        return d

    @classmethod
    def from_dict(cls, d) -> "PolicyConfig":
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown policy config fields: {sorted(unknown)}")
        if "expert_loc" in d:
            d["expert_loc"] = tuple(d["expert_loc"])
        return cls(**d)


@struct.dataclass
class DecoderCache:
    """Per-instance decoder inputs computed once per rollout.

    embeddings: (B, N, D) node embeddings (also the single-head keys).
    keys, values: (B, H, N, D/H) multi-head keys and values.
    """

    embeddings: jax.Array
    keys: jax.Array
    values: jax.Array


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


def _moe(cfg: PolicyConfig, output_dim: int, expert_type: str, name: str, hidden_dim: int | None = None):
    return moe_lib.MoE(num_experts=cfg.num_experts, k=cfg.topk, output_dim=output_dim,
                       hidden_dim=hidden_dim, expert_type=expert_type, routing=cfg.routing_method,
                       level=cfg.routing_level, dispatch=cfg.moe_dispatch,
                       capacity_factor=cfg.capacity_factor, dtype=cfg.dtype, name=name)


class EncoderLayer(nn.Module):
    cfg: PolicyConfig
    index: int

    @nn.compact
    def __call__(self, x, train: bool):
        cfg = self.cfg
        h = cfg.num_heads
        q = split_heads(Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype, name="Wq")(x), h)
        k = split_heads(Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype, name="Wk")(x), h)
        v = split_heads(Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype, name="Wv")(x), h)
        attn = Dense(cfg.embedding_dim, dtype=cfg.dtype, name="multi_head_combine")(
            multi_head_attention(q, k, v))
        out1 = InstanceNorm(name="norm1")(x + attn)
        if cfg.moe_at(f"Enc{self.index}"):
            ff, aux = _moe(cfg, cfg.embedding_dim, "mlp", "feed_forward", cfg.ff_hidden_dim)(out1, train=train)
        else:
            ff, aux = FeedForward(cfg.ff_hidden_dim, cfg.dtype, name="feed_forward")(out1), jnp.float32(0.0)
        return InstanceNorm(name="norm2")(out1 + ff), aux


class Policy(nn.Module):
    """Encoder-decoder policy. Use ``encode`` once per batch, ``precompute`` once, ``decode`` per step."""

    cfg: PolicyConfig

    def setup(self):
        cfg = self.cfg
        if cfg.moe_at("Raw"):
            self.embedding_depot = _moe(cfg, cfg.embedding_dim, "linear", "embedding_depot")
            self.embedding_node = _moe(cfg, cfg.embedding_dim, "linear", "embedding_node")
        else:
            self.embedding_depot = Dense(cfg.embedding_dim, dtype=cfg.dtype)
            self.embedding_node = Dense(cfg.embedding_dim, dtype=cfg.dtype)
        self.layers = [EncoderLayer(cfg, i, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.Wq_last = Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype)
        self.Wk = Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype)
        self.Wv = Dense(cfg.embedding_dim, use_bias=False, dtype=cfg.dtype)
        if cfg.hierarchical:
            self.multi_head_combine = moe_lib.DenseOrMoE(
                output_dim=cfg.embedding_dim, num_experts=cfg.num_experts, k=cfg.topk,
                routing=cfg.routing_method, level=cfg.routing_level, capacity_factor=cfg.capacity_factor,
                dispatch=cfg.moe_dispatch, dtype=cfg.dtype)
        elif cfg.moe_at("Dec"):
            self.multi_head_combine = _moe(cfg, cfg.embedding_dim, "linear", "multi_head_combine")
        else:
            self.multi_head_combine = Dense(cfg.embedding_dim, dtype=cfg.dtype)

    def __call__(self, inst: Instance, train: bool = False):
        """Initialisation entry point: encode, then one decoding step from the depot."""
        emb, aux = self.encode(inst, train)
        cache = self.precompute(emb)
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

    def precompute(self, embeddings: jax.Array) -> DecoderCache:
        h = self.cfg.num_heads
        return DecoderCache(embeddings=embeddings, keys=split_heads(self.Wk(embeddings), h),
                            values=split_heads(self.Wv(embeddings), h))

    def decode(self, cache: DecoderCache, current: jax.Array, dynamic: jax.Array, mask: jax.Array,
               gate_probs: jax.Array | None = None, train: bool = False):
        """One decoding step for every (instance, start).

        current int (B, P); dynamic (B, P, 4) = (load, time, length, open); mask bool (B, P, N).
        gate_probs: MVMoE-L's dense-or-sparse probabilities (2,), None at the first decoding step
        (they are computed there, from the batch mean, and reused for the whole rollout).
        Returns log-probabilities (B, P, N) (-inf where masked), the MoE auxiliary loss, gate_probs.
        """
        cfg = self.cfg
        emb = cache.embeddings
        last = jnp.take_along_axis(emb, current[..., None].astype(jnp.int32), axis=1)     # (B, P, D)
        query = jnp.concatenate([last, dynamic.astype(emb.dtype)], axis=-1)
        q = split_heads(self.Wq_last(query), cfg.num_heads)
        attn = multi_head_attention(q, cache.keys, cache.values, mask)                    # (B, P, D)
        aux = jnp.float32(0.0)
        if cfg.hierarchical:
            out, aux, gate_probs = self.multi_head_combine(attn, train, gate_probs)
        elif cfg.moe_at("Dec"):
            out, aux = self.multi_head_combine(attn, train=train)
        else:
            out = self.multi_head_combine(attn)
        score = jnp.einsum("bpd,bnd->bpn", out.astype(cfg.dtype), emb.astype(cfg.dtype),
                           preferred_element_type=jnp.float32)
        score = cfg.logit_clipping * jnp.tanh(score / jnp.sqrt(jnp.float32(cfg.embedding_dim)))
        score = jnp.where(mask, score, -jnp.inf)
        return jax.nn.log_softmax(score, axis=-1), aux, gate_probs
