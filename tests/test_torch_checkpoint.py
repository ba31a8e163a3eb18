"""Tests of the torch-free ``.pt`` reader.

The reference checkpoints are checked for names, shapes, dtypes and parameter counts against the
fixture README, and value-for-value against ``torch.load`` when torch happens to be installed. Everything
else uses small checkpoints written here by hand (zip container + protocol-2 pickle), so the suite needs
no torch: strided/offset views, several dtypes, byte order, and hostile or damaged files.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile

import numpy as np
import pytest

from mvmoe_jax.io.torch_checkpoint import (CheckpointFormatError, UnsafeCheckpointError,
                                           load_torch_checkpoint)
from mvmoe_jax.io.safe_pickle import UnsafePickleError

# ----------------------------------------------------------------------------------------------------
# Expected state dicts of the three reference checkpoints, spelled out from the fixture README.

E, FFN, EXPERTS, LAYERS = 128, 512, 4, 6


def _gate(prefix: str) -> dict[str, tuple[int, ...]]:
    """A MoE layer's gate and its two constant buffers (normal-distribution mean 0 and std 1)."""
    return {f"{prefix}.w_gate": (E, EXPERTS), f"{prefix}.w_noise": (E, EXPERTS),
            f"{prefix}.mean": (1,), f"{prefix}.std": (1,)}


def _linear(prefix: str, out: int, inp: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (out, inp), f"{prefix}.bias": (out,)}


def expected_shapes(model: str) -> dict[str, tuple[int, ...]]:
    shapes = {**_linear("encoder.embedding_depot", E, 2), **_linear("encoder.embedding_node", E, 5)}
    for i in range(LAYERS):
        p = f"encoder.layers.{i}"
        shapes.update({f"{p}.{w}.weight": (E, E) for w in ("Wq", "Wk", "Wv")})
        shapes.update(_linear(f"{p}.multi_head_combine", E, E))
        for k in (1, 2):
            shapes.update({f"{p}.addAndNormalization{k}.norm.weight": (E,),
                           f"{p}.addAndNormalization{k}.norm.bias": (E,)})
        if model == "mtl":
            shapes.update(_linear(f"{p}.feedForward.W1", FFN, E))
            shapes.update(_linear(f"{p}.feedForward.W2", E, FFN))
        else:
            shapes.update(_gate(f"{p}.feedForward"))
            for j in range(EXPERTS):
                shapes.update({**_linear(f"{p}.feedForward.experts.{j}.fc1", FFN, E),
                               **_linear(f"{p}.feedForward.experts.{j}.fc2", E, FFN)})
    # The decoder query is [current node embedding, load, time, length, open]: 128 + 4 inputs.
    shapes.update({"decoder.Wq_last.weight": (E, E + 4), "decoder.Wk.weight": (E, E),
                   "decoder.Wv.weight": (E, E)})
    if model == "mtl":
        shapes.update(_linear("decoder.multi_head_combine", E, E))
    else:
        moe = "decoder.multi_head_combine" if model == "moe" else "decoder.multi_head_combine_moe"
        shapes.update(_gate(moe))
        for j in range(EXPERTS):
            shapes.update(_linear(f"{moe}.experts.{j}", E, E))
        if model == "moe_light":
            shapes["decoder.dense_or_moe.weight"] = (2, E)
            shapes.update(_linear("decoder.multi_head_combine_dense", E, E))
    return shapes


# README totals; they INCLUDE the MoE buffers mean/std (7 MoE layers x 2 x 1 element = 14 for MoE models).
FIXTURES = {"mtl": 1_254_656, "moe": 3_682_190, "moe_light": 3_698_958}
BUFFERS = {"mtl": 0, "moe": 14, "moe_light": 14}


def fixture_path(torch_fixtures, model: str):
    return torch_fixtures / "checkpoints" / f"{model}_n20_fixture.pt"


@pytest.mark.parametrize("model", sorted(FIXTURES))
def test_reference_checkpoint_structure(torch_fixtures, model):
    ckpt = load_torch_checkpoint(fixture_path(torch_fixtures, model))
    assert set(ckpt) == {"epoch", "problem", "model_state_dict"}
    assert ckpt["epoch"] == 200 and ckpt["problem"] == "Train_ALL"
    state = ckpt["model_state_dict"]
    assert isinstance(state, collections.OrderedDict)
    assert {k: v.shape for k, v in state.items()} == expected_shapes(model)
    assert all(v.dtype == np.float32 and v.flags.c_contiguous and v.flags.owndata for v in state.values())
    assert sum(v.size for v in state.values()) == FIXTURES[model]
    buffers = {k: v for k, v in state.items() if k.endswith((".mean", ".std"))}
    assert sum(v.size for v in buffers.values()) == BUFFERS[model]
    for k, v in buffers.items():
        assert v.tolist() == ([0.0] if k.endswith(".mean") else [1.0])
    # Trained weights, not an initialisation artefact: finite and not all equal.
    assert all(np.isfinite(v).all() for v in state.values())
    assert np.std(state["decoder.Wq_last.weight"]) > 0


@pytest.mark.parametrize("model", sorted(FIXTURES))
def test_reference_checkpoint_matches_torch_load(torch_fixtures, model):
    torch = pytest.importorskip("torch")
    path = fixture_path(torch_fixtures, model)
    ours = load_torch_checkpoint(path)
    ref = torch.load(path, map_location="cpu", weights_only=True)
    assert {k: v for k, v in ours.items() if k != "model_state_dict"} == \
        {k: v for k, v in ref.items() if k != "model_state_dict"}
    assert list(ours["model_state_dict"]) == list(ref["model_state_dict"])
    for name, tensor in ref["model_state_dict"].items():
        got = ours["model_state_dict"][name]
        assert got.dtype == np.float32 and got.shape == tuple(tensor.shape)
        np.testing.assert_array_equal(got, tensor.numpy(), err_msg=name)


def test_torch_written_views_and_dtypes(tmp_path):
    """What torch itself writes for views, shared storages and other dtypes reads back identically."""
    torch = pytest.importorskip("torch")
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    obj = {"t": base.t()[2:5, 1:4], "row": base[1], "col": base[:, 3], "i": torch.arange(10)[3:],
           "b": torch.tensor([True, False]), "h": torch.tensor([1.5], dtype=torch.float16),
           "i8": torch.tensor([-1, 7], dtype=torch.int8), "c": torch.tensor([1 + 2j]), "s": torch.tensor(3.0),
           "e": torch.zeros(0, 3), "p": torch.nn.Parameter(torch.ones(2)), "size": torch.Size([2, 3]),
           "bytes": b"ab\xff", "set": {1, 2}}
    torch.save(obj, tmp_path / "views.pt")
    got = load_torch_checkpoint(tmp_path / "views.pt")
    for k, v in obj.items():
        if isinstance(v, torch.Tensor):
            want = v.detach().numpy()
            assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
            np.testing.assert_array_equal(got[k], want, err_msg=k)
        else:
            assert got[k] == (tuple(v) if k == "size" else v), k


# ----------------------------------------------------------------------------------------------------
# A tiny torch-free writer of the zip container, emitting the same opcodes torch.save does.

class Global:
    """A global referenced by name (module, name), written as a GLOBAL or STACK_GLOBAL opcode."""

    def __init__(self, module: str, name: str, stack: bool = False):
        self.module, self.name, self.stack = module, name, stack


class Call:
    """``func(*args)`` written as ``<func> <args> REDUCE``."""

    def __init__(self, func: Global, *args):
        self.func, self.args = func, args


class Storage:
    """A storage record, written as the persistent id ``('storage', torch.<kind>, key, 'cpu', numel)``."""

    def __init__(self, kind: str, key: str, numel: int):
        self.kind, self.key, self.numel = kind, key, numel


def tensor(storage: Storage, offset: int, size: tuple, stride: tuple) -> Call:
    hooks = Call(Global("collections", "OrderedDict"))
    return Call(Global("torch._utils", "_rebuild_tensor_v2"), storage, offset, size, stride, False, hooks)


class _Writer(pickle._Pickler):  # the pure-Python pickler, whose save() can be extended
    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, Global):
            if obj.stack:
                self.save(obj.module)
                self.save(obj.name)
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        elif isinstance(obj, Call):
            self.save(obj.func)
            self.save(obj.args)
            self.write(pickle.REDUCE)
        else:
            super().save(obj, save_persistent_id)

    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ("storage", Global("torch", obj.kind), obj.key, "cpu", obj.numel)
        return None


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Writer(buf, protocol=2).dump(obj)
    return buf.getvalue()


def write_checkpoint(path, obj=None, storages=None, byteorder="little", pkl=None, name="archive"):
    """Write ``<name>/data.pkl`` (``pkl`` bytes, or ``obj`` pickled), ``<name>/data/<key>`` and byteorder."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/data.pkl", pkl if pkl is not None else dumps(obj))
        if byteorder is not None:
            z.writestr(f"{name}/byteorder", byteorder)
        z.writestr(f"{name}/version", "3\n")
        for key, data in (storages or {}).items():
            z.writestr(f"{name}/data/{key}", data)
    return path


# ----------------------------------------------------------------------------------------------------

def test_synthetic_views_dtypes_and_nesting(tmp_path):
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    longs = np.arange(-5, 7, dtype=np.int64)
    flags = np.array([True, False, True])
    store = Storage("DoubleStorage", "0", base.size)
    obj = {
        "transposed": tensor(store, 12, (3, 4), (1, 10)),  # base[1:5, 2:5].T, non-contiguous, offset
        "every_other": tensor(store, 5, (3, 2), (20, 2)),  # base[0:6:2, 5:9:2]
        "broadcast": tensor(store, 7, (2, 3), (0, 1)),  # stride 0, as torch.expand saves
        "scalar": tensor(store, 59, (), ()),
        "empty": tensor(store, 0, (0, 4), (4, 1)),
        "nested": {"longs": [tensor(Storage("LongStorage", "1", longs.size), 2, (2, 5), (5, 1))],
                   "pair": (tensor(Storage("BoolStorage", "2", 3), 0, (3,), (1,)), 42),
                   "param": Call(Global("torch._utils", "_rebuild_parameter"),
                                 tensor(store, 0, (2,), (1,)), True,
                                 Call(Global("collections", "OrderedDict"))),
                   "size": Call(Global("torch", "Size"), (4, 2)),
                   "od": Call(Global("collections", "OrderedDict"), [("a", 1), ("b", 2)])},
        "meta": "x",
    }
    storages = {"0": base.tobytes(), "1": longs.tobytes(), "2": flags.tobytes()}
    got = load_torch_checkpoint(write_checkpoint(tmp_path / "syn.pt", obj, storages))

    np.testing.assert_array_equal(got["transposed"], base[1:5, 2:5].T)
    np.testing.assert_array_equal(got["every_other"], base[0:6:2, 5:9:2])
    np.testing.assert_array_equal(got["broadcast"], np.broadcast_to(base[0, 7:10], (2, 3)))
    assert got["scalar"].shape == () and got["scalar"] == 59.0
    assert got["empty"].shape == (0, 4) and got["empty"].dtype == np.float64
    nested = got["nested"]
    np.testing.assert_array_equal(nested["longs"][0], longs[2:12].reshape(2, 5))
    assert nested["longs"][0].dtype == np.int64
    np.testing.assert_array_equal(nested["pair"][0], flags)
    assert nested["pair"][0].dtype == np.bool_ and nested["pair"][1] == 42
    np.testing.assert_array_equal(nested["param"], [0.0, 1.0])
    assert nested["size"] == (4, 2) and list(nested["od"].items()) == [("a", 1), ("b", 2)]
    assert got["meta"] == "x"
    # Views of one storage come back as independent, writeable, contiguous arrays.
    for a in (got["transposed"], got["every_other"], got["broadcast"], nested["param"]):
        assert a.flags.c_contiguous and a.flags.owndata and a.flags.writeable
    got["transposed"][:] = -1
    assert got["every_other"].min() >= 0


@pytest.mark.parametrize("byteorder", ["little", "big", None])
def test_synthetic_byte_order(tmp_path, byteorder):
    """Storages are decoded per the byteorder record (none: little, as pre-1.12 torch wrote)."""
    values = np.array([1.5, -2.25, 3e300])
    ints = np.array([1, -2, 2**40], dtype=np.int64)
    end = ">" if byteorder == "big" else "<"
    storages = {"0": values.astype(end + "f8").tobytes(), "1": ints.astype(end + "i8").tobytes()}
    obj = {"f": tensor(Storage("DoubleStorage", "0", 3), 0, (3,), (1,)),
           "i": tensor(Storage("LongStorage", "1", 3), 1, (2,), (1,))}
    got = load_torch_checkpoint(write_checkpoint(tmp_path / "bo.pt", obj, storages, byteorder=byteorder))
    np.testing.assert_array_equal(got["f"], values)
    np.testing.assert_array_equal(got["i"], ints[1:])
    assert got["f"].dtype.isnative and got["i"].dtype.isnative


HOSTILE = [("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"),
           ("subprocess", "check_output"), ("builtins", "getattr"), ("numpy", "load")]


@pytest.mark.parametrize("stack", [False, True], ids=["GLOBAL", "STACK_GLOBAL"])
@pytest.mark.parametrize("module,name", HOSTILE)
def test_hostile_global_is_refused_and_not_run(tmp_path, module, name, stack):
    marker = tmp_path / "pwned"
    payload = {"eval": f"open({str(marker)!r}, 'w').close()",
               "exec": f"open({str(marker)!r}, 'w').close()",
               "system": f"touch '{marker}'"}.get(name, ["touch", str(marker)])
    # The hostile call hides inside an otherwise ordinary state dict, after a legitimate tensor.
    obj = {"w": tensor(Storage("FloatStorage", "0", 2), 0, (2,), (1,)),
           "evil": Call(Global(module, name, stack), payload)}
    path = write_checkpoint(tmp_path / "evil.pt", obj, {"0": np.ones(2, np.float32).tobytes()})
    with pytest.raises(UnsafeCheckpointError, match=f"{module}.{name}") as err:
        load_torch_checkpoint(path)
    assert str(path) in str(err.value)
    assert isinstance(err.value, UnsafePickleError)
    assert not marker.exists()


def test_hostile_payload_is_live(tmp_path):
    """Control: the eval payload above really does run under a plain unpickler."""
    marker = tmp_path / "pwned"
    pickle.loads(dumps(Call(Global("builtins", "eval"), f"open({str(marker)!r}, 'w').close()")))
    assert marker.exists()


def test_hostile_storage_type_and_persistent_id(tmp_path):
    evil_type = {"w": tensor(Storage("FloatStorage", "0", 1), 0, (1,), (1,))}
    pkl = dumps(evil_type).replace(b"torch\nFloatStorage\n", b"os\nsystem\n")
    path = write_checkpoint(tmp_path / "a.pt", pkl=pkl, storages={"0": b"\0" * 4})
    with pytest.raises(UnsafeCheckpointError, match="os.system"):
        load_torch_checkpoint(path)
    # A persistent id that is not a storage record is refused, not passed on.
    pkl = b"\x80\x02X\x04\x00\x00\x00evilQ."  # PROTO 2, BINUNICODE 'evil', BINPERSID, STOP
    with pytest.raises(CheckpointFormatError, match="persistent id"):
        load_torch_checkpoint(write_checkpoint(tmp_path / "b.pt", pkl=pkl))


def test_missing_file(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_torch_checkpoint(path)


def test_legacy_non_zip_file(tmp_path):
    path = tmp_path / "legacy.pt"
    path.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(CheckpointFormatError, match="not a zip archive") as err:
        load_torch_checkpoint(path)
    assert "legacy" in str(err.value) and "torch.save(torch.load(" in str(err.value)


def test_zip_without_data_pkl(tmp_path):
    path = tmp_path / "nodata.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data/0", b"\0" * 8)
    with pytest.raises(CheckpointFormatError, match="data.pkl"):
        load_torch_checkpoint(path)


def test_missing_storage(tmp_path):
    obj = {"w": tensor(Storage("FloatStorage", "7", 4), 0, (4,), (1,))}
    with pytest.raises(CheckpointFormatError, match=r"storage '7'.*archive/data/7 is not in the archive"):
        load_torch_checkpoint(write_checkpoint(tmp_path / "m.pt", obj, {"0": b"\0" * 16}))


@pytest.mark.parametrize("offset,size,stride", [(1, (4,), (1,)), (0, (2, 3), (3, 1)), (0, (2, 2), (1, 3)),
                                                (4, (), ())])
def test_view_larger_than_storage(tmp_path, offset, size, stride):
    obj = {"w": tensor(Storage("FloatStorage", "0", 4), offset, size, stride)}
    with pytest.raises(CheckpointFormatError, match="too small for a view"):
        load_torch_checkpoint(write_checkpoint(tmp_path / "v.pt", obj, {"0": b"\0" * 16}))


def test_storage_member_shorter_than_record(tmp_path):
    obj = {"w": tensor(Storage("DoubleStorage", "0", 4), 0, (4,), (1,))}
    with pytest.raises(CheckpointFormatError, match="should hold 4 x float64 = 32 bytes"):
        load_torch_checkpoint(write_checkpoint(tmp_path / "s.pt", obj, {"0": b"\0" * 31}))


@pytest.mark.parametrize("offset,size,stride", [(-1, (1,), (1,)), (0, (2,), (-1,)), (0, (2,), (1, 1)),
                                                (0, [2], [1]), (0.5, (1,), (1,))])
def test_malformed_view_arguments(tmp_path, offset, size, stride):
    obj = {"w": tensor(Storage("FloatStorage", "0", 4), offset, size, stride)}
    with pytest.raises(CheckpointFormatError):
        load_torch_checkpoint(write_checkpoint(tmp_path / "x.pt", obj, {"0": b"\0" * 16}))


def test_tensor_storage_must_come_from_archive(tmp_path):
    rebuild = Global("torch._utils", "_rebuild_tensor_v2")
    obj = {"w": Call(rebuild, "not a storage", 0, (1,), (1,), False, None)}
    with pytest.raises(CheckpointFormatError, match="must come from the archive"):
        load_torch_checkpoint(write_checkpoint(tmp_path / "n.pt", obj))


def test_truncated_pickle(tmp_path):
    pkl = dumps({"a": [1, 2, 3]})[:-4]
    with pytest.raises(CheckpointFormatError, match="damaged data.pkl"):
        load_torch_checkpoint(write_checkpoint(tmp_path / "t.pt", pkl=pkl))
