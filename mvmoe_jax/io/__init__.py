"""Data input/output: the paper's pickles, VRPLIB / Solomon files, npz batches, JSON instances, PyTorch checkpoints."""

from mvmoe_jax.io.paper import (dataset_path, load_paper_instances, load_paper_solutions,
                                reference_solution_path, reference_solver, save_paper_solutions,
                                variant_from_filename)
from mvmoe_jax.io.json_instances import JsonMeta, read_json_instances
from mvmoe_jax.io.npz import load_npz, save_npz
from mvmoe_jax.io.safe_pickle import UnsafePickleError
from mvmoe_jax.io.solomon import SolomonMeta, read_solomon
from mvmoe_jax.io.vrplib_io import DataFileNotFoundError, VrplibMeta, load_bks, read_vrplib

__all__ = ["dataset_path", "load_paper_instances", "load_paper_solutions", "reference_solution_path",
           "reference_solver", "save_paper_solutions", "variant_from_filename", "UnsafePickleError",
           "load_npz", "save_npz", "read_solomon", "SolomonMeta", "read_vrplib", "VrplibMeta", "load_bks",
           "DataFileNotFoundError", "read_json_instances", "JsonMeta"]
