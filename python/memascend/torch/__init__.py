"""memascend.torch: a PyTorch training loop's optimizer state, parameters and saved
activations kept by MemAscend (pinned host memory under a budget, over a volume on NVMe).

    import memascend.torch as mt
    opt = mt.OffloadedAdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                            volume="/nvme/run.vol", host_budget=256 << 20)
    ...                               # the usual loop: loss.backward(); opt.step(); opt.zero_grad()

``OffloadedAdamW`` has ``torch.optim.AdamW``'s semantics. Its fp32 master weights and both
moments live on the volume, updated part by part (``part_elements`` at a time) through
the SDK's offloaded optimizer under ``host_budget`` bytes of pinned memory; every step is
committed crash-consistently in the background, and ``resume=True`` continues from the
last committed step after a crash.

``offload_parameters(module, optimizer)`` keeps the parameters themselves there too
(ZeRO-3 style): each submodule's parameters are loaded before its forward and its
backward and dropped after. ``offload_activations(store)`` keeps the tensors autograd
saves for the backward pass in a TensorStore instead of ordinary (or pinned) memory.

On a GPU (the parameters on a CUDA device) the same three run through the SDK's device
paths (memascend/device_training.h): the store's host memory is registered with CUDA,
gradients leave the GPU on a copy stream into it, parameters come back from it into a
device budget on another, read ahead by bytes along the order the first step recorded,
and every copy is fenced by CUDA events that torch's current stream waits on.

Differences from torch.optim.AdamW, each deliberate:
- The optimizer owns the master weights: a parameter changed outside ``step()`` (a
  ``model.load_state_dict`` after the optimizer was made) must be told with
  ``reload_parameters()``.
- A parameter without a gradient at ``step()`` is updated with a zero gradient (its
  moments decay and weight decay applies), as DeepSpeed does; torch skips it.
- One ``betas`` and ``eps`` for every group (lr and weight_decay may differ per group),
  every parameter of one dtype (float32, float16 or bfloat16), and no ``amsgrad``,
  ``maximize`` or sparse gradients: each is refused with an exception, not ignored.

The package's modules: optimizer (OffloadedAdamW), state (its state_dict), scaling
(PyTorch's GradScaler), distributed (torch.distributed), parameters (offload_parameters),
activations (offload_activations), cuda (the device paths), trace (StepTrace: where a step's
time goes, for a timeline).

Thread-safety: one thread drives an optimizer and the modules it offloads.
"""
from memascend.torch._common import DEFAULT_PART_ELEMENTS
from memascend.torch.activations import ActivationOffload, offload_activations
from memascend.torch.optimizer import OffloadedAdamW
from memascend.torch.parameters import ParameterOffload, offload_parameters
from memascend.torch.trace import StepTrace

__all__ = ["OffloadedAdamW", "offload_parameters", "offload_activations", "ParameterOffload",
           "ActivationOffload", "StepTrace", "DEFAULT_PART_ELEMENTS"]
