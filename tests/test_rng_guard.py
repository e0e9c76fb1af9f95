"""The generator guards of checkpoint replay: lock order, and no lock or state left behind."""
import contextlib
import threading
import time

import pytest
import torch

from torchpipe.checkpoint import RNGGuard, StageRNG, _lock_for


def accelerator_like_stage(device_generator):
    """A StageRNG with a host guard and a second, device-like generator with its own lock."""
    stage = StageRNG(torch.device("cpu"), shared=True, host_shared=True)
    device = RNGGuard(torch.device("cpu"), shared=True)
    device.generator, device.lock = device_generator, _lock_for(device_generator)
    stage.guards = [stage.guards[0], device]
    return stage


# Regression: saving the host state for a replay took the host lock while the forward held
# only the device lock (host seen RNG-free): the reverse of another stage's host-then-device
# order, so two partitions on one accelerator could deadlock.
def test_reading_the_state_takes_no_generator_lock_out_of_order():
    device_generator = torch.Generator()
    first, second = accelerator_like_stage(device_generator), accelerator_like_stage(device_generator)
    first.guards[0]._uses_rng[True] = False  # host RNG-free: its section holds the device lock only
    first.guards[1]._uses_rng[True] = True
    second.guards[0]._uses_rng[True] = second.guards[1]._uses_rng[True] = True
    first_holds_device, second_started = threading.Event(), threading.Event()

    def run_first():
        with first.forward_section(True):
            first_holds_device.set()
            second_started.wait(2)
            time.sleep(0.1)  # the second stage now holds the host lock and waits for the device's
            with first.new_replay(True).forward_context():
                pass

    def run_second():
        first_holds_device.wait(2)
        second_started.set()
        with second.forward_section(True):
            pass

    threads = [threading.Thread(target=run_first, daemon=True), threading.Thread(target=run_second, daemon=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert not any(thread.is_alive() for thread in threads), "the two stages deadlocked on the generator locks"


# Regression: a recompute context that failed to enter left the generator lock held and the
# generator at the replayed state (torch's checkpoint does not call __exit__ after a failed enter).
def test_a_recompute_that_fails_to_enter_leaves_no_lock_or_state_behind():
    stage = StageRNG(torch.device("cpu"), shared=True, host_shared=True)
    replay = stage.new_replay(True)
    with replay.forward_context():
        torch.rand(3)  # a draw, so that the replay keeps its state

    @contextlib.contextmanager
    def failing():
        raise RuntimeError("extra context failed")
        yield

    replay.recompute_extras.append(failing)
    torch.rand(3)
    moved = torch.default_generator.get_state()
    with pytest.raises(RuntimeError, match="extra context failed"):
        with replay.recompute_context():
            pass
    assert torch.equal(torch.default_generator.get_state(), moved)
    taken = []
    other = threading.Thread(target=lambda: taken.append(stage.guards[0].lock.acquire(timeout=1)))
    other.start()
    other.join()
    assert taken == [True], "the generator lock was left held"
    stage.guards[0].lock.release()
