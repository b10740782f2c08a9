"""MemAscend: tiered tensor storage (pinned host memory over a raw NVMe volume) and an
offloaded optimizer, for training models far larger than GPU and host memory.

    import memascend
    with memascend.Volume.open_or_create("/nvme/run.vol", size=64 << 30) as vol, \\
         memascend.TensorStore(vol, host_budget=1 << 30) as store:
        t = store.register("w", 4096 * 4)
        store.write(t, bytes(4096 * 4))

PyTorch users want :mod:`memascend.torch` (``OffloadedAdamW``, ``offload_parameters``,
``offload_activations``). Every failure raises a :class:`memascend.Error` subclass
carrying the SDK's status code and message (see :mod:`memascend.errors`).

Thread-safety: a Volume and a TensorStore may be used from several threads; a Lease by
one. Lifetime: a TensorStore keeps its Volume alive, a Lease its TensorStore; closing
one that is still in use raises FailedPreconditionError.
"""
import json as _json

from memascend import _core
from memascend.errors import (  # noqa: F401
    Error, StatusCode, InvalidArgumentError, NotFoundError, AlreadyExistsError,
    ResourceExhaustedError, FailedPreconditionError, OutOfRangeError, DataLossError,
    UnavailableError)

__version__ = _core.version()

Volume = _core.Volume
TensorStore = _core.TensorStore
Lease = _core.Lease


def _enter(self):
    return self


def _exit_close(self, *exc):
    self.close()
    return False


def _exit_release(self, *exc):
    self.release()
    return False


for _cls in (Volume, TensorStore):
    _cls.__enter__ = _enter
    _cls.__exit__ = _exit_close
Lease.__enter__ = _enter
Lease.__exit__ = _exit_release
Volume.__repr__ = lambda self: f"memascend.Volume({self.path!r}{', closed' if self.closed else ''})"
TensorStore.__repr__ = lambda self: (
    f"memascend.TensorStore(host_budget={self.host_budget}{', closed' if self.closed else ''})")


def system_info():
    """What this machine offers and what MemAscend picks (``memascend info`` as a dict):
    CPU features, memory and memlock limits, io_uring, CUDA devices, NUMA nodes."""
    return _json.loads(_core.system_info_json())


__all__ = ["Volume", "TensorStore", "Lease", "system_info", "Error", "StatusCode", "errors"]
