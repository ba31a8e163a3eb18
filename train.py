"""Train MVMoE / MVMoE-L / POMO-MTL / POMO as the paper does (REINFORCE with the POMO shared baseline).

    python train.py --config=configs/mvmoe.py                               # MVMoE/4E, n = 50, default recipe
    python train.py --config=configs/mvmoe_paper.py                         # ... under the paper's recipe
    python train.py --config=configs/demo.py                                # a CPU demo in minutes
    python train.py --config=configs/mvmoe.py --config.problem_size=100 --config.pomo_size=100 \\
        --config.workdir=workdir_mvmoe100
    python train.py --config=configs/mvmoe_paper.py --config.workdir=workdir_ft \\
        --config.finetune_from=workdir --config.train_problems=VRPBLTW --config.train_episodes=10000

Every config field can be overridden as ``--config.field=value``. Running the same command again resumes
from the workdir's latest checkpoint. Exit codes: 0 done, 1 the run diverged (non-finite loss; the last
good checkpoint is kept), 2 bad input (config, override, checkpoint), 3 a computation failed in a run of
several processes (most often another process stopped), 130 interrupted.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/mvmoe.py", "Run configuration file.")


def _parse_flags(argv):
    """absl's parser, but a bad flag or override is exit code 2 with a one-line message."""
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:      # ml_collections: an override of a field that is not there
        field = str(e).strip("\"'")
        print(f"error: unknown config field {field!r} in an override; use --config.FIELD=VALUE with a field "
              "of the config file (see configs/common.py)", file=sys.stderr)
    except (flags.Error, TypeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]} (options are --config=FILE and --config.FIELD=VALUE)",
              file=sys.stderr)
        sys.exit(2)
    from mvmoe_jax import distributed, training, training_loop

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)     # orbax logs every save at INFO
    try:
        config = _CONFIG.value
        config.to_dict()                           # a config file that failed to load raises here
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        training_loop.prepare_process(config)          # before JAX starts: huge pages, CPU cores as devices
        training_loop.train_and_evaluate(config)
        if distributed.is_main():
            print("\n".join(training_loop.next_steps(config)), flush=True)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (training.NonFiniteError, training_loop.CheckpointWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except distributed.ProcessFailure as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Without the lost process, JAX's exit-time shutdown of the distributed runtime would abort (or wait
        # for it): end here, the checkpoints already closed.
        os._exit(3)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume from the last checkpoint", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
