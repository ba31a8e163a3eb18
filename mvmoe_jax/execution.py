"""The execution plan: every choice of how the model's computations run, in one frozen object.

A plan changes speed, never the model: the parameters, the tours and (within float rounding) the gradients
are the same under every plan (``tests/test_execution_plan.py`` turns its fields on one at a time against
``reference``). It is chosen once, at the entry point, from a preset, and passed explicitly: the policy
module holds it (``Policy(cfg, plan)``), so it is part of every jit cache key that the policy is.

Presets:

* ``reference``: the paper's computation written plainly: softmax attention differentiated by autodiff,
  every MoE expert on every token mixed by the gates, a query projection and a combining projection at every
  decoding step, whole batches, and the gradient by ``jax.grad`` of a teacher-forced replay.
* ``cpu``: the choices measured fastest on CPUs (docs/performance.md names each one's section).
* ``gpu``: the choices measured on an H200 (large fused products, whole batches).

``preset_for_platform(platform)`` maps a JAX platform to ``cpu`` or ``gpu``; ``plan_for(name, **overrides)``
builds a plan from a preset name (``auto``: the platform's) and field overrides.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax

from mvmoe_jax import devices, host_memory

PRESETS = ("reference", "cpu", "gpu")
MOE_DISPATCHES = ("dense", "grouped_mlp", "grouped", "sparse", "einsum")
BACKWARDS = ("stepwise", "replay")
REUSE_SAMPLING = ("never", "always", "auto")


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """How a policy's computations run. The defaults are the ``reference`` preset."""

    # --- MoE layers (nn/moe.py; the engines in mvmoe_jax/engines/grouped_experts.py and gates_by_rank.py)
    # dense: every expert on every token, mixed by the gates | grouped_mlp: MLP experts run only on their
    # chosen tokens, sorted into blocks (from grouped_min_assignments assignments per sort on), linear experts
    # dense | grouped: every layer grouped | sparse: capacity buffers, scatter and gather | einsum: one-hot
    # dispatch and combine tensors.
    moe_dispatch: str = "dense"
    grouped_min_assignments: int = 0
    grouped_by_expert: bool = False         # forward-only grouped MLP experts run expert by expert
    grouped_blocks_as_one_product: bool = False  # trace the grouped blocks as one product (FLOP counting only)
    moe_sort_groups: int = 1                # the grouped sort runs within this many groups of units per device
                                            # (training multiplies it by its devices)
    gates_by_rank: bool = False             # forward-only top-1/top-2 dense gates elementwise

    # --- Decoder (nn/policy.py; engines: readout.py, query_tables.py, bounded_softmax.py)
    fused_readout: bool = False             # combining projection folded into the node embeddings per rollout
    readout_column_multiple: int = 1        # the folded readout's node axis padded to this column multiple
    fused_query: bool = False               # every possible query's attention scores tabled per rollout
    query_table_multiple: int = 1           # forward-only score tables padded to this column multiple ...
    query_table_max_columns: int = 0        # ... where that gives at most this many columns (0: no cap)
    score_bound_instances: int = 0          # forward steps over at most this many instances offset the softmax
                                            # by the query tables' score bounds (0: never)
    mix_maps_elementwise: bool = False      # forward-only MoE readout mixed elementwise
    lane_reductions: bool = False           # greedy / sampling reductions over nodes in 16-wide lanes

    # --- Attention (nn/attention.py; engine: engines/attention.py)
    attention_vjp: bool = False             # hand-written attention backward (False: autodiff of the softmax)
    products_against_transposes: bool = False  # that backward transposes before its query contractions
    keys_major_weights: bool = False        # recorded softmax weights kept keys-major
    row_sums_from_output: bool = False      # softmax-backward row sums from the recorded output
    merge_heads_by_slices: bool = False     # a decoding step's heads merged by concatenation
    normalise_after_product: bool = False   # forward-only encoder attention normalised after the value product

    # --- Rollouts (rollout.py, chunked_sampling.py)
    eval_chunk_trajectories: int = 0        # greedy evaluation decodes ~this many trajectories at a time (0: all)
    encoder_tokens: int = 0                 # ... encoding several chunks at once up to this many tokens (0: per chunk)
    sampling_chunk_trajectories: int = 0    # training's sampling pass, likewise (0: a device's whole share)

    # --- Training step (training.py)
    backward: str = "replay"                # stepwise: per-step vjp in a loop | replay: jax.grad of a replay
    reuse_sampling: str = "never"           # the stepwise backward takes the sampling pass's products: auto
                                            # where the record fits training.DECODER_RECORD_BUDGET_BYTES
    replay_steps_at_once: int = 8           # backward=replay: decoding steps vmapped at a time
    replay_remat: bool = False              # backward=replay: each group of steps recomputed in the backward

    # --- Process (set by the entry point before JAX starts; devices.py, host_memory.py)
    cpu_devices: int = 1                    # CPU cores as devices (0: one per core dividing the batches)
    huge_pages: bool = False                # glibc's transparent huge pages for XLA:CPU's buffers

    def __post_init__(self):
        def one_of(name, allowed):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"execution plan field {name} must be one of {allowed}, got {value!r}")

        one_of("moe_dispatch", MOE_DISPATCHES)
        one_of("backward", BACKWARDS)
        one_of("reuse_sampling", REUSE_SAMPLING)
        for name in ("grouped_min_assignments", "query_table_max_columns", "score_bound_instances",
                     "eval_chunk_trajectories",
                     "encoder_tokens", "sampling_chunk_trajectories", "cpu_devices"):
            if getattr(self, name) < 0:
                raise ValueError(f"execution plan field {name} must be >= 0, got {getattr(self, name)}")
        for name in ("moe_sort_groups", "readout_column_multiple", "query_table_multiple", "replay_steps_at_once"):
            if getattr(self, name) < 1:
                raise ValueError(f"execution plan field {name} must be >= 1, got {getattr(self, name)}")

    def replace(self, **changes) -> "ExecutionPlan":
        """This plan with ``changes`` (field names checked)."""
        unknown = set(changes) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown execution plan fields {sorted(unknown)}; the fields are {', '.join(FIELDS)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ExecutionPlan))


def reference() -> ExecutionPlan:
    """The plain computation (see the module docstring)."""
    return ExecutionPlan()


def cpu(avx512: bool | None = None) -> ExecutionPlan:
    """The CPU choices. ``avx512`` (default: this machine's) decides the attention backward's layouts: with
    AVX-512, XLA:CPU's products against a transposed operand win; with AVX2 explicit transposes do
    (docs/performance.md, "Attention backward layouts")."""
    avx512 = devices.cpu_has_avx512() if avx512 is None else avx512
    return ExecutionPlan(
        moe_dispatch="grouped_mlp", grouped_min_assignments=256, grouped_by_expert=True, gates_by_rank=True,
        fused_readout=True, readout_column_multiple=16, fused_query=True, query_table_multiple=8,
        query_table_max_columns=128, score_bound_instances=1, mix_maps_elementwise=True, lane_reductions=True,
        attention_vjp=True, products_against_transposes=not avx512, keys_major_weights=avx512,
        row_sums_from_output=True, merge_heads_by_slices=True, normalise_after_product=True,
        eval_chunk_trajectories=100, encoder_tokens=3264, sampling_chunk_trajectories=100,
        backward="stepwise", reuse_sampling="auto", replay_steps_at_once=2, replay_remat=True, cpu_devices=0,
        huge_pages=True)


def gpu() -> ExecutionPlan:
    """The accelerator choices: the fusions that cut FLOPs, whole batches, the stepwise backward."""
    return ExecutionPlan(
        fused_readout=True, readout_column_multiple=16, fused_query=True, attention_vjp=True,
        products_against_transposes=True, row_sums_from_output=True, backward="stepwise", cpu_devices=0,
        huge_pages=True)


_PRESETS = {"reference": reference, "cpu": cpu, "gpu": gpu}


def preset_for_platform(platform: str) -> str:
    """The preset for a JAX platform name (``jax.default_backend()``): ``cpu`` for CPUs, else ``gpu``."""
    return "cpu" if platform == "cpu" else "gpu"


def plan_for(preset: str, platform: str | None = None, **overrides) -> ExecutionPlan:
    """The plan of ``preset`` (``reference``, ``cpu``, ``gpu``, or ``auto``: ``preset_for_platform(platform)``,
    ``platform`` then required) with ``overrides`` (field name -> value; None values are ignored)."""
    if preset == "auto":
        if platform is None:
            raise ValueError("the auto preset needs the platform (jax.default_backend())")
        preset = preset_for_platform(platform)
    if preset not in _PRESETS:
        raise ValueError(f"unknown execution preset {preset!r}; expected auto or one of {PRESETS}")
    return _PRESETS[preset]().replace(**{k: v for k, v in overrides.items() if v is not None})


def parse_overrides(text: str) -> dict[str, Any]:
    """``"field=value,field=value"`` (a command line's overrides) -> {field: value}, each value parsed as its
    field's type (bools: true/false/1/0)."""
    types = {f.name: type(getattr(ExecutionPlan(), f.name)) for f in dataclasses.fields(ExecutionPlan)}
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in types:
            raise ValueError(f"execution override {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(FIELDS)}")
        kind = types[name]
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"execution override {item!r}: {name} takes true or false")
            out[name] = value.lower() in ("true", "1")
        elif kind is int:
            try:
                out[name] = int(value)
            except ValueError:
                raise ValueError(f"execution override {item!r}: {name} takes an integer") from None
        else:
            out[name] = value
    return out


def default_plan(preset: str = "auto", **overrides) -> ExecutionPlan:
    """``plan_for(preset, jax.default_backend(), **overrides)``: the plan on JAX's default backend, for entry
    points (after ``prepare_process``) and for library calls that are given no plan."""
    return plan_for(preset, jax.default_backend(), **overrides)


def process_settings(preset: str, overrides: Mapping[str, Any]) -> tuple[int, bool]:
    """(cpu_devices, huge_pages) of a plan before JAX starts (the platform is not known yet: ``auto`` takes
    the ``cpu`` preset's, which the ``gpu`` preset shares)."""
    process = {k: overrides.get(k) for k in ("cpu_devices", "huge_pages")}
    plan = plan_for("cpu" if preset == "auto" else preset, **process)
    return plan.cpu_devices, plan.huge_pages


def prepare_process(preset: str, overrides: Mapping[str, Any],
                    batch_sizes: Callable[[], Sequence[int]] = tuple) -> int:
    """An entry point's process settings, before JAX starts: with ``huge_pages`` the process is started again
    with glibc's huge pages (``host_memory``), first thing, then the CPU is presented as ``cpu_devices``
    devices (0: one per core, reduced to the largest count dividing every one of ``batch_sizes()``, which is
    called after the restart, so that the work it does, such as checking a run's config, is not done twice).
    Returns the device count."""
    cpu_devices, huge_pages = process_settings(preset, overrides)
    if huge_pages:
        host_memory.restart_with_huge_pages()
    return devices.use_cpu_devices(cpu_devices, *batch_sizes(), what="execution cpu_devices")
