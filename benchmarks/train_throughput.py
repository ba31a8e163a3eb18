"""Training throughput: instances per second through full optimiser steps (fresh batch, sampling rollout,
differentiable replay, Adam update), compilation timed separately.

A step whose replay length (a bucket above the decoding steps the batch needed) has not been seen yet
compiles the update for that length: such steps count as compilation, not throughput. Prints a markdown
table and writes JSON.

    python benchmarks/train_throughput.py --configs mvmoe,pomo_mtl --size 50 --batch 64 --steps 5
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # configs/
from mvmoe_jax import checkpoints, devices, execution, host_memory, precision, training, training_loop  # noqa: E402
import machine  # noqa: E402  (benchmarks/machine.py; this folder is on sys.path when run or imported)


def step_setup(config_name: str, size: int, pomo: int, batch: int,
               execution_preset: str = "auto", execution_overrides: str = "", problems: str | None = None,
               matmul_precision: str | None = None):
    """(config, run settings, step functions) of a training run of configs/<config_name>.py at this size and
    batch, data parallel over as many devices as split the batch evenly (all of them, usually), under the
    execution plan ``execution_preset`` with ``execution_overrides`` (``FIELD=VALUE,...``).
    ``matmul_precision``: the config's ``matmul_precision`` (training's; None keeps the config's)."""
    config = importlib.import_module(f"configs.{config_name}").get_config()
    if problems:
        config.train_problems = problems
    if matmul_precision:
        config.matmul_precision = matmul_precision
    config.problem_size, config.pomo_size, config.batch_size = size, pomo, batch
    config.train_episodes = batch
    config.execution.preset = execution_preset
    for field, value in execution.parse_overrides(execution_overrides).items():
        config.execution[field] = value
    run = training_loop.check_config(config)
    num_devices = devices.largest_divisor_at_most(len(jax.devices()), batch)
    fns = training_loop.step_functions(config, run, devices.make_mesh(jax.devices()[:num_devices]))
    return config, run, fns


def program_memory(config_name: str, size: int, pomo: int, batch: int,
                   execution_preset: str = "auto", execution_overrides: str = "", problems: str | None = None,
                   matmul_precision: str | None = None) -> int:
    """Per-device memory of a training step at this batch, from the compiled programs (compiled, not run;
    see ``StepFunctions.memory_bytes``)."""
    config, plan, fns = step_setup(config_name, size, pomo, batch, execution_preset,
                                   execution_overrides, problems, matmul_precision)
    with precision.matmul_precision(config.matmul_precision):
        state = fns.init_state(training.init_params(plan.policy, jax.random.key(0)))
        return fns.memory_bytes(state, fns.batch(jax.random.key(0), batch), jax.random.key(0))


def measure(config_name: str, size: int, pomo: int, batch: int, steps: int,
            max_compile_steps: int = 6, execution_preset: str = "auto", execution_overrides: str = "",
            problems: str | None = None, weights: str | None = None, matmul_precision: str | None = None,
            warmup: int = 1) -> dict:
    """``warmup``: untimed steps before the ``steps`` timed ones, the first (compiling) step included; steps
    that compile (a new replay length) are never timed. ``problems``: the training variants (comma list;
    default: the config's). ``weights``: a checkpoint (original ``.pt`` or orbax) to start from, as
    fine-tuning does; None: random initialisation (seed 0).
    Where the policy starts matters: the decoding steps a batch needs, hence a step's time, depend on it
    (an untrained policy returns to the depot far more often). ``matmul_precision``: training's (None: the
    config's, as train.py runs it)."""
    if warmup < 1:
        raise ValueError(f"warmup counts the first (compiling) step: at least 1, got {warmup}")
    config, plan, fns = step_setup(config_name, size, pomo, batch, execution_preset,
                                   execution_overrides, problems, matmul_precision)
    with precision.matmul_precision(config.matmul_precision):
        row = _timed_steps(config_name, config, plan, fns, size, pomo, batch, steps,
                           max_compile_steps, weights, warmup)
    row["matmul_precision"] = config.matmul_precision
    return row


def _timed_steps(config_name: str, config, plan, fns, size: int, pomo: int, batch: int, steps: int,
                 max_compile_steps: int, weights: str | None, warmup: int = 1) -> dict:
    """The measurement of ``measure``: compile, then ``steps`` timed optimiser steps."""
    num_devices = fns.num_devices
    t0 = time.perf_counter()
    if weights:
        _, params = checkpoints.load_policy(weights, plan.policy)
    else:
        params = training.init_params(plan.policy, jax.random.key(0))
    state = fns.init_state(params)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    n_params = sum(x.size for x in jax.tree.leaves(state.params))

    seen, compile_s, timed, lengths, steps_needed = set(), init_s, [], [], []
    key = jax.random.key(config.seed)
    step = 0
    # warmup counts the compiling step, which max_compile_steps already allows for.
    while len(timed) < steps and step < warmup - 1 + steps + max_compile_steps:
        k_data, k_roll = jax.random.split(training.step_key(key, step))
        t0 = time.perf_counter()
        inst = fns.batch(k_data, batch)
        if fns.replays:
            # Sampling, a host sync for the replay length, then the update.
            traj = fns.sample(state.params, inst, k_roll)
            needed = int(traj.num_steps)
            length = fns.replay_length(needed)
            t1 = time.perf_counter()
            state, m = fns.update(state, inst, traj, k_roll, length)
            m = jax.device_get(m)
        else:
            # What the training loop runs: sampling and update in one program (no sampling/update split).
            state, m = fns.sample_and_update(state, inst, k_roll)
            m = jax.device_get(m)
            needed = length = int(m["decode_steps"])
            t1 = t0                                      # the whole step counts as the update
        t2 = time.perf_counter()
        assert m["finite"], "non-finite step"
        # The replay compiles once per length; the stepwise backward once.
        first = step == 0 or (fns.replays and length not in seen)
        seen.add(length)
        if first:
            compile_s += t2 - t0
        elif step < warmup:
            pass                                         # warm-up: run, not timed
        else:
            timed.append((t1 - t0, t2 - t1))
            lengths.append(length)
            steps_needed.append(needed)
        step += 1
    step_s = float(np.mean([a + b for a, b in timed])) if timed else float("nan")
    sample_s = float(np.mean([a for a, _ in timed])) if timed and fns.replays else None
    update_s = float(np.mean([b for _, b in timed])) if timed and fns.replays else None
    # The compiled step's memory (a cache hit: the steps above compiled it), at the longest replay seen.
    memory = fns.memory_bytes(state, inst, k_roll, max(seen) if fns.replays else None)
    return {"config": config_name, "model": plan.policy.model, "params": int(n_params), "size": size,
            "weights": os.path.basename(weights.rstrip("/")) if weights else "random initialisation (seed 0)",
            "pomo": pomo, "batch": batch, "devices": num_devices, "train_problems": config.train_problems,
            "backward": fns.plan.backward, "execution": fns.plan.to_dict(),
            "warmup_steps": warmup, "timed_steps": len(timed),
            "steps_run": step,
            "decoder_record": training.records_decoder(fns.policy, fns.settings, inst, fns.max_steps, fns.mesh),
            "decode_steps": steps_needed, "replay_lengths": lengths, "sample_seconds": sample_s,
            "update_seconds": update_s,
            "step_seconds": step_s, "instances_per_second": batch / step_s,
            "compile_seconds": compile_s, "compiled_lengths": sorted(seen), "program_memory_bytes": memory}


def split(row: dict) -> str:
    """Seconds per step, with the sampling/update split where the two run as separate programs."""
    if row["sample_seconds"] is None:
        return f"{row['step_seconds']:.2f} (one program)"
    return f"{row['step_seconds']:.2f} ({row['sample_seconds']:.2f} + {row['update_seconds']:.2f})"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="mvmoe,pomo_mtl", help="comma list of configs/<name>.py")
    p.add_argument("--size", type=int, default=50)
    p.add_argument("--pomo", type=int, default=0, help="POMO starts; 0 = n")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after compilation)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps before the timed ones, the first (compiling) step included")
    p.add_argument("--problems", default="", help="training variants, comma list (default: the config's)")
    p.add_argument("--execution", default="auto", choices=("auto",) + execution.PRESETS,
                   help="execution plan preset (mvmoe_jax/execution.py)")
    p.add_argument("--execution_overrides", default="",
                   help="plan fields, FIELD=VALUE,... (e.g. backward=replay; cpu_devices=1: JAX's single device)")
    p.add_argument("--weights", default="", help="checkpoint to start from (.pt or orbax); default random")
    p.add_argument("--output", default="benchmarks/results/train_throughput.json")
    args = p.parse_args()
    cpu_devices, _ = execution.process_settings(args.execution, execution.parse_overrides(args.execution_overrides))
    devices.use_cpu_devices(cpu_devices, args.batch, what="execution cpu_devices")
    device = (f"{jax.devices()[0].device_kind} x{len(jax.devices())} ({jax.default_backend()}, {os.cpu_count()} "
              f"cpus, {machine.cpu_model()})")
    load_before = os.getloadavg()
    rows = []
    for name in args.configs.split(","):
        row = measure(name, args.size, args.pomo or args.size, args.batch, args.steps,
                      execution_preset=args.execution, execution_overrides=args.execution_overrides,
                      problems=args.problems or None, weights=args.weights or None,
                      warmup=args.warmup)
        rows.append(row)
        print(f"{name}: {row['instances_per_second']:.1f} instances/s ({split(row)} s/step; compile "
              f"{row['compile_seconds']:.0f} s)", flush=True)
    load_after = os.getloadavg()
    print(f"\nDevice: {device}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}\n")
    print("| config | params | n | batch x pomo | s / step (sample + update) | instances / s | compile s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['params'] / 1e6:.2f}M | {r['size']} | {r['batch']} x {r['pomo']} | "
              f"{split(r)} | "
              f"{r['instances_per_second']:.1f} | {r['compile_seconds']:.0f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"device": device, "jax": jax.__version__, "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
                   "xla_flags": os.environ.get("XLA_FLAGS", ""),
                   "load_average_before": load_before,
                   "load_average_after": load_after, "args": vars(args), "rows": rows}, f, indent=1)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    # Measure what train.py runs: glibc's huge-page tunable set (mvmoe_jax/host_memory.py); the PyTorch peers
    # run in this process, under the same setting.
    host_memory.restart_with_huge_pages()
    main()
