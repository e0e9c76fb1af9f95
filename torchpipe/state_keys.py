"""State-dict keys of other pipelines: torchgpipe's and fairscale's load as they are, the retired torch ``Pipe``'s converted.

torchgpipe and fairscale keep each layer under ``partitions.<i>.<name>``, with the model's
own child name, so a ``Pipe`` loads their state dicts as they are. The retired torch ``Pipe``
(torch 1.8 to 2.3) renumbered the layers from 0 inside each partition, after flattening
children that are themselves ``nn.Sequential``: its keys read ``partitions.<i>.<j>.weight``,
where ``j`` says nothing about the layer without the partition sizes. Mapping such keys by
name would load one layer's weights into another, so ``Pipe.load_state_dict`` refuses them
(:func:`check_not_renumbered`) and :func:`retired_pipe_state_dict` converts them, given the
partition sizes the retired ``Pipe`` had.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Sequence

from torch import nn

from .partition import verify_balance

__all__ = ["retired_pipe_state_dict", "check_not_renumbered"]

_KEY = re.compile(r"partitions\.(\d+)\.([^.]+)\.(.+)")

_HOW_TO_CONVERT = (
    "PyTorch's retired Pipe saved its layers that way (numbered from 0 inside each partition); convert it "
    "with torchpipe.retired.retired_pipe_state_dict(state_dict, model, balance), where balance is the "
    "number of the model's children in each of that Pipe's partitions (on CPU it made one partition per "
    "child: [1] * len(model); on GPUs, one per run of children on the same device)"
)


def check_not_renumbered(state_dict: Mapping[str, Any], prefix: str, children: Mapping[str, Any]) -> None:
    """ValueError if ``partitions.<i>.<name>`` keys cannot be torchgpipe's (one name, one partition, in order).

    torchgpipe and fairscale put every child in exactly one partition, in the model's
    order. A name found in two partitions, or partitions whose names run backwards in the
    model, means the layers were renumbered per partition: the retired torch ``Pipe``'s
    layout, which loaded by name would put weights into the wrong layers. So does a key
    that reaches into a child ``nn.Sequential`` by none of its children's names: the retired
    ``Pipe`` flattened such children, also in a single partition, where the numbering
    otherwise looks like torchgpipe's.
    """
    position = {name: index for index, name in enumerate(children)}
    partition_of: Dict[str, int] = {}
    span: Dict[int, List[int]] = {}
    for key in state_dict:
        if not key.startswith(prefix):
            continue
        match = _KEY.fullmatch(key, len(prefix))
        if match is None:
            continue
        partition, name = int(match.group(1)), match.group(2)
        child = children.get(name)
        below = match.group(3).split(".", 1)[0]
        if isinstance(child, nn.Sequential) and below not in child._modules and below not in child._parameters \
                and below not in child._buffers:
            raise ValueError(
                f"state dict key {key!r} names {match.group(3)!r} inside layer {name!r}, an nn.Sequential without "
                f"such a child; expected the model's own names below each layer (torchgpipe's and fairscale's "
                f"layout), not layers flattened and renumbered. {_HOW_TO_CONVERT}"
            )
        seen = partition_of.setdefault(name, partition)
        if seen != partition:
            raise ValueError(
                f"state dict key {key!r}: layer {name!r} also appears under {prefix}partitions.{seen}; "
                f"expected each layer in one partition (torchgpipe's and fairscale's layout). {_HOW_TO_CONVERT}"
            )
        if name in position:
            span.setdefault(partition, []).append(position[name])
    ordered = sorted(span.items())
    for (before, earlier), (after, later) in zip(ordered, ordered[1:]):
        if max(earlier) >= min(later):
            raise ValueError(
                f"state dict keys under {prefix}partitions.{after} name layers that come before those of "
                f"{prefix}partitions.{before} in the model; expected the partitions in the model's order "
                f"(torchgpipe's and fairscale's layout). {_HOW_TO_CONVERT}"
            )


def _flattened_names(module: nn.Sequential, start: int, size: int) -> List[str]:
    """The key prefixes of the retired ``Pipe``'s layers ``0..`` in one partition.

    It flattened a child that is an ``nn.Sequential`` into that child's own children.
    """
    children = list(module.named_children())[start:start + size]
    names: List[str] = []
    for name, child in children:
        if isinstance(child, nn.Sequential):
            names.extend(f"{name}.{grandchild}" for grandchild, _ in child.named_children())
        else:
            names.append(name)
    return names


def retired_pipe_state_dict(state_dict: Mapping[str, Any], model: nn.Module,
                            balance: Sequence[int], prefix: str = "") -> Dict[str, Any]:
    """A state dict of the retired torch ``Pipe``, keyed by ``model``'s own names.

    ``model`` is the ``nn.Sequential`` (or a ``Pipe`` of it) the retired ``Pipe`` wrapped,
    and ``balance`` the number of its children in each of that ``Pipe``'s partitions. The
    result loads into a ``Pipe`` of any balance and into the plain model. Keys outside
    ``partitions`` are kept; a key that names a partition or a layer that ``balance`` does
    not have is refused (ValueError), so nothing is dropped silently.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of key to tensor (what torch.load gives), got "
                        f"{type(state_dict).__name__}: {state_dict!r:.80}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the nn.Sequential the retired Pipe wrapped (or a Pipe of it), got "
                        f"{type(model).__name__}: {model!r:.80}")
    names = [name for name, _ in model.named_children()]
    sizes = verify_balance(balance, len(names))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    layers = [_flattened_names(model, start, size) for start, size in zip(starts, sizes)]  # type: ignore[arg-type]
    converted: Dict[str, Any] = {}
    for key, value in state_dict.items():
        match = _KEY.fullmatch(key, len(prefix)) if key.startswith(prefix) else None
        if match is None:
            converted[key] = value
            continue
        partition, index = int(match.group(1)), match.group(2)
        if partition >= len(layers) or not index.isdigit() or int(index) >= len(layers[partition]):
            raise ValueError(
                f"state dict key {key!r}: expected partitions.<i>.<j> with i < {len(layers)} and j below "
                f"partition i's layer count, {[len(part) for part in layers]} under balance {list(sizes)} "
                f"(nn.Sequential children count their own children); is balance the retired Pipe's?"
            )
        converted[f"{prefix}{layers[partition][int(index)]}.{match.group(3)}"] = value
    return converted
