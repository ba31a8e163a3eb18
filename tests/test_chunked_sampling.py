"""Training's sampling pass decoded in per-device chunks (mvmoe_jax/chunked_sampling.py) against the
whole-batch rollout it replaces: the same trajectories and the same record of the decoder's inputs."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO_ROOT, xla_flags_env
from mvmoe_jax import chunked_sampling, execution, instances, rollout, training
from mvmoe_jax.nn.policy import Policy, PolicyConfig

CPU = execution.cpu()

N = 20
TINY = dict(embedding_dim=16, num_heads=2, num_layers=1, ff_hidden_dim=32, expert_loc=("Enc0", "Dec"))
MAX_STEPS = 44


def tiny_policy(model: str) -> PolicyConfig:
    return PolicyConfig(model=model, **TINY)


def mixed_batch(size=8, seed=2):
    # Backhaul variants have 16 of 20 starts, time windows make tours long: chunks finish at different steps.
    return instances.generate(jax.random.key(seed), size, N, ["CVRP", "VRPB", "OVRPTW", "VRPBLTW"])


def whole_and_chunked(policy, params, inst, rng, chunk, mesh=None, record_decoder=True):
    """(whole-batch rollout, chunked sampling) from the same encoder pass, in one program."""

    def both(params, inst, rng):
        encoded = rollout.encode(policy, params, inst, rng, True)
        whole = rollout.rollout(policy, params, inst, pomo_size=N, decode_type="sampling", rng=rng, train=True,
                                max_steps=MAX_STEPS, record=True, encoded=encoded, record_decoder=record_decoder)
        chunked = chunked_sampling.chunked_sampling(policy, params, inst, rng, pomo_size=N, max_steps=MAX_STEPS,
                                                    encoded=encoded, chunk=chunk, mesh=mesh,
                                                    record_decoder=record_decoder)
        return whole, chunked, encoded[1]

    return jax.jit(both)(params, inst, rng)


def assert_same_rollout(whole, chunked):
    """Sampled actions, costs and the record exactly; log-likelihoods and recorded products to float
    rounding (a chunk's products run on fewer rows). The record only up to the steps the batch ran: the
    backward pass reads no further."""
    t = int(whole.num_steps)
    assert int(chunked.num_steps) == t
    for name in ("actions", "cost", "valid", "finished"):
        np.testing.assert_array_equal(getattr(chunked, name), getattr(whole, name), err_msg=name)
    for name in ("masks", "dynamic", "active"):
        np.testing.assert_array_equal(getattr(chunked, name)[:t], getattr(whole, name)[:t], err_msg=name)
    np.testing.assert_allclose(chunked.log_likelihood, whole.log_likelihood, rtol=1e-5, atol=1e-4)
    if whole.decoder is not None:
        for got, want in zip(jax.tree.leaves(chunked.decoder), jax.tree.leaves(whole.decoder)):
            np.testing.assert_allclose(got[:t], want[:t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model,record", [("mvmoe", True), ("pomo_mtl", False)])
def test_chunks_sample_what_the_whole_batch_samples(model, record):
    """Chunks of two instances give the whole batch's trajectories and record (MVMoE/4E: its decoder MoE's
    gating noise taken from the whole batch's draws), including the steps after a chunk has finished,
    which the whole batch still decodes; the auxiliary loss is the encoder's alone."""
    cfg = tiny_policy(model)
    policy = Policy(cfg, CPU)
    params = training.init_params(cfg, jax.random.key(1))
    inst, rng = mixed_batch(), jax.random.key(3)
    whole, chunked, encoder_aux = whole_and_chunked(policy, params, inst, rng, chunk=2, record_decoder=record)
    assert (chunked.decoder is not None) == record
    assert_same_rollout(whole, chunked)
    # Some chunk finished before the batch: its later steps came from its last step's record.
    t = int(whole.num_steps)
    chunk_active = np.asarray(whole.active[:t]).reshape(t, 4, 2, -1).any(axis=(2, 3))        # (T, chunks)
    assert (~chunk_active[t - 2]).any(), "every chunk ran to the batch's end: the test would prove less"
    np.testing.assert_array_equal(chunked.aux_loss, encoder_aux)
    if cfg.moe_at("Dec"):
        assert float(whole.aux_loss) > float(encoder_aux)     # the decoding steps' part, left out by chunks


def test_chunk_sizes_and_bad_input():
    """About 100 trajectories a chunk in the cpu plan (the largest divisor of a device's share within
    ``rollout.chunk_instances``), none in the gpu and reference plans, for MVMoE-L or where one chunk is the
    whole share; clear errors for MVMoE-L, chunks that do not divide the share and storage without a record."""
    cfg = tiny_policy("mvmoe")
    size = chunked_sampling.sampling_chunk_size
    assert [size(cfg, CPU, 50, 32), size(cfg, CPU, 20, 32), size(cfg, CPU, 100, 32)] == [2, 4, 1]
    assert size(cfg, CPU, 20, 6) == 3 and size(cfg, CPU, 20, 5) is None and size(cfg, CPU, 50, 2) is None
    assert size(cfg, execution.gpu(), 50, 32) is None and size(cfg, execution.reference(), 50, 32) is None
    assert size(tiny_policy("mvmoe_light"), CPU, 50, 32) is None

    policy = Policy(cfg, CPU)
    params = training.init_params(cfg, jax.random.key(1))
    inst, rng = mixed_batch(), jax.random.key(3)
    encoded = rollout.encode(policy, params, inst, rng, True)
    run = lambda pol, **kw: chunked_sampling.chunked_sampling(pol, params, inst, rng, pomo_size=N,
                                                              max_steps=MAX_STEPS, encoded=encoded, **kw)
    with pytest.raises(ValueError, match="chunks of 3 instances do not divide a batch of 8"):
        run(policy, chunk=3)
    with pytest.raises(ValueError, match="pass record_decoder=True"):
        run(policy, chunk=2, decoder_buffers=jnp.zeros(()))
    with pytest.raises(ValueError, match="MVMoE-L's gate needs the whole batch"):
        run(Policy(tiny_policy("mvmoe_light"), CPU), chunk=2)


TWO_DEVICE_SCRIPT = r"""
import sys
sys.path.insert(0, "tests")
import jax
from mvmoe_jax import training
from mvmoe_jax.devices import make_mesh
from mvmoe_jax.nn.policy import Policy
import test_chunked_sampling as t
assert len(jax.devices()) == 2
mesh = make_mesh(jax.devices())
for model, record in (("mvmoe", True), ("mvmoe", False), ("pomo_mtl", True)):
    cfg = t.tiny_policy(model)
    policy = Policy(cfg, t.CPU)
    params = training.init_params(cfg, jax.random.key(1))
    whole, chunked, _ = t.whole_and_chunked(policy, params, t.mixed_batch(), jax.random.key(3), chunk=2, mesh=mesh,
                                            record_decoder=record)
    t.assert_same_rollout(whole, chunked)
    print("OK", model, record, int(whole.num_steps))
"""


def test_chunks_on_two_devices_sample_what_the_sharded_batch_samples():
    """On a two-device mesh each device decodes its own chunks (the batch's step count agreed by a pmax)
    and the result is the sharded whole-batch rollout's, with and without the decoder record."""
    env = xla_flags_env("--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", TWO_DEVICE_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("OK") == 3, proc.stdout
