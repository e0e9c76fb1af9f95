"""state_dict holds the full tables under EBC keys: round trips and torchrec interop."""

from __future__ import annotations

import pytest
import torch
from rec_helpers import SumOfPooled, integer_weights, make_tables, zipf_batches
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

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


def test_weights_from_a_torchrec_ebcs_parameters_give_values_not_a_graph() -> None:
    """Review: ``weights={name: ebc.embedding_bags[name].weight}`` pulled the host rows into
    autograd (a CopySlices node, and a node more with every write-back)."""
    tables = make_tables()
    ebc = EmbeddingBagCollection(tables=tables)
    weights = {t.name: ebc.embedding_bags[t.name].weight for t in tables}
    assert all(w.requires_grad for w in weights.values())
    model = CachedEmbeddingBagCollection(tables, 16, optimizer=RowWiseAdagrad(lr=0.5), weights=weights)
    for name, host in model.hosts.items():
        assert not host.rows.requires_grad and host.rows.grad_fn is None
        assert torch.equal(host.weight, weights[name].detach())
    for kjt in zipf_batches(tables, 10, seed=3):
        model(kjt).values().sum().backward()
    state = model.state_dict()
    assert not any(v.requires_grad for v in state.values())
    assert all(host.rows.grad_fn is None for host in model.hosts.values())
    grad_state = model.optimizer_state("t0").clone().requires_grad_()
    model.load_optimizer_state("t0", grad_state)
    assert model.hosts["t0"].rows.grad_fn is None and not model.optimizer_state("t0").requires_grad


def test_strict_load_reports_every_unexpected_key_as_torch_does() -> None:
    """Review: a key under the collection's prefix without a dot ("typo_weight") was accepted."""
    model, _ = trained_model()
    state = model.state_dict()
    for extra in ("typo_weight", "embedding_bags.t9.weight", "other.weight"):
        wrong = dict(state, **{extra: torch.zeros(1)})
        try:
            model.load_state_dict(wrong)
        except RuntimeError as error:
            assert f'Unexpected key(s) in state_dict: "{extra}"' in str(error)
        else:
            raise AssertionError(f"{extra!r} was accepted")
        assert model.load_state_dict(wrong, strict=False).unexpected_keys == [extra]
    parent = torch.nn.Module()
    parent.ebc = model
    nested = {f"ebc.{k}": v for k, v in state.items()}
    try:
        parent.load_state_dict(dict(nested, **{"ebc.extra": torch.zeros(1)}))
    except RuntimeError as error:
        assert 'Unexpected key(s) in state_dict: "ebc.extra"' in str(error)
    else:
        raise AssertionError("'ebc.extra' was accepted")
    parent.load_state_dict(nested)  # and the right keys still load


def test_a_config_whose_init_fn_was_set_to_none_gets_torchrecs_default_range() -> None:
    """Review: rows came from torch.empty (whatever memory held). TorchRec's config fills a
    missing init_fn in ``__post_init__`` with uniform(-sqrt(1/n), sqrt(1/n))."""
    tables = make_tables(num_rows=(400, 24))
    for config in tables:
        config.init_fn = None
    torch.manual_seed(0)
    first = CachedEmbeddingBagCollection(tables, 16).full_weight("t0")
    torch.manual_seed(0)
    second = CachedEmbeddingBagCollection(tables, 16).full_weight("t0")
    assert torch.equal(first, second)
    bound = tables[0].get_weight_init_max()
    assert bound == (1 / 400) ** 0.5 and tables[0].get_weight_init_min() == -bound
    assert float(first.abs().max()) <= bound and float(first.abs().max()) > bound / 2


def test_a_checkpoint_with_the_optimizer_states_resumes_exactly() -> None:
    """Reviews: state_dict() holds the tables only (TorchRec's EBC keys), so a resumed Adam or
    RowWiseAdagrad restarted from fresh state; optimizer_state_dict() is the other half."""
    from torchpipe.rec import Adam

    tables = make_tables()
    batches = zipf_batches(tables, 24, seed=11)

    def fresh(cache_rows: int) -> CachedEmbeddingBagCollection:
        return CachedEmbeddingBagCollection(make_tables(), cache_rows, optimizer=Adam(lr=0.25),
                                            weights=integer_weights(tables))

    through = fresh(16)
    for kjt in batches:
        through(kjt).values().sum().backward()
    first = fresh(16)
    for kjt in batches[:12]:
        first(kjt).values().sum().backward()
    tables_state, optimizer_states = first.state_dict(), first.optimizer_state_dict()
    assert sorted(optimizer_states) == ["t0", "t1"]
    resumed = fresh(20)  # another cache size: the checkpoint is the tables, not the cache
    resumed.load_state_dict(tables_state)
    resumed.load_optimizer_state_dict(optimizer_states)
    for kjt in batches[12:]:
        resumed(kjt).values().sum().backward()
    for name in ("t0", "t1"):
        assert torch.equal(resumed.full_weight(name), through.full_weight(name))
        assert torch.equal(resumed.optimizer_state(name), through.optimizer_state(name))
    without = fresh(16)  # the tables alone do not resume Adam
    without.load_state_dict(tables_state)
    for kjt in batches[12:]:
        without(kjt).values().sum().backward()
    assert not torch.equal(without.full_weight("t0"), through.full_weight("t0"))


def test_loading_optimizer_states_checks_every_table_first() -> None:
    import pytest

    model, _ = trained_model()
    states = model.optimizer_state_dict()
    before = {name: host.rows.clone() for name, host in model.hosts.items()}
    bad_shape = dict(states, t1=torch.zeros(3, 3))
    meta = dict(states, t0=states["t0"] + 1, t1=torch.empty(states["t1"].shape, device="meta"))
    sparse = dict(states, t0=states["t0"] + 1, t1=states["t1"].to_sparse())
    for wrong, error, words in ((dict(states, t9=states["t0"]), KeyError, r"unknown \['t9'\]"),
                                (meta, TypeError, "table 't1' must be a dense tensor with values, got .* on meta"),
                                (sparse, TypeError, "table 't1' must be a dense tensor with values, got a torch.sparse_coo"),
                                ({"t0": states["t0"]}, KeyError, r"missing \['t1'\]"),
                                (bad_shape, ValueError, r"table 't1' must have shape \(24, 1\)"),
                                ([states["t0"]], TypeError, "must be a dict")):
        with pytest.raises(error, match=words):
            model.load_optimizer_state_dict(wrong)
        assert all(torch.equal(before[n], model.hosts[n].rows) for n in before)  # t0 untouched too


def test_reset_parameters_draws_torchrecs_rows_and_fresh_optimizer_state() -> None:
    """TorchRec parity: ``EmbeddingBagCollection.reset_parameters()`` redraws every table from its
    init_fn in config order; ours does the same (same seed, same rows), for the cache's rows too,
    and resets the optimizer state. With a pipeline's batches in flight it is refused first,
    without drawing from the RNG or changing a row."""
    from torchpipe.rec import FullTableEmbeddingBagCollection
    from torchpipe.train import EmbCacheTrainPipeline, RecBatch

    tables = make_tables()
    data = zipf_batches(tables, 6, seed=4)
    every_row = {t.name: t.num_embeddings for t in tables}  # room for a pipeline's batches in flight below
    cached = CachedEmbeddingBagCollection(tables, every_row, optimizer=RowWiseAdagrad(lr=0.5))
    full = FullTableEmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(lr=0.5))
    fresh_state = CachedEmbeddingBagCollection(tables, 16, optimizer=RowWiseAdagrad(lr=0.5)).optimizer_state_dict()
    for model in (cached, full):
        for kjt in data:
            model(kjt).values().sum().backward()
        assert any(not torch.equal(model.optimizer_state(t.name), fresh_state[t.name]) for t in tables)
        torch.manual_seed(11)
        model.reset_parameters()
        theirs = EmbeddingBagCollection(tables=tables)
        torch.manual_seed(11)
        theirs.reset_parameters()
        for t in tables:
            assert torch.equal(model.full_weight(t.name), theirs.embedding_bags[t.name].weight.detach()), t.name
            assert torch.equal(model.optimizer_state(t.name), fresh_state[t.name]), t.name
    torch.manual_seed(12)
    cached.reset_parameters()
    once = cached(data[0]).values()  # served from the cache's slots, which were refreshed too
    assert torch.equal(once, FullTableEmbeddingBagCollection(tables, weights={
        t.name: cached.full_weight(t.name) for t in tables})(data[0]).values())

    with EmbCacheTrainPipeline(SumOfPooled(cached), None, host_threads=1, device_threads=1) as pipe:
        pipe.progress(iter([RecBatch(torch.zeros(4, 1), kjt, torch.zeros(4)) for kjt in data]))
        assert cached.in_flight() > 0
        rng, rows = torch.get_rng_state(), [host.rows.clone() for host in cached.hosts.values()]
        with pytest.raises(RuntimeError, match=r"reset_parameters\(\) with batches in flight: .* drain the pipeline "
                                               r"first \(its flush\(\) or close\(\)\)"):
            cached.reset_parameters()
        with pytest.raises(RuntimeError, match=r"^state_dict\(\) with batches in flight"):  # the call made
            cached.state_dict()
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(host.rows, before) for host, before in zip(cached.hosts.values(), rows))
        pipe.flush()
    cached.reset_parameters()


class _Ranker(torch.nn.Module):
    """A model with the cached collection inside and dense layers beside it, as a user has."""

    def __init__(self, ebc: CachedEmbeddingBagCollection) -> None:
        super().__init__()
        self.sparse = ebc
        self.over = torch.nn.Linear(4, 1)


def test_distributed_checkpoint_state_dict_helpers_resolve_the_ebc_keys_and_load_them(tmp_path) -> None:
    # Review: get_model_state_dict walked "sparse.embedding_bags.t0.weight" by attribute and hit
    # AttributeError: 'CachedEmbeddingBagCollection' object has no attribute 'embedding_bags'.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, batches = trained_model()
    ranker = _Ranker(model)
    state = get_model_state_dict(ranker)
    assert sorted(state) == ["over.bias", "over.weight", "sparse.embedding_bags.t0.weight",
                             "sparse.embedding_bags.t1.weight"]
    assert torch.equal(state["sparse.embedding_bags.t1.weight"], model.full_weight("t1"))
    fresh = _Ranker(CachedEmbeddingBagCollection(make_tables(), 16, optimizer=RowWiseAdagrad(lr=0.5)))
    fresh.sparse(batches[0])  # rows cached already: the load must reach them too
    dcp.save(state, checkpoint_id=tmp_path)  # through the disk, as a user's checkpoint goes
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=tmp_path)
    set_model_state_dict(fresh, state)
    state = get_model_state_dict(ranker)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in state.items())
    with torch.no_grad():
        assert torch.equal(fresh.sparse(batches[1]).values(), model(batches[1]).values())


def test_embedding_bags_reads_each_table_as_torchrec_names_it_as_a_flushed_copy() -> None:
    model, batches = trained_model()
    bags = model.embedding_bags
    assert list(bags) == ["t0", "t1"] and len(bags) == 2
    weight = bags["t0"].weight
    assert torch.equal(weight, model.state_dict()["embedding_bags.t0.weight"])
    assert torch.equal(bags.t1.weight, model.full_weight("t1"))
    weight.zero_()  # a copy: the table is unchanged
    assert not torch.equal(model.full_weight("t0"), weight)
    with pytest.raises(KeyError, match=r"no table named 'tx'; the tables are \['t0', 't1'\]"):
        bags["tx"]
    with pytest.raises(AttributeError, match="no table named 'tx'"):
        bags.tx


@pytest.mark.parametrize("name", ["get", "_ads", "_entries"])
def test_a_table_named_like_the_views_own_attributes_is_walked_to_by_its_key(name) -> None:
    # Review: view.get was Mapping.get and "_..." names were refused, so get_model_state_dict
    # failed on tables TorchRec's EBC accepts (it walks each key's path by attribute).
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    tables = [EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name=name, feature_names=["f"]),
              EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name="t1", feature_names=["g"])]
    model = CachedEmbeddingBagCollection(tables, 8)
    state = get_model_state_dict(_Ranker(model))
    assert torch.equal(state[f"sparse.embedding_bags.{name}.weight"], model.full_weight(name))
    bags = model.embedding_bags
    assert torch.equal(getattr(bags, name).weight, model.full_weight(name))
    assert list(bags) == [name, "t1"] and len(bags) == 2 and bags["t1"] is bags.t1


@pytest.mark.parametrize("name", ["keys", "items", "values"])
def test_a_table_named_like_a_mapping_call_leaves_the_views_mapping_calls_working(name) -> None:
    # Review (s31): with table names first, a table called "keys" broke dict(view), "items" ==.
    tables = [EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name=name, feature_names=["f"]),
              EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name="t1", feature_names=["g"])]
    bags = CachedEmbeddingBagCollection(tables, 8).embedding_bags
    assert sorted(dict(bags)) == sorted([name, "t1"]) and bags == bags
    assert list(bags.keys()) == [name, "t1"] and len(list(bags.items())) == len(list(bags.values())) == 2


@pytest.mark.parametrize("bad", [torch.zeros(24, 4, device="meta"), [[0.0] * 4] * 24, torch.zeros(24, 4).to_sparse()],
                         ids=["meta", "list", "sparse"])
def test_a_value_that_cannot_load_leaves_every_table_as_it_was(bad) -> None:
    """Review (helper-130): t0 was overwritten on the host before t1's value failed to copy, the
    cached rows were never refreshed (old in the cache, new on the host), and the error was a
    NotImplementedError, or an AttributeError for a list, naming no key."""
    model, batches = trained_model()
    before = model.state_dict()
    wrong = {"embedding_bags.t0.weight": torch.ones(40, 4), "embedding_bags.t1.weight": bad}
    with pytest.raises(RuntimeError, match='parameter named "embedding_bags.t1.weight"'):
        model.load_state_dict(wrong)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The cache agrees with the host: training on matches a model that never saw the failed load.
    twin = CachedEmbeddingBagCollection(make_tables(), 16, optimizer=RowWiseAdagrad(lr=0.5))
    twin.load_state_dict(before)
    twin.load_optimizer_state_dict(model.optimizer_state_dict())
    for kjt in batches[:5]:
        model(kjt).values().sum().backward()
        twin(kjt).values().sum().backward()
    assert all(torch.equal(model.state_dict()[k], twin.state_dict()[k]) for k in before)
