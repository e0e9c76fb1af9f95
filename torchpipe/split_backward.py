"""Split one stage's backward into its input-gradient half (``I``) and weight-gradient half (``W``).

Zero-bubble schedules run ``I`` early (the previous stage waits for it) and ``W`` late (to
fill bubbles). Running ``autograd.backward(..., inputs=parameters)`` for ``W`` would walk
the whole stage graph a second time. Instead, before ``I`` runs, the stage graph is searched
for its *frontier*: the nodes on the path to the stage inputs that also feed a parameter
through a branch of their own (a Linear's ``AddmmBackward`` feeds the bias and, through
``TBackward``, the weight). A hook on each frontier node keeps the gradient that reaches it
during ``I``, while autograd computes nothing for the parameters (it skips outputs that no
requested input needs). ``W`` then starts from those kept gradients and runs only the
parameter branches: per frontier node, once to get the gradients entering its parameter
branches, then once more through the branches into ``.grad``.

"Parameter" here means every leaf of the stage graph other than the stage inputs: a target
or a plain tensor attribute that requires grad gets its ``.grad`` as in the plain backward.

Two cases fall back to the stage's whole backward into those leaves (``whole``), which is
correct but walks the input path a second time:

* a parameter branch reachable from another one (a weight transformed once and used twice,
  ``w.exp()`` feeding two matmuls, or a tied weight used directly and through ``F.linear``):
  the per-node gradient of the upper node would also include the path through the lower
  node, counting it twice;
* a checkpointed micro-batch of a stage with more than two frontier nodes: torch's
  checkpoint recomputes the forward once per backward call, so ``W`` would recompute the
  stage once per frontier node; walking the input path again costs less than that.

A stage whose input path holds a region that cannot keep its graph (a compiled backward
that donates its buffers) or hides its parameters from the graph (a reentrant
``torch.utils.checkpoint``) runs its whole backward in ``I``, and ``W`` has nothing to do.

The backward of an ``autograd.Function`` (a user's, a compiled region's, the one that calls
module backward hooks) must run once per micro-batch: it may do more than return gradients
(accumulate into ``weight.main_grad``, call the hooks), and it computes every gradient its
forward said it needs whatever the engine asks for. As a frontier node it runs in ``I`` only:
a hook after it keeps what it sent into its parameter branches, and ``W`` starts those
branches from there without calling it again. Where the input path holds one and the split
falls back to the whole backward above, that fallback runs in ``I`` instead, once, and leaves
``W`` nothing to do.

A built-in frontier node runs a second time in ``W``, through the engine, which applies the
tensor hooks on its inputs again; a pre-hook hands the node what reached it in ``I`` instead,
and its parameter branches get what it sends itself (not what reaches them, which their own
hooks would change before ``W`` starts them): each hook's change counts once (see
``_side_grads``).

A parameter whose ``AccumulateGrad`` node is a branch's first node (a bias, a conv weight)
would have its tensor hooks (``p.register_hook``) called where the engine captures that
branch's gradient and again when ``W`` accumulates it; for the stage's own parameters they are
muted during the capture (`_muted_parameter_hooks`), so they run once. A leaf that is no
parameter of the stage (a tensor several stages use) may be accumulated by another worker
meanwhile: its hooks are not muted, and run twice. Accumulating without the engine would skip
the node's own hooks, on which gradient reduction and optimizer-in-backward code rely.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from . import engine

__all__ = ["WeightSplit"]

# Split W recomputes a checkpointed stage once per frontier node; whole W recomputes it once
# and redoes the input-path backward (about one more forward's work). Above this many
# frontier nodes, whole is cheaper.
MAX_SPLIT_RECOMPUTES = 2

Node = Any  # torch.autograd.graph.Node
Edge = Tuple[Node, int]


def _accumulator_type() -> type:
    with torch.inference_mode(False), torch.enable_grad():  # importable under no_grad too
        leaf = torch.zeros(1, requires_grad=True)
        return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulator_type()  # a leaf's node: compared by type, per node of every walk

# What a node leads to, as bits: a stage input (a leaf the caller named), a parameter (any
# other leaf that needs a gradient), or both.
_TO_INPUT = 1
_TO_WEIGHT = 2


def _is_accumulator(node: Node) -> bool:
    return type(node) is _ACCUMULATE_GRAD


def _reach(roots: Sequence[Node], leaf_ids: Set[int]) -> Dict[Node, int]:
    """Per node under ``roots``: the leaves it leads to (``_TO_INPUT`` and/or ``_TO_WEIGHT`` bits).

    One walk of the whole graph, iterative (deep stage graphs must not hit Python's recursion
    limit), in post-order: a node's bits are its children's, joined once they are all known.
    ``I`` makes one per micro-batch, so it is written for few Python calls.
    """
    reach: Dict[Node, int] = {}
    stack: List[Tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            bits = 0
            for child, _ in node.next_functions:
                if child is not None:
                    bits |= reach[child]
            reach[node] = bits
        elif node not in reach:
            if type(node) is _ACCUMULATE_GRAD:
                reach[node] = _TO_INPUT if id(node.variable) in leaf_ids else _TO_WEIGHT
                continue
            reach[node] = 0  # provisional until expanded (an autograd graph has no cycles)
            stack.append((node, True))
            for child, _ in node.next_functions:
                if child is not None and child not in reach:
                    stack.append((child, False))
    return reach


def _donates_buffers(node: Node) -> bool:
    """Whether ``node`` is a backward compiled by ``torch.compile`` that donates its buffers.

    Such a backward refuses ``retain_graph=True`` (torch compiles a region's backward that way
    once it has run one backward). Read from torch's private metadata; where it is missing,
    ``WeightSplit.input_grads`` still catches the refusal.
    """
    if type(node).__name__ != "CompiledFunctionBackward":
        return False
    metadata = getattr(getattr(node, "_forward_cls", None), "metadata", None)
    return bool(getattr(metadata, "bw_donated_idxs", None))


def _is_reentrant_checkpoint(node: Node) -> bool:
    """Whether ``node`` is a reentrant checkpoint (``torch.utils.checkpoint(use_reentrant=True)``,
    and the like-named functions of other libraries).

    Its backward recomputes the region and runs a backward of its own into the region's
    parameters, which its graph does not show; torch's refuses to run under ``inputs=`` or
    ``autograd.grad``, which is how ``I`` stops short of the parameters. So a stage holding
    one on its input path takes its whole backward in ``I``."""
    return type(node).__name__ == "CheckpointFunctionBackward"


# The type names of the nodes the two checks above look at (the checks read only these).
_HOLDS_REGION = frozenset({"CompiledFunctionBackward", "CheckpointFunctionBackward"})

# torch's words when a reentrant checkpoint runs under ``inputs=`` (a backstop for a node
# _is_reentrant_checkpoint does not know by name).
_REENTRANT_REFUSAL = "use_reentrant=True"


# The nodes that must run once per micro-batch: the backward of an ``autograd.Function`` (a
# user's, a compiled region's, the one that calls an ``nn.Module``'s full backward hooks).
# Such a backward computes every input gradient its forward said it needs, whatever the engine
# asks for, and may do more than return them: accumulate into ``weight.main_grad`` (Megatron's
# fused weight-gradient accumulation), call module hooks, count. So its gradients for the
# parameter branches are kept when ``I`` runs it, not asked of it again in ``W``. Tested with
# ``isinstance`` inline: ``I`` and ``W`` test every frontier node, per micro-batch.
_RUNS_ONCE = BackwardCFunction


def _below(roots: Sequence[Node]) -> Set[Node]:
    """Every node reachable from ``roots``, the roots included."""
    seen: Set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return seen


def _summed(sent: Tuple[Optional[Tensor], ...], outputs: List[int]) -> Optional[Tensor]:
    """What a node sends into one edge: the sum over its outputs that feed it (``torch.addcmul(x,
    w, w)`` feeds ``w`` twice), as the engine sums them; None if none was computed."""
    total = None
    for i in outputs:
        grad = sent[i]
        if grad is not None:
            total = grad if total is None else total + grad
    return total


def _stand_in_hook(grad: Tensor) -> None:
    """Takes a muted hook's place during ``W``'s capture (see `_muted_parameter_hooks`)."""


def _muted_parameter_hooks(side: List[Edge], owned: FrozenSet[int]) -> List[Tuple[Dict[Any, Any], Any, Any]]:
    """Replace the tensor hooks of the stage's own parameters whose accumulators start a branch
    in ``side`` by `_stand_in_hook`, under the same keys; returns (dict, key, hook) for
    `_restore_hooks`. Only parameters of this stage (``owned``): no other worker reads their
    hooks meanwhile, where a leaf several stages use may be accumulated by another one now."""
    muted = []
    for child, _ in side:
        if type(child) is _ACCUMULATE_GRAD and id(child.variable) in owned:
            hooks = child.variable._backward_hooks
            if hooks:
                for key, hook in list(hooks.items()):
                    muted.append((hooks, key, hook))
                    hooks[key] = _stand_in_hook
    return muted


def _restore_hooks(muted: List[Tuple[Dict[Any, Any], Any, Any]]) -> None:
    """Put each muted hook back where its stand-in still is (not one removed meanwhile)."""
    for hooks, key, hook in muted:
        if hooks.get(key) is _stand_in_hook:
            hooks[key] = hook


class WeightSplit:
    """The plan of one stage's split backward for one micro-batch; see the module docstring."""

    def __init__(self, outputs: Sequence[Tensor], leaves: Sequence[Tensor], *, checkpointed: bool = False,
                 owned: FrozenSet[int] = frozenset()) -> None:
        """``owned``: ids of the stage's own parameters, which no other stage uses (see `_muted_parameter_hooks`)."""
        self.owned = owned
        leaf_ids = {id(t) for t in leaves}
        self.leaf_ids = leaf_ids
        reach = _reach([o.grad_fn for o in outputs if o.grad_fn is not None], leaf_ids)
        self.frontier: Dict[Node, List[Edge]] = {}
        # Per frontier node and side edge: the node's outputs that feed the edge (see _summed).
        self.side_outputs: Dict[Node, List[List[int]]] = {}
        # Outputs whose graph never reaches the stage inputs: W back-propagates them whole.
        self.detached_outputs: List[int] = []
        seen: Set[Node] = set()
        stack: List[Node] = []
        for index, output in enumerate(outputs):
            grad_fn = output.grad_fn
            if grad_fn is None or not reach[grad_fn] & _TO_INPUT:
                self.detached_outputs.append(index)
            elif grad_fn not in seen:
                seen.add(grad_fn)
                stack.append(grad_fn)
        donating = runs_once = False
        while stack:  # the input path: nodes that lead to a stage input
            node = stack.pop()
            if not donating and type(node).__name__ in _HOLDS_REGION:
                donating = _donates_buffers(node) or _is_reentrant_checkpoint(node)
            runs_once = runs_once or isinstance(node, _RUNS_ONCE)
            side: Dict[Edge, List[int]] = {}
            for output, edge in enumerate(node.next_functions):
                child = edge[0]
                if child is None:
                    continue
                bits = reach[child]
                if bits & _TO_INPUT:
                    if child not in seen and type(child) is not _ACCUMULATE_GRAD:
                        seen.add(child)
                        stack.append(child)
                elif bits:
                    side.setdefault(edge, []).append(output)
            if side:
                self.frontier[node] = list(side)
                self.side_outputs[node] = list(side.values())
        self.whole = (checkpointed and len(self.frontier) > MAX_SPLIT_RECOMPUTES) or self._branches_meet()
        if self.whole:
            self.frontier = {}
        self.kept: Dict[Node, Tuple[Optional[Tensor], ...]] = {}
        # What each frontier node that runs once (_RUNS_ONCE) sent into its parameter
        # branches when I ran it.
        self.sent: Dict[Node, Tuple[Optional[Tensor], ...]] = {}
        # See input_grads: a region on the input path that cannot keep its graph or that
        # hides its parameters (a reentrant checkpoint), or a node that must run once, which a
        # whole backward in W would run a second time.
        self.whole_in_input = donating or (self.whole and runs_once)
        self.done_in_input = False
        if self.whole_in_input:
            self.frontier = {}
        self._hooks = []
        for node in self.frontier:
            self._hooks.append(node.register_hook(self._sender(node)) if isinstance(node, _RUNS_ONCE)
                               else node.register_prehook(self._keeper(node)))

    def _branches_meet(self) -> bool:
        """Whether one parameter branch feeds another (see the module docstring)."""
        owners: Dict[Node, Node] = {}  # per branch start: the frontier node that feeds it
        for node, side in self.frontier.items():
            for child, _ in side:
                if owners.setdefault(child, node) is not node:
                    return True  # two frontier nodes feed one branch
        # A branch start below another start's children is reached from that branch (autograd
        # graphs have no cycles, so a start is never below itself): one walk for all of them.
        grandchildren = []
        for start in owners:
            for grand, _ in start.next_functions:
                if grand is not None:
                    grandchildren.append(grand)
        return not _below(grandchildren).isdisjoint(owners)

    def _keeper(self, node: Node) -> Any:
        def keep(grad_outputs: Tuple[Optional[Tensor], ...]) -> None:
            self.kept[node] = grad_outputs

        return keep

    def _sender(self, node: Node) -> Any:
        outputs = self.side_outputs[node]

        def record(grad_inputs: Tuple[Optional[Tensor], ...], grad_outputs: Tuple[Any, ...]) -> None:
            self.sent[node] = tuple(_summed(grad_inputs, feeding) for feeding in outputs)

        return record

    def input_grads(self, outputs: Sequence[Tensor], grad_outputs: Sequence[Tensor], leaves: Sequence[Tensor]) -> List[Optional[Tensor]]:
        """``I``: gradients for ``leaves``; the graph is kept and the frontier's gradients too.

        A region compiled with ``torch.compile`` whose backward donates its buffers refuses to
        keep its graph (once it has run a backward anywhere, torch compiles it that way). Then
        the whole backward runs here, into ``.grad`` too, and ``W`` has nothing left to do:
        correct, without the split's overlap for this micro-batch. Such a region is found
        before anything runs (``_donates_buffers``); if torch's metadata did not tell, the
        refusal is caught, and the nodes after the region, which ran once already, run again
        (their backward hooks too).
        """
        if not self.whole_in_input:
            try:
                # Into the leaves' ``.grad`` (they are the step's own, fresh per micro-batch),
                # not ``engine.grad``: under ``autograd.grad`` torch refuses a multi-grad hook
                # on a leaf (``FlopCounterMode``'s module tracker puts one on every module input).
                engine.backward(outputs, grad_outputs, inputs=leaves, retain_graph=True)
                grads = [leaf.grad for leaf in leaves]
                for leaf in leaves:
                    leaf.grad = None
                return grads
            except RuntimeError as exc:
                if "donated buffers" not in str(exc) and _REENTRANT_REFUSAL not in str(exc):
                    raise
                for leaf in leaves:  # fresh per micro-batch: nothing of theirs to keep
                    leaf.grad = None
            finally:
                for hook in self._hooks:
                    hook.remove()
                self._hooks = []
        self.done_in_input = True
        self._clear()
        engine.backward(outputs, grad_outputs)  # the stage's own input leaves get .grad as well
        return [leaf.grad for leaf in leaves]

    def weight_grads(self, outputs: Sequence[Tensor], grad_outputs: Sequence[Optional[Tensor]]) -> None:
        """``W``: accumulate the parameters' gradients into ``.grad``, from what ``I`` kept.

        All parameter branches go through the engine in one call: the branches of different
        frontier nodes may meet further down, and a node they share must get the sum of their
        gradients before it runs, once.
        """
        if self.done_in_input:
            return
        if self.whole:
            self._whole_weight_grads(outputs, grad_outputs)
            return
        entering: Dict[Edge, Tensor] = {}  # per branch start: the gradient that enters it
        for node, side in self.frontier.items():
            if isinstance(node, _RUNS_ONCE):
                side_grads = self.sent.get(node)  # None: I did not run it (its outputs were unused)
            else:
                kept = self.kept.get(node)
                side_grads = None if kept is None else self._side_grads(node, kept, side, self.side_outputs[node])
            if side_grads is None:
                continue
            for edge, grad in zip(side, side_grads):
                if grad is not None:
                    entering[edge] = grad if edge not in entering else entering[edge] + grad
        sources: List[Any] = [GradientEdge(child, slot) for child, slot in entering]
        source_grads: List[Tensor] = list(entering.values())
        for i in self.detached_outputs:
            grad = grad_outputs[i]
            if grad is not None:
                sources.append(outputs[i])
                source_grads.append(grad)
        if sources:  # branches and detached outputs reach no stage input: no need to name inputs
            engine.backward(sources, source_grads)
        self._clear()

    def _clear(self) -> None:
        self.kept.clear()
        self.sent.clear()

    def _side_grads(self, node: Node, kept: Tuple[Optional[Tensor], ...], side: List[Edge],
                    outputs: List[List[int]]) -> Tuple[Optional[Tensor], ...]:
        """The gradients ``node`` sends into its parameter branches ``side``.

        ``node`` runs again here, from the gradients it received in ``I``, and autograd calls
        the tensor hooks on its inputs again (those of ``h.register_hook`` for the tensor
        ``h`` it made), then those of each branch's first node when it stops there. A hook
        that returns a new gradient would so count twice (torch 2.13's zero-bubble
        ``stage_backward_weight`` does so for a hook on a ``Linear``'s output). So a pre-hook,
        which runs after the tensor hooks, gives the node back what it received in ``I``; and
        each branch gets what the node sent (a post-hook records it), not what reached the
        branch: ``W`` applies the branch's own hooks when it starts it. The node's own hooks
        run as in any backward, under checkpointing within the one recompute of this call.
        """
        fed_at, fed = [], []
        for i, grad in enumerate(kept):
            if grad is not None:
                fed_at.append(i)
                fed.append(grad)
        if not fed:
            return (None,) * len(side)
        ran: List[Tuple[Optional[Tensor], ...]] = []
        # The engine captures each branch's gradient where the branch starts, and calls the
        # tensor hooks there first: a parameter's own (``p.register_hook``: a bias's, whose
        # accumulator starts its branch) would run here and again when W starts the branch.
        # The engine reads them from ``p._backward_hooks`` when it calls them: stand-ins there
        # during the capture, they run once. (Ending the call early instead, by a raise, would
        # skip the call's engine callbacks, which free a checkpoint's recompute.)

        def as_in_input(grads: Tuple[Optional[Tensor], ...]) -> Tuple[Optional[Tensor], ...]:
            return kept

        def record(grad_inputs: Tuple[Optional[Tensor], ...], grad_outputs: Tuple[Any, ...]) -> None:
            ran.append(grad_inputs)

        muted: List[Tuple[Dict[Any, Any], Any, Any]] = []
        handles = []
        try:
            for child, _ in side:  # inline: W runs this per frontier node and micro-batch
                if type(child) is _ACCUMULATE_GRAD and child.variable._backward_hooks:
                    muted = _muted_parameter_hooks(side, self.owned)
                    break
            handles = [node.register_prehook(as_in_input), node.register_hook(record)]
            engine.grad([GradientEdge(node, i) for i in fed_at], [GradientEdge(child, slot) for child, slot in side],
                        fed, retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()
            _restore_hooks(muted)
        sent = ran[0]
        return tuple(_summed(sent, feeding) for feeding in outputs)

    def _whole_weight_grads(self, outputs: Sequence[Tensor], grad_outputs: Sequence[Optional[Tensor]]) -> None:
        """The stage's whole backward into its parameters (it walks the input path again)."""
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
        if pairs:
            weights = self._weights([o for o, _ in pairs])
            if weights:
                engine.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=weights)

    def _weights(self, outputs: Sequence[Tensor]) -> List[Tensor]:
        """Every leaf under ``outputs`` that needs a gradient, except the stage inputs; an output
        that is such a leaf itself too (a parameter handed on, in the output or as a skip)."""
        roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
        found = {id(node.variable): node.variable for node in _below(roots) if _is_accumulator(node)}
        for output in outputs:
            if output.grad_fn is None and output.requires_grad:
                found.setdefault(id(output), output)
        return [leaf for key, leaf in found.items() if key not in self.leaf_ids]
