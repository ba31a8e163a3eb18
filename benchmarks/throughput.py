"""Inference and training throughput of POMO-MTL, MVMoE/4E and MVMoE/4E-L, with FLOPs and memory.

One workload (the contract used by external checks)::

    python benchmarks/throughput.py --model=mvmoe --size=50 --batch=64 --mode=infer --output=FILE

writes ``{"instances_per_second", "compile_seconds", "device", "seconds", "flops_per_instance",
"achieved_gflops", "fraction_of_matmul_peak", "peak_memory_bytes", ...}``. Without ``--model`` it sweeps
every model, the sizes in ``--sizes`` and the batch sizes in ``--batches`` and prints a markdown table.

Inference: greedy decoding from all n starts with x8 augmentation (``--aug``). Training: full optimiser
steps (sampling rollout, replayed decoder, backward pass, Adam). Instances per second exclude compilation,
which is reported separately. FLOPs come from XLA's cost analysis of the encoder and of one decoding step
(a ``while_loop`` body is counted once by XLA, so the decoder's FLOPs are multiplied by the steps the
rollout actually took); the achieved rate is compared with a matmul peak measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mvmoe_jax import instances, rollout, training

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_throughput  # noqa: E402  (benchmarks/train_throughput.py)
from mvmoe_jax.nn.policy import Policy, PolicyConfig

MODELS = {"pomo_mtl": "POMO-MTL", "mvmoe": "MVMoE/4E", "mvmoe_light": "MVMoE/4E-L"}


def device_description() -> str:
    d = jax.devices()[0]
    if d.platform == "cpu":
        return f"cpu: {os.cpu_count()} cores {platform.machine()} ({platform.processor() or 'unknown'})"
    return f"{d.platform}: {d.device_kind}"


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


def init_params(cfg: PolicyConfig, n: int):
    return training.init_params(cfg, jax.random.key(0), n)


def model_flops_per_instance(cfg: PolicyConfig, params, inst, pomo: int, decode_steps: float) -> float:
    """Encoder FLOPs + decoding-step FLOPs x steps, per (un-augmented) instance of ``inst``'s batch."""
    policy = Policy(cfg)
    b, n1 = inst.locs.shape[0], inst.locs.shape[1]
    enc = jax.jit(lambda p, i: policy.apply(p, i, False, method=Policy.encode, rngs={"gating": jax.random.key(0)}))
    enc_c = enc.lower(params, inst).compile()
    emb, _ = enc(params, inst)
    cache = policy.apply(params, emb, method=Policy.precompute)

    def one_step(p, cache, cur, dyn, mask, probs):
        return policy.apply(p, cache, cur, dyn, mask, probs, False, method=Policy.decode,
                            rngs={"gating": jax.random.key(0)})

    args = (params, cache, jnp.zeros((b, pomo), jnp.int32), jnp.zeros((b, pomo, 4)), jnp.ones((b, pomo, n1), bool),
            jnp.full((2,), 0.5) if cfg.hierarchical else None)
    dec_c = jax.jit(one_step).lower(*args).compile()
    return (_flops(enc_c) + _flops(dec_c) * decode_steps) / b


def measure_infer(model: str, size: int, batch: int, aug: int = 8, repeats: int = 3, **cfg_kw) -> dict:
    cfg = PolicyConfig(model=model, **cfg_kw)
    params = init_params(cfg, size)
    inst = instances.generate(jax.random.key(1), batch, size, "CVRP")
    t0 = time.perf_counter()
    compiled = rollout.greedy_evaluate.lower(cfg, params, inst, jax.random.key(0), pomo_size=size,
                                             augment=aug == 8).compile()
    compile_s = time.perf_counter() - t0
    res = jax.block_until_ready(compiled(params, inst, jax.random.key(0)))
    seconds = min(_timed(lambda: jax.block_until_ready(compiled(params, inst, jax.random.key(r))))
                  for r in range(repeats))
    decode_steps = float(res.num_steps)
    flops = model_flops_per_instance(cfg, params, inst, size, decode_steps) * (8 if aug == 8 else 1)
    return {"mode": "infer", "model": model, "size": size, "batch": batch, "aug": aug, "seconds": seconds,
            "instances_per_second": batch / seconds, "compile_seconds": compile_s,
            "decode_steps": decode_steps, "flops_per_instance": flops,
            "achieved_gflops": flops * batch / seconds / 1e9, "mean_objective": float(np.mean(res.obj))}


def measure_train(model: str, size: int, batch: int, steps: int = 3, **cfg_kw) -> dict:
    """Full optimiser steps, timed as benchmarks/train_throughput.py does (configs/<model>.py)."""
    if cfg_kw:
        raise ValueError(f"training benchmark takes the model's config as is; unsupported: {sorted(cfg_kw)}")
    row = train_throughput.measure(model, size, size, batch, steps, chunk=8, remat=False)
    row.update(mode="train", model=model, seconds=row["step_seconds"])
    return row


def run(mode: str, model: str, size: int, batch: int, peak: float | None, **kw) -> dict:
    row = (measure_infer if mode == "infer" else measure_train)(model, size, batch, **kw)
    row["device"] = device_description()
    row["peak_memory_bytes"] = peak_memory_bytes()
    if peak and "achieved_gflops" in row:
        row["matmul_peak_gflops"] = peak
        row["fraction_of_matmul_peak"] = row["achieved_gflops"] / peak
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), help="one model (default: all)")
    p.add_argument("--mode", choices=["infer", "train", "both"], default="both")
    p.add_argument("--size", type=int, help="one problem size (default: --sizes)")
    p.add_argument("--batch", type=int, help="one batch size (default: --batches)")
    p.add_argument("--sizes", default="20,50,100")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--aug", type=int, default=8, choices=[1, 8])
    p.add_argument("--dispatch", default=None, help="MoE execution: dense | sparse | einsum")
    p.add_argument("--compute_dtype", default=None, help="float32 | bfloat16")
    p.add_argument("--output", default="benchmarks/results/throughput.json")
    args = p.parse_args()

    kw = {}
    if args.dispatch:
        kw["moe_dispatch"] = args.dispatch
    if args.compute_dtype:
        kw["compute_dtype"] = args.compute_dtype
    models = [args.model] if args.model else list(MODELS)
    sizes = [args.size] if args.size else [int(s) for s in args.sizes.split(",")]
    batches = [args.batch] if args.batch else [int(b) for b in args.batches.split(",")]
    modes = ["infer", "train"] if args.mode == "both" else [args.mode]
    peak = matmul_peak_gflops()
    print(f"device: {device_description()}; measured float32 matmul peak {peak:.1f} GFLOP/s", flush=True)

    rows = []
    for mode in modes:
        for model in models:
            for size in sizes:
                for batch in batches:
                    extra = {"aug": args.aug} if mode == "infer" else {}
                    row = run(mode, model, size, batch, peak, **extra, **kw)
                    rows.append(row)
                    print(f"{mode:5s} {MODELS[model]:11s} n={size:3d} batch={batch:4d}: "
                          f"{row['instances_per_second']:8.2f} inst/s  ({row['seconds']:.3f} s, compile "
                          f"{row['compile_seconds']:.1f} s)" + (f", {row['fraction_of_matmul_peak']:.0%} of peak"
                                                               if "fraction_of_matmul_peak" in row else ""),
                          flush=True)
    print("\n| mode | model | n | batch | instances/s | seconds | compile s | GFLOP/s | % of peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {MODELS[r['model']]} | {r['size']} | {r['batch']} | {r['instances_per_second']:.2f} | "
              f"{r['seconds']:.3f} | {r['compile_seconds']:.1f} | {r.get('achieved_gflops', float('nan')):.1f} | "
              f"{100 * r.get('fraction_of_matmul_peak', float('nan')):.0f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    result = rows[0] if len(rows) == 1 else {"device": device_description(), "matmul_peak_gflops": peak,
                                             "rows": rows}
    if len(rows) == 1:
        result["matmul_peak_gflops"] = peak
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
