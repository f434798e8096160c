"""The wrapped strategy's own server state, kept in an async run's checkpoint.

``Compressed(strategy, mode="async")`` calls the wrapped strategy's ``aggregate_train`` once per model version,
and some stock strategies keep state between those calls: FedAvgM its server momentum, FedAdam / FedYogi /
FedAdagrad their moments. A checkpoint that held only the model would restart them at zero on ``resume=``, so a
resumed run would not be the run it continues. ``STRATEGY_STATE`` names, per strategy class (exact types, as
``options.WEIGHTED_MEAN_STRATEGIES``: a subclass may keep more), the attributes ``aggregate_train`` and
``configure_train`` change (read from flwr 1.41's ``flwr/serverapp/strategy`` sources; a test checks, on flwr
1.41 and 1.42, that no other attribute changes, so a Flower release that adds state fails there, not in a user's
resumed run).

The contract: ``save(strategy)`` returns those attributes as a ``torch.load(weights_only=True)``-safe dict
(each value ``None``, an ``ArrayRecord``, a list or a dict of numpy arrays, exactly: dtypes and key order kept);
``restore(strategy, state)`` puts them back, ``ConfigError`` when the state was saved for another class. A
strategy class not in ``STRATEGY_STATE`` cannot be checkpointed (``check``: ``ConfigError``), never saved
without its state.

    >>> from flwr.serverapp.strategy import FedAvgM
    >>> s = FedAvgM(server_momentum=0.9)
    >>> restore(s, save(s)); STRATEGY_STATE[FedAvgM]
    ('current_arrays', 'momentum_vector')
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedProx, FedYogi

from fedcomp.registry import ConfigError

_OPT = ("current_arrays", "m_t", "v_t")  # FedOpt: the model it steps from, the first and second moments
#: Per strategy class: the attributes that hold its server state between rounds (empty: stateless).
STRATEGY_STATE: dict[type, tuple[str, ...]] = {
    FedAvg: (),
    FedProx: (),
    FedAvgM: ("current_arrays", "momentum_vector"),  # the model it steps from, the server momentum
    FedAdam: _OPT,
    FedYogi: _OPT,
    FedAdagrad: _OPT,
}


def check(strategy: object) -> tuple[str, ...]:
    """The state attributes of ``strategy``'s class; ``ConfigError`` when they are not known."""
    names = STRATEGY_STATE.get(type(strategy))
    if names is None:
        raise ConfigError(
            f"checkpoint_every / resume: the server state {type(strategy).__name__} keeps between rounds is not "
            f"known (fedcomp.flower.strategystate.STRATEGY_STATE: {', '.join(t.__name__ for t in STRATEGY_STATE)}), "
            "so a checkpoint could not hold it: run without checkpoint_every and resume"
        )
    return names


def save(strategy: object) -> dict[str, Any]:
    """``{"class": name, "state": {attribute: encoded value}}`` of ``strategy`` (``check`` first)."""
    return {"class": type(strategy).__name__,
            "state": {n: _encode(getattr(strategy, n, None)) for n in check(strategy)}}


def restore(strategy: object, saved: dict[str, Any]) -> None:
    """Set ``strategy``'s state attributes from ``save``'s dict; ``ConfigError`` if it was saved for another class
    or lacks one of them."""
    names, cls = check(strategy), type(strategy).__name__
    if saved.get("class") != cls:
        raise ConfigError(f"resume: the checkpoint holds the state of {saved.get('class')!r}, this run wraps {cls}")
    state = saved.get("state", {})
    missing = [n for n in names if n not in state]
    if missing:
        raise ConfigError(f"resume: the checkpoint lacks {cls}'s {', '.join(missing)}")
    for n in names:
        setattr(strategy, n, _decode(state[n]))


def _tensor(a: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True))


def _encode(value: Any) -> dict[str, Any]:
    if value is None:
        return {"kind": "none"}
    if isinstance(value, ArrayRecord):
        return {"kind": "record", "keys": list(value.keys()), "arrays": [_tensor(value[k].numpy()) for k in value]}
    if isinstance(value, dict):
        return {"kind": "dict", "keys": list(value.keys()), "arrays": [_tensor(v) for v in value.values()]}
    if isinstance(value, (list, tuple)):
        return {"kind": "list", "arrays": [_tensor(v) for v in value]}
    raise ConfigError(f"strategy state of type {type(value).__name__} cannot be checkpointed")


def _decode(enc: dict[str, Any]) -> Any:
    kind = enc["kind"]
    if kind == "none":
        return None
    arrays = [t.numpy() for t in enc["arrays"]]
    if kind == "record":
        return ArrayRecord({k: Array(a) for k, a in zip(enc["keys"], arrays, strict=True)})
    if kind == "dict":
        return dict(zip(enc["keys"], arrays, strict=True))
    if kind == "list":
        return arrays
    raise ConfigError(f"resume: unknown strategy state kind {kind!r}")
