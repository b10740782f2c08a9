"""The autograd hooks' helpers of offload_parameters(): marks in the graph that call back
when the backward pass reaches a module's outputs or inputs, and the modules' units."""
import torch

from memascend import errors


class OnBackward(torch.autograd.Function):
    """Identity on some tensors, calling `callback` when the backward pass reaches them:
    on a module's outputs, before the module's backward (its parameters are loaded); on
    its inputs, after it (they are dropped)."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


def wrap(obj, apply):
    """obj with its floating tensors that need a gradient passed through apply(tensors).

    No closures: a recursive nested function is a reference cycle (the function, its
    cell) holding what it closes over, here a module's inputs or outputs, which then
    outlive their use until Python's cyclic collector happens to run. Every module's
    activations were kept so past the backward pass that freed them (issue 43: 22 MiB
    left at the end of a step of the 27.4 M benchmark, more at its peak)."""
    found = []
    _collect(obj, found)
    if not found:
        return None
    out = apply(found)
    if not isinstance(out, tuple):
        out = (out,)
    return _rebuild(obj, {id(a): b for a, b in zip(found, out)})


def _collect(x, found):
    if isinstance(x, torch.Tensor):
        if x.requires_grad and x.is_floating_point():
            found.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _collect(y, found)
    elif isinstance(x, dict):
        for y in x.values():
            _collect(y, found)


def _rebuild(x, replacement):
    if isinstance(x, torch.Tensor):
        return replacement.get(id(x), x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_rebuild(y, replacement) for y in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_rebuild(y, replacement) for y in x)
    if isinstance(x, dict):
        for k in list(x.keys()):
            x[k] = _rebuild(x[k], replacement)
        return x
    return x


def in_backward():  # a backward pass runs on this thread (torch >= 2.0; else unknown)
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def outside_units(module, units):
    """ids of the modules reached from `module` without passing below a unit."""
    found, todo = set(), [module]
    while todo:
        m = todo.pop()
        if id(m) not in found:
            found.add(id(m))
            todo.extend(() if units and isinstance(m, units) else m.children())
    return found


# Modules that read their children's parameters without calling the children, whose own
# hooks would then never load them: units always. nn.MultiheadAttention reads
# out_proj.weight itself (F.multi_head_attention_forward), and nn.TransformerEncoderLayer's
# inference fast path reads every parameter of its attention and feed-forward.
READS_CHILDREN = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer)


def unit_types(units):
    """offload_parameters' `units` as a tuple of classes, READS_CHILDREN's included."""
    found = () if units is None else \
        tuple(units) if isinstance(units, (tuple, list)) else (units,)
    if not all(isinstance(u, type) and issubclass(u, torch.nn.Module) for u in found):
        raise errors.InvalidArgumentError(
            f"units must be torch.nn.Module classes (a class or a tuple of them), not {units!r}")
    return found + tuple(u for u in READS_CHILDREN if u not in found)
