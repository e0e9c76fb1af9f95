"""What the per-call checks read from modules, without nn.Module's slow paths.

Before every call a pipeline walks its layers (has one changed?), lists its parameters
(``Pipe.step``'s leaves) and reads optional attributes (a layer's ``inplace`` flag, the
wrappers ``torch.compile`` puts around a loss). ``modules()`` and ``parameters()`` build a
qualified name for every module they pass; ``getattr(module, name, default)`` on an
``nn.Module`` that lacks ``name`` raises an AttributeError inside ``nn.Module.__getattr__`` and
catches it, about a microsecond each. These read the same things without either.
"""
from __future__ import annotations

from typing import Any, List, Tuple

from torch import nn

__all__ = ["modules_in_order", "optional_attribute", "parameters_in_order"]

_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")
"""Where ``nn.Module.__getattr__`` looks for a name the instance and its class lack."""


def optional_attribute(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)``, the same value, without raising and catching an
    AttributeError when ``obj`` is an ``nn.Module`` that has no ``name``.

    Only a module that looks attributes up as ``nn.Module`` does (no ``__getattribute__`` or
    ``__getattr__`` of its own) and whose class holds no ``name`` anywhere in its MRO (no
    attribute, property or other descriptor) is read from its instance dict and slots; any
    other object, or name, goes through ``getattr`` itself."""
    kind = type(obj)
    if (not issubclass(kind, nn.Module) or kind.__getattribute__ is not object.__getattribute__
            or kind.__getattr__ is not nn.Module.__getattr__ or _class_holds(kind, name)):
        return getattr(obj, name, default)
    found = obj.__dict__
    if name in found:
        return found[name]
    for slot in _MODULE_SLOTS:
        if name in found.get(slot, ()):
            return getattr(obj, name, default)
    return default


def _class_holds(kind: type, name: str) -> bool:
    """Whether ``name`` is in the dict of ``kind`` or a class it inherits from (read
    statically: a descriptor that raises when read on the class still counts)."""
    for klass in kind.__mro__:
        if name in klass.__dict__:
            return True
    return False


def modules_in_order(root: nn.Module) -> Tuple[nn.Module, ...]:
    """The modules under ``root`` as ``tuple(root.modules())`` lists them (depth first, each once,
    None children skipped), read before every step without the qualified names ``named_modules``
    builds for each. It follows what ``_modules`` holds, the modules that run, and tells them
    apart by identity: a module that overrides ``named_modules``, or ``__eq__``/``__hash__`` so
    that two distinct ones compare equal, does not hide modules from it as it would from
    ``modules()``."""
    found = [root]
    children = root._modules
    if not children:
        return (root,)
    seen = {id(root)}
    pending = [child for child in reversed(children.values()) if child is not None]
    while pending:
        module = pending.pop()
        key = id(module)
        if key in seen:
            continue
        seen.add(key)
        found.append(module)
        children = module._modules
        if children:
            pending.extend([child for child in reversed(children.values()) if child is not None])
    return tuple(found)


def parameters_in_order(root: nn.Module) -> List[nn.Parameter]:
    """The parameters ``list(root.parameters())`` lists, each once, in the order of
    :func:`modules_in_order`: read from each module's ``_parameters`` and told apart by
    identity, so a module that overrides ``parameters``/``named_parameters`` (or what
    :func:`modules_in_order` names) does not hide the parameters it holds."""
    seen = set()
    found = []
    for module in modules_in_order(root):
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                found.append(parameter)
    return found
