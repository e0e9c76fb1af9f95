"""Ready train pipelines: TorchRec's ``TrainPipelineBase`` / ``TrainPipelineSparseDist``
equivalents and `EmbCacheTrainPipeline`, each a list of `PipelineStage` on a `StagedPipeline`.

The model contract is TorchRec's: ``losses, output = model(batch)``; the step is
``zero_grad(); sum(losses).backward(); optimizer.step()`` and ``progress`` returns
``output``. A batch is anything with ``.to(device, non_blocking=...)`` (TorchRec's
``Batch``, or `RecBatch`); the embedding-cache pipeline also reads ``batch.sparse_features``
(a ``KeyedJaggedTensor``).
"""

from __future__ import annotations

import gc
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from ..checks import check_bool
from ..copy import caller_waits_for_streams, mark_ready, streams_wait_for_caller
from ..devices import get_backend, usable_device
from ..grad_sync import (PeerStepFailed, grad_buckets, start_first_rank_broadcast, take_first_ranks_values,
                         unflatten_into, write_back_grads)
from ..notes import add_note
from ..rec import BatchPlan, CachedEmbeddingBagCollection, CacheTooSmallError, RecInputError
from ..rec.batch_keys import BatchKeys, check_kjt
from ..rec.collection import mark_pipeline_hook
from ..thread_state import records_graphs
from ..workers import OwnsThreads
from .schedule import Clock
from .dist import ExchangeRecord, TableWiseSharding
from .staged import (PipelineFailure, PipelineStage, StagedPipeline, UnevenDataError, check_pipeline_options,
                     fail_clock_now, keep_flushed_outputs, record_streams)

__all__ = ["RecBatch", "TrainPipelineBase", "TrainPipelineSparseDist", "EmbCacheTrainPipeline", "train_step"]

# What each rank says in the vote before a batch is admitted (sharded pipelines).
_HAS_BATCH = 0  # a batch that passed its checks
_REFUSED = 1  # a batch that failed them
_DATA_ENDED = 2  # no batch: the data iterator ended
_NO_BATCH = 3  # no batch: the data iterator raised


@dataclass
class RecBatch:
    """A recommendation batch: dense features, sparse features (KJT), labels (like TorchRec's ``Batch``)."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "RecBatch":
        return RecBatch(self.dense_features.to(device, non_blocking=non_blocking),
                        self.sparse_features.to(device, non_blocking=non_blocking),
                        self.labels.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: Any) -> None:
        """Keep the device copies alive for ``stream`` (they were made on a copy stream)."""
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)


def is_training(model: Any) -> bool:
    """Whether a step of ``model`` trains: an ``nn.Module`` in ``train()`` mode, or any other callable."""
    return bool(getattr(model, "training", True))


def train_step(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], batch: Any,
               before_step: Optional[Callable[[], None]] = None) -> Any:
    """One synchronous step, exactly as every pipeline here runs it (and as TorchRec does).

    A model in ``eval()`` mode runs its forward only, as TorchRec's pipelines do: no
    ``zero_grad``, backward or optimizer step, so evaluation batches change nothing.
    ``before_step`` runs between backward and the optimizer step (the dense gradient
    all-reduce of a sharded pipeline).
    """
    if not is_training(model):
        _, output = model(batch)
        return output
    if optimizer is not None:
        optimizer.zero_grad()
    losses, output = model(batch)
    torch.sum(losses).backward()
    if before_step is not None:
        before_step()
    if optimizer is not None:
        optimizer.step()
    return output


def dense_replica(model: nn.Module, collection: nn.Module) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The replicated part of a sharded model, the collection's own tensors left out: its
    parameters (floating point: those that can have a gradient) and its buffers."""
    own = {id(t) for t in collection.parameters()} | {id(t) for t in collection.buffers()}
    parameters = [p for p in model.parameters() if id(p) not in own and (p.is_floating_point() or p.is_complex())]
    buffers = [b for b in model.buffers() if id(b) not in own]
    return parameters, buffers


def all_reduce_dense_grads(parameters: List[torch.Tensor], group: Any, average: bool, failed: bool,
                           device: torch.device, buffers: Sequence[torch.Tensor] = ()) -> List[int]:
    """Sum (or average, as DDP) the dense gradients over ``group``, and learn which ranks' steps
    ``failed``: the ranks that did, in the order of ``group``.

    One all-reduce per dtype; the first carries one failure flag per rank too, so agreeing on
    the step costs no collective of its own. Every rank, a failed one too, issues the same
    collectives (its buffers have the same size whichever gradients it has). The gradients
    are written back only when no rank failed; otherwise each rank's stay its own.

    ``buffers`` (batch norm's running statistics): the first rank's are broadcast in the same
    round and taken only when no rank failed, so that the replicas' buffers are equal after
    every step (DDP broadcasts them before each forward).
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    votes = torch.zeros(world, device=device)  # where the group reduces (with no dense parameter to go by)
    votes[rank] = float(failed)
    buckets = grad_buckets(parameters, extra=votes, scale=1.0 / world if average else 1.0)
    firsts = start_first_rank_broadcast(buffers, group)
    works = [work for work, _, _ in firsts] + [dist.all_reduce(flat, group=group, async_op=True) for flat, _ in buckets]
    for work in works:
        work.wait()
    failed_ranks = [r for r, vote in enumerate(buckets[0][0][-world:].tolist()) if vote]
    if not failed_ranks:
        for flat, bucket in buckets:
            write_back_grads(flat, bucket)
        with torch.no_grad():
            for _, flat, same_dtype in firsts:
                unflatten_into(flat, same_dtype)
    return failed_ranks


_EVAL_STEP_FAILED = object()
"""``EmbCacheTrainPipeline._eval_step`` of a clock whose forward-only step failed on this rank:
set when the step reaches the ranks' agreement, and replaced by its batch only once the train
stage returns the output, so that an error anywhere after it still counts as the step's."""

_FAILED_CODE, _EVAL_STEP_FAILED_CODE = 1, 2
"""What a rank says in the clock's vote: its h2d, plan or swap failed; its forward-only step did."""


@dataclass(eq=False)
class _Item:
    """One batch on its way through the stages."""

    batch: Any
    device_batch: Any = None
    event: Any = None
    features: Any = None  # host KJT the keys are planned from (after input dist)
    keys: Optional[BatchKeys] = None
    plan: Optional[BatchPlan] = None
    trained: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    """TypeError unless ``model`` is callable and ``optimizer`` None or an optimizer."""
    if not callable(model):
        raise TypeError(f"model must be callable as losses, output = model(batch) (an nn.Module, say), "
                        f"got {type(model).__name__}")
    if optimizer is not None and not (callable(getattr(optimizer, "zero_grad", None))
                                      and callable(getattr(optimizer, "step", None))):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (with zero_grad() and step()) or None, "
                        f"got {type(optimizer).__name__}")


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of a pipeline, holding the pipeline weakly.

    A pipeline's stages (and hooks) are built from these: its `StagedPipeline` holds them,
    so a strong reference back would be a cycle, and a pipeline dropped without ``close()``
    (its worker threads, its in-flight batches) would live until the cycle collector runs.
    """
    reference = weakref.WeakMethod(method)
    owner = type(method.__self__).__name__  # the name only: ``call`` must not hold ``method``

    def call(*args: Any) -> Any:
        bound = reference()
        if bound is None:  # only a stage still running while its pipeline is collected
            raise RuntimeError(f"the {owner} this stage belongs to is gone")
        return bound(*args)

    return call


class _ReadyPipeline(OwnsThreads):
    """Shared plumbing: H2D on the copy worker with an event, the train step on the compute worker."""

    COPY_ADVICE = ("copy or save its model and optimizer (flush() first: a collection's state_dict "
                   "reads through its cache), then build a new pipeline on the copy")

    pipeline: StagedPipeline

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 device: Union[str, torch.device]) -> None:
        check_model_and_optimizer(model, optimizer)
        self.model = model
        self.optimizer = optimizer
        self.device = usable_device(device)
        self._backend = get_backend(self.device)
        self.steps_done = 0

    @staticmethod
    def _check_movable(batch: Any) -> None:
        """TypeError, before the batch enters, for one the copy stage could not move: otherwise
        it fails on the copy worker, after the pipeline took it (and the batch behind it)."""
        if not callable(getattr(batch, "to", None)):
            raise TypeError(f"a batch must have .to(device, non_blocking=...) (TorchRec's Pipelineable, or a "
                            f"tensor), got {type(batch).__name__}; wrap a tuple or dict of tensors in a class "
                            "with a .to() that moves each one")

    def _h2d(self, item: _Item) -> _Item:
        item.device_batch = item.batch.to(self.device, non_blocking=True)
        event = self._backend.new_event()
        self._backend.record_event(event, self._backend.current_stream(self.device))
        item.event = event
        return item

    def _h2d_batch(self, batch: Any) -> _Item:
        return self._h2d(_Item(batch))

    def _wait_h2d(self, item: _Item) -> None:
        """On the compute stream: wait for the batch's copy, and keep its memory for this stream."""
        stream = self._backend.current_stream(self.device)
        self._backend.wait_event(stream, item.event)
        if self._backend.type != "cpu":
            record_streams(item.device_batch, stream, self._backend, self.device.type)

    def streams(self) -> List[Tuple[torch.device, Any]]:
        """Every stream the pipeline queues device work on."""
        return self.pipeline.device_streams()

    def _train(self, item: _Item) -> Any:
        self._wait_h2d(item)
        output = train_step(self.model, self.optimizer, item.device_batch)
        item.trained = True
        self.steps_done += 1
        return output

    def _refuse_training_without_grad(self, what: str) -> None:
        """RuntimeError, before anything changes, for a training step that could not backpropagate.

        The train stage runs under the caller's grad mode: under ``no_grad`` or
        ``inference_mode`` its backward would fail inside the pipeline and drop every batch in
        flight. A model in ``eval()`` mode runs forward only (TorchRec's rule) and may.
        """
        if is_training(self.model) and not records_graphs():  # enable_grad() in inference_mode records nothing
            raise RuntimeError(
                f"{what} under torch.no_grad() or torch.inference_mode() with the model in train mode: its "
                "backward would fail. Call model.eval() first for forward-only steps (evaluation), or call "
                f"{what} with gradients enabled to train")

    # -- delegation ------------------------------------------------------------------
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """One finished step's model output; StopIteration once every batch was trained.

        A model in ``eval()`` mode takes forward-only steps (as in TorchRec's pipelines):
        nothing is updated, and ``torch.no_grad()`` around the call skips building the autograd
        graph. In train mode, a call under ``no_grad`` raises before anything changes.

        On an accelerator the output is safe to use on the caller's current stream: the
        pipeline's streams wait for the caller's work first, and the caller's stream waits
        for theirs before this returns.
        """
        self._refuse_training_without_grad("progress()")
        streams_wait_for_caller(self.streams())
        try:
            return self.pipeline.progress(dataloader_iter)
        finally:
            caller_waits_for_streams(self.streams())

    def flush(self) -> List[Any]:
        """Run every in-flight batch's step (forward only in eval mode); their outputs, in order.

        Under ``no_grad`` with the model in train mode, refused as ``progress()`` is.
        """
        if self.pipeline.in_flight():
            self._refuse_training_without_grad("flush()")
        streams_wait_for_caller(self.streams())
        try:
            return self.pipeline.flush()
        finally:
            caller_waits_for_streams(self.streams())

    def schedule_table(self, num_batches: int) -> str:
        return self.pipeline.schedule_table(num_batches)

    def print_schedule(self, num_batches: int) -> None:
        self.pipeline.print_schedule(num_batches)

    def close(self) -> None:
        self.pipeline.close()

    def __enter__(self) -> "_ReadyPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TrainPipelineBase(_ReadyPipeline):
    """Two stages, as TorchRec's ``TrainPipelineBase``: H2D of batch ``b + 1`` (copy worker)
    overlaps forward/backward/optimizer of batch ``b`` (compute worker)."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 device: Union[str, torch.device] = "cpu", *, device_threads: Optional[int] = None,
                 overlap: bool = True) -> None:
        check_bool("overlap", overlap)  # before anything is set up
        super().__init__(model, optimizer, device)
        # The stages reach this object weakly: a pipeline dropped without close() is freed (its
        # threads stopped, its in-flight batch let go) at once, not when the cycle collector runs.
        self.pipeline = StagedPipeline(
            [PipelineStage("h2d", _weakly(self._h2d_batch), "copy"),
             PipelineStage("train", _weakly(self._train), "device")],
            device=self.device, host_threads=0, device_threads=device_threads, overlap=overlap,
            admit=self._check_movable)


class TrainPipelineSparseDist(_ReadyPipeline):
    """Three stages, as TorchRec's ``TrainPipelineSparseDist``: H2D; input dist; fwd/bwd/opt.

    ``input_dist(device_batch) -> device_batch`` runs on a host thread (TorchRec starts the
    sparse-feature all-to-all there); on an accelerator, on that thread's current stream,
    after the batch's copy (the stages hand over through events, see ``StagedPipeline``). Single process, the default is the identity; for a
    key all-to-all across processes see `torchpipe.train.dist.TableWiseSharding`.
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 device: Union[str, torch.device] = "cpu", *,
                 input_dist: Optional[Callable[[Any], Any]] = None, host_threads: int = 1,
                 device_threads: Optional[int] = None, overlap: bool = True) -> None:
        if input_dist is not None and not callable(input_dist):
            raise TypeError(f"input_dist must be callable or None, got {input_dist!r}")
        check_bool("overlap", overlap)
        super().__init__(model, optimizer, device)
        self._input_dist = input_dist
        # Weakly, as in TrainPipelineBase: no cycle through the stages.
        self.pipeline = StagedPipeline(
            [PipelineStage("h2d", _weakly(self._h2d_batch), "copy"),
             PipelineStage("input_dist", _weakly(self._dist), "host"),
             PipelineStage("train", _weakly(self._train), "device")],
            device=self.device, host_threads=host_threads, device_threads=device_threads, overlap=overlap,
            admit=self._check_movable)

    def _dist(self, item: _Item) -> _Item:
        if self._input_dist is not None:
            item.device_batch = self._input_dist(item.device_batch)
        return item


def _raise_own_or_peers(failure: Optional[Exception], own_note: str, peers_message: str) -> NoReturn:
    """After a vote that some rank failed: this rank's own ``failure`` if it has one (with
    ``own_note``, which names the failed ranks), else `PeerStepFailed` (``peers_message``)."""
    if failure is not None:
        add_note(failure, f"[torchpipe.train] {own_note}")
        raise failure
    raise PeerStepFailed(peers_message)


def _or_own_failure(call: Callable[[], Any], failure: Optional[Exception]) -> Any:
    """``call()`` (a vote: telling the other ranks); if it fails, this rank's own ``failure``,
    noted with that, when it has one: the rank's own error is the one to raise."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001
        if failure is None:
            raise
        _note_telling_the_others_failed(failure, error)
        raise failure


def _note_telling_the_others_failed(failure: Exception, error: Exception) -> None:
    """Say on this rank's ``failure`` (still the error raised) that telling the other ranks of it failed too."""
    add_note(failure, f"[torchpipe.train] telling the other ranks of it failed too ({type(error).__name__}: {error})")


@dataclass(eq=False)
class _Armed:
    features: Any
    plan: BatchPlan
    thread: int
    item: Any = None
    used: bool = False
    exchange: ExchangeRecord = field(default_factory=ExchangeRecord)  # across processes: the output exchanges
    agreed: bool = False  # across processes: every rank's step got as far as the dense optimizer's


def _call_if_alive(pipeline: "weakref.ref[Any]", method: str, *args: Any) -> Any:
    alive = pipeline()
    return None if alive is None else getattr(alive, method)(*args)


class _InFlight:
    """The batches planned on the collection and not yet released, in plan order.

    Kept apart from the pipeline, so that the pipeline's finalizer can reach them without
    keeping the pipeline alive: a pipeline closed or collected with batches in flight must
    still hand the collection back whole, or every later `flush` would be refused.
    """

    def __init__(self, collection: CachedEmbeddingBagCollection) -> None:
        self.collection = collection
        self._items: List[_Item] = []
        self._lock = threading.Lock()

    def add(self, item: _Item) -> None:
        with self._lock:
            self._items.append(item)

    def release_trained(self) -> None:
        """Release the batches whose train step ran, oldest first.

        A batch leaves the set only once released: a release cut short (a Ctrl-C on the
        caller's thread) is finished by the next call, or by `drop_all`.
        """
        with self._lock:
            done = [item for item in self._items if item.trained]
        for item in done:
            assert item.plan is not None
            # done_ok: a close() on another thread that gave up waiting for this call may be
            # handing the same batches back (finish_swaps releases them too).
            self.collection.release(item.plan, done_ok=True)
            with self._lock:
                self._items = [other for other in self._items if other is not item]

    def _take_plans(self) -> List[BatchPlan]:
        with self._lock:
            items, self._items = self._items, []
        return [item.plan for item in items if item.plan is not None]

    def drop_all(self) -> None:
        """Complete the swaps of every batch left (oldest first) and release them all.

        Swaps move rows without changing them, so the tables plus the cache keep exactly the
        state of the steps that ran. If a swap fails, the collection keeps the rest queued
        and retries them before its next plan, flush or lookup.
        """
        plans = self._take_plans()
        if plans:
            self.collection.finish_swaps(plans)

    def hand_back(self) -> None:
        """Like `drop_all`, but only queue the swaps on the collection (see `defer_swaps`).

        Queued before they leave this set: a hand-back cut short by a Ctrl-C loses no batch,
        and one run again queues them twice, which `finish_swaps` takes (a swap or release
        already done is not repeated)."""
        with self._lock:
            plans = [item.plan for item in self._items if item.plan is not None]
        self.collection.defer_swaps(plans)
        self._take_plans()


def _drop_pipeline(hooks: List[Any], in_flight: _InFlight, backend: Any, device: torch.device) -> None:
    """Finalizer of an `EmbCacheTrainPipeline`: unhook it and hand its batches back (see `_InFlight`).

    It may run on any thread, from the garbage collector, so it moves no row and takes none of
    the collection's locks; the device work of the steps that ran is waited for, so the
    queued swaps read the final rows.
    """
    for hook in hooks:
        hook.remove()
    backend.synchronize(device)
    in_flight.hand_back()


# The pipeline each collection serves: the newest one built on it. An older one, drained and
# left open, must not plan on the cache again behind the newer one's batches.
_SERVING: "weakref.WeakKeyDictionary[CachedEmbeddingBagCollection, Any]" = weakref.WeakKeyDictionary()


def claim_collection(collection: CachedEmbeddingBagCollection) -> None:
    """Refuse a collection that still has batches in flight: a cache serves one pipeline at a time.

    A pipeline that was dropped without `close()` hands its batches back when it is collected,
    so collect garbage first; a live one must be flushed or closed. (A direct lookup whose
    backward has not run is released, as by the collection's next plan.) Two pipelines
    planning on one cache would evict each other's protected rows or wait on each other's
    write-backs.
    """
    def busy() -> bool:  # batches that protect no slot yet (in h2d, say) count too, through the owner
        return _busy_owner(collection) is not None or bool(collection.in_flight() or collection.pending_writes())

    if busy():
        collection.settle()
    if busy():
        gc.collect()  # a full collection costs tenths of a second: only when settling was not enough
        collection.settle()
    if busy():
        owner = _busy_owner(collection)
        batches = f"; batches {owner.pipeline.in_flight()} of its pipeline" if owner is not None else ""
        raise RuntimeError(
            f"the collection has batches in flight ({collection.in_flight()} protected slots, "
            f"{collection.pending_writes()} pending write-backs{batches}) from another pipeline; flush() or "
            "close() that pipeline first")


def _busy_owner(collection: CachedEmbeddingBagCollection) -> Any:
    """The pipeline ``collection`` serves, if it is open with batches in flight; else None."""
    serving = _SERVING.get(collection)
    owner = serving() if serving is not None else None
    if owner is None or owner.pipeline.closed or not owner.pipeline.in_flight():
        return None
    return owner


def serve(collection: CachedEmbeddingBagCollection, pipeline: Any) -> None:
    """From now on ``collection`` serves ``pipeline`` (once it is fully built): an older pipeline
    on it refuses to run (`refuse_if_superseded`) instead of waiting on the newer one's
    write-backs for good."""
    _SERVING[collection] = weakref.ref(pipeline)


def refuse_if_superseded(collection: CachedEmbeddingBagCollection, pipeline: Any) -> None:
    """RuntimeError when a newer pipeline has claimed ``collection`` since ``pipeline`` did."""
    serving = _SERVING.get(collection)
    if serving is None or serving() is not pipeline:
        raise RuntimeError("this pipeline's collection serves a newer EmbCacheTrainPipeline, built on it after "
                           "this one was drained: one pipeline at a time plans on a cache. close() this one and "
                           "go on with the newer one")


def find_collection(model: nn.Module) -> CachedEmbeddingBagCollection:
    """The one cached collection in ``model``, so that a pipeline can plan its swaps without being told."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model is a {type(model).__name__}, not an nn.Module whose modules hold the "
                        "CachedEmbeddingBagCollection: pass collection= explicitly")
    found = [m for m in model.modules() if isinstance(m, CachedEmbeddingBagCollection)]
    if len(found) != 1:
        raise ValueError(f"EmbCacheTrainPipeline needs exactly one CachedEmbeddingBagCollection in the model "
                         f"(found {len(found)}); pass collection= explicitly")
    return found[0]


def check_features(kjt: Any, collection: CachedEmbeddingBagCollection) -> None:
    """Cheap admission check of a batch's KJT (names, dtype, key range); raises `RecInputError`.

    Runs on the caller's thread before the batch enters the pipeline, so a bad batch changes
    nothing: no cache, table or pipeline state. (The input-dist stage validates again.)
    """
    check_kjt(kjt, collection.layouts)


class EmbCacheTrainPipeline(_ReadyPipeline):
    """Five stages over a `CachedEmbeddingBagCollection` (host tables, device row cache):

    1. ``h2d`` (copy worker): the batch to the device; the host KJT is kept for planning;
    2. ``input_dist`` (host): in one process, validation + dedup of the batch; across
       processes (``sharding=`` a `torchpipe.train.dist.TableWiseSharding`), the key
       all-to-all to the table owners, and the global batch's dedup moves to ``plan``;
    3. ``plan`` (host): swap info (slots, evictions, protection, host-write ticket), in
       batch order;
    4. ``swap`` (host): gather evicted rows from their slots, write them back to the host
       table, look up the incoming rows (after earlier write-backs of them: ticket order),
       scatter them into their slots;
    5. ``train`` (compute worker): forward with the batch's plan, backward (the sparse
       optimizer is fused into it), dense ``optimizer.step()``.

    In a steady clock batch ``b`` trains while ``b + 1`` swaps and ``b + 2`` plans on host
    threads. A batch's keys are protected from its plan until the clock after its train
    step, so the cache must hold the unique keys of 3 consecutive batches (plan window:
    the batch being planned, the one swapping, the one training); `CacheTooSmallError`
    says so with numbers.

    The model calls the collection with ``batch.sparse_features`` as TorchRec's EBC is
    called; a forward pre-hook hands the collection the batch's plan.

    Across processes (``sharding=``), the rest of the model is a replica on every rank, as
    with TorchRec's DMP + DDP: its parameters and buffers are broadcast from the first rank
    when the pipeline is built, and its gradients are all-reduced before the dense optimizer
    steps, averaged (``dense_grads='mean'``, DDP's rule) or summed (``'sum'``, for a loss that
    sums over samples), with the first rank's buffers in the same round. The trained
    parameters are read at every step (freeze and unfreeze alike on every rank), the buffers
    when the pipeline is built.

    Failure: the first error of any stage surfaces with its type; in-flight batches are
    dropped *after* their swaps are completed (swaps move rows, they never change them),
    so the host tables plus the cache hold exactly the state after `steps_done` steps,
    and `flush()` writes it back. The pipeline is empty and usable afterwards.

    Across processes, a failure in ``h2d``, ``plan`` or ``swap`` on one rank (a cache too
    small for the keys its tables get) reaches every rank: the ranks vote once per clock
    (one small all-reduce, which no rank waits for at the clock's end). The clock's finished
    batch, if any, is returned on every rank; then, before the next clock admits a batch (in
    the same call while the pipeline fills, else the next ``progress()`` or ``flush()``),
    the failing rank raises its own error and the others `torchpipe.grad_sync.PeerStepFailed`.
    All drop the same batches and return the same outputs, so they go on in step.

    A failure in the train stage on one rank (the model's forward, the loss, backward) fails
    that step on every rank, in the same call: the failing rank still issues the batch's
    output exchanges it missed (zeros) and the dense all-reduce, which carries a failure
    flag per rank, so no rank takes the dense optimizer step, every rank puts the batch's
    rows back, and every rank drops its batches in flight. An error in the dense optimizer's
    own ``step()`` comes after the ranks agreed: every rank keeps the step (rows, and
    ``steps_done``), that rank fails at once, the others in their next call
    (`PeerStepFailed`), and its dense replica may differ from then on. In ``eval()`` mode
    (no all-reduce) the step's failure goes into the clock's vote, which such a clock waits
    for before it hands its output on: every rank drops that output and raises in the same
    call, and the step counts only once every rank's went well. A collective that
    fails itself (a peer gone, the group's timeout), in ``input_dist`` or ``train``, is the
    process group's own error, on the ranks it reaches.
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 device: Union[str, torch.device] = "cpu", *,
                 collection: Optional[CachedEmbeddingBagCollection] = None, host_threads: int = 3,
                 device_threads: Optional[int] = None, overlap: bool = True,
                 sharding: Optional[Any] = None, dense_grads: str = "mean", keep_records: int = 0) -> None:
        # Everything is checked before the collection is claimed and hooked, or a thread starts.
        if collection is not None and not isinstance(collection, CachedEmbeddingBagCollection):
            raise TypeError(f"collection must be a CachedEmbeddingBagCollection or None (found in the model), "
                            f"got {type(collection).__name__}")
        check_pipeline_options(host_threads, device_threads, overlap, keep_records)
        if host_threads == 0:  # here, before the collection is claimed: its plan and swap stages need one
            raise ValueError("EmbCacheTrainPipeline runs its input_dist, plan and swap stages on host threads, "
                             "but host_threads=0; give it at least 1")
        if dense_grads not in ("mean", "sum"):
            raise ValueError(f"dense_grads must be 'mean' (DDP's rule) or 'sum', got {dense_grads!r}")
        if sharding is not None:
            if not isinstance(sharding, TableWiseSharding):
                raise TypeError(f"sharding must be a torchpipe.train.dist.TableWiseSharding or None, got "
                                f"{type(sharding).__name__}")
            if not isinstance(model, nn.Module):
                raise TypeError(f"sharding= replicates the model's parameters: the model must be an nn.Module, "
                                f"got {type(model).__name__}")
        super().__init__(model, optimizer, device)
        try:
            self.collection = collection if collection is not None else find_collection(model)
            if self.collection.device != self.device:
                raise ValueError(f"the collection caches rows on {self.collection.device}, the pipeline runs on "
                                 f"{self.device}")
            if sharding is not None:
                sharding.check_collection(self.collection)
            refusal: Optional[Exception] = None
        except Exception as exc:  # noqa: BLE001 - raised at once, or agreed on across ranks first
            refusal = exc
        if sharding is not None:  # every rank refuses together: none is left in the broadcast below
            sharding.agree(refusal, "collection", ValueError)
        elif refusal is not None:
            raise refusal
        claim_collection(self.collection)
        self._sharding = sharding
        # Across processes the dense part is replicated: its gradients are all-reduced over the
        # sharding's output group before the dense optimizer steps ('mean' like DDP, or 'sum').
        self._dense_sync: Optional[Callable[[bool], List[int]]] = None
        if sharding is not None:
            group, average, device, collection = sharding.output_group, dense_grads == "mean", self.device, self.collection
            parameters, buffers = dense_replica(model, collection)
            take_first_ranks_values(parameters + buffers, group)  # every replica starts equal, as with DDP

            def dense_sync(failed: bool) -> List[int]:
                # The trained parameters as of this step (a layer unfrozen later is averaged; the
                # frozen ones cost nothing), and the buffers as built (DDP's list too: every rank's
                # broadcast has the same layout, whatever a layer later registers).
                trained = [p for p in dense_replica(model, collection)[0] if p.requires_grad]
                return all_reduce_dense_grads(trained, group, average, failed, device, buffers)

            self._dense_sync = dense_sync
        # Swaps run on host threads but move rows in device memory: on an accelerator they get
        # their own stream, ordered after the train steps that last updated the evicted rows
        # and before the train step of their batch (events; no-ops on the CPU).
        self._swap_stream = self._backend.new_stream(self.device)
        self._trained_event: Any = None
        self._in_flight = _InFlight(self.collection)
        self._armed: Optional[_Armed] = None
        # This clock's forward-only step across processes (eval mode), settled by the clock's
        # vote (`_agree_on_clock`): the batch waiting to count, _EVAL_STEP_FAILED, or None
        # (no such step in this clock, or a clock that failed at once).
        self._eval_step: Any = None
        # The collection outlives the pipeline: its hooks must not keep the pipeline (and its
        # threads) alive, so they reach it through a weak reference and go with it.
        this = weakref.ref(self)
        self._hooks = [self.collection.register_forward_pre_hook(mark_pipeline_hook(
            lambda module, args, kwargs: _call_if_alive(this, "_inject_plan", module, args, kwargs)),
            with_kwargs=True)]
        if sharding is not None:
            self._hooks.append(self.collection.register_forward_hook(mark_pipeline_hook(
                lambda module, args, output: _call_if_alive(this, "_output_dist", module, args, output))))
        # Closed or collected with batches in flight: the workers stop first, then this runs.
        self._finalizer = weakref.finalize(self, _drop_pipeline, list(self._hooks), self._in_flight,
                                           self._backend, self.device)
        # The stages reach this object weakly too: without a cycle, a pipeline dropped without
        # close() goes (and hands its batches back) at once, not when the cycle collector runs.
        # Across processes, a failure of a stage without collectives (h2d, plan, swap), or of
        # the train stage (which issues the collectives it missed and agrees with the other
        # ranks within the step), lets the clock's other stages finish (their collectives pair
        # up with the other ranks'); then the ranks vote (`_agree_on_clock`) and all drop the
        # same batches.
        self.pipeline = StagedPipeline(
            [PipelineStage("h2d", _weakly(self._h2d_batch), "copy", local=True),
             PipelineStage("input_dist", _weakly(self._dist), "host"),
             PipelineStage("plan", _weakly(self._plan), "host", local=True),
             PipelineStage("swap", _weakly(self._swap), "host", local=True),
             PipelineStage("train", _weakly(self._train_cached), "device", local=True)],
            device=self.device, host_threads=host_threads, device_threads=device_threads, overlap=overlap,
            admit=_weakly(self._admit), data_ended=_weakly(self._data_ended) if sharding is not None else None,
            on_abort=self.collection.abort, on_failure=_weakly(self._recover),
            after_clock=_weakly(self._after_clock), before_call=_weakly(self._release_leftovers),
            agree=_weakly(self._agree_on_clock) if sharding is not None else None, keep_records=keep_records)
        serve(self.collection, self)  # last: a constructor that failed leaves the serving pipeline as it was

    # -- stages ----------------------------------------------------------------------
    def _admit(self, batch: Any) -> None:
        if self._sharding is None:
            self._check_batch(batch)
            self.collection.check_batch_fits(batch.sparse_features)
            return
        # Every rank checks its whole batch against every table (all ranks have the configs):
        # a bad key found only by its owner, after the key exchange, would leave the ranks'
        # collectives out of step. Then the ranks vote, so that a batch refused on one rank is
        # refused on all of them and every rank skips that step together.
        try:
            self._check_batch(batch)
            refusal: Optional[Exception] = None
        except Exception as exc:  # noqa: BLE001 - voted on, then raised
            refusal = exc
        self._admission_vote(_REFUSED if refusal is not None else _HAS_BATCH, refusal)

    def _data_ended(self, failure: Optional[Exception]) -> None:
        """Sharded: this rank has no batch (its data ended, or its iterator raised ``failure``);
        it votes all the same, as the ranks that have one do in ``_admit``."""
        self._admission_vote(_DATA_ENDED if failure is None else _NO_BATCH, failure)

    def _admission_vote(self, code: int, own_error: Optional[Exception]) -> None:
        """Every rank's admission code (one small all-reduce before a batch's collectives); raises
        on every rank unless every rank has a good batch, or every rank's data ended.

        A rank whose data ended would otherwise leave the others in the next batch's key
        exchange until the group's timeout; a rank whose iterator failed, likewise.
        """
        assert self._sharding is not None
        codes = self._sharding.codes_later(code)()
        ended = [rank for rank, c in enumerate(codes) if c == _DATA_ENDED]
        refused = [rank for rank, c in enumerate(codes) if c == _REFUSED]
        broken = [rank for rank, c in enumerate(codes) if c == _NO_BATCH]
        if ended and len(ended) < len(codes):
            mine = ("this rank's data ended too" if code == _DATA_ENDED else
                    "this rank's data iterator failed (the error this was raised from)" if code == _NO_BATCH else
                    "this rank's batch was not admitted (not trained)")
            had = [rank for rank, c in enumerate(codes) if c in (_HAS_BATCH, _REFUSED)]
            others = " and ".join(([f"ranks {had} still had a batch"] if had else []) +
                                  ([f"the data iterator of ranks {broken} failed"] if broken else []))
            raise UnevenDataError(
                f"the data ended on ranks {ended} while {others}: every rank must feed the same number of batches "
                f"(drop_last=True, or shards of equal length); {mine}. The pipeline ends the data on every rank: "
                "call progress() with the same iterator until StopIteration to finish the batches in flight"
            ) from own_error
        what = " and ".join(([f"ranks {refused} refused their batch"] if refused else []) +
                            ([f"the data iterator of ranks {broken} failed"] if broken else []))
        if own_error is not None:
            add_note(own_error, f"[torchpipe.train] {what}; every rank skips this batch, so the ranks stay in step")
            raise own_error
        if what:
            raise RecInputError(f"{what} (see their error), so this rank skips its batch too: the ranks stay in step")

    def _check_batch(self, batch: Any) -> None:
        if not hasattr(batch, "sparse_features"):
            raise TypeError(f"EmbCacheTrainPipeline batches need .sparse_features, got {type(batch).__name__}")
        self._check_movable(batch)
        if self._sharding is None:
            check_features(batch.sparse_features, self.collection)
        else:
            self._sharding.check_batch(batch.sparse_features)

    def _dist(self, item: _Item) -> _Item:
        features = item.batch.sparse_features
        if self._sharding is not None:  # only the key exchange here: prepare can fail on one rank only
            item.features, item.extra["splits"] = self._sharding.input_dist(features)
            return item
        item.features = features
        item.keys = self.collection.prepare(features)
        return item

    def _plan(self, item: _Item) -> _Item:
        if item.keys is None:  # sharded: the global batch's dedup, in this stage without collectives
            item.keys = self.collection.prepare(item.features)
        try:
            plan = self.collection.plan(item.keys)
        except CacheTooSmallError as error:  # its advice counts this moment's batches: say what the pipeline needs
            add_note(error, "[torchpipe.train] this pipeline keeps the keys of 3 consecutive batches in the cache "
                            "(the one planned, the one swapping, the one training): cache_rows must hold the "
                            "unique keys a table gets in any 3 consecutive batches")
            raise
        item.plan = plan
        self._in_flight.add(item)
        return item

    def _swap(self, item: _Item) -> _Item:
        collection, plan, backend, stream = self.collection, item.plan, self._backend, self._swap_stream
        assert plan is not None
        with backend.use_device(self.device), backend.use_stream(stream):
            # Evicted rows were last updated by batches whose train steps are all queued by
            # now (their keys were unprotected when this batch was planned): wait for them.
            trained = self._trained_event
            if trained is not None:
                backend.wait_event(stream, trained)
            collection.write_back(plan, collection.gather_out(plan))
            collection.scatter_in(plan, collection.fetch_in(plan))
            item.extra["swapped"] = mark_ready(backend, stream)
        return item

    def streams(self) -> List[Tuple[torch.device, Any]]:
        return [*super().streams(), (self.device, self._swap_stream)]

    def _inject_plan(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        armed = self._armed
        if armed is None or armed.thread != threading.get_ident():
            return None
        features = args[0] if args else kwargs.get("features")
        if armed.used:
            raise RuntimeError("the model called the cached collection twice in one step; "
                               "EmbCacheTrainPipeline plans one lookup per batch")
        if features is not armed.features:
            raise RuntimeError("the model must call the cached collection with the batch's own "
                               "sparse_features (the pipeline planned that KJT's keys)")
        armed.used = True
        return (armed.item.features, armed.plan), {}

    def _output_dist(self, module: nn.Module, args: tuple, output: Any) -> Any:
        armed = self._armed
        if armed is None or armed.thread != threading.get_ident():
            return None
        return self._sharding.output_dist(output, armed.item.extra["splits"], armed.exchange)

    def _train_cached(self, item: _Item) -> Any:
        assert item.plan is not None
        armed = _Armed(item.device_batch.sparse_features, item.plan, threading.get_ident(), item)
        self._armed = armed
        self._eval_step = None
        training = is_training(self.model)
        snapshots: List[Any] = []  # the batch's rows before the step (a forward-only step updates none)

        def prepare() -> None:
            self._wait_h2d(item)
            swapped = item.extra.get("swapped")
            if swapped is not None:
                self._backend.wait_event(self._backend.current_stream(self.device), swapped)
            if training:
                snapshots.append(self.collection.snapshot_rows(item.plan))

        def before_step() -> None:  # before the dense optimizer: a refused step must change nothing
            if not armed.used:
                raise RuntimeError("the model did not call the cached collection with batch.sparse_features")

        try:
            if self._sharding is None:
                prepare()
                output = train_step(self.model, self.optimizer, item.device_batch, before_step)
            else:
                output = self._train_step_with_every_rank(item, armed, prepare)
            if not armed.used:  # a forward-only step skips before_step; it changed nothing
                raise RuntimeError("the model did not call the cached collection with batch.sparse_features")
        except BaseException as exc:
            if armed.agreed:  # every rank keeps this step (see _train_step_with_every_rank)
                add_note(exc, "[torchpipe.train] the ranks had agreed on this train step before the dense "
                              "optimizer's step() failed: as on the other ranks, its rows are kept and it counts in "
                              "steps_done; the dense parameters are as that step() left them")
                item.trained = True
                self.steps_done += 1
            elif snapshots:
                # Rows may already carry this step's fused update: put them back (nothing lost,
                # nothing half-applied).
                self.collection.restore_rows(item.plan, snapshots[0])
            raise
        finally:
            self._armed = None
            self._trained_event = mark_ready(self._backend, self._backend.current_stream(self.device))
            snapshots.clear()
        if self._eval_step is _EVAL_STEP_FAILED:  # a forward-only step across processes: it counts once
            self._eval_step = item                # every rank's went well (_agree_on_clock)
            return output
        item.trained = True
        self.steps_done += 1
        return output

    def _train_step_with_every_rank(self, item: _Item, armed: _Armed, prepare: Callable[[], None]) -> Any:
        """`train_step` across processes, failing on every rank when it fails on one.

        A rank whose step fails (waiting for its batch, the model's forward, the loss,
        backward) still issues what the other ranks wait for: the batch's output exchanges it
        missed (`complete_exchange`, zeros), then the dense gradient all-reduce, which carries
        one failure flag per rank. If any rank failed, no rank takes its dense optimizer step
        and every rank raises, the failing one its own error and the others `PeerStepFailed`;
        the caller puts the rows back. So the ranks fail together, at once, instead of the
        others waiting in the exchange for the group's timeout. Once they agreed
        (``armed.agreed``), the step is every rank's: an error in the dense optimizer's step()
        then keeps the rows, as the other ranks do.

        In eval mode there is no all-reduce to carry the flags: the step only notes how it went
        (``_eval_step``), and the clock's own vote, which every clock takes anyway, settles it
        before the output is handed on (`_agree_on_clock`).

        A collective that fails itself (a peer gone, the group's timeout) leaves nothing to
        pair up and nobody to agree with: that error fails the clock at once (`fail_clock_now`).
        """
        assert self._sharding is not None and self._dense_sync is not None
        training = is_training(self.model)
        failure: Optional[Exception] = None
        output: Any = None
        try:
            prepare()
            if training and self.optimizer is not None:
                self.optimizer.zero_grad()
            losses, output = self.model(item.device_batch)
            if not armed.used:
                raise RuntimeError("the model did not call the cached collection with batch.sparse_features")
            if training:
                torch.sum(losses).backward()
        except Exception as exc:  # noqa: BLE001 - agreed on with the other ranks, then raised
            failure = exc
        try:
            if armed.exchange.failed:  # the exchange itself failed: nothing to pair, nobody to agree with
                raise fail_clock_now(failure if failure is not None else RuntimeError(
                    "the batch's output exchange failed, and the model went on past its error"))
            try:
                self._sharding.complete_exchange(armed.exchange, item.extra["splits"], backward=training,
                                                 device=self.device)
                failed = self._dense_sync(failure is not None) if training else []
            except Exception as error:  # noqa: BLE001 - this rank's own failure is still the one raised
                if failure is None:
                    raise fail_clock_now(error)
                _note_telling_the_others_failed(failure, error)
                raise fail_clock_now(failure)
            if not training:  # settled by the clock's vote, before the output is handed on
                self._eval_step = _EVAL_STEP_FAILED  # until the stage returns (_train_cached)
                if failure is not None:
                    raise failure
                return output
            if failed or failure is not None:  # (this rank's own failure is among the flags)
                _raise_own_or_peers(failure, f"ranks {failed} failed this batch's train step: every rank undoes it "
                                             "(rows put back, no dense optimizer step), so the ranks stay in step",
                                    f"ranks {failed} failed this batch's train step (see their error): this rank "
                                    "undoes it too (rows put back, no dense optimizer step), so the ranks stay in "
                                    "step")
        finally:  # no cycle: the failure's traceback holds this frame
            failure = None
        armed.agreed = True
        if training and self.optimizer is not None:
            self.optimizer.step()
        return output

    def _agree_on_clock(self, failure: Optional[Exception]) -> Callable[[], None]:
        """At the end of every clock across processes, tell the other ranks whether this rank's
        h2d, plan or swap failed (a cache too small for its tables' keys, say), or its
        forward-only step (eval mode).

        No rank waits here for the h2d, plan and swap: each starts the vote and reads it before
        its next clock or admission (the check returned), so every rank raises in the same
        call, the failing one its own error and the others `PeerStepFailed`. A clock that ran
        a forward-only step waits for the vote now: if that step failed on any rank, the other
        ranks' outputs hold its zeros, so every rank drops the clock's output and raises here;
        if not, the step counts (``steps_done``) and the output is handed on.
        """
        assert self._sharding is not None
        eval_step, self._eval_step = self._eval_step, None
        own = failure is not None and not isinstance(failure, PeerStepFailed)  # a peer's is voted by the peer
        if eval_step is _EVAL_STEP_FAILED:  # whatever its type: in eval mode no stage raises a peer's error
            code = _EVAL_STEP_FAILED_CODE
        else:
            code = _FAILED_CODE if own else 0
        codes = _or_own_failure(lambda: self._sharding.codes_later(code), failure)
        if eval_step is not None:
            known = [rank for rank, said in enumerate(self._settle_eval_step(eval_step, codes, failure)) if said]
            outcome: Callable[[], List[int]] = lambda: known  # noqa: E731 - waited for already
        else:
            outcome = lambda: [rank for rank, said in enumerate(codes()) if said]  # noqa: E731

        def check() -> None:
            nonlocal failure
            try:
                failed = outcome()
            except Exception as error:  # noqa: BLE001
                if failure is None:
                    raise
                _note_telling_the_others_failed(failure, error)
                failed = None
            if failure is not None:
                if failed is not None:
                    add_note(failure, f"[torchpipe.train] ranks {failed} failed in this clock: every rank drops "
                                      "its batches in flight, so the ranks stay in step")
                try:
                    raise failure
                finally:  # no cycle through this closure: the failure's traceback holds its frame
                    failure = None
            if failed:
                raise PeerStepFailed(f"ranks {failed} failed in this clock's h2d, plan or swap stage, or in the dense "
                                     "optimizer's step (see their error): this rank drops its batches in flight "
                                     "too, so the ranks stay in step")

        return check

    def _settle_eval_step(self, eval_step: Any, codes: Callable[[], List[int]],
                          failure: Optional[Exception]) -> List[int]:
        """Wait for the clock's vote; raise if any rank's forward-only step failed, else count
        this one. Returns every rank's code."""
        said = _or_own_failure(codes, failure)
        failed = [rank for rank, code in enumerate(said) if code == _EVAL_STEP_FAILED_CODE]
        if failed:
            _raise_own_or_peers(failure, f"ranks {failed} failed this batch's train step (forward only, in eval mode): "
                                         "every rank drops its output and its batches in flight, so the ranks stay "
                                         "in step",
                                f"ranks {failed} failed this batch's train step (see their error), a forward-only "
                                "step in eval mode: this rank drops its output too, and its batches in flight, so "
                                "the ranks stay in step")
        eval_step.trained = True  # a batch: this rank's step went well (or the vote says otherwise above)
        self.steps_done += 1
        return said

    # -- bookkeeping on the caller's thread ------------------------------------------------
    def _after_clock(self, clock: Clock, outputs: Dict[int, Any]) -> None:
        """Release the batches trained in this clock (their backward is done)."""
        self._in_flight.release_trained()

    def _release_leftovers(self) -> None:
        """Before each call: release trained batches that an interrupted ``_after_clock`` (a
        Ctrl-C on the caller's thread) left protected, so that the next plan has their room
        and a drained pipeline's flush finds nothing in flight."""
        self._in_flight.release_trained()

    def _recover(self, failure: PipelineFailure) -> None:
        """After a failed clock: finish the swaps of dropped batches, release everything."""
        self._eval_step = None  # a clock that failed at once never settled its step
        self.collection.clear_abort()
        backend, swap = self._backend, self._swap_stream
        others = super().streams()
        for _, stream in others:  # the swaps below come after every step's device work ...
            backend.wait_stream(swap, stream)
        try:
            with backend.use_device(self.device), backend.use_stream(swap):
                # Plan order: swaps complete in ticket order. Trained batches were swapped in.
                self._in_flight.drop_all()
        except BaseException as again:  # noqa: B902 - the step's own error is the one to raise
            add_note(failure.error, f"[torchpipe.train] completing the dropped batches' swaps failed too "
                                    f"({type(again).__name__}: {again}); the collection retries them before its "
                                    "next plan, flush or lookup")
        finally:
            for _, stream in others:  # ... and the next steps come after them
                backend.wait_stream(stream, swap)

    # -- public --------------------------------------------------------------------------
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        refuse_if_superseded(self.collection, self)
        return super().progress(dataloader_iter)

    progress.__doc__ = _ReadyPipeline.progress.__doc__

    def flush(self) -> List[Any]:
        """Train every in-flight batch, then write every cached row back to the host tables."""
        refuse_if_superseded(self.collection, self)
        outputs = super().flush()
        try:
            self.collection.flush()  # on the caller's stream, which now waits for the pipeline's
        except BaseException as exc:  # noqa: B902 - the batches trained here are not lost
            keep_flushed_outputs(exc, outputs)
            raise
        return outputs

    def hit_rate(self) -> float:
        """Share of looked-up rows found in the device cache, over every table since the cache was built."""
        stats = self.collection.cache_stats().values()
        hits = sum(s.hits for s in stats)
        total = hits + sum(s.misses for s in stats)
        return hits / total if total else 0.0

    def close(self) -> None:
        """Stop the threads. Batches still in flight are dropped, not trained (`flush` trains them).

        Their swaps are completed and their keys released, so the collection holds exactly the
        state after `steps_done` steps: its `flush()` and `save` work, and a new pipeline (or
        the model called directly) can go on training from there. Called on the thread inside
        ``progress()`` (the data iterator, a callback, a signal handler), it closes when that
        call ends, as ``StagedPipeline.close`` does.
        """
        if self.pipeline.defer_to_call_end(self.close):  # inside progress(): its stages still run
            return
        super().close()  # no stage runs after this
        held = self._finalizer.peek()
        if held is not None:  # run before it is marked done: a close() cut short by Ctrl-C is run again
            _drop_pipeline(*held[2])
            self._finalizer.detach()
        with self._backend.use_device(self.device):
            self.collection.finish_swaps()  # on the caller's stream, after the device work (above)
