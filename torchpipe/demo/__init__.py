"""Runnable demos: ``python -m torchpipe.demo``."""
