"""Train-pipeline tests run torch single-threaded: tiny tensors, and a reference loop
whose float results must match the workers' bitwise (same ops, same thread count)."""
from thread_helpers import single_torch_thread  # noqa: F401  (autouse for this folder)
