"""Input and output dist across processes, table-wise, with `torch.distributed` (gloo on CPU).

Ownership is **table-wise**: table ``i`` (in config order) belongs to rank ``i % world``
unless ``owners`` says otherwise; the owner keeps the whole table (host table + device
cache) and every other rank sends it the keys of that table's features. Why table-wise and
not row-wise: a bag is pooled entirely on one rank, so pooling (sum *and* mean) and the
fused optimizer see exactly the same ops as single-process training; row-wise would pool
partial sums on several ranks and change the summation order.

A feature several tables read (TorchRec's shared feature, pooled as ``feature@table``) goes
to every rank that owns one of them, once per rank.

Per batch, ``input_dist`` buckets the local KJT's features by owner rank and runs three
``all_to_all_single``: counts (batch size, lengths, values per destination), then lengths,
then values. The owner gets its features for the *global* batch (samples in source-rank
order); the collection's ``prepare`` then dedups it (the global dedup level). After the
lookup, ``output_dist`` sends each source its samples' pooled rows back (an autograd
all-to-all, whose backward returns the gradients to the owner).

Collectives of one group must be issued in the same order on every rank. A pipeline issues
input dists on a host thread and output dists (and their backward) on the compute thread,
concurrently; so they take **two** process groups (``input_group``, ``output_group``),
each used by one thread in batch order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

from ..rec.batch_keys import check_kjt, embedding_names_by_table, table_layouts
from ..rec.errors import RecInputError

__all__ = ["TableWiseSharding", "DistSplits", "all_to_all"]


@dataclass(frozen=True)
class DistSplits:
    """Batch size of every source rank, for one batch's output dist."""

    batch_sizes: Tuple[int, ...]
    local_batch_size: int


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group=None) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 with autograd (backward sends the grads back)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def refuse_weights(kjt: object) -> None:
    """`RecInputError` for a weighted KJT: the key exchange would drop its weights silently."""
    weights_or_none = getattr(kjt, "weights_or_none", None)
    if callable(weights_or_none) and weights_or_none() is not None:
        raise RecInputError("TableWiseSharding exchanges keys, not per-sample weights: a weighted "
                            "KeyedJaggedTensor trains in one process only")


def refuse_weighted_collection(collection: object) -> None:
    """`ValueError` for a collection built with ``is_weighted=True``: its weights would not be exchanged."""
    is_weighted = getattr(collection, "is_weighted", None)
    if callable(is_weighted) and is_weighted():
        raise ValueError("TableWiseSharding exchanges keys, not per-sample weights: a collection built with "
                         "is_weighted=True trains in one process only")


class TableWiseSharding:
    """Which rank owns which table, and the key/embedding all-to-alls between ranks."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig], input_group=None, output_group=None,
                 owners: Optional[Dict[str, int]] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("TableWiseSharding needs torch.distributed initialised (init_process_group)")
        self.input_group = input_group
        self.output_group = output_group
        self.rank = dist.get_rank(input_group)
        self.world = dist.get_world_size(input_group)
        self.tables = list(tables)
        self.owner = {t.name: (owners[t.name] if owners else i % self.world) for i, t in enumerate(self.tables)}
        for name, r in self.owner.items():
            if not 0 <= r < self.world:
                raise ValueError(f"table {name!r}: owner rank {r} out of range for world size {self.world}")
        # Every rank checks its own batch against every table before the key exchange (a key
        # only its owner would find bad would leave the ranks' collectives out of step); this
        # also checks the configs as the collections will (names, pooling, repeated features).
        self.layouts = table_layouts(self.tables)
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

    @property
    def local_tables(self) -> List[EmbeddingBagConfig]:
        """The configs of the tables this rank owns (build its collection from these)."""
        return [t for t in self.tables if self.owner[t.name] == self.rank]

    def check_batch(self, kjt: KeyedJaggedTensor) -> None:
        """`RecInputError` unless this rank's ``kjt`` suits every table, whichever rank owns it
        (keys in range for each table a feature feeds, no per-sample weights). Reads only."""
        refuse_weights(kjt)
        check_kjt(kjt, self.layouts)

    def agree(self, refusal: Optional[Exception]) -> None:
        """Tell every rank whether any refused its batch (one small all-reduce), and raise if one did.

        ``refusal`` is this rank's own error (None: its batch is good). It is raised here with
        a note naming every refusing rank; a rank whose batch was good raises `RecInputError`
        naming the ones that refused, so that every rank skips the batch together and the
        ranks' collectives stay in step.
        """
        votes = torch.zeros(self.world, dtype=torch.int64)
        votes[self.rank] = int(refusal is not None)
        dist.all_reduce(votes, group=self.input_group)
        refused = [rank for rank, vote in enumerate(votes.tolist()) if vote]
        if refusal is not None:
            if hasattr(refusal, "add_note"):
                refusal.add_note(f"[torchpipe.train] ranks {refused} refused their batch; every rank skips this "
                                 "batch, so the ranks stay in step")
            raise refusal
        if refused:
            raise RecInputError(f"ranks {refused} refused their batch (see their error), so this rank skips its "
                                "batch too: the ranks stay in step")

    def input_dist(self, kjt: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, DistSplits]:
        """This rank's features for the global batch, and the splits for the output dist.

        Keys only: a weighted KJT is refused (before any collective) rather than sent without
        its weights.
        """
        refuse_weights(kjt)
        features = kjt.to_dict()
        missing = [f for f in self.all_features if f not in features]
        if missing:
            raise ValueError(f"features {missing} are missing from the batch")
        batch = kjt.stride()
        send_lengths, send_values, counts = [], [], []
        for r in range(self.world):
            mine = self.features_of_rank[r]
            lengths = [features[f].lengths().to(torch.int64) for f in mine]
            values = [features[f].values().to(torch.int64) for f in mine]
            send_lengths.append(torch.cat(lengths) if lengths else torch.empty(0, dtype=torch.int64))
            send_values.append(torch.cat(values) if values else torch.empty(0, dtype=torch.int64))
            counts.append(torch.tensor([batch, send_lengths[-1].numel(), send_values[-1].numel()]))
        group = self.input_group
        got_counts = torch.empty(3 * self.world, dtype=torch.int64)
        dist.all_to_all_single(got_counts, torch.cat(counts), [3] * self.world, [3] * self.world, group=group)
        got_counts = got_counts.view(self.world, 3)
        got_lengths = torch.empty(int(got_counts[:, 1].sum()), dtype=torch.int64)
        dist.all_to_all_single(got_lengths, torch.cat(send_lengths), got_counts[:, 1].tolist(),
                               [t.numel() for t in send_lengths], group=group)
        got_values = torch.empty(int(got_counts[:, 2].sum()), dtype=torch.int64)
        dist.all_to_all_single(got_values, torch.cat(send_values), got_counts[:, 2].tolist(),
                               [t.numel() for t in send_values], group=group)
        mine = self.features_of_rank[self.rank]
        per_feature_lengths: List[List[torch.Tensor]] = [[] for _ in mine]
        per_feature_values: List[List[torch.Tensor]] = [[] for _ in mine]
        for lengths, values, b in zip(torch.split(got_lengths, got_counts[:, 1].tolist()),
                                      torch.split(got_values, got_counts[:, 2].tolist()),
                                      got_counts[:, 0].tolist()):
            blocks = lengths.view(len(mine), b) if mine else lengths.view(0, b)
            sizes = blocks.sum(dim=1).tolist()
            for j, (block, vals) in enumerate(zip(blocks, torch.split(values, sizes))):
                per_feature_lengths[j].append(block)
                per_feature_values[j].append(vals)
        lengths = torch.cat([torch.cat(x) for x in per_feature_lengths]) if mine else torch.empty(0, dtype=torch.int64)
        values = torch.cat([torch.cat(x) for x in per_feature_values]) if mine else torch.empty(0, dtype=torch.int64)
        splits = DistSplits(tuple(got_counts[:, 0].tolist()), batch)
        global_kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(mine), values=values, lengths=lengths,
                                                         stride=sum(splits.batch_sizes))
        return global_kjt, splits

    def output_dist(self, pooled: KeyedTensor, splits: DistSplits) -> KeyedTensor:
        """Each source's rows of ``pooled`` (global batch, this rank's outputs) back to it, as a local KT
        keyed like the unsharded collection's output."""
        mine = self.outputs_of_rank[self.rank]
        width = sum(self.dims[name] for name in mine)
        values = pooled.values() if mine else torch.zeros(sum(splits.batch_sizes), 0)
        expected = self.local_keys_of_rank[self.rank]
        if mine and list(pooled.keys()) != expected:
            raise ValueError(f"pooled keys {pooled.keys()} are not the keys {expected} of this rank's collection "
                             "(build it from local_tables)")
        widths = [sum(self.dims[name] for name in self.outputs_of_rank[r]) for r in range(self.world)]
        flat = values.reshape(-1)
        got = all_to_all(flat, [splits.local_batch_size * w for w in widths],
                         [b * width for b in splits.batch_sizes], self.output_group)
        blocks: Dict[str, torch.Tensor] = {}
        for r, part in enumerate(torch.split(got, [splits.local_batch_size * w for w in widths])):
            part = part.view(splits.local_batch_size, widths[r])
            names = self.outputs_of_rank[r]
            for name, col in zip(names, torch.split(part, [self.dims[name] for name in names], 1)):
                blocks[name] = col
        keys = self.all_outputs
        return KeyedTensor(keys=keys, length_per_key=[self.dims[name] for name in keys],
                           values=torch.cat([blocks[name] for name in keys], dim=1))

    def lookup(self, collection: torch.nn.Module, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Synchronous sharded lookup: input dist, the owner's collection, output dist.

        Each rank's batch is checked against every table first and the ranks agree
        (`agree`): a bad batch on one rank is refused on every rank, before any key moves.
        """
        refuse_weighted_collection(collection)
        try:
            self.check_batch(kjt)
            refusal: Optional[Exception] = None
        except Exception as exc:  # noqa: BLE001 - agreed on, then raised
            refusal = exc
        self.agree(refusal)
        global_kjt, splits = self.input_dist(kjt)
        return self.output_dist(collection(global_kjt), splits)
