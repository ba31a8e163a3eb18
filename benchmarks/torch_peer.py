"""PyTorch peer: RL4CO 0.7.0's POMO-MTL, MVMoE/4E and MVMoE/4E-L on the same CVRP workloads.

Lets ``benchmarks/throughput.py --torch`` put the JAX numbers next to RL4CO's (PyTorch) on the same
instances. Everything here goes through RL4CO's public API (``MTVRPEnv``, ``POMO``, ``MVMoE_POMO``); torch
and rl4co are imported lazily so this module imports without them (install with ``pip install -e '.[torch]'``).

Inference: randomly initialised weights (seed 0), float32 on CPU, ``torch.inference_mode``, one batch of
all B instances, greedy decoding from all n starts (POMO multistart = n) with x8 dihedral augmentation,
exactly as ``POMO.shared_step`` does for ``phase="test"``. One warm-up run (with RL4CO's solution checker
on), then the best of ``repeats`` timed runs.

Training: full REINFORCE steps with POMO's shared baseline (``model.shared_step(phase="train")``: sampling
from all n starts, no augmentation), then ``loss.backward()`` and Adam (lr 1e-4, weight decay 1e-6) from
``model.configure_optimizers()``; no Lightning ``Trainer``. Each step draws a fresh batch from RL4CO's own
MTVRP generator restricted to CVRP (same distribution as ``mvmoe_jax.instances``: uniform locations,
integer demands 1..9, the same capacities 30/40/50/70 for n = 20/50/100/200).

    python benchmarks/torch_peer.py --model mvmoe --size 50 --batch 64 --mode infer
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import time
import warnings

import numpy as np

import peer_cli  # benchmarks/peer_cli.py (this folder is on sys.path when run or imported)

MODELS = ("pomo_mtl", "mvmoe", "mvmoe_light")
INSTALL_HINT = "PyTorch/RL4CO are not installed: pip install -e '.[torch]'  (needs torch and rl4co==0.7.0)"


def _import_torch():
    """Import torch and the RL4CO pieces used here, or raise an ImportError with the install hint."""
    try:
        import torch
        import rl4co
        from rl4co.envs import MTVRPEnv
        from rl4co.models.zoo.mvmoe import MVMoE_POMO
        from rl4co.models.zoo.pomo import POMO
    except ImportError as e:      # pragma: no cover - depends on the environment
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    # RL4CO logs at INFO/WARNING on every model build ("Features not passed...", "cvrp selected...").
    for name in ("rl4co", "lightning", "pytorch_lightning", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*self.log.*")
    warnings.filterwarnings("ignore", message=".*is an instance of `nn.Module`.*")
    return torch, rl4co, MTVRPEnv, POMO, MVMoE_POMO


def rl4co_available() -> bool:
    """True when torch and rl4co (with its MTVRP env and MVMoE models) import."""
    try:
        _import_torch()
    except ImportError:
        return False
    return True


def _moe_kwargs(light: bool) -> dict:
    """MoE settings of RL4CO's ``MVMoE_POMO`` defaults (4 experts, top-2, noisy gating; ReLU MLP experts in
    every encoder layer's feed-forward, linear experts in the decoder's attention output projection), with the
    decoder's hierarchical gating on (MVMoE-L) or off (MVMoE)."""
    return {
        "encoder": {"hidden_act": "ReLU", "num_experts": 4, "k": 2, "noisy_gating": True},
        "decoder": {"light_version": bool(light), "num_experts": 4, "k": 2, "noisy_gating": True},
    }


def build_model(model: str, num_loc: int, seed: int = 0, check_solution: bool = False):
    """(lightning module, env) for ``model`` on MTVRP restricted to CVRP with ``num_loc`` customers.

    pomo_mtl:    ``POMO(env)``: ``AttentionModelPolicy(env_name="mtvrp", num_encoder_layers=6,
                 normalization="instance", use_graph_context=False)`` (MTVRP init/context embeddings).
    mvmoe:       ``MVMoE_POMO(env, moe_kwargs=...)`` with the decoder's ``light_version=False``.
    mvmoe_light: ``MVMoE_POMO(env, moe_kwargs=...)`` with ``light_version=True`` (RL4CO's default).
    All: ``num_starts=num_loc`` (RL4CO's own default for mtvrp would be n + 1 starts, one duplicated),
    ``num_augment=8``, ``augment_fn="dihedral8"``, Adam(lr 1e-4, weight_decay 1e-6).
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {MODELS}")
    torch, _, MTVRPEnv, POMO, MVMoE_POMO = _import_torch()
    env = MTVRPEnv(generator_params={"num_loc": num_loc, "variant_preset": "cvrp"},
                   check_solution=check_solution)
    torch.manual_seed(seed)
    common = dict(num_starts=num_loc, num_augment=8, augment_fn="dihedral8", optimizer="Adam",
                  optimizer_kwargs={"lr": 1e-4, "weight_decay": 1e-6})
    if model == "pomo_mtl":
        lit = POMO(env, policy_kwargs={}, **common)
    else:
        lit = MVMoE_POMO(env, policy_kwargs={}, moe_kwargs=_moe_kwargs(model == "mvmoe_light"), **common)
    return lit, env


def cvrp_tensordict(locs: np.ndarray, demand: np.ndarray, capacity: float | None = None):
    """A plain CVRP batch -> RL4CO's MTVRP TensorDict (the fields its generator produces for a CVRP).

    locs float32 (B, n+1, 2) depot first; demand float32 (B, n+1), demand / capacity with the depot 0.
    Fields: demand_linehaul = demand, demand_backhaul = 0, vehicle_capacity = 1 (demands are already
    normalised), capacity_original = the raw capacity (only used by RL4CO's renderer), open_route = False,
    distance_limit = +inf, time_windows = [0, +inf], service_time = 0, speed = 1.
    """
    torch, *_ = _import_torch()
    from tensordict import TensorDict
    from rl4co.envs.routing.mtvrp.generator import get_vehicle_capacity

    locs = np.asarray(locs, np.float32)
    demand = np.asarray(demand, np.float32)
    if locs.ndim != 3 or locs.shape[-1] != 2 or demand.shape != locs.shape[:2]:
        raise ValueError(f"expected locs (B, n+1, 2) and demand (B, n+1), got {locs.shape} and {demand.shape}")
    if np.any(demand[:, 0] != 0) or np.any(demand[:, 1:] <= 0) or np.any(demand > 1):
        raise ValueError("CVRP demand must be 0 at the depot and in (0, 1] (normalised) at customers")
    b, n1 = demand.shape
    if capacity is None:
        capacity = float(get_vehicle_capacity(n1 - 1))
    time_windows = np.zeros((b, n1, 2), np.float32)
    time_windows[..., 1] = np.inf
    return TensorDict(
        {
            "locs": torch.from_numpy(locs.copy()),
            "demand_linehaul": torch.from_numpy(demand.copy()),
            "demand_backhaul": torch.zeros(b, n1),
            "distance_limit": torch.full((b, 1), float("inf")),
            "time_windows": torch.from_numpy(time_windows),
            "service_time": torch.zeros(b, n1),
            "vehicle_capacity": torch.ones(b, 1),
            "capacity_original": torch.full((b, 1), float(capacity)),
            "open_route": torch.zeros(b, 1, dtype=torch.bool),
            "speed": torch.ones(b, 1),
        },
        batch_size=[b],
    )


def _check_reset(env, td) -> None:
    """The reset state of a CVRP batch: at the depot, depot masked, every customer feasible, variant CVRP."""
    td0 = env.reset(td.clone())
    mask = td0["action_mask"]
    if bool(mask[:, 0].any()) or not bool(mask[:, 1:].all()):
        raise AssertionError("unexpected reset mask: depot must be masked and every customer available")
    names = set(env.get_variant_names(td0))
    if names != {"CVRP"}:
        raise AssertionError(f"RL4CO sees variants {names}, expected only CVRP")


def _quiet(fn, *args, **kwargs):
    """Call fn with Lightning's 'self.log without a Trainer' chatter suppressed."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def torch_infer(model: str, locs: np.ndarray, demand: np.ndarray, aug: int = 8, repeats: int = 3,
                threads: int | None = None, check_solution: bool = True) -> dict:
    """Greedy multistart (all n starts) x ``aug`` augmentation inference of one batch with RL4CO.

    ``check_solution``: run RL4CO's feasibility check on the untimed warm-up's tours (``feasible`` True);
    False skips it (``feasible`` None). The check is slow (99 s for MVMoE/4E-L's random-weights tours at
    n = 50, batch 64), and a caller that decodes the same instances with the same weights again gets the
    same tours, which one check covers (``throughput.py --rounds``)."""
    torch, rl4co, *_ = _import_torch()
    from rl4co.utils.ops import unbatchify

    if threads is not None:
        torch.set_num_threads(int(threads))
    td_in = cvrp_tensordict(locs, demand)
    b, n = td_in.batch_size[0], td_in["locs"].shape[1] - 1
    lit, env = build_model(model, n, seed=0)
    if aug != 8:
        from rl4co.data.transforms import StateAugmentation
        lit.num_augment = aug
        lit.augment = (StateAugmentation(num_augment=aug, augment_fn="symmetric", first_aug_identity=True)
                       if aug > 1 else None)
    lit.eval()
    _check_reset(env, td_in)

    def run():
        # POMO.shared_step(phase="test"), keeping the per-instance results and the actions.
        td = env.reset(td_in.clone())
        if aug > 1:
            td = lit.augment(td)
        out = lit.policy(td, env, phase="test", num_starts=n, return_actions=True)
        reward = unbatchify(out["reward"], (max(aug, 1), n)) if aug > 1 else unbatchify(out["reward"], n)
        best = reward.reshape(b, -1).max(dim=-1).values      # best over augmentations and starts
        return best, out

    with torch.inference_mode():
        env.check_solution = check_solution       # warm-up: RL4CO asserts every solution is feasible
        best, out = run()
        env.check_solution = False
        times, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            best, out = run()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    seconds = min(times)
    return {
        "framework": "pytorch/rl4co",
        "model": model,
        "num_customers": n,
        "batch": b,
        "aug": aug,
        "num_starts": n,
        "seconds": seconds,
        "all_seconds": times,
        # process CPU time / wall time of the best run: ~threads when the cores were not shared
        "cpu_utilisation": cpu[times.index(seconds)] / seconds,
        "instances_per_second": b / seconds,
        "mean_objective": float(-best.mean()),
        "decode_steps": int(out["actions"].shape[-1]),     # actions per trajectory, the start node included
        # The warm-up run passed env.check_solution_validity (None: not checked in this call).
        "feasible": True if check_solution else None,
        "torch_version": torch.__version__,
        "rl4co_version": rl4co.__version__,
        "threads": torch.get_num_threads(),
    }


def torch_train(model: str, size: int, batch: int, steps: int = 3, threads: int | None = None,
                seed: int = 0, warmup: int = 1) -> dict:
    """Full RL4CO REINFORCE/POMO optimiser steps (all n starts, no augmentation) on fresh CVRP batches:
    ``warmup`` untimed steps, then ``steps`` timed ones."""
    peer_cli.check_warmup(warmup)
    torch, rl4co, *_ = _import_torch()
    if threads is not None:
        torch.set_num_threads(int(threads))
    lit, env = build_model(model, size, seed=seed)
    optimizer = lit.configure_optimizers()
    if isinstance(optimizer, (list, tuple)):         # (optimizers, schedulers) if a scheduler were set
        optimizer = optimizer[0][0] if isinstance(optimizer[0], (list, tuple)) else optimizer[0]
    lit.train()
    torch.manual_seed(seed + 1)
    _check_reset(env, env.generator(batch_size=[batch]))

    def step():
        data = env.generator(batch_size=[batch])          # fresh CVRP batch (RL4CO's generator)
        out = _quiet(lit.shared_step, data, 0, phase="train")
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        optimizer.step()
        return out

    for _ in range(warmup):
        out = step()                                      # warm-up
    losses, times, cpu = [out["loss"].item()], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(out["loss"].item())
    seconds = sum(times) / len(times)
    return {
        "framework": "pytorch/rl4co",
        "model": model,
        "num_customers": size,
        "batch": batch,
        "num_starts": size,
        "steps": steps,
        "warmup_steps": warmup,
        "seconds_per_step": seconds,
        "all_seconds": times,
        "cpu_utilisation": sum(cpu) / sum(times),
        "instances_per_second": batch / seconds,
        "losses": losses,
        "mean_tour_length_last_step": -float(out["train/reward"]),   # mean over instances and starts
        "num_params": sum(p.numel() for p in lit.policy.parameters()),
        "optimizer": f"Adam(lr={optimizer.defaults['lr']}, weight_decay={optimizer.defaults['weight_decay']})",
        "torch_version": torch.__version__,
        "rl4co_version": rl4co.__version__,
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="mvmoe")
    parser.add_argument("--size", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--aug", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="train: untimed steps before the timed ones")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1, help="jax key for the instances (infer)")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    if args.mode == "infer":
        locs, demand = peer_cli.cvrp_workload(args.seed, args.batch, args.size)
        result = torch_infer(args.model, locs, demand, aug=args.aug, repeats=args.repeats, threads=args.threads)
    else:
        result = torch_train(args.model, args.size, args.batch, steps=args.steps, threads=args.threads,
                             warmup=args.warmup)
    return peer_cli.emit(result, args.output)


if __name__ == "__main__":
    main()
