"""Solve one's own routing instances with a trained policy; write routes, a summary and plots.

    python -m mvmoe_jax.solve INPUT... [--checkpoint=NAME|PATH] [--search=greedy|sampling|eas|sgbs|sgbs_eas]
        [--time_limit=S] [--improve=none|ls] [--output=DIR] [--plot] [--problem=VARIANT]
        [--backhauls=paper|classic|mixed] [--bks=BKS.json] [--save_adapted=FILE.npz]
        [--distance_bias=ALPHA] [--candidates=K]

INPUT: files or folders of VRPLIB ``.vrp`` (with PyVRP's sections for time windows, service times, backhauls
and route limits), Solomon ``.txt``, the paper's ``.pkl``, ``.npz`` batches (``io.save_npz``) and JSON
(``mvmoe_jax.io.json_instances``). Writes ``DIR/<instance>.sol`` (VRPLIB solution format), with ``--plot``
``DIR/<instance>.png``, and ``DIR/summary.json``; with ``--search=eas --save_adapted=FILE`` the adapted
embeddings (``outputs.write_adapted``); prints a table. Exit status: 0 when every instance was
solved, 1 when some inputs were refused (the others are solved and written) or a route failed the checker
(nothing is written for it), 2 for a bad command line or when nothing could be read.
"""

from __future__ import annotations

import argparse
import sys


def _parser(searches) -> argparse.ArgumentParser:
    from mvmoe_jax.solve import eas, sgbs

    p = argparse.ArgumentParser(prog="python -m mvmoe_jax.solve", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="instance files or folders of them")
    p.add_argument("--checkpoint", default=None, help="shipped model name or checkpoint path (orbax directory, "
                   "training workdir or original .pt); default: the shipped model closest to the instance size")
    p.add_argument("--search", default="greedy", choices=list(searches),
                   help="greedy: greedy x8 from every POMO start (default); sampling: then sampled rollouts per "
                        "start and augmentation, keeping the best; eas: then efficient active search (EAS-Emb: each "
                        "instance's node embeddings adapted by gradient steps), keeping the best; sgbs: then "
                        "simulation-guided beam search (each beam node's children valued by a greedy rollout); "
                        "sgbs_eas: then rounds of an EAS iteration and an SGBS pass on the adapted embeddings")
    p.add_argument("--improve", default=None, choices=("none", "ls"),
                   help="ls: then a local search on each solution (2-opt, or-opt, relocate, exchange, 2-opt* under "
                        "the instance's rules, to a local optimum; its time is reported apart and not part of "
                        "--time_limit); default: ls on instances of at least twice a shipped model's training "
                        "size, none below")
    p.add_argument("--time_limit", type=float, default=None,
                   help="seconds per instance for the search, greedy included (compilation not)")
    p.add_argument("--rounds", type=int, default=None, help="sampling: at most this many rounds (default 10 without "
                   "--time_limit); eas: iterations (default 50 without --time_limit); sgbs: passes, each from the "
                   "next-ranked starts (default 1 without --time_limit); sgbs_eas: rounds (default 5 without "
                   "--time_limit); a run is repeated exactly by the same seed and its reported rounds (and samples)")
    p.add_argument("--samples", type=int, default=8, help="sampling: rollouts per POMO start and augmentation a "
                   "round (fewer where a round of that many would not fit --time_limit)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    p.add_argument("--eas_learning_rate", type=float, default=eas.LEARNING_RATE, help="eas: Adam's step size")
    p.add_argument("--eas_imitation_weight", type=float, default=eas.IMITATION_WEIGHT,
                   help="eas: weight of the imitation loss (the best solution's negative log-likelihood)")
    p.add_argument("--beam_width", type=int, default=sgbs.BEAM_WIDTH,
                   help="sgbs, sgbs_eas: beam nodes per symmetric copy of an instance")
    p.add_argument("--expansion", type=int, default=sgbs.EXPANSION,
                   help="sgbs, sgbs_eas: children of a beam node: its greedy move and the policy's next best moves")
    p.add_argument("--save_adapted", default=None, metavar="FILE",
                   help="eas: write each instance's adapted embeddings to this .npz file (format: "
                        "mvmoe_jax/solve/outputs.py)")
    p.add_argument("--distance_bias", type=float, default=None, metavar="ALPHA",
                   help="add -ALPHA * log2(n) * d(current, j) to the decoder's logits, favouring near nodes on "
                        "instances larger than the model's training size (0: off; default: the model's own, and for a "
                        "shipped model without one 1 on instances of at least twice its training size; "
                        "mvmoe_jax/nn/locality.py)")
    p.add_argument("--candidates", type=int, default=None, metavar="K",
                   help="each step chooses among the K feasible customers nearest the current node, and the depot "
                        "(0: all; default: the model's, all for the shipped ones)")
    p.add_argument("--max_starts", type=int, default=None, help="at most this many POMO starts (default: all n up to 200 "
                   "customers, min(200, 50,000 / n) above)")
    p.add_argument("--problem", default=None, help="the variant (e.g. OVRPTW) when the data does not say it all: "
                   "open routes, or a paper .pkl named otherwise")
    p.add_argument("--backhauls", default=None, choices=("paper", "classic", "mixed"),
                   help="the backhaul rule for every instance (docs/environment.md), overriding the files': classic "
                        "(linehauls before backhauls; VRPLIB's VRPB, the default for .vrp files), mixed (any order, "
                        "the load on board within capacity) or paper (the MVMoE paper's; its data's default)")
    p.add_argument("--num_instances", type=int, default=None, help="at most this many instances of each file")
    p.add_argument("--bks", default=None, help="best-known values (BKS.json style) for gaps")
    p.add_argument("--batch_size", type=int, default=None, help="instances solved together (default by size)")
    p.add_argument("--output", default="solutions", help="folder for the .sol files, plots and summary.json")
    p.add_argument("--plot", action="store_true", help="also write a PNG of each solution")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--execution", default="auto", choices=("auto", "reference", "cpu", "gpu"),
                   help="execution plan preset (mvmoe_jax/execution.py; auto: the platform's); results do not depend "
                        "on it")
    p.add_argument("--execution_overrides", default="", help="plan fields, FIELD=VALUE,... (e.g. cpu_devices=1: "
                   "JAX's single CPU device; 0: one per core)")
    return p


def _local_search_line(solutions) -> str:
    """What the local search did over the feasible solutions: how many it improved, by how much, in what time."""
    done = [s for s in solutions if s.feasible and s.searched_cost and s.improve == "ls"]
    if not done:
        return "local search: no feasible solution to improve"
    change = [(s.cost - s.searched_cost) / s.searched_cost * 100.0 for s in done]
    better = sum(s.cost < s.searched_cost for s in done)
    return (f"local search: {better} of {len(done)} solution(s) improved, cost {sum(change) / len(done):+.2f} % on "
            f"average, {sum(s.improve_seconds for s in done) / len(done):.2f} s per instance")


def _say(line: str) -> None:
    """Print an informational line on stdout at once, above a progress bar that may be drawn (on stderr)."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def _written_line(report) -> str:
    """The last line: instances, time (search and compilation apart) and what was written."""
    sols = sum("sol" in s.files for s in report.solutions)
    pngs = sum("plot" in s.files for s in report.solutions)
    plots = f", {pngs} PNG file(s)" if pngs else ""
    return (f"{len(report.solutions)} instance(s) in {report.seconds:.1f} s (search {report.search_seconds:.1f} s, "
            f"compilation {report.compile_seconds:.1f} s, not counted in --time_limit); wrote {sols} .sol file(s)"
            f"{plots} and {report.summary_file}")


def main(argv=None, *, setup_process: bool = False) -> int:
    """Run the command on ``argv`` (default ``sys.argv[1:]``); returns the exit status. ``setup_process``: first
    the plan's huge pages (the process is started again with them) and a CPU's cores as devices, which must
    happen before JAX computes anything."""
    from mvmoe_jax import execution
    from mvmoe_jax.solve import api, search

    args = _parser(search.SEARCHES).parse_args(argv)
    try:
        overrides = execution.parse_overrides(args.execution_overrides)
        if setup_process:
            execution.prepare_process(args.execution, overrides)      # any device count: chunks are dealt out
        plan = execution.default_plan(args.execution, **overrides)
        report = api.solve(args.inputs, checkpoint=args.checkpoint, search=args.search, time_limit=args.time_limit,
                           rounds=args.rounds, samples=args.samples, max_starts=args.max_starts, seed=args.seed,
                           problem=args.problem, num_instances=args.num_instances, bks=args.bks,
                           backhauls=args.backhauls,
                           batch_size=args.batch_size, output=args.output, plot=args.plot,
                           progress=not args.no_progress, execution=plan, eas_learning_rate=args.eas_learning_rate,
                           eas_imitation_weight=args.eas_imitation_weight, save_adapted=args.save_adapted,
                           improve=args.improve, beam_width=args.beam_width, expansion=args.expansion,
                           distance_bias=args.distance_bias, candidates=args.candidates, log=_say)
    except api.NothingToSolveError as e:
        for r in e.refused:
            print(f"refused: {r.error}", file=sys.stderr)
        print("error: no instance could be read", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(report.table(), flush=True)
    if report.improve == "ls":
        print(_local_search_line(report.solutions), flush=True)
    failed = [s for s in report.solutions if not s.feasible]
    for s in failed:
        why = f"the route fails the checker ({s.violation})" if s.found else s.violation
        print(f"error: {s.name}: {why}; nothing written for it", file=sys.stderr)
    for r in report.refused:
        print(f"refused: {r.error}", file=sys.stderr)
    for w in report.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(_written_line(report))
    if report.adapted_file is not None:
        print(f"adapted embeddings: {report.adapted_file}")
    return 1 if failed or report.refused else 0


if __name__ == "__main__":
    sys.exit(main(setup_process=True))
