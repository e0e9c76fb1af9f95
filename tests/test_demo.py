"""The demo's command line (the demo itself runs in `make demo`)."""
import subprocess
import sys


def test_too_few_steps_is_a_usage_error_not_a_crash():
    """With --steps 1 the GPipe half ran no step and the demo crashed on a missing step record."""
    done = subprocess.run([sys.executable, "-m", "torchpipe.demo", "--steps", "1", "--out", "unused"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--steps must be at least 2" in done.stderr
