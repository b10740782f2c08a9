# Type stub for optimizer.py: OffloadedAdamW's signatures, kept here rather than in the
# module (which stays within memascend.torch's 500 lines a module). Type checkers read
# this file instead of optimizer.py: a change to a public signature there is made here
# too (python3 -m mypy.stubtest memascend.torch.optimizer compares the two).
import os
from typing import Any, Callable, Iterable, Literal, Mapping

import torch

from memascend import _core

class OffloadedAdamW(torch.optim.Optimizer):
    host_budget: int
    host_budget_reason: str
    host_budget_locked: bool
    resumed_step: int | None
    last_step: dict[str, Any] | None
    skipped_steps: int
    comm_bytes: int
    # Read from the volume per parameter (state.StateView): read-only, copies.
    state: Mapping[torch.Tensor, dict[str, torch.Tensor]]  # type: ignore[assignment]
    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 volume: str | os.PathLike[str] | _core.Volume, host_budget: int | None = None,
                 volume_size: int | None = None, part_elements: int = ...,
                 max_grad_norm: float = 0.0, dynamic_loss_scale: bool = False,
                 initial_scale: float = 65536.0, resume: bool = False, overwrite: bool = False,
                 threads: int | None = None, read_ahead: int | None = None, run_id: int = 0,
                 amsgrad: bool = False, maximize: bool = False, process_group: Any = None,
                 offload_gradients: bool | None = None, commit_every: int = 1,
                 write_back_depth: int | None = None,
                 io_threads: int | None = None,
                 staging: Literal["bounded", "step"] = "bounded") -> None: ...
    def add_param_group(self, param_group: dict[str, Any]) -> None: ...
    def close(self) -> None: ...
    def __repr__(self) -> str: ...
    def __enter__(self) -> OffloadedAdamW: ...
    def __exit__(self, *exc: object) -> Literal[False]: ...
    @staticmethod
    def min_host_budget(max_numel: int, part_elements: int = ...,
                        dtype: torch.dtype = ...) -> int: ...
    @property
    def loss_scale(self) -> float: ...
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...
    @property
    def steps(self) -> int: ...
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any: ...
    def settle(self) -> None: ...
    def reload_parameters(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    # Used by the package's other modules (parameters, activations, state, cuda,
    # distributed, scaling), not by its users.
    _core: Any
    _store: Any
    _cuda: Any
    _params: list[torch.Tensor]
    _shapes: list[Any]
    _numels: list[int]
    _shards: list[Any]
    _dtype: torch.dtype
    _dt: str
    _device: torch.device
    _betas_eps: tuple[tuple[float, float], float]
    _world: int
    _sharded: bool
    _pg: Any
    _step_number: int
    _dynamic: bool
    _offloads: list[Any]
    def _check(self) -> None: ...
    def _grad(self, i: int, p: torch.Tensor) -> torch.Tensor: ...
    def _finish_update(self) -> None: ...
    def _defer_updates(self, on: bool) -> None: ...
    def _update_through(self, i: int) -> None: ...
    def _apply_group_options(self) -> None: ...
