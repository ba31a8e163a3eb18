"""Inference and training throughput of POMO-MTL, MVMoE/4E and MVMoE/4E-L, with FLOPs and memory.

One workload (the contract used by external checks)::

    python benchmarks/throughput.py --model=mvmoe --size=50 --batch=64 --mode=infer --output=FILE

writes ``{"instances_per_second", "compile_seconds", "device", "seconds", "flops_per_instance",
"achieved_gflops", "fraction_of_matmul_peak", "seconds_over_flop_limit", "peak_memory_bytes", ...}``.
Without ``--model`` it sweeps every model, the sizes in ``--sizes`` and the batch sizes in ``--batches``
and prints a markdown table. ``--torch`` runs RL4CO (the ``[torch]`` extra) and ``--authors=PATH`` the authors'
own PyTorch code (a checkout of RoyalSkye/Routing-MVMoE; see ``authors_peer.py``) on the same workloads in
the same process, and add their figures and our speed-up.

Inference: greedy decoding from all n starts with x8 augmentation (``--aug``), with trained weights where
available (``--weights``; the decoding steps, hence the time, depend on them). Training: full optimiser
steps (sampling rollout, backward pass, Adam; the plan's ``backward``). Instances per second exclude compilation,
which is reported separately. FLOPs are the model's, from XLA's cost analysis of its plain formulation
(``plain_formulation``: the query projection and the heads' combination computed at every step, each token
through its k chosen experts only), with the encoder and one decoding step costed at the sizes the program
runs them and multiplied by the chunks and the steps each chunk ran (XLA counts a ``while_loop`` body once).
The FLOP limit is those FLOPs at the matmul peak: the highest rate measured in the same run (at its start and
after every workload), which every workload of the run is held to (result files from before 2026-12-03
held each workload to the highest rate measured up to and right after it). ``executed_flops_per_instance``
counts what the compiled program runs instead (fewer: the precomputed query scores and readout trade per-step
products for per-rollout ones, and the grouped MoE skips unchosen experts; more where the dense MoE computes
every expert).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mvmoe_jax import checkpoints, devices, env, execution, host_memory, instances, precision, rollout, training

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402  (benchmarks/machine.py)
import peer_cli  # noqa: E402  (benchmarks/peer_cli.py)
import train_throughput  # noqa: E402  (benchmarks/train_throughput.py)
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.nn.policy import Policy, PolicyConfig, fuses_readout

MODELS = {"pomo_mtl": "POMO-MTL", "mvmoe": "MVMoE/4E", "mvmoe_light": "MVMoE/4E-L"}


def device_description() -> str:
    d, count = jax.devices()[0], jax.local_device_count()
    if d.platform == "cpu":
        split = f", as {count} devices" if count > 1 else ""
        return f"cpu: {os.cpu_count()} cores {platform.machine()} ({machine.cpu_model()}){split}"
    return f"{d.platform}: {d.device_kind}" + (f" x{count}" if count > 1 else "")


def peak_memory_bytes() -> int:
    d = jax.devices()[0]
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # host RSS (CPU backend)


def matmul_peak_gflops(dim: int = 2048, repeats: int = 5) -> float:
    """Measured float32 matmul rate on the default device (the practical peak)."""
    a = jax.random.normal(jax.random.key(0), (dim, dim), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    best = min(_timed(lambda: jax.block_until_ready(f(a))) for _ in range(repeats))
    return 2 * dim ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0)) if cost else 0.0


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weights_path(model: str, weights: str) -> str | None:
    """The checkpoint that ``weights`` names for ``model`` ('auto': the reference fixture of
    ``shared/fixtures`` when present), None for random initialisation."""
    if weights == "auto":
        return peer_cli.fixture_checkpoint(model)
    return None if weights == "random" else weights


def load_weights(model: str, size: int, weights: str, **cfg_kw) -> tuple[PolicyConfig, dict, str]:
    """(config, params, description). ``weights``: 'random' (initialisation, seed 0), 'auto' (the briefly
    trained reference checkpoint of ``shared/fixtures`` when present, else random), or a checkpoint path.

    Trained weights matter: an untrained policy returns to the depot often, so greedy decoding needs up to
    2n steps (99 at n = 50) where a trained one needs ~64.
    """
    path = weights_path(model, weights)
    if path is None:
        cfg = PolicyConfig(model=model, **cfg_kw)
        return cfg, training.init_params(cfg, jax.random.key(0), size), "random initialisation (seed 0)"
    cfg, params = checkpoints.load_policy(path)
    if cfg.model != model:
        raise ValueError(f"{path} holds a {cfg.model} model, not {model}")
    return dataclasses.replace(cfg, **cfg_kw), params, os.path.basename(path.rstrip("/"))


def program_flops_per_instance(cfg: PolicyConfig, plan: ExecutionPlan, params, inst, pomo: int, chunk: int,
                               chunk_steps: np.ndarray, num_devices: int) -> float:
    """FLOPs per instance of the (augmented) batch ``inst`` that a chunked greedy evaluation of ``cfg``
    executes, from XLA's cost analysis of its parts at the sizes the program runs them: the encoder per call
    of ``rollout.encoder_group_size`` chunks, the decoder's precomputation per chunk, one decoding step per
    step each chunk ran. XLA counts a loop body once, so the chunks and steps are multiplied in here and the
    grouped MoE blocks are traced as one product (the plan's ``grouped_blocks_as_one_product``). ``chunk_steps``:
    the steps of every chunk, padding chunks included (``GreedyResult.chunk_steps``)."""
    policy = Policy(cfg, plan)
    counted = Policy(cfg, plan.replace(grouped_blocks_as_one_product=True))
    m, num_nodes = inst.locs.shape[0], inst.locs.shape[-2]
    num_chunks = len(chunk_steps)
    group = rollout.encoder_group_size(max(1, num_chunks // num_devices), chunk, num_nodes,
                                       rollout.encoder_token_budget(cfg, plan))
    rng = jax.random.key(0)

    def take(count):
        return jax.tree.map(lambda x: x[np.arange(count) % m], inst)

    encoder = jax.jit(lambda p, i: rollout.encode_nodes(counted, p, i, rng)[0]).lower(
        params, take(group * chunk)).compile()
    sub = take(chunk)
    # Shapes only: run eagerly, these would compile every operation on its own (seconds per call).
    emb = jax.eval_shape(lambda p, i: rollout.encode_nodes(policy, p, i, rng)[0], params, sub)
    lowered = jax.jit(lambda p, e: policy.apply(p, e, method=Policy.precompute)).lower(params, emb)
    precompute, cache = lowered.compile(), lowered.out_info     # cache: the decoding step's input (shapes)
    states = jax.eval_shape(lambda i: rollout.initial_states(i, pomo)[0], sub)

    def one_step(p, cache, states):
        mask = env.batch_action_mask(states)
        return policy.apply(p, cache, states.current, rollout.dynamic_features(states), mask,
                            jnp.full((2,), 0.5) if cfg.hierarchical else None, False, method=Policy.decode,
                            rngs={"gating": rng})

    step = jax.jit(one_step).lower(params, cache, states).compile()
    total = (num_chunks / group * _flops(encoder) + num_chunks * _flops(precompute)
             + float(np.sum(chunk_steps)) * _flops(step))
    return total / m


def plain_formulation(cfg: PolicyConfig) -> PolicyConfig:
    """The model as written, the basis of its FLOPs, run on the reference plan: a decoding step projects its
    query and combines the heads itself (no precomputed query scores or readout), and each token goes through
    its k chosen experts only (an MoE layer of k experts, every one computed: the FLOPs of top-k routing, less
    a gate of E - k columns)."""
    return dataclasses.replace(cfg, num_experts=cfg.topk) if cfg.uses_moe else cfg


def model_flops_per_instance(cfg: PolicyConfig, size: int, inst, pomo: int, chunk: int, chunk_steps: np.ndarray,
                             num_devices: int) -> float:
    """The model's FLOPs per instance for the same decoding: ``program_flops_per_instance`` of
    ``plain_formulation(cfg)`` (which the FLOP limit is computed from). The program computes the same
    result with fewer: the precomputed query scores and readout, and the MoE layers' execution."""
    plain = plain_formulation(cfg)
    params = jax.eval_shape(lambda key: training.init_params(plain, key, size), jax.random.key(0))
    return program_flops_per_instance(plain, execution.reference(), params, inst, pomo, chunk, chunk_steps,
                                      num_devices)


class InferWorkload(NamedTuple):
    cfg: PolicyConfig
    plan: ExecutionPlan
    params: dict
    weights_desc: str
    inst: instances.Instance
    compiled: rollout.CompiledGreedyEvaluate
    compile_seconds: float


def compile_infer(model: str, size: int, batch: int, aug: int = 8, weights: str = "auto",
                  chunk_size: int | None = None, execution_preset: str = "auto", execution_overrides: str = "",
                  **cfg_kw) -> InferWorkload:
    """The inference workload's weights, instances and compiled greedy evaluation (timed)."""
    cfg, params, weights_desc = load_weights(model, size, weights, **cfg_kw)
    plan = execution.default_plan(execution_preset, **execution.parse_overrides(execution_overrides))
    inst = instances.generate(jax.random.key(1), batch, size, "CVRP")
    t0 = time.perf_counter()
    compiled = rollout.compile_greedy_evaluate(cfg, params, inst, jax.random.key(0), pomo_size=size,
                                               augment=aug == 8, chunk_size=chunk_size, plan=plan)
    return InferWorkload(cfg, plan, params, weights_desc, inst, compiled, time.perf_counter() - t0)


def measure_infer(model: str, size: int, batch: int, aug: int = 8, repeats: int = 3, weights: str = "auto",
                  chunk_size: int | None = None, matmul_precision: str | None = None, **cfg_kw) -> dict:
    """Greedy x``aug`` inference at ``matmul_precision`` (None: evaluation's default, full float32)."""
    prec = matmul_precision or precision.EVAL_DEFAULT
    with precision.matmul_precision(prec):
        row = _measure_infer(model, size, batch, aug, repeats, weights, chunk_size, **cfg_kw)
    row["matmul_precision"] = prec
    return row


# (config, size, batch, aug, chunk, steps of every chunk, devices) -> (model, executed) FLOPs per instance.
_FLOPS_PER_INSTANCE: dict[tuple, tuple[float, float]] = {}


def _measure_infer(model: str, size: int, batch: int, aug: int, repeats: int, weights: str,
                   chunk_size: int | None, **cfg_kw) -> dict:
    cfg, plan, params, weights_desc, inst, compiled, compile_s = compile_infer(model, size, batch, aug, weights,
                                                                               chunk_size, **cfg_kw)
    # Placed on the devices once, as evaluation.evaluate_batches does (the PyTorch peers' weights, too,
    # stay where they were loaded); the instances are copied at every call.
    params = rollout.replicated(params)
    res = jax.block_until_ready(compiled(params, inst, jax.random.key(0)))
    seconds = min(_timed(lambda: jax.block_until_ready(compiled(params, inst, jax.random.key(r))))
                  for r in range(repeats))
    flat = rollout.augmented_batch(inst) if aug == 8 else inst
    m = flat.locs.shape[0]
    chunk = rollout.effective_chunk_size(chunk_size, size, flat, plan, jax.local_device_count())
    chunk_steps = np.asarray(res.chunk_steps)
    num_devices = compiled.num_devices
    # Per instance of the batch (each stands for m // batch augmented copies). Counted once per workload:
    # later rounds decode the same instances in the same steps.
    key = (cfg, plan, size, batch, aug, chunk, tuple(chunk_steps.tolist()), num_devices)
    if key not in _FLOPS_PER_INSTANCE:
        _FLOPS_PER_INSTANCE[key] = (
            model_flops_per_instance(cfg, size, flat, size, chunk, chunk_steps, num_devices) * (m // batch),
            program_flops_per_instance(cfg, plan, params, flat, size, chunk, chunk_steps, num_devices) * (m // batch))
    flops, executed = _FLOPS_PER_INSTANCE[key]
    return {"mode": "infer", "model": model, "size": size, "batch": batch, "aug": aug, "seconds": seconds,
            "instances_per_second": batch / seconds, "compile_seconds": compile_s, "weights": weights_desc,
            "devices": jax.local_device_count(),
            "moe_dispatch": plan.moe_dispatch if cfg.uses_moe else None, "fused_readout": fuses_readout(cfg, plan),
            "fused_query": plan.fused_query, "execution": plan.to_dict(),
            "compute_dtype": cfg.compute_dtype, "chunk_size": chunk, "decode_steps": int(res.num_steps),
            "mean_chunk_steps": float(chunk_steps.mean()), "flops_per_instance": flops,
            "achieved_gflops": flops * batch / seconds / 1e9, "executed_flops_per_instance": executed,
            "executed_gflops": executed * batch / seconds / 1e9, "mean_objective": float(np.mean(res.obj)),
            "program_memory_bytes": compiled.memory_bytes()}


def program_memory(mode: str, model: str, size: int, batch: int, aug: int = 8, weights: str = "auto",
                   chunk_size: int | None = None, execution_preset: str = "auto", execution_overrides: str = "",
                   matmul_precision: str | None = None, **cfg_kw) -> int:
    """Per-device memory of a workload's compiled program, from XLA's memory analysis (compiled, not run)."""
    if mode == "infer":
        with precision.matmul_precision(matmul_precision or precision.EVAL_DEFAULT):
            return compile_infer(model, size, batch, aug, weights, chunk_size, execution_preset, execution_overrides,
                                 **cfg_kw).compiled.memory_bytes()
    if cfg_kw:
        raise ValueError(f"training benchmark takes the model's config as is; unsupported: {sorted(cfg_kw)}")
    return train_throughput.program_memory(model, size, size, batch, execution_preset=execution_preset,
                                           execution_overrides=execution_overrides, problems="CVRP",
                                           matmul_precision=matmul_precision)


def default_memory_budget() -> int:
    """Bytes a workload's program may take per device: 90% of an accelerator's memory, or on CPU half of
    the physical memory shared out over the devices (the rest for the process, the peers and the OS)."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(0.9 * stats["bytes_limit"])
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(0.5 * physical / jax.local_device_count())


def largest_batch(mode: str, model: str, size: int, start: int, budget: int, max_batch: int,
                  memory=program_memory, **kw) -> tuple[int, list[tuple[int, int]]]:
    """The largest batch ``start * 2**k`` (at most ``max_batch``) whose program fits in ``budget`` bytes
    per device, and the (batch, bytes) pairs tried. Compiles each candidate, runs none. ``start`` itself
    must fit: a workload that does not fit at all is an error worth stopping for."""
    tried = []
    best, batch = None, start
    while batch <= max_batch:
        need = memory(mode, model, size, batch, **kw)
        tried.append((batch, need))
        if need > budget:
            break
        best, batch = batch, batch * 2
    if best is None:
        raise ValueError(f"{mode} {model} n={size}: batch {start} needs {need / 2**30:.2f} GiB per device, "
                         f"over the budget of {budget / 2**30:.2f} GiB (--memory_budget_gb)")
    return best, tried


def measure_train(model: str, size: int, batch: int, steps: int = 3, execution_preset: str = "auto",
                  execution_overrides: str = "", problems: str = "CVRP",
                  weights: str = "auto", matmul_precision: str | None = None, warmup: int = 1, **cfg_kw) -> dict:
    """Full optimiser steps, timed as benchmarks/train_throughput.py does (configs/<model>.py), on fresh
    batches of ``problems`` (CVRP by default: the inference workload's variant, and the one the peers
    train on; the decoding steps, hence the time, depend on the variant), from the parameters ``weights``
    names (see ``weights_path``; the authors' code starts from the same ones)."""
    if cfg_kw:
        raise ValueError(f"training benchmark takes the model's config as is; unsupported: {sorted(cfg_kw)}")
    row = train_throughput.measure(model, size, size, batch, steps,
                                   execution_preset=execution_preset, execution_overrides=execution_overrides,
                                   problems=problems, weights=weights_path(model, weights),
                                   matmul_precision=matmul_precision, warmup=warmup)
    row.update(mode="train", model=model, seconds=row["step_seconds"])
    return row


def _fastest(rows: list[dict]) -> dict:
    """The row of the fastest round, with every round's instances/s under ``rounds_instances_per_second``."""
    best = dict(max(rows, key=lambda r: r["instances_per_second"]))
    best["rounds_instances_per_second"] = [r["instances_per_second"] for r in rows]
    return best


def run(mode: str, model: str, size: int, batch: int, peak: float | None, with_torch: bool = False,
        authors_code: str | None = None, rounds: int = 1, timing: dict | None = None, **kw) -> dict:
    """One workload: ours, then (when asked) the authors' code and RL4CO, ``rounds`` times in turn; each
    framework's fastest round is kept. Interleaving the rounds lets a slow spell of a shared machine
    (seen here: the same program 1.6x slower for minutes) fall on every framework alike."""
    # Training: every framework runs the same untimed warm-up and timed steps.
    timing = (timing or {}) if mode == "train" else {}
    ours, theirs, rl4co = [], [], []
    for round_index in range(rounds):
        ours.append((measure_infer if mode == "infer" else measure_train)(model, size, batch, **timing, **kw))
        if authors_code:
            theirs.append(authors_row(mode, model, size, batch, kw.get("aug", 8), authors_code,
                                      weights_path(model, kw.get("weights", "auto")), **timing))
        if with_torch:
            # RL4CO's own feasibility check runs in the first round only (see carry_feasibility).
            rl4co.append(torch_row(mode, model, size, batch, kw.get("aug", 8), check_solution=round_index == 0,
                                   **timing))
    if mode == "infer":
        carry_feasibility(rl4co)
    row = _fastest(ours)
    # Later rounds reuse the first round's compiled program (jax's cache): its compilation is the one to report.
    row["compile_seconds"] = ours[0]["compile_seconds"]
    row["device"] = device_description()
    row["peak_memory_bytes"] = peak_memory_bytes()
    if peak:
        # The machine's speed drifts: the peak is re-measured after every workload, and at the end of the run
        # every workload is held to the highest rate seen in it (``hold_to_peak``: the stricter FLOP limit).
        row["matmul_peak_gflops_after_workload"] = matmul_peak_gflops()
        hold_to_peak([row], max(peak, row["matmul_peak_gflops_after_workload"]))
    if authors_code:
        row["authors"] = _fastest(theirs)
        row["speedup_vs_authors"] = row["instances_per_second"] / row["authors"]["instances_per_second"]
        if row["authors"].get("decode_steps") and row.get("decode_steps"):
            row["per_step_speedup_vs_authors"] = per_step_speedup(row, row["authors"])
    if with_torch:
        usable = [r for r in rl4co if "instances_per_second" in r]
        row["torch"] = _fastest(usable) if usable else rl4co[0]
        if "instances_per_second" in row["torch"]:
            row["speedup_vs_torch"] = row["instances_per_second"] / row["torch"]["instances_per_second"]
        if row["torch"].get("decode_steps") and row.get("decode_steps"):
            # Decisions (hence steps) differ between differently initialised policies: per step as well.
            row["per_step_speedup_vs_torch"] = per_step_speedup(row, row["torch"])
    return row


def per_step_speedup(ours: dict, peer: dict) -> float:
    """The speed-up per decoding step: decisions (hence steps) differ between policies that were initialised
    differently or sample differently. ``decode_steps``: one count, or one per timed training step."""
    def per_step(row):
        seconds = row.get("seconds", row.get("seconds_per_step"))
        return seconds / float(np.mean(row["decode_steps"]))
    return per_step(peer) / per_step(ours)


def torch_row(mode: str, model: str, size: int, batch: int, aug: int, check_solution: bool = True,
              **timing) -> dict:
    """RL4CO on the same workload (the same generated instances for inference), in this process.
    ``check_solution``: inference's feasibility check (``torch_peer.torch_infer``). ``timing``: training's
    ``steps`` and ``warmup`` (see ``torch_peer.torch_train``)."""
    import torch_peer  # benchmarks/torch_peer.py; needs the [torch] extra

    if mode == "infer":
        inst = instances.generate(jax.random.key(1), batch, size, "CVRP")
        return torch_peer.torch_infer(model, np.asarray(inst.locs), np.asarray(inst.demand), aug=aug,
                                      check_solution=check_solution)
    return torch_peer.torch_train(model, size, batch, **timing)


def carry_feasibility(rows: list[dict]) -> None:
    """Marks the unchecked RL4CO inference rounds (``feasible`` None) feasible when they decoded what the
    checked round did: the same instances with the same weights, so the same tours, shown by equal mean
    objectives and decoding steps. Rounds that differ, or a workload without a checked round, stay None."""
    checked = [r for r in rows if r.get("feasible")]
    for row in rows:
        if row.get("feasible") is None and "mean_objective" in row and any(
                row["mean_objective"] == c["mean_objective"] and row["decode_steps"] == c["decode_steps"]
                for c in checked):
            row["feasible"] = True


def authors_row(mode: str, model: str, size: int, batch: int, aug: int, code: str, weights: str | None,
                **timing) -> dict:
    """The authors' PyTorch code on the same workload (the same generated instances for inference) from the
    same parameters (``weights``: a checkpoint path, None for random initialisation). ``timing``: training's
    ``steps`` and ``warmup`` (see ``authors_peer.authors_train``)."""
    import authors_peer  # benchmarks/authors_peer.py; needs torch and a checkout of their code

    weights = weights or "random"
    device = "cpu" if jax.default_backend() == "cpu" else "cuda"      # their code runs where ours does
    if mode == "infer":
        inst = instances.generate(jax.random.key(1), batch, size, "CVRP")
        return authors_peer.authors_infer(model, np.asarray(inst.locs), np.asarray(inst.demand), code, aug=aug,
                                          weights=weights, device=device)
    return authors_peer.authors_train(model, size, batch, code, weights=weights, device=device, **timing)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), help="one model (default: all)")
    p.add_argument("--mode", choices=["infer", "train", "both"], default="both")
    p.add_argument("--size", type=int, help="one problem size (default: --sizes)")
    p.add_argument("--batch", type=int, help="one batch size (default: --batches)")
    p.add_argument("--sizes", default="20,50,100")
    p.add_argument("--batches", default="1,16,64",
                   help="comma list; 'max' adds the largest batch (doubling from the largest listed) whose "
                        "compiled program fits --memory_budget_gb, up to --max_batch")
    p.add_argument("--memory_budget_gb", type=float, default=None,
                   help="per-device memory a program may take for 'max' (default: 90%% of an accelerator's "
                        "memory; on CPU half the physical memory over the devices)")
    p.add_argument("--max_batch", type=int, default=1024, help="the largest batch 'max' tries")
    p.add_argument("--aug", type=int, default=8, choices=[1, 8])
    p.add_argument("--weights", default="auto",
                   help="auto (the reference fixture checkpoints in ../shared when present, else random) | "
                        "random | a checkpoint path; training starts from them too, ours and the authors' code "
                        "alike (RL4CO cannot load them and starts from random initialisation)")
    p.add_argument("--chunk_size", type=int, default=None,
                   help="instances decoded at once in inference (default: the plan's, rollout.chunk_instances)")
    p.add_argument("--execution", default="auto", choices=("auto",) + execution.PRESETS,
                   help="execution plan preset (mvmoe_jax/execution.py; auto: the platform's)")
    p.add_argument("--execution_overrides", default="",
                   help="plan fields, FIELD=VALUE,... (e.g. moe_dispatch=dense,fused_query=false,backward=replay; "
                        "cpu_devices=1: JAX's single device)")
    p.add_argument("--compute_dtype", default=None, help="float32 | bfloat16")
    p.add_argument("--matmul_precision", default=None, choices=precision.MATMUL_PRECISIONS,
                   help="float32 matmuls on GPUs (mvmoe_jax/precision.py; default: the library's, full float32 "
                        "for inference and tensorfloat32 for training); no effect on a CPU")
    p.add_argument("--train_steps", type=int, default=3, help="training: timed optimiser steps per round")
    p.add_argument("--train_warmup", type=int, default=1,
                   help="training: untimed steps before the timed ones, the same for every framework (ours: the "
                        "compiling step included), for steady-state figures")
    p.add_argument("--torch", action="store_true",
                   help="also run RL4CO (pip install -e '.[torch]') on the same workloads, with the ratios")
    p.add_argument("--authors", default=os.environ.get("MVMOE_AUTHORS_CODE"), metavar="PATH",
                   help="also run the authors' PyTorch code from this checkout of RoyalSkye/Routing-MVMoE "
                        "(default: $MVMOE_AUTHORS_CODE), with the ratios")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each workload this many times, the frameworks in turn, and keep each one's "
                        "fastest round (for a shared machine whose speed drifts)")
    p.add_argument("--output", default="benchmarks/results/throughput.json")
    args = p.parse_args()
    # Measure what train.py and evaluate.py run: glibc's huge-page tunable set (mvmoe_jax/host_memory.py).
    # The PyTorch peers run in this process, under the same setting.
    host_memory.restart_with_huge_pages()
    cpu_devices, _ = execution.process_settings(args.execution, execution.parse_overrides(args.execution_overrides))
    devices.use_cpu_cores_as_devices(cpu_devices or None)
    if args.authors or args.torch:
        # On a GPU, JAX would otherwise reserve most of its memory at start, leaving the peers little.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    kw = {"execution_preset": args.execution, "execution_overrides": args.execution_overrides}
    if args.compute_dtype:
        kw["compute_dtype"] = args.compute_dtype
    if args.torch:
        import torch_peer
        if not torch_peer.rl4co_available():
            p.error("--torch needs RL4CO: pip install -e '.[torch]'")
    if args.authors:
        import authors_peer
        if not authors_peer.authors_available(args.authors):
            p.error(f"--authors={args.authors} is not a checkout of RoyalSkye/Routing-MVMoE that imports with "
                    f"torch (see benchmarks/authors_peer.py)")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.train_steps < 1 or args.train_warmup < 1:
        p.error(f"--train_steps and --train_warmup must be at least 1, got {args.train_steps} and "
                f"{args.train_warmup}")
    models = [args.model] if args.model else list(MODELS)
    sizes = [args.size] if args.size else [int(s) for s in args.sizes.split(",")]
    try:
        batches = [args.batch] if args.batch else [b if b == "max" else int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches must list positive integers and optionally 'max', got {args.batches!r}")
    if any(b != "max" and b < 1 for b in batches):
        p.error(f"--batches must list positive integers and optionally 'max', got {args.batches!r}")
    budget = int(args.memory_budget_gb * 2**30) if args.memory_budget_gb else default_memory_budget()
    modes = ["infer", "train"] if args.mode == "both" else [args.mode]
    peak = peak_at_start = matmul_peak_gflops()
    load_before = os.getloadavg()[0]
    print(f"device: {device_description()}; measured float32 matmul peak {peak:.1f} GFLOP/s; "
          f"load average {load_before:.2f}", flush=True)

    rows = []
    for mode in modes:
        for model in models:
            for size in sizes:
                extra = dict(aug=args.aug, weights=args.weights, chunk_size=args.chunk_size, **kw) \
                    if mode == "infer" else dict(kw, weights=args.weights)
                extra["matmul_precision"] = args.matmul_precision
                listed = [b for b in batches if b != "max"]
                search = None
                if "max" in batches:
                    top, tried = largest_batch(mode, model, size, max(listed, default=1), budget,
                                               args.max_batch, **extra)
                    search = {"budget_bytes": budget, "max_batch": args.max_batch, "largest": top,
                              "tried": [{"batch": b, "program_memory_bytes": m} for b, m in tried]}
                    print(f"{mode:5s} {MODELS[model]:11s} n={size:3d}: largest batch that fits "
                          f"{budget / 2**30:.1f} GiB per device: {top} (tried "
                          + ", ".join(f"{b}: {m / 2**30:.2f} GiB" for b, m in tried) + ")", flush=True)
                    listed = sorted(set(listed) | {top})
                    # The search compiled these programs: measured from jax's cache, their compilation
                    # would read as nothing.
                    jax.clear_caches()
                for batch in listed:
                    row = run(mode, model, size, batch, peak, with_torch=args.torch, authors_code=args.authors,
                              rounds=args.rounds, timing=dict(steps=args.train_steps, warmup=args.train_warmup),
                              **extra)
                    if search and batch == search["largest"]:
                        row["largest_batch_search"] = search
                    rows.append(row)
                    peak = row.get("matmul_peak_gflops", peak)
                    print(f"{mode:5s} {MODELS[model]:11s} n={size:3d} batch={batch:4d}: "
                          f"{row['instances_per_second']:8.2f} inst/s  ({row['seconds']:.3f} s, compile "
                          f"{row['compile_seconds']:.1f} s)" + (f", {row['fraction_of_matmul_peak']:.0%} of peak"
                                                               if "fraction_of_matmul_peak" in row else "")
                          + (f"; RL4CO {row['torch']['instances_per_second']:.2f} inst/s, "
                             f"{row['speedup_vs_torch']:.1f}x" if "speedup_vs_torch" in row else "")
                          + (f"; authors {row['authors']['instances_per_second']:.2f} inst/s, "
                             f"{row['speedup_vs_authors']:.1f}x" if "speedup_vs_authors" in row else ""),
                          flush=True)
    hold_to_peak(rows, peak)
    print_table(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    meta = {"device": device_description(), "jax": jax.__version__, "matmul_peak_gflops": peak,
            "matmul_peak_gflops_at_start": peak_at_start,
            "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    result = dict(rows[0], **meta) if len(rows) == 1 else dict(meta, rows=rows)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.output}")


def hold_to_peak(rows: list[dict], peak: float) -> None:
    """Sets each row's matmul peak to ``peak`` (GFLOP/s) and its achieved fraction of it, FLOP limit and
    ratio to that limit from it, in place. ``main`` calls it after every workload with the highest rate seen
    so far, then once more at the end of the run with the run's highest, which every row is held to."""
    for row in rows:
        row["matmul_peak_gflops"] = peak
        if "achieved_gflops" in row:
            row["fraction_of_matmul_peak"] = row["achieved_gflops"] / peak
            row["flop_limit_seconds"] = row["flops_per_instance"] * row["batch"] / (peak * 1e9)
            row["seconds_over_flop_limit"] = row["seconds"] / row["flop_limit_seconds"]


def print_table(rows: list[dict]) -> None:
    torch = any("torch" in r for r in rows)
    authors = any("authors" in r for r in rows)
    head = "| mode | model | n | batch | weights | decode steps | instances/s | seconds | compile s | model GFLOP/s | " \
           "% of peak | x FLOP limit | executed GFLOP/s | program MiB |"
    if authors:
        head += " authors s | authors steps | speed-up |"
    if torch:
        head += " RL4CO s | RL4CO steps | speed-up |"
    print("\n" + head)
    print("|" + "---|" * (head.count("|") - 1))
    nan = float("nan")
    for r in rows:
        line = (f"| {r['mode']} | {MODELS[r['model']]} | {r['size']} | {r['batch']} | "
                f"{'random' if str(r.get('weights', 'random')).startswith('random') else 'trained'} | "
                f"{r.get('decode_steps', '')} | {r['instances_per_second']:.2f} | {r['seconds']:.3f} | "
                f"{r['compile_seconds']:.1f} | {r.get('achieved_gflops', nan):.1f} | "
                f"{100 * r.get('fraction_of_matmul_peak', nan):.0f} | {r.get('seconds_over_flop_limit', nan):.2f} | "
                f"{r.get('executed_gflops', nan):.1f} | "
                f"{r.get('program_memory_bytes', nan) / 2**20:.0f}{'*' if 'largest_batch_search' in r else ''} |")
        if authors:
            a = r.get("authors", {})
            line += (f" {a.get('seconds', a.get('seconds_per_step', nan)):.2f} | {a.get('decode_steps', '')} | "
                     f"{r.get('speedup_vs_authors', nan):.1f}x |")
        if torch:
            t = r.get("torch", {})
            line += (f" {t.get('seconds', t.get('seconds_per_step', nan)):.2f} | {t.get('decode_steps', '')} | "
                     f"{r.get('speedup_vs_torch', nan):.1f}x |")
        print(line)
    if any("largest_batch_search" in r for r in rows):
        print("\n\\* the largest batch whose program fits the memory budget (--batches=...,max)")


if __name__ == "__main__":
    main()
