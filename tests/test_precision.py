"""Matmul precision: the setting each entry point runs under, and clear errors for a bad one."""

import types

import jax
import pytest

from mvmoe_jax import cli, execution, precision, training, training_loop
from test_training import tiny_config


def test_context_sets_and_restores_jax_precision():
    before = jax.config.jax_default_matmul_precision
    for name in ("float32", "tensorfloat32", "bfloat16"):
        with precision.matmul_precision(name):
            assert jax.config.jax_default_matmul_precision == name
        assert jax.config.jax_default_matmul_precision == before
    with precision.matmul_precision("default"):
        assert jax.config.jax_default_matmul_precision == before
    with pytest.raises(ValueError, match="float32, tensorfloat32, bfloat16, default.*'highest-ish'"):
        precision.matmul_precision("highest-ish")


def test_evaluation_runs_at_the_flag_else_the_config_else_float32(monkeypatch):
    monkeypatch.setattr(cli, "_run_evaluation", lambda config, flags: jax.config.jax_default_matmul_precision)
    config = tiny_config("unused", eval_matmul_precision="bfloat16")
    assert cli.run_evaluation(config, types.SimpleNamespace(matmul_precision=None)) == "bfloat16"
    assert cli.run_evaluation(config, types.SimpleNamespace(matmul_precision="tensorfloat32")) == "tensorfloat32"
    assert cli.run_evaluation(None, types.SimpleNamespace()) == "float32"
    with pytest.raises(ValueError, match="matmul precision must be one of"):
        cli.run_evaluation(None, types.SimpleNamespace(matmul_precision="fp8"))


def test_training_runs_at_its_precision_and_validates_at_evaluations(monkeypatch, tmp_path):
    seen = {}

    def fake_run(config, plan, fns, mngr, state, *args):
        seen["train"] = jax.config.jax_default_matmul_precision
        return {}

    monkeypatch.setattr(training_loop, "_run", fake_run)
    config = tiny_config(tmp_path / "run", matmul_precision="bfloat16")
    training_loop.train_and_evaluate(config)
    assert seen["train"] == "bfloat16"
    assert tiny_config(tmp_path).matmul_precision == precision.TRAIN_DEFAULT
    assert tiny_config(tmp_path).eval_matmul_precision == precision.EVAL_DEFAULT == "float32"
    for field in ("matmul_precision", "eval_matmul_precision"):
        with pytest.raises(ValueError, match=f"{field} must be one of float32"):
            training_loop.check_config(tiny_config(tmp_path, **{field: "half"}))


def test_training_validates_at_the_evaluation_precision(monkeypatch, tmp_path):
    """Validation is evaluation: it runs at eval_matmul_precision inside training's setting (stopped at the
    first validation, before any training step compiles)."""

    class Stop(Exception):
        pass

    class FakeValidator:
        def __init__(self, *args, **kwargs):
            pass

        def describe(self):
            return "fake"

        def __call__(self, params):
            raise Stop(jax.config.jax_default_matmul_precision)

    monkeypatch.setattr(training_loop, "Validator", FakeValidator)
    config = tiny_config(tmp_path / "run", matmul_precision="bfloat16", eval_matmul_precision="float32")
    with pytest.raises(Stop, match="float32"):
        training_loop.train_and_evaluate(config)


def test_the_cpu_and_gpu_plans_take_the_stepwise_backward():
    """Measured faster than the replay on a CPU and on an H200 (mvmoe_jax/training.py); the reference plan
    differentiates the replay with jax.grad."""
    assert execution.cpu().backward == execution.gpu().backward == "stepwise"
    assert execution.reference().backward == "replay"
