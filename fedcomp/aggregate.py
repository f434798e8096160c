"""Placeholder: implemented by the aggregation work."""


class SparseAccumulator:
    pass
