"""Checkpoints: orbax save / restore of parameters with their config, and import of the original
PyTorch ``.pt`` checkpoints (POMO-MTL, MVMoE, MVMoE-L) without importing torch.

An orbax checkpoint is a ``CheckpointManager`` directory: ``<dir>/<step>/{params, config}``; training
workdirs add optimiser state and the PRNG state to the same steps, so ``restore_policy(workdir)`` reads the
latest step of a training run as well as an exported model.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from mvmoe_jax import execution, shipped
from mvmoe_jax.io.torch_checkpoint import load_torch_checkpoint
from mvmoe_jax.nn import moe as moe_lib
from mvmoe_jax.nn.policy import Policy, PolicyConfig


class CheckpointMismatchError(ValueError):
    """The checkpoint's parameters do not fit the requested model configuration."""


# ----------------------------------------------------------------------------------------------------
# Parameter shapes and comparison
# ----------------------------------------------------------------------------------------------------

def abstract_params(cfg: PolicyConfig, num_customers: int = 20) -> Any:
    """ShapeDtypeStructs of the parameters of a ``Policy`` of ``cfg`` (no computation; the parameters do not
    depend on the execution plan)."""
    from mvmoe_jax.instances import generate

    policy = Policy(cfg, execution.reference())
    def init():
        inst = generate(jax.random.key(0), 1, num_customers, "CVRP")
        return policy.init({"params": jax.random.key(0), "gating": jax.random.key(1)}, inst)

    shapes = jax.eval_shape(init)
    return shapes["params"]


def _flat(tree) -> dict[str, Any]:
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


def check_params_fit(params, cfg: PolicyConfig, source: str) -> None:
    """Raise CheckpointMismatchError naming every missing, unexpected or mis-shaped parameter."""
    want = _flat(abstract_params(cfg))
    got = _flat(params)
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    shape = [f"{k}: checkpoint {tuple(np.shape(got[k]))}, model {tuple(want[k].shape)}"
             for k in sorted(set(want) & set(got)) if tuple(np.shape(got[k])) != tuple(want[k].shape)]
    if missing or extra or shape:
        lines = [f"{source} does not fit model {cfg.model!r} ({_describe(cfg)}):"]
        if missing:
            lines.append(f"  missing parameters ({len(missing)}): {', '.join(missing[:6])}"
                         + (" ..." if len(missing) > 6 else ""))
        if extra:
            lines.append(f"  unexpected parameters ({len(extra)}): {', '.join(extra[:6])}"
                         + (" ..." if len(extra) > 6 else ""))
        if shape:
            lines.append("  shape mismatches: " + "; ".join(shape[:6]) + (" ..." if len(shape) > 6 else ""))
        raise CheckpointMismatchError("\n".join(lines))


def _describe(cfg: PolicyConfig) -> str:
    s = f"D={cfg.embedding_dim}, layers={cfg.num_layers}, heads={cfg.num_heads}, FFN={cfg.ff_hidden_dim}"
    if cfg.uses_moe:
        s += f", {cfg.num_experts} experts top-{cfg.topk} at {','.join(cfg.expert_loc)}"
    return s


# ----------------------------------------------------------------------------------------------------
# Import of the original PyTorch checkpoints
# ----------------------------------------------------------------------------------------------------

def _linear(state, name: str, bias: bool = True) -> dict:
    out = {"kernel": np.asarray(state[f"{name}.weight"]).T}
    if bias:
        out["bias"] = np.asarray(state[f"{name}.bias"])
    return out


def infer_torch_config(state: dict[str, np.ndarray]) -> PolicyConfig:
    """Read the architecture off a reference state dict's names and shapes."""
    for key in ("decoder.Wq_last.weight", "decoder.Wk.weight"):
        if key not in state:
            raise CheckpointMismatchError(f"not an MVMoE/POMO-MTL state dict: {key} is missing")
    emb = state["decoder.Wk.weight"].shape[0]
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r"encoder\.layers\.(\d+)\.", k))})
    positions = [f"Enc{i}" for i in layers if f"encoder.layers.{i}.feedForward.w_gate" in state]
    if "encoder.embedding_depot.w_gate" in state:
        positions.insert(0, "Raw")
    light = "decoder.dense_or_moe.weight" in state
    if light or "decoder.multi_head_combine.w_gate" in state:
        positions.append("Dec")
    gate = next((state[k] for k in state if k.endswith("w_gate")), None)
    hidden = state.get("encoder.layers.0.feedForward.W1.weight",
                       state.get("encoder.layers.0.feedForward.experts.0.fc1.weight"))
    if hidden is None:
        raise CheckpointMismatchError("not an MVMoE/POMO-MTL state dict: the first encoder layer has no "
                                      "feed-forward weight (feedForward.W1 or feedForward.experts.0.fc1)")
    model = "mvmoe_light" if light else ("mvmoe" if positions else "pomo_mtl")
    kwargs = dict(model=model, embedding_dim=emb, num_layers=len(layers), ff_hidden_dim=hidden.shape[0])
    if positions:
        kwargs.update(num_experts=gate.shape[1], expert_loc=tuple(positions))
    else:   # a dense model ignores MoE positions; keep the default's that exist at this depth
        kwargs["expert_loc"] = tuple(p for p in PolicyConfig.expert_loc if p == "Dec" or int(p[3:]) < len(layers))
    return PolicyConfig(**kwargs)


def _check_state(state: dict, path) -> None:
    """A CheckpointMismatchError naming ``path`` and the entry when the state dict holds anything but named
    real-valued tensors (torch saves every parameter and buffer as one), or NaN or infinite values."""
    for name, value in state.items():
        if not isinstance(name, str):
            raise CheckpointMismatchError(f"{path}: the state dict has an entry named {name!r}, not a parameter name")
        if not isinstance(value, np.ndarray):
            raise CheckpointMismatchError(f"{path}: state dict entry {name!r} is a {type(value).__name__}, not a "
                                          "tensor")
        floating = value.dtype.kind == "f" or value.dtype.name == "bfloat16"   # ml_dtypes' bfloat16: kind "V"
        if not (floating or value.dtype.kind in "iu"):
            raise CheckpointMismatchError(f"{path}: state dict entry {name!r} is a tensor of {value.dtype}, not of "
                                          "real numbers")
        if floating and not np.all(np.isfinite(value)):
            raise CheckpointMismatchError(f"{path}: state dict entry {name!r} holds non-finite values (NaN or "
                                          "infinity)")


def torch_state_to_params(state: dict[str, np.ndarray], cfg: PolicyConfig) -> dict:
    """Map a reference state dict onto the Flax parameter tree of ``Policy(cfg)``."""
    p: dict[str, Any] = {}
    try:
        for name in ("embedding_depot", "embedding_node"):
            if cfg.moe_at("Raw"):
                p[name] = moe_lib.torch_to_flax_moe(state, f"encoder.{name}", cfg.num_experts, "linear")
            else:
                p[name] = _linear(state, f"encoder.{name}")
        for i in range(cfg.num_layers):
            t = f"encoder.layers.{i}"
            layer = {w: _linear(state, f"{t}.{w}", bias=False) for w in ("Wq", "Wk", "Wv")}
            layer["multi_head_combine"] = _linear(state, f"{t}.multi_head_combine")
            for j in (1, 2):
                layer[f"norm{j}"] = {"scale": np.asarray(state[f"{t}.addAndNormalization{j}.norm.weight"]),
                                     "bias": np.asarray(state[f"{t}.addAndNormalization{j}.norm.bias"])}
            if cfg.moe_at(f"Enc{i}"):
                layer["feed_forward"] = moe_lib.torch_to_flax_moe(state, f"{t}.feedForward", cfg.num_experts,
                                                                  "mlp")
            else:
                layer["feed_forward"] = {w: _linear(state, f"{t}.feedForward.{w}") for w in ("W1", "W2")}
            p[f"layers_{i}"] = layer
        for w in ("Wq_last", "Wk", "Wv"):
            p[w] = _linear(state, f"decoder.{w}", bias=False)
        if cfg.hierarchical:
            p["multi_head_combine"] = moe_lib.torch_to_flax_dense_or_moe(state, "decoder", cfg.num_experts)
        elif cfg.moe_at("Dec"):
            p["multi_head_combine"] = moe_lib.torch_to_flax_moe(state, "decoder.multi_head_combine",
                                                                cfg.num_experts, "linear")
        else:
            p["multi_head_combine"] = _linear(state, "decoder.multi_head_combine")
    except KeyError as e:
        raise CheckpointMismatchError(
            f"the checkpoint has no parameter {e.args[0]!r}, which model {cfg.model!r} needs") from None
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)


def import_torch_checkpoint(path: str | os.PathLike, cfg: PolicyConfig | None = None
                            ) -> tuple[PolicyConfig, dict]:
    """Load an original ``.pt`` checkpoint into (config, params). With ``cfg`` given, the checkpoint
    must fit it exactly (a clear CheckpointMismatchError otherwise); without, it is read off the file."""
    blob = load_torch_checkpoint(path)
    state = blob.get("model_state_dict", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict) or not state:
        raise CheckpointMismatchError(f"{path}: no model_state_dict in this checkpoint")
    _check_state(state, path)
    try:
        found = infer_torch_config(state)
    except CheckpointMismatchError as e:
        raise CheckpointMismatchError(f"{path}: {e}") from None
    except (KeyError, AttributeError, IndexError, ValueError) as e:   # a tensor missing, or of another rank
        raise CheckpointMismatchError(f"{path}: not an MVMoE/POMO-MTL state dict: cannot read its architecture "
                                      f"({type(e).__name__}: {e})") from None
    if cfg is None:
        cfg = found
    elif cfg.model != found.model or cfg.uses_moe != found.uses_moe:
        raise CheckpointMismatchError(
            f"{path} holds a {found.model!r} model ({_describe(found)}), but the config asks for "
            f"{cfg.model!r} ({_describe(cfg)})")
    else:
        fields = ["embedding_dim", "num_layers", "ff_hidden_dim"]
        fields += ["num_experts", "expert_loc"] if cfg.uses_moe else []
        diff = [f"{f}: checkpoint {getattr(found, f)}, config {getattr(cfg, f)}" for f in fields
                if getattr(found, f) != getattr(cfg, f)]
        if diff:
            raise CheckpointMismatchError(f"{path} does not fit the config: " + "; ".join(diff))
    try:
        params = {"params": torch_state_to_params(state, cfg)}
    except CheckpointMismatchError as e:
        raise CheckpointMismatchError(f"{path}: {e}") from None
    except (IndexError, ValueError) as e:       # tensors of shapes that cannot be stacked or transposed
        raise CheckpointMismatchError(f"{path} does not fit model {cfg.model!r}: {e}") from None
    check_params_fit(params["params"], cfg, os.fspath(path))
    return cfg, params


# ----------------------------------------------------------------------------------------------------
# orbax
# ----------------------------------------------------------------------------------------------------

def save_policy(directory: str | os.PathLike, params, cfg: PolicyConfig, step: int = 0) -> str:
    """Save ``params`` (the {'params': ...} collection) and ``cfg`` as an orbax checkpoint at ``step``."""
    directory = os.path.abspath(os.fspath(directory))
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                config=ocp.args.JsonSave(cfg.to_dict())), force=True)
        mngr.wait_until_finished()
    return directory


def restore_policy(directory: str | os.PathLike, cfg: PolicyConfig | None = None, step: int | None = None
                   ) -> tuple[PolicyConfig, dict]:
    """Restore (config, params) from an orbax checkpoint directory (its latest step by default).

    With ``cfg`` given, the stored parameters must fit it; otherwise the stored config is used.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoint directory at {directory}")
    # Handlers named up front so that the stored array metadata can be read (see _single_device_target).
    # A training checkpoint also holds the optimiser state and run metadata: their handlers are named too, so
    # that orbax does not warn about items it cannot restore (they are not read).
    handlers = {"params": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler(),
                "opt_state": ocp.StandardCheckpointHandler(), "train_meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory, item_handlers=handlers) as mngr:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{directory} holds no checkpoint steps")
        stored = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        stored_cfg = PolicyConfig.from_dict(stored)
        use = stored_cfg if cfg is None else cfg
        if cfg is not None and (cfg.model != stored_cfg.model or cfg.uses_moe != stored_cfg.uses_moe):
            raise CheckpointMismatchError(
                f"{directory} holds a {stored_cfg.model!r} model ({_describe(stored_cfg)}), but the config "
                f"asks for {cfg.model!r} ({_describe(cfg)})")
        target = _single_device_target(mngr.item_metadata(step)["params"])
        raw = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]
    check_params_fit(raw["params"], use, directory)
    return use, jax.tree.map(jnp.asarray, raw)


def _single_device_target(metadata) -> Any:
    """The stored parameters' shapes and dtypes, placed on this process's first device: a checkpoint
    written by a run over several devices (a CPU's cores, or GPUs) restores on a machine with any number
    (orbax otherwise restores onto the writer's device topology, and refuses a different one)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    tree = getattr(metadata, "tree", metadata)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), tree)


def load_policy(path: str | os.PathLike, cfg: PolicyConfig | None = None) -> tuple[PolicyConfig, dict]:
    """(config, params) from a shipped model's name (``mvmoe_jax.shipped``), an orbax checkpoint directory,
    a training workdir or an original ``.pt`` file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        ckpt = os.path.join(path, "checkpoints")
        return restore_policy(ckpt if os.path.isdir(ckpt) else path, cfg)
    if not os.path.exists(path):
        if shipped.looks_like_name(path):
            if path in shipped.names():
                return shipped.load(path, cfg)
            raise FileNotFoundError(f"no checkpoint at {path}, and {path!r} is not the name of a shipped model "
                                    f"({shipped.describe_available()})")
        raise FileNotFoundError(f"no checkpoint at {path}")
    return import_torch_checkpoint(path, cfg)


def starting_weights(path: str | os.PathLike, cfg: PolicyConfig) -> dict:
    """The parameters ({"params": ...}) at ``path`` (as ``load_policy``) as the start of training a model of
    ``cfg``. A model that learns its distance bias (``cfg.learned_distance_bias``) may start from weights without
    one: its ``distance_bias_alpha`` then starts at ``cfg.distance_bias``."""
    if not cfg.learned_distance_bias:
        return load_policy(path, cfg)[1]
    source_cfg, params = load_policy(path)
    if not source_cfg.learned_distance_bias:
        params = {"params": {**params["params"], "distance_bias_alpha": jnp.float32(cfg.distance_bias)}}
    check_params_fit(params["params"], cfg, os.fspath(path))
    return params
