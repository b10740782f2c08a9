"""OffloadedAdamW's state_dict in torch.optim.AdamW's format (plus 'master' for 16-bit
parameters), loading one (of this optimizer or of torch.optim.AdamW), ``opt.state`` (the
same entries, read per parameter), ``repr(opt)``, and the state's first values (a fresh
start) or the parameters' from it (a resume)."""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from memascend import errors
from memascend.torch import distributed as _dist
from memascend.torch._common import check_groups, check_parameters, host, offloaded

if TYPE_CHECKING:
    from memascend.torch.optimizer import OffloadedAdamW


def _entry(opt: OffloadedAdamW, i: int) -> dict[str, torch.Tensor]:
    """Parameter i's state as torch.optim.AdamW keeps it, read from the volume (copies);
    under torch.distributed a collective (each rank's shard all-gathered)."""
    entry = {"step": torch.tensor(float(opt._core.adam_step))}
    kinds = ["exp_avg", "exp_avg_sq"] + (["master"] if opt._dt != "float32" else [])
    failure = None
    for kind in kinds:
        k, begin, end = opt._shards[i]
        t = torch.zeros(end - begin, dtype=torch.float32)
        if k is not None and failure is None:
            try:  # a rank whose read fails goes on gathering, then the ranks agree
                opt._core.read_state(kind, k, t.data_ptr(), t.numel(), "float32")
            except Exception as e:  # noqa: BLE001 - agreed below
                if not opt._sharded:
                    raise
                failure = e
        if opt._sharded:
            t = _dist.gather(opt, i, t, dtype=torch.float32)
        entry[kind] = t.view(opt._shapes[i])
    if opt._sharded:
        _dist.agree(opt, failure is None, "failed to read their state")
        if failure is not None:
            raise failure
    return entry


class StateView(Mapping):
    """``opt.state``: parameter -> its state, as ``torch.optim.AdamW``'s ``opt.state[p]``
    holds it (``step``, ``exp_avg``, ``exp_avg_sq``; ``master`` for 16-bit parameters).
    Read from the volume on each access: the tensors are copies (changing them changes
    nothing; ``load_state_dict`` writes a state) and the mapping is read-only. Under
    torch.distributed each access is a collective, as ``state_dict()``."""

    def __init__(self, opt: OffloadedAdamW) -> None:
        self._opt = opt

    def _index(self, p: object) -> int:
        for i, q in enumerate(self._opt._params):
            if q is p:
                return i
        raise KeyError("not a parameter of this optimizer")

    def __getitem__(self, p: object) -> dict[str, torch.Tensor]:
        i = self._index(p)
        self._opt._check()
        return _entry(self._opt, i)

    def __contains__(self, p: object) -> bool:
        return any(q is p for q in self._opt._params)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._opt._params)

    def __len__(self) -> int:
        return len(self._opt._params)

    def __repr__(self) -> str:
        return f"<OffloadedAdamW state of {len(self)} parameters, read from the volume>"


def describe(opt: OffloadedAdamW) -> str:
    """repr(opt): torch's (the parameter groups) with the volume and the host budget."""
    volume = getattr(opt, "_volume", None)
    where = "closed" if getattr(opt, "_core", None) is None else repr(volume.path)
    budget = f"host_budget: {getattr(opt, 'host_budget', None)}"
    if getattr(opt, "host_budget_reason", None):
        locked = "" if opt.host_budget_locked else "; not page-locked"
        budget += f" ({opt.host_budget_reason}{locked})"
    lines = torch.optim.Optimizer.__repr__(opt).splitlines()
    return "\n".join(lines[:1] + [f"volume: {where}", budget] + lines[1:])


def state_dict(opt: OffloadedAdamW) -> dict[str, Any]:
    opt._check()
    state = {i: _entry(opt, i) for i in range(len(opt._params))}
    groups, start = [], 0
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        groups.append(packed)
    return {"state": state, "param_groups": groups}


def load_state_dict(opt: OffloadedAdamW, state_dict: dict[str, Any]) -> None:
    opt._check()
    if opt._sharded:
        _dist.refuse_offloaded(opt, "load_state_dict")
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, opt.param_groups)):
        raise errors.InvalidArgumentError(
            "the state_dict's parameter groups differ from this optimizer's in number or size")
    # Everything checked before anything is written: a refused state_dict changes nothing.
    check_groups(groups, opt._betas_eps, "of the state_dict has")
    order = [idx for g in groups for idx in g["params"]]
    steps = set()
    for i, idx in enumerate(order):
        entry = state_dict["state"].get(idx)
        if entry is None:
            raise errors.InvalidArgumentError(
                f"the state_dict has no state for parameter {i} (torch's AdamW makes none for "
                "a parameter that never had a gradient; OffloadedAdamW keeps one step count "
                "for all): leave a parameter that does not train out of both optimizers")
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
    def write():
        for i, idx in enumerate(order):
            entry = state_dict["state"][idx]
            for kind in ("exp_avg", "exp_avg_sq"):
                t = host(entry[kind].detach().to(torch.float32))
                k, h = _dist.mine(opt, i, t)
                if k is not None:
                    opt._core.write_state(kind, k, h.data_ptr(), h.numel(), "float32")
            master = entry.get("master")
            if master is None:
                master = opt._params[i].detach()
                if offloaded(opt._params[i]):
                    continue  # its master weights are on the volume already
            k, h = _dist.mine(opt, i, host(master.to(torch.float32)))
            if k is None:
                continue
            opt._core.write_state("master", k, h.data_ptr(), h.numel(), "float32")
            opt._core.write_state("param", k, h.data_ptr(), h.numel(), "float32")
    _written(opt, write, "failed to write the state_dict given")
    opt._core.set_adam_step(int(steps.pop()) if steps else 0)
    for mine, theirs in zip(opt.param_groups, groups):  # as torch's optimizers: every key
        mine.update({k: v for k, v in theirs.items() if k != "params"})  # (a scheduler's too)
    opt._core.commit(opt._step_number, opt._record)


def record_bytes(betas_eps) -> bytes:
    """What each commit records besides the state: the betas and eps the moments are made
    with (resume=True checks them; lr and weight_decay are the caller's to change)."""
    betas, eps = betas_eps
    return json.dumps({"betas": [float(b) for b in betas], "eps": float(eps)}).encode()


def check_record(opt: OffloadedAdamW, record: Mapping[str, Any]) -> None:
    """resume=True with betas or eps other than those the run's moments were made with:
    FailedPreconditionError (they were taken silently, over moments made otherwise). A
    commit that recorded none (an older volume) passes; a torn step finished on resume
    carries the record of the commit before it. Compared as the kernels take them (fp32)."""
    try:
        saved = json.loads(bytes(record.get("user") or b"{}"))
        betas, eps = tuple(saved["betas"]), saved["eps"]
    except (ValueError, TypeError, KeyError):
        return
    mine = tuple(float(b) for b in opt._betas_eps[0]), float(opt._betas_eps[1])
    f32 = torch.tensor([*betas, eps, *mine[0], mine[1]], dtype=torch.float64).float().tolist()
    if f32[:3] != f32[3:]:  # np.float32(0.9) is 0.9 there
        raise errors.FailedPreconditionError(
            f"volume {opt._volume.path} holds a run made with betas {betas} and eps {eps}; "
            f"this optimizer has betas {mine[0]} and eps {mine[1]}, and the run's moments "
            "were made with its own: pass those to resume it (or overwrite=True to start "
            "over: its state is then lost)")


def reload_parameters(opt: OffloadedAdamW) -> None:
    opt._check()
    check_parameters(opt)  # their bytes are written as the optimizer's dtype
    if opt._sharded:
        _dist.refuse_offloaded(opt, "reload_parameters")
    def write():
        for i, p in enumerate(opt._params):
            if offloaded(p):
                continue
            k, h = _dist.mine(opt, i, host(p.detach()))
            if k is None:
                continue
            opt._core.write_state("master", k, h.data_ptr(), h.numel(), opt._dt)
            opt._core.write_state("param", k, h.data_ptr(), h.numel(), opt._dt)
    _written(opt, write, "failed to write the parameters as master weights")
    opt._core.commit(opt._step_number, opt._record)


def _written(opt: OffloadedAdamW, write, what: str) -> None:
    """write() (no collective in it) under torch.no_grad(); under torch.distributed a
    rank's failure is agreed before any rank commits: every rank raises and later steps
    refuse (its state is part-written: resume=True goes on from the volumes)."""
    failure = None
    with torch.no_grad():
        try:
            write()
        except Exception as e:  # noqa: BLE001 - agreed below, or raised as it was
            if not opt._sharded:
                raise
            failure = e
    if opt._sharded:
        _dist.agree_on_step(opt, failure, what)


def initialize(opt: OffloadedAdamW) -> None:
    """A fresh start: each rank's shard of the parameters (rank 0's, under
    torch.distributed, as DDP starts from) as the master weights; committed at step 0."""
    with torch.no_grad():
        if opt._sharded:
            _dist.broadcast_parameters(opt)
        failure = None
        try:  # no collective in here: what fails on one rank is agreed below
            for i, p in enumerate(opt._params):
                k, begin, end = opt._shards[i]
                if k is None:
                    continue
                h = host(p.detach()).reshape(-1)[begin:end].contiguous()
                opt._core.initialize(k, h.data_ptr(), h.numel(), opt._dt)
            opt._core.commit(opt._step_number, opt._record)
        except Exception as e:  # noqa: BLE001 - raised below, after the ranks agree
            failure = e
        if opt._sharded:
            _dist.agree_opened(opt, failure is None)
        if failure is not None:
            raise failure


def load_into_parameters(opt: OffloadedAdamW) -> None:
    """After a resume: the parameters' values from the volume (offloaded ones stay there)."""
    with torch.no_grad():
        if opt._sharded:
            _dist.load_into_parameters(opt)
            return
        for i, p in enumerate(opt._params):
            if offloaded(p):
                continue
            if opt._cuda is not None:
                opt._cuda.copy_parameter(i, p)
                continue
            opt._write_parameter(i, p, lambda h, i=i: opt._core.load_parameters(
                i, h.data_ptr(), h.numel(), opt._dt))
