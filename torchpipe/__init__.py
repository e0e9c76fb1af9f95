"""torchpipe."""
