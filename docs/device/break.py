"""Break one stream guarantee on purpose and run the tests that must catch it (device check)."""
import sys

import pytest

import torchpipe.pipe as P

what = sys.argv[1]
noop = lambda *a, **k: None  # noqa: E731
if what == "pipe-fence-in":
    P.streams_wait_for_caller = noop
    tests = ["tests/test_cuda.py", "-k", "training_loop"]
elif what == "pipe-fence-out":
    P.caller_waits_for_streams = noop
    tests = ["tests/test_cuda.py", "-k", "training_loop"]
elif what == "rec-events":
    import torchpipe.train.pipelines as T
    T.mark_ready = noop
    tests = ["tests/train/test_emb_cache_cuda.py"]
elif what == "rec-fences":
    import torchpipe.train.pipelines as T
    T.caller_waits_for_streams = noop
    T.streams_wait_for_caller = noop
    tests = ["tests/train/test_emb_cache_cuda.py"]
else:
    raise SystemExit(f"unknown {what}")
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *tests, *sys.argv[2:]]))
