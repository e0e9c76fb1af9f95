"""The fused row optimizers against torch.optim on a dense parameter.

When every row of a table is in every batch, once, a lazy row-wise rule must give what
torch's optimizer gives for the same weights and gradients: SGD (weight decay too) bitwise,
Adam against torch.optim.Adam (``weight_decay_mode='l2'``) and torch.optim.AdamW
(``'decoupled'``), and row-wise Adagrad on one-column rows (where the row's mean square is
the element's square) against torch.optim.Adagrad, to float32 rounding: the rules order
their operations differently from torch's. Rows a batch does not read are not decayed.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from torchpipe.rec import SGD, Adam, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection, RowWiseAdagrad

ROWS, STEPS = 6, 8

CASES: dict[str, tuple[Callable[[], object], Callable[[list], torch.optim.Optimizer], int, bool]] = {
    # name: (our optimizer, torch's on [param], embedding dim, bitwise)
    "sgd": (lambda: SGD(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5), 4, True),
    "sgd-decay": (lambda: SGD(lr=0.5, weight_decay=0.1), lambda p: torch.optim.SGD(p, lr=0.5, weight_decay=0.1),
                  4, True),
    "adam": (lambda: Adam(lr=0.1), lambda p: torch.optim.Adam(p, lr=0.1), 4, False),
    "adam-l2": (lambda: Adam(lr=0.1, weight_decay=0.3), lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.3),
                4, False),
    "adamw": (lambda: Adam(lr=0.1, beta1=0.8, beta2=0.99, weight_decay=0.3, weight_decay_mode="decoupled"),
              lambda p: torch.optim.AdamW(p, lr=0.1, betas=(0.8, 0.99), weight_decay=0.3), 4, False),
    "adagrad": (lambda: RowWiseAdagrad(lr=0.5, eps=1e-10),
                lambda p: torch.optim.Adagrad(p, lr=0.5, eps=1e-10), 1, False),
    "adagrad-l2": (lambda: RowWiseAdagrad(lr=0.5, eps=1e-10, weight_decay=0.2),
                   lambda p: torch.optim.Adagrad(p, lr=0.5, eps=1e-10, weight_decay=0.2), 1, False),
}


def one_key_per_bag(keys: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(["f"], keys, torch.ones(keys.numel(), dtype=torch.int64))


@pytest.mark.parametrize("case", list(CASES))
def test_a_row_rule_equals_torchs_optimizer_when_every_row_is_in_every_batch(case: str) -> None:
    ours, theirs, dim, bitwise = CASES[case]
    table = EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=dim, name="t", feature_names=["f"],
                               pooling=PoolingType.SUM)
    g = torch.Generator().manual_seed(len(case))
    start = torch.randn(ROWS, dim, generator=g)
    ebc = FullTableEmbeddingBagCollection([table], optimizer=ours(), weights={"t": start})
    param = torch.nn.Parameter(start.clone())
    optimizer = theirs([param])
    for step in range(STEPS):
        keys = torch.randperm(ROWS, generator=g)  # every row once, in a new order
        coefficients = torch.randn(ROWS, dim, generator=g)
        (ebc(one_key_per_bag(keys)).values() * coefficients).sum().backward()  # the update is fused into it
        optimizer.zero_grad()
        (param[keys] * coefficients).sum().backward()
        optimizer.step()
        got = ebc.full_weight("t")
        if bitwise:
            assert torch.equal(got, param.detach()), f"step {step}"
        else:
            torch.testing.assert_close(got, param.detach(), rtol=2e-5, atol=2e-6, msg=f"step {step}")
    assert not torch.equal(got, start)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.5, weight_decay=0.5), Adam(lr=0.1, weight_decay=0.5),
                                       Adam(lr=0.1, weight_decay=0.5, weight_decay_mode="decoupled"),
                                       RowWiseAdagrad(lr=0.5, weight_decay=0.5, weight_decay_mode="decoupled")],
                         ids=["sgd", "adam-l2", "adamw", "adagrad-decoupled"])
def test_weight_decay_reaches_only_the_rows_a_batch_reads(optimizer) -> None:
    table = EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=3, name="t", feature_names=["f"],
                               pooling=PoolingType.SUM)
    start = torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(0))
    ebc = FullTableEmbeddingBagCollection([table], optimizer=optimizer, weights={"t": start})
    ebc(one_key_per_bag(torch.tensor([1, 4]))).values().mul(0).sum().backward()  # zero gradient
    got = ebc.full_weight("t")
    untouched = [0, 2, 3, 5]
    assert torch.equal(got[untouched], start[untouched])
    assert (got[[1, 4]].abs() < start[[1, 4]].abs()).all()  # a zero gradient: only the decay moved them


@pytest.mark.parametrize("collection", ["full", "cached"])
@pytest.mark.parametrize("optimizer, moves", [
    (lambda: SGD(lr=0.5), False),
    (lambda: SGD(lr=0.5, weight_decay=0.1), True),
    (lambda: Adam(lr=0.1), True),  # the moments of the first step carry on
    (lambda: RowWiseAdagrad(lr=0.5, weight_decay=0.1, weight_decay_mode="decoupled"), True),
])
def test_a_table_the_loss_does_not_use_takes_a_zero_gradient_update(collection, optimizer, moves) -> None:
    """FBGEMM's rules update every row a batch reads, with the gradient the one output tensor
    gives it: zero for a table whose output the loss leaves out. So decay and Adam's moments
    move those rows; rows no batch reads stay as they are."""
    tables = [EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=3, name=name, feature_names=[feature],
                                 pooling=PoolingType.SUM) for name, feature in (("t", "f"), ("u", "g"))]
    starts = {name: torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(seed))
              for seed, name in enumerate(("t", "u"))}
    if collection == "full":
        ebc = FullTableEmbeddingBagCollection(tables, optimizer=optimizer(), weights=dict(starts))
    else:
        ebc = CachedEmbeddingBagCollection(tables, 4, optimizer=optimizer(), weights=dict(starts))
    batch = KeyedJaggedTensor.from_lengths_sync(["f", "g"], torch.tensor([1, 4, 2, 5]), torch.ones(4, dtype=torch.int64))
    ebc(batch).values().square().sum().backward()  # both tables: a gradient, and Adam's moments
    after_first = ebc.full_weight("u").clone()
    ebc(batch)["f"].square().sum().backward()  # u's output unused: a zero gradient for rows 2 and 5
    got = ebc.full_weight("u")
    untouched = [0, 1, 3, 4]
    assert torch.equal(got[untouched], starts["u"][untouched])
    assert torch.equal(got[[2, 5]], after_first[[2, 5]]) is not moves
    assert not torch.equal(ebc.full_weight("t")[[1, 4]], starts["t"][[1, 4]])


@pytest.mark.parametrize("build, error, words", [
    (lambda: SGD(weight_decay=-0.1), ValueError, "weight_decay must be a finite float >= 0, got -0.1"),
    (lambda: Adam(weight_decay=float("inf")), ValueError, "weight_decay must be a finite float >= 0"),
    (lambda: Adam(weight_decay="0.1"), TypeError, "weight_decay must be a finite float >= 0"),
    (lambda: RowWiseAdagrad(weight_decay=1e-50), ValueError, "weight_decay=1e-50 rounds to 0 in float32"),
    (lambda: Adam(weight_decay=0.1, weight_decay_mode="adamw"), ValueError,
     r"weight_decay_mode must be one of \('l2', 'decoupled'\).* got 'adamw'"),
    (lambda: RowWiseAdagrad(weight_decay_mode=None), ValueError, "weight_decay_mode must be one of"),
])
def test_a_bad_weight_decay_is_refused_when_the_optimizer_is_built(build, error, words) -> None:
    with pytest.raises(error, match=words):
        build()
