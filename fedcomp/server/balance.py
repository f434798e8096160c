"""Participation balance for asynchronous aggregation: an update's weight grows for nodes that are applied less
often than the average node, and shrinks for those applied more often.

Why: in async mode a fast node has many more updates applied than a slow one, so the model follows the fast
nodes' data (on non-IID partitions, a bias that sync rounds do not have). With ``balance = B > 1`` the server
multiplies the staleness weight of node ``i``'s update by

    clip((mean applied + 1) / (applied_i + 1), 1 / B, B)

where ``applied_i`` counts node ``i``'s updates applied so far and the mean is over every node the server has
sent a task to (both from the ledger, so a resumed server goes on with the same counts). ``B = 1`` (the default)
leaves every weight as it was. The factor never changes which replies are accepted, only how much they count;
the staleness bound still decides what is too old (a slow node's updates count only if ``max-staleness`` admits
them).

>>> balance_factor(applied=9, mean_applied=4.0, bound=4.0)   # a fast node: half the weight
0.5
>>> balance_factor(applied=0, mean_applied=9.0, bound=4.0)   # a slow node: capped at 4
4.0
>>> balance_factor(applied=0, mean_applied=9.0, bound=1.0)   # off
1.0
"""

from __future__ import annotations


def balance_factor(applied: int, mean_applied: float, bound: float) -> float:
    """``clip((mean_applied + 1) / (applied + 1), 1 / bound, bound)``; ``bound >= 1`` (1 = no balancing)."""
    if bound <= 1.0:
        return 1.0
    return min(max((mean_applied + 1.0) / (max(applied, 0) + 1.0), 1.0 / bound), bound)
