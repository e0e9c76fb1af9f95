"""The benchmark command runs and writes well-formed results (never timing asserts)."""
import json
import math
import os
import threading

import pytest
import torch

from torchpipe.bench import SUITES, Goal, SuiteResult, TimingConfig, compare
from torchpipe.bench.__main__ import main, parse_args



def _pipeline_threads():
    return {t for t in threading.enumerate() if t.name.startswith(("torchpipe", "thread-chain-"))}


def _strict_load(path):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    with open(path) as f:
        return json.load(f, parse_constant=reject)


def _check_document(doc, suite):
    assert doc["schema"] == "torchpipe.bench/1"
    assert doc["meta"]["quick"] is True
    assert doc["meta"]["suites"] == [suite]
    assert doc["meta"]["environment"]["torch"]
    result = doc["suites"][suite]
    assert set(result) >= {"description", "config", "tables", "ratios", "goals", "notes"}
    assert result["ratios"], "a suite must quote at least one ratio"
    for name, value in result["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
    for table in result["tables"]:
        keys = {c["key"] for c in table["columns"]}
        assert table["title"] and table["rows"]
        for row in table["rows"]:
            assert set(row) <= keys, (table["title"], row)
    for goal in result["goals"]:
        assert goal["op"] in ("<=", ">=") and goal["met"] in (True, False, None)
    return result


@pytest.mark.parametrize("suite", ["overhead", "gpipe"])
def test_quick_suite_json(suite, tmp_path, capsys):
    path = tmp_path / f"{suite}.json"
    before = _pipeline_threads()
    returned = main([suite, "--quick", "--json", str(path)])
    doc = _strict_load(path)
    assert doc == json.loads(json.dumps(returned))
    result = _check_document(doc, suite)
    printed = capsys.readouterr().out
    assert f"== {suite}:" in printed and "Goals (reported, never asserted)" in printed
    assert _pipeline_threads() <= before, "the benchmark must close every Pipe it builds"

    if suite == "overhead":
        for chunks in (1, 8, 32):
            for name in ("loop", "torchpipe", "threads"):
                assert f"chunks={chunks}/{name} step / plain step" in result["ratios"]
        assert {g["name"] for g in result["goals"]} >= {
            "chunks=32: torchpipe overhead per (stage, mb), us",
            "chunks=32: torchgpipe overhead / torchpipe overhead",
        }
    else:
        for m in (8, 32):
            assert f"m={m}/torchpipe forward ideal / wall" in result["ratios"]
            assert f"m={m}/torchpipe forward ideal / last_step.makespan" in result["ratios"]
            assert f"m={m}/torchpipe forward+backward ideal / wall" in result["ratios"]
            assert f"m={m}/forward wall bare threads / torchpipe" in result["ratios"]
        forward = result["tables"][0]
        torchpipe_rows = [r for r in forward["rows"] if r["case"] == "torchpipe Pipe"]
        assert len(torchpipe_rows) == 2
        for row in torchpipe_rows:
            assert 0 <= row["bubble"] < 1 and 0 < row["bubble_sim"] < 1


def test_cli_knows_every_suite_and_all():
    assert {"overhead", "gpipe", "cuda"} <= set(SUITES)
    assert parse_args(["all", "--quick"]).suite == "all"
    assert parse_args(["gpipe", "--repeats", "2"]).repeats == 2
    with pytest.raises(SystemExit):
        parse_args(["nope"])
    with pytest.raises(SystemExit):
        parse_args(["overhead", "--repeats", "0"])
    assert parse_args(["gpipe", "--stage-ms", "10"]).stage_ms == 10.0
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            parse_args(["gpipe", "--stage-ms", bad])
    assert parse_args(["all", "--stage-ms", "3"]).stage_ms == 3.0
    with pytest.raises(SystemExit):  # a suite without simulated stages would ignore it silently
        parse_args(["overhead", "--stage-ms", "3"])


def test_an_unwritable_json_path_is_refused_before_any_suite_runs(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for bad, words in [(tmp_path, "is a folder"), (blocker / "out.json", "is a file, so no folder can be made")]:
        with pytest.raises(SystemExit):
            parse_args(["overhead", "--json", str(bad)])
        assert words in capsys.readouterr().err
    assert parse_args(["overhead", "--json", str(tmp_path / "new" / "out.json")]).json  # folders are made later


def test_a_json_path_in_a_folder_that_takes_no_files_is_refused_up_front(tmp_path, capsys, monkeypatch):
    # Review: /proc passed the permission check (root may "write" there) and failed after the suites ran.
    import tempfile

    def no_files(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_files)
    with pytest.raises(SystemExit):
        parse_args(["overhead", "--json", str(tmp_path / "new" / "out.json")])
    assert f"cannot write in {tmp_path} (Read-only file system)" in capsys.readouterr().err


def test_an_existing_json_file_is_judged_by_opening_it_not_by_its_folder(tmp_path, capsys, monkeypatch):
    # Review (s31): a writable results.json in a folder that takes no new file (chattr +i) was
    # refused, though the writer opens it in place; one that cannot be opened still is.
    import tempfile

    def no_files(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_files)
    existing = tmp_path / "results.json"
    existing.write_text("kept")
    assert parse_args(["overhead", "--json", str(existing)]).json == str(existing)
    assert existing.read_text() == "kept"  # looked at, not changed
    import builtins

    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (_ for _ in ()).throw(OSError(30, "Read-only file system"))
                        if str(path) == str(existing) else real_open(path, *a, **k))
    with pytest.raises(SystemExit):
        parse_args(["overhead", "--json", str(existing)])
    assert "is a file that cannot be written (Read-only file system)" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
@pytest.mark.timeout(20)
def test_an_existing_fifo_as_json_path_is_not_opened_by_the_check(tmp_path):
    # Review (s31): opening a FIFO to test it blocks until a reader comes (argument parsing hung).
    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)
    assert parse_args(["overhead", "--json", str(fifo)]).json == str(fifo)


def test_stage_ms_sets_the_simulated_latency():
    from torchpipe.bench.registry import Options

    assert Options(quick=True).stage_seconds(default_s=0.002, quick_s=0.0002) == 0.0002
    assert Options().stage_seconds(default_s=0.002, quick_s=0.0002) == 0.002
    assert Options(quick=True, stage_ms=5.0).stage_seconds(default_s=0.002, quick_s=0.0002) == 0.005


def test_compare_interleaves_and_takes_the_median():
    calls = []
    cases = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    measured = compare(cases, TimingConfig(repeats=3, warmup=1, iters=2))
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3
    for m in measured.values():
        assert m.iters == 2 and len(m.samples) == 3 and m.min <= m.median <= m.max


def test_undefined_ratios_are_noted_not_recorded():
    result = SuiteResult("x", "test")
    assert result.ratio("ok", 2.0, 4.0) == 0.5
    assert result.ratio("zero", 1.0, 0.0) is None
    assert result.ratio("negative", -1.0, 2.0) is None
    assert result.ratio("missing", None, 2.0) is None
    assert result.ratios == {"ok": 0.5}
    assert len(result.notes) == 3
    assert Goal("g", 20.0, "<=", 25.0).status == "PASS"
    assert Goal("g", 3.0, ">=", 3.5).status == "MISS"
    assert Goal("g", None, ">=", 3.5).status == "n/a"


def test_the_median_interval_has_the_binomial_coverage_of_its_order_statistics():
    from torchpipe.bench.stats import median_interval, paired_median_interval

    values = [float(v) for v in (9, 1, 5, 3, 11, 7, 2, 10, 4, 8, 6)]  # 1..11, shuffled
    interval = median_interval(values)
    # 11 repeats: the 2nd smallest and 2nd largest hold the median with 1 - 2 * 12/2048.
    assert (interval.median, interval.low, interval.high) == (6.0, 2.0, 10.0)
    assert interval.coverage == 1 - 2 * 12 / 2048
    # The 3rd ones would cover 1 - 2 * 67/2048 = 0.935 < 0.95: not narrowed that far, but at 0.9 they are.
    assert (median_interval(values, 0.9).low, median_interval(values, 0.9).high) == (3.0, 9.0)
    few = median_interval([3.0, 1.0, 2.0])  # too few for 95%: [min, max], and says how little it covers
    assert (few.low, few.high, few.coverage) == (1.0, 3.0, 0.75)
    assert median_interval([1.0, float("nan")]) is None and median_interval([]) is None
    with pytest.raises(ValueError, match="confidence"):
        median_interval(values, 1.0)
    # Paired: repeat i of each series is combined before the median.
    paired = paired_median_interval(lambda a, b: a / b, [2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert (paired.median, paired.low, paired.high) == (2.0, 2.0, 2.0)
    assert paired_median_interval(lambda a, b: a / b, [1.0], [0.0]) is None
    assert paired_median_interval(lambda a, b: a / b, [1.0, 2.0], [1.0]) is None


def test_a_goal_with_an_interval_passes_or_misses_only_when_all_of_it_does():
    from torchpipe.bench.stats import MedianInterval

    def goal(low, high, op=">="):
        return Goal("g", (low + high) / 2, op, 3.5, MedianInterval((low + high) / 2, low, high, 0.95))

    assert goal(3.6, 4.0).status == "PASS" and goal(3.0, 3.4).status == "MISS"
    assert goal(3.0, 4.0).status == "UNSURE" and goal(3.0, 4.0).met is True  # the point alone would pass
    assert goal(3.0, 3.4, "<=").status == "PASS" and goal(3.0, 4.0, "<=").status == "UNSURE"
    described = goal(3.0, 4.0).describe()
    assert described.startswith("[UNSURE] g: 3.5") and "95.0% interval 3..4" in described
    assert goal(3.0, 4.0).to_json()["interval"] == {"median": 3.5, "low": 3.0, "high": 4.0, "coverage": 0.95}


def test_rec_suite_runs_on_a_tiny_config():
    from torchpipe.bench.rec import RecConfig, run_config
    from torchpipe.bench.registry import Options

    cfg = RecConfig(tables=2, rows=3000, dim=8, batch=64, pooling=4, pool_batches=6, host_threads=2,
                    sim_compute_ms=1.0, torchrec=False)
    result = run_config(cfg, Options(repeats=2, quick=True, progress=None)).to_json()
    assert result["ratios"], "the rec suite must quote ratios against its baselines"
    for name, value in result["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
    assert any(table["rows"] for table in result["tables"])


def test_schedules_suite_quick(tmp_path):
    from torchpipe.bench.registry import Options
    from torchpipe.bench.schedules import run

    result = run(Options(repeats=1, quick=True, stage_ms=0.3, progress=None)).to_json()
    assert result["config"]["t_ms"] == pytest.approx(0.3)
    rows = result["tables"][0]["rows"]
    assert {row["schedule"] for row in rows} == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"}
    for name, value in result["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
    one_f_one_b = [row for row in rows if row["schedule"] == "1f1b"]
    assert all(row["peak_mb"] == "[4, 3, 2, 1]" for row in one_f_one_b)
    # 1F1B's stage 0 holds p of GPipe's m micro-batches: the worst worker's ratio is p/m exactly.
    assert {row["m"]: row["peak_vs_gpipe"] for row in one_f_one_b} == {8: pytest.approx(4 / 8), 32: pytest.approx(4 / 32)}
    for row in rows:  # achieved is the call's wall time, which contains the runtime's own span
        assert row["achieved_ms"] >= row["span_ms"] > 0
        # Each action costs the stage alone at least its sleeps: the plan takes at least as long.
        assert row["sim_ms"] >= row["sleep_sim_ms"] > 0
    for costs in result["config"]["stage_alone_ms"].values():
        assert costs["F"] >= 0.3 and costs["I"] >= 0.3 and costs["W"] >= 0.3 and costs["B"] >= 0.6, costs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_cuda_suite_skips_without_cuda(tmp_path, capsys):
    from torchpipe.bench.cuda import SKIP_NOTE

    path = tmp_path / "cuda.json"
    main(["cuda", "--json", str(path)])
    result = _strict_load(path)["suites"]["cuda"]
    assert SKIP_NOTE in result["notes"]
    assert result["tables"] == [] and result["goals"] == [] and result["ratios"] == {}
    printed = capsys.readouterr().out
    assert "== cuda:" in printed and SKIP_NOTE in printed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_suite_quick(tmp_path, capsys):
    from torchpipe.bench import cuda

    path = tmp_path / "cuda.json"
    before = _pipeline_threads()
    returned = main(["cuda", "--quick", "--json", str(path)])
    doc = _strict_load(path)
    assert doc == json.loads(json.dumps(returned))
    result = _check_document(doc, "cuda")
    assert cuda.SKIP_NOTE not in result["notes"]
    assert result["config"]["gpu"] and result["config"]["cuda"]
    assert "== cuda:" in capsys.readouterr().out
    assert _pipeline_threads() <= before, "the benchmark must close every Pipe it builds"
    ratios = result["ratios"]
    for chunks in cuda.CHUNKS:
        assert f"overhead/chunks={chunks}/torchpipe step / loop step" in ratios
    for chunks in cuda.REAL_CHUNKS:
        assert f"real/chunks={chunks}/loop step / plain step" in ratios
        for checkpoint in cuda.CHECKPOINTS:
            for name in ("torchpipe", *[f"step {s}" for s in cuda.STEP_SCHEDULES]):
                assert f"real/chunks={chunks}/checkpoint={checkpoint}/{name} step / loop step" in ratios
    for batch in cuda.MEMORY_BATCHES:
        for name in ("1f1b", "zb-h1"):
            assert f"memory/batch={batch}/{name} peak increase / gpipe's" in ratios
    memory = result["tables"][-1]["rows"]
    one_f_one_b = [row for row in memory if row["case"] == "Pipe.step(schedule='1f1b')"]
    assert len(one_f_one_b) == len(cuda.MEMORY_BATCHES)
    assert all(row["peak_mb"] == "[4, 3, 2, 1]" for row in one_f_one_b)


def test_thread_chain_baseline_matches_the_model_and_reports_stage_errors():
    """The bench's floor must compute what the model computes, backward included, and fail cleanly."""
    from torch import nn

    from torchpipe.bench.thread_chain import ThreadChain

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(10, 4)
    chain = ThreadChain([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)], chunks=3)
    try:
        chain.load_state_dict({f"layers.{k}": v for k, v in model.state_dict().items()})
        out = chain(x)
        expected = model(x)
        assert torch.allclose(out, expected)
        out.sum().backward()
        expected.sum().backward()
        for mine, theirs in zip(chain.parameters(), model.parameters()):
            assert torch.allclose(mine.grad, theirs.grad)
        with pytest.raises(RuntimeError):  # a stage error reaches the caller; the chain stays usable
            chain(torch.randn(5, 3))
        assert torch.allclose(chain(x), expected)
    finally:
        chain.close()
    assert not any(t.name.startswith("thread-chain-") and t.is_alive() for t in threading.enumerate())


def test_release_waits_for_the_peers_stopped_workers_to_end():
    """A peer's daemon worker that is still ending when a suite returns can abort the
    interpreter at exit (seen on a 16-core host); release() waits for it, up to a limit."""
    import time

    from torchpipe.bench.peers import join_stopped_peer_workers, release

    stop = threading.Event()

    def worker():  # the target name torchgpipe's and fairscale's worker threads have
        stop.wait()
        time.sleep(0.2)  # still ending after its stop message

    ending = threading.Thread(target=worker, daemon=True)
    ending.start()
    assert ending.name.endswith("(worker)")
    stop.set()
    release({})
    assert not ending.is_alive()

    forever = threading.Event()
    stuck = threading.Thread(target=lambda: forever.wait(), name="stuck (worker)", daemon=True)
    stuck.start()
    began = time.monotonic()
    join_stopped_peer_workers(timeout=0.2)  # a live peer's worker: the wait is bounded
    assert stuck.is_alive() and time.monotonic() - began < 5
    forever.set()
    stuck.join(5)


def test_overhead_formula_on_known_step_times():
    """Review: the suite tests checked only the JSON's shape, so a wrong formula passed. The
    overhead is (pipeline step - chunked-loop step) / (stages x chunks), from the medians."""
    from torchpipe.bench.overhead import STAGES, overhead_tables, report_chunks
    from torchpipe.bench.peers import THREADS
    from torchpipe.bench.timing import Measurement

    chunks = 8
    step_ms = {"plain": 1.0, "loop": 2.0, "torchpipe": 2.8, "torchgpipe": 6.0, "fairscale": 7.0, THREADS: 2.4}
    measured = {name: Measurement(name, 10, [ms / 1e3 * k for k in (0.9, 1.0, 1.3)]) for name, ms in step_ms.items()}
    result = SuiteResult("overhead", "synthetic")
    steps, summary = overhead_tables("steps", "summary")
    labels = {name: name for name in step_ms}
    report_chunks(result, steps, summary, chunks, measured, {}, labels)
    row = summary.rows[0]
    per = STAGES * chunks
    assert STAGES == 4
    assert row["torchpipe"] == pytest.approx((2.8 - 2.0) / 1e3 / per * 1e6)      # 25 us
    assert row["torchgpipe"] == pytest.approx((6.0 - 2.0) / 1e3 / per * 1e6)     # 125 us
    assert row[THREADS] == pytest.approx((2.4 - 2.0) / 1e3 / per * 1e6)
    assert row["tp_over_floor"] == pytest.approx(row["torchpipe"] - row[THREADS])
    assert row["tg_over_tp"] == pytest.approx(5.0) and row["fs_over_tp"] == pytest.approx(6.25)
    goals = {goal.name: goal for goal in result.goals}
    assert goals["chunks=8: torchpipe overhead per (stage, mb), us"].met is True  # 25 <= 25
    assert goals["chunks=8: torchgpipe overhead / torchpipe overhead"].met is True  # 5 >= 3.5


def test_schedules_suite_costs_and_peaks_follow_the_plans():
    """The simulated makespans use F = t, B = 2t (stage 0 of a split schedule: I = 0, W = 2t, as it
    runs), and the 1F1B peak ratio is exactly p/m on the tight worker."""
    from torchpipe.bench.schedules import STAGES, stage_costs
    from torchpipe.schedule import build

    t, p = 1.0, STAGES
    for m in (8, 32):
        costs = stage_costs(t, p)
        assert build("gpipe", p, m).simulate(costs).makespan == pytest.approx(3 * t * (m + p - 1))
        assert build("1f1b", p, m).simulate(costs).makespan == pytest.approx(3 * t * (m + p - 1))
    assert stage_costs(t, 8)["I"] == [0.0] + [t] * 7 and stage_costs(t, 8)["W"] == [2 * t] + [t] * 7


def test_schedules_suite_simulates_with_what_the_stage_alone_costs():
    """Measured alone, each kind costs at least its sleeps; stage 0 of a split schedule runs I = 0
    and W = the whole backward, as in the pipeline."""
    from torchpipe.bench.schedules import StageAlone

    t = 0.001
    alone = StageAlone.measure(t, 4, samples=3)
    assert alone.forward >= t and alone.input_grad >= t and alone.weight_grad >= t and alone.backward >= 2 * t
    costs = StageAlone(1.0, 2.5, 1.2, 1.3).costs(4)
    assert costs == {"F": 1.0, "B": 2.5, "I": [0.0, 1.2, 1.2, 1.2], "W": [2.5, 1.3, 1.3, 1.3]}
