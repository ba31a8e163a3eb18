"""How a batch of instances is searched: greedy POMO decoding with x8 augmentation, or sampling on top of it.

A search is a function ``(decoder, batch, key, real) -> BatchResult`` registered in ``SEARCHES`` under the
name ``--search`` takes; ``batch`` is a batched Instance (B, padded with copies of its first instance) of
which the first ``real`` are wanted. Every search starts from greedy x8's routes and keeps the best it
finds, so none returns a route worse than greedy's.

- ``greedy``: every POMO start (customers 1..P) decoded greedily on the 8 symmetric copies of each instance;
  the best of the 8P rollouts (``rollout.greedy_evaluate``).
- ``sampling``: then rounds of ``samples`` sampled rollouts per start and copy (samples x 8 x P per instance
  a round, all in one batched program), until ``time_limit`` seconds per instance (greedy included,
  compilation not) or ``rounds`` rounds are spent; under a time limit too short for one such round after
  greedy, rounds of as many samples as one round can hold (``round_samples``). Round r draws from
  ``fold_in(key, r)``, so a run with the same seed, inputs and options is repeated exactly by ``rounds`` and
  ``samples`` = the rounds and samples it reports.
- ``eas``: efficient active search (``eas``: EAS-Emb, each instance's node embeddings adapted by Adam on
  REINFORCE over one sampled rollout per start and copy plus imitation of the incumbent), iterations under the
  same time limit and round count (iteration r draws from ``fold_in(key, r)``, likewise repeatable), keeping
  the best solution found; ``BatchResult.adapted`` holds the adapted embeddings.
- ``sgbs``: simulation-guided beam search (``sgbs``: beam width ``beam_width`` and expansion factor ``expansion``
  per symmetric copy, each child valued by a greedy rollout), one pass from the best-ranked starts, then under a
  time limit further passes from the next-ranked starts while time and starts remain (or ``rounds`` passes);
  the time limit is checked before every depth, so the last pass may stop part-way (``depths`` counts them).
  It draws nothing: the seed changes nothing but MVMoE-L's dense-or-MoE draws.
- ``sgbs_eas``: rounds of one EAS iteration then one SGBS pass on the adapted embeddings, sharing the incumbent
  (the authors' SGBS + EAS), under the same time limit and round count.

A search whose first round would not fit ``time_limit`` after greedy x8 (predicted from greedy's time) returns
greedy's result without compiling its own programs.

Memory: a decoding program is compiled for the batch and its size checked against ``Settings.memory_budget``
(default: what the device has free; on a CPU half the free memory, shared by its devices). When it does not
fit, fewer augmented instances are decoded at once (chunks, decoded one after another; same results), and
when one at a time still does not fit, fewer POMO starts are used; ``DecodePlan`` says what was done. EAS's
program is sized the same way, in instances (with their 8 copies) adapted at once.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mvmoe_jax import rollout
from mvmoe_jax.devices import DATA_AXIS, local_mesh, program_memory_bytes
from mvmoe_jax.execution import ExecutionPlan, default_plan
from mvmoe_jax.instances import Instance
from mvmoe_jax.nn.policy import Policy, PolicyConfig
from mvmoe_jax.solve import eas, sgbs

DEFAULT_ROUNDS = 10          # sampling rounds when neither a time limit nor a number of rounds is given
DEFAULT_EAS_ROUNDS = 50      # EAS iterations when neither a time limit nor a number of rounds is given
DEFAULT_SGBS_ROUNDS = 1      # SGBS passes when neither a time limit nor a number of rounds is given
DEFAULT_SGBS_EAS_ROUNDS = 5  # SGBS + EAS rounds likewise


@dataclasses.dataclass(frozen=True)
class Settings:
    """time_limit: seconds per instance for greedy and search together (compilation excluded); rounds: at
    most this many sampling rounds or EAS iterations (default ``DEFAULT_ROUNDS``, ``DEFAULT_EAS_ROUNDS``
    when there is no time limit); samples: sampled rollouts per POMO start and augmentation in a sampling
    round; max_starts: at most this many POMO starts (default all n); memory_budget: bytes a decoding program
    may use on each device (default: see the module docstring); eas_learning_rate and eas_imitation_weight:
    EAS's Adam step size and weight of the imitation loss (``eas``); beam_width and expansion: SGBS's beam nodes
    per symmetric copy and children per node (``sgbs``)."""

    time_limit: float | None = None
    rounds: int | None = None
    samples: int = 8
    max_starts: int | None = None
    memory_budget: int | None = None
    eas_learning_rate: float = eas.LEARNING_RATE
    eas_imitation_weight: float = eas.IMITATION_WEIGHT
    beam_width: int = sgbs.BEAM_WIDTH
    expansion: int = sgbs.EXPANSION

    def __post_init__(self):
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"--time_limit must be a positive number of seconds, got {self.time_limit}")
        if not (isinstance(self.eas_learning_rate, numbers.Real) and 0 < self.eas_learning_rate < float("inf")):
            raise ValueError(f"--eas_learning_rate must be a positive number, got {self.eas_learning_rate!r}")
        if not (isinstance(self.eas_imitation_weight, numbers.Real) and 0 <= self.eas_imitation_weight < float("inf")):
            raise ValueError(f"--eas_imitation_weight must be a number >= 0, got {self.eas_imitation_weight!r}")
        for name in ("rounds", "samples", "max_starts", "memory_budget", "beam_width"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        if not isinstance(self.expansion, (int, np.integer)) or self.expansion < 2:
            raise ValueError(f"--expansion must be an integer >= 2 (the greedy child and at least one other), "
                             f"got {self.expansion!r}")


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """How a batch shape is decoded: ``starts`` of the ``num_customers`` POMO starts, ``chunk`` rows of ``rows``
    at a time, ``memory_bytes`` of ``budget`` per device. ``unit`` names the rows: augmented or sampled instance
    copies, or for EAS instances (each with its 8 copies)."""

    num_customers: int
    starts: int
    chunk: int
    rows: int
    memory_bytes: int
    budget: int
    unit: str = "instance copies"

    @property
    def reduced_starts(self) -> bool:
        return self.starts < self.num_customers

    def describe(self) -> str:
        starts = (f"{self.starts} of {self.num_customers} POMO starts" if self.reduced_starts
                  else f"all {self.starts} POMO starts")
        return f"{starts}, {self.chunk} of {self.rows} {self.unit} decoded at a time"


@dataclasses.dataclass
class BatchResult:
    """Per instance of the batch (B): cost float32 (B,) of the best route found (unit square), actions int32
    (B, T) its decoded actions, greedy_cost (B,) and greedy_actions (B, T) greedy x8's; rounds: sampling rounds,
    EAS iterations, SGBS passes or SGBS + EAS rounds run; samples: sampled rollouts per start and copy in each
    sampling round (sampling only); greedy_seconds: greedy x8's share of ``seconds``; depths: int (B,) each instance's beam-search depths over all passes, those
    until its beam had finished (SGBS searches only);
    seconds: the batch's wall time without compilation; compile_seconds; plans: the
    DecodePlan of each program used; adapted: EAS's adapted node embeddings of the first ``real`` instances,
    float32 (real, 8, N, D) (``eas``, ``sgbs_eas``), else None."""

    cost: np.ndarray
    actions: np.ndarray
    greedy_cost: np.ndarray
    greedy_actions: np.ndarray
    rounds: int
    seconds: float
    compile_seconds: float
    plans: dict[str, DecodePlan]
    samples: int | None = None
    depths: np.ndarray | None = None
    adapted: np.ndarray | None = None
    greedy_seconds: float = 0.0


def memory_budget_bytes() -> int:
    """Bytes a decoding program may use per device: 80% of an accelerator's free memory; on a CPU half the
    free memory, shared out over its devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(0.8 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    return int(0.5 * host_available_bytes() / len(jax.local_devices()))


def host_available_bytes() -> int:
    """Memory the host can give without swapping: Linux's MemAvailable (free memory and reclaimable caches),
    else the free pages, else 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _smaller(value: int, need: int, budget: int, last: tuple[int, int] | None) -> int:
    """The next, smaller ``value`` (chunk or starts) to try when it needs ``need`` bytes against ``budget``: where
    the line through this and the ``last`` (value, need) measurement meets the budget, or without a second
    measurement ``value`` scaled by budget / need; always at least one less, never below 1."""
    if last is not None and last[0] != value and last[1] > need:
        slope = (last[1] - need) / (last[0] - value)
        target = int(value - (need - budget) / slope)
    else:
        target = int(value * 0.9 * budget / need)
    return max(1, min(value - 1, target))


def fit_to_memory(compile_at: Callable[[int, int], object], *, rows: int, starts: int, chunk: int, budget: int,
                  num_customers: int, unit: str = "instance copies"):
    """Compile ``compile_at(chunk, starts)`` (a compiled program with ``memory_analysis``), shrinking the chunk
    and then the starts until it needs at most ``budget`` bytes per device. Returns (compiled, DecodePlan)."""
    last_chunk = last_starts = None
    while True:
        compiled = compile_at(chunk, starts)
        need = compiled.memory_bytes() if hasattr(compiled, "memory_bytes") else program_memory_bytes(compiled)
        if need <= budget:
            return compiled, DecodePlan(num_customers, starts, chunk, rows, need, budget, unit)
        if chunk > 1:
            chunk, last_chunk = _smaller(chunk, need, budget, last_chunk), (chunk, need)
        elif starts > 1:
            starts, last_starts = _smaller(starts, need, budget, last_starts), (starts, need)
        else:
            raise ValueError(f"an instance of n = {num_customers} needs {need / 2**30:.2f} GiB to decode even one "
                             f"start at a time, more than the {budget / 2**30:.2f} GiB available")


def _default_chunk(starts: int, rows: int, num_devices: int, plan: ExecutionPlan) -> int:
    """Rows decoded at once before any memory limit: the plan's chunk (``rollout.chunk_instances``: a CPU's
    cache-sized chunk), else the whole share of the rows."""
    share = -(-rows // num_devices)
    chunk = rollout.chunk_instances(starts, plan.eval_chunk_trajectories)
    return share if chunk is None else min(chunk, share)


def _sample_rows(policy: Policy, params, rows: Instance, key: jax.Array, starts: int, chunk: int,
                 num_devices: int) -> tuple[jax.Array, jax.Array]:
    """Sampled rollouts of M rows (each a batched instance copy), ``chunk`` rows at a time (``lax.map``),
    the chunks dealt out over ``num_devices`` devices; chunk c samples from ``fold_in(key, c)``. Returns the
    best start of each row: cost (M,) (+inf if unfinished) and actions int32 (M, T)."""
    m = rows.locs.shape[0]
    num_chunks = -(-m // chunk)
    num_chunks = -(-num_chunks // num_devices) * num_devices
    idx = jnp.concatenate([jnp.arange(m), jnp.zeros(num_chunks * chunk - m, jnp.int32)])
    chunks = jax.tree.map(lambda x: x[idx].reshape((num_chunks, chunk) + x.shape[1:]), rows)
    ids = jnp.arange(num_chunks)

    def decode(params, key, chunks, ids):
        def one(args):
            c, i = args
            out = rollout.rollout(policy, params, c, pomo_size=starts, decode_type="sampling",
                                  rng=jax.random.fold_in(key, i))
            best = rollout.best_starts(out.replace(cost=jnp.where(out.finished, out.cost, jnp.inf)))
            return best.cost, best.actions
        return jax.lax.map(one, (chunks, ids))

    if num_devices == 1:
        cost, actions = decode(params, key, chunks, ids)
    else:
        # check_vma=False: the rollout's loop starts its log-likelihood sum from zeros that do not vary over the
        # devices and adds sampled choices that do; each device's rows are its own, so nothing is lost unchecked.
        cost, actions = jax.shard_map(decode, mesh=local_mesh(num_devices),
                                      in_specs=(P(), P(), P(DATA_AXIS), P(DATA_AXIS)), out_specs=P(DATA_AXIS),
                                      check_vma=False)(params, key, chunks, ids)
    return cost.reshape(-1)[:m], actions.reshape((-1, actions.shape[-1]))[:m]


@partial(jax.jit, static_argnames=("cfg", "plan", "starts", "samples", "chunk", "num_devices"))
def sampling_round(cfg: PolicyConfig, plan: ExecutionPlan, params, inst: Instance, key: jax.Array, *, starts: int,
                   samples: int, chunk: int, num_devices: int) -> tuple[jax.Array, jax.Array]:
    """One round for a batch (B): ``samples`` sampled rollouts from each of ``starts`` POMO starts on each of
    the 8 symmetric copies of each instance. Returns each instance's best: cost (B,), actions int32 (B, T)."""
    b = inst.locs.shape[0]
    flat = rollout.augmented_batch(inst)                                     # (8B, ...), augmentation-major
    rows = jax.tree.map(lambda x: jnp.concatenate([x] * samples), flat)      # (S 8B, ...): row r is instance r % B
    cost, actions = _sample_rows(Policy(cfg, plan), params, rows, key, starts, chunk, num_devices)
    cost = cost.reshape(-1, b)
    best = jnp.argmin(cost, axis=0)
    actions = actions.reshape(-1, b, actions.shape[-1])
    return cost.min(0), jnp.take_along_axis(actions, best[None, :, None], axis=0)[0]


# Compiled programs and their plans by (model configuration, batch shape, options): they take the parameters as
# an argument, so every model of one configuration shares them, across solves in one process.
_COMPILED: dict[tuple, tuple] = {}


class Decoder:
    """One model on this process's devices, with compiled greedy and sampling programs per batch shape, each
    sized to the memory budget (``fit_to_memory``)."""

    def __init__(self, cfg: PolicyConfig, params, settings: Settings = Settings(),
                 execution: ExecutionPlan | None = None):
        self.cfg, self.settings = cfg, settings
        self.execution = execution or default_plan()
        self.num_devices = len(jax.local_devices())
        self.params = rollout.replicated(params)
        self.budget = settings.memory_budget or memory_budget_bytes()
        self.on_stage: Callable[[str], None] = lambda stage: None    # told what the search is doing (progress)

    def starts(self, n: int) -> int:
        return n if self.settings.max_starts is None else min(n, self.settings.max_starts)

    def _cached(self, key: tuple, build):
        """A cached program whose plan fits this budget, else ``build()`` (timed)."""
        key = (self.cfg, self.execution, self.num_devices, jax.config.jax_default_matmul_precision) + key
        if key in _COMPILED and _COMPILED[key][1].memory_bytes <= self.budget:
            return _COMPILED[key] + (0.0,)
        self.on_stage(f"compiling {key[4]}")
        t0 = time.perf_counter()
        _COMPILED[key] = build()
        return _COMPILED[key] + (time.perf_counter() - t0,)

    def greedy_program(self, batch: Instance):
        """(compiled greedy x8 for batches shaped like ``batch``, DecodePlan, seconds spent compiling now)."""
        b, n = batch.locs.shape[0], batch.locs.shape[1] - 1
        starts, rng = self.starts(n), jax.random.key(0)

        def compile_at(chunk, p):
            return rollout.compile_greedy_evaluate(self.cfg, self.params, batch, rng, pomo_size=p, augment=True,
                                                   chunk_size=chunk, plan=self.execution)
        return self._cached(("greedy", b, n, starts), lambda: fit_to_memory(
            compile_at, rows=8 * b, starts=starts, budget=self.budget,
            chunk=_default_chunk(starts, 8 * b, self.num_devices, self.execution), num_customers=n))

    def sampling_program(self, batch: Instance, starts: int, samples: int):
        """(compiled sampling round, DecodePlan, seconds spent compiling now) for ``starts`` POMO starts and
        ``samples`` rollouts per start and copy."""
        b, n = batch.locs.shape[0], batch.locs.shape[1] - 1
        rows = samples * 8 * b
        args = rollout.replicated((self.params, batch, jax.random.key(0)), self.num_devices)

        def compile_at(chunk, p):
            return sampling_round.lower(self.cfg, self.execution, *args, starts=p, samples=samples, chunk=chunk,
                                        num_devices=self.num_devices).compile()
        return self._cached(("sampling", b, n, starts, samples), lambda: fit_to_memory(
            compile_at, rows=rows, starts=starts, budget=self.budget,
            chunk=_default_chunk(starts, rows, self.num_devices, self.execution), num_customers=n))


    def eas_program(self, batch: Instance, starts: int):
        """((compiled ``eas.start``, compiled ``eas.adapt_iteration``), DecodePlan, seconds spent compiling now) for
        ``starts`` POMO starts; the iteration sized to the memory budget in instances adapted at once."""
        b, n = batch.locs.shape[0], batch.locs.shape[1] - 1
        lr, weight = self.settings.eas_learning_rate, self.settings.eas_imitation_weight
        incumbent = (jnp.zeros((b,), jnp.float32), jnp.zeros((b, 2 * n + 1), jnp.int32))   # greedy's shapes
        args = rollout.replicated((self.params, batch, jax.random.key(0)) + incumbent, self.num_devices)

        def build():
            start = eas.start.lower(self.cfg, self.execution, *args, learning_rate=lr).compile()
            copies, state = start(*args)
            iteration_args = rollout.replicated((self.params, copies, state, jax.random.key(0)), self.num_devices)

            def compile_at(chunk, p):
                return eas.adapt_iteration.lower(self.cfg, self.execution, *iteration_args, starts=p, chunk=chunk,
                                                 num_devices=self.num_devices, learning_rate=lr,
                                                 imitation_weight=weight).compile()
            compiled, decode_plan = fit_to_memory(
                compile_at, rows=b, starts=starts, chunk=eas.default_chunk(b, self.num_devices, self.execution),
                budget=self.budget, num_customers=n, unit="instances (8 copies each)")
            return (start, compiled), decode_plan
        return self._cached(("eas", b, n, starts, lr, weight), build)

    def sgbs_program(self, batch: Instance, starts: int):
        """(``SgbsPrograms``, DecodePlan, seconds spent compiling now) for ``starts`` POMO starts and the settings'
        beam, sized to the memory budget in instances searched at once."""
        b, n = batch.locs.shape[0], batch.locs.shape[1] - 1
        width, expansion, devices = self.settings.beam_width, self.settings.expansion, self.num_devices
        replicated = NamedSharding(local_mesh(devices), P()) if devices > 1 else None
        args = rollout.replicated((self.params, batch, jax.random.key(0)), devices)

        def spec(tree):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree)

        def build():
            encode = eas.encoded_copies.lower(self.cfg, self.execution, *args).compile()
            copies, emb = spec(jax.eval_shape(partial(eas.encoded_copies, self.cfg, self.execution), *args))
            key, depth = spec((jax.eval_shape(lambda: jax.random.key(0)), jax.ShapeDtypeStruct((), jnp.int32)))
            incumbent = spec((jax.ShapeDtypeStruct((b,), jnp.float32), jax.ShapeDtypeStruct((b, 2 * n + 1), jnp.int32)))

            def compile_at(chunk, p):
                options = dict(chunk=chunk, num_devices=devices)
                first = sgbs.first_rollouts.lower(self.cfg, self.execution, self.params, copies, emb, key, starts=p,
                                                  **options)
                first_spec = spec(jax.eval_shape(partial(sgbs.first_rollouts, self.cfg, self.execution, starts=p,
                                                         **options), self.params, copies, emb, key))
                initial = sgbs.initial_beam.lower(copies, first_spec, depth, *incumbent, width=width)
                beam = spec(jax.eval_shape(partial(sgbs.initial_beam, width=width), copies, first_spec, depth,
                                           *incumbent)[0])
                step = sgbs.depth_step.lower(self.cfg, self.execution, self.params, copies, emb, beam, *incumbent,
                                             depth, key, expansion=expansion, **options)
                return SgbsPrograms(encode, first.compile(), initial.compile(), step.compile())

            return fit_to_memory(compile_at, rows=b, starts=starts, budget=self.budget, num_customers=n,
                                 chunk=sgbs.default_chunk(b, devices, self.execution, width, expansion),
                                 unit="instances (8 copies each)")
        return self._cached(("sgbs", b, n, starts, width, expansion), build)


@dataclasses.dataclass(frozen=True)
class SgbsPrograms:
    """SGBS's compiled programs for one batch shape: ``eas.encoded_copies``, ``sgbs.first_rollouts``,
    ``sgbs.initial_beam`` and ``sgbs.depth_step``, called with their array arguments replicated over the devices
    (``rollout.replicated``); ``memory_bytes`` is what the larger of the two searching programs needs per device."""

    encode: object
    first: object
    initial: object
    depth: object

    def memory_bytes(self) -> int:
        return max(program_memory_bytes(self.first), program_memory_bytes(self.depth))


def greedy_search(decoder: Decoder, batch: Instance, key: jax.Array, real: int) -> BatchResult:
    """Greedy x8 from every start (within the memory plan)."""
    compiled, decode_plan, compile_s = decoder.greedy_program(batch)
    decoder.on_stage(f"greedy x8, {decode_plan.chunk} of {decode_plan.rows} copies at a time")
    t0 = time.perf_counter()
    res = jax.device_get(compiled(decoder.params, batch, key))
    seconds = time.perf_counter() - t0
    # An instance none of whose rollouts finished (every start ran into a dead end) keeps cost +inf and an
    # unfinished route: a later search may still find a solution; else the checker reports it unsolved.
    obj, actions = np.asarray(res.obj), np.asarray(res.best_actions)
    return BatchResult(cost=obj, actions=actions, greedy_cost=obj.copy(), greedy_actions=actions.copy(), rounds=0,
                       seconds=seconds, compile_seconds=compile_s, plans={"greedy": decode_plan},
                       greedy_seconds=seconds)


def _run_rounds(result: BatchResult, settings: Settings, real: int, default_rounds: int, first_estimate: float,
                run_round: Callable[[int], None]) -> None:
    """``run_round(r)`` for r = 0, 1, ... while ``settings.rounds`` (else ``default_rounds`` when there is no time
    limit) and the time limit allow, adding each round's seconds and count to ``result``. A round starts only
    when it should end within the budget: predicted from the last round, or for the first by
    ``first_estimate`` seconds."""
    max_rounds = settings.rounds
    if max_rounds is None and settings.time_limit is None:
        max_rounds = default_rounds
    budget = None if settings.time_limit is None else settings.time_limit * real
    last = None
    while max_rounds is None or result.rounds < max_rounds:
        predicted = last if last is not None else first_estimate
        if budget is not None and result.seconds + predicted > budget:
            break
        t0 = time.perf_counter()
        run_round(result.rounds)
        last = time.perf_counter() - t0
        result.seconds += last
        result.rounds += 1


def _first_round_fits(settings: Settings, spent: float, real: int, first_estimate: float) -> bool:
    """Whether the first round, predicted to take ``first_estimate`` seconds, fits the time limit after the
    ``spent`` seconds of greedy x8 (always without a limit). A search whose first round does not fit returns
    greedy's result without compiling its own programs."""
    return settings.time_limit is None or spent + first_estimate <= settings.time_limit * real


# A round's sampled rollout costs about this many greedy rollouts (no argmax, but a draw per step), for
# predicting whether a round fits the time limit.
SAMPLE_PER_GREEDY = 1.5


def round_samples(settings: Settings, greedy_seconds: float, real: int) -> int:
    """Sampled rollouts per start and copy in a sampling round: ``settings.samples``, or under a time limit that
    leaves too little after greedy's ``greedy_seconds`` (for ``real`` instances) for one such round, as many as
    one round can hold (at least 1)."""
    if settings.time_limit is None:
        return settings.samples
    left = settings.time_limit * real - greedy_seconds
    fit = int(left // (SAMPLE_PER_GREEDY * greedy_seconds)) if greedy_seconds > 0 else settings.samples
    return min(settings.samples, max(1, fit))


def sampling_search(decoder: Decoder, batch: Instance, key: jax.Array, real: int) -> BatchResult:
    """Greedy x8 as the incumbent, then sampling rounds while the time limit and round count allow."""
    result = greedy_search(decoder, batch, key, real)
    settings = decoder.settings
    result.samples = round_samples(settings, result.seconds, real)
    if not _first_round_fits(settings, result.seconds, real, SAMPLE_PER_GREEDY * result.samples * result.seconds):
        return result
    compiled, decode_plan, compile_s = decoder.sampling_program(batch, result.plans["greedy"].starts, result.samples)
    result.compile_seconds += compile_s
    result.plans["sampling"] = decode_plan
    params, batch = rollout.replicated((decoder.params, batch), decoder.num_devices)
    round_key = jax.random.fold_in(key, 1)

    def sampling_round(r: int) -> None:
        decoder.on_stage(f"sampling round {r + 1}")
        k = rollout.replicated(jax.random.fold_in(round_key, r), decoder.num_devices)
        cost, actions = jax.device_get(compiled(params, batch, k))
        better = np.asarray(cost) < result.cost
        result.cost = np.where(better, cost, result.cost)
        result.actions = np.where(better[:, None], actions, result.actions)

    # The first round is predicted from greedy's time: greedy decodes 1 / samples of a round's rollouts.
    _run_rounds(result, settings, real, DEFAULT_ROUNDS, SAMPLE_PER_GREEDY * result.samples * result.seconds,
                sampling_round)
    return result


# An EAS iteration's time relative to greedy x8 (one sampled rollout per start and copy, then their replay and its
# backward pass), for predicting whether the first one fits the time limit.
EAS_ITERATION_PER_GREEDY = 4.0


def eas_search(decoder: Decoder, batch: Instance, key: jax.Array, real: int) -> BatchResult:
    """Greedy x8 as the incumbent, then EAS iterations (``eas``) while the time limit and round count allow."""
    result = greedy_search(decoder, batch, key, real)
    if not _first_round_fits(decoder.settings, result.seconds, real, EAS_ITERATION_PER_GREEDY * result.seconds):
        return result
    (start, iteration), decode_plan, compile_s = decoder.eas_program(batch, result.plans["greedy"].starts)
    result.compile_seconds += compile_s
    result.plans["eas"] = decode_plan
    greedy_seconds = result.seconds
    t0 = time.perf_counter()
    copies, state = start(*rollout.replicated((decoder.params, batch, key, result.cost, result.actions),
                                              decoder.num_devices))
    jax.block_until_ready(state)
    result.seconds += time.perf_counter() - t0
    round_key = jax.random.fold_in(key, 1)

    def eas_iteration(r: int) -> None:
        nonlocal state
        decoder.on_stage(f"eas iteration {r + 1}")
        k = rollout.replicated(jax.random.fold_in(round_key, r), decoder.num_devices)
        state = jax.block_until_ready(iteration(decoder.params, copies, state, k))

    _run_rounds(result, decoder.settings, real, DEFAULT_EAS_ROUNDS, EAS_ITERATION_PER_GREEDY * greedy_seconds,
                eas_iteration)
    cost, actions = jax.device_get((state.best_cost, state.best_actions))
    result.cost, result.actions = np.asarray(cost), np.asarray(actions)
    result.adapted = eas.adapted_arrays(state, real)
    return result


# A beam-search depth's time relative to the greedy rollouts from every start of every copy that begin a pass: it
# simulates W (G - 1) rollouts per copy where those run P, none longer, in smaller programs; for predicting whether
# a pass's first depth fits the time limit before one has been timed.
SGBS_DEPTH_PER_ROLLOUTS = 2.0


def _sgbs_depth_estimate(settings: Settings, rollouts_seconds: float, starts: int) -> float:
    """Predicted seconds of a pass's first depth from those of the greedy rollouts from ``starts`` starts."""
    return SGBS_DEPTH_PER_ROLLOUTS * rollouts_seconds * settings.beam_width * (settings.expansion - 1) / starts


def _sgbs_pass(decoder: Decoder, programs: "SgbsPrograms", copies: Instance, emb: jax.Array,
               first: sgbs.FirstRollouts, incumbent: tuple[jax.Array, jax.Array], offset: int, key: jax.Array,
               result: BatchResult, real: int, estimate: float) -> tuple[tuple[jax.Array, jax.Array], float | None]:
    """One SGBS pass from the starts ranked ``offset`` and on (``sgbs.initial_beam``), depth after depth while the
    time limit allows (a depth starts only when it should end within the budget: predicted by the pass's last
    depth, or for the first by ``estimate`` seconds), adding its seconds to ``result`` and to each instance's
    depths those it ran before its beam had finished. Returns the
    incumbent (best_cost (B,), best_actions (B, T + 1)) and the first depth's seconds (None when none ran)."""
    put = partial(rollout.replicated, num_devices=decoder.num_devices)
    budget = None if decoder.settings.time_limit is None else decoder.settings.time_limit * real
    t0 = time.perf_counter()
    beam, cost, actions = jax.block_until_ready(programs.initial(*put((copies, first, jnp.int32(offset)) + incumbent)))
    result.seconds += time.perf_counter() - t0
    first_depth, searching = None, np.ones(result.depths.shape, bool)
    for depth in range(incumbent[1].shape[-1] - 1):
        predicted = estimate if first_depth is None else last
        if budget is not None and result.seconds + predicted > budget:
            break
        t0 = time.perf_counter()
        beam, cost, actions, done = programs.depth(decoder.params, *put((copies, emb, beam, cost, actions,
                                                                         jnp.int32(depth), key)))
        done = np.asarray(jax.device_get(done))
        last = time.perf_counter() - t0
        result.seconds += last
        result.depths += searching
        searching &= ~done
        first_depth = last if first_depth is None else first_depth
        if not searching[:real].any():
            break
    return (cost, actions), first_depth


def _timed(result: BatchResult, run: Callable[[], object]):
    """``run()``'s value once computed, its seconds added to ``result``."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    result.seconds += time.perf_counter() - t0
    return out


def _max_rounds(settings: Settings, default: int) -> int | None:
    """Rounds to run at most: the settings', else ``default`` without a time limit, else no limit."""
    if settings.rounds is None and settings.time_limit is None:
        return default
    return settings.rounds


def sgbs_search(decoder: Decoder, batch: Instance, key: jax.Array, real: int) -> BatchResult:
    """Greedy x8 as the incumbent, then SGBS passes (``sgbs``) while the time limit, round count and the ranked
    starts allow."""
    result = greedy_search(decoder, batch, key, real)
    settings, put = decoder.settings, partial(rollout.replicated, num_devices=decoder.num_devices)
    starts = result.plans["greedy"].starts
    result.depths = np.zeros(batch.locs.shape[0], np.int64)
    # Before a pass: the encoding and the ranked starts' rollouts (about greedy's time), then its first depth.
    if not _first_round_fits(settings, 2 * result.seconds, real, _sgbs_depth_estimate(settings, result.seconds, starts)):
        return result
    programs, decode_plan, compile_s = decoder.sgbs_program(batch, starts)
    result.compile_seconds += compile_s
    result.plans["sgbs"] = decode_plan
    t0 = result.seconds
    copies, emb = _timed(result, lambda: programs.encode(*put((decoder.params, batch, key))))
    first = _timed(result, lambda: programs.first(decoder.params, copies, emb, put(jax.random.fold_in(key, 1))))
    estimate = _sgbs_depth_estimate(settings, result.seconds - t0, decode_plan.starts)
    incumbent = put((jnp.asarray(result.cost), jnp.asarray(result.actions)))
    budget = None if settings.time_limit is None else settings.time_limit * real
    max_rounds = _max_rounds(settings, DEFAULT_SGBS_ROUNDS)
    for offset in range(0, decode_plan.starts, settings.beam_width):
        if max_rounds is not None and result.rounds >= max_rounds:
            break
        if budget is not None and result.seconds + estimate > budget:
            break
        pass_key = put(jax.random.fold_in(jax.random.fold_in(key, 2), result.rounds))
        result.rounds += 1
        decoder.on_stage(f"sgbs pass {result.rounds}")
        incumbent, first_depth = _sgbs_pass(decoder, programs, copies, emb, first, incumbent, offset, pass_key,
                                            result, real, estimate)
        estimate = first_depth or estimate
    cost, actions = jax.device_get(incumbent)
    result.cost, result.actions = np.asarray(cost), np.asarray(actions)
    return result


def sgbs_eas_search(decoder: Decoder, batch: Instance, key: jax.Array, real: int) -> BatchResult:
    """Greedy x8 as the incumbent, then rounds of one EAS iteration (``eas``) and one SGBS pass (``sgbs``) on the
    adapted embeddings, sharing the incumbent, while the time limit and round count allow; a round starts only when
    its iteration, rollouts and first depth should fit, and its pass stops at the depth the budget allows."""
    result = greedy_search(decoder, batch, key, real)
    settings, put = decoder.settings, partial(rollout.replicated, num_devices=decoder.num_devices)
    starts = result.plans["greedy"].starts
    greedy_seconds = result.seconds
    result.depths = np.zeros(batch.locs.shape[0], np.int64)
    if not _first_round_fits(settings, greedy_seconds, real, (EAS_ITERATION_PER_GREEDY + 1) * greedy_seconds
                             + _sgbs_depth_estimate(settings, greedy_seconds, starts)):
        return result
    (start, iteration), eas_plan, eas_compile_s = decoder.eas_program(batch, starts)
    programs, sgbs_plan, sgbs_compile_s = decoder.sgbs_program(batch, starts)
    result.compile_seconds += eas_compile_s + sgbs_compile_s
    result.plans.update(eas=eas_plan, sgbs=sgbs_plan)
    copies, state = _timed(result, lambda: start(*put((decoder.params, batch, key, result.cost, result.actions))))
    budget = None if settings.time_limit is None else settings.time_limit * real
    max_rounds = _max_rounds(settings, DEFAULT_SGBS_EAS_ROUNDS)
    iteration_s, rollouts_s = EAS_ITERATION_PER_GREEDY * greedy_seconds, greedy_seconds
    estimate = _sgbs_depth_estimate(settings, rollouts_s, sgbs_plan.starts)
    while max_rounds is None or result.rounds < max_rounds:
        if budget is not None and result.seconds + iteration_s + rollouts_s + estimate > budget:
            break
        r, t0 = result.rounds, result.seconds
        decoder.on_stage(f"sgbs_eas round {r + 1}")
        state = _timed(result, lambda: iteration(decoder.params, copies, state,
                                                 put(jax.random.fold_in(jax.random.fold_in(key, 1), r))))
        iteration_s, t0 = result.seconds - t0, result.seconds
        result.rounds += 1
        first = _timed(result, lambda: programs.first(decoder.params, copies, state.embeddings,
                                                      put(jax.random.fold_in(jax.random.fold_in(key, 2), r))))
        rollouts_s = result.seconds - t0
        (cost, actions), first_depth = _sgbs_pass(
            decoder, programs, copies, state.embeddings, first, (state.best_cost, state.best_actions), 0,
            put(jax.random.fold_in(jax.random.fold_in(key, 3), r)), result, real, estimate)
        state = state.replace(best_cost=cost, best_actions=actions)
        estimate = first_depth or estimate
    cost, actions = jax.device_get((state.best_cost, state.best_actions))
    result.cost, result.actions = np.asarray(cost), np.asarray(actions)
    result.adapted = eas.adapted_arrays(state, real)
    return result


SEARCHES: dict[str, Callable[[Decoder, Instance, jax.Array, int], BatchResult]] = {
    "greedy": greedy_search,
    "sampling": sampling_search,
    "eas": eas_search,
    "sgbs": sgbs_search,
    "sgbs_eas": sgbs_eas_search,
}
