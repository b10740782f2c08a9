"""StepTrace: where a training step's time goes, as spans on lanes, for a timeline.

Opt-in and for one step at a time: give a ``StepTrace`` to ``offload_parameters``' result
(``offload.trace = trace``), call ``trace.start()`` when the step begins (after the device
is idle: ``start`` synchronises) and ``trace.finish()`` once it has ended. The hooks then
record:

- ``update``: the host's time in each group's part of the optimizer's update, which runs
  in the forward pass just before the group is loaded (Note [optimizer overlap]);
- ``load``: the host's time making each module's parameters ready (on a GPU: queuing the
  copies of a group not yet on the device, or finding it there);
- ``compute``: each module's forward (``fwd``), its recomputation under activation
  checkpointing (``recompute``) and its backward (``bwd``): on a GPU the compute stream's
  time, by CUDA events (nothing synchronised in between), else the host's;
- any span the caller adds (``trace.host(lane, name, begin, end)``, ``perf_counter``
  seconds), such as ``step`` for ``opt.step()``.

``trace.spans`` is then a list of ``(lane, name, begin, end)``, seconds from ``start()``.
Without a trace the hooks pay one attribute test. Thread-safety: the hooks' threads (the
forward pass's, autograd's), one at a time. Totals per phase, for every step, are ``opt.stats()["seconds"]`` (memascend
Note [step times])."""
from __future__ import annotations

import time

import torch


class StepTrace:
    """Spans of one step; see the module's docstring."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = device.type == "cuda"
        self.device = device
        self.spans: list[tuple[str, str, float, float]] = []
        self._events: list[tuple[str, str, object, object]] = []
        self._t0 = None
        self._anchor = None

    def start(self) -> None:
        """The step begins: the device is synchronised, and times count from here."""
        self.spans, self._events = [], []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._anchor = self.now()
        self._t0 = time.perf_counter()

    def now(self):
        """A mark on the compute lane: a CUDA event recorded on the current stream, or the
        host's time."""
        if self.cuda:  # the stream the calling thread computes on, of this trace's device
            e = torch.cuda.Event(enable_timing=True)
            e.record(torch.cuda.current_stream(self.device))
            return e
        return time.perf_counter()

    def compute(self, name: str, begin, end) -> None:
        """A span of the compute lane between two marks of now()."""
        self._events.append(("compute", name, begin, end))

    def host(self, lane: str, name: str, begin: float, end: float) -> None:
        """A span of the host's, in perf_counter seconds (none before start())."""
        if self._t0 is not None:
            self.spans.append((lane, name, begin - self._t0, end - self._t0))

    def finish(self) -> list[tuple[str, str, float, float]]:
        """The step has ended: the device is synchronised and the compute marks become
        seconds from start(). Returns the spans, sorted by their beginning."""
        if self._t0 is None:
            raise RuntimeError("StepTrace.finish() before start()")
        if self.cuda:
            torch.cuda.synchronize(self.device)
            at = lambda e: self._anchor.elapsed_time(e) / 1e3  # noqa: E731
        else:
            at = lambda t: t - self._t0  # noqa: E731
        for lane, name, begin, end in self._events:
            self.spans.append((lane, name, at(begin), at(end)))
        self._events = []
        self.spans.sort(key=lambda s: s[2])
        return self.spans
