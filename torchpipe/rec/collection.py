"""`CachedEmbeddingBagCollection`: a TorchRec-compatible EBC whose tables live on the host.

Each table is a `HostEmbeddingTable` (rows with their optimizer state) and a device slot
tensor managed by an `EmbeddingCache`. One batch goes through separate steps so that a
pipeline can run them on different threads for consecutive batches:

``prepare`` (validate + dedup, host) -> ``plan`` (slots, evictions, protection, host
ticket; serial, batch order) -> ``gather_out`` (device) -> ``write_back`` (host) ->
``fetch_in`` (host, waits for earlier write-backs of its keys) -> ``scatter_in`` (device,
after this batch's ``gather_out``) -> ``forward(features, plan)`` (fused update in
backward) -> ``release`` (after backward). ``forward(features)`` runs them all.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

from ..checks import as_int, check_bool, check_positive_int
from ..notes import add_note
from .batch_keys import (BatchKeys, TableLayout, check_weights, collection_device, prepare_batch, starting_rows,
                         table_layouts)
from .cache import CacheStats, EmbeddingCache
from .errors import CacheTooSmallError, StaleBatchError
from .eviction import check_policy
from .fused_lookup import fused_pooled_lookup
from .host_table import HostEmbeddingTable
from .optim import FusedOptimizerAttribute, RowOptimizer, check_row_optimizer
from .portable import fresh_locks, in_use_error, state_without_locks
from .swap_plan import SwapPlan
from .table_view import EmbeddingBagsView

__all__ = ["CachedEmbeddingBagCollection", "BatchPlan", "mark_pipeline_hook"]

_PIPELINE_HOOK = "_torchpipe_pipeline_hook"


def mark_pipeline_hook(hook: Any) -> Any:
    """Mark a hook a pipeline put on a collection: a copy of the collection goes without it
    (the copy is not in that pipeline)."""
    setattr(hook, _PIPELINE_HOOK, True)
    return hook


@dataclass(eq=False)
class BatchPlan:
    """The swap plans of one batch, one per table, plus its keys and step progress."""

    seq: int
    keys: BatchKeys
    tables: dict[str, SwapPlan]
    gathered: bool = field(default=False)
    written: bool = field(default=False)
    scattered: bool = field(default=False)
    released: bool = field(default=False)


class _Witness:
    """Alive exactly as long as a direct lookup's autograd graph, which holds it.

    A lookup keeps its keys protected until its backward has updated their rows. If the
    graph is dropped without backward (an evaluation without ``no_grad``), the witness dies
    and the next lookup releases the keys; while it lives, the backward may still come, with
    another lookup's (two towers reading one collection in one step).
    """

    __slots__ = ("__weakref__",)


def cache_rows_per_table(cache_rows: Any, layouts: list[TableLayout]) -> dict[str, int]:
    """``cache_rows`` per table: an int for every table, or a dict with an entry for each table.

    As for ``weights`` (`check_weights`): a dict may hold other tables too (one dict for the
    tables of every rank); when a table is missing, names that are no table are shown with it
    (a misspelling, most likely).
    """
    names = [layout.name for layout in layouts]
    if isinstance(cache_rows, Mapping):
        missing = [name for name in names if name not in cache_rows]
        if missing:
            unknown = [name for name in cache_rows if name not in names]
            also = f" (it names unknown tables {unknown})" if unknown else ""
            raise ValueError(f"cache_rows has no entry for tables {missing}{also}; give one for each of {names}")
        return {name: check_positive_int(f"cache_rows[{name!r}]", cache_rows[name]) for name in names}
    if as_int(cache_rows) is None:
        raise TypeError(f"cache_rows must be a positive int or a dict {{table name: positive int}}, "
                        f"got {cache_rows!r}")
    rows = check_positive_int("cache_rows", cache_rows)  # a plain int, from a NumPy or tensor one too
    return {name: rows for name in names}


def weight_key(table: str) -> str:
    """The state_dict key of a table, as in `torchrec.EmbeddingBagCollection`."""
    return f"embedding_bags.{table}.weight"


class CachedEmbeddingBagCollection(nn.Module):
    """An EBC (KJT in, KeyedTensor out, sum/mean pooling) training through a device row cache.

    ``cache_rows``: slots per table (an int for all, or ``{table: rows}``). The optimizer
    is fused (`torchpipe.rec.optim`): rows are updated in backward, there are no dense
    grads. `state_dict` holds the full tables under EBC keys, so checkpoints move to and
    from a plain `torchrec.EmbeddingBagCollection`; the optimizer's state is saved apart
    (`optimizer_state_dict`), as a fused optimizer's is in TorchRec's sharded EBC.
    ``is_weighted=True`` pools SUM tables with the KJT's per-sample weights, as TorchRec's
    EBC does. Training equals the full-table `FullTableEmbeddingBagCollection` bitwise, step
    for step.
    """

    _LOCKS = {"_plan_lock": threading.Lock, "_finish_lock": threading.RLock, "_direct_lock": threading.RLock}

    optimizer = FusedOptimizerAttribute()

    def __init__(self, tables: list[EmbeddingBagConfig], cache_rows: int | dict[str, int],
                 device: torch.device | str | None = None, optimizer: RowOptimizer | None = None,
                 policy: str = "lru", pin_memory: bool | None = None,
                 weights: dict[str, torch.Tensor] | None = None, is_weighted: bool = False) -> None:
        # Every argument is checked before the first table is built.
        device = collection_device(device)
        optimizer = check_row_optimizer(optimizer)
        check_bool("is_weighted", is_weighted)
        layouts = table_layouts(tables, weighted=is_weighted)
        rows_of = cache_rows_per_table(cache_rows, layouts)
        check_policy(policy)
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool or None, got {pin_memory!r}")
        check_weights(weights, layouts)
        super().__init__()
        self.device = device
        self.optimizer = optimizer
        self.layouts: list[TableLayout] = layouts
        self._configs = tables
        self.hosts: dict[str, HostEmbeddingTable] = {}
        self.caches: dict[str, EmbeddingCache] = {}
        self.slots: dict[str, torch.Tensor] = {}
        for layout, weight, state in starting_rows(tables, self.layouts, weights, self.optimizer.init_state):
            rows = rows_of[layout.name]
            width = self.optimizer.state_width(layout.dim)
            host = HostEmbeddingTable(layout.num_rows, layout.dim, width, pin_memory=pin_memory, weight=weight,
                                      state=state)
            cache = EmbeddingCache(layout.num_rows, rows, policy, layout.name)
            self.hosts[layout.name] = host
            self.caches[layout.name] = cache
            self.slots[layout.name] = torch.zeros(cache.cache_rows, layout.dim + width, dtype=host.dtype,
                                                  device=self.device)
        self._plan_lock = threading.Lock()
        self._plan_seq = 0
        # Batches planned and not swapped in yet: their keys map to slots that still hold
        # other rows (or nothing), so a direct lookup must not read them.
        self._unswapped: set[int] = set()
        # Swaps a failure stopped partway, oldest first: finished before anything else runs.
        self._unfinished: list[BatchPlan] = []
        # Those of a pipeline collected with batches in flight: its finalizer only queues them
        # here (it may run on any thread, in the middle of anything), `finish_swaps` runs them.
        self._dropped: list[BatchPlan] = []
        self._finish_lock = threading.RLock()
        # Direct lookups whose backward has not run, with a witness of their graph (see _Witness).
        self._sync_plans: list[tuple[BatchPlan, weakref.ref[_Witness]]] = []
        # Direct lookups from several threads (serving) run one at a time, as Pipe's calls do,
        # and none runs while a direct lookup's backward updates its rows (from its stale check
        # to its release): a lookup would read rows half updated, or release and evict them.
        # Also guards _sync_plans. Taken before any other lock of the collection. What runs
        # under it may wait for a host write-back queued earlier (finish_swaps), never for a
        # thread that needs this lock: write-backs take none of the collection's locks.
        self._direct_lock = threading.RLock()
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)

    # -- per-batch steps ---------------------------------------------------------------
    def prepare(self, features: KeyedJaggedTensor) -> BatchKeys:
        """Validate ``features`` and dedup its keys per table; raises `RecInputError`. No state changes."""
        return prepare_batch(features, self.layouts)

    def check_batch_fits(self, features: KeyedJaggedTensor) -> None:
        """`CacheTooSmallError` when one table's unique keys in ``features`` alone exceed its
        ``cache_rows``: such a batch can never be planned. Changes nothing; a pipeline calls it
        at admission, so that the batch is refused before it enters (and is not found two
        clocks later, when the good batches in flight would be dropped with it). ``features``
        has passed `check_kjt`. A table that gets no more keys than it has rows costs a sum;
        one that gets more costs a count of its distinct keys (`EmbeddingCache.distinct_count`)."""
        per_feature = dict(zip(features.keys(), features.length_per_key()))
        for layout in self.layouts:
            cache = self.caches[layout.name]
            if sum(per_feature[f] for f in layout.feature_names) <= cache.cache_rows:
                continue  # fewer keys than rows, duplicates or not
            keys = torch.cat([features[f].values().to("cpu", torch.int64) for f in layout.feature_names])
            if cache.distinct_count(keys) > cache.cache_rows:
                unique = torch.unique(keys)  # only for the error's numbers
                missing = int(unique.numel()) - int(cache.is_cached(unique).sum())
                error = CacheTooSmallError(layout.name, cache.cache_rows, int(unique.numel()), 0, missing,
                                           cache.cache_rows)
                add_note(error, f"[torchpipe.rec] this batch alone has {unique.numel()} unique keys for table "
                                f"{layout.name!r}, more than its {cache.cache_rows} cache rows: it can never fit")
                raise error

    def plan(self, keys: BatchKeys) -> BatchPlan:
        """Plan every table's swap and protect the batch's keys; call in batch order.

        Raises `CacheTooSmallError` before any state changes (all tables are checked first).
        """
        self.settle()
        return self._plan(keys)

    def _plan(self, keys: BatchKeys) -> BatchPlan:
        with self._plan_lock:
            for name, batch in keys.tables.items():
                self.caches[name].check_fits(batch.unique_keys)
            plans: dict[str, SwapPlan] = {}
            batch_plan = BatchPlan(self._plan_seq, keys, plans)
            self._plan_seq += 1
            self._unswapped.add(batch_plan.seq)
            try:
                for name, batch in keys.tables.items():
                    plan = self.caches[name].plan_swap(batch.unique_keys)
                    plans[name] = plan  # committed in that table's cache from here on
                    plan.ticket = self.hosts[name].reserve_write(plan.swap_out_keys)
            except BaseException:
                if not plans:  # nothing was committed: the batch was never planned
                    self._unswapped.discard(batch_plan.seq)
                else:
                    # The tables planned so far moved keys to slots and protected them (and
                    # later lookups of the evicted keys wait for their write-back): their swaps
                    # must still run, or those waits never end. Queued, they run first thing.
                    with self._finish_lock:
                        self._unfinished.append(batch_plan)
                raise
            return batch_plan

    def gather_out(self, plan: BatchPlan) -> dict[str, torch.Tensor]:
        """Device step: copy the evicted rows (with state) out of their slots, to host memory."""
        rows = {name: self.slots[name].index_select(0, p.swap_out_slots.to(self.device)).cpu()
                for name, p in plan.tables.items()}
        plan.gathered = True
        return rows

    def write_back(self, plan: BatchPlan, rows: dict[str, torch.Tensor]) -> None:
        """Host step: write the evicted rows to the host tables, landing this batch's tickets."""
        for name, p in plan.tables.items():
            self.hosts[name].update(p.swap_out_keys, rows[name], p.ticket)
        plan.written = True

    def fetch_in(self, plan: BatchPlan) -> dict[str, torch.Tensor]:
        """Host step: read the incoming rows, after every earlier batch's write-back of them."""
        return {name: self.hosts[name].lookup(p.swap_in_keys, p.ticket) for name, p in plan.tables.items()}

    def scatter_in(self, plan: BatchPlan, rows: dict[str, torch.Tensor]) -> None:
        """Device step: put the incoming rows into their slots; needs this batch's `gather_out` first."""
        if not plan.gathered:
            raise RuntimeError("scatter_in before gather_out would overwrite rows being evicted")
        for name, p in plan.tables.items():
            self.slots[name].index_copy_(0, p.swap_in_slots.to(self.device), rows[name].to(self.device))
        plan.scattered = True
        self._unswapped.discard(plan.seq)

    def finish_swaps(self, plans: Sequence[BatchPlan] = ()) -> None:
        """Complete the swaps a failure stopped partway, oldest first, and release their batches.

        A plan that failed between its steps leaves new keys mapped to slots that still hold
        the evicted rows, and a host write pending that later lookups wait for. Swaps move
        rows and never change them, so the remaining steps are always right to run (a step
        already done is not repeated, or repeats the same copy). If one fails again, the rest
        stay queued and every later `plan`, `flush` or direct forward retries them first:
        an error each time, never a hang or a row lost.
        """
        with self._finish_lock:
            while self._dropped:
                self._unfinished.append(self._dropped.pop(0))
            self._unfinished.extend(plans)
            self._unfinished.sort(key=lambda queued: queued.seq)  # ticket order, whoever queued them
            while self._unfinished:
                plan = self._unfinished[0]
                for name, table_plan in plan.tables.items():
                    if table_plan.ticket is None:  # planning failed between plan_swap and its ticket
                        table_plan.ticket = self.hosts[name].reserve_write(table_plan.swap_out_keys)
                if not plan.scattered:
                    if not plan.written:
                        self.write_back(plan, self.gather_out(plan))
                    self.scatter_in(plan, self.fetch_in(plan))
                self.release(plan, done_ok=True)
                self._unfinished.pop(0)

    def settle(self) -> None:
        """What every plan does first: release a direct lookup whose backward never ran (its
        graph goes stale) and complete the swaps queued by failures."""
        self._release_sync_plans(keep_live=False)
        self.finish_swaps()

    def defer_swaps(self, plans: Sequence[BatchPlan]) -> None:
        """Queue the swaps of batches whose pipeline is gone, running nothing now.

        For finalizers: it takes no lock and moves no row. The next `finish_swaps` (every
        `plan`, `flush` and direct lookup starts with one) completes them in plan order.
        """
        self._dropped.extend(plans)

    def swap(self, plan: BatchPlan) -> None:
        """All four swap steps of one batch, in order."""
        out_rows = self.gather_out(plan)
        self.write_back(plan, out_rows)
        self.scatter_in(plan, self.fetch_in(plan))

    def forward(self, features: KeyedJaggedTensor | None, plan: BatchPlan | None = None) -> KeyedTensor:
        """Pooled embeddings of a batch; the optimizer updates its rows in backward.

        With ``plan``: the batch must be swapped in; the caller `release`\\ s it after backward.
        Without: runs prepare, plan, swap, and releases in backward (or now, without grad).
        """
        if plan is None:
            return self._forward_sync(features)
        if not plan.scattered:
            raise RuntimeError(f"batch {plan.seq} is not swapped in yet")
        if plan.released:
            raise StaleBatchError(f"batch {plan.seq} was already released")
        return self._lookup(plan, release_after_backward=False)

    def snapshot_rows(self, plan: BatchPlan) -> dict[str, torch.Tensor]:
        """Copies of the batch's cached rows with their optimizer state, taken before its step.

        The fused optimizer updates rows during backward; if the step fails after that
        (later in backward, or in the dense optimizer), `restore_rows` puts them back, so the
        cache holds exactly the state after the last completed step.
        """
        return {name: self.slots[name].index_select(0, p.slots_of_keys.to(self.device))
                for name, p in plan.tables.items()}

    def restore_rows(self, plan: BatchPlan, rows: dict[str, torch.Tensor]) -> None:
        """Undo a failed step's row updates with a `snapshot_rows` copy."""
        for name, p in plan.tables.items():
            self.slots[name].index_copy_(0, p.slots_of_keys.to(self.device), rows[name])

    def release(self, plan: BatchPlan, *, done_ok: bool = False) -> None:
        """End the protection of the batch's keys (after its backward, or when dropping it).

        Table by table: if it is cut short (a Ctrl-C), calling it again releases the rest.
        ``done_ok``: a batch (or table) already released is no error: for a pipeline's
        release of its trained batches, which may meet a ``close()`` from another thread that
        gave up waiting for the call, and for `finish_swaps`; each table is released once.
        """
        if plan.released:
            if done_ok:
                return
            raise RuntimeError(f"batch {plan.seq} released twice")
        for name, p in plan.tables.items():
            if not p.released:
                self.caches[name].release(p, done_ok=done_ok)
        plan.released = True

    def _lookup(self, plan: BatchPlan, release_after_backward: bool, witness: _Witness | None = None) -> KeyedTensor:
        names = list(plan.tables)
        updated = False

        def before_update(witness: _Witness | None = witness) -> None:  # the graph holds the witness
            nonlocal updated
            if updated:  # backward(retain_graph=True), then backward again: rows step once per lookup
                raise RuntimeError(
                    f"a second backward through the lookup of batch {plan.seq}: its backward already applied "
                    "the fused optimizer to its rows, and a row is updated once per lookup (there is no "
                    ".grad to accumulate into). Sum the losses and call backward once")
            if plan.released:
                raise StaleBatchError(
                    f"backward of batch {plan.seq} after its slots were released: a later direct lookup "
                    "needed them (the cache had no room for both batches' keys), a pipeline planned, or "
                    "flush() ran while this lookup's graph waited for its backward")
            updated = True

        def after_update() -> None:
            if release_after_backward:
                self.release(plan)

        return fused_pooled_lookup(self._anchor, [self.slots[n] for n in names],
                                   [plan.tables[n].slots_of_keys.to(self.device) for n in names],
                                   [plan.keys.tables[n] for n in names], self.optimizer,
                                   before_update, after_update, self._direct_lock if release_after_backward else None)

    def _forward_sync(self, features: KeyedJaggedTensor | None) -> KeyedTensor:
        if features is None:
            raise ValueError("forward needs features or a plan")
        with self._direct_lock:
            return self._forward_sync_locked(features)

    def _forward_sync_locked(self, features: KeyedJaggedTensor) -> KeyedTensor:
        keys = self.prepare(features)
        self._release_sync_plans(keep_live=True)
        self.finish_swaps()
        unswapped, pending = len(self._unswapped), self.pending_writes()
        if unswapped or pending:
            # Batches a pipeline planned and has not swapped yet: only its next progress()
            # swaps them. Their keys already map to slots whose rows are not theirs yet (a
            # lookup would read them), and their write-backs would make this lookup wait for
            # itself.
            raise RuntimeError(
                f"the collection has {unswapped} batches planned and not swapped in yet, with "
                f"{pending} host write-backs pending from batches in flight in a pipeline; call the "
                "pipeline's flush() before using the collection directly"
            )
        try:
            plan = self._plan(keys)
        except CacheTooSmallError:
            too_many = any(batch.unique_keys.numel() > self.caches[name].cache_rows
                           for name, batch in keys.tables.items())
            if not self._sync_plans or too_many:  # (releasing them would not make room)
                raise
            # Earlier lookups whose graphs are alive keep their keys, for a backward through
            # both (two towers on one collection). No room for both: they go stale instead.
            self._release_sync_plans(keep_live=False)
            plan = self._plan(keys)
        try:
            self.swap(plan)
            witness = _Witness()
            out = self._lookup(plan, release_after_backward=True, witness=witness)
        except BaseException:
            self.finish_swaps([plan])  # the rows must not stay in the wrong slots
            raise
        if out.values().requires_grad:
            self._sync_plans.append((plan, weakref.ref(witness)))
        else:
            self.release(plan)
        return out

    def _release_sync_plans(self, keep_live: bool) -> None:
        """Release direct lookups whose backward never ran: those whose graph is gone, or
        (``keep_live=False``) all of them, whose backward then raises `StaleBatchError`."""
        with self._direct_lock:
            kept = []
            for plan, witness in self._sync_plans:
                if plan.released:  # its backward ran
                    continue
                if keep_live and witness() is not None:
                    kept.append((plan, witness))
                else:
                    self.release(plan)
            self._sync_plans = kept

    # -- whole-table operations --------------------------------------------------------
    def in_flight(self) -> int:
        """Slots protected by unreleased batches, over all tables."""
        return sum(cache.protected_slots() for cache in self.caches.values())

    def pending_writes(self) -> int:
        """Host write-backs reserved but not landed, over all tables."""
        return sum(host.pending_writes() for host in self.hosts.values())

    def flush(self) -> None:
        """Write every cached row and its optimizer state back to the host tables.

        The cache keeps its rows (both copies are equal afterwards). Needs a drained
        pipeline: raises if batches are still in flight. A direct lookup whose backward has
        not run yet stays valid (as a plain module's forward does across a `state_dict`): its
        rows are written as they are now, and its backward updates them afterwards.
        """
        self._flush("flush()")

    def _flush(self, call: str) -> None:
        """`flush`, for ``call`` (named in the refusal: what the user called, not this helper)."""
        with self._direct_lock:  # no direct lookup's backward changes the rows being written
            self._flush_locked(call)

    def _flush_locked(self, call: str) -> None:
        self._release_sync_plans(keep_live=True)
        self.finish_swaps()
        live = [table_plan for plan, _ in self._sync_plans for table_plan in plan.tables.values()]
        busy = sum(cache.protected_slots(excluding=[p for p in live if p.table == name])
                   for name, cache in self.caches.items())
        if busy or self.pending_writes():
            raise RuntimeError(f"{call} with batches in flight: {busy} protected slots, "
                               f"{self.pending_writes()} pending write-backs; drain the pipeline first "
                               "(its flush() or close())")
        for name, cache in self.caches.items():
            keys, slots = cache.cached()
            self.hosts[name].update(keys, self.slots[name].index_select(0, slots.to(self.device)).cpu())

    def _refresh_slots(self) -> None:
        """Reload every cached row from the host (after the host tables were overwritten)."""
        for name, cache in self.caches.items():
            keys, slots = cache.cached()
            self.slots[name].index_copy_(0, slots.to(self.device), self.hosts[name].lookup(keys).to(self.device))

    def _host(self, table: Any) -> HostEmbeddingTable:
        """The host table named ``table``; a KeyError that names the tables there are."""
        host = self.hosts.get(table) if isinstance(table, str) else None
        if host is None:
            raise KeyError(f"no table named {table!r}; the tables are {list(self.hosts)}")
        return host

    @property
    def embedding_bags(self) -> EmbeddingBagsView:
        """TorchRec's path to the tables (``embedding_bags[name].weight``, its state_dict keys):
        each ``weight`` a flushed copy, so ``torch.distributed.checkpoint`` resolves the keys."""
        return EmbeddingBagsView(list(self.hosts), self.full_weight)

    def full_weight(self, table: str) -> torch.Tensor:
        """A copy of the whole table's embeddings, flushed."""
        host = self._host(table)
        self._flush("full_weight()")
        return host.weight.clone()

    def _prepared_optimizer_state(self, table: str, state: Any) -> torch.Tensor:
        """``state`` checked and made a host tensor of the table's dtype, ready to copy: what
        can fail (a meta or sparse tensor, say) fails here, before any table is written."""
        host = self._host(table)
        expected = tuple(host.state.shape)
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"optimizer state for table {table!r} must be a torch.Tensor of shape {expected} "
                            f"(rows, state width), got {type(state).__name__}")
        if tuple(state.shape) != expected:
            raise ValueError(f"optimizer state for table {table!r} must have shape {expected} "
                             f"(rows, state width), got {tuple(state.shape)}")
        if state.layout != torch.strided or state.device.type == "meta":
            raise TypeError(f"optimizer state for table {table!r} must be a dense tensor with values, got a "
                            f"{state.layout} tensor on {state.device}")
        return state.detach().to(device="cpu", dtype=host.dtype).contiguous()

    def optimizer_state(self, table: str) -> torch.Tensor:
        """A copy of the whole table's optimizer state ``[num_rows, state_width]``, flushed."""
        host = self._host(table)
        self._flush("optimizer_state()")
        return host.state.clone()

    def load_optimizer_state(self, table: str, state: torch.Tensor) -> None:
        """Overwrite a table's optimizer state (host and cached rows)."""
        state = self._prepared_optimizer_state(table, state)
        self._flush("load_optimizer_state()")
        self.hosts[table].state.copy_(state)
        self._refresh_slots()

    def optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        """Every table's optimizer state, ``{table: [num_rows, state_width]}``, flushed.

        `state_dict` holds the tables only, under TorchRec's EBC keys (so checkpoints move to
        and from a plain EBC; TorchRec's sharded EBC keeps its fused optimizer's state outside
        `state_dict` too): save this beside it, or a resumed RowWiseAdagrad/Adam starts from
        fresh state.
        """
        self._flush("optimizer_state_dict()")
        return {name: host.state.clone() for name, host in self.hosts.items()}

    def load_optimizer_state_dict(self, states: Mapping[str, torch.Tensor]) -> None:
        """Restore `optimizer_state_dict`'s output: every table is checked before any is written."""
        if not isinstance(states, Mapping):
            raise TypeError(f"optimizer states must be a dict {{table name: tensor}}, got {type(states).__name__}")
        names = list(self.hosts)
        missing = [name for name in names if name not in states]
        unknown = [name for name in states if name not in self.hosts]
        if missing or unknown:
            raise KeyError(f"optimizer states for tables {sorted(states)}, expected exactly {names} "
                           f"(missing {missing}, unknown {unknown})")
        prepared = {name: self._prepared_optimizer_state(name, states[name]) for name in names}
        self._flush("load_optimizer_state_dict()")
        for name in names:
            self.hosts[name].state.copy_(prepared[name])
        self._refresh_slots()

    # -- copy and pickle (copy.deepcopy(model), torch.save(model)) -------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The whole collection (tables, optimizer state, cache and its statistics), once idle.

        Refused while batches are in flight, or while a direct lookup waits for its backward:
        their slots, write tickets and graph belong to this object. A pipeline's hooks stay
        behind (the copy is not in that pipeline); hooks of your own go with the copy.
        """
        def busy() -> bool:
            self._release_sync_plans(keep_live=True)
            self.finish_swaps()
            return bool(self._sync_plans or self._unswapped or self.in_flight() or self.pending_writes())

        if busy():
            gc.collect()  # a pipeline dropped in a reference cycle hands its batches back when collected
        if busy():
            raise in_use_error(
                "CachedEmbeddingBagCollection",
                f"{self.in_flight()} protected slots, {self.pending_writes()} pending write-backs, "
                f"{len(self._sync_plans)} direct lookups waiting for their backward",
                "flush() the pipeline first, and run (or drop) the lookups' backward; or save state_dict() and "
                "optimizer_state_dict()")
        state = state_without_locks(self, self._LOCKS)
        state.pop("_compiled_call_impl", None)  # as nn.Module drops it: a copy compiles its own
        for hooks in ("_forward_pre_hooks", "_forward_hooks"):
            left_behind = [key for key, hook in state[hooks].items() if getattr(hook, _PIPELINE_HOOK, False)]
            state[hooks] = type(state[hooks])((k, h) for k, h in state[hooks].items() if k not in left_behind)
            flags = f"{hooks}_with_kwargs"
            state[flags] = type(state[flags])((k, v) for k, v in state[flags].items() if k not in left_behind)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        fresh_locks(self, self._LOCKS)

    def cache_stats(self) -> dict[str, CacheStats]:
        """Hit/miss counters and swap volume per table."""
        return {name: cache.stats for name, cache in self.caches.items()}

    def abort(self, exc: BaseException) -> None:
        """Wake every thread waiting in a host-table lookup with `CacheAbortedError` from ``exc``."""
        for host in self.hosts.values():
            host.abort(exc)

    def clear_abort(self) -> None:
        """Make the collection usable again after `abort`."""
        for host in self.hosts.values():
            host.clear_abort()

    def reset_parameters(self) -> None:
        """Draw every table's rows again from its config's ``init_fn`` and reset its optimizer state.

        What TorchRec's ``EmbeddingBagCollection.reset_parameters`` does for its weights (the
        tables in config order, so the same seed draws the same rows), plus the optimizer state,
        which a start over needs too. Like ``load_state_dict``: refused with batches in flight.
        One table at a time, so that tables too big to be held twice are not (an ``init_fn``
        that raises leaves the tables before it reset).
        """
        self._flush("reset_parameters()")  # first: a refusal must not have drawn from the RNG
        for layout, weight, state in starting_rows(self._configs, self.layouts, None, self.optimizer.init_state):
            self.hosts[layout.name].weight.copy_(weight)
            self.hosts[layout.name].state.copy_(state)
        self._refresh_slots()

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        """Whether lookups pool with the KJT's per-sample weights (TorchRec's ``is_weighted``)."""
        return any(layout.weighted for layout in self.layouts)

    # -- checkpoints (full tables under EBC keys) --------------------------------------
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        self._flush("state_dict()")
        for name, host in self.hosts.items():
            destination[prefix + weight_key(name)] = host.weight.clone()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        mine = {prefix + weight_key(name): name for name in self.hosts}
        loads: dict[str, torch.Tensor] = {}
        refused = False
        for key, name in mine.items():
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            problem = self._load_problem(key, name, value)
            if problem is not None:
                error_msgs.append(problem)
                refused = True
                continue
            # Made a host tensor of the table's dtype now (no copy when it is one): what can
            # fail, fails before any table is written.
            try:
                loads[name] = value.detach().to(device="cpu", dtype=self.hosts[name].weight.dtype)
            except Exception as exc:  # noqa: BLE001 - reported as torch reports a failed copy
                error_msgs.append(f'While copying the parameter named "{key}", whose dimensions in the model are '
                                  f"{tuple(self.hosts[name].weight.shape)} and whose dimensions in the checkpoint "
                                  f"are {tuple(value.shape)}, an exception occurred : {exc.args}.")
                refused = True
        if refused:  # every table or none: a table half loaded would differ from its cached rows
            loads = {}
        if strict:  # torch's rule: a key under this prefix that no table, child or own tensor takes
            own = set(self._parameters) | set(self._buffers)
            for key in state_dict:
                if not key.startswith(prefix) or key in mine:
                    continue
                head, dot, _ = key[len(prefix):].partition(".")
                if (head not in self._modules) if dot else (head not in own):
                    unexpected_keys.append(key)
        if loads:
            self._flush("load_state_dict()")
            try:
                for name, value in loads.items():
                    self.hosts[name].weight.copy_(value)
            finally:  # the cached rows follow whatever the host tables hold now
                self._refresh_slots()

    def _load_problem(self, key: str, name: str, value: Any) -> str | None:
        """Why ``value`` cannot be table ``name``'s weight (torch's wording), or None."""
        expected = tuple(self.hosts[name].weight.shape)
        if not isinstance(value, torch.Tensor):
            return (f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like object from '
                    f"checkpoint but received {type(value)}")
        if tuple(value.shape) != expected:
            return (f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                    f"the table has shape {expected}.")
        if value.layout != torch.strided or value.device.type == "meta":
            return (f'While copying the parameter named "{key}": expected a dense tensor with values, got a '
                    f"{value.layout} tensor on {value.device}")
        return None
