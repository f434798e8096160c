"""What one ``Pipeline.send`` asks of the host and the device, counted without a GPU: host reads of device data (each
one a synchronisation on a CUDA device), shape-dependent ops (their output size is read back: a synchronisation
too), torch ops and Triton kernel launches.

``SendCounts`` is a context manager: inside it every call is counted, and ``table()`` lists them with the source
line in ``fedcomp`` that made each host read::

    with SendCounts(device) as counts:
        pipe.send(grads)
    print(counts.summary())

What counts as a host read: ``item``, ``tolist``, ``cpu``, ``numpy``, ``int()``/``float()``/``bool()``/``index``
of a tensor on ``device`` (under Triton's interpreter the device is the CPU: draws from a host generator are
left out, as on a GPU, and the table's call sites tell any other host tensor apart), and a copy from ``device``
to the host. Shape-dependent ops: ``nonzero`` (and boolean indexing, which runs it), ``masked_select``,
``unique``, ``repeat_interleave`` without ``output_size``. Host data copied to the device without
``non_blocking`` (the host waits for the device: ``torch.tensor(list, device=...)``; under the interpreter the
``torch.tensor``/``torch.as_tensor`` calls given the device, and ``to`` of a host draw). Torch ops: every aten
op with a tensor on ``device`` among its outputs (views counted apart; not the interpreter's own). Launches: every
run of a Triton kernel of ``fedcomp.kernels`` (compiled or interpreted).
"""

from __future__ import annotations

import collections
import importlib
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

#: Tensor methods that read device data on the host.
HOST_READS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"}
#: aten ops whose output size depends on the data (the host reads it back to allocate).
SHAPE_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                   "unique_dim"}
KERNEL_MODULES = ("_triton_dgc", "_triton_dgc_multi", "_triton_quant", "_triton_encode", "_triton_scatter")
_PACKAGE = str(Path(__file__).resolve().parents[1] / "fedcomp")


def _call_site() -> str:
    """The innermost ``fedcomp`` source line on the stack (``file:line function``)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(_PACKAGE):
            return f"{Path(frame.filename).relative_to(Path(_PACKAGE).parent)}:{frame.lineno} {frame.name}"
    return "(outside fedcomp)"


def _in_interpreter() -> bool:
    """Whether the current op runs inside Triton's interpreter (its own copies are not the send's ops)."""
    frame = sys._getframe(2)
    while frame is not None:
        if "triton/runtime/interpreter" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _is_view(func) -> bool:
    """Whether the aten op returns a view of an input (``OpOverload.is_view``, or its schema where torch lacks it)."""
    flag = getattr(func, "is_view", None)
    if flag is not None:
        return bool(flag)
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class _Reads(TorchFunctionMode):
    def __init__(self, owner: SendCounts) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if func in (torch.tensor, torch.as_tensor) and self.owner.device.type == "cpu":
            dev = (kwargs or {}).get("device")
            if dev is not None and torch.device(dev).type == "cpu" and args and not isinstance(args[0], torch.Tensor):
                # on a GPU: host data copied from pageable memory, which waits for the device (``_Ops`` counts it)
                self.owner.reads[f"h2d  {_call_site()}"] += 1
        if (name == "to" and self.owner.device.type == "cpu" and args and isinstance(args[0], torch.Tensor)
                and args[0] in self.owner.host_made and not (kwargs or {}).get("non_blocking")):
            # a host draw moved to the device, waiting for it
            self.owner.reads[f"h2d  {_call_site()}"] += 1
        if name == "cpu" and self.owner.device.type != "cpu":
            pass  # a device tensor's copy to the host is counted where it dispatches (``_Ops``)
        elif (name in HOST_READS and args and isinstance(args[0], torch.Tensor) and self.owner.on_device(args[0])
              and args[0] not in self.owner.host_made):
            self.owner.reads[f"{name}  {_call_site()}"] += 1
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, owner: SendCounts) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _in_interpreter():
            return out
        base = func.overloadpacket.__name__
        owner = self.owner
        outs = out if isinstance(out, (tuple, list)) else (out,)
        gen = kwargs.get("generator")
        if gen is not None and gen.device.type == "cpu":  # a draw from a host generator: a host tensor anywhere
            for t in outs:
                if isinstance(t, torch.Tensor):
                    owner.host_made[t] = True
            return out
        if any(isinstance(t, torch.Tensor) and owner.on_device(t) for t in outs):
            (owner.views if _is_view(func) else owner.ops)[base] += 1
        if base in SHAPE_DEPENDENT or (base == "repeat_interleave" and kwargs.get("output_size") is None
                                       and len(args) < 4):
            owner.reads[f"{base} (shape)  {_call_site()}"] += 1
        if owner.device.type != "cpu" and base in ("_to_copy", "copy_"):
            src = args[1] if base == "copy_" else args[0]
            dst = args[0] if base == "copy_" else out
            if isinstance(src, torch.Tensor) and owner.on_device(src) and dst.device.type == "cpu":
                owner.reads[f"{base} to host  {_call_site()}"] += 1
            blocking = not (kwargs.get("non_blocking") or (base == "copy_" and len(args) > 2 and args[2]))
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and owner.on_device(dst) and blocking:
                owner.reads[f"h2d  {_call_site()}"] += 1
        return out


class SendCounts:
    """Counts of host reads, torch ops on ``device`` and Triton launches inside a ``with`` block."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.reads: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()
        self.views: collections.Counter[str] = collections.Counter()
        self.launches: collections.Counter[str] = collections.Counter()
        self._hooked: list = []
        self.hooks_found = False
        #: Tensors drawn from a host generator (host tensors on a GPU too: reading them is no synchronisation).
        self.host_made: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type

    def _launch_hook(self, name: str):
        def hook(*args, **kwargs) -> None:
            self.launches[name] += 1
        return hook

    def __enter__(self) -> SendCounts:
        for mod_name in KERNEL_MODULES:
            mod = importlib.import_module(f"fedcomp.kernels.{mod_name}")
            for attr, obj in vars(mod).items():
                if hasattr(obj, "pre_run_hooks") and hasattr(obj, "add_pre_run_hook"):
                    hook = self._launch_hook(attr)
                    obj.add_pre_run_hook(hook)
                    self._hooked.append((obj, hook))
        self.hooks_found = bool(self._hooked)
        self._modes = [_Reads(self), _Ops(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        for obj, hook in self._hooked:
            obj.pre_run_hooks.remove(hook)
        self._hooked = []

    def totals(self) -> dict[str, int]:
        return {"host_reads": sum(self.reads.values()), "launches": sum(self.launches.values()),
                "torch_ops": sum(self.ops.values()), "views": sum(self.views.values())}

    def summary(self, top: int = 12) -> str:
        t = self.totals()
        lines = [f"host reads {t['host_reads']}, Triton launches {t['launches']}, torch ops on the device "
                 f"{t['torch_ops']} (+ {t['views']} views)"]
        lines += [f"    {n:>4}  {site}" for site, n in self.reads.most_common(top)]
        hooked = "" if self.hooks_found else " (not counted: no Triton pre-run hooks)"
        lines.append("    launches: " + ", ".join(f"{k} {n}" for k, n in self.launches.most_common()) + hooked)
        lines.append("    top ops: " + ", ".join(f"{k} {n}" for k, n in self.ops.most_common(top)))
        return "\n".join(lines)
