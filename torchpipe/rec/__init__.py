"""Host-embedding cache: full tables with optimizer state in host memory, a row cache on the device.

Training through the cache equals training with the whole table on the device, bitwise,
step for step. The per-batch steps (prepare, plan, gather_out, write_back, fetch_in,
scatter_in, forward, release) are separate and thread-safe so that a train pipeline
(`torchpipe.train`) can overlap them across consecutive batches.
"""

from .batch_keys import BatchKeys, TableBatch, TableLayout, prepare_batch
from .cache import CacheStats, EmbeddingCache
from .collection import BatchPlan, CachedEmbeddingBagCollection
from .errors import CacheAbortedError, CacheTooSmallError, RecInputError, StaleBatchError
from .host_table import HostEmbeddingTable, WriteTicket
from .optim import SGD, Adam, RowOptimizer, RowWiseAdagrad
from .reference import FullTableEmbeddingBagCollection
from .swap_plan import SwapPlan

__all__ = [
    "Adam", "BatchKeys", "BatchPlan", "CacheAbortedError", "CacheStats", "CacheTooSmallError",
    "CachedEmbeddingBagCollection", "EmbeddingCache", "FullTableEmbeddingBagCollection",
    "HostEmbeddingTable", "RecInputError", "RowOptimizer", "RowWiseAdagrad", "SGD",
    "StaleBatchError", "SwapPlan", "TableBatch", "TableLayout", "WriteTicket", "prepare_batch",
]
