"""MemAscend: tiered tensor storage (pinned host memory over a raw NVMe volume) and an
offloaded optimizer, for training models far larger than GPU and host memory.

    import memascend
    with memascend.Volume.open_or_create("/nvme/run.vol", size=64 << 30) as vol, \\
         memascend.TensorStore(vol, host_budget=1 << 30) as store:
        t = store.register("w", 4096 * 4)
        store.write(t, bytes(4096 * 4))

Before a run, :func:`memascend.plan` says what it needs (host RSS, pinned memory, disk,
I/O per step) beside ZeRO-Infinity's rules, as ``memascend plan`` does.

PyTorch users want :mod:`memascend.torch` (``OffloadedAdamW``, ``offload_parameters``,
``offload_activations``). Every failure raises a :class:`memascend.Error` subclass
carrying the SDK's status code and message (see :mod:`memascend.errors`).

Thread-safety: a Volume and a TensorStore may be used from several threads; a Lease by
one. Lifetime: a TensorStore keeps its Volume alive, a Lease its TensorStore; closing
one that is still in use raises FailedPreconditionError.
"""
from __future__ import annotations

import json as _json
from typing import Any, Literal, TypeVar

from memascend import _core
from memascend.errors import (  # noqa: F401
    Error, StatusCode, InvalidArgumentError, NotFoundError, AlreadyExistsError,
    ResourceExhaustedError, FailedPreconditionError, OutOfRangeError, DataLossError,
    UnavailableError)

__version__ = _core.version()

Volume = _core.Volume
TensorStore = _core.TensorStore
Lease = _core.Lease

from memascend.plan import plan  # noqa: E402  (after _core: it imports it)


_T = TypeVar("_T")


def _enter(self: _T) -> _T:
    return self


def _exit_close(self: Any, *exc: object) -> Literal[False]:
    self.close()
    return False


def _exit_release(self: Any, *exc: object) -> Literal[False]:
    self.release()
    return False


# The extension's classes get the context-manager protocol and a repr here; setattr, since
# their stub (_core.pyi) declares these as the classes' own.
for _cls in (Volume, TensorStore):
    setattr(_cls, "__enter__", _enter)
    setattr(_cls, "__exit__", _exit_close)
setattr(Lease, "__enter__", _enter)
setattr(Lease, "__exit__", _exit_release)
setattr(Volume, "__repr__",
        lambda self: f"memascend.Volume({self.path!r}{', closed' if self.closed else ''})")
setattr(TensorStore, "__repr__", lambda self: (
    f"memascend.TensorStore(host_budget={self.host_budget}{', closed' if self.closed else ''})"))


def system_info() -> dict[str, Any]:
    """What this machine offers and what MemAscend picks (``memascend info`` as a dict):
    CPU features, memory and memlock limits, io_uring, CUDA devices, NUMA nodes."""
    return _json.loads(_core.system_info_json())


__all__ = ["Volume", "TensorStore", "Lease", "system_info", "plan", "Error", "StatusCode",
           "errors",
           "InvalidArgumentError", "NotFoundError", "AlreadyExistsError", "ResourceExhaustedError",
           "FailedPreconditionError", "OutOfRangeError", "DataLossError", "UnavailableError"]
