"""A continuous-batching LLM engine model, shaped after vLLM's scheduler.

Functional core: no I/O, no clock. Callers pass time in. The pool emulator
drives it in real time and the simulator in virtual time, so both see the
same queueing, batching and preemption.

One step = one forward pass over every running sequence: decoding sequences
gain one token, newly admitted sequences prefill (chunked by the token budget)
and emit their first token when the prefill completes. The step time model is
that of a memory-bound decode:

    step = tpot * (1 + batch_slope * (n_seqs - 1) + kv_read_per_token * kv_tokens)
           + prefill_s_per_token * prefill_tokens

so a lone sequence decodes at exactly `tpot` (the tier's static prior), more
sequences cost a little more each (throughput saturates at 1 / (tpot *
batch_slope) tokens/s), and long contexts add the cost of reading their KV.
When a decode step cannot get a KV block, the most recently admitted sequence
is preempted by recompute: its blocks are freed and it returns to the head of
the waiting queue, to prefill prompt and generated tokens again.

A caller may also swap a request out (QLM's GPU-CPU state swap, which only
the simulator does: stock vLLM gives a gateway no such control): its KV
cache goes to host memory (`host_kv_tokens` of room) and, when the request
is swapped in and admitted again, comes back at the host link's speed
instead of being recomputed, so it resumes where it stopped.

Automatic prefix caching, as vLLM does it by default (prefix_cache.py): a
request brings the chained hashes of its prompt's full blocks (`prefix`),
takes its longest run of cached leading blocks at admission (never the
prompt's last token: that one is always computed) and prefills only the
rest; its full prompt blocks enter the cache as they are computed. The n
samples of one request (vLLM's parallel sampling: n engine requests of one
prompt, a `group`) share its prefill: vLLM v1 caches a block when it
schedules it, so a sample admitted in the same step as another takes the
blocks that one computes as hits. (vLLM does that for any two requests; the
model keeps it to the samples of one request, which arrive together, and
leaves distinct requests as the simulator was calibrated with.) A block
that running requests share is counted once, and cached blocks no running
request holds count as free (the KV usage the engine reports leaves them
out, as vLLM's does), evicted least recently freed when room is needed.
Only prompt blocks are cached: the answer's tokens are not known here.

A mixture-of-experts tier (`EngineSpec.moe`, engine/moe.py) splits the step
into its dense part (the formula above, for the attention and the KV reads)
and its MoE layers, whose time grows with the union of experts the step's
tokens activate; each request brings its domain (the prompt's kind), and
requests of one domain share experts:

    step = tpot * ((1 - moe_share) * dense + moe_share * (fixed + union) / (fixed + k)) + prefill
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from gateway.core.engine.moe import ExpertModel, MoeSpec
from gateway.core.engine.prefix_cache import PrefixCache
from gateway.core.prefix import cacheable_blocks


@dataclass(frozen=True, slots=True)
class EngineSpec:
    tpot_s: float
    batch_slope: float
    kv_read_per_token: float
    prefill_s_per_token: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    # GPU-CPU state swap (simulated only: stock vLLM gives a gateway no such control): seconds to move one
    # token's KV cache between GPU and host memory, and how many tokens' worth host memory holds.
    kv_swap_s_per_token: float = 0.0
    host_kv_tokens: int = 0
    # A mixture-of-experts tier: the MoE layers' step time grows with the union of experts (engine/moe.py).
    moe: MoeSpec | None = None
    # Automatic prefix caching (vLLM's default; --no-enable-prefix-caching turns it off).
    prefix_caching: bool = True


class Sequence:
    """One request inside the engine. Times are engine times (seconds)."""

    __slots__ = (
        "rid", "prompt_tokens", "max_tokens", "target_tokens", "cut", "arrival",
        "generated", "computed", "first_scheduled", "first_token_time",
        "finish_time", "finish_reason", "preemptions", "prefill_done_time", "in_host", "domain",
        "prefix", "held", "cached_tokens", "group",
    )

    def __init__(self, rid, prompt_tokens: int, max_tokens: int, output_tokens: int, arrival: float,
                 domain: int = ExpertModel.NEUTRAL, prefix: Seq[int] = (), group: object = None):
        self.rid = rid
        self.group = group  # the request this is one sample of (None: a request of its own)
        self.prefix = prefix  # chained hashes of the prompt's full blocks (empty: nothing to cache)
        self.held: list[int] = []  # the leading ones it holds in the prefix cache
        self.cached_tokens: int | None = None  # prompt tokens its first admission found cached
        self.domain = domain  # its domain's index in the engine's ExpertModel (MoE tiers; NEUTRAL: unknown)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        # The answer the model would give, cut by max_tokens: that cut is finish_reason "length".
        self.target_tokens = max(1, min(output_tokens, max_tokens))
        self.cut = output_tokens > max_tokens
        self.arrival = arrival
        self.generated = 0
        self.computed = 0  # tokens of (prompt + generated) whose KV is in the cache
        self.first_scheduled: float | None = None
        self.prefill_done_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.in_host = False  # its KV cache waits in host memory (swapped out), to be copied back when admitted

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def pending(self) -> int:
        """Tokens the next forward pass must process: 1 while decoding, more while prefilling."""
        return self.context - self.computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class StepReport:
    """What happened during one `advance` call, for metrics and streaming."""

    progressed: list[Sequence] = field(default_factory=list)  # got tokens (or finished), each once
    finished: list[Sequence] = field(default_factory=list)
    inter_token: list[tuple[float, int]] = field(default_factory=list)  # (gap seconds, decode tokens)
    prompt_tokens: int = 0  # prompt tokens prefilled or found cached (recomputes included, as vLLM counts them)
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    experts: float = 0.0  # MoE tiers: the steps' expected distinct experts per layer, summed over the steps


@dataclass(slots=True)
class _Plan:
    start: float
    end: float
    admitted: list[tuple[Sequence, int]]  # (sequence, leading prompt blocks it takes from the prefix cache)
    work: list[tuple[Sequence, int]]  # (sequence, tokens it processes this step)
    decoding: int  # sequences processing exactly their last sampled token
    preempted: list[Sequence]
    union: float = 0.0  # MoE tiers: expected distinct experts per layer the step loads


class Engine:
    def __init__(self, spec: EngineSpec, now: float = 0.0, record_events: bool = False):
        self.spec = spec
        # The prefix cache (None: caching is off); `record_events` keeps what enters and leaves it.
        self.cache = PrefixCache(record_events) if spec.prefix_caching else None
        self.clock = now  # end of the last step, or when the engine last went idle
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._by_id: dict[object, Sequence] = {}
        self.swapped: dict[object, Sequence] = {}  # swapped out, KV cache in host memory, until swapped in or dropped
        self._plan: _Plan | None = None  # cached until state changes
        self.last_step_end = now  # when the last step completed (the clock also moves while idle)
        # Only requests that arrived by then are admitted: a GPU shared by several models serves them
        # first come first served, so the loaded one stops taking requests that came after another's.
        self.admit_until = math.inf
        self.experts = ExpertModel(spec.moe) if spec.moe is not None else None

    # ---- queries ---------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def blocks_used(self) -> int:
        """KV blocks running sequences hold: their own, and the cached ones they share counted once (cached blocks
        no running sequence holds are free)."""
        size = self.spec.block_size
        own = 0
        for s in self.running:  # a plain loop: this runs twice a step, the simulator's hottest line
            own += -(-s.computed // size) - len(s.held)
        return own + (self.cache.referenced if self.cache is not None else 0)

    def kv_usage(self) -> float:
        return min(1.0, self.blocks_used() / self.spec.num_gpu_blocks)

    def get(self, rid) -> Sequence | None:
        return self._by_id.get(rid)

    @property
    def drained(self) -> bool:
        """Nothing runs and nothing it may admit waits (what waits came after `admit_until`)."""
        return not self.running and not (self.waiting and self.waiting[0].arrival <= self.admit_until)

    def gate(self, admit_until: float) -> None:
        if admit_until != self.admit_until:
            self.admit_until = admit_until
            self._plan = None

    def resume(self, at: float) -> None:
        """Its model is on the GPU again from `at`: nothing of it ran while another model was loaded."""
        self.clock = max(self.clock, at)
        self._plan = None

    def next_step_end(self) -> float | None:
        """When the next step would complete, or None if there is nothing to run."""
        plan = self._planned()
        return plan.end if plan else None

    # ---- commands ----------------------------------------------------------
    def add(self, rid, *, prompt_tokens: int, max_tokens: int, output_tokens: int, now: float,
            domain: str | None = None, prefix: Seq[int] = (), group: object = None) -> Sequence:
        """Queue a request; `domain` (the prompt's kind, None if unknown) matters on MoE tiers only; `prefix`: the
        chained hashes of the prompt's full blocks (core/prefix.py), for the prefix cache; `group`: the request
        it is one sample of, whose other samples share its prompt's prefill."""
        if rid in self._by_id:
            raise ValueError(f"duplicate request id {rid!r}")
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if prompt_tokens + max_tokens > self.spec.max_model_len:
            raise ValueError(
                f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds max_model_len {self.spec.max_model_len}"
            )
        if not self.busy:
            self.clock = max(self.clock, now)
        index = self.experts.domain(domain) if self.experts is not None else ExpertModel.NEUTRAL
        seq = Sequence(rid, prompt_tokens, max_tokens, output_tokens, arrival=max(now, 0.0), domain=index,
                       prefix=prefix[:prompt_tokens // self.spec.block_size], group=group)
        self.waiting.append(seq)
        self._by_id[rid] = seq
        self._plan = None
        return seq

    def abort(self, rid, now: float) -> Sequence | None:
        """Drop a request (client went away). Returns it, marked 'abort', or None if unknown or done."""
        seq = self._by_id.pop(rid, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finish_reason = "abort"
        seq.finish_time = max(now, self.clock)
        self._plan = None
        return seq

    def swap_out(self, rid, now: float) -> Sequence | None:
        """GPU-CPU state swap: take a request off the GPU, its KV cache copied to host memory (in the
        background), to resume where it stopped when swapped in. None if unknown, done, or host memory
        cannot hold its KV cache (the caller then aborts it)."""
        seq = self._by_id.get(rid)
        held = sum(s.computed for s in self.swapped.values())
        if seq is None or held + seq.computed > self.spec.host_kv_tokens:
            return None
        del self._by_id[rid]
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)  # its KV cache goes to host memory whole; it comes back as its own blocks
        seq.in_host = seq.computed > 0
        self.swapped[rid] = seq
        self._plan = None
        return seq

    def swap_in(self, rid, now: float) -> Sequence:
        """Queue a swapped-out request again; when admitted its KV cache is copied back, not recomputed."""
        seq = self.swapped.pop(rid)
        if not self.busy:
            self.clock = max(self.clock, now)
        seq.arrival = max(now, 0.0)
        self.waiting.append(seq)
        self._by_id[rid] = seq
        self._plan = None
        return seq

    def drop_swapped(self, rid) -> Sequence | None:
        """Forget a swapped-out request (it went to another instance)."""
        return self.swapped.pop(rid, None)

    def advance(self, until: float) -> StepReport:
        """Run every step that completes by `until`."""
        report = StepReport()
        seen: set[int] = set()
        while True:
            plan = self._planned()
            if plan is None or plan.end > until:
                break
            self._commit(plan, report, seen)
        if not self.busy:
            self.clock = max(self.clock, until)
        return report

    # ---- internals ---------------------------------------------------------
    def _planned(self) -> _Plan | None:
        if self._plan is None and self.busy:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> _Plan | None:
        spec = self.spec
        size = spec.block_size
        start = self.clock

        # Running sequences keep their slots: decoders (one pending token) first
        # so they never starve, then unfinished prefills by chunk. If the KV
        # cache cannot take this step's tokens, preempt the newest sequence.
        # (Sequence.pending is spelt out in these loops: they run every step.)
        running = list(self.running)
        preempted: list[Sequence] = []
        used = self.blocks_used()
        while True:
            budget = spec.max_num_batched_tokens
            free = spec.num_gpu_blocks - used
            work: list[tuple[Sequence, int]] = []
            prefilling: list[tuple[Sequence, int]] = []
            for s in running:
                pending = s.prompt_tokens + s.generated - s.computed
                if pending == 1:
                    work.append((s, 1))
                    budget -= 1
                elif pending > 1:
                    prefilling.append((s, pending))
            for s, pending in prefilling:
                if budget <= 0:
                    break
                chunk = min(pending, budget)
                work.append((s, chunk))
                budget -= chunk
            need = 0
            for s, t in work:  # the new blocks each one's tokens open
                need += -(-(s.computed + t) // size) - (s.computed + size - 1) // size
            if need <= free or not running:
                break
            preempted.append(running.pop())
            used = self._used_without(running, preempted)
        free -= need

        # Admit waiting sequences (FCFS) that have arrived and fit the slot
        # limit, the token budget and the KV cache. After a preemption nothing
        # new is admitted: the cache is full.
        admitted: list[tuple[Sequence, int]] = []
        slots = spec.max_num_seqs - len(running)
        if not preempted:
            computing: dict[object, set[int]] = {}  # group -> the prompt blocks its samples compute in this step
            for s, t in work:
                if s.group is not None:
                    self._computing(computing, s, s.computed + t)
            for s in self.waiting:
                if s.arrival > start or s.arrival > self.admit_until or slots <= 0 or budget <= 0:
                    break
                hit, taken_free = self._hit(s, computing)
                computed = s.computed + hit * size
                chunk = min(s.context - computed, budget)
                blocks = (-(-(computed + chunk) // size) - hit - (-(-s.computed // size))
                          + taken_free + (-(-s.computed // size) if s.in_host else 0))
                if blocks > free:
                    break
                admitted.append((s, hit))
                work.append((s, chunk))
                if s.group is not None:
                    self._computing(computing, s, computed + chunk)
                budget -= chunk
                free -= blocks
                slots -= 1

        if not work and not preempted:
            # Work that cannot start now: a later arrival, or a request whose
            # prompt does not fit even an empty cache (vLLM rejects those at
            # admission; we never admit them, so they wait until aborted).
            later = [s.arrival for s in self.waiting if start < s.arrival <= self.admit_until]
            if not later:
                return None
            self.clock = min(later)
            return self._make_plan()

        decoding = kv_tokens = prefill_tokens = 0
        for s, t in work:
            kv_tokens += s.computed
            if t == 1:
                decoding += 1
            else:
                prefill_tokens += t
        kv_tokens += sum(h for _, h in admitted) * size  # the cached blocks admitted ones start with
        union = 0.0
        factor = 1.0 + spec.batch_slope * max(len(work) - 1, 0) + spec.kv_read_per_token * kv_tokens
        if self.experts is not None:  # MoE: the dense part above, and the MoE layers by the experts loaded
            tokens: dict[int, int] = {}
            for s, t in work:
                tokens[s.domain] = tokens.get(s.domain, 0) + t
            union = self.experts.union(tokens)
            factor = self.experts.step_factor(factor, union)
        duration = spec.tpot_s * factor + spec.prefill_s_per_token * prefill_tokens
        duration += spec.kv_swap_s_per_token * sum(s.computed for s, _ in admitted if s.in_host)  # copied back
        return _Plan(start, start + duration, admitted, work, decoding, preempted, union)

    def _commit(self, plan: _Plan, report: StepReport, seen: set[int]) -> None:
        end = plan.end
        size = self.spec.block_size
        for s in plan.preempted:
            self.running.remove(s)
            self._release(s)
            s.computed = 0  # recompute: prompt and generated tokens prefill again (cached blocks excepted)
            s.preemptions += 1
            report.preemptions += 1
            self.waiting.appendleft(s)
        for s, hit in plan.admitted:
            self.waiting.remove(s)  # admitted ones are at the head, so this is O(1) in practice
            self.running.append(s)
            s.in_host = False
            if s.first_scheduled is None:
                s.first_scheduled = plan.start
            if self.cache is not None and not s.computed:  # a new or recomputed prompt looks up the cache
                self.cache.queries += s.prompt_tokens
                self.cache.hits += hit * size
                for h in s.prefix[:hit]:
                    self.cache.acquire(h)
                s.held = list(s.prefix[:hit])
                s.computed = hit * size
                report.prompt_tokens += hit * size  # vLLM's prompt counter counts the cached part of a prompt too
                if s.cached_tokens is None:
                    s.cached_tokens = hit * size

        cache = self.cache
        prompt_tokens = generated = 0
        for s, tokens in plan.work:  # every step's loop: locals and spelt-out properties keep it lean
            if tokens > 1 or s.generated == 0:
                prompt_tokens += tokens
            s.computed += tokens
            if cache is not None and len(s.held) < len(s.prefix):
                self._store(s)
            if s.computed < s.prompt_tokens + s.generated:
                continue  # prefill continues next step
            # All known tokens are in the cache: the model samples the next one.
            if s.prefill_done_time is None:
                s.prefill_done_time = end
            s.generated += 1
            generated += 1
            if s.first_token_time is None:
                s.first_token_time = end
            if s.generated >= s.target_tokens:
                s.finish_reason = "length" if s.cut else "stop"
                s.finish_time = end
                self.running.remove(s)
                self._release(s)
                del self._by_id[s.rid]
                report.finished.append(s)
            key = id(s)
            if key not in seen:
                seen.add(key)
                report.progressed.append(s)
        report.prompt_tokens += prompt_tokens
        report.generation_tokens += generated
        if plan.decoding:
            report.inter_token.append((end - plan.start, plan.decoding))
        report.steps += 1
        report.experts += plan.union
        if self.cache is not None:  # new blocks took the room of the least recently freed cached ones
            over = self.blocks_used() + len(self.cache.free) - self.spec.num_gpu_blocks
            if over > 0:
                self.cache.evict(over)
        self.clock = self.last_step_end = end
        self._plan = None

    # ---- the prefix cache -----------------------------------------------------
    def _hit(self, s: Sequence, computing: dict[object, set[int]]) -> tuple[int, int]:
        """(leading prompt blocks a waiting sequence would take from the cache, or from those other samples of its
        group compute in this step; how many of them are free cached blocks)."""
        if self.cache is None or s.computed or s.in_host:
            return 0, 0
        most = cacheable_blocks(s.prompt_tokens, self.spec.block_size)
        hit, taken_free = self.cache.match(s.prefix, most)
        siblings = computing.get(s.group, ()) if s.group is not None else ()
        while hit < min(most, len(s.prefix)) and s.prefix[hit] in siblings:
            hit += 1
        return hit, taken_free

    def _computing(self, computing: dict[object, set[int]], s: Sequence, computed: int) -> None:
        """Note, for its group, the full prompt blocks a sample holds once `computed` of its tokens are."""
        if self.cache is not None:
            full = min(computed, s.prompt_tokens) // self.spec.block_size
            computing.setdefault(s.group, set()).update(s.prefix[:full])

    def _store(self, s: Sequence) -> None:
        """The prompt blocks `s` has now computed whole enter the cache (or, cached already, are shared)."""
        assert self.cache is not None
        full = min(s.computed, s.prompt_tokens) // self.spec.block_size
        for h in s.prefix[len(s.held):full]:
            self.cache.acquire(h)
            s.held.append(h)

    def _release(self, s: Sequence) -> None:
        if self.cache is not None and s.held:
            self.cache.release(s.held)
            s.held = []

    def _used_without(self, running: list[Sequence], preempted: list[Sequence]) -> int:
        """Blocks in use once the `preempted` sequences let go of theirs."""
        size = self.spec.block_size
        own = sum(-(-s.computed // size) - len(s.held) for s in running)
        if self.cache is None:
            return own
        return own + self.cache.referenced - self.cache.freed_by([s.held for s in preempted])

    def take_cache_events(self) -> tuple[list[int], list[int]]:
        """(hashes stored, hashes removed) since the last call (with `record_events`)."""
        if self.cache is None:
            return [], []
        stored, removed = self.cache.stored, self.cache.removed
        self.cache.stored, self.cache.removed = [], []
        return stored, removed
