#!/usr/bin/env python3
"""Checks libmemascend's layering (docs/architecture.md): every file of src/ and every
public header may include only headers of its own layer or the layers below it.

    tools/check_layers.py [REPO_ROOT]

Prints each include that goes up a layer and exits 1 if there is any; prints the layer
order and exits 0 otherwise. Run by ctest (test `architecture_layers`)."""
import pathlib
import re
import sys

# Bottom up. A layer is a folder of src/ (base: the files at src/'s top level).
LAYERS = ["base", "util", "prim", "kernels", "memory", "io", "storage", "store", "train"]
RANK = {name: i for i, name in enumerate(LAYERS)}

# Each public header belongs to the layer that implements it.
PUBLIC = {
    "types.h": "base", "status.h": "base", "version.h": "base",
    "workload.h": "util",
    "system.h": "prim", "cuda.h": "prim",
    "kernels.h": "kernels", "cuda_kernels.h": "kernels",
    "memory_ledger.h": "memory", "host_arena.h": "memory", "host_budget.h": "memory", "pinned_pool.h": "memory",
    "io_engine.h": "io", "io_scheduler.h": "io",
    "block_target.h": "storage", "volume.h": "storage", "object_store.h": "storage",
    "tensor_store.h": "store",
    "training_state.h": "train", "offloaded_optimizer.h": "train", "offloaded_training.h": "train", "safetensors.h": "train",
    "device_training.h": "train",
}
UMBRELLA = {"memascend.h"}  # includes everything; for users only

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def layer_of_header(name):
    """The layer of an included path, or None for a system or third-party header."""
    if name.startswith("memascend/"):
        base = name[len("memascend/"):]
        if base in UMBRELLA:
            return "umbrella"
        if base not in PUBLIC:
            raise SystemExit(f"check_layers: public header {base} has no layer in PUBLIC")
        return PUBLIC[base]
    first = name.split("/")[0]
    if "/" in name and first in RANK:
        return first
    return None


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    files = []
    for f in sorted((root / "src").rglob("*")):
        if f.suffix not in (".h", ".cpp", ".inc", ".cu"):
            continue
        rel = f.relative_to(root / "src")
        layer = rel.parts[0] if len(rel.parts) > 1 else "base"
        if layer not in RANK:
            raise SystemExit(f"check_layers: src/{rel} is in no layer (add its folder to LAYERS)")
        files.append((f, layer))
    for f in sorted((root / "include" / "memascend").glob("*.h")):
        if f.name in UMBRELLA:
            continue
        if f.name not in PUBLIC:
            raise SystemExit(f"check_layers: include/memascend/{f.name} has no layer in PUBLIC")
        files.append((f, PUBLIC[f.name]))
    for f in sorted((root / "kernels").glob("*.cu")):
        files.append((f, "kernels"))
    bad = []
    for f, layer in files:
        for _, name in INCLUDE.findall(f.read_text()):
            target = layer_of_header(name)
            if target is None:
                continue
            if target == "umbrella" or RANK[target] > RANK[layer]:
                bad.append(f"{f.relative_to(root)} ({layer}) includes {name} ({target})")
    if bad:
        print("includes that go up a layer (order: " + " < ".join(LAYERS) + "):")
        for b in bad:
            print("  " + b)
        return 1
    print(f"layers ok over {len(files)} files: " + " < ".join(LAYERS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
