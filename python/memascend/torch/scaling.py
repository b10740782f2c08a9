"""OffloadedAdamW and PyTorch's GradScaler: the scale the gradients carry, and what the
SDK's fused overflow check found, told back to the scaler."""
import torch

from memascend import errors


def outside_scale(opt, grad_scaler):
    """(scale the gradients carry, skip) from a torch GradScaler, if one drives `opt`."""
    if grad_scaler is not None:  # torch 1.x: step(grad_scaler=...)
        if opt._dynamic:
            raise errors.FailedPreconditionError(
                "a GradScaler and dynamic_loss_scale both scale the loss; use one")
        state = grad_scaler._per_optimizer_states.get(id(opt), {})
        if getattr(state.get("stage"), "name", None) == "UNSCALED":
            # scaler.unscale_(opt) ran (to clip): the gradients carry no scale any more, and
            # its check's findings stand (they were unscaled twice, by 1/scale^2).
            found = state.get("found_inf_per_device", {})
            if sum(float(v.sum().item()) for v in found.values()) > 0:
                return 0.0, True
            return 1.0, False
        return float(grad_scaler._get_scale_async().item()), False
    grad_scale = getattr(opt, "grad_scale", None)  # torch 2.x sets these two
    found_inf = getattr(opt, "found_inf", None)
    if found_inf is not None and not torch.is_tensor(found_inf):
        # The scaler's check found no gradient in p.grad (its sum of none is the integer 0),
        # and its update() would then stop for want of a check: refused before anything.
        raise errors.FailedPreconditionError(
            "torch's GradScaler found no gradient in p.grad to check for inf/NaN: with "
            "parameters on a GPU each gradient goes to the store as backward makes it "
            "(offload_gradients). Make the optimizer with offload_gradients=False to use a "
            "GradScaler, or use dynamic_loss_scale=True (the SDK's scaler, whose fused check "
            "sees the gradients where they went)")
    if found_inf is not None and float(found_inf.sum().item()) > 0:
        return 0.0, True
    if grad_scale is not None:
        if opt._dynamic:
            raise errors.FailedPreconditionError(
                "a GradScaler and dynamic_loss_scale both scale the loss; use one")
        return float(grad_scale.item()), False
    return 0.0, False


def report(opt, grad_scaler, plan):
    """Tells a torch 1.x GradScaler (step(grad_scaler=...)) what the fused check found."""
    if grad_scaler is None:
        return
    scale_t = grad_scaler._get_scale_async()
    found = torch.full((1,), 1.0 if plan["skipped"] else 0.0, dtype=torch.float32,
                       device=scale_t.device)
    grad_scaler._per_optimizer_states[id(opt)]["found_inf_per_device"][scale_t.device] = found
