"""Validate a KeyedJaggedTensor and deduplicate its keys per table (the local dedup level).

Why a separate step: validation must happen before any cache or table state changes, and
the dedup result (unique keys, restore index, bag offsets) is all that planning, swapping
and pooling need, so a pipeline can run it on a host worker ahead of the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.types import DataType

from ..checks import as_int, check_positive_int
from ..devices import usable_device
from .errors import RecInputError

__all__ = ["TableLayout", "TableBatch", "BatchKeys", "prepare_batch", "table_layouts", "embedding_names_by_table",
           "starting_rows", "TABLE_DTYPE", "batch_size_of"]

TABLE_DTYPE = torch.float32  # TorchRec's default DataType.FP32, the only one supported


@dataclass(frozen=True)
class TableLayout:
    """What the collection needs to know about one table."""

    name: str
    num_rows: int
    dim: int
    feature_names: tuple[str, ...]
    pooling: str  # 'sum' or 'mean'
    weighted: bool = False  # pools with the KJT's per-sample weights (TorchRec's is_weighted)
    embedding_names: tuple[str, ...] = ()
    """The output key of each feature, in order: the feature's name, or ``feature@table``
    when several tables read that feature (TorchRec's naming); empty means the feature names."""

    @property
    def output_names(self) -> tuple[str, ...]:
        """The pooled output's key for each of ``feature_names``."""
        return self.embedding_names or self.feature_names


@dataclass(eq=False)
class TableBatch:
    """One table's share of a batch: bags of all its features, keys deduplicated.

    ``inverse[p]`` is the index into ``unique_keys`` of key position ``p``; bags are
    feature-major (``num_features * batch_size`` bags) with ``offsets`` of length bags + 1.
    A batch size per feature (TorchRec's variable batch, VBE) gives each feature its own
    number of bags; a KJT with ``inverse_indices`` (VBE or not) has ``bag_of_sample``, which
    maps each (feature, sample), feature-major, to its bag, as those indices do.
    """

    layout: TableLayout
    unique_keys: torch.Tensor
    inverse: torch.Tensor
    offsets: torch.Tensor
    batch_size: int
    weights: Optional[torch.Tensor] = None  # per key position, as ``inverse``; None: unweighted
    bag_of_sample: Optional[torch.Tensor] = None  # with inverse_indices: ``num_features * batch_size`` bags


@dataclass(eq=False)
class BatchKeys:
    """The validated, per-table deduplicated keys of one batch."""

    tables: dict[str, TableBatch]
    batch_size: int


def collection_device(device: Any) -> torch.device:
    """Where a collection keeps its device rows: the CPU when not given, resolved as a Pipe's
    devices are. A meta device is refused: it holds no data, so every lookup, update and
    ``state_dict()`` would fail later, far from the cause."""
    resolved = usable_device(device) if device is not None else torch.device("cpu")
    if resolved.type == "meta":
        raise ValueError(f"device {device!r}: a meta device holds no rows for the tables; use 'cpu' or an accelerator")
    return resolved


def table_layouts(tables: list[EmbeddingBagConfig], weighted: bool = False) -> list[TableLayout]:
    """Layouts from TorchRec configs; checks names and pooling types we support.

    ``weighted``: every table pools with per-sample weights, which needs SUM pooling (a MEAN
    table is a ValueError, as torch's ``EmbeddingBag`` refuses ``per_sample_weights`` there).
    """
    if isinstance(tables, (str, bytes, Mapping)) or not isinstance(tables, Sequence):
        raise TypeError(f"tables must be a list of torchrec EmbeddingBagConfig, got {type(tables).__name__}: "
                        f"{tables!r:.80}")
    for index, config in enumerate(tables):
        if not isinstance(config, EmbeddingBagConfig):
            raise TypeError(f"tables[{index}] must be a torchrec EmbeddingBagConfig, got {type(config).__name__}: "
                            f"{config!r:.80}")
        for field in ("num_embeddings", "embedding_dim"):  # TorchRec's own collection refuses 2.5 rows too
            check_positive_int(f"table {config.name!r}: {field}", getattr(config, field))
    layouts: list[TableLayout] = []
    seen_tables: set[str] = set()
    for config in tables:
        if config.name in seen_tables:
            raise ValueError(f"duplicate table name {config.name!r}")
        seen_tables.add(config.name)
    names_by_table = embedding_names_by_table(tables)
    for config, names in zip(tables, names_by_table):
        features = tuple(config.feature_names) or (config.name,)
        if config.data_type != DataType.FP32:
            raise ValueError(f"table {config.name!r}: data_type {config.data_type} not supported; the host "
                             "tables and the device cache hold float32 rows (DataType.FP32)")
        if config.pooling == PoolingType.SUM:
            pooling = "sum"
        elif config.pooling == PoolingType.MEAN:
            pooling = "mean"
        else:
            raise ValueError(f"table {config.name!r}: pooling {config.pooling} not supported (SUM, MEAN)")
        if weighted and pooling != "sum":
            raise ValueError(f"table {config.name!r}: per-sample weights (is_weighted=True) pool with SUM only, "
                             f"as torch's EmbeddingBag does; got {config.pooling}")
        layouts.append(TableLayout(config.name, as_int(config.num_embeddings), as_int(config.embedding_dim),
                                   features, pooling, weighted, tuple(names)))
    return layouts


def embedding_names_by_table(tables: list[EmbeddingBagConfig]) -> list[list[str]]:
    """Each table's output keys, TorchRec's rule: a feature read by one table keeps its name,
    one read by several tables becomes ``feature@table`` in each of them.

    Why TorchRec's rule: a model written for its ``EmbeddingBagCollection`` reads the pooled
    ``KeyedTensor`` by these keys. Two refusals go beyond TorchRec, whose output would then
    hold one key twice: a ValueError for a table that lists a feature more than once, and for
    outputs that would share a key (a feature literally named ``f@t`` beside a shared ``f``
    of table ``t``).
    """
    features_by_table = [tuple(config.feature_names) or (config.name,) for config in tables]
    for config, features in zip(tables, features_by_table):
        repeated = sorted(name for name, count in Counter(features).items() if count > 1)
        if repeated:
            raise ValueError(f"table {config.name!r} lists features {repeated} more than once in its "
                             f"feature_names {list(features)}; each feature pools once per table")
    readers = Counter(feature for features in features_by_table for feature in features)
    names = [[f if readers[f] == 1 else f"{f}@{config.name}" for f in features]
             for config, features in zip(tables, features_by_table)]
    produced_by: dict[str, list[str]] = {}
    for config, features, keys in zip(tables, features_by_table, names):
        for feature, key in zip(features, keys):
            produced_by.setdefault(key, []).append(f"feature {feature!r} of table {config.name!r}")
    clashing = {key: sources for key, sources in produced_by.items() if len(sources) > 1}
    if clashing:
        described = "; ".join(f"{key!r} from {' and '.join(sources)}" for key, sources in clashing.items())
        raise ValueError(f"the tables' pooled outputs would share keys: {described}. Rename a feature "
                         "(a feature read by several tables is keyed 'feature@table')")
    return names


def check_weights(weights: Any, layouts: list[TableLayout]) -> None:
    """Check a collection's ``weights`` argument against its tables, before anything is built.

    ``None``, or a dict ``{table name: tensor [num_rows, embedding_dim]}`` (a table left out,
    or given ``None``, starts from its config's ``init_fn``). Names of tables that are not
    here are ignored: one dict serves the tables of every rank, each rank's collection taking
    its own (`torchpipe.train.dist.TableWiseSharding.local_tables`), also when only some
    tables have pretrained rows.
    """
    if weights is None:
        return
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict {{table name: tensor}} or None, got {type(weights).__name__}")
    shapes = {layout.name: (layout.num_rows, layout.dim) for layout in layouts}
    for name, weight in weights.items():
        if weight is None or name not in shapes:
            continue
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weights[{name!r}] must be a torch.Tensor of shape {shapes[name]} "
                            f"(num_embeddings, embedding_dim), got {type(weight).__name__}")
        if tuple(weight.shape) != shapes[name]:
            raise ValueError(f"weights[{name!r}] has shape {tuple(weight.shape)}, expected {shapes[name]} "
                             f"(table {name!r}: num_embeddings, embedding_dim)")


def initial_weight(config: EmbeddingBagConfig, layout: TableLayout,
                   weights: Optional[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The table's starting rows: the given weight, else the config's ``init_fn`` on empty rows.

    One rule for the cached collection and the full-table reference, so both start equal.
    Rows are float32 (`TABLE_DTYPE`) whatever the default dtype: a given weight of another
    type is cast, as ``load_state_dict`` would, and detached (a TorchRec EBC's parameter
    gives its values, not its graph). A config whose ``init_fn`` was set to None after it
    was built gets the uniform range TorchRec's config gives by default.
    """
    weight = weights.get(layout.name) if weights is not None else None
    if weight is not None:
        return weight.detach().to(TABLE_DTYPE)
    weight = torch.empty(layout.num_rows, layout.dim, dtype=TABLE_DTYPE)
    with torch.no_grad():
        if config.init_fn is not None:
            config.init_fn(weight)
        else:
            torch.nn.init.uniform_(weight, a=config.get_weight_init_min(), b=config.get_weight_init_max())
    return weight


def starting_rows(configs: list[EmbeddingBagConfig], layouts: list[TableLayout],
                  weights: Optional[dict[str, torch.Tensor]],
                  init_state: Callable[[int, int], torch.Tensor],
                  ) -> Iterator[tuple[TableLayout, torch.Tensor, torch.Tensor]]:
    """Each table's starting ``(layout, weight, optimizer state)``, drawn in config order.

    One rule for building a collection and for ``reset_parameters``, in the cached collection
    and the full-table reference alike: the same seed gives the same rows everywhere. Drawn
    one table at a time, as the caller takes them, so that host tables too big to be held
    twice are not. ``init_state(num_rows, dim)`` is the row optimizer's.
    """
    for config, layout in zip(configs, layouts):
        yield layout, initial_weight(config, layout, weights), init_state(layout.num_rows, layout.dim)


def check_kjt(kjt: Any, layouts: list[TableLayout]) -> None:
    """Check a batch's KJT against the tables: names, key dtype, per-sample weights, keys in range.

    Every feature a table reads must be there; features no table reads are ignored (TorchRec's
    rule: one KJT may feed several collections).

    Raises `RecInputError` naming what is wrong; reads the batch only, so a caller can run
    it before anything (cache, tables, pipeline) changes.
    """
    if not isinstance(kjt, KeyedJaggedTensor):
        raise RecInputError(f"expected a torchrec KeyedJaggedTensor, got {type(kjt).__name__}")
    tables_of: dict[str, list[TableLayout]] = {}  # a feature may feed several tables
    for layout in layouts:
        for feature in layout.feature_names:
            tables_of.setdefault(feature, []).append(layout)
    given = list(kjt.keys())
    missing = [f for f in tables_of if f not in given]
    if missing:
        others = [f for f in given if f not in tables_of]
        also = f" (it has {others}, which no table reads)" if others else ""
        raise RecInputError(f"features {missing} are missing from the batch{also}")
    if kjt.values().dtype not in (torch.int32, torch.int64):
        raise RecInputError(f"feature values must be int32 or int64 keys, got {kjt.values().dtype}")
    _check_weights(kjt, any(layout.weighted for layout in layouts))
    _check_jagged_structure(kjt, given)
    # A feature no table reads is left alone, as TorchRec's EBC does: one KJT may feed several
    # collections. Its structure was checked with the rest (it shares the values and lengths).
    for feature, keys in zip(given, torch.split(kjt.values(), kjt.length_per_key())):
        if not keys.numel() or feature not in tables_of:
            continue
        low, high = (int(bound) for bound in torch.aminmax(keys))
        for layout in tables_of[feature]:
            if low < 0 or high >= layout.num_rows:
                bad = keys[(keys < 0) | (keys >= layout.num_rows)]
                raise RecInputError(
                    f"feature {feature!r} (table {layout.name!r}) has keys out of range "
                    f"[0, {layout.num_rows}): e.g. {bad[:5].tolist()}")


def _check_weights(kjt: KeyedJaggedTensor, weighted: bool) -> None:
    """Per-sample weights: refused by an unweighted collection (TorchRec's EBC would drop them
    silently); a weighted one needs them (TorchRec's asserts), one floating-point weight per key."""
    weights = kjt.weights_or_none()
    if weights is None:
        if weighted:
            raise RecInputError("the collection was built with is_weighted=True, but the batch has no per-sample "
                                "weights (a KeyedJaggedTensor built without weights=)")
        return
    if not weighted:
        raise RecInputError("the batch carries per-sample weights (a weighted KeyedJaggedTensor), but the "
                            "collection was built with is_weighted=False; build it with is_weighted=True to pool "
                            "with them (TorchRec's EBC would ignore them)")
    if not weights.is_floating_point() or weights.dim() != 1 or weights.numel() != kjt.values().numel():
        raise RecInputError(f"per-sample weights must be a 1-D floating-point tensor with one weight per key "
                            f"({kjt.values().numel()}), got {weights.dtype} of shape {tuple(weights.shape)}")


def _check_jagged_structure(kjt: KeyedJaggedTensor, given: list[str]) -> None:
    """One bag per (feature, sample), lengths >= 0 that add up to the values: what the lookup
    reads. A torchrec KJT does not check this when it is built, and a bad one would fail only
    in the lookup, after the cache and the tables have changed."""
    repeated = sorted({f for f in given if given.count(f) > 1})
    if repeated:
        raise RecInputError(f"features {repeated} appear more than once in the batch's keys {given}: each "
                            "feature must have one jagged row")
    values = kjt.values()
    if values.dim() != 1:
        raise RecInputError(f"feature values must be a 1-D tensor of keys, got shape {tuple(values.shape)}")
    lengths = kjt.lengths()
    bags_per_feature = _bags_per_feature(kjt, given)
    if kjt.inverse_indices_or_none() is not None:
        _check_bags_of_samples(kjt, given, bags_per_feature)
    elif len(set(bags_per_feature)) > 1:
        raise RecInputError(f"a KeyedJaggedTensor whose features have different numbers of bags "
                            f"({dict(zip(given, bags_per_feature))}, a batch size per feature: "
                            "stride_per_key_per_rank) needs inverse_indices=(keys, tensor) mapping each sample to "
                            "its bag of each feature, as TorchRec's EmbeddingBagCollection does")
    bags = sum(bags_per_feature)
    if lengths.dim() != 1 or lengths.numel() != bags:
        raise RecInputError(f"the batch's lengths have shape {tuple(lengths.shape)}, expected ({bags},): one per "
                            f"bag, and the features have {dict(zip(given, bags_per_feature))} bags")
    if bags and int(lengths.min()) < 0:
        raise RecInputError(f"the batch's lengths must be >= 0, got {lengths[lengths < 0][:5].tolist()}")
    total = int(lengths.sum()) if bags else 0
    if total != values.numel():
        raise RecInputError(f"the batch's lengths add up to {total} keys, but its values hold {values.numel()}")
    _check_cached_key_counts(kjt, given, lengths, bags_per_feature)


def _check_cached_key_counts(kjt: KeyedJaggedTensor, given: list[str], lengths: torch.Tensor,
                             bags_per_feature: list[int]) -> None:
    """A KJT built with ``length_per_key=`` or ``offset_per_key=`` keeps them as given, and
    ``to_dict()`` and ``kjt[feature]`` split the values by them, not by the lengths: counts that
    disagree with the lengths move keys into another feature's bags (silently, where both
    features feed one table). TorchRec's EBC refuses such a batch in its lookup."""
    cached_lengths, cached_offsets = kjt.length_per_key_or_none(), kjt.offset_per_key_or_none()
    if (cached_lengths is None and cached_offsets is None) or not given:
        return
    if len(set(bags_per_feature)) == 1:  # one batch size: one sum over a [features, bags] view
        counts = lengths.view(len(given), bags_per_feature[0]).sum(1).tolist()
    else:
        counts = [int(part.sum()) for part in torch.split(lengths, bags_per_feature)]
    if cached_lengths is not None and list(cached_lengths) != counts:
        raise RecInputError(f"the batch's length_per_key {list(cached_lengths)} disagrees with its lengths, which "
                            f"give {dict(zip(given, counts))} keys per feature; build the KeyedJaggedTensor without "
                            "length_per_key= (it is computed from the lengths) or with the right counts")
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    if cached_offsets is not None and list(cached_offsets) != offsets:
        raise RecInputError(f"the batch's offset_per_key {list(cached_offsets)} disagrees with its lengths, which "
                            f"give offsets {offsets} ({dict(zip(given, counts))} keys per feature); build the "
                            "KeyedJaggedTensor without offset_per_key= or with the right offsets")


def _bags_per_feature(kjt: KeyedJaggedTensor, given: list[str]) -> list[int]:
    """How many bags each feature has: the batch size, or with a batch size per feature (VBE)
    its entries of ``stride_per_key_per_rank``, checked to be one list per feature, each with
    one count per rank (torchrec does not check them, and a short list drops features)."""
    if not kjt.variable_stride_per_key():
        return [kjt.stride()] * len(given)
    per_rank = kjt.stride_per_key_per_rank()
    ranks = {len(counts) for counts in per_rank}
    if len(per_rank) != len(given) or len(ranks) != 1:
        raise RecInputError(f"stride_per_key_per_rank must hold one list per feature ({len(given)}), each with one "
                            f"bag count per rank, got {per_rank}")
    if any(count < 0 for counts in per_rank for count in counts):
        raise RecInputError(f"stride_per_key_per_rank must hold counts >= 0, got {per_rank}")
    return [sum(counts) for counts in per_rank]


def batch_size_of(kjt: KeyedJaggedTensor) -> int:
    """Samples in a checked batch: ``inverse_indices``' width when it has them, else the bags
    of any feature (every feature has one per sample)."""
    inverse = kjt.inverse_indices_or_none()
    if inverse is not None:
        return int(inverse[1].shape[1])
    return kjt.stride_per_key()[0] if kjt.variable_stride_per_key() and kjt.keys() else kjt.stride()


def _check_bags_of_samples(kjt: KeyedJaggedTensor, given: list[str], bags_per_feature: list[int]) -> None:
    """``inverse_indices`` (TorchRec's: applied whenever a KJT carries them, batch size per
    feature or not) must map every sample of every feature to one of that feature's bags:
    TorchRec's EBC expands its pooled bags to the batch with them."""
    names, index = kjt.inverse_indices()
    if not isinstance(index, torch.Tensor) or index.dim() != 2 or index.dtype not in (torch.int32, torch.int64) \
            or index.shape[0] != len(names):
        got = (f"{index.dtype} of shape {tuple(index.shape)}" if isinstance(index, torch.Tensor)
               else type(index).__name__)
        raise RecInputError(f"inverse_indices must be (keys, a 2-D int32/int64 tensor of shape (len(keys), batch "
                            f"size)), got {len(names)} keys and {got}")
    missing = [f for f in given if f not in names]
    if missing:
        raise RecInputError(f"inverse_indices has no row for features {missing} (its keys: {list(names)})")
    row_of = {name: i for i, name in enumerate(names)}
    for feature, bags in zip(given, bags_per_feature):
        row = index[row_of[feature]]
        if row.numel() and (int(row.min()) < 0 or int(row.max()) >= bags):
            bad = row[(row < 0) | (row >= bags)]
            raise RecInputError(f"inverse_indices of feature {feature!r} must index its {bags} bags, got "
                                f"{bad[:5].tolist()}")


def _bags_of_samples(kjt: KeyedJaggedTensor, feature_names: tuple[str, ...], bags_of: dict[str, int]) -> torch.Tensor:
    """For a batch with ``inverse_indices``: each (feature, sample) of one table's features,
    feature-major, as an index into the table's bags (the features' bags laid end to end;
    ``bags_of``: each feature's number of bags)."""
    names, index = kjt.inverse_indices()
    row_of = {name: i for i, name in enumerate(names)}
    parts, start = [], 0
    for feature in feature_names:
        parts.append(index[row_of[feature]].to("cpu", torch.int64) + start)
        start += bags_of[feature]
    return torch.cat(parts)


def prepare_batch(kjt: KeyedJaggedTensor, layouts: list[TableLayout]) -> BatchKeys:
    """Check ``kjt`` against ``layouts`` and dedup keys per table; raises `RecInputError`."""
    check_kjt(kjt, layouts)
    features = kjt.to_dict()
    given = list(kjt.keys())
    bags_of = dict(zip(given, _bags_per_feature(kjt, given))) if kjt.inverse_indices_or_none() is not None else None
    batch_size = batch_size_of(kjt)
    tables: dict[str, TableBatch] = {}
    for layout in layouts:
        values: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []
        for feature in layout.feature_names:
            jagged = features[feature]
            # Keys are planned on the host: a device KJT is read back here, once.
            values.append(jagged.values().to("cpu", torch.int64))
            lengths.append(jagged.lengths().to("cpu", torch.int64))
            if layout.weighted:
                weights.append(jagged.weights())  # where they are, with their graph: pooled on the device
        all_keys = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        all_lengths = torch.cat(lengths)
        offsets = torch.zeros(all_lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(all_lengths, 0, out=offsets[1:])
        unique_keys, inverse = torch.unique(all_keys, sorted=True, return_inverse=True)
        tables[layout.name] = TableBatch(layout, unique_keys, inverse, offsets, batch_size,
                                         torch.cat(weights) if weights else None,
                                         None if bags_of is None else
                                         _bags_of_samples(kjt, layout.feature_names, bags_of))
    return BatchKeys(tables, batch_size)
