"""OffloadedAdamW's state_dict in torch.optim.AdamW's format (plus 'master' for 16-bit
parameters), and loading one (of this optimizer or of torch.optim.AdamW)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memascend import errors
from memascend.torch import distributed as _dist
from memascend.torch._common import host, offloaded

if TYPE_CHECKING:
    from memascend.torch.optimizer import OffloadedAdamW


def state_dict(opt: OffloadedAdamW) -> dict[str, Any]:
    opt._check()
    state = {}
    step = torch.tensor(float(opt._core.adam_step))
    for i in range(len(opt._params)):
        entry = {"step": step.clone()}
        kinds = ["exp_avg", "exp_avg_sq"] + (["master"] if opt._dt != "float32" else [])
        for kind in kinds:
            k, begin, end = opt._shards[i]
            t = torch.empty(end - begin, dtype=torch.float32)
            if k is not None:
                opt._core.read_state(kind, k, t.data_ptr(), t.numel(), "float32")
            if opt._world > 1:
                t = _dist.gather(opt, i, t, dtype=torch.float32)
            entry[kind] = t.view(opt._shapes[i])
        state[i] = entry
    groups, start = [], 0
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        groups.append(packed)
    return {"state": state, "param_groups": groups}


def load_state_dict(opt: OffloadedAdamW, state_dict: dict[str, Any]) -> None:
    opt._check()
    if opt._world > 1:
        opt._refuse_offloaded("load_state_dict")
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, opt.param_groups)):
        raise errors.InvalidArgumentError(
            "the state_dict's parameter groups differ from this optimizer's in number or size")
    order = [idx for g in groups for idx in g["params"]]
    # Everything checked before anything is written: a refused state_dict changes nothing.
    steps = set()
    for i, idx in enumerate(order):
        entry = state_dict["state"].get(idx)
        if entry is None:
            raise errors.InvalidArgumentError(f"the state_dict has no state for parameter {i}")
        steps.add(float(entry["step"]))
        for kind in ("exp_avg", "exp_avg_sq", "master"):
            t = entry.get(kind)
            if t is None:
                if kind == "master":
                    continue
                raise errors.InvalidArgumentError(f"the state_dict has no {kind} for parameter {i}")
            if t.numel() != opt._numels[i]:
                raise errors.InvalidArgumentError(
                    f"parameter {i}'s {kind} has {t.numel()} elements, not {opt._numels[i]}")
    if len(steps) > 1:
        raise errors.InvalidArgumentError(
            f"the parameters were stepped {sorted(steps)} times; OffloadedAdamW keeps one "
            "step count")
    with torch.no_grad():
        for i, idx in enumerate(order):
            entry = state_dict["state"][idx]
            for kind in ("exp_avg", "exp_avg_sq"):
                t = host(entry[kind].detach().to(torch.float32))
                k, h = opt._mine(i, t)
                if k is not None:
                    opt._core.write_state(kind, k, h.data_ptr(), h.numel(), "float32")
            master = entry.get("master")
            if master is None:
                master = opt._params[i].detach()
                if offloaded(opt._params[i]):
                    continue  # its master weights are on the volume already
            k, h = opt._mine(i, host(master.to(torch.float32)))
            if k is None:
                continue
            opt._core.write_state("master", k, h.data_ptr(), h.numel(), "float32")
            opt._core.write_state("param", k, h.data_ptr(), h.numel(), "float32")
    opt._core.set_adam_step(int(steps.pop()) if steps else 0)
    for mine, theirs in zip(opt.param_groups, groups):
        for key in ("lr", "weight_decay"):
            if key in theirs:
                mine[key] = theirs[key]
    opt._core.commit(opt._step_count)


def reload_parameters(opt: OffloadedAdamW) -> None:
    opt._check()
    if opt._world > 1:
        opt._refuse_offloaded("reload_parameters")
    with torch.no_grad():
        for i, p in enumerate(opt._params):
            if offloaded(p):
                continue
            k, h = opt._mine(i, host(p.detach()))
            if k is None:
                continue
            opt._core.write_state("master", k, h.data_ptr(), h.numel(), opt._dt)
            opt._core.write_state("param", k, h.data_ptr(), h.numel(), opt._dt)
    opt._core.commit(opt._step_count)
