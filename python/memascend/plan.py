"""What a training run needs before it starts: :func:`plan`, the same figures as
``memascend plan --json`` (one C++ function, tools/sim/plan.h, serves both)."""
from __future__ import annotations

import json as _json
import os
from typing import Any, Literal, Optional, Union

from memascend import _core, errors

_DTYPES = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def plan(config: Union[str, "os.PathLike[str]", dict[str, Any], None] = None, *,
         params: int = 0, layers: int = 0, hidden: int = 0, heads: int = 0, vocab: int = 0,
         seq: int = 64, batch: int = 8,
         dtype: Literal["fp16", "bf16", "float16", "bfloat16"] = "fp16",
         part_elements: int = 1 << 20, checkpoint_activations: bool = False,
         host_limit: Optional[int] = None, host_budget: Optional[int] = None,
         gpu_memory: Optional[int] = None, base_rss: int = 256 << 20) -> dict[str, Any]:
    """What a MemAscend run of a model needs, beside what ZeRO-Infinity's rules would need.

    The model is a Hugging Face ``config.json`` (``config``: its path, or the parsed dict;
    model_type gpt2 or llama), or a parameter count (``params``, with ``layers`` and
    ``hidden`` if known, for the activations), or, with neither, memascend-train's demo GPT
    (``layers``/``hidden``/``heads``/``vocab`` override its 4/128/4/256).

    ``host_limit`` (bytes; None: this machine's memory limit) is what the default pinned
    budget is chosen against, as the SDK's ``ChooseHostBudget`` does (memascend Note
    [default host budget]); ``host_budget`` gives one instead. ``gpu_memory`` adds a
    verdict on the GPU estimate. ``base_rss`` is the process's fixed memory counted in the
    peak RSS.

    Returns the dict ``memascend plan --json`` prints, every figure in bytes: ``model``,
    ``memascend`` and ``zero_infinity`` (each with ``pinned_bytes``, ``pageable_bytes``,
    ``peak_rss_bytes``, ``disk_bytes``, ``io_read_bytes_per_step``,
    ``io_write_bytes_per_step``, ``io_bytes_per_step``), and ``gpu``. How each figure is
    modelled: Note [plan model] in tools/sim/plan.h, and docs/python.md.

    Raises InvalidArgumentError for a config it cannot parse, a bad size or dtype, OSError
    (FileNotFoundError...) for a config path it cannot open, ResourceExhaustedError when
    the least budget the run trains with does not fit the host limit.
    """
    text = ""
    if isinstance(config, dict):
        text = _json.dumps(config)
    elif config is not None:
        with open(config, encoding="utf-8") as f:
            text = f.read()
    if dtype not in _DTYPES:
        raise errors.InvalidArgumentError(f"dtype {dtype!r}: fp16 or bf16")
    return _json.loads(_core.plan_json(
        config_json=text, params=params, layers=layers, hidden=hidden, heads=heads,
        vocab=vocab, seq=seq, batch=batch, dtype=_DTYPES[dtype], part_elements=part_elements,
        checkpoint_activations=checkpoint_activations, host_limit=host_limit or 0,
        host_budget=host_budget or 0, gpu_memory=gpu_memory or 0, base_rss=base_rss))


__all__ = ["plan"]
