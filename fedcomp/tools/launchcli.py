"""Command-line helpers shared by the ``flower-server`` and ``flower-client`` launchers."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """Bad flags: one line on stderr (``prog: error: ... (see --help)``) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
