"""The measurement that fills a :class:`~generator.model.kerneltable.KernelTable` and applies it to a plan.

Runs on the calling thread (the generator's engine thread, with its torch thread count), once
per cache key: a second start on the same machine reads ``<data_dir>/kernels/<key>.json``. A
corrupt cache file is measured again (with a warning); the ``kernels`` setting overrides it.
:func:`measure_steps` yields after each timed unit: a generator runs it between engine steps, in the
background (:mod:`generator.model.tuning`); :func:`tune_plan` (benchmarks, tests) measures at once, as follows.

Timings taken while other processes hold the cores pick slow kernels (a table measured beside two busy
processes made a quiet machine's steps 1.4-1.5x slower, and a cached table is never measured again),
so one process measures at a time (a lock beside the cache file, :mod:`generator.model.cachelock`: the
others wait and read its table), and a table measured while other processes used
more than :data:`BUSY_SHARE` of the machine is measured once more, then, still busy, neither trusted
nor cached: the rules serve that run and the next start measures again.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..kernels.build import load_gemv
from .attention import FP32_ATTENTION_ROWS
from .cachelock import one_at_a_time
from .forward import decode_step
from .kerneltable import (
    KERNEL_CHOICES,
    ROLES,
    KernelTable,
    bands_from,
    cache_file,
    cache_key,
    choose,
    kernel_for,
    row_counts,
    rule_table,
    timed,
)
from .kvcache import BLOCK_SIZE, PagedKVCache, bytes_per_position
from .plan import Plan, release_float_weights
from .quant import QuantLinear
from .stack import ROLES as STACK_ROLES
from .stack import STACK_KERNELS, build_stack

__all__ = ["BUSY_SHARE", "OthersLoad", "Tunable", "apply_table", "measure_steps", "measure_table", "prepare_plan",
           "read_cache", "release_freed_memory", "tune_plan", "write_cache"]

log = logging.getLogger(__name__)

_CONTEXT = 256  # positions each row attends in the confirming decode steps (a short chat)
_ATTENTION_MAX_ROWS = 8  # fp32 attention is tried up to this many rows (it lost from 8 rows on, measured)
# Other processes' CPU use (a share of the machine) above which a measurement is not trusted (see the module
# docstring); a quarter leaves room for the idle noise of the stack's own processes (NATS, the relay).
BUSY_SHARE = 0.25


def apply_table(plan: Plan, table: KernelTable, *, keep_packed: bool = False) -> None:
    """Point every projection at its bands; pack the float weights of the roles that use ``packed``
    (and, unless ``keep_packed``, drop packed copies no band uses, so they cost no memory)."""
    for role in ROLES:
        bands = table.bands[role]
        uses = {k for _, k in bands}
        for mod in plan.projections(role):
            if isinstance(mod, QuantLinear):
                mod.bands = bands
                if "packed" in uses:
                    mod.pack()
                elif not keep_packed:
                    mod.packed = None
                if uses & {"gemm8", "amx"}:
                    mod.block()
                elif not keep_packed:
                    mod.blocked = None
                if not keep_packed and "quant" not in uses:
                    mod.drop_torch_weight()  # no band runs torch's quantized kernel: its copy costs memory only
    if plan.stack is not None:
        plan.stack.refresh()
    plan.attention_fp32_rows = table.attention_fp32_rows
    plan.paged_attention_rows = table.paged_attention_rows


@dataclass
class Tunable:
    """What :func:`tune_plan` starts from: the rules applied to the plan, the row counts, and (where a table is
    measured: ``auto`` on a quantized CPU plan) its cache key and file."""

    rules: KernelTable
    counts: tuple[int, ...]
    key: dict[str, Any] | None = None
    path: Path | None = None


def prepare_plan(model: Any, plan: Plan, *, dtype: torch.dtype, dense_rows: int, max_batch: int, name: str,
                 data_dir: str | os.PathLike[str], setting: str = "auto", float_weights: str = "keep") -> Tunable:
    """Load the library where it can serve, build the plan's step ops and stack on it, and name the rules
    table and (where ``setting`` measures) the cache the measured table goes in. Applies nothing.
    ``float_weights``: ``drop`` lets go of the projections' float weights the library can make again
    (:func:`generator.model.plan.release_float_weights`); a table measured without them is cached apart."""
    counts = row_counts(max_batch)
    quantized = plan.quant != "none"
    cpu = next(model.parameters()).device.type == "cpu"
    lib = load_gemv(data_dir) if quantized and cpu else None
    # By rule the library's attention kernel serves every decode step where it is built: 2-6x the torch
    # ops per layer from 1 to 32 rows where measured; the measurement can take it back.
    paged = max(counts) if lib is not None and _kernel_attends(model) else 0
    rules = rule_table(counts, dense_rows, quantized=quantized, attention_fp32_rows=FP32_ATTENTION_ROWS,
                       forced=setting if setting in KERNEL_CHOICES else "", paged_attention_rows=paged,
                       level=lib.level if lib is not None else "")
    for role in ROLES:
        for mod in plan.projections(role):
            if isinstance(mod, QuantLinear):
                mod.gemv_lib = lib
                if lib is None:
                    mod.gemv = None  # its weights cost memory only where the kernel can run
    if float_weights == "drop" and lib is not None:
        freed = release_float_weights(model, plan)
        if freed:
            log.info("float weights of the quantized projections let go: %.0f MB", freed / 2**20,
                     extra={"float_weights": "drop"})
    plan.step_ops = lib is not None  # fewer calls for the same arithmetic: nothing to choose between
    plan.stack = build_stack(model, plan) if lib is not None else None  # the same again, fewer calls still
    if setting in ("gemv", "gemm8", "amx") and lib is None:
        log.warning("TOKENPIPE_KERNELS=%s, but tokenpipe's kernels are not available here: torch's quantized "
                    "kernel serves instead", setting)
    if setting != "auto" or not quantized or not cpu:
        return Tunable(rules, counts)
    floats = all(m.dense is not None for role in ROLES for m in plan.projections(role) if isinstance(m, QuantLinear))
    key = cache_key(name, plan.quant, dtype, counts, gemv=lib.path.name if lib else "", float_weights=floats)
    return Tunable(rules, counts, key, cache_file(data_dir, key))


def tune_plan(model: Any, plan: Plan, *, name: str, dtype: torch.dtype, dense_rows: int, max_batch: int,
              data_dir: str | os.PathLike[str], setting: str = "auto",
              busy_share: float | None = BUSY_SHARE, float_weights: str = "keep") -> KernelTable:
    """The kernel table for ``plan`` (by ``setting``: ``auto`` measured here, now, or cached; ``rules``, or one
    kernel for every decode row count), applied to it. Unquantized and non-CPU plans keep the rules:
    their projections have no second kernel to choose. ``busy_share``: other processes' CPU share
    above which a measurement is discarded for the rules (None: always kept). A generator measures in the
    background instead (:mod:`generator.model.tuning`); this is the benchmarks' and tests' way."""
    t = prepare_plan(model, plan, dtype=dtype, dense_rows=dense_rows, max_batch=max_batch, name=name,
                     data_dir=data_dir, setting=setting, float_weights=float_weights)
    table = t.rules
    if t.key is not None and t.path is not None:
        # The common start reads the cache without taking the lock.
        table = read_cache(t.path, t.key) or _measure_and_cache(t.path, t.key, model, plan, t.rules, t.counts,
                                                                dtype, busy_share)
    apply_table(plan, table)
    log.info("kernel table (%s): %s", table.source, table.summary(),
             extra={"kernels": table.source, "seconds": round(table.seconds, 2), "model": name})
    return table


def release_freed_memory() -> None:
    """Hand the heap the load freed (the float copies quantization made, per tensor; the copies a new kernel
    table dropped) back to the system: glibc
    keeps it otherwise, and an idle generator's RSS counted it (~100 MB for SmolLM2). No-op off glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _kernel_attends(model: Any) -> bool:
    """Whether the attention kernel takes this model's heads (``attention.c``: head size a multiple of 8)."""
    cfg = model.config
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return hd % 8 == 0 and int(cfg.num_attention_heads) % int(cfg.num_key_value_heads) == 0


def _measure_and_cache(path: Path, key: dict[str, Any], model: Any, plan: Plan, rules: KernelTable,
                       counts: tuple[int, ...], dtype: torch.dtype, busy_share: float | None) -> KernelTable:
    """Under the lock: the table another process cached while this one waited, else one measured here
    (cached only if trusted)."""
    with one_at_a_time(path, "measuring the kernel table"):
        table = read_cache(path, key) or _measure_quietly(model, plan, rules, counts, dtype, busy_share)
        if table.source == "measured":
            write_cache(path, table.to_json(key))
    return table


def _measure_quietly(model: Any, plan: Plan, rules: KernelTable, counts: tuple[int, ...], dtype: torch.dtype,
                     busy_share: float | None, attempts: int = 2) -> KernelTable:
    """:func:`measure_table`, kept only if other processes left the CPUs to it; measured once more first
    (a busy spell is often short: another generator loading its model)."""
    spent = 0.0
    for attempt in range(1, attempts + 1):
        load = OthersLoad()
        table = measure_table(model, plan, rules, counts, dtype=dtype)
        spent += table.seconds
        share = load.share()
        if busy_share is None or share is None or share <= busy_share:
            table.seconds = spent
            return table
        last = attempt == attempts
        log.warning("kernel table measured while other processes used %.0f%% of the CPUs: not trusted; %s",
                    100 * share, "the rules serve this run (not cached: the next start measures again)" if last
                    else "measuring again", extra={"others_share": round(share, 2), "limit": busy_share,
                                                   "attempt": attempt})
    return replace(rules, seconds=spent)


class OthersLoad:
    """The CPU time other processes use from now on, as a share of the machine (0 idle, 1 every core
    busy): the machine's busy time in ``/proc/stat`` (steal included: a neighbour VM slows us too) less
    this process's own CPU time."""

    def __init__(self) -> None:
        self._start = _cpu_seconds()

    def share(self) -> float | None:
        """Others' share since construction; None where ``/proc/stat`` cannot be read."""
        got = self.seconds()
        return got[0] / got[1] if got is not None and got[1] > 0 else None

    def seconds(self) -> tuple[float, float] | None:
        """Others' CPU seconds since construction and the machine's (wall time × CPUs), to add up over the
        spells of a measurement run in pieces; None where ``/proc/stat`` cannot be read."""
        end = _cpu_seconds()
        if self._start is None or end is None:
            return None
        (busy0, own0, t0, cpus), (busy1, own1, t1, _) = self._start, end
        return max(0.0, (busy1 - busy0) - (own1 - own0)), (t1 - t0) * cpus


def _cpu_seconds() -> tuple[float, float, float, int] | None:
    """(machine busy CPU seconds, this process's CPU seconds, monotonic time, CPUs counted) now."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            lines = fh.read().splitlines()
        ticks = [int(v) for v in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, IndexError, ValueError):
        return None
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    own = os.times()
    return ((sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.monotonic(),
            max(cpus, 1))


def read_cache(path: os.PathLike[str], key: dict[str, Any]) -> KernelTable | None:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("kernel table cache unreadable; measuring again", extra={"path": str(path), "error": str(exc)})
        return None
    try:
        return KernelTable.from_json(text, key)
    except ValueError as exc:
        log.warning("kernel table cache is corrupt; measuring again", extra={"path": str(path), "error": str(exc)})
        return None


def write_cache(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)  # atomic: a reader never sees half a table
    except OSError as exc:  # a read-only data dir: the table is measured again next start
        log.warning("could not cache the kernel table", extra={"path": str(path), "error": str(exc)})


def measure_table(model: Any, plan: Plan, rules: KernelTable, counts: tuple[int, ...], *,
                  dtype: torch.dtype) -> KernelTable:
    """:func:`measure_steps` run to its end at once."""
    return _run(measure_steps(model, plan, rules, counts, dtype=dtype))


def _run(steps: Generator[None, None, KernelTable]) -> KernelTable:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def measure_steps(model: Any, plan: Plan, rules: KernelTable, counts: tuple[int, ...], *,
                  dtype: torch.dtype) -> Generator[None, None, KernelTable]:
    """Time each candidate kernel on each projection role at each row count; keep a non-default kernel
    only at a clear win (:data:`generator.model.kerneltable.MARGIN`), then keep each changed row count only
    where a whole decode step confirms it. Each call takes the next layer's module, as a step does: one
    module called again and again keeps its weight in the core's cache, which flattered the kernels with
    the largest weights.

    A generator: it yields after each timed unit (one role at one row count, one set of confirming steps;
    tens to a few hundred milliseconds), so the engine thread can serve steps between units
    (:mod:`generator.model.tuning`). A unit may leave other bands applied to the plan: whoever serves
    between units applies its own table first. Its value is the measured table."""
    t0 = time.monotonic()
    times_us: dict[str, dict[str, dict[str, float]]] = {}
    choices: dict[str, dict[int, str]] = {}
    for i, role in enumerate(ROLES):
        mods = [m for m in plan.projections(role) if isinstance(m, QuantLinear)]
        first = mods[0]
        ours = all([m.block() for m in mods])  # the library is built here (each blocked copy made)
        tiles = ours and first.gemv_lib is not None and first.gemv_lib.tiles()
        kernels = ["quant", "dense"] + (["packed"] if all([m.pack() for m in mods]) else []) + \
            (["gemv", "gemm8"] if ours else []) + (["amx"] if tiles else [])
        times_us[role], choices[role] = {}, {}
        for rows in counts:
            with torch.inference_mode():
                x = torch.randn(rows, first.in_features, dtype=dtype)
                got = timed({k: _round_robin(mods, x, k) for k in kernels})
            times_us[role][str(rows)] = {k: round(v * 1e6, 1) for k, v in got.items()}
            choices[role][rows] = choose(got, kernel_for(rules.bands[role], rows))
            yield
        for m in mods:
            m.packed = m.blocked = None  # made again below for the roles whose table uses them
        log.info("measuring kernels: %s (%d/%d)", role, i + 1, len(ROLES),
                 extra={"role": role, "done": i + 1, "of": len(ROLES)})
    measured = KernelTable({role: bands_from(choices[role]) for role in ROLES}, rules.attention_fp32_rows,
                           source="measured", times_us=times_us, paged_attention_rows=rules.paged_attention_rows)
    table = yield from _confirm_steps(model, plan, rules, measured, counts, dtype)
    table.seconds = time.monotonic() - t0
    return table


def _round_robin(mods: list[QuantLinear], x: torch.Tensor, kernel: str) -> Any:
    """A call of ``kernel`` on the next of ``mods`` each time."""
    turn = itertools.cycle(mods)
    return lambda: next(turn).run(x, kernel)


def _confirm(model: Any, plan: Plan, rules: KernelTable, measured: KernelTable, counts: tuple[int, ...],
             dtype: torch.dtype) -> KernelTable:
    """:func:`_confirm_steps` run to its end at once."""
    return _run(_confirm_steps(model, plan, rules, measured, counts, dtype))


def _confirm_steps(model: Any, plan: Plan, rules: KernelTable, measured: KernelTable, counts: tuple[int, ...],
                   dtype: torch.dtype) -> Generator[None, None, KernelTable]:
    """Whole decode steps, alternating, at each row count: the measured kernels against the rules' where they
    differ, and where a layer projection's fastest call was one of torch's kernels, against the library's
    fastest (which keep the step in one call: generator/model/stack.py); the fastest step is kept. Then the paged
    attention kernel against the torch ops (kept unless they win clearly), and fp32 attention against native
    at the few rows left to those. Yields after each set of timed steps."""
    cache = PagedKVCache(model, (_CONTEXT + 2 * BLOCK_SIZE) * bytes_per_position(model, dtype),
                         torch.device("cpu"), dtype, min_positions=_CONTEXT)
    blocks = torch.arange(1, _CONTEXT // BLOCK_SIZE + 1)

    def step(rows: int) -> Any:
        tokens = torch.zeros(rows, dtype=torch.long)
        positions = torch.full((rows,), _CONTEXT - 1)
        slots = torch.full((rows,), int(blocks[-1]) * BLOCK_SIZE + BLOCK_SIZE - 1)
        tables = blocks.expand(rows, -1)  # every row attends the same blocks: the cost, not the content, counts
        return lambda: decode_step(model, cache, tokens, positions, slots, tables)

    steps_ms: dict[str, dict[str, float]] = {}
    final: dict[str, dict[int, str]] = {role: {r: kernel_for(measured.bands[role], r) for r in counts}
                                        for role in ROLES}

    def one_band(rows: int, kernels: dict[str, str]) -> KernelTable:
        return KernelTable({role: ((rows, kernels[role]),) for role in ROLES}, rules.attention_fp32_rows,
                           paged_attention_rows=rules.paged_attention_rows)

    for rows in counts:
        variants = {"rules": one_band(rows, {role: kernel_for(rules.bands[role], rows) for role in ROLES}),
                    "measured": one_band(rows, {role: final[role][rows] for role in ROLES})}
        if plan.stack is not None and any(final[role][rows] not in STACK_KERNELS for role in STACK_ROLES):
            calls = {role: measured.times_us.get(role, {}).get(str(rows), {}) for role in STACK_ROLES}
            ours = {role: min((k for k in STACK_KERNELS if k in t), key=t.__getitem__, default=final[role][rows])
                    for role, t in calls.items()}
            library = one_band(rows, {role: ours.get(role, final[role][rows]) for role in ROLES})
            if library.bands != variants["measured"].bands:
                variants["library"] = library
        if variants["measured"].bands == variants["rules"].bands:
            del variants["measured"]
        if len(variants) == 1:
            continue
        got = _time_tables(plan, variants, step(rows))
        yield
        steps_ms[str(rows)] = {k: round(v * 1e3, 3) for k, v in got.items()}
        best = min(got, key=lambda k: got[k])
        for role in ROLES:
            final[role][rows] = kernel_for(variants[best].bands[role], rows)
    bands = {role: bands_from(final[role]) for role in ROLES}
    paged_rows = 0
    for rows in (r for r in counts if r <= rules.paged_attention_rows):
        variants = {name: KernelTable(bands, rules.attention_fp32_rows, paged_attention_rows=limit)
                    for name, limit in (("paged", rows), ("torch", rows - 1))}
        got = _time_tables(plan, variants, step(rows))
        yield
        steps_ms.setdefault(str(rows), {}).update({f"attention {k}": round(v * 1e3, 3) for k, v in got.items()})
        if choose(got, "paged") != "paged":
            break
        paged_rows = rows
    fp32_rows = rules.attention_fp32_rows
    if dtype != torch.float32:
        fp32_rows = paged_rows  # the rows below are the kernel's: fp32 or not does not apply to them
        for rows in (r for r in counts if paged_rows < r <= _ATTENTION_MAX_ROWS):
            variants = {name: KernelTable(bands, limit, paged_attention_rows=paged_rows)
                        for name, limit in (("fp32", rows), ("native", rows - 1))}
            got = _time_tables(plan, variants, step(rows))
            yield
            steps_ms.setdefault(str(rows), {}).update({f"attention {k}": round(v * 1e3, 3) for k, v in got.items()})
            if choose(got, "fp32" if rows <= FP32_ATTENTION_ROWS else "native") != "fp32":
                break
            fp32_rows = rows
    return KernelTable(bands, fp32_rows, source="measured", times_us=measured.times_us, steps_ms=steps_ms,
                       paged_attention_rows=paged_rows)


def _time_tables(plan: Plan, tables: dict[str, KernelTable], fn: Any) -> dict[str, float]:
    """Seconds per call of ``fn`` under each table, alternating (each applied before its calls)."""
    def run(table: KernelTable) -> None:
        apply_table(plan, table, keep_packed=True)
        fn()
    return timed({name: partial(run, t) for name, t in tables.items()}, rounds=3, min_s=0.0)
