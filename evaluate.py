"""Evaluate a policy (a shipped model by name, an orbax checkpoint, a training workdir or an original .pt file)
on the paper's test sets or on CVRPLIB / Solomon files.

    python evaluate.py --config=configs/mvmoe.py --checkpoint=PATH --problems=ALL \
        --data_dir=../shared/data/mvmoe-paper --size=50 --aug=8 --output=results.json

``--config`` may be left out: the model configuration is then the one stored with the checkpoint (or read
off the .pt file). Prints a table (variant, objective, gap, time) and writes JSON
``{variant: {"obj": [...], "obj_no_aug": [...], "mean": float, "gap": float | null, "seconds": float,
"compile_seconds": float, "distance_bias": float, "candidates": int}}``. ``seconds`` excludes compilation.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from mvmoe_jax import cli, distributed, execution, precision

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Model configuration file; the checkpoint must fit it. Default: the configuration stored "
    "with an orbax checkpoint or read off a .pt file.")
flags.DEFINE_string("checkpoint", None, "shipped model name (e.g. mvmoe_4e_n50), orbax checkpoint directory, "
                    "training workdir or original .pt file.")
flags.DEFINE_string("problems", "ALL", "Comma list of variants, ALL, TRAIN or UNSEEN.")
flags.DEFINE_string("data_dir", None, "Folder in the paper's layout: DIR/<VARIANT>/<variant><size>_uniform.pkl.")
flags.DEFINE_integer("size", 50, "Problem size n of the paper datasets to evaluate.")
flags.DEFINE_integer("aug", 8, "Augmentation factor: 8 (x8 symmetries) or 1 (none).")
flags.DEFINE_integer("num_instances", None, "Evaluate only the first K instances of each dataset.")
flags.DEFINE_integer("batch_size", None, "Instances per jitted batch (default: config.eval_batch_size).")
flags.DEFINE_integer("pomo_size", None, "POMO starts (default: n).")
flags.DEFINE_string("vrplib_dir", None, "Folder of CVRPLIB .vrp and/or Solomon .txt files to evaluate.")
flags.DEFINE_string("bks", None, "JSON of best-known values (BKS.json style) for --vrplib_dir gaps.")
flags.DEFINE_string("reference", None, "Solution file (paper format) to compute gaps against; only with a "
                    "single problem. Default: the paper's reference solver file beside the dataset.")
flags.DEFINE_float("distance_bias", None, "alpha >= 0: -alpha * log2(n) * d(current, j) added to the decoder's "
                   "logits, favouring near nodes on instances larger than the training ones (0: off; default: the "
                   "model's, off for every shipped one; mvmoe_jax/nn/locality.py).")
flags.DEFINE_integer("candidates", None, "k: each step chooses among the k feasible customers nearest the current "
                     "node (and the depot) (0: all; default: the model's, all for every shipped one).")
flags.DEFINE_string("output", None, "Write results as JSON here.")
flags.DEFINE_integer("seed", 0, "Seed (MVMoE-L samples its dense-or-sparse gate in evaluation).")
flags.DEFINE_bool("progress", True, "Show a progress bar.")
flags.DEFINE_enum("matmul_precision", None, precision.MATMUL_PRECISIONS,
                  "float32 matmuls on GPUs (default: config.eval_matmul_precision, else float32, the original "
                  "implementation's numbers); tensorfloat32 measured 1.38x faster on an H200, 0.04% off.")
flags.DEFINE_enum("compute_dtype", None, ["float32", "bfloat16"], "Matmul input dtype (default: the model's).")
flags.DEFINE_enum("execution", "auto", ("auto",) + execution.PRESETS,
                  "Execution plan preset (mvmoe_jax/execution.py): auto (cpu or gpu by the platform), reference, "
                  "cpu, gpu. Results do not depend on it.")
flags.DEFINE_string("execution_overrides", "", "Plan fields to override, as FIELD=VALUE,FIELD=VALUE (e.g. "
                    "moe_dispatch=dense,cpu_devices=1; cpu_devices 0: one JAX device per core).")
flags.DEFINE_integer("chunk_size", None, "Augmented instances decoded at once (default: ~100 trajectories "
                     "on CPU, the whole batch on accelerators).")
flags.DEFINE_bool("distributed", False, "Join an evaluation over several processes (jax.distributed): each "
                  "decodes its share of the batches, process 0 prints and writes the results.")
flags.DEFINE_string("coordinator_address", None, "Process 0's host:port (with --num_processes and --process_id; "
                    "none of the three: detected from SLURM, Open MPI or a cloud TPU).")
flags.DEFINE_integer("num_processes", None, "Processes of a --distributed evaluation.")
flags.DEFINE_integer("process_id", None, "This process's index (0 .. num_processes - 1).")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)     # orbax logs every restore at INFO
    try:
        # Before JAX starts: huge pages, the CPU's cores as devices (any count: chunks are dealt out).
        launch = distributed.launch_from_config({k: FLAGS[k].value for k in (
            "distributed", "coordinator_address", "num_processes", "process_id")})
        execution.prepare_process(FLAGS.execution, execution.parse_overrides(FLAGS.execution_overrides))
        distributed.initialize(launch)
        if not distributed.is_main():
            sys.stdout = open(os.devnull, "w")      # the other processes compute their shares silently
        results = cli.run_evaluation(_CONFIG.value, FLAGS)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.output and distributed.is_main():
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
        with open(FLAGS.output, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {FLAGS.output}")


if __name__ == "__main__":
    flags.mark_flag_as_required("checkpoint")
    app.run(main)
