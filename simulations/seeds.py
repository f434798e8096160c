"""One scenario over several seeds: each figure as mean (min–max) over the seeds.

A seed changes the data partition, the model's initialisation, the clients' batches, the links' faults and where
the server's reads land (``simulations.scenario``: ``seed``). ``aggregate`` takes each seed's results (every
method run on that seed, with its speed-ups against the baseline and ``compare_to`` methods of the same seed:
paired ratios) and gives one row per method: every figure of ``FIGURES`` as ``{"mean", "min", "max", "n",
"per_seed"}`` over the seeds where it exists (a time to target a seed never reached is ``None`` there and
``n`` counts the others), and per link the mean of each part of a task's time.

Example:
    >>> rows = aggregate({0: [{"method": "a", "accuracy": 0.90, "speedup": 2.0}],
    ...                   1: [{"method": "a", "accuracy": 0.92, "speedup": None}]})
    >>> rows[0]["accuracy"]["mean"], rows[0]["speedup"]["n"], mean_min_max(rows[0]["accuracy"], 4)
    (0.91, 1, '0.9100 (0.9000–0.9200)')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: The figures aggregated over seeds (besides every ``speedup_vs_NAME``; names: ``fedcomp.tools.summary``).
FIGURES = ("accuracy", "best_accuracy", "delta_accuracy", "time_to_target_s", "speedup", "versions", "virtual_s",
           "wire_bytes_up", "wire_bytes_down", "wire_bytes_total", "task_compute_s", "task_codec_s",
           "task_transfer_s", "task_latency_s", "task_total_s", "wall_s")
#: What identifies a method's row (the same on every seed).
KEYS = ("method", "mode", "compressor", "downlink", "worker", "superexec_poll_s", "codec_calibrated")


def stats(values: Sequence[float | None]) -> dict[str, Any]:
    """``{"mean", "min", "max", "n", "per_seed"}`` of the values that are not None (``None``s when none is)."""
    have = [float(v) for v in values if v is not None]
    if not have:
        return {"mean": None, "min": None, "max": None, "n": 0, "per_seed": list(values)}
    return {"mean": round(sum(have) / len(have), 4), "min": min(have), "max": max(have), "n": len(have),
            "per_seed": list(values)}


def mean_min_max(s: Mapping[str, Any], digits: int = 2, of: int | None = None) -> str:
    """``"mean (min–max)"``; ``"-"`` when no seed has the figure; `` [n/of]`` when only some have it."""
    if s.get("mean") is None:
        return "-"
    f = f"{{:.{digits}f}}"
    text = f"{f.format(s['mean'])} ({f.format(s['min'])}–{f.format(s['max'])})"
    return text if of is None or s["n"] == of else f"{text} [{s['n']}/{of}]"


def aggregate(per_seed: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per method (in the first seed's order) from each seed's summary rows (``MethodResult.summary``)."""
    seeds = sorted(per_seed)
    by_seed = {s: {row["method"]: row for row in per_seed[s]} for s in seeds}
    names = [row["method"] for row in per_seed[seeds[0]]]
    ratios = sorted({k for rows in per_seed.values() for r in rows for k in r if k.startswith("speedup_vs_")})
    out = []
    for name in names:
        rows = [by_seed[s].get(name, {}) for s in seeds]
        row: dict[str, Any] = {k: rows[0].get(k) for k in KEYS}
        row["seeds"] = seeds
        for fig in (*FIGURES, *ratios):
            row[fig] = stats([r.get(fig) for r in rows])
        out.append(row)
    return out


def split_by_link(per_seed: Mapping[int, Mapping[str, Mapping[str, Mapping[str, float]]]]) -> dict[str, Any]:
    """Method -> link -> each part of a task's mean time (``runner.split_summary``), averaged over the seeds where
    that link delivered a task (``None`` where it delivered none on any seed)."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for splits in per_seed.values():
        for method, links in splits.items():
            for link, parts in links.items():
                acc = out.setdefault(method, {}).setdefault(link, {})
                for k, v in parts.items():
                    acc.setdefault(k, []).extend([] if v is None else [v])
    return {m: {link: {k: round(sum(v) / len(v), 3) if v else None for k, v in parts.items()}
                for link, parts in links.items()} for m, links in out.items()}


def flat(row: Mapping[str, Any]) -> dict[str, Any]:
    """A CSV row: the keys as they are, each aggregated figure as ``FIG`` (``mean (min–max)``), ``FIG_mean``,
    ``FIG_min``, ``FIG_max`` and ``FIG_n``."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, Mapping) and "mean" in v:
            out[k] = mean_min_max(v, 4)
            out.update({f"{k}_{p}": v[p] for p in ("mean", "min", "max", "n")})
        elif isinstance(v, list):
            out[k] = " ".join(map(str, v))
        else:
            out[k] = v
    return out
