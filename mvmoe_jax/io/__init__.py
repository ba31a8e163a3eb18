"""Data input/output: the paper's pickles, VRPLIB / Solomon files, npz batches, PyTorch checkpoints."""

from mvmoe_jax.io.paper import (dataset_path, load_paper_instances, load_paper_solutions,
                                reference_solution_path, reference_solver, save_paper_solutions,
                                variant_from_filename)
from mvmoe_jax.io.safe_pickle import UnsafePickleError

__all__ = ["dataset_path", "load_paper_instances", "load_paper_solutions", "reference_solution_path",
           "reference_solver", "save_paper_solutions", "variant_from_filename", "UnsafePickleError"]
