"""state_dict holds the full tables under EBC keys: round trips and torchrec interop."""

from __future__ import annotations

import torch
from rec_helpers import integer_weights, make_tables, zipf_batches
from torchrec import EmbeddingBagCollection

from torchpipe.rec import CachedEmbeddingBagCollection, RowWiseAdagrad


def trained_model() -> tuple[CachedEmbeddingBagCollection, list]:
    tables = make_tables()
    batches = zipf_batches(tables, 30, seed=5)
    model = CachedEmbeddingBagCollection(tables, 16, optimizer=RowWiseAdagrad(lr=0.5),
                                         weights=integer_weights(tables))
    for kjt in batches:
        model(kjt).values().sum().backward()
    return model, batches


def test_state_dict_has_full_tables_under_ebc_keys_and_round_trips_bitwise() -> None:
    model, batches = trained_model()
    state = model.state_dict()
    assert sorted(state) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]
    assert state["embedding_bags.t0.weight"].shape == (40, 4)
    assert torch.equal(state["embedding_bags.t0.weight"], model.full_weight("t0"))
    fresh = CachedEmbeddingBagCollection(make_tables(), 16, optimizer=RowWiseAdagrad(lr=0.5))
    fresh(batches[0])  # something cached already: load must refresh it
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(fresh(batches[1]).values(), model(batches[1]).values())


def test_checkpoint_moves_to_plain_torchrec_ebc_and_back() -> None:
    model, batches = trained_model()
    ebc = EmbeddingBagCollection(tables=make_tables())
    ebc.load_state_dict(model.state_dict())
    for kjt in batches[:5]:
        with torch.no_grad():
            ours, theirs = model(kjt), ebc(kjt)
        assert ours.keys() == theirs.keys()
        assert ours.length_per_key() == theirs.length_per_key()
        torch.testing.assert_close(ours.values(), theirs.values(), rtol=1e-6, atol=1e-6)
    back = CachedEmbeddingBagCollection(make_tables(), 5)
    back.load_state_dict(ebc.state_dict())
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ebc.state_dict().items())


def test_integer_tables_match_torchrec_ebc_exactly_for_sum_pooling() -> None:
    tables = make_tables()
    weights = integer_weights(tables)
    model = CachedEmbeddingBagCollection(tables, 20, weights=weights)
    ebc = EmbeddingBagCollection(tables=make_tables())
    ebc.load_state_dict({f"embedding_bags.{k}.weight": v for k, v in weights.items()})
    kjt = zipf_batches(tables, 1, seed=9)[0]
    with torch.no_grad():
        ours, theirs = model(kjt), ebc(kjt)
    assert torch.equal(ours["f0a"], theirs["f0a"]) and torch.equal(ours["f0b"], theirs["f0b"])


def test_no_dense_grads_and_optimizer_state_is_swapped_with_rows() -> None:
    model, _ = trained_model()
    assert list(model.parameters()) == []
    state = model.optimizer_state("t0")
    assert state.shape == (40, 1) and bool((state > 0).any())
    model.load_optimizer_state("t0", torch.zeros(40, 1))
    assert torch.equal(model.optimizer_state("t0"), torch.zeros(40, 1))


def test_a_checkpoint_between_forward_and_backward_keeps_the_lookup_valid() -> None:
    """Like a plain module: state_dict reads the rows as they are, and the backward still updates them."""
    from torchpipe.rec import FullTableEmbeddingBagCollection

    tables = make_tables()
    batches = zipf_batches(tables, 12, seed=7)
    model = CachedEmbeddingBagCollection(tables, 16, optimizer=RowWiseAdagrad(lr=0.5), weights=integer_weights(tables))
    reference = FullTableEmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(lr=0.5), weights=integer_weights(tables))
    for step, kjt in enumerate(batches):
        out, want = model(kjt).values(), reference(kjt).values()
        assert torch.equal(out, want)
        state = model.state_dict()  # also full_weight and optimizer_state: each flushes
        assert torch.equal(state["embedding_bags.t0.weight"], reference.full_weight("t0")), step
        assert torch.equal(model.optimizer_state("t1"), reference.optimizer_state("t1")), step
        out.sum().backward()  # used to raise StaleBatchError: the flush released the lookup
        want.sum().backward()
    for name in ("t0", "t1"):
        assert torch.equal(model.full_weight(name), reference.full_weight(name))
        assert torch.equal(model.optimizer_state(name), reference.optimizer_state(name))
    assert model.in_flight() == 0
