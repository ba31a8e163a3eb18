"""Shared test fixtures.

Tests that need the read-only material in ``../shared`` (the paper's data, the PyTorch fixtures) get it
through ``shared_dir``: a user's clone has no shared/, so they skip with a clear reason, but under CI
(``CI=true``) a missing folder is a failure, so CI never skips them silently.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import tempfile
import types

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"
_XLA_CACHE = pytest.StashKey[str]()
# The tests compile far more than they compute: XLA:CPU's code generation (LLVM) runs unoptimised for the run,
# which cuts many a test's compilation by a third and leaves results alone (LLVM may not reorder floating-point
# arithmetic at any level). Its effect is in docs/performance.md, "Test suite". An XLA_FLAGS naming a level keeps it.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags_env(*flags: str) -> dict[str, str]:
    """This process's environment with ``flags`` added to its ``XLA_FLAGS`` (for a test's subprocess)."""
    return dict(os.environ, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip())


def pytest_configure(config):
    """Keep compiled XLA programs on disk for the length of the run, in one folder that the worker processes
    and every ``train.py`` the tests start share (they inherit the environment): a program compiled again (the
    same command killed and resumed, the same step in two test files) is read back instead of compiled. A
    folder the caller chose is left alone. Its effect is in docs/performance.md, "Test suite"."""
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="mvmoe-jax-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.3"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    config.stash[_XLA_CACHE] = folder


def pytest_unconfigure(config):
    folder = config.stash.get(_XLA_CACHE, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def require_shared(*parts: str) -> pathlib.Path:
    path = SHARED_DIR.joinpath(*parts)
    if not path.exists():
        reason = f"{path} is missing (the shared/ folder beside the repository holds the paper's data)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    return path


def script_module(relative_path: str) -> types.ModuleType:
    """A script of the repository that is not part of the package (``scripts/ship_model.py``), imported."""
    path = REPO_ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
    return require_shared()


@pytest.fixture(scope="session")
def paper_dir() -> pathlib.Path:
    return require_shared("data", "mvmoe-paper")


@pytest.fixture(scope="session")
def torch_fixtures() -> pathlib.Path:
    return require_shared("fixtures", "torch-reference")
