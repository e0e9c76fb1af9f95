"""torchpipe: pipeline-parallel PyTorch training as tasks on worker threads, in one process.

``Pipe`` runs an ``nn.Sequential`` as a GPipe pipeline (torchgpipe's API, more schedules);
``GradientSync`` averages its gradients across processes;
``torchpipe.schedule`` holds the plans as data; ``torchpipe.balance`` computes partitions;
``torchpipe.rec`` and ``torchpipe.train`` serve host-embedding-cache training.
"""
from .checkpoint import RNGReplayError, is_checkpointing, is_recomputing
from .devices import BackendUnavailableError
from .grad_sync import GradientSync
from .microbatch import Batch
from .partition import BalanceError
from .pipe import CHECKPOINT_MODES, MovingDenied, Pipe
from .workers import HostPool, Task, ThreadBudget

__all__ = [
    "Pipe",
    "GradientSync",
    "MovingDenied",
    "BalanceError",
    "CHECKPOINT_MODES",
    "is_checkpointing",
    "is_recomputing",
    "RNGReplayError",
    "BackendUnavailableError",
    "Batch",
    "HostPool",
    "Task",
    "ThreadBudget",
]
__version__ = "0.1.0"
