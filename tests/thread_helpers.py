"""Thread checks shared by the reliability and worker tests."""
import time


def wait_until_gone(threads, timeout=5.0):
    """Poll until every thread in ``threads`` has exited; return the ones still alive."""
    deadline = time.monotonic() + timeout
    alive = [t for t in threads if t.is_alive()]
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = [t for t in alive if t.is_alive()]
    return alive
