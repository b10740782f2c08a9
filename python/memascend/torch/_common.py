"""What the modules of memascend.torch share: dtype names, host copies, the registry
of parameters offloaded by offload_parameters(), and the optimizers closed at exit."""
import atexit
import math
import os
import sys
import warnings
import weakref

import torch

from memascend import _core, errors

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DEFAULT_PART_ELEMENTS = 1 << 20


def dtype_name(dtype, what):
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise errors.InvalidArgumentError(
            f"{what} has dtype {dtype}; MemAscend keeps float32, float16 and bfloat16") from None


def choose_budget(least, most, on_host, cuda, given):
    """(bytes, reason, locked): the host budget, given or from the machine.

    memascend Note [default host budget]: a given budget is capped at `most` (refused past
    the memory limit or RLIMIT_MEMLOCK); without one, what the machine leaves beyond the
    process's other needs: on the CPU the parameters and gradients in torch (`on_host`
    bytes) and as much again for activations, and 256 MiB of heap. A given budget below
    `least` is refused here, before the volume is made."""
    if given and given < least:
        raise errors.InvalidArgumentError(
            f"host budget {given} bytes is below the least, {least} bytes: twice what one "
            "part needs at once (gradient, parameters, master weights and both moments of a "
            "part; the second set is room against fragmentation); raise host_budget or lower "
            "part_elements")
    choice = _core.choose_host_budget(least, most, 3 * on_host + (256 << 20), cuda=cuda,
                                      given=given or 0)
    if choice["warning"]:
        warnings.warn(choice["warning"], errors.MemlockWarning, stacklevel=3)
    return int(choice["bytes"]), choice["reason"], bool(choice["locked"])


def is_kept_dtype(dtype):
    return dtype in _DTYPE_NAMES


def host(t):
    """`t` as a contiguous CPU tensor (a copy only where needed)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


# id(parameter) -> (a weak reference to its ParameterOffload, index), while offloaded.
# Keyed by id (a tensor's == is elementwise, which a WeakKeyDictionary would call). Weak, so
# a model and optimizer dropped without close() are collected (a global's strong reference
# kept both, and the volume's lock, for the life of the process); an offload's entries go
# when it does (ParameterOffload's finalizer), while the parameters it holds still live.
OFFLOADED = {}


def offloaded(p):
    return id(p) in OFFLOADED


def offload_of(p):
    """(the ParameterOffload holding p, p's index there), or None."""
    entry = OFFLOADED.get(id(p))
    owner = entry[0]() if entry is not None else None
    return None if owner is None else (owner, entry[1])


# Open OffloadedAdamW instances, for the exit handler below.
OPEN = weakref.WeakSet()


def track(opt):
    """`opt` is open: closed at exit if still open then, by the process that made it only
    (a forked child's copy, at its exit or collected there, must not close it: it would
    commit into the parent's volume). The process is the instance's own: a collected
    cycle loses its weak references before its __del__ runs."""
    opt._pid = os.getpid()
    OPEN.add(opt)


def made_here(opt):
    return getattr(opt, "_pid", os.getpid()) == os.getpid()


def refuse_in_child(opt):
    """close() in a forked child: refused before anything (it would run the planned update
    and commit into the parent's volume, on threads the child does not have)."""
    if not made_here(opt):
        raise errors.FailedPreconditionError(
            f"this optimizer was made by process {opt._pid}, which this one was forked "
            "from: closed here it would write into that process's volume; close it there")


@atexit.register
def _close_at_exit():
    """A run that ends without close() (transformers' Trainer never calls it) still gets
    its last step's planned update (Note [optimizer overlap]) and commit: under
    offload_parameters a model and its optimizer hold each other, so no reference count
    reaching zero would close it, and the run resumed a step short. The model is not
    given back (its parameters loaded): the process is ending."""
    for opt in [opt for opt in list(OPEN) if made_here(opt)]:
        try:
            opt._offloads = []
            opt.close()
        except Exception as e:  # noqa: BLE001 - nobody to raise to; said on stderr
            print(f"memascend.torch: closing {opt.__class__.__name__} at exit failed: {e}",
                  file=sys.stderr)


def forget_offload(ref, ids):
    """A ParameterOffload's finalizer: its entries, unless another's took their place."""
    for k in ids:
        if OFFLOADED.get(k, (None,))[0] is ref:
            del OFFLOADED[k]


MAX_THREADS = 1024


def whole(name, value, lo, hi, optional=False):
    """`value` as an int in [lo, hi] (None passes when optional), or InvalidArgumentError
    saying what was wrong."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            as_int = int(value)
        except (TypeError, ValueError, OverflowError):
            as_int = None
        if as_int is None or as_int != value:
            raise errors.InvalidArgumentError(f"{name} must be a whole number, not {value!r}")
        value = as_int
    if not lo <= value <= hi:
        raise errors.InvalidArgumentError(f"{name} must be in {lo}..{hi}, not {value}")
    return value


def check_adamw(lr, betas, eps, weight_decay, amsgrad, maximize, resume, overwrite, staging):
    """OffloadedAdamW's arguments as torch.optim.AdamW checks them, and its own that exclude
    each other: InvalidArgumentError (UnimplementedError for what it does not do)."""
    if not lr >= 0.0:
        raise errors.InvalidArgumentError(f"invalid learning rate: {lr}")
    if not eps > 0.0:
        raise errors.InvalidArgumentError(f"invalid epsilon value: {eps}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise errors.InvalidArgumentError(f"invalid betas: {betas}")
    if not weight_decay >= 0.0:
        raise errors.InvalidArgumentError(f"invalid weight_decay value: {weight_decay}")
    if amsgrad or maximize:
        raise errors.UnimplementedError("OffloadedAdamW has no amsgrad or maximize")
    if resume and overwrite:
        raise errors.InvalidArgumentError("resume and overwrite exclude each other")
    if staging not in ("bounded", "step"):
        raise errors.InvalidArgumentError(f"staging must be 'bounded' or 'step', not {staging!r}")


def check_groups(groups, betas_eps, what):
    """One betas and eps for every group, those the optimizer was made with (its kernels
    take them once: a scheduler's change, OneCycleLR's cycle_momentum, would go unused), and
    no amsgrad or maximize: InvalidArgumentError (UnimplementedError) naming the group."""
    betas, eps = betas_eps
    for gi, g in enumerate(groups):
        if tuple(g.get("betas", betas)) != tuple(betas) or g.get("eps", eps) != eps:
            raise errors.InvalidArgumentError(
                f"parameter group {gi} {what} betas {tuple(g.get('betas', betas))} and eps "
                f"{g.get('eps', eps)}; OffloadedAdamW takes one betas and eps for every group, "
                f"{tuple(betas)} and {eps} here (lr and weight_decay may change; with "
                "OneCycleLR pass cycle_momentum=False), or make a new optimizer with them")
        if g.get("amsgrad") or g.get("maximize"):
            raise errors.UnimplementedError("OffloadedAdamW has no amsgrad or maximize")


def check_parameters(opt):
    """Each parameter still of the optimizer's dtype, device and shape (model.to(dtype)
    keeps the Parameter objects, and a step would write the old dtype's bytes into the new
    data): FailedPreconditionError naming it."""
    for i, p in enumerate(opt._params):
        if p.dtype != opt._dtype or p.device != opt._device or (
                tuple(p.shape) != opt._shapes[i] and not offloaded(p)):
            raise errors.FailedPreconditionError(
                f"parameter {i} is now {p.dtype} {tuple(p.shape)} on {p.device}; its state "
                f"is {opt._dtype} {opt._shapes[i]} on {opt._device} (the model was cast, "
                "moved or given new data after the optimizer was made): change it back, or "
                "make a new optimizer")


def refuse_frozen(params, at_construction):
    """Parameters that do not require grad: torch.optim.AdamW leaves them, OffloadedAdamW
    would move them by weight decay; refused, at construction or at step()."""
    frozen = [i for i, p in enumerate(params) if not p.requires_grad]
    if not frozen:
        return
    shown = f"{frozen[:8]}{' ...' if len(frozen) > 8 else ''}"
    if at_construction:
        raise errors.InvalidArgumentError(
            f"parameters {shown} do not require grad: OffloadedAdamW would move them by weight "
            "decay where torch.optim.AdamW leaves them; pass only the trainable ones "
            "([p for p in model.parameters() if p.requires_grad])")
    raise errors.FailedPreconditionError(
        f"parameters {shown} stopped requiring grad after the optimizer was made: OffloadedAdamW "
        "updates every parameter it holds; make a new optimizer over the trainable ones")


def dense_grad(p, i, shape, dtype):
    """Parameter i's gradient, checked (dense, its size); zeros where it has none."""
    g = p.grad
    if g is None:
        return torch.zeros(shape, dtype=dtype)
    if g.is_sparse:
        raise errors.InvalidArgumentError(
            f"parameter {i} (shape {list(shape)}) has a sparse gradient; "
            "OffloadedAdamW takes dense gradients, as torch.optim.AdamW")
    numel = math.prod(shape)
    if g.numel() != numel:
        raise errors.InvalidArgumentError(
            f"parameter {i}'s gradient has {g.numel()} elements, not {numel}")
    return g
