"""What a client computes besides training: compressing and encoding its update, decoding the model it is sent.

The figures come from a calibration on one CPU (``benchmarks/codec_calibration.py`` writes ``CODEC_TABLE``, one
entry per model): per uplink compressor, the seconds of one ``Pipeline.send`` (error-feedback compensate,
compress, memory update, wire encode) at each density measured (sparsifiers; other compressors at one point,
density 0); per downlink mode, the seconds of one ``fedcomp.downlink.receive`` of a typical task's blob (and
the replica's save where the mode keeps one); and the seconds per training sample of the same model on the
same CPU with the same threads. A simulated device scales the codec seconds as it scales training: by
``device.s_per_sample / train_s_per_sample`` (a phone that trains 4x slower than the calibration CPU also
compresses 4x slower).

Example:
    >>> cost = CodecCost(train_s_per_sample=1e-3, uplink=((0.01, 0.02), (0.1, 0.04)), downlink_s=0.01)
    >>> cost.uplink_s(0.055)          # linear between the measured densities
    0.03
    >>> cost.scaled(4e-3).downlink_s  # a device 4x slower than the calibration CPU
    0.04
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["CODEC_TABLE", "NO_CODEC", "CodecCost", "codec_cost", "load_table"]

#: The calibration table the simulator reads (written by ``benchmarks/codec_calibration.py``).
CODEC_TABLE = Path(__file__).with_name("codec_calibration.json")


@dataclass(frozen=True)
class CodecCost:
    """A task's codec seconds on the calibration CPU, for one model, uplink compressor and downlink mode.

    ``uplink``: ``(density, seconds)`` points sorted by density (one point for a compressor without a density);
    ``uplink_s(d)`` interpolates linearly between them and holds the end values outside. ``downlink_s``: decode
    seconds per task. ``train_s_per_sample``: the model's training seconds per sample on the same CPU (the
    reference of ``scaled``). All >= 0.
    """

    train_s_per_sample: float = 0.0
    uplink: tuple[tuple[float, float], ...] = ()
    downlink_s: float = 0.0

    def __post_init__(self) -> None:
        if self.train_s_per_sample < 0 or self.downlink_s < 0 or any(s < 0 for _, s in self.uplink):
            raise ValueError("codec seconds must be >= 0")
        object.__setattr__(self, "uplink", tuple(sorted((float(d), float(s)) for d, s in self.uplink)))

    def uplink_s(self, density: float = 0.0) -> float:
        """Seconds of one compress + encode at ``density`` (ignored for a one-point compressor)."""
        pts = self.uplink
        if not pts:
            return 0.0
        ds = [d for d, _ in pts]
        i = bisect.bisect_left(ds, density)
        if i == 0:
            return pts[0][1]
        if i == len(pts):
            return pts[-1][1]
        (d0, s0), (d1, s1) = pts[i - 1], pts[i]
        return round(s0 + (s1 - s0) * (density - d0) / (d1 - d0), 9)

    def scaled(self, s_per_sample: float) -> CodecCost:
        """These seconds on a device that trains at ``s_per_sample`` (the calibration CPU: ``train_s_per_sample``).
        A cost without a training reference is returned as it is."""
        if self.train_s_per_sample <= 0:
            return self
        f = s_per_sample / self.train_s_per_sample
        return CodecCost(s_per_sample, tuple((d, s * f) for d, s in self.uplink), self.downlink_s * f)

    @property
    def charged(self) -> bool:
        return bool(self.uplink) or self.downlink_s > 0


#: No codec charge (the clock without a calibration, or with ``sim.codec = "off"``).
NO_CODEC = CodecCost()


@lru_cache(maxsize=4)
def load_table(path: str | Path = CODEC_TABLE) -> Mapping[str, Any]:
    """The calibration table (``{"models": {MODEL: {"train_s_per_sample", "uplink": {COMPRESSOR: {DENSITY: s}},
    "downlink": {MODE: s}}}, ...}``); an empty one when the file is missing."""
    p = Path(path)
    if not p.is_file():
        return {"models": {}}
    return json.loads(p.read_text())


def codec_cost(
    model: str, compressor: str, downlink: str, table: Mapping[str, Any] | None = None, options: str = ""
) -> CodecCost | None:
    """The calibrated ``CodecCost`` of ``model`` (built with ``options``) sending with ``compressor`` and
    receiving ``downlink``; None when the table lacks the model, the compressor or the downlink mode (the caller
    decides what to do). A model built with options that change what the codec works on (a wider ``mlp``) has an
    entry of its own, keyed ``NAME:OPTIONS``: it is taken when ``options`` name it; otherwise the entry ``NAME``.

    Example:
        >>> t = {"models": {"m": {"train_s_per_sample": 1e-4, "uplink": {"int8": {"0": 0.01}},
        ...                       "downlink": {"dense": 0.002}},
        ...                 "m:hidden=64": {"train_s_per_sample": 1e-3, "uplink": {"int8": {"0": 0.1}},
        ...                                 "downlink": {"dense": 0.02}}}}
        >>> codec_cost("m", "int8", "dense", t).uplink_s(), codec_cost("m", "dgc", "dense", t)
        (0.01, None)
        >>> codec_cost("m", "int8", "dense", t, options="hidden=64").uplink_s()
        0.1
    """
    models = (table if table is not None else load_table()).get("models", {})
    entry = models.get(f"{model}:{options.strip()}") if options.strip() else None
    if entry is None:
        entry = models.get(model)
    if entry is None:
        return None
    up = entry.get("uplink", {}).get(compressor)
    down = entry.get("downlink", {}).get(downlink)
    if up is None or down is None:
        return None
    points = tuple((float(d), float(s)) for d, s in up.items())
    return CodecCost(float(entry["train_s_per_sample"]), points, float(down))
