"""Carrying skip tensors between partitions inside one pipeline step.

Each step has a :class:`SkipStore`, a mailbox keyed by (skip name, micro-batch). A partition's
job installs a :class:`PipelineSkipTracker`: a stash puts the tensor (and the producer's
ready event) into the store, a pop takes it out (so the store holds it no longer than
needed) and copies it to the popping partition's device. Under ``Pipe.step`` the pop also
cuts the graph: the popped tensor becomes a leaf whose gradient goes back through the store
to the stashing partition's backward. Under checkpointing, the pops of skips from other
partitions are remembered so that the recompute receives exactly the same tensors, and the
recompute's stashes do not leave the partition (the originals are already on their way):
a skip stashed and popped within the partition is recomputed like any other activation.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

from torch import Tensor

from ..checkpoint import is_checkpointing
from ..copy import mark_ready, receive
from ..microbatch import Batch, items_of, map_nested, nested_tensors, rebuild
from .tracker import SkipKey, skip_name, use_skip_tracker

__all__ = ["SkipStore", "PipelineSkipTracker", "StageSkips"]

RECOMPUTED_HERE: Any = object()
"""A checkpointed partition's memo entry for a pop of its own stash, which the recompute redoes."""


Graph = List[Tuple[int, Tensor]]
"""The tensors of a stash that get gradients, with their positions in it (`_graph_tensors`)."""


class SkipStore:
    """The per-step mailbox of skip tensors and of their gradients."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (value, ready event, stashing partition, its graph tensors as stashed: `_graph_tensors`)
        self._tensors: Dict[Tuple[SkipKey, int], Tuple[Any, Any, int, Graph]] = {}
        self._grads: Dict[Tuple[Tuple[SkipKey, int], int], Tuple[Optional[Tensor], Any]] = {}

    def put(self, key: SkipKey, microbatch: int, tensor: Any, event: Any, partition: int,
            graph: Graph) -> Optional[Graph]:
        """Leave ``tensor`` for its pop. A partition that stashes a name again before it is
        popped replaces its own stash, as the plain model's last stash wins; the replaced
        stash's graph tensors are returned (None if there was none)."""
        with self._lock:
            earlier = self._tensors.get((key, microbatch))
            if earlier is not None and earlier[2] != partition:
                raise RuntimeError(f"skip {skip_name(key)} stashed twice for micro-batch {microbatch}, by "
                                   f"partitions {earlier[2]} and {partition}: a name is stashed by one layer")
            self._tensors[(key, microbatch)] = (tensor, event, partition, graph)
            return None if earlier is None else earlier[3]

    def take(self, key: SkipKey, microbatch: int) -> Tuple[Any, Any, int, Graph]:
        with self._lock:
            try:
                return self._tensors.pop((key, microbatch))
            except KeyError:
                raise RuntimeError(f"pop of skip {skip_name(key)} for micro-batch {microbatch} without a stash") from None

    def put_grad(self, key: Tuple[SkipKey, int], microbatch: int, grad: Optional[Tensor], event: Any) -> None:
        with self._lock:
            self._grads[(key, microbatch)] = (grad, event)

    def take_grad(self, key: Tuple[SkipKey, int], microbatch: int) -> Tuple[Optional[Tensor], Any]:
        with self._lock:
            return self._grads.pop((key, microbatch), (None, None))

    def __len__(self) -> int:
        with self._lock:
            return len(self._tensors) + len(self._grads)

    def aliased_by(self, microbatch: int, tensor: Tensor) -> Optional[SkipKey]:
        """The key of a waiting skip of ``microbatch`` that shares ``tensor``'s memory, if any."""
        if tensor.numel() == 0:  # no memory to share (and every empty storage points at 0)
            return None
        pointer = tensor.untyped_storage().data_ptr()
        with self._lock:
            for (key, index), (stashed, _, _, _) in self._tensors.items():
                if index == microbatch and any(item.numel() and item.untyped_storage().data_ptr() == pointer
                                               for item in nested_tensors((stashed,))):
                    return key
        return None


def _graph_tensors(value: Any) -> Graph:
    """(position, tensor) of each tensor in a stashed ``value`` that requires grad: the value
    itself, or the tensors inside its tuples, lists and dicts, numbered in the order
    ``map_nested`` visits them. Taken at the stash: the pop finds each by identity, so a
    container the stashing layer changes afterwards still sends each gradient to its tensor."""
    return [(position, tensor) for position, tensor in enumerate(nested_tensors((value,))) if tensor.requires_grad]


def _copied_structure(value: Any) -> Any:
    """``value`` with its tuples, lists and dicts copied (nested ones too), their items kept."""
    if isinstance(value, tuple):
        return rebuild(value, [_copied_structure(item) for item in value])
    if isinstance(value, (list, dict)):
        copied = copy.copy(value)  # a subclass keeps its type (a defaultdict its factory)
        for key, item in items_of(value):
            copied[key] = _copied_structure(item)
        return copied
    return value


def _versions(value: Any) -> Tuple[Tuple[int, int], ...]:
    """(identity, version counter) of the tensors in ``value`` (a skip, or inside its containers)."""
    return tuple((id(tensor), tensor._version) for tensor in nested_tensors((value,)))


class StageSkips:
    """What one (partition, micro-batch) stashed and popped, for its explicit backward."""

    __slots__ = ("stashed", "popped")

    def __init__(self) -> None:
        # Keyed by (skip, position): a skip may hold several tensors in a tuple, list or dict.
        self.stashed: List[Tuple[Tuple[SkipKey, int], Tensor]] = []
        self.popped: List[Tuple[Tuple[SkipKey, int], Tensor]] = []


class PipelineSkipTracker:
    """The tracker a pipeline job installs while its partition runs one micro-batch."""

    def __init__(self, store: SkipStore, microbatch: int, stage: Any, record: Optional[StageSkips],
                 memo: Optional[List[Optional[Tensor]]]) -> None:
        self.store = store
        self.microbatch = microbatch
        self.stage = stage
        self.record = record  # set under Pipe.step: cut popped tensors into leaves
        self.memo = memo  # set when the partition is checkpointed
        self.memo_versions: List[Tuple[Tuple[int, int], ...]] = []

    def save(self, key: SkipKey, tensor: Any) -> None:
        stage = self.stage
        event = None if stage.backend.type == "cpu" else mark_ready(stage.backend, stage.stream)
        # Each tensor that requires grad, also inside a tuple, list or dict the layer stashed,
        # gets its gradient back under a key of its own: (name, position).
        graph = _graph_tensors(tensor) if self.record is not None else []
        replaced = self.store.put(key, self.microbatch, tensor, event, stage.index, graph)
        if replaced is not None and self.record is not None:  # no gradient will come for it
            self._forget_local_stash(key, replaced)
        if self.record is not None:
            self.record.stashed.extend(((key, position), item) for position, item in graph)

    def load(self, key: SkipKey) -> Tensor:
        stage = self.stage
        tensor, event, source, graph = self.store.take(key, self.microbatch)
        if source == stage.index and self.record is not None:
            self._forget_local_stash(key, graph)
        if source != stage.index:
            tensor = self._received(key, tensor, event, graph)
        if self.memo is not None and is_checkpointing():
            # A skip of this partition is recomputed with it: nothing to remember (a marker,
            # since another partition may stash None itself).
            # A container is remembered as a copy of its structure: the layer may take items out
            # of the one it got (``parts.pop(0)``), and its recompute must find them all again.
            remembered = _copied_structure(tensor) if source != stage.index else RECOMPUTED_HERE
            self.memo.append(remembered)
            self.memo_versions.append(_versions(remembered))
        return tensor

    def _received(self, key: SkipKey, value: Any, event: Any, graph: Graph) -> Any:
        """A skip from another partition, on this one's device; under ``Pipe.step`` each tensor
        that requires grad (as the stash recorded it, in ``save``), also inside a container,
        becomes a leaf whose gradient goes back to the stasher. A mask or a constant stays what
        the plain model's pop gives (``numpy()`` works on it)."""
        stage = self.stage
        positions: Dict[int, List[int]] = {}  # a tensor held twice has two positions, taken in order
        for position, stashed in graph:
            positions.setdefault(id(stashed), []).append(position)

        def arrive(tensor: Tensor) -> Tensor:
            wants_grad = tensor.requires_grad
            slots = positions.get(id(tensor)) if self.record is not None and wants_grad else None
            if self.record is not None and wants_grad and not slots:
                raise RuntimeError(
                    f"skip {skip_name(key)}: its {type(value).__name__} holds a tensor that requires grad which it did "
                    "not hold when stashed (the stashing layer added or replaced it afterwards): Pipe.step sends "
                    "gradients to the tensors a skip held at its stash, so stash the container once it is complete")
            if event is not None or tensor.device != stage.device:
                tensor = receive(Batch(tensor), event, stage.device, stage.stream, stage.copy_stream_for).tensor
            if slots:
                tensor = tensor.detach().requires_grad_(True)
                self.record.popped.append(((key, slots.pop(0)), tensor))  # type: ignore[union-attr]
            return tensor

        return map_nested(value, arrive)

    def _forget_local_stash(self, key: SkipKey, graph: Graph) -> None:
        """A stash popped in its own partition gets its gradient inside the partition's graph,
        and one stashed over never gets one; no later partition sends one for either. Kept in
        ``record.stashed``, it would take the gradient sent for a later stash of the same name.
        ``graph``: that stash's tensors, as `save` recorded them."""
        stashed = self.record.stashed  # type: ignore[union-attr]
        for position, tensor in graph:
            for index in range(len(stashed) - 1, -1, -1):
                if stashed[index][0] == (key, position) and stashed[index][1] is tensor:
                    del stashed[index]
                    break

    def check_popped_untouched(self) -> None:
        """RuntimeError if a checkpointed forward changed a popped tensor in place.

        Its recompute is served the same tensor, so it would start from the changed values.
        """
        for index, (tensor, versions) in enumerate(zip(self.memo or [], self.memo_versions)):
            now = _versions(tensor)
            if [identity for identity, _ in now] != [identity for identity, _ in versions]:
                raise RuntimeError(
                    f"partition {self.stage.index} changed the {type(tensor).__name__} of popped skip {index} (added, "
                    "removed or replaced tensors in it) while being checkpointed, so its recompute would not see what "
                    "the forward saw; change a copy (list(skip), dict(skip)) or use checkpoint='never'")
            if now != versions:
                raise RuntimeError(
                    f"partition {self.stage.index} modified popped skip tensor {index} in place while "
                    "being checkpointed, so its recompute would start from the wrong values; pop it "
                    "into an out-of-place operation (skip = skip * 0.5, not skip.mul_(0.5)) or use "
                    "checkpoint='never'"
                )


class _ReplayTracker:
    """Serves a recompute's pops: skips from other partitions from the first forward's memo,
    skips of this partition from the recompute's own stashes (which go nowhere else)."""

    def __init__(self, memo: List[Optional[Tensor]]) -> None:
        self.memo = memo
        self.position = 0
        self.local: Dict[SkipKey, Tensor] = {}

    def save(self, key: SkipKey, tensor: Tensor) -> None:
        self.local[key] = tensor

    def load(self, key: SkipKey) -> Tensor:
        tensor = self.memo[self.position]
        self.position += 1
        # A copy of a container's structure each time: a partition may be recomputed twice
        # (zero-bubble's I and W), and the layer may take items out of what it gets.
        return self.local.pop(key) if tensor is RECOMPUTED_HERE else _copied_structure(tensor)


def replay_context(memo: List[Optional[Tensor]]) -> Callable[[], ContextManager[None]]:
    """A recompute context factory that installs a fresh replay tracker over ``memo``."""
    return lambda: use_skip_tracker(_ReplayTracker(memo))
