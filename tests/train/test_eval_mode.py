"""A model in eval() mode takes forward-only steps, as in TorchRec's pipelines.

TorchRec's `TrainPipelineSparseDist.progress` guards zero_grad, backward and the optimizer
step with ``if self._model.training``: evaluation batches go through the same pipeline and
change nothing. A model in train mode under ``no_grad`` cannot take a step: refused before
anything changes, instead of failing inside the pipeline and dropping the batches in flight.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch
from train_helpers import (assert_same_outputs, assert_same_state, build, drain, make_batches, make_tables,
                           reference_run, window_minimum)

from torchpipe.rec import Adam
from torchpipe.train import EmbCacheTrainPipeline, TrainPipelineBase, TrainPipelineSparseDist, train_step

KINDS = ["emb_cache", "base", "sparse_dist"]


def _pipeline(kind: str, model, opt):
    if kind == "emb_cache":
        return EmbCacheTrainPipeline(model, opt, host_threads=2, device_threads=1)
    if kind == "base":
        return TrainPipelineBase(model, opt, device_threads=1)
    return TrainPipelineSparseDist(model, opt, device_threads=1)


def _model(kind: str, tables):
    """The cached model for the cache pipeline; the full-table one (plain module) for the others."""
    return build(tables, 64, Adam(lr=0.5), cached=kind == "emb_cache")


def _state(model) -> Dict[str, torch.Tensor]:
    """Dense parameters, and every table's rows and optimizer state (a full-table collection's
    state_dict holds neither)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for layout in model.ebc.layouts:
        state[f"{layout.name} rows"] = model.ebc.full_weight(layout.name)
        state[f"{layout.name} optimizer state"] = model.ebc.optimizer_state(layout.name)
    return state


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("no_grad", [False, True])
def test_eval_mode_steps_run_forward_only_and_change_nothing(kind: str, no_grad: bool) -> None:
    tables = make_tables()
    batches = make_batches(tables, 6)
    model, _ = _model(kind, tables)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # a step would leave momentum buffers
    model.eval()
    before = _state(model)
    expected = [model(b)[1] for b in batches]  # the plain forward, nothing trained
    assert not any(p.grad is not None for p in model.parameters())
    with _pipeline(kind, model, opt) as pipe:
        if no_grad:
            with torch.no_grad():
                outputs = drain(pipe, iter(batches))
        else:
            outputs = drain(pipe, iter(batches))
        if kind == "emb_cache":
            pipe.flush()
    assert_same_outputs(outputs, expected)
    after = _state(model)
    assert len(after) == len(before) > 6 and [k for k in before if not torch.equal(before[k], after[k])] == []
    assert all(p.grad is None for p in model.parameters()), "an eval step ran backward"
    assert len(opt.state) == 0, "an eval step stepped the optimizer"


def test_switching_to_eval_and_back_trains_exactly_the_train_mode_batches() -> None:
    """Steps 0-2 train, 3-4 evaluate (in the same pipeline, batches in flight), 5-7 train:
    equal to a loop that trains on 0-2 and 5-7 only."""
    tables = make_tables()
    batches = make_batches(tables, 8)
    model, opt = _model("emb_cache", tables)
    reference, ref_opt = build(tables, None, Adam(lr=0.5), cached=False)
    ref_outputs = []
    for i, batch in enumerate(batches):
        reference.train(i not in (3, 4))
        ref_outputs.append(train_step(reference, ref_opt, batch))
    outputs = []
    it = iter(batches)
    with _pipeline("emb_cache", model, opt) as pipe:
        # progress() call i fills the pipeline as far as needed and returns batch i, whose
        # train stage runs in that call: the mode then is what counts, as in TorchRec.
        for call in range(len(batches)):
            model.train(call not in (3, 4))
            outputs.append(pipe.progress(it))
            in_flight = pipe.pipeline.in_flight()
            assert all(b > call for b in in_flight) and (in_flight or call == len(batches) - 1)
        pipe.flush()
    assert_same_outputs(outputs, ref_outputs)
    assert_same_state(model, reference)


def _enable_grad_in_inference_mode():
    """Grad mode on, yet nothing recorded: the workers could not backpropagate either."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode())
    stack.enter_context(torch.enable_grad())
    return stack


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "enable_grad_in_inference_mode"])
def test_train_mode_under_no_grad_is_refused_before_anything_changes(kind: str, mode: str) -> None:
    tables = make_tables()
    batches = make_batches(tables, 6)
    model, opt = _model(kind, tables)
    reference, _, ref_outputs = reference_run(tables, batches, Adam(lr=0.5))
    disable = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "enable_grad_in_inference_mode": _enable_grad_in_inference_mode}[mode]
    it = iter(batches)
    with _pipeline(kind, model, opt) as pipe:
        outputs = [pipe.progress(it)]  # one batch finished, the rest of the window in flight
        in_flight = pipe.pipeline.in_flight()
        with disable():
            with pytest.raises(RuntimeError, match=r"progress\(\) under torch.no_grad\(\).*model.eval\(\)"):
                pipe.progress(it)
            with pytest.raises(RuntimeError, match=r"flush\(\) under torch.no_grad\(\)"):
                pipe.flush()
        assert pipe.pipeline.in_flight() == in_flight  # nothing admitted, nothing dropped
        outputs += drain(pipe, it)
        if kind == "emb_cache":
            pipe.flush()
    assert_same_outputs(outputs, ref_outputs)
    assert_same_state(model, reference)


def test_flush_of_a_drained_pipeline_under_no_grad_is_allowed() -> None:
    """Nothing in flight: a flush only writes rows back (a checkpoint routine under no_grad)."""
    tables = make_tables()
    batches = make_batches(tables, 3)
    model, opt = _model("emb_cache", tables)
    with _pipeline("emb_cache", model, opt) as pipe:
        drain(pipe, iter(batches))
        with torch.no_grad():
            assert pipe.flush() == []


def test_an_evaluation_under_inference_mode_leaves_the_cache_fit_for_training() -> None:
    """Review: admission (on the caller's thread) made the cache's scratch array under
    inference_mode, and every later training batch with more keys than cache rows failed
    ("Inplace update to inference tensor outside InferenceMode")."""
    tables = make_tables()
    evaluation = make_batches(tables, 4, batch_size=8, max_bag=6, seed=1)
    training = make_batches(tables, 6, batch_size=8, max_bag=6)
    cache_rows = window_minimum(tables, evaluation + training)

    def counts_distinct(batches) -> bool:  # admission counts distinct keys (the scratch array) for these
        return any(sum(b.sparse_features[f].values().numel() for f in t.feature_names) > cache_rows
                   for b in batches for t in tables)

    assert counts_distinct(evaluation) and counts_distinct(training)
    model, opt = build(tables, cache_rows, Adam(lr=0.5))
    reference, ref_opt, ref_outputs = reference_run(tables, training, Adam(lr=0.5))
    with _pipeline("emb_cache", model, opt) as pipe:
        model.eval()
        with torch.inference_mode():
            assert len(drain(pipe, iter(evaluation))) == 4
        model.train()
        outputs = drain(pipe, iter(training))
        pipe.flush()
    assert_same_outputs(outputs, ref_outputs)
    assert_same_state(model, reference)


def test_an_eval_step_that_skips_the_cached_collection_is_refused_as_in_train_mode() -> None:
    """Review: the check sat in before_step, which a forward-only step never reaches, so an eval
    forward that bypassed the collection returned results without the planned embeddings."""
    tables = make_tables()
    batches = make_batches(tables, 4)
    model, opt = _model("emb_cache", tables)
    model.eval()
    model.forward = lambda batch: (torch.zeros(()), torch.zeros(()))  # never calls model.ebc
    with _pipeline("emb_cache", model, opt) as pipe:
        with pytest.raises(RuntimeError, match="the model did not call the cached collection"):
            pipe.progress(iter(batches))
        assert pipe.pipeline.in_flight() == [] and model.ebc.in_flight() == 0  # dropped and released
