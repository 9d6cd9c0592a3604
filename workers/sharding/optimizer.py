"""The optimizer over one slice of the flat parameters, and its state moved when the slices
change (docs/architecture.md, "Sharded optimizer state").

With ``sharding.group_size`` above 1 each rank steps only the slice of the flat parameters it
owns (``policies/sharding.py``) and holds only that slice's optimizer state: a stepper over
views of the slice of the parameters and of the reduced gradient (``workers/sharding/slice_steppers.py``:
the fused sgd/adam/adamw, or an element-wise ``torch.optim`` optimizer; fp32 parameters are
their own master values). The slices are fixed by the group that forms, so the stepper is
re-made at every join (``reshard``): the state each rank needs comes from the ranks that hold
it at the step the group starts from (``plan_moves``: each byte once, from a holder to its new
owner, in one exchange), and a checkpoint restored on every rank makes each the holder of the
slice it is about to own (``restore``).

What it holds is valid for one step: ``state_step``, the next job step its state is ready for.
It runs ahead of the replica's ``next_step`` where a step's optimizer update was applied and
its parameters' all-gather then failed: that state is good for a group starting after that
step, and for nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from jobspec.job import JobConfig
from jobspec.recipe import OptimizerConfig
from policies.sharding import LostState, Move, ShardingLayout, Span, plan_moves
from workers.comm.comm_group import CommGroup
from workers.comm.communicator import NativeAllReduce
from workers.model.flat_parameters import FlatParameters
from workers.optim.fused import FlatOptimizer
from workers.optim.generic import GenericOptimizer, make_optimizer
from workers.optim.state_codec import decode, encode
from workers.sharding.slice_steppers import Exported, FusedSlice, GenericSlice, check_element_wise


@dataclass(frozen=True)
class KeptSlice:
    """Optimizer state held outside the stepper, for job step ``step``: entries ``span`` of the
    flat vector, each key's state there, the step counts (``template``), and the parameters'
    ``values`` there (at that step)."""

    span: Span
    step: int
    state: dict[str, torch.Tensor]
    template: dict[str, Any]
    values: torch.Tensor


class ShardedOptimizer:
    """The job's optimizer (``config``) over the slice of ``flat`` this rank owns. Holds
    nothing until the first ``reshard`` (or ``restore``)."""

    def __init__(self, config: OptimizerConfig, flat: FlatParameters) -> None:
        """Raises ValueError (naming ``sharding.group_size``) for a generic optimizer that steps
        slices of a parameter otherwise than the whole parameter (``shape_blind``)."""
        if not config.is_fused:
            check_element_wise(config.name, config.kwargs)
        self.config = config
        self.flat = flat
        self.numel = flat.numel
        #: The slice whose state this rank holds (None: none) and the next step it is ready for.
        self.held: Span | None = None
        self.state_step = 0
        #: Slices held before the last regroup, until every rank confirms it (``reshard``).
        self.kept: list[KeptSlice] = []
        self._lock = threading.Lock()  # what it holds changes as a whole (``holding``)
        self.inner = self._over(0, 0)

    def _over(self, lo: int, hi: int, state: Exported | None = None) -> FusedSlice | GenericSlice:
        """A stepper over values ``[lo, hi)`` holding ``state`` (None: zero, or none yet), and
        the gradient slice it steps from (the rest of the gradient is not kept)."""
        self.flat.keep_gradient_slice(lo, hi)
        config = self.config
        if config.is_fused:
            no_decay = None if config.decay_biases_and_norms else self.flat.no_decay_ranges()
            return FusedSlice(str(config.name), config.kwargs, self.flat, no_decay, lo, hi, state)
        return GenericSlice(config.name, config.kwargs, self.flat, config.decay_biases_and_norms, lo, hi, state)

    @property
    def base_lr(self) -> float:
        return self.inner.base_lr

    def step(self, lr: float | None = None) -> None:
        """Step the owned slice from its reduced gradient (the caller all-gathers the values)."""
        self.inner.step(lr)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The held slice's state, by key (one value per entry)."""
        return self.inner.state_tensors()

    def holding(self) -> tuple[tuple[int, int, int, int], ...]:
        """What it holds, for the driver (``Progress.held``, asked on another thread: never a
        half-made change): ``(lo, hi, numel, step)`` of the slice it steps (first), then of
        those kept from an unconfirmed regroup; () for none."""
        with self._lock:
            current = () if self.held is None else ((self.held[0], self.held[1], self.numel, self.state_step),)
            return current + tuple((k.span[0], k.span[1], self.numel, k.step) for k in self.kept)

    def stepped_to(self, step: int) -> None:
        """The slice was stepped: its state is ready for job step ``step``."""
        with self._lock:
            self.state_step = step

    def reshard(
        self, group: CommGroup, layout: ShardingLayout, step: int, before_move: Callable[[], None] = lambda: None
    ) -> None:
        """Hold the state of ``layout.slice_of(group.rank)`` for a group starting at job step
        ``step``: from what the ranks hold at that step (or zero at step 0), each piece sent by
        one holder, the template (step counts) from the first of them, and with each piece the
        parameters' entries (a holder's own slice of them is at that step even where its
        all-gather broke off; the caller all-gathers the rest). Every rank of ``group`` makes
        this call. Raises LostState (naming the entries) if no rank holds some of it,
        CollectiveAborted/CollectiveTimeout if the transfer breaks off.

        Two-phase: nothing this rank holds is dropped or written until the caller has seen
        every rank of the group finish its whole join (``confirm``). The slice it steps, if it
        is for another step (stepped before an all-gather that broke off), is first set aside
        with a copy of its parameters (``kept``: the move writes the parameters); the slices
        it held for ``step`` stay as they are until the transfer has completed, then are kept
        too, beside the new one (``holding`` reports them all). A join that fails part-way,
        here or after, thus leaves every rank a holder of everything it held before (and of
        its new slice where its own part completed). ``before_move`` is called once the move
        is planned, before this rank sends or receives any of it (where chaos strikes)."""
        lo, hi = layout.slice_of(group.rank)
        self._set_aside(step)
        sources = self._held_for(step) if step > 0 else []
        held = self._held_by_rank(group, [source.span for source in sources])
        if step == 0:  # the state is zero everywhere: nothing moves
            with self._lock:
                self.inner, self.held, self.state_step, self.kept = self._over(lo, hi), (lo, hi), 0, []
            return
        moves = plan_moves(held, [layout.slice_of(r) for r in range(group.size)])
        # The template's source holds entries: an empty slice's stepper exports no state at all.
        source = next((rank for rank, spans in enumerate(held) if any(a < b for a, b in spans)), None)
        if source is None:
            raise LostState((0, self.numel))
        first = next((s for s in sources if s.span[0] < s.span[1]), None)
        dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in first.state.items()} if first else {}
        meta = self._from(group, source, {"dtypes": dtypes, "template": first.template if first else {}})
        values = self.flat.values
        new_flat = {k: torch.empty(hi - lo, dtype=getattr(torch, t), device=values.device) for k, t in meta["dtypes"].items()}
        _copy_own_part(sources, (lo, hi), new_flat, values)
        # Received parameters land in scratch, written into place only once all of it is in.
        incoming = torch.empty(hi - lo, dtype=values.dtype, device=values.device)
        sends, receives = _transfers(group.rank, moves, sources, lo, new_flat, incoming)
        before_move()
        group.submit(lambda: group.exchange(sends, receives).complete(), "reshard optimizer state").wait()
        # The slice it stepped (a source) keeps its values, copied: the all-gather overwrites them.
        stepped = sources[0] if sources and self.held == sources[0].span and self.state_step == step else None
        previous = [replace(s, values=s.values.clone()) if s is stepped else s for s in sources]
        previous += [k for k in self.kept if k.step != step]
        for move in moves:
            if move.target == group.rank:
                values[move.lo : move.hi].copy_(incoming[move.lo - lo : move.hi - lo])
        inner = self._over(lo, hi, (new_flat, meta["template"]))
        with self._lock:  # kept: all but what the new slice holds at the same step
            self.kept = [s for s in previous if not (s.step == step and lo <= s.span[0] and s.span[1] <= hi)]
            self.inner, self.held, self.state_step = inner, (lo, hi), step

    def _set_aside(self, step: int) -> None:
        """If the slice this rank steps is for another job step than ``step`` (the group's), keep
        it (with a copy of its parameters, which the move and the all-gather write) among the
        slices kept: nothing of it is overwritten, and it still counts where a later group
        starts at its step."""
        if self.held is None or self.state_step == step:
            return
        lo, hi = self.held
        state, template = self.inner.export()
        aside = KeptSlice(self.held, self.state_step, state, template, self.flat.values[lo:hi].clone())
        with self._lock:
            self.kept = [*self.kept, aside]
            self.held = None

    def _held_for(self, step: int) -> list[KeptSlice]:
        """The slices this rank holds for job step ``step``, one per span: first the one it
        steps, if it is at that step (its values a view of the parameters), then those kept
        from an unconfirmed regroup."""
        found: dict[Span, KeptSlice] = {}
        if self.held is not None and self.state_step == step:
            lo, hi = self.held
            state, template = self.inner.export()
            found[self.held] = KeptSlice(self.held, step, state, template, self.flat.values[lo:hi])
        for kept in self.kept:
            if kept.step == step:
                found.setdefault(kept.span, kept)
        return list(found.values())

    def _held_by_rank(self, group: CommGroup, spans: list[Span]) -> list[list[Span]]:
        """Every rank's ``spans`` (two small all-reduces: how many each holds, then which)."""
        device = self.flat.values.device
        counts = torch.zeros(group.size, dtype=torch.float64, device=device)
        counts[group.rank] = len(spans)
        NativeAllReduce(group).start_sum(counts).wait()
        width = int(counts.max().item())
        table = torch.zeros((group.size, max(width, 1), 2), dtype=torch.float64)
        for index, (a, b) in enumerate(spans):
            table[group.rank, index] = torch.tensor([a, b], dtype=torch.float64)
        on_device = table.to(device)
        NativeAllReduce(group).start_sum(on_device).wait()  # one row each: the sum is every row
        rows = on_device.cpu().tolist()
        return [[(int(a), int(b)) for a, b in rows[rank][: int(count)]] for rank, count in enumerate(counts.cpu().tolist())]

    def confirm(self) -> None:
        """Every rank of the group has its whole state: the slices kept from before go."""
        with self._lock:
            self.kept = []

    def _from(self, group: CommGroup, source: int, value: Any) -> Any:
        """``value`` as rank ``source`` has it (small: encoded and broadcast)."""
        device = self.flat.values.device
        blob = encode(value).to(device) if group.rank == source else torch.empty(0, dtype=torch.uint8, device=device)
        length = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
        group.broadcast(length, root=source)
        if group.rank != source:
            blob = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        group.broadcast(blob, root=source)
        return decode(blob)

    def checkpoint_tensors(self, whole: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The held slice's state as whole-vector ``FlatPieces`` (a checkpoint part copies the
        entries it covers; one outside the held slice is an error) and, with ``whole``, what the
        whole state shares, in the unsharded optimizer's format."""
        if self.held is None:
            raise RuntimeError("this replica holds no optimizer state to checkpoint (a state transfer did not finish)")
        return self.inner.checkpoint_tensors(whole, self.held[0], self.numel)

    def restore(self, flat: dict[str, Any], whole: dict[str, torch.Tensor], span: Span | None = None) -> None:
        """Hold ``span`` (None: all) of a checkpoint's state (written sharded or not, in the
        unsharded optimizer's format; ``flat``: each entry a whole-length tensor or the
        checkpoint's ``workers.checkpoint.parts.SavedFlat``, of which only the span is read, into
        the span's state on the device: nothing whole is built). Checked first as the unsharded
        optimizer checks it (``FusedSlice.saved_span``, ``GenericSlice.saved_span``). Raises
        ValueError if the state is not the optimizer's, CheckpointCorrupt if a file no longer
        reads; either way before anything changed. The span's state is then for no step until
        ``restored_at`` names it (this replica is then its holder at the next join)."""
        config = self.config
        lo, hi = span if span is not None else (0, self.numel)
        if config.is_fused:
            state = FusedSlice.saved_span(str(config.name), config.kwargs, self.flat, flat, whole, lo, hi)
        else:
            state = GenericSlice.saved_span(config.name, config.kwargs, self.flat, config.decay_biases_and_norms, flat, whole, lo, hi)
        inner = self._over(lo, hi, state)
        with self._lock:  # a rollback: what was held in memory (kept too) is replaced
            # -1: a join takes it for no step, should the parameters' span fail to read after it.
            self.inner, self.held, self.state_step, self.kept = inner, (lo, hi), -1, []

    def restored_at(self, step: int) -> None:
        """The restored state is the one for job step ``step``."""
        with self._lock:
            self.state_step = step


def build_optimizer(job: JobConfig, flat: FlatParameters) -> FlatOptimizer | GenericOptimizer | ShardedOptimizer:
    """The job's optimizer over ``flat``: sharded with ``sharding.group_size`` above 1 (its
    slice is known when a group forms), else ``make_optimizer``'s."""
    if job.sharding.enabled:
        return ShardedOptimizer(job.optimizer, flat)
    return make_optimizer(job.optimizer, flat)


def _copy_own_part(
    sources: list[KeptSlice], span: tuple[int, int], new_flat: dict[str, torch.Tensor], values: torch.Tensor
) -> None:
    """Copy what this rank holds (``sources``) of its new slice ``span`` into the slice's state
    (``new_flat``) and the parameters (``values``, the same step's: equal where a source's
    values are these)."""
    lo, hi = span
    for kept in sources:
        a, b = max(lo, kept.span[0]), min(hi, kept.span[1])
        if a < b:
            there, here = slice(a - kept.span[0], b - kept.span[0]), slice(a - lo, b - lo)
            for key in new_flat:
                new_flat[key][here].copy_(kept.state[key][there])
            values[a:b].copy_(kept.values[there])


Transfer = tuple[torch.Tensor, int]  # a tensor and the peer rank it goes to or comes from


def _transfers(
    rank: int, moves: list[Move], sources: list[KeptSlice], lo: int,
    new_flat: dict[str, torch.Tensor], incoming: torch.Tensor,
) -> tuple[list[Transfer], list[Transfer]]:
    """``rank``'s sends and receives for ``moves``: each moved range's state (by key, in sorted
    order) then its parameters, sent from the source that holds it, received into the new
    slice's state (starting at entry ``lo``) and into ``incoming``."""
    sends: list[Transfer] = []
    receives: list[Transfer] = []
    for move in moves:
        if move.source == rank:
            kept = next(s for s in sources if s.span[0] <= move.lo and move.hi <= s.span[1])
            cut = slice(move.lo - kept.span[0], move.hi - kept.span[0])
            sends += [(kept.state[key][cut], move.target) for key in sorted(new_flat)] + [(kept.values[cut], move.target)]
        if move.target == rank:
            receives += [(new_flat[key][move.lo - lo : move.hi - lo], move.source) for key in sorted(new_flat)]
            receives.append((incoming[move.lo - lo : move.hi - lo], move.source))
    return sends, receives
