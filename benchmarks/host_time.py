"""The host's own time in one ``Pipeline.send``, by hop: what a GPU client's send costs its CPU whatever the model's
size (on a GPU the kernels run asynchronously; the host waits only at its reads of device data).

``HostTime`` is a context manager that times the send's hops (the NaN/Inf check, the running totals, the fused
steps' planning, launch and finish, the small tensors' group step, the wire encode; the acks apart) and the whole
send. Under Triton's interpreter (``TRITON_INTERPRET=1``, kernels on the CPU) the time spent inside interpreted
kernels is taken out of every figure: it is the interpreter's, where a GPU would run the kernel while the host
goes on. What is left still runs slower than it would beside a GPU (the interpreter's work between the calls
leaves the CPU's caches cold: a DGC step's host setup took 22 µs alone and about 120 µs inside such a send), so
under the interpreter compare two codes side by side, not with a GPU's figures. On a CUDA device nothing is taken
out: a launch costs the host its launch time, a host read waits for the device. Example::

    with HostTime() as host:
        for _ in range(5):
            pipe.send(grads)
            pipe.ack(pipe.last_seq)
    print(host.per_send())      # {"send": ms, "fused add": ms, ...} averaged over the sends
"""

from __future__ import annotations

import time
from collections import defaultdict

#: (label, module, owner attribute path) of each timed hop; ``send`` is the whole of ``Pipeline.send``.
HOPS = (
    ("send", "fedcomp.client.pipeline", "Pipeline.send"),
    ("non-finite check", "fedcomp.client.admit", "non_finite"),  # the name send calls (through admit)
    ("totals", "fedcomp.client.totals", "Totals.before_step"),
    ("totals", "fedcomp.client.totals", "Totals.after_step"),
    ("fused steps: plan", "fedcomp.kernels.hooks", "FusedBatch.add"),
    ("fused steps: launch", "fedcomp.kernels.hooks", "start_dgc_steps"),
    ("fused steps: finish", "fedcomp.kernels.hooks", "FusedBatch.finish"),
    ("group step: launch", "fedcomp.client.pipeline", "start_group_send"),
    ("wire encode", "fedcomp.client.pipeline", "encode_update"),
    ("ack", "fedcomp.client.pipeline", "Pipeline.ack"),
)


class HostTime:
    """Host milliseconds per hop of the sends made inside the context (see the module docstring)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.sends = 0
        self._kernel_s = 0.0  # time inside interpreted kernels so far
        self._nested_s = 0.0  # time inside timed hops so far (what an enclosing hop leaves out)
        self._undo: list[tuple[object, str, object]] = []

    def _timed(self, label: str, fn):
        def timed(*args, **kwargs):
            kernel0, nested0, start = self._kernel_s, self._nested_s, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - start - (self._kernel_s - kernel0)
                # a hop inside another (the launch inside the finish) counts once: the outer keeps its own time
                self.totals[label] += total if label == "send" else total - (self._nested_s - nested0)
                self._nested_s = nested0 + total
                if label == "send":
                    self.sends += 1
        return timed

    def _patch(self, owner, attr: str, new) -> None:
        self._undo.append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, new)

    def __enter__(self) -> HostTime:
        import importlib
        import os

        for label, module, path in HOPS:
            owner = importlib.import_module(module)
            *outer, attr = path.split(".")
            for name in outer:
                owner = getattr(owner, name)
            self._patch(owner, attr, self._timed(label, getattr(owner, attr)))
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            from triton.runtime.interpreter import InterpretedFunction

            run = InterpretedFunction.run

            def counted(fn_self, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return run(fn_self, *args, **kwargs)
                finally:
                    self._kernel_s += time.perf_counter() - start

            self._patch(InterpretedFunction, "run", counted)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, old in reversed(self._undo):
            setattr(owner, attr, old)
        self._undo.clear()

    def per_send(self) -> dict[str, float]:
        """Milliseconds per send of each hop (``send``: the whole send; ``other``: the send's time in no hop)."""
        n = max(self.sends, 1)
        out = {label: s * 1e3 / n for label, s in self.totals.items()}
        inner = sum(v for k, v in out.items() if k not in ("send", "ack"))
        out["other"] = out.get("send", 0.0) - inner
        return out
