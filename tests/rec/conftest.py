"""Run the embedding-cache tests single-threaded inside torch.

The tensors here are tiny: on a busy 2-core box, torch's intra-op thread pool costs
milliseconds per op in barrier waits, and the suite would be 5x slower.
"""
from thread_helpers import single_torch_thread  # noqa: F401  (autouse for this folder)
