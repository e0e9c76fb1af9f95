"""Input and output dist across processes, table-wise, with `torch.distributed` (gloo on CPU).

Ownership is **table-wise**: table ``i`` (in config order) belongs to rank ``i % world``
unless ``owners`` says otherwise; the owner keeps the whole table (host table + device
cache) and every other rank sends it the keys of that table's features. Why table-wise and
not row-wise: a bag is pooled entirely on one rank, so pooling (sum *and* mean) and the
fused optimizer see exactly the same ops as single-process training; row-wise would pool
partial sums on several ranks and change the summation order.

A feature several tables read (TorchRec's shared feature, pooled as ``feature@table``) goes
to every rank that owns one of them, once per rank.

Per-sample weights (``is_weighted=True``, TorchRec's weighted EBC) travel with their keys, as
float32 (what the pooling casts them to anyway). They are data: their gradients are not sent
back across processes, so weights that require grad are refused rather than left without one.

Per batch, ``input_dist`` buckets the local KJT's features by owner rank and runs three
``all_to_all_single``: counts (batch size, lengths, values per destination), then lengths,
then values (a weighted sharding runs a fourth, for the weights). The owner gets its
features for the *global* batch (samples in source-rank order); the collection's
``prepare`` then dedups it (the global dedup level). After the lookup, ``output_dist``
sends each source its samples' pooled rows back (an autograd all-to-all, whose backward
returns the gradients to the owner).

Collectives of one group must be issued in the same order on every rank. A pipeline issues
input dists on a host thread and output dists (and their backward) on the compute thread,
concurrently; so they take **two** process groups (``input_group``, ``output_group``),
each used by one thread in batch order. With the keys on the default group, an output group
left out is made once per job (`output_group_beside_the_world`); with a subgroup it is given.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

from ..checks import as_int
from ..rec.batch_keys import TABLE_DTYPE, check_kjt, embedding_names_by_table, table_layouts
from ..notes import add_note
from ..rec.errors import RecInputError

__all__ = ["TableWiseSharding", "DistSplits", "ExchangeRecord", "all_to_all", "output_group_beside_the_world",
           "group_timeout"]


@dataclass(frozen=True)
class DistSplits:
    """Batch size of every source rank, for one batch's output dist."""

    batch_sizes: Tuple[int, ...]
    local_batch_size: int


@dataclass
class ExchangeRecord:
    """Which of one batch's output exchanges this rank has issued: the forward all-to-all of
    the pooled rows, and the backward one of their gradients.

    A train step that fails on one rank issues the ones it missed (`complete_exchange`), so
    that the other ranks' exchanges pair up at once instead of at the group's timeout.
    """

    forward: bool = False
    backward: bool = False
    failed: bool = False  # one of them raised: the group itself failed (a call that raised is never issued again)


@contextlib.contextmanager
def _noted(record: Optional[ExchangeRecord], direction: str) -> Iterator[None]:
    """Note in ``record`` that the exchange of ``direction`` went out, also when it raised (then
    the group failed, and it is never issued again)."""
    if record is not None:
        setattr(record, direction, True)
    try:
        yield
    except BaseException:
        if record is not None:
            record.failed = True
        raise


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group,
                record: Optional[ExchangeRecord]) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.record = (out_splits, in_splits), group, record
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        with _noted(record, "forward"):
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        with _noted(ctx.record, "backward"):
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group=None,
               record: Optional[ExchangeRecord] = None) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 with autograd (backward sends the grads back);
    ``record`` notes each direction once it has gone out."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, record)


def _as_group(group: Any) -> Any:
    """``group``, with None (the default group, as collectives read it) made explicit."""
    return group if group is not None else dist.group.WORLD


def check_carries_cpu_tensors(group: Any, role: str) -> None:
    """ValueError unless ``group`` has a backend for CPU tensors (gloo): the keys, their counts and
    every rank's votes are exchanged as CPU tensors, which an NCCL-only group refuses with
    torch's "No backend type associated with device type cpu" at the first collective.
    Raised alike on every rank (the ranks' groups are made alike), before any collective."""
    read_config = getattr(dist, "get_backend_config", None)
    if read_config is None:  # pragma: no cover - every torch we support has it
        return
    config = str(read_config(group))
    if "cpu:" not in config:
        raise ValueError(f"TableWiseSharding's {role} has no backend for CPU tensors (its backends: {config}), but "
                         "the keys and the ranks' votes travel as CPU tensors: init_process_group("
                         "backend='cpu:gloo,cuda:nccl'), or pass input_group=dist.new_group(backend='gloo')")


def group_timeout(group: Any) -> Optional[datetime.timedelta]:
    """The timeout ``group`` (None: the default group) was made with, or None where torch does
    not say (then ``new_group``'s default applies)."""
    process_group = _as_group(group)
    for device_type in ("cpu", "cuda"):  # a gloo group has a CPU backend, an NCCL-only one not
        try:
            return process_group._get_backend(torch.device(device_type)).options._timeout
        except Exception:  # noqa: BLE001 - a private attribute: a backend without it, another torch
            continue
    return None


_output_groups: Dict[Tuple[int, Optional[datetime.timedelta]], Tuple[Any, Any]] = {}
"""The output groups the shardings made, by default group and timeout: ``(default group, made group)``."""


def output_group_beside_the_world() -> Any:
    """A process group over every rank, with the default group's timeout, for the output
    exchanges of shardings whose key exchange uses the default group.

    Why a group of its own: a pipeline runs the key exchange on a host thread and the output
    exchange (with the dense all-reduce) on its compute thread; on one group the two threads'
    collectives would pair up across ranks in different orders (gloo aborts the process).
    Made by every rank (torch names it from its count of groups, the same on every rank), once
    per default group and timeout: the shardings of a job share it rather than each leaving
    a group behind.
    """
    world, timeout = dist.group.WORLD, group_timeout(None)
    made = _output_groups.get((id(world), timeout))
    if made is not None and made[0] is world:
        try:
            dist.get_process_group_ranks(made[1])  # KeyError once destroyed
            return made[1]
        except (KeyError, ValueError, RuntimeError):
            pass
    group = dist.new_group(timeout=timeout)
    _output_groups[(id(world), timeout)] = (world, group)
    return group


class TableWiseSharding:
    """Which rank owns which table, and the key/embedding all-to-alls between ranks.

    ``input_group`` carries the key exchange (None: the default group); ``output_group`` the
    output exchange and a pipeline's dense all-reduce. Left out (or given as the input group)
    while the keys use the default group, the output group is made here, over every rank with
    the same timeout (`output_group_beside_the_world`): a pipeline runs the two exchanges on
    two threads, which one group cannot serve. With a subgroup for the keys, pass another
    group over the same ranks as ``output_group`` (made on every rank of the job).
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], input_group=None, output_group=None,
                 owners: Optional[Dict[str, int]] = None, *, is_weighted: bool = False) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TableWiseSharding needs torch.distributed initialised (init_process_group)")
        check_carries_cpu_tensors(input_group, "input_group (None: the default group)")
        self.input_group = input_group
        self.output_group = output_group
        self._keys_on_default_group = _as_group(input_group) is dist.group.WORLD
        self._makes_output_group = output_group is None or _as_group(output_group) is _as_group(input_group)
        self.rank = dist.get_rank(input_group)
        self.world = dist.get_world_size(input_group)
        # Every rank must build the same sharding, or the first exchange pairs up collectives of
        # different shapes (gloo aborts the process) or of different counts (a hang until the
        # group's timeout). So the ranks compare what they were given, and all raise together.
        try:
            self._build(tables, owners, is_weighted)
            refusal: Optional[Exception] = None
        except Exception as exc:  # noqa: BLE001 - agreed on, then raised
            refusal = exc
        self._agree_on_arguments(refusal)
        if self._makes_output_group:  # decided alike on every rank: agreed above
            self.output_group = output_group_beside_the_world()

    def _owners(self, owners: Optional[Dict[str, int]]) -> Dict[str, int]:
        """Each table's owning rank: ``owners`` checked, or round-robin in config order."""
        names = [t.name for t in self.tables]
        if owners is not None and not isinstance(owners, Mapping):
            raise TypeError(f"owners must be a dict of table name to rank, got {type(owners).__name__}: {owners!r:.80}")
        if not owners:
            return {name: i % self.world for i, name in enumerate(names)}
        missing = [name for name in names if name not in owners]
        unknown = [name for name in owners if name not in names]
        if missing or unknown:
            raise ValueError(f"owners must name every table once: missing {missing}, unknown {unknown}; the tables "
                             f"are {names}")
        result: Dict[str, int] = {}
        for name in names:
            rank = as_int(owners[name])
            if rank is None:
                raise TypeError(f"table {name!r}: owner rank must be an int, got {owners[name]!r}")
            if not 0 <= rank < self.world:
                raise ValueError(f"table {name!r}: owner rank {rank} out of range for world size {self.world}")
            result[name] = rank
        return result

    def _build(self, tables: Sequence[EmbeddingBagConfig], owners: Optional[Dict[str, int]],
               is_weighted: bool) -> None:
        if not isinstance(is_weighted, bool):
            raise TypeError(f"is_weighted must be a bool, got {is_weighted!r}")
        if self._makes_output_group and not self._keys_on_default_group:
            raise ValueError("input_group is a subgroup and output_group is "
                             f"{'not given' if self.output_group is None else 'the same group'}: the output exchange "
                             "needs a group of its own (a pipeline runs the two exchanges on two threads), which "
                             "only every rank of the job can make. Pass output_group=dist.new_group(ranks, "
                             "timeout=...), called on every rank")
        self._weighted = is_weighted
        # Every rank checks its own batch against every table before the key exchange (a key
        # only its owner would find bad would leave the ranks' collectives out of step); this
        # also checks the configs as the collections will (names, pooling, repeated features).
        self.layouts = table_layouts(tables, weighted=is_weighted)
        self.tables = list(tables)
        self.owner = self._owners(owners)
        names_by_table = [layout.output_names for layout in self.layouts]  # ``f@t``: a feature several read
        owned = [[i for i, t in enumerate(self.tables) if self.owner[t.name] == r] for r in range(self.world)]
        idle = [r for r, mine in enumerate(owned) if not mine]
        if idle:  # the same on every rank: all of them refuse, none is left in a collective
            raise ValueError(f"ranks {idle} own no table ({len(self.tables)} tables, world size {self.world}, "
                             f"owners {self.owner}): every rank of the key exchange must own one (pass owners=, "
                             "or use fewer ranks)")
        # What rank r pools: its tables' outputs, in config order, keyed as the whole collection
        # keys them. What it is sent: the features those tables read, each once.
        self.outputs_of_rank: List[List[str]] = [[name for i in mine for name in names_by_table[i]] for mine in owned]
        self.features_of_rank: List[List[str]] = [
            list(dict.fromkeys(f for i in mine for f in self.layouts[i].feature_names)) for mine in owned]
        # The keys rank r's own collection (built from its ``local_tables``) gives the same outputs:
        # a feature it shares only with another rank's table is plain ``f`` there, not ``f@t``.
        self.local_keys_of_rank: List[List[str]] = [
            [name for names in embedding_names_by_table([self.tables[i] for i in mine]) for name in names]
            for mine in owned]
        # Width of each output, keyed like the pooled KeyedTensor (``f@t`` for a shared feature).
        self.dims = {name: layout.dim for layout in self.layouts for name in layout.output_names}
        self.all_outputs = [name for names in names_by_table for name in names]
        self.all_features = list(dict.fromkeys(f for layout in self.layouts for f in layout.feature_names))

    def _arguments(self) -> tuple:
        """What every rank must agree on, as plain values: the tables, their owners, weights,
        and which groups the exchanges use."""
        tables = tuple((layout.name, layout.num_rows, layout.dim, layout.feature_names, layout.pooling)
                       for layout in self.layouts)
        groups = (self._keys_on_default_group, self._makes_output_group)
        return tables, tuple(sorted(self.owner.items())), self._weighted, groups

    def _agree_on_arguments(self, refusal: Optional[Exception]) -> None:
        """Raise on every rank if one refused its arguments or the ranks were given different ones."""
        mine = (refusal is not None, None if refusal is not None else self._arguments())
        everyone: List[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.input_group)
        refused = [rank for rank, (failed, _) in enumerate(everyone) if failed]
        if refusal is not None:
            add_note(refusal, f"[torchpipe.train] ranks {refused} refused their TableWiseSharding arguments; the "
                              "sharding is refused on every rank")
            raise refusal
        if refused:
            raise ValueError(f"ranks {refused} refused their TableWiseSharding arguments (see their error), so "
                             "this rank refuses the sharding too")
        differ = [rank for rank, (_, arguments) in enumerate(everyone) if arguments != everyone[0][1]]
        if differ:
            fields = ("tables (name, rows, dim, features, pooling)", "owners", "is_weighted",
                      "groups (keys on the default group, output group made by the sharding)")
            first, other = everyone[0][1], everyone[differ[0]][1]
            diffs = "; ".join(f"{field}: {a!r} on rank 0, {b!r} on rank {differ[0]}"
                              for field, a, b in zip(fields, first, other) if a != b)
            raise ValueError(f"the ranks built TableWiseSharding with different arguments (ranks {differ} differ "
                             f"from rank 0): {diffs}; every rank must pass the same")

    @property
    def local_tables(self) -> List[EmbeddingBagConfig]:
        """The configs of the tables this rank owns (build its collection from these)."""
        return [t for t in self.tables if self.owner[t.name] == self.rank]

    def is_weighted(self) -> bool:
        """Whether batches carry per-sample weights to the owners (the collections' ``is_weighted``)."""
        return self._weighted

    def check_collection(self, collection: object) -> None:
        """`ValueError` unless ``collection`` pools as this sharding sends: weighted or not, alike."""
        is_weighted = getattr(collection, "is_weighted", None)
        weighted = bool(is_weighted()) if callable(is_weighted) else False
        if weighted != self._weighted:
            raise ValueError(f"the collection was built with is_weighted={weighted} but the sharding with "
                             f"is_weighted={self._weighted}: build both alike (a weighted sharding sends the "
                             "per-sample weights with the keys)")

    def check_batch(self, kjt: KeyedJaggedTensor) -> None:
        """`RecInputError` unless this rank's ``kjt`` suits every table, whichever rank owns it
        (keys in range for each table a feature feeds, per-sample weights as ``is_weighted``
        says and not requiring grad). Reads only."""
        self._check_sendable(kjt)
        check_kjt(kjt, self.layouts)

    def _check_sendable(self, kjt: KeyedJaggedTensor) -> None:
        """What the exchange can carry: one bag per feature and sample, and weights present iff
        weighted, without a graph to send gradients back through (the exchange is data only,
        as TorchRec's input dist)."""
        if not isinstance(kjt, KeyedJaggedTensor):
            raise RecInputError(f"expected a torchrec KeyedJaggedTensor, got {type(kjt).__name__}")
        if kjt.variable_stride_per_key() or kjt.inverse_indices_or_none() is not None:
            raise RecInputError("TableWiseSharding sends one bag per feature and sample: a KeyedJaggedTensor with "
                                "a batch size per feature (stride_per_key_per_rank, VBE) or inverse_indices trains "
                                "in one process only")
        weights = kjt.weights_or_none()
        if (weights is not None) != self._weighted:
            raise RecInputError(f"the sharding was built with is_weighted={self._weighted}, but the batch "
                                f"{'carries' if weights is not None else 'has no'} per-sample weights")
        if weights is not None and weights.requires_grad:
            raise RecInputError("the batch's per-sample weights require grad, but across processes they are sent "
                                "as data and get no gradient back: detach them, or train in one process")

    def vote(self, failed: bool, *, on_output_group: bool = False, device: Optional[torch.device] = None) -> List[int]:
        """The ranks that say they ``failed`` (one small all-reduce over the input group, or the
        output group, of a tensor on ``device``, the CPU by default; every rank must call it, in
        the same order as its other collectives of that group)."""
        return self.vote_later(failed, on_output_group=on_output_group, device=device)()

    def vote_later(self, failed: bool, *, on_output_group: bool = False,
                   device: Optional[torch.device] = None) -> Callable[[], List[int]]:
        """`vote` without waiting for the other ranks: the returned function waits for them and
        gives the ranks that failed. This rank's place in the group's order is taken now."""
        codes = self.codes_later(int(failed), on_output_group=on_output_group, device=device)
        return lambda: [rank for rank, code in enumerate(codes()) if code]

    def codes_later(self, code: int, *, on_output_group: bool = False,
                    device: Optional[torch.device] = None) -> Callable[[], List[int]]:
        """Every rank's small integer ``code`` (0: nothing to say), in rank order: `vote_later`
        with more than yes or no, in the same one all-reduce. The returned function waits."""
        codes = torch.zeros(self.world, dtype=torch.int64, device=device)
        codes[self.rank] = code
        group = self.output_group if on_output_group else self.input_group
        work = dist.all_reduce(codes, group=group, async_op=True)

        def outcome() -> List[int]:
            work.wait()
            return codes.tolist()

        return outcome

    def agree(self, refusal: Optional[Exception], what: str = "batch",
              error: Callable[[str], Exception] = RecInputError) -> None:
        """Tell every rank whether any refused its ``what`` (one small all-reduce), and raise if one did.

        ``refusal`` is this rank's own error (None: its batch is good). It is raised here with
        a note naming every refusing rank; a rank whose batch was good raises ``error``
        (`RecInputError` for a batch) naming the ones that refused, so that every rank skips
        the batch together and the ranks' collectives stay in step.
        """
        refused = self.vote(refusal is not None)
        if refusal is not None:
            add_note(refusal, f"[torchpipe.train] ranks {refused} refused their {what}; every rank skips this "
                              f"{what}, so the ranks stay in step")
            raise refusal
        if refused:
            raise error(f"ranks {refused} refused their {what} (see their error), so this rank skips its {what} too: "
                        "the ranks stay in step")

    def input_dist(self, kjt: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, DistSplits]:
        """This rank's features for the global batch, and the splits for the output dist.

        A weighted sharding sends each key's weight with it (as float32). Weights that do not
        match ``is_weighted``, or that require grad, are refused before any collective (an
        unchecked batch here leaves the other ranks in theirs: `lookup` and the pipeline check
        every rank's batch and agree first).
        """
        self._check_sendable(kjt)
        features = kjt.to_dict()
        missing = [f for f in self.all_features if f not in features]
        if missing:
            raise ValueError(f"features {missing} are missing from the batch")
        batch = kjt.stride()
        # What goes to each rank: the lengths of its features, then per key position the key
        # (and its weight), all in the rank's feature order.
        kinds = [(lambda jt: jt.lengths(), torch.int64), (lambda jt: jt.values(), torch.int64)]
        if self._weighted:
            kinds.append((lambda jt: jt.weights(), TABLE_DTYPE))
        # (Every rank owns a table, and every table reads a feature: no list below is empty.)
        send = [[torch.cat([read(features[f]).to(dtype) for f in self.features_of_rank[r]])
                 for r in range(self.world)] for read, dtype in kinds]
        counts = torch.tensor([[batch, lengths.numel(), keys.numel()] for lengths, keys in zip(send[0], send[1])],
                              dtype=torch.int64)
        group = self.input_group
        got_counts = torch.empty_like(counts)
        dist.all_to_all_single(got_counts, counts, group=group)
        got_batches, got_lengths_n, got_keys_n = (column.tolist() for column in got_counts.unbind(1))
        got = []
        for parts, (_, dtype), sizes in zip(send, kinds, (got_lengths_n, got_keys_n, got_keys_n)):
            out = torch.empty(sum(sizes), dtype=dtype)
            dist.all_to_all_single(out, torch.cat(parts), sizes, [t.numel() for t in parts], group=group)
            got.append(torch.split(out, sizes))
        # Each source sent [features x its samples] lengths: regroup them feature-major over
        # the global batch (samples in source-rank order), and the keys (weights) with them.
        mine = self.features_of_rank[self.rank]
        per_feature: List[List[List[torch.Tensor]]] = [[[] for _ in mine] for _ in kinds]
        for source, b in enumerate(got_batches):
            blocks = got[0][source].view(len(mine), b)
            sizes = blocks.sum(dim=1).tolist()
            for j, block in enumerate(blocks):
                per_feature[0][j].append(block)
            for kind in range(1, len(kinds)):
                for j, part in enumerate(torch.split(got[kind][source], sizes)):
                    per_feature[kind][j].append(part)
        lengths, values, *weights = (torch.cat([t for parts in columns for t in parts]) for columns in per_feature)
        splits = DistSplits(tuple(got_batches), batch)
        global_kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(mine), values=values, lengths=lengths,
                                                         weights=weights[0] if weights else None,
                                                         stride=sum(splits.batch_sizes))
        return global_kjt, splits

    def _output_splits(self, splits: DistSplits) -> Tuple[List[int], List[int]]:
        """The forward output exchange's sizes: what this rank gets from each rank (its samples'
        rows of that rank's tables) and what it sends to each (that rank's samples' rows of its
        own tables), in elements."""
        width = sum(self.dims[name] for name in self.outputs_of_rank[self.rank])
        widths = [sum(self.dims[name] for name in self.outputs_of_rank[r]) for r in range(self.world)]
        return [splits.local_batch_size * w for w in widths], [b * width for b in splits.batch_sizes]

    def output_dist(self, pooled: KeyedTensor, splits: DistSplits,
                    record: Optional[ExchangeRecord] = None) -> KeyedTensor:
        """Each source's rows of ``pooled`` (global batch, this rank's outputs) back to it, as a local KT
        keyed like the unsharded collection's output. ``record`` notes the exchanges as they go out."""
        mine = self.outputs_of_rank[self.rank]
        values = pooled.values() if mine else torch.zeros(sum(splits.batch_sizes), 0)
        expected = self.local_keys_of_rank[self.rank]
        if mine and list(pooled.keys()) != expected:
            raise ValueError(f"pooled keys {pooled.keys()} are not the keys {expected} of this rank's collection "
                             "(build it from local_tables)")
        widths = [sum(self.dims[name] for name in self.outputs_of_rank[r]) for r in range(self.world)]
        flat = values.reshape(-1)
        received, sent = self._output_splits(splits)
        got = all_to_all(flat, received, sent, self.output_group, record)
        blocks: Dict[str, torch.Tensor] = {}
        for r, part in enumerate(torch.split(got, [splits.local_batch_size * w for w in widths])):
            part = part.view(splits.local_batch_size, widths[r])
            names = self.outputs_of_rank[r]
            for name, col in zip(names, torch.split(part, [self.dims[name] for name in names], 1)):
                blocks[name] = col
        keys = self.all_outputs
        return KeyedTensor(keys=keys, length_per_key=[self.dims[name] for name in keys],
                           values=torch.cat([blocks[name] for name in keys], dim=1))

    def complete_exchange(self, record: ExchangeRecord, splits: DistSplits, *, backward: bool,
                          device: torch.device) -> None:
        """Issue the output exchanges of one batch that this rank has not (``record``), with
        zeros and no autograd: the forward one, and the backward one too when ``backward``.

        For a step that failed on this rank: the other ranks' exchanges of the batch pair up
        with these, and the ranks then agree that the step failed (what the zeros carried is
        undone with it).
        """
        received, sent = self._output_splits(splits)

        def exchange(into: List[int], out_of: List[int]) -> None:
            got = torch.empty(sum(into), dtype=TABLE_DTYPE, device=device)
            dist.all_to_all_single(got, torch.zeros(sum(out_of), dtype=TABLE_DTYPE, device=device), into, out_of,
                                   group=self.output_group)

        with torch.no_grad():
            if not record.forward:
                with _noted(record, "forward"):
                    exchange(received, sent)
            if backward and not record.backward:
                with _noted(record, "backward"):
                    exchange(sent, received)

    def lookup(self, collection: torch.nn.Module, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Synchronous sharded lookup: input dist, the owner's collection, output dist.

        Each rank's collection and batch are checked against every table first and the ranks
        agree (`agree`): a bad batch on one rank is refused on every rank, before any key moves.
        They agree again after the owners' lookups, so that one that fails (a cache too small
        for the global batch) fails every rank's call instead of leaving the others waiting
        in the output exchange.
        """
        try:
            self.check_collection(collection)
            self.check_batch(kjt)
            refusal: Optional[Exception] = None
        except Exception as exc:  # noqa: BLE001 - agreed on, then raised
            refusal = exc
        self.agree(refusal)
        global_kjt, splits = self.input_dist(kjt)
        pooled = None
        try:
            pooled = collection(global_kjt)
            failure: Optional[Exception] = None
        except Exception as exc:  # noqa: BLE001 - agreed on, then raised
            failure = exc
        self.agree(failure, "lookup", RuntimeError)
        return self.output_dist(pooled, splits)
