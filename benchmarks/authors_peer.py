"""Authors' peer: the original PyTorch MVMoE code (RoyalSkye/Routing-MVMoE) on the same CVRP workloads.

Puts the JAX numbers of ``benchmarks/throughput.py`` next to the authors' own implementation of POMO-MTL
(``MTLModel``), MVMoE/4E (``MOEModel``) and MVMoE/4E-L (``MOEModel_Light``). Their code is not vendored
here: it is imported from a local checkout given by ``--code=PATH`` (or ``$MVMOE_AUTHORS_CODE``)::

    git clone https://github.com/RoyalSkye/Routing-MVMoE /path/to/Routing-MVMoE
    python benchmarks/authors_peer.py --code=/path/to/Routing-MVMoE --model mvmoe --size 50 --batch 64

torch and the authors' modules are imported lazily, so this module imports without them. Their code needs
torch plus the packages their ``utils.py`` imports (numpy, matplotlib, scipy, tqdm); only their CVRP
environment (``envs/CVRPEnv.py``), their models (``models/``), ``utils.py``, ``Tester.py`` and ``Trainer.py``
are used.

Model settings are the defaults of their ``train.py``/``test.py``: embedding 128, 8 heads x 16, 6 encoder
layers, FFN 512, instance norm after each residual (``norm_last``), logit clipping 10, and for the MoE
models 4 experts, top-2, input-choice node-level gating, MoE in Enc0..Enc5 and the decoder. Float32 on CPU.
Their classes read the device from ``model_params['device']`` / ``env_params['device']`` (falling back to
CUDA), so both are set to the CPU here.

Inference: one batch, exactly as their ``Tester._test_one_batch`` does it (their method is called, on
their env and model): their x8 augmentation inside ``env.load_problems``, ``model.eval()``, the encoder
under ``torch.no_grad()``, then their ``pre_step``/``step`` loop with greedy (argmax) decoding from all n
starts. Like their tester, the decoding loop itself runs with autograd on (``--no-grad-rollout`` wraps
the whole call in ``torch.inference_mode()`` instead). Weights: the briefly trained fixture checkpoint of
``../shared/fixtures/torch-reference/checkpoints`` when present (trained at n = 20; the weights do not
depend on n), else random initialisation (seed 0), or ``--weights PATH`` (their ``.pt`` format, loaded
with ``strict=True`` as their tester does). One warm-up run, whose tours are checked here (every customer
once, capacity respected, the reported objective equal to the recomputed tour length), then the best of
``repeats`` timed runs. MVMoE/4E-L samples its dense-or-MoE decoder gate even in evaluation; torch is
seeded (0) once before the warm-up.

Training: full REINFORCE/POMO optimiser steps by their ``Trainer._train_one_batch`` (their method): a
fresh CVRP batch from their own generator (``CVRPEnv.get_random_problems``: uniform locations, integer
demands 1..9, capacities 30/40/50/70 for n = 20/50/100/200), sampling from all n starts, shared (mean over
starts) baseline, their loss plus the MoE auxiliary loss, backward and an Adam step (their optimizer
class, lr 1e-4, weight decay 1e-6, as in their ``train.py``), from random initialisation.

``decode_steps`` counts decoder evaluations per rollout: their env's steps minus the two forced moves (the
depot, then the POMO start node), the same count as ``decode_steps`` of throughput.py; ``env_steps`` is their
env's count.

Threads: their code issues many small ops, and torch's intra-op threads wait on each other, so when another
process holds one of the cores the default thread count can be many times slower than ``--threads 1`` (a
2-instance n = 20 training step: 19 s with 2 threads against 0.1 s with 1). The returned ``threads``,
``cpu_utilisation`` and load averages say under which conditions a figure was taken.
"""

from __future__ import annotations

import argparse
import inspect
import os
import pathlib
import subprocess
import sys
import time
import types

import numpy as np

import peer_cli  # benchmarks/peer_cli.py (this folder is on sys.path when run or imported)

MODELS = ("pomo_mtl", "mvmoe", "mvmoe_light")
AUTHORS_CLASSES = {"pomo_mtl": "MTLModel", "mvmoe": "MOEModel", "mvmoe_light": "MOEModel_Light"}
# Files of their repository this harness relies on; a checkout without them is not that repository.
REQUIRED_FILES = ("Tester.py", "Trainer.py", "utils.py", "envs/CVRPEnv.py", "models/__init__.py",
                  "models/MTLModel.py", "models/MOEModel.py", "models/MOEModel_Light.py", "models/MOELayer.py")
# Top-level module names their code uses (it runs from its repository root).
AUTHORS_MODULES = ("utils", "models", "envs", "Tester", "Trainer")
CODE_HINT = ("pass the path of a local checkout of the authors' code: "
             "git clone https://github.com/RoyalSkye/Routing-MVMoE PATH, then --code=PATH "
             "(or set MVMOE_AUTHORS_CODE=PATH)")
INSTALL_HINT = ("the authors' code needs torch and the packages its utils.py imports: "
                "pip install -e '.[torch]' matplotlib scipy tqdm")
TRAIN_SIZES = (20, 50, 100, 200)      # the sizes their CVRP generator knows
LOAD_TOLERANCE = 1e-4                 # their env's own round-off allowance is 1e-5 per check


def _checkout(code_path) -> pathlib.Path:
    """The checkout's resolved path, or a ValueError with the hint when it is missing or is not theirs."""
    if code_path is None or str(code_path).strip() == "":
        raise ValueError(f"no path to the authors' code given: {CODE_HINT}")
    path = pathlib.Path(code_path).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"{path} does not exist or is not a directory: {CODE_HINT}")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise ValueError(f"{path} is not a checkout of RoyalSkye/Routing-MVMoE (missing {', '.join(missing)}): "
                         f"{CODE_HINT}")
    return path


def _git_commit(path: pathlib.Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _load_average() -> float | None:
    """1-minute load average (other work on the cores slows the timed runs), None where unknown."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _conditions(authors, load_before: float | None) -> dict:
    """Under what a figure was taken: torch version and threads, load averages, the authors' checkout."""
    torch = authors.torch
    return {"torch_version": torch.__version__, "threads": torch.get_num_threads(),
            "load_average_before": load_before, "load_average_after": _load_average(),
            "authors_code": str(authors.path), "authors_commit": authors.commit}


def _import_authors(code_path) -> types.SimpleNamespace:
    """torch and the authors' modules from the checkout at ``code_path``.

    Raises ValueError (with the hint) for a missing path or a folder that is not their repository, and
    ImportError when torch or one of their dependencies is missing, or when other modules named like theirs
    (``utils``, ``models``, ``envs``, ``Tester``, ``Trainer``) are already imported from elsewhere.
    """
    path = _checkout(code_path)
    try:
        import torch
    except ImportError as e:      # pragma: no cover - depends on the environment
        raise ImportError(f"torch is not installed: {INSTALL_HINT} ({e})") from e
    for name in AUTHORS_MODULES:
        mod = sys.modules.get(name)
        origin = getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", [])), None)
        if mod is not None and (origin is None or path not in pathlib.Path(origin).resolve().parents):
            raise ImportError(f"a module named {name!r} is already imported from {origin}, not from {path}; "
                              "the authors' code uses that top-level name: run this harness in a fresh "
                              "process (one checkout per process)")
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    try:
        import importlib
        models = importlib.import_module("models")
        cvrp_env = importlib.import_module("envs.CVRPEnv")
        tester = importlib.import_module("Tester")
        trainer = importlib.import_module("Trainer")
    except ImportError as e:
        raise ImportError(f"importing the authors' code from {path} failed: {INSTALL_HINT} ({e})") from e
    return types.SimpleNamespace(
        torch=torch, path=path, commit=_git_commit(path), CVRPEnv=cvrp_env.CVRPEnv,
        classes={m: getattr(models, c) for m, c in AUTHORS_CLASSES.items()},
        test_one_batch=tester.Tester._test_one_batch, train_one_batch=trainer.Trainer._train_one_batch,
        Optimizer=getattr(trainer, "Optimizer", torch.optim.Adam))


def authors_available(code_path) -> bool:
    """True when ``code_path`` is a checkout of the authors' code that imports (torch included)."""
    try:
        _import_authors(code_path)
    except (ImportError, ValueError):
        return False
    return True


def model_params(model: str, problem: str = "Train_ALL") -> dict:
    """The authors' ``model_params`` (defaults of their train.py/test.py), on the CPU."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {MODELS}")
    import torch
    return {"embedding_dim": 128, "sqrt_embedding_dim": 128 ** (1 / 2), "encoder_layer_num": 6,
            "decoder_layer_num": 1, "qkv_dim": 16, "head_num": 8, "logit_clipping": 10, "ff_hidden_dim": 512,
            "num_experts": 4, "eval_type": "argmax", "norm": "instance", "norm_loc": "norm_last",
            "expert_loc": ["Enc0", "Enc1", "Enc2", "Enc3", "Enc4", "Enc5", "Dec"], "problem": problem,
            "topk": 2, "routing_level": "node", "routing_method": "input_choice",
            "device": torch.device("cpu")}


def build_model(authors, model: str, weights: str | None = None, seed: int = 0):
    """(their model, its model_params, description of the weights).

    ``weights``: None (the fixture when present, else random), "random" (initialisation with torch seed
    ``seed``) or the path of a checkpoint in their format ({"model_state_dict", "problem", ...}).
    """
    torch = authors.torch
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {MODELS}")
    path = peer_cli.fixture_checkpoint(model) if weights is None else (None if weights == "random" else weights)
    checkpoint = None
    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f"weights {path} not found")
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    # As their Tester: the checkpoint's training problem goes into model_params before building.
    params = model_params(model, checkpoint.get("problem", "Train_ALL") if checkpoint else "Train_ALL")
    torch.manual_seed(seed)
    net = authors.classes[model](**params)
    if checkpoint is not None:
        net.load_state_dict(checkpoint["model_state_dict"], strict=True)
        return net, params, os.path.basename(path)
    return net, params, f"random initialisation (seed {seed})"


def _cvrp_batch(authors, locs, demand):
    """(depot_xy (B, 1, 2), node_xy (B, n, 2), node_demand (B, n)): their env's problem tuple."""
    locs = np.asarray(locs, np.float32)
    demand = np.asarray(demand, np.float32)
    if locs.ndim != 3 or locs.shape[-1] != 2 or demand.shape != locs.shape[:2]:
        raise ValueError(f"expected locs (B, n+1, 2) and demand (B, n+1), got {locs.shape} and {demand.shape}")
    if np.any(demand[:, 0] != 0) or np.any(demand[:, 1:] <= 0) or np.any(demand > 1):
        raise ValueError("CVRP demand must be 0 at the depot and in (0, 1] (normalised) at customers")
    t = authors.torch
    return (t.from_numpy(locs[:, :1].copy()), t.from_numpy(locs[:, 1:].copy()),
            t.from_numpy(demand[:, 1:].copy()))


def check_tours(tours: np.ndarray, locs: np.ndarray, demand: np.ndarray) -> tuple[bool, np.ndarray]:
    """Our own check of the authors' rollouts. tours int (A*B, P, L): their ``env.selected_node_list`` for
    A stacked augmentations of the B instances (augmentation-major, as their env stacks them).

    Returns (feasible, lengths (A*B, P) float64 on the original coordinates): feasible when every tour
    starts at the depot then its POMO start node 1..P, visits every customer exactly once, and no route
    (between depot visits) carries more than the capacity (demand normalised: 1).
    """
    tours = np.asarray(tours, np.int64)
    locs = np.asarray(locs, np.float64)
    demand = np.asarray(demand, np.float64)
    m, p, length = tours.shape
    b, n1 = demand.shape
    inst = np.arange(m) % b
    ok = bool(np.all(tours[:, :, 0] == 0)) and bool(np.all(tours[:, :, 1] == np.arange(1, p + 1)))
    traj = np.arange(m * p).reshape(m, p, 1)
    visits = np.bincount((traj * n1 + tours).ravel(), minlength=m * p * n1).reshape(m, p, n1)
    ok = ok and bool(np.all(visits[:, :, 1:] == 1))
    route = np.cumsum(tours == 0, axis=2)                    # route index: a new one at each depot visit
    loads = np.bincount((traj * (length + 1) + route).ravel(),
                        weights=demand[inst[:, None, None], tours].ravel(), minlength=m * p * (length + 1))
    ok = ok and bool(loads.max() <= 1 + LOAD_TOLERANCE)
    xy = locs[inst[:, None, None], tours]                     # (A*B, P, L, 2); the x8 maps keep distances
    lengths = np.linalg.norm(xy - np.roll(xy, -1, axis=2), axis=-1).sum(axis=2)
    return ok, lengths


def authors_infer(model: str, locs: np.ndarray, demand: np.ndarray, code_path, aug: int = 8,
                  repeats: int = 3, weights: str | None = None, threads: int | None = None,
                  no_grad_rollout: bool = False) -> dict:
    """Greedy POMO inference (all n starts, x``aug`` augmentation) of one CVRP batch with the authors' code.

    locs float (B, n+1, 2) with the depot first; demand float (B, n+1), normalised by the capacity, 0 at
    the depot. ``aug`` is 1 or 8 (all their env supports).
    """
    if aug not in (1, 8):
        raise ValueError(f"aug must be 1 or 8 (the authors' env knows no other), got {aug}")
    authors = _import_authors(code_path)
    torch = authors.torch
    if threads is not None:
        torch.set_num_threads(int(threads))
    data = _cvrp_batch(authors, locs, demand)
    b, n = data[1].shape[:2]
    net, params, weights_desc = build_model(authors, model, weights, seed=0)
    # What their Tester reads from itself in _test_one_batch.
    tester = types.SimpleNamespace(model=net, model_params=params, device=torch.device("cpu"),
                                   tester_params={"aug_factor": aug, "sample_size": 1})
    takes_model = "model" in inspect.signature(authors.test_one_batch).parameters

    def run():
        env = authors.CVRPEnv(problem_size=n, pomo_size=n, device=torch.device("cpu"))
        args = (net, data, env) if takes_model else (data, env)
        if no_grad_rollout:
            with torch.inference_mode():
                out = authors.test_one_batch(tester, *args)
        else:
            out = authors.test_one_batch(tester, *args)
        return out, env

    load_before = _load_average()
    torch.manual_seed(0)
    (no_aug_mean, aug_mean, no_aug, best), env = run()           # warm-up, checked
    feasible, lengths = check_tours(env.selected_node_list.numpy(), locs, demand)
    recomputed = lengths.reshape(aug, b, n).min(axis=(0, 2))
    objective_error = float(np.max(np.abs(recomputed - best.double().numpy())))
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        (no_aug_mean, aug_mean, no_aug, best), env = run()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    seconds = min(times)
    return {
        "framework": "pytorch/authors",
        "model": model,
        "authors_class": AUTHORS_CLASSES[model],
        "num_customers": n,
        "batch": b,
        "aug": aug,
        "num_starts": n,
        "weights": weights_desc,
        "seconds": seconds,
        "all_seconds": times,
        # process CPU time / wall time of the best run: ~threads when the cores were not shared
        "cpu_utilisation": cpu[times.index(seconds)] / seconds,
        "instances_per_second": b / seconds,
        "mean_objective": float(aug_mean),            # best over augmentations and starts, mean over B
        "no_aug_mean_objective": float(no_aug_mean),  # best over starts of the original instances
        "decode_steps": int(env.selected_count) - 2,
        "env_steps": int(env.selected_count),
        # the warm-up's tours: feasible, and their tour length equal to the reported objective
        "feasible": feasible and objective_error < 1e-3,
        "objective_recheck_max_abs_error": objective_error,
        "rollout_grad": "off (inference_mode)" if no_grad_rollout else "on, as in their Tester",
        **_conditions(authors, load_before),
    }


def authors_train(model: str, size: int, batch: int, code_path, steps: int = 3, threads: int | None = None,
                  seed: int = 0, weights: str | None = "random") -> dict:
    """Full REINFORCE/POMO optimiser steps of the authors' Trainer on fresh CVRP batches of their generator,
    from ``weights`` (see ``build_model``; random initialisation by default)."""
    if size not in TRAIN_SIZES:
        raise ValueError(f"the authors' CVRP generator knows sizes {TRAIN_SIZES}, not {size}")
    authors = _import_authors(code_path)
    torch = authors.torch
    if threads is not None:
        torch.set_num_threads(int(threads))
    net, params, weights_desc = build_model(authors, model, weights, seed=seed)
    optimizer = authors.Optimizer(net.parameters(), lr=1e-4, weight_decay=1e-6)
    trainer = types.SimpleNamespace(model=net, model_params=params, optimizer=optimizer,
                                    device=torch.device("cpu"))
    torch.manual_seed(seed + 1)

    def step():
        # As their Trainer._train_one_epoch: a new env of the (here only) training problem, a fresh batch
        # from its generator, then their _train_one_batch.
        env = authors.CVRPEnv(problem_size=size, pomo_size=size, device=torch.device("cpu"))
        data = env.get_random_problems(batch, size)
        score, loss = authors.train_one_batch(trainer, data, env)
        return score, loss, env

    load_before = _load_average()
    score, loss, env = step()                                 # warm-up
    losses, scores, times, cpu, decode_steps = [loss], [score], [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        score, loss, env = step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss)
        scores.append(score)
        decode_steps.append(int(env.selected_count) - 2)
    seconds = sum(times) / len(times)
    return {
        "framework": "pytorch/authors",
        "model": model,
        "authors_class": AUTHORS_CLASSES[model],
        "num_customers": size,
        "batch": batch,
        "num_starts": size,
        "steps": steps,
        "weights": weights_desc,
        "seconds_per_step": seconds,
        "all_seconds": times,
        "cpu_utilisation": sum(cpu) / sum(times),
        "instances_per_second": batch / seconds,
        "losses": losses,                                      # their loss (REINFORCE + MoE aux), warm-up first
        "mean_best_tour_length_last_step": scores[-1],         # their score: best over starts, mean over B
        "decode_steps": decode_steps,                          # per timed step (sampling: varies)
        "num_params": sum(p.numel() for p in net.parameters()),
        "optimizer": f"{type(optimizer).__name__}(lr={optimizer.defaults['lr']}, "
                     f"weight_decay={optimizer.defaults['weight_decay']})",
        **_conditions(authors, load_before),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", default=os.environ.get("MVMOE_AUTHORS_CODE"),
                        help="local checkout of RoyalSkye/Routing-MVMoE (default: $MVMOE_AUTHORS_CODE)")
    parser.add_argument("--model", choices=MODELS, default="mvmoe")
    parser.add_argument("--size", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--aug", type=int, choices=(1, 8), default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--weights", default=None,
                        help="a checkpoint in the authors' format, or 'random' (default: infer the fixture of "
                             "../shared when present, else random; train random)")
    parser.add_argument("--no-grad-rollout", action="store_true",
                        help="infer: decode under torch.inference_mode (their Tester keeps autograd on)")
    parser.add_argument("--seed", type=int, default=1,
                        help="infer: jax key for the instances (1: those of throughput.py); train: torch seed")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    try:
        _checkout(args.code)
    except ValueError as e:
        parser.error(str(e))
    if args.mode == "infer":
        locs, demand = peer_cli.cvrp_workload(args.seed, args.batch, args.size)
        result = authors_infer(args.model, locs, demand, args.code, aug=args.aug, repeats=args.repeats,
                               weights=args.weights, threads=args.threads, no_grad_rollout=args.no_grad_rollout)
    else:
        result = authors_train(args.model, args.size, args.batch, args.code, steps=args.steps,
                               threads=args.threads, seed=args.seed, weights=args.weights or "random")
    return peer_cli.emit(result, args.output)


if __name__ == "__main__":
    main()
