"""What the modules of memascend.torch share: dtype names, host copies, and the registry
of parameters offloaded by offload_parameters()."""
import torch

from memascend import errors

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DEFAULT_PART_ELEMENTS = 1 << 20


def dtype_name(dtype, what):
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise errors.InvalidArgumentError(
            f"{what} has dtype {dtype}; MemAscend keeps float32, float16 and bfloat16") from None


def is_kept_dtype(dtype):
    return dtype in _DTYPE_NAMES


def host(t):
    """`t` as a contiguous CPU tensor (a copy only where needed)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


# id(parameter) -> (ParameterOffload, index), while offloaded. (Keyed by id: a tensor's ==
# is elementwise, which a WeakKeyDictionary would call.)
OFFLOADED = {}


def offloaded(p):
    return id(p) in OFFLOADED
