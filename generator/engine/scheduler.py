"""Continuous batching: sequences holding KV blocks, admitted and retired between steps.

The engine is single-threaded and transport-free. Each :meth:`Engine.step` gives the
running sequences the blocks their next position needs (preempting the youngest when
the pool is short), admits waiting sequences whose blocks fit (one batched prefill of
what the prefix cache does not already hold, bounded by a token budget), runs one decode
step for the sequences already running, samples, and retires finished sequences.

Two classes of service: interactive sequences wait ahead of batch ones (``flex``), and when
the first waiting interactive sequence has no slot or too few blocks, running batch rows are
preempted for it, youngest first. A preempted row keeps its full blocks as cached prefix (they
are reused on its return unless the pool needed them meanwhile) and is resumed with the tokens
an uninterrupted run gives: its tokens are recomputed, and its sampler drew nothing meanwhile.

Within a class, slots are shared fairly between owners (weighted fair queuing over seats, as
Kubernetes' API Priority and Fairness): the next sequence admitted is the first waiting one of
the owner with the fewest running rows of that class per unit of weight (who waits and who is
next: generator.engine.lanes), and when none is free, the youngest row of the owner most over
its share is preempted for an owner under it, as long as the move leaves the first no poorer
than the second (so two owners never trade a slot back and forth).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TypedDict

import torch

from tokenpipe.errors import InvalidRequest
from tokenpipe.wire import FinishReason, SamplingParams

from ..model.forward import decode_step, prefill
from ..model.kvcache import BLOCK_SIZE, SCRATCH, PagedKVCache, auto_budget_bytes, bytes_per_position
from ..model.loader import LoadedModel
from .blocks import ROOT_KEY, BlockPool, prefix_keys
from .graphs import StaticDecode, resolve_cuda_graphs, sample_on_device, table_width
from .lanes import Lanes, running
from .sampling import RowSampler, sample

__all__ = ["Engine", "EngineArgs", "Sequence", "StepOutput"]

log = logging.getLogger(__name__)

_ATTEND_ROUND = 32  # attended length is rounded up to this (fewer distinct shapes, little padding)
# The time-bounded prefill step (Engine._budget): the first prefill's bound before any was measured, the
# least a step may take, the smallest prefill whose time is counted, and how fast the cost follows.
_FIRST_BUDGET = 512
_MIN_BUDGET = 64
_MEASURED_TOKENS = 16
_COST_EWMA = 0.3


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. ``prompt`` includes any tokens carried over on resume."""

    id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    sampler: RowSampler
    generated: list[int] = field(default_factory=list)
    row: int = -1  # 0 while running, -1 while waiting
    finish: FinishReason | None = None
    cancelled: bool = False
    admitted_ns: int = 0
    blocks: list[int] = field(default_factory=list)  # its block table
    keys: list[bytes] = field(default_factory=list)  # prefix keys of its full blocks, as far as computed
    computed: int = 0  # positions whose K/V its blocks hold
    order: int = 0  # admission count: the highest is the youngest, preempted first
    batch: bool = False  # batch work (``flex``): waits behind interactive sequences, preempted for them
    owner: str = ""  # who it runs for (tokenpipe.quota.fair_owner): slots are shared fairly between owners
    weight: float = 1.0  # its owner's fair-share weight

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def next_position(self) -> int:
        """Cache position of the last sampled token (the next decode input)."""
        return len(self.prompt) + len(self.generated) - 1


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq: Sequence
    token: int | None  # None when the sequence ended without a new token (cancel)
    finish: FinishReason | None


class EngineArgs(TypedDict, total=False):
    """:class:`Engine`'s keyword arguments, for those who pass them on (its defaults are its own)."""

    max_batch: int
    max_seq_len: int
    prefill_token_budget: int
    prefill_step_s: float
    max_prompt_tokens: int
    kv_cache_mb: float
    prefix_caching: bool
    admit_reserve_tokens: int
    cuda_graphs: str
    owner_max_running: int


class Engine:
    """Continuous batching over a :class:`LoadedModel` and a paged KV cache (see the module docstring).

    ``max_batch`` caps the running sequences; the KV budget decides how many fit. A preempted row's
    tokens are recomputed when it is admitted again, as vLLM's recompute."""

    def __init__(self, loaded: LoadedModel, *, max_batch: int = 32, max_seq_len: int = 2048,
                 prefill_token_budget: int = 4096, prefill_step_s: float = 0.0, max_prompt_tokens: int = 0,
                 kv_cache_mb: float = 0, prefix_caching: bool = True, admit_reserve_tokens: int = 256,
                 cuda_graphs: str = "off", owner_max_running: int = 0) -> None:
        self.loaded = loaded
        self.lanes: Lanes[Sequence] = Lanes(owner_max_running)
        self.model = loaded.model
        self.device = loaded.device
        self.max_batch = max_batch
        self.max_seq_len = min(max_seq_len, loaded.max_context)
        self.prefill_token_budget = max(prefill_token_budget, 1)
        # A prefill step's time bound (0: the token budget alone), and the seconds a padded prompt token
        # has cost here (None: no prefill measured yet): see _budget.
        self.prefill_step_s = prefill_step_s
        self.prefill_token_s: float | None = None
        self.max_prompt_tokens = max_prompt_tokens or self.max_seq_len - 1
        per_position = bytes_per_position(self.model, loaded.dtype)
        budget = int(kv_cache_mb * 2**20) if kv_cache_mb > 0 else auto_budget_bytes(
            loaded.device, (max_batch * self.max_seq_len + 2 * BLOCK_SIZE) * per_position)
        self.cache = PagedKVCache(self.model, budget, loaded.device, loaded.dtype, min_positions=self.max_seq_len)
        self.pool = self.cache.blocks = BlockPool(self.cache.num_blocks, caching=prefix_caching)
        self.reserve_blocks = -(-min(admit_reserve_tokens, self.max_seq_len) // BLOCK_SIZE)
        self.rows: list[Sequence] = []  # running, oldest admission first
        self.waiting = self.lanes.waiting  # interactive ones first (generator.engine.lanes)
        self.last_step_batch = 0
        self.preemptions = 0
        self.room = self._room()  # read by the worker's thread: an int, replaced whole
        self._admissions = 0
        # Decode over static buffers, captured per batch bucket (generator.engine.graphs); None: the plain step.
        self.static: StaticDecode | None = None
        if resolve_cuda_graphs(cuda_graphs, self.device):
            static = StaticDecode(self.model, self.cache, max_batch=max_batch, max_seq_len=self.max_seq_len,
                                  device=self.device)
            if static.capture(strict=cuda_graphs == "on"):
                self.static = static

    # -- admission -------------------------------------------------------------------
    def new_sequence(self, seq_id: str, prompt: list[int], params: SamplingParams, carried: int = 0, *,
                     batch: bool = False, owner: str = "", weight: float = 1.0) -> Sequence:
        """Validate and build a sequence; raises :class:`InvalidRequest` if it cannot run.

        ``carried`` trailing prompt tokens were generated earlier (crash continuation): they count
        against the context and ``max_tokens`` but not against the prompt-length limit. ``batch``:
        the sequence is batch work; ``owner`` and ``weight``: whom it runs for, and their fair-share
        weight (see the module docstring)."""
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        vocab = int(self.model.config.vocab_size)
        if max(prompt) >= vocab:
            raise InvalidRequest(f"token id {max(prompt)} is outside the vocabulary ({vocab})", param="input_ids")
        room = self.max_seq_len - len(prompt)
        if room < 1:
            raise InvalidRequest(
                f"prompt has {len(prompt)} tokens; this model's context is {self.max_seq_len}", param="prompt"
            )
        if len(prompt) - carried > self.max_prompt_tokens:
            raise InvalidRequest(f"prompt has {len(prompt) - carried} tokens; the limit here is "
                                 f"{self.max_prompt_tokens}", param="prompt")
        return Sequence(id=seq_id, prompt=list(prompt), params=params, max_new=min(params.max_tokens, room),
                        sampler=RowSampler.from_params(params, self.device), batch=batch, owner=owner,
                        weight=weight)

    def add(self, seq: Sequence) -> None:
        self.lanes.enqueue(seq)
        self.room = self._room()

    def cancel(self, seq_id: str) -> bool:
        """Mark a sequence; it leaves the batch (and frees its blocks) at the next step."""
        for seq in (*self.rows, *self.waiting):
            if seq.id == seq_id:
                seq.cancelled = True
                return True
        return False

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire ``seq`` now (e.g. a stop string matched): its blocks are free for the next step."""
        if seq.finish is None:
            seq.finish = reason
            self._retire()

    def abort_all(self) -> list[Sequence]:
        """Drop every sequence (an engine fault), freeing their blocks; returns them."""
        dropped = [*self.rows, *self.waiting]
        for seq in self.rows:
            self._free(seq)
        self.rows.clear()
        self.waiting.clear()
        self.room = self._room()
        return dropped

    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiting

    def _room(self) -> int:
        """More requests the free blocks can take now, at ``reserve_blocks`` each, after what the
        waiting ones need and one block per running row."""
        waiting = sum(-(-len(s.tokens) // BLOCK_SIZE) for s in self.waiting)
        return max(0, (self.pool.available - waiting - len(self.rows)) // self.reserve_blocks)

    # -- one step --------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        out: list[StepOutput] = []
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            seq.finish = "cancelled"
            out.append(StepOutput(seq, None, "cancelled"))
        for seq in self.rows:
            if seq.cancelled and seq.finish is None:
                seq.finish = "cancelled"
                out.append(StepOutput(seq, None, "cancelled"))
        self._retire()

        self._grow()  # may preempt: the rows left all have a block for their next position
        self._yield_to_interactive()  # may preempt batch rows: before the rows to decode are taken
        self._yield_to_fair_share()  # may preempt a row of an owner over its share
        decoding = list(self.rows)  # rows admitted below get their first token from prefill
        admitted = self._admit()
        if admitted:
            out += self._prefill(admitted)
        if decoding:
            out += self._decode(decoding)
        self._retire()
        self.last_step_batch = len(decoding) + len(admitted)
        self.room = self._room()
        return out

    def _grow(self) -> None:
        """Give every running row a block for its next position; preempt the youngest when short
        (a batch row before any interactive one)."""
        for seq in list(self.rows):
            while seq.row >= 0 and seq.next_position // BLOCK_SIZE >= len(seq.blocks):
                if self.pool.available:
                    seq.blocks.append(self.pool.allocate())
                else:
                    self._preempt(max(self.rows, key=lambda s: (s.batch, s.order)), "KV blocks ran out")

    def _yield_to_interactive(self) -> None:
        """Preempt batch rows, youngest first, until the waiting interactive sequences have a slot
        and their blocks each, in order (as :meth:`_admit` takes them), or no batch row is left.

        Blocks are counted without the prefix cache (a cached prompt needs fewer): at worst one
        batch row more waits, never an interactive one."""
        slots = blocks = 0  # taken by the interactive sequences ahead
        for seq in [s for s in self.waiting if not s.batch and not self.lanes.capped(s, self.rows, {})]:
            need = -(-len(seq.tokens) // BLOCK_SIZE)
            while (self.max_batch - len(self.rows) - slots < 1
                   or self.pool.available - len(self.rows) - blocks < need):
                running = [r for r in self.rows if r.batch]
                if not running:
                    return
                self._preempt(max(running, key=lambda s: s.order), "an interactive request waits")
            slots, blocks = slots + 1, blocks + need + 1  # and a block for its next step, as _admit reserves

    def _short_for(self, need: int) -> bool:
        """No slot, or too few blocks, for a sequence of ``need`` blocks (and one for its next step)."""
        return self.max_batch - len(self.rows) < 1 or self.pool.available - len(self.rows) < need + 1

    def _yield_to_fair_share(self) -> None:
        """Preempt rows of the owner most over its share, youngest first, while the next sequence to
        admit (:meth:`Lanes.next`) finds no slot or too few blocks and belongs to an owner under its share.

        Only rows of its class are taken (batch rows for interactive work went in
        :meth:`_yield_to_interactive`). A victim owner ``v`` gives up a row to owner ``c`` only if
        ``(running_v - 1) / weight_v >= (running_c + 1) / weight_c``: after the move ``v`` is still no
        poorer than ``c``, so the same slot is never taken back at the next step."""
        for _ in range(self.max_batch):
            seq = self.lanes.next(self.rows, {})
            if seq is None or self.lanes.capped(seq, self.rows, {}):
                return
            if not self._short_for(-(-len(seq.tokens) // BLOCK_SIZE)):
                return
            mine = [r for r in self.rows if r.batch == seq.batch]
            counts = running(mine)
            victims = [r for r in mine if r.owner != seq.owner]
            if not victims:
                return
            worst = max(victims, key=lambda r: (counts[r.owner] / r.weight, r.order))
            have = counts.get(seq.owner, 0)
            if (counts[worst.owner] - 1) / worst.weight < (have + 1) / seq.weight:
                return
            youngest = max((r for r in victims if r.owner == worst.owner), key=lambda r: r.order)
            self._preempt(youngest, f"owner {seq.owner!r} is under its fair share")

    def _preempt(self, seq: Sequence, why: str) -> None:
        log.info("preempting a sequence: %s", why, extra={"request_id": seq.id, "tokens": len(seq.tokens),
                                                         "batch": seq.batch})
        self._free(seq)  # its full blocks stay cached (keyed): its return prefills only what was evicted
        self.rows.remove(seq)
        self.lanes.enqueue(seq, front=True)  # first of its class again; its tokens are recomputed then
        self.preemptions += 1

    def _budget(self) -> int:
        """Padded tokens this step's prefill may take: the token budget, and on a CPU no more than it
        prefills in ``prefill_step_s`` at the cost measured so far (the first prefill at most
        :data:`_FIRST_BUDGET`). A step runs whole, so a request that arrives during a long admission
        wave waits for it: 32 short chats at once were one 2.9 s step on a 2-core AVX2 CPU, and a
        person's chat behind them waited that long (issue 46). Prefill is compute-bound there, so
        smaller steps cost little throughput; the decode steps of running rows go between them."""
        budget = self.prefill_token_budget
        if self.prefill_step_s <= 0 or self.device.type != "cpu":
            return budget
        if self.prefill_token_s is None:
            return min(budget, _FIRST_BUDGET)
        return max(_MIN_BUDGET, min(budget, int(self.prefill_step_s / self.prefill_token_s)))

    def _admit(self) -> list[Sequence]:
        batch: list[Sequence] = []
        budget = self._budget()
        widest = 0
        reserve = len(self.rows)  # a block each for the running rows' next steps
        admitted: dict[str, int] = {}
        while self.waiting and len(self.rows) + len(batch) < self.max_batch:
            seq = self.lanes.next(self.rows, admitted)
            if seq is None:
                break
            tokens = seq.tokens
            held = self.pool.match(self._keys(seq, len(tokens) - 1))  # at least one token left to compute
            fresh = -(-len(tokens) // BLOCK_SIZE) - len(held)
            widest_if = max(widest, len(tokens) - len(held) * BLOCK_SIZE)
            if (batch and widest_if * (len(batch) + 1) > budget) or \
                    fresh + reserve > self.pool.available:
                self.pool.release(held)
                break
            self.waiting.remove(seq)
            admitted[seq.owner] = admitted.get(seq.owner, 0) + 1
            seq.blocks = held + [self.pool.allocate() for _ in range(fresh)]
            seq.computed = len(held) * BLOCK_SIZE
            if not seq.order:  # a prompt's first admission (a preempted one's recompute is not a query)
                self.pool.query_tokens += len(tokens)
                self.pool.hit_tokens += seq.computed
            self._admissions += 1
            seq.order = self._admissions
            batch.append(seq)
            widest, reserve = widest_if, reserve + 1
        return batch

    def _keys(self, seq: Sequence, upto: int) -> list[bytes]:
        """Prefix keys of ``seq``'s full blocks within its first ``upto`` tokens (kept on the sequence:
        its tokens only grow)."""
        full = upto // BLOCK_SIZE
        if len(seq.keys) < full:
            tokens = seq.tokens
            parent = seq.keys[-1] if seq.keys else ROOT_KEY
            seq.keys += prefix_keys(tokens[: full * BLOCK_SIZE], parent, start=len(seq.keys) * BLOCK_SIZE)
        return seq.keys[:full]

    def _register(self, seq: Sequence) -> None:
        """Offer ``seq``'s full computed blocks to the prefix cache."""
        keys = self._keys(seq, seq.computed)
        for block, key in zip(seq.blocks, keys, strict=False):
            self.pool.register(block, key)

    def _prefill(self, seqs: list[Sequence]) -> list[StepOutput]:
        width = max(len(s.tokens) - s.computed for s in seqs)
        N = len(seqs)
        ids = torch.zeros((N, width), dtype=torch.long)
        positions = torch.empty((N, width), dtype=torch.long)
        slots = torch.full((N, width), SCRATCH * BLOCK_SIZE, dtype=torch.long)
        lengths = torch.empty(N, dtype=torch.long)
        span = torch.arange(width)
        for i, s in enumerate(seqs):
            tokens = s.tokens
            n = len(tokens) - s.computed
            ids[i, :n] = torch.tensor(tokens[s.computed:])
            positions[i] = span + s.computed
            table = torch.tensor(s.blocks)
            real = positions[i, :n]
            slots[i, :n] = table[real // BLOCK_SIZE] * BLOCK_SIZE + real % BLOCK_SIZE
            lengths[i] = n
            s.row = 0
            s.admitted_ns = s.admitted_ns or time.time_ns()
        tables = self._tables(seqs, max(len(s.tokens) for s in seqs)) if any(s.computed for s in seqs) else None
        dev = self.device
        started = time.perf_counter()
        logits = prefill(self.model, self.cache, ids.to(dev), positions.to(dev), slots.to(dev), lengths.to(dev),
                         None if tables is None else tables.to(dev))  # [N, V]
        if dev.type == "cpu" and N * width >= _MEASURED_TOKENS:  # synchronous there: the step's own time
            cost = (time.perf_counter() - started) / (N * width)
            last = self.prefill_token_s
            self.prefill_token_s = cost if last is None else last + _COST_EWMA * (cost - last)
        for s in seqs:
            s.computed = len(s.tokens)
            self._register(s)
        self.rows.extend(seqs)
        return self._accept(seqs, logits)

    def _tables(self, seqs: list[Sequence], length: int) -> torch.Tensor:
        """Block tables ``[B, n]`` covering ``length`` positions (rounded up to ``_ATTEND_ROUND``,
        fewer distinct shapes), padded with the scratch block."""
        n = table_width(min(-(-length // _ATTEND_ROUND) * _ATTEND_ROUND, self.max_seq_len))
        tables = torch.full((len(seqs), n), SCRATCH, dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, : len(s.blocks)] = torch.tensor(s.blocks)
        return tables

    def _decode(self, seqs: list[Sequence]) -> list[StepOutput]:
        positions = [s.next_position for s in seqs]
        slots = [s.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for s, p in zip(seqs, positions, strict=True)]
        last = [s.generated[-1] for s in seqs]
        if self.static is not None:
            logits = self.static.decode(last, positions, slots, [s.blocks for s in seqs])  # [B, V]
        else:
            tables = self._tables(seqs, max(positions) + 1)
            dev = self.device
            logits = decode_step(self.model, self.cache, torch.tensor(last, device=dev),
                                 torch.tensor(positions, device=dev), torch.tensor(slots, device=dev),
                                 tables.to(dev))  # [B, V]
        for s in seqs:
            s.computed += 1
            if s.computed % BLOCK_SIZE == 0:
                self._register(s)
        return self._accept(seqs, logits)

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        draw = sample if self.static is None else sample_on_device  # one device -> host copy per step
        tokens = draw(logits, [s.sampler for s in seqs])
        eos = self.loaded.eos_ids
        out = []
        for seq, tok in zip(seqs, tokens, strict=False):
            seq.generated.append(tok)
            if tok in eos and not seq.params.ignore_eos:
                seq.finish = "stop"
            elif len(seq.generated) >= seq.max_new:
                seq.finish = "length"
            out.append(StepOutput(seq, tok, seq.finish))
        return out

    def _free(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.computed, seq.row = [], 0, -1

    def _retire(self) -> None:
        """Drop finished rows and give their blocks back (no K/V moves)."""
        if any(s.finish is not None for s in self.rows):
            for seq in self.rows:
                if seq.finish is not None:
                    self._free(seq)
            self.rows = [s for s in self.rows if s.finish is None]

    # -- convenience -----------------------------------------------------------------
    def run_to_completion(self) -> list[StepOutput]:
        """Step until idle; for tests and in-process benchmarks."""
        outputs: list[StepOutput] = []
        while not self.idle:
            outputs += self.step()
        return outputs
