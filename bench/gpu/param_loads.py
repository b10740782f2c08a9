#!/usr/bin/env python3
"""The device parameters' loads per micro-batch, counted over the host emulation: the GPU
path's acquire sequence for a Llama (an embedding tied to the output head, decoder layers
loaded whole, a final norm), at the device budget and read-ahead memascend.torch chooses.

    python3 bench/gpu/param_loads.py [--layers 16] [--scale 256] [--micro-batches 8]
                                     [--budget-fraction F] [--read-ahead-fraction F]
                                     [--loss-pieces N]

The groups are Llama-3.2-1B's parameters (--layers decoder layers), each divided by
--scale (the counts are of bytes over the model's, which the scale does not change);
memascend._core.DeviceParameters(emulate=True) runs the SDK's own scheduling, the device
being host memory. A micro-batch acquires, as offload_parameters(units=decoder layers)
does under activation checkpointing: forward, the embedding, each layer's groups, the
norm, the head (the embedding again); backward, the same in reverse. Micro-batch 0 and
every --update-every-th are preceded by an update (every device copy invalidated). The
defaults are memascend.torch's: read-ahead twice the largest module (the embedding), the
budget that plus room for two; with Llama-3.2-1B's 16 layers, 0.85 of the model.

Prints one JSON object: the model's bytes, the budget and read-ahead as fractions of
them, and each micro-batch's loads in models (bytes copied over the model's bytes), with
the acquires, misses and read-aheads. Counted, not timed: the same on any machine. The
fifth H200 lease measured 4.47 GB of loads a micro-batch at 16 layers (1.81 models, commit
c3f4f1f); this count at that commit gives 1.86-1.90 (docs/gpu.md).
"""
import argparse
import json
import os
import sys
import tempfile

HIDDEN, INTERMEDIATE, VOCAB, KV = 2048, 8192, 128256, 512  # Llama-3.2-1B
LAYER = [HIDDEN * HIDDEN, HIDDEN * KV, HIDDEN * KV, HIDDEN * HIDDEN,  # q, k, v, o
         HIDDEN * INTERMEDIATE, HIDDEN * INTERMEDIATE, INTERMEDIATE * HIDDEN,  # gate, up, down
         HIDDEN, HIDDEN]  # the two norms
PART_ELEMENTS = 1 << 20  # memascend.torch's default, scaled with the model


def groups(layers, scale):
    """(name, elements) of each parameter group, in the model's order."""
    g = [("embed", VOCAB * HIDDEN // scale)]
    for i in range(layers):
        g += [(f"layers.{i}.{j}", max(64, n // scale)) for j, n in enumerate(LAYER)]
    return g + [("norm", max(64, HIDDEN // scale))]


def units(layers, loss_pieces=0):
    """(forward, backward): each pass's uses in order, each a list of groups acquired
    together. With loss_pieces N (the path's --loss-chunk, common.causal_lm_loss) the head
    is used once a piece in forward, and twice a piece in backward (the piece's
    recomputation, then its backward), the pieces in reverse."""
    body = [[0]] + [list(range(1 + 9 * i, 10 + 9 * i)) for i in range(layers)] + \
        [[9 * layers + 1]]
    if loss_pieces <= 0:
        forward = body + [[0]]
        return forward, forward[::-1]
    return body + [[0]] * loss_pieces, [[0]] * (2 * loss_pieces) + body[::-1]


def count(layers=16, scale=256, micro_batches=8, update_every=4, budget_fraction=None,
          read_ahead_fraction=None, workdir=None, loss_pieces=0):
    """Runs the sequence; returns the record (see the module's docstring)."""
    import torch
    from memascend import _core
    gs = groups(layers, scale)
    elements = sum(n for _, n in gs)
    model = 2 * elements  # bf16
    largest = 2 * gs[0][1]
    read_ahead = (int(read_ahead_fraction * model) if read_ahead_fraction is not None
                  else 2 * largest)
    budget = (int(budget_fraction * model) if budget_fraction is not None
              else 2 * largest + read_ahead)
    part = max(1024, PART_ELEMENTS // scale)
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        # The state whole in the store's budget (the path's operating point: nothing evicted).
        vol = _core.Volume.open_or_create(os.path.join(d, "loads.vol"), _core.OffloadedAdam.
                                          volume_bytes(gs, "bfloat16", "bfloat16", part, True))
        store = _core.TensorStore(vol, host_budget=_core.OffloadedAdam.stored_bytes(
            gs, "bfloat16", "bfloat16", part, True) + (32 << 20))
        n = len(gs)
        adam = _core.OffloadedAdam(store, gs, "bfloat16", "bfloat16", part, [1e-3] * n,
                                   [0.0] * n, 0.9, 0.999, 1e-8, 0.0, False, 1.0, 0, 0, 1, True)
        for i, (_, k) in enumerate(gs):
            w = torch.zeros(k, dtype=torch.bfloat16)
            adam.initialize(i, w.data_ptr(), k, "bfloat16")
        adam.commit(0)
        dev = _core.DeviceParameters(adam, device_budget=budget, read_ahead=read_ahead,
                                     emulate=True)
        try:
            (forward, backward), rows, last = units(layers, loss_pieces), [], dev.stats()
            for mb in range(micro_batches):
                updated = mb % update_every == 0
                if updated:
                    for g in range(n):
                        dev.invalidate(g)
                for is_backward, order in ((False, forward), (True, backward)):
                    for unit in order:
                        for g in unit:
                            dev.acquire(g, 0, is_backward)
                        for g in unit:
                            dev.release(g, 0)
                s = dev.stats()
                rows.append({"micro_batch": mb, "after_update": updated,
                             "models_loaded": (s["bytes_to_device"] - last["bytes_to_device"])
                             / model,
                             **{k: s[k] - last[k] for k in ("acquires", "misses", "read_ahead",
                                                             "evictions")}})
                last = s
        finally:
            dev.close()
            adam.close()
            store.close()
            vol.close()
    steady = [r["models_loaded"] for r in rows if not r["after_update"]]
    return {"model": f"llama-3.2-1b-shapes-{layers}-layers", "scale": scale,
            "loss_pieces": loss_pieces,
            "model_bytes_unscaled": model * scale, "budget_fraction": budget / model,
            "read_ahead_fraction": read_ahead / model, "update_every": update_every,
            "steady_models_loaded_max": max(steady) if steady else None,
            "micro_batches": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--scale", type=int, default=256)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--update-every", type=int, default=4)
    ap.add_argument("--budget-fraction", type=float)
    ap.add_argument("--read-ahead-fraction", type=float)
    ap.add_argument("--loss-pieces", type=int, default=0, help="the head used a piece at a "
                    "time (the path's --loss-chunk: tokens a micro-batch over the chunk)")
    a = ap.parse_args()
    r = count(a.layers, a.scale, a.micro_batches, a.update_every, a.budget_fraction,
              a.read_ahead_fraction, loss_pieces=a.loss_pieces)
    print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
