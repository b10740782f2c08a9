"""model.state_dict() and model.load_state_dict() under offload_parameters: an offloaded
parameter holds an empty tensor between uses, so its entries go to and come from the
optimizer's state instead. Each module with offloaded parameters of its own gets both
hooks (ParameterOffload registers them), so a submodule's state_dict, a module reached
by two paths, and a load at any level of the model each see the real values."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from memascend import errors
from memascend.torch._common import host, offload_of

if TYPE_CHECKING:
    from memascend.torch.parameters import ParameterOffload


def _mine(offload: ParameterOffload, p) -> int | None:
    """p's index in offload's optimizer, if offload holds it."""
    entry = offload_of(p)
    return entry[1] if entry is not None and entry[0] is offload else None


def fill(offload: ParameterOffload, module: torch.nn.Module, state_dict, prefix: str):
    """module.state_dict()'s hook: the entries of `module`'s own offloaded parameters
    hold their values (CPU copies), not the empty tensors they hold between uses."""
    opt = offload._opt
    if opt._core is None:
        return state_dict
    for name, p in module._parameters.items():
        i = _mine(offload, p)
        if i is None or prefix + name not in state_dict:
            continue
        opt._finish_update()  # one step's parameters, all of them
        h = torch.empty(opt._shapes[i], dtype=opt._dtype)  # a copy: one in use is a view
        opt._core.load_parameters(i, h.data_ptr(), h.numel(), opt._dt)
        state_dict[prefix + name] = h
    return state_dict


def load(offload: ParameterOffload, module: torch.nn.Module, state_dict, prefix: str,
         error_msgs: list) -> None:
    """module.load_state_dict()'s pre-hook: the entries of the offloaded parameters at and
    below `module` become their master weights and 16-bit parameters in the optimizer's
    state, committed at its step in one commit (the moments stay, as after a
    model.load_state_dict() under torch.optim.AdamW). Each entry is then the parameter
    itself, so torch's copy does nothing and the hooks of the modules below find nothing
    left to load. An entry of the wrong shape (or not a real tensor) is an error torch
    raises once it has loaded the rest, and then none of these entries is written."""
    found = []  # (parameter index, key, value): a tied parameter's keys in torch's order
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, p in sub._parameters.items():
            i, key = _mine(offload, p), f"{prefix}{path}.{name}" if path else prefix + name
            if i is not None and key in state_dict and state_dict[key] is not p:
                found.append((i, key, state_dict[key]))
                state_dict[key] = p
    if not found:
        return
    opt = offload._opt
    opt._check()
    busy = [key for i, key, _ in found if offload._count.get(i, 0) > 0]
    if busy:
        raise errors.FailedPreconditionError(
            f"load_state_dict while {busy[0]} is in use (inside a forward or backward pass "
            "of the model); nothing was loaded")
    bad = []
    for n, (i, key, v) in enumerate(found):
        shape = tuple(opt._shapes[i])
        if isinstance(v, torch.Tensor) and shape == () and tuple(v.shape) == (1,):
            v = v[0]  # a scalar saved as one element (torch's rule for old checkpoints)
            found[n] = (i, key, v)
        if not isinstance(v, torch.Tensor) or v.is_complex():
            bad.append(f'while copying the parameter named "{key}", expected a real '
                       f"tensor from the checkpoint but received {type(v).__name__}"
                       f"{'' if not isinstance(v, torch.Tensor) else ' ' + str(v.dtype)}")
        elif tuple(v.shape) != shape:
            bad.append(f"size mismatch for {key}: copying a param with shape "
                       f"{torch.Size(v.shape)} from checkpoint, the shape in current "
                       f"model is {torch.Size(shape)} (offloaded by memascend)")
    if bad:
        error_msgs.extend(bad)  # torch raises them once it has loaded the rest
        return  # and none of these entries is written
    last = {i: v for i, _, v in found}  # a tied parameter's last key wins, as in torch
    opt._finish_update()  # a planned update would write over what is loaded
    with torch.no_grad():
        for i, v in sorted(last.items()):
            h = host(v.detach().to(torch.float32))
            opt._core.write_state("master", i, h.data_ptr(), h.numel(), "float32")
            opt._core.write_state("param", i, h.data_ptr(), h.numel(), "float32")
            if opt._cuda is not None:
                opt._cuda.params.invalidate(i)  # its device copy is of the old values
            offload._loads[i] = offload._loads.get(i, 0) + 1  # a pass that saved it: refused
    opt._core.commit(opt._step_number, opt._record)
