"""The ``fedcomp`` command line and what it runs: the run check, the data-parallel runner, plots, reports."""
