"""Generators (paper Appendix A), augmentation and the variant table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mvmoe_jax import checker, instances, problems


def test_variant_table():
    assert len(problems.VARIANTS) == 16
    assert len({v.flags for v in problems.VARIANTS}) == 16
    assert problems.TRAIN_VARIANTS == ("CVRP", "OVRP", "VRPB", "VRPL", "VRPTW", "OVRPTW")
    assert set(problems.TRAIN_VARIANTS).isdisjoint(problems.UNSEEN_VARIANTS)
    assert len(problems.UNSEEN_VARIANTS) == 10
    v = problems.get_variant("ovrpbltw")
    assert v.flags == (True, True, True, True) and v.name == "OVRPBLTW"
    assert problems.variant_from_flags(False, True, False, True).name == "VRPBTW"
    assert [x.name for x in problems.parse_variants("CVRP, vrptw")] == ["CVRP", "VRPTW"]
    assert len(problems.parse_variants("ALL")) == 16


@pytest.mark.parametrize("bad", ["VRPX", "TWVRP", "", "OVRPTWL"])
def test_unknown_variant_is_a_clear_error(bad):
    with pytest.raises(problems.UnknownVariantError, match="CVRP, OVRP, VRPB"):
        problems.get_variant(bad) if bad else problems.parse_variants(bad)


def test_bad_size_is_a_clear_error():
    with pytest.raises(ValueError, match="problem size must be one of"):
        instances.generate(jax.random.key(0), 2, 30, "CVRP")


@pytest.mark.parametrize("size", [20, 50, 100] + [pytest.param(n, marks=pytest.mark.slow) for n in (200, 500, 1000)])
def test_appendix_a_distributions_and_feasibility(size):
    batch_per_variant = 48 if size <= 100 else 16 if size <= 200 else 4
    capacity = instances.CAPACITY_BY_SIZE[size]
    for k, var in enumerate(problems.VARIANTS):
        b = jax.device_get(instances.generate(jax.random.key(100 * size + k), batch_per_variant, size, var))
        assert b.locs.shape == (batch_per_variant, size + 1, 2)
        assert instances.variant_names(b) == [var.name] * batch_per_variant
        locs = b.locs
        assert locs.min() >= 0 and locs.max() <= 1
        raw = b.demand[:, 1:] * capacity
        np.testing.assert_allclose(raw, np.round(raw), atol=1e-4)
        assert np.all(b.demand[:, 0] == 0)
        mag = np.abs(np.round(raw))
        assert mag.min() >= 1 and mag.max() <= 9
        n_back = (raw < 0).sum(1)
        assert np.all(n_back == (int(0.2 * size) if var.backhaul else 0))
        np.testing.assert_array_equal(b.route_limit, 3.0 if var.limit else np.inf)
        assert np.all(b.is_open == var.open) and np.all(b.has_tw == var.tw)
        if var.tw:
            e, l, s = b.tw_start[:, 1:], b.tw_end[:, 1:], b.service_time[:, 1:]
            np.testing.assert_allclose(s, 0.2)
            assert np.all(b.tw_end[:, 0] == 3.0) and np.all(b.tw_start[:, 0] == 0)
            assert e.min() >= 0 and l.max() <= 3 and np.all(l > e)
            d0 = np.linalg.norm(locs[:, 1:] - locs[:, :1], axis=-1)
            unclipped = (e > 0) & (l < 3)
            half = (l - e) / 2
            assert half[unclipped].min() >= 0.1 - 1e-5 and half[unclipped].max() <= 1 + 1e-5
            centre = (l + e) / 2
            assert np.all(centre[unclipped] >= d0[unclipped] - 1e-5)
            assert np.all(centre[unclipped] <= 3 - d0[unclipped] - 0.2 + 1e-5)
        else:
            assert not b.tw_start.any() and not b.tw_end.any() and not b.service_time.any()
        unreachable = np.asarray(checker.unreachable_customers(
            instances.generate(jax.random.key(k), batch_per_variant, size, var)))
        assert not unreachable.any(), f"{var.name} n={size}: a customer unreachable by depot -> i -> depot"


def test_distribution_moments():
    """Coordinates ~ U(0,1)^2, raw demand uniform on 1..9, TW half width ~ U(0.1, 1)."""
    b = jax.device_get(instances.generate(jax.random.key(7), 512, 100, "VRPTW"))
    xy = b.locs.reshape(-1)
    assert abs(xy.mean() - 0.5) < 0.01 and abs(xy.var() - 1 / 12) < 0.005
    raw = np.round(b.demand[:, 1:] * 50).astype(int).reshape(-1)
    freq = np.bincount(raw, minlength=10)[1:] / raw.size
    np.testing.assert_allclose(freq, 1 / 9, atol=0.01)
    # Time windows: compare with an independent numpy simulation of Appendix A on the same geometry
    # (clipping to [0, 3] biases the visible widths, so compare like with like).
    e, l = b.tw_start[:, 1:], b.tw_end[:, 1:]
    d0 = np.linalg.norm(b.locs[:, 1:] - b.locs[:, :1], axis=-1)
    rng = np.random.default_rng(0)
    c = rng.uniform(d0, 3 - d0 - 0.2)
    h = rng.uniform(0.1, 1.0, size=d0.shape)
    e_ref, l_ref = np.maximum(0, c - h), np.minimum(3, c + h)
    for ours, ref in [(e, e_ref), (l, l_ref), (l - e, l_ref - e_ref)]:
        assert abs(ours.mean() - ref.mean()) < 0.02 and abs(ours.std() - ref.std()) < 0.02
    assert abs((e == 0).mean() - (e_ref == 0).mean()) < 0.01
    assert abs((l == 3).mean() - (l_ref == 3).mean()) < 0.01


def test_mixed_batch_and_determinism():
    key = jax.random.key(3)
    b = instances.generate(key, 600, 20, problems.TRAIN_VARIANTS)
    names = instances.variant_names(b)
    counts = {v: names.count(v) for v in problems.TRAIN_VARIANTS}
    assert set(names) == set(problems.TRAIN_VARIANTS)
    assert min(counts.values()) > 60, counts
    again = instances.generate(key, 600, 20, problems.TRAIN_VARIANTS)
    for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(again)):
        np.testing.assert_array_equal(x, y)
    other = instances.generate(jax.random.key(4), 600, 20, problems.TRAIN_VARIANTS)
    assert not np.array_equal(b.locs, other.locs)


def test_augment_8_preserves_distances_and_costs():
    b = instances.generate(jax.random.key(1), 4, 20, "OVRPBLTW")
    aug = instances.augment_8(b)
    assert aug.locs.shape == (8, 4, 21, 2)
    np.testing.assert_array_equal(aug.locs[0], b.locs)
    dist = lambda xy: np.linalg.norm(xy[..., :, None, :] - xy[..., None, :, :], axis=-1)
    for k in range(8):
        np.testing.assert_allclose(dist(np.asarray(aug.locs[k])), dist(np.asarray(b.locs)), atol=1e-6)
    assert len({tuple(np.asarray(aug.locs[k, 0, 1])) for k in range(8)}) == 8


# fold_in(key(0), i) for these i gives VRPTW n = 20 first draws with a customer 1.4+ from the depot: no time
# to reach it, serve it and be back by 3 (found by scanning the first two million indices).
UNSERVABLE_FIRST_DRAWS = (1039936, 1475726)


@pytest.mark.parametrize("index", UNSERVABLE_FIRST_DRAWS)
@pytest.mark.parametrize("variant", ["VRPTW", "OVRPBLTW"])
def test_a_time_window_draw_with_an_unservable_customer_is_drawn_again(index, variant):
    key = jax.random.fold_in(jax.random.key(0), index)
    flags = jnp.asarray(problems.get_variant(variant).flags)
    first = instances._draw_instance(key, flags, 20)
    assert not bool(instances.all_customers_servable(first))          # the case this test is about
    assert bool(np.asarray(checker.unreachable_customers(jax.tree.map(lambda x: x[None], first))).any()) \
        or variant.startswith("O")                                      # open routes need no way back
    inst = instances.generate_instance(key, flags, 20)
    assert bool(instances.all_customers_servable(inst))
    assert not np.asarray(checker.unreachable_customers(jax.tree.map(lambda x: x[None], inst))).any()
    # Time windows decide the redraw; without them the first draw stands.
    cvrp = jnp.asarray(problems.get_variant("CVRP").flags)
    np.testing.assert_array_equal(instances.generate_instance(key, cvrp, 20).locs,
                                  instances._draw_instance(key, cvrp, 20).locs)


def test_valid_first_draws_are_kept():
    keys = jax.random.split(jax.random.key(3), 256)
    flags = jnp.asarray(problems.get_variant("VRPLTW").flags)
    first = jax.vmap(instances._draw_instance, in_axes=(0, None, None))(keys, flags, 50)
    assert np.asarray(jax.vmap(instances.all_customers_servable)(first)).all()
    inst = jax.vmap(instances.generate_instance, in_axes=(0, None, None))(keys, flags, 50)
    jax.tree.map(np.testing.assert_array_equal, inst, first)
