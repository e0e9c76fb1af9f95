"""Declarative train-step pipelines on the torchpipe runtime (TorchRec family).

`StagedPipeline` runs a list of `PipelineStage` clock by clock: in clock ``t`` stage ``s``
handles batch ``t - s``, all on worker threads of one `Runtime` (a device compute worker,
a device copy worker, device-less host threads). Ready pipelines: `TrainPipelineBase`
(H2D; fwd/bwd/opt), `TrainPipelineSparseDist` (H2D; input dist; fwd/bwd/opt) and
`EmbCacheTrainPipeline` (H2D; input dist; plan; swap; fwd/bwd/opt) over a
`torchpipe.rec.CachedEmbeddingBagCollection`.
"""

from .schedule import Clock, ClockSchedule, schedule_table
from .dist import DistSplits, TableWiseSharding
from .staged import PipelineFailure, PipelineStage, StagedPipeline, UnevenDataError
from .pipelines import (EmbCacheTrainPipeline, RecBatch, TrainPipelineBase, TrainPipelineSparseDist, check_features,
                        train_step)

__all__ = ["Clock", "ClockSchedule", "DistSplits", "EmbCacheTrainPipeline", "PipelineFailure", "PipelineStage", "RecBatch",
           "StagedPipeline", "TableWiseSharding", "TrainPipelineBase", "TrainPipelineSparseDist", "UnevenDataError", "check_features",
           "schedule_table", "train_step"]
