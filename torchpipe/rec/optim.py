"""Fused sparse row optimizers whose state lives in the row, next to the embedding.

A row of a table is ``[embedding (dim) | optimizer state (state_width(dim))]``. Keeping
the state in the row is what lets the cache swap a row and its state as one unit, and
what makes a cached row self-contained: no global table-wide counter is needed to update
it. Every rule uses only elementwise +, -, *, / and sqrt (correctly rounded in IEEE), so
the same rows and gradients give bitwise the same result whether the rows came from
cache slots or from a full table.

Updates are applied to the *unique* rows of a batch; the caller sums the gradients of
duplicate keys first (two-level dedup).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..checks import check_real
from .batch_keys import TABLE_DTYPE

__all__ = ["RowOptimizer", "SGD", "RowWiseAdagrad", "Adam", "check_row_optimizer", "FusedOptimizerAttribute"]

ROW_DTYPE = TABLE_DTYPE  # what the hyper-parameters are multiplied in


def held_in_rows(value: float) -> float:
    """``value`` as the rows' float32 holds it: what a hyper-parameter is multiplied in."""
    return float(torch.tensor(float(value), dtype=ROW_DTYPE))


def _check_held_in_rows(name: str, value: float, *, below_one: bool = False) -> None:
    """``ValueError`` for a value that passes the double-precision check but changes meaning in
    the rows' float32: a beta below 1 that rounds to 1 (``1 - beta**t`` becomes 0: NaN or inf
    rows), a positive lr or eps that rounds to 0 (no update, or a 0 that the check refused), or
    one beyond float32's range (inf rows)."""
    held = held_in_rows(value)
    if below_one and held >= 1.0:
        raise ValueError(f"{name}={value!r} rounds to {held} in float32, the rows' dtype, where it must stay below 1 "
                         "(1 - beta**t would be 0); take a beta further from 1")
    if value > 0 and held == 0.0:
        raise ValueError(f"{name}={value!r} rounds to 0 in float32, the rows' dtype; give 0 or a value float32 "
                         f"holds (at least {torch.finfo(ROW_DTYPE).smallest_normal * 2.0 ** -23:g})")
    if held == float("inf"):
        raise ValueError(f"{name}={value!r} is beyond float32's range, the rows' dtype (at most "
                         f"{torch.finfo(ROW_DTYPE).max:g})")


WEIGHT_DECAY_MODES = ("l2", "decoupled")


def _check_weight_decay(weight_decay: float, mode: str = "l2") -> None:
    """A weight decay as torch's optimizers take it (a finite float >= 0), and its mode."""
    check_real("weight_decay", weight_decay, 0.0)
    _check_held_in_rows("weight_decay", weight_decay)
    if mode not in WEIGHT_DECAY_MODES:
        raise ValueError(f"weight_decay_mode must be one of {WEIGHT_DECAY_MODES} ('l2' adds weight_decay * w to "
                         f"the gradient, as torch.optim.Adam; 'decoupled' scales w by 1 - lr * weight_decay, as "
                         f"AdamW), got {mode!r}")


def _decay(w: torch.Tensor, grad: torch.Tensor, lr: float, weight_decay: float,
           mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and gradient a rule goes on with after weight decay: ``'l2'`` adds
    ``weight_decay * w`` to the gradient (torch.optim's ``weight_decay``), ``'decoupled'``
    scales the weights by ``1 - lr * weight_decay`` first (AdamW's). Zero decay changes nothing."""
    if not weight_decay:
        return w, grad
    if mode == "l2":
        return w, grad.add(w, alpha=weight_decay)  # torch.optim's op: the same rounding (an FMA on some CPUs)
    return w * (1 - lr * weight_decay), grad


class RowOptimizer:
    """A sparse optimizer that updates whole rows ``[emb | state]`` in one fused step."""

    def state_names(self, dim: int) -> list[str]:
        """Names of the state columns, in order, for readers of `optimizer_state`."""
        return []

    def state_width(self, dim: int) -> int:
        """Columns of state stored after the embedding in each row."""
        return len(self.state_names(dim))

    def init_state(self, num_rows: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The state of a row never updated yet."""
        return torch.zeros(num_rows, self.state_width(dim), dtype=dtype)

    def apply(self, rows: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
        """Return the updated rows (``[n, dim + state_width]``) for deduplicated ``grad`` ``[n, dim]``."""
        raise NotImplementedError


@dataclass(frozen=True)
class SGD(RowOptimizer):
    """Plain SGD: ``w -= lr * g``. No state.

    ``weight_decay`` as torch.optim.SGD's: ``g += weight_decay * w`` first, on the rows in the
    batch only (lazily, as FBGEMM's fused optimizers decay).
    """

    lr: float = 0.01
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_real("lr", self.lr, 0.0)
        _check_held_in_rows("lr", self.lr)
        _check_weight_decay(self.weight_decay)

    def state_names(self, dim: int) -> list[str]:
        return []

    def apply(self, rows: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
        out = rows.clone()
        w, grad = _decay(rows[:, :dim], grad, self.lr, self.weight_decay, "l2")
        out[:, :dim] = w - grad * self.lr
        return out


@dataclass(frozen=True)
class RowWiseAdagrad(RowOptimizer):
    """Row-wise Adagrad as FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row.

    ``G += mean(g * g)``; ``w -= g * (lr / (sqrt(G) + eps))``. State: ``[G]``.

    ``weight_decay`` (rows in the batch only): ``weight_decay_mode='l2'`` adds
    ``weight_decay * w`` to ``g`` before it is accumulated, as torch.optim.Adagrad does;
    ``'decoupled'`` scales ``w`` by ``1 - lr * weight_decay`` before the update.
    """

    lr: float = 0.01
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mode: str = "l2"

    def __post_init__(self) -> None:
        check_real("lr", self.lr, 0.0)
        check_real("eps", self.eps, 0.0)
        _check_held_in_rows("lr", self.lr)
        _check_held_in_rows("eps", self.eps)
        _check_weight_decay(self.weight_decay, self.weight_decay_mode)

    def state_names(self, dim: int) -> list[str]:
        return ["sum_sq_mean"]

    def apply(self, rows: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
        out = rows.clone()
        w, grad = _decay(rows[:, :dim], grad, self.lr, self.weight_decay, self.weight_decay_mode)
        acc = rows[:, dim:dim + 1] + (grad * grad).mean(dim=1, keepdim=True)
        multiplier = self.lr / (torch.sqrt(acc) + self.eps)
        out[:, :dim] = w - grad * multiplier
        out[:, dim:dim + 1] = acc
        return out


@dataclass(frozen=True)
class Adam(RowOptimizer):
    """Lazy Adam with a **per-row** step: rows not in the batch are not touched.

    Why per-row: a row's moments only decay when the row is updated, so its bias
    correction must count its own updates, not the global step (torch's SparseAdam and
    FBGEMM's TBE Adam use the global step instead; we do not). The step is stored as the
    running powers ``beta1**t`` and ``beta2**t`` (products of correctly rounded
    multiplies, never ``pow``), so the rule is bitwise reproducible. State:
    ``[m (dim) | v (dim) | beta1**t | beta2**t]``, ``2 * dim + 2`` columns, powers start at 1.

    ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``; ``w -= lr * (m/(1-b1**t)) /
    (sqrt(v/(1-b2**t)) + eps)``.

    ``weight_decay`` (rows in the batch only): ``weight_decay_mode='l2'`` adds
    ``weight_decay * w`` to ``g`` first, as torch.optim.Adam; ``'decoupled'`` scales ``w`` by
    ``1 - lr * weight_decay`` first, as torch.optim.AdamW.
    """

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mode: str = "l2"

    def __post_init__(self) -> None:
        # torch.optim.Adam's ranges; beta == 1 would divide by 1 - beta**t == 0 (NaN rows).
        check_real("lr", self.lr, 0.0)
        check_real("beta1", self.beta1, 0.0, 1.0)
        check_real("beta2", self.beta2, 0.0, 1.0)
        check_real("eps", self.eps, 0.0)
        _check_held_in_rows("lr", self.lr)
        _check_held_in_rows("beta1", self.beta1, below_one=True)
        _check_held_in_rows("beta2", self.beta2, below_one=True)
        _check_held_in_rows("eps", self.eps)
        _check_weight_decay(self.weight_decay, self.weight_decay_mode)

    @cached_property
    def _held_betas(self) -> tuple[float, float]:
        """The betas as float32 holds them (computed once per optimizer, not per update)."""
        return held_in_rows(self.beta1), held_in_rows(self.beta2)

    def state_names(self, dim: int) -> list[str]:
        return [f"m{i}" for i in range(dim)] + [f"v{i}" for i in range(dim)] + ["beta1_pow", "beta2_pow"]

    def init_state(self, num_rows: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        state = torch.zeros(num_rows, self.state_width(dim), dtype=dtype)
        state[:, 2 * dim:] = 1.0
        return state

    def apply(self, rows: torch.Tensor, grad: torch.Tensor, dim: int) -> torch.Tensor:
        # The betas as the rows hold them, in the moments and in the powers alike: (1 - beta)
        # from the double beta against beta**t from the float32 one would not cancel at t = 1
        # (a first step of 1.09 lr instead of lr for beta2 = 0.9999999).
        beta1, beta2 = self._held_betas
        out = rows.clone()
        w, grad = _decay(rows[:, :dim], grad, self.lr, self.weight_decay, self.weight_decay_mode)
        m = rows[:, dim:2 * dim] * beta1 + grad * (1.0 - beta1)
        v = rows[:, 2 * dim:3 * dim] * beta2 + (grad * grad) * (1.0 - beta2)
        b1_pow = rows[:, 3 * dim:3 * dim + 1] * beta1
        b2_pow = rows[:, 3 * dim + 1:3 * dim + 2] * beta2
        m_hat = m / (1.0 - b1_pow)
        v_hat = v / (1.0 - b2_pow)
        out[:, :dim] = w - (m_hat * self.lr) / (torch.sqrt(v_hat) + self.eps)
        out[:, dim:2 * dim] = m
        out[:, 2 * dim:3 * dim] = v
        out[:, 3 * dim:3 * dim + 1] = b1_pow
        out[:, 3 * dim + 1:3 * dim + 2] = b2_pow
        return out


def check_row_optimizer(optimizer: object) -> RowOptimizer:
    """A collection's ``optimizer`` argument: a `RowOptimizer` instance, or None for ``SGD()``.

    The optimizer is fused into the lookup's backward, so a ``torch.optim`` optimizer (which
    steps dense parameters) cannot stand in for it.
    """
    if optimizer is None:
        return SGD()
    if not isinstance(optimizer, RowOptimizer) or type(optimizer).apply is RowOptimizer.apply:
        raise TypeError(f"optimizer must be a torchpipe.rec RowOptimizer instance (SGD, RowWiseAdagrad, Adam) or "
                        f"None, got {optimizer!r}")
    return optimizer


class FusedOptimizerAttribute:
    """A collection's ``optimizer``: replaceable, for a new learning rate or new betas, by an
    optimizer whose state has the same columns in every table.

    Why checked: the optimizer's state lives in the rows. Another kind (Adagrad after Adam)
    would read the old state's columns as its own and train on garbage, silently, or fail
    only inside a backward; so assigning one is a ``TypeError`` and the collection keeps its
    optimizer. To schedule the learning rate: ``ebc.optimizer = dataclasses.replace(
    ebc.optimizer, lr=new_lr)``.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name, self._slot = name, f"_{name}"

    def __get__(self, collection: object, owner: type | None = None) -> "RowOptimizer | FusedOptimizerAttribute":
        if collection is None:
            return self
        state = collection.__dict__
        if self._slot not in state and self._name in state:  # pickled before the attribute was checked
            state[self._slot] = state.pop(self._name)
        try:
            return state[self._slot]
        except KeyError:
            raise AttributeError(f"{type(collection).__name__} has no optimizer yet") from None

    def __set__(self, collection: object, optimizer: object) -> None:
        if optimizer is None:
            raise TypeError("optimizer cannot be set to None on a built collection: give a RowOptimizer")
        optimizer = check_row_optimizer(optimizer)
        current = collection.__dict__.get(self._slot)
        if current is not None:
            for layout in collection.layouts:  # type: ignore[attr-defined]
                if optimizer.state_names(layout.dim) != current.state_names(layout.dim):
                    raise TypeError(f"this collection's rows hold {type(current).__name__}'s state "
                                    f"({current.state_width(layout.dim)} columns in table {layout.name!r}); "
                                    f"{type(optimizer).__name__} keeps another state and cannot take over. "
                                    f"Replace it by another {type(current).__name__} "
                                    "(dataclasses.replace(ebc.optimizer, lr=...)), or build a new collection")
        collection.__dict__[self._slot] = optimizer

    def __delete__(self, collection: object) -> None:
        raise AttributeError("a collection's optimizer cannot be deleted: its rows hold the optimizer's state")
