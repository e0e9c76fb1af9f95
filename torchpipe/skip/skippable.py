"""``@skippable``: layers that hand tensors to later layers, across partitions.

A skippable layer's ``forward`` is a generator: ``yield stash('name', tensor)`` hands a
tensor on, and ``tensor = yield pop('name')`` receives it in a later layer. The decorator
declares which names a class stashes and pops, so that a whole model can be checked before
it runs (:func:`verify_skippables`) and the pipeline knows which partitions talk to which.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, FrozenSet, Generator, Iterable, Iterator, List, Optional, Tuple, Type

from torch import Tensor, nn

from .namespace import DEFAULT_NAMESPACE, Namespace
from .tracker import SkipKey, current_skip_tracker, skip_name

__all__ = ["skippable", "stash", "pop", "Skippable", "SkipEvent", "skip_events", "verify_skippables"]


class stash:
    """``yield stash(name, tensor)``: hand ``tensor`` to the layer that pops ``name``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor


class pop:
    """``tensor = yield pop(name)``: receive the tensor an earlier layer stashed as ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """Base of the classes ``@skippable`` makes: wraps the user's layer as ``self.module``."""

    module_cls: ClassVar[Type[nn.Module]]
    stashable_names: ClassVar[FrozenSet[str]]
    poppable_names: ClassVar[FrozenSet[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: Dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module!r})"

    def __getstate__(self) -> Dict[str, Any]:
        # The wrapper took the class's name in its module, so pickle (torch.save of a model)
        # would look the inner layer's class up by that name and find the wrapper: the inner
        # layer travels as its state plus the wrapper, which knows the class (module_cls).
        state = self.__dict__.copy()
        modules = dict(state["_modules"])
        modules["module"] = _InnerLayer(type(self), modules["module"])
        state["_modules"] = modules
        return state

    def isolate(self, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> "Skippable":
        """Put this layer's skip names (or ``only`` those) into namespace ``ns``; returns self.

        The parameter is named ``ns`` as in torchgpipe, so ``isolate(ns=...)`` keeps working.
        """
        names = self.stashable_names | self.poppable_names
        namespace = ns
        if not isinstance(namespace, Namespace):
            raise TypeError(f"ns must be a torchpipe.skip.Namespace, got {namespace!r}")
        chosen = set(names if only is None else _names("only", only))
        unknown = chosen - names
        if unknown:
            raise ValueError(f"cannot isolate names {sorted(unknown)}: {type(self).__name__} declares {sorted(names)}")
        for name in chosen:
            self.namespaces[name] = namespace
        return self

    def key(self, name: str) -> SkipKey:
        return (self.namespaces.get(name, DEFAULT_NAMESPACE), name)

    def stashable(self) -> Iterable[SkipKey]:
        return (self.key(n) for n in sorted(self.stashable_names))

    def poppable(self) -> Iterable[SkipKey]:
        return (self.key(n) for n in sorted(self.poppable_names))

    def forward(self, input: Any) -> Any:  # type: ignore[override]
        result = self.module(input)
        if not isinstance(result, Generator):
            if self.stashable_names or self.poppable_names:
                # RuntimeError, as for a generator that skips a declared name (and as torchgpipe).
                raise RuntimeError(
                    f"{self.module_cls.__name__} declared but did not stash/pop "
                    f"{sorted(self.stashable_names | self.poppable_names)}: its forward must be a generator "
                    f"that yields stash()/pop() for them"
                )
            return result
        return self._drive(result)

    def _drive(self, generator: Generator[Any, Any, Any]) -> Any:
        tracker = current_skip_tracker()
        stashed: List[str] = []
        popped: List[str] = []
        try:
            op = next(generator)
            while True:
                if isinstance(op, stash):
                    if op.name not in self.stashable_names:
                        raise RuntimeError(f"{self.module_cls.__name__} stashed {op.name!r}, which it did not declare in @skippable(stash=...)")
                    tracker.save(self.key(op.name), op.tensor)
                    stashed.append(op.name)
                    op = generator.send(None)
                elif isinstance(op, pop):
                    if op.name not in self.poppable_names:
                        raise RuntimeError(f"{self.module_cls.__name__} popped {op.name!r}, which it did not declare in @skippable(pop=...)")
                    popped.append(op.name)
                    op = generator.send(tracker.load(self.key(op.name)))
                else:
                    raise TypeError(f"a skippable forward may only yield stash() or pop(), got {op!r}")
        except StopIteration as stop:
            missing = (self.stashable_names - set(stashed)) | (self.poppable_names - set(popped))
            if missing:
                raise RuntimeError(f"{self.module_cls.__name__} declared but did not stash/pop {sorted(missing)}")
            return stop.value


class _InnerLayer:
    """A Skippable's inner layer while pickled or deep-copied (see ``Skippable.__getstate__``)."""

    def __init__(self, wrapper: Type[Skippable], layer: nn.Module) -> None:
        self.wrapper = wrapper
        self.layer = layer

    def __reduce__(self) -> Tuple[Any, ...]:
        layer = self.layer
        state = layer.__getstate__() if hasattr(layer, "__getstate__") else layer.__dict__
        return _rebuild_inner_layer, (self.wrapper, state)


def _rebuild_inner_layer(wrapper: Type[Skippable], state: Any) -> nn.Module:
    layer = wrapper.module_cls.__new__(wrapper.module_cls)
    layer.__setstate__(state)
    return layer


def _names(argument: str, names: Any) -> frozenset:
    """``names`` as a set of skip names; a bare str would pass for its characters."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(f"{argument} must be a list of names (e.g. {argument}=[{names!r}]), got {names!r}")
    names = list(names)  # an iterator is read once
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"{argument} names must be str, got {names!r}")
    return frozenset(names)


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Any:
    """Class decorator: the layer stashes the names ``stash`` and pops the names ``pop``."""
    stash_names, pop_names = _names("stash", stash), _names("pop", pop)

    def decorate(cls: Type[nn.Module]) -> Type[Skippable]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates nn.Module subclasses, got {cls!r}")
        attrs = {
            "module_cls": cls,
            "stashable_names": stash_names,
            "poppable_names": pop_names,
            "__qualname__": cls.__qualname__,
            "__module__": cls.__module__,
            "__doc__": cls.__doc__,
        }
        return type(cls.__name__, (Skippable,), attrs)

    return decorate


SkipEvent = Tuple[str, SkipKey, str]
"""``("pop" | "stash", key, qualified layer name)``, in the order the model runs them."""


def skip_events(module: nn.Module, prefix: str = "") -> Iterator[SkipEvent]:
    """The stashes and pops of ``module``'s skippable layers, in run order where it is known.

    An ``nn.Sequential`` runs its children in order, so its skippable layers are listed in
    that order, nested ``nn.Sequential`` containers included. Another module that holds
    skippable layers may run them in any order (registration order is not run order), so it
    counts as one unit: a name it both stashes and pops is matched inside it, and only what
    is left over leaves it, its pops before its stashes.
    """
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if isinstance(child, Skippable):
            yield from (("pop", key, qualified) for key in sorted(child.poppable(), key=_order))
            yield from (("stash", key, qualified) for key in sorted(child.stashable(), key=_order))
        elif isinstance(child, nn.Sequential):
            yield from skip_events(child, f"{qualified}.")
        else:
            yield from _unit_events(child, qualified)


def _order(key: SkipKey) -> Tuple[str, int]:
    return key[1], id(key[0])


def _unit_events(unit: nn.Module, qualified: str) -> Iterator[SkipEvent]:
    """A module of unknown run order: what its skippable layers exchange with the outside."""
    pops: Dict[SkipKey, List[str]] = {}
    stashes: Dict[SkipKey, List[str]] = {}
    for name, layer in unit.named_modules(prefix=qualified):
        if isinstance(layer, Skippable):
            for key in layer.poppable():
                pops.setdefault(key, []).append(name)
            for key in layer.stashable():
                stashes.setdefault(key, []).append(name)
    for key in sorted(pops, key=_order):
        matched = len(stashes.get(key, ()))
        yield from (("pop", key, name) for name in pops[key][matched:])
    for key in sorted(stashes, key=_order):
        matched = len(pops.get(key, ()))
        yield from (("stash", key, name) for name in stashes[key][matched:])


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every stashed name is popped exactly once by a later layer, and vice versa.

    Raises TypeError listing every problem: a pop without an earlier stash, a stash never
    popped, a name stashed again before its pop. Once popped, a name may be stashed again (a
    residual block repeated without a ``Namespace``). Skippable layers nested in containers
    count too, under their qualified names ("0.1"), in the order :func:`skip_events` gives:
    the run order of nested ``nn.Sequential`` containers; another module holding skippable
    layers is one unit whose own stashes and pops match each other in any order.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"verify_skippables takes an nn.Module (an nn.Sequential), got {module!r}")
    waiting: Dict[SkipKey, str] = {}  # stashed and not popped yet: by whom
    popped: Dict[SkipKey, str] = {}  # the last pop of each name, for the messages
    problems: List[str] = []
    for kind, key, layer_name in skip_events(module):
        if kind == "pop":
            if key in waiting:
                popped[key] = layer_name
                del waiting[key]
            elif key in popped:
                problems.append(f"layer {layer_name!r} pops {skip_name(key)}, already popped by layer "
                                f"{popped[key]!r} and not stashed again since")
            else:
                problems.append(f"layer {layer_name!r} pops {skip_name(key)}, which no earlier layer stashes")
        elif key in waiting:
            problems.append(f"layer {layer_name!r} stashes {skip_name(key)}, already stashed by layer "
                            f"{waiting[key]!r} and not popped since")
        else:
            waiting[key] = layer_name
    for key, layer_name in waiting.items():
        problems.append(f"layer {layer_name!r} stashes {skip_name(key)}, which no later layer pops")
    if problems:
        raise TypeError("skippable layers do not match:\n  " + "\n  ".join(problems) + "\n(isolate repeated blocks with Namespace)")
