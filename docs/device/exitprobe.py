"""Which threads are alive when the gpipe suite's interpreter exits (it aborts there on the H100 host)."""
import atexit, runpy, sys, threading, traceback

def alive():
    frames = sys._current_frames()
    for t in threading.enumerate():
        stack = "".join(traceback.format_stack(frames.get(t.ident))[-3:]) if t.ident in frames else ""
        print(f"EXIT alive: {t.name} daemon={t.daemon}\n{stack}", flush=True)

atexit.register(alive)
sys.argv = ["torchpipe.bench", *sys.argv[1:]]
try:
    runpy.run_module("torchpipe.bench", run_name="__main__")
except SystemExit as exc:
    print("EXIT code", exc.code, flush=True)
