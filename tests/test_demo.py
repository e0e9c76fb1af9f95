"""The demo's command line (the demo itself runs in `make demo`)."""
import subprocess
import sys


def test_too_few_steps_is_a_usage_error_not_a_crash():
    """With --steps 1 the GPipe half ran no step and the demo crashed on a missing step record."""
    done = subprocess.run([sys.executable, "-m", "torchpipe.demo", "--steps", "1", "--out", "unused"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--steps must be at least 2" in done.stderr


def test_an_out_path_that_cannot_be_a_folder_is_a_usage_error_before_any_training(tmp_path):
    # Review: the MLP demo trained first, then makedirs ended in a traceback.
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out, words in [(blocker, "is a file; give a folder"), (blocker / "sub", "is a file, so no folder can be made")]:
        done = subprocess.run([sys.executable, "-m", "torchpipe.demo", "--out", str(out)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert f"--out {out}: " in done.stderr and words in done.stderr
        assert "Traceback" not in done.stderr and not done.stdout  # nothing trained
