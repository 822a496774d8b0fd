"""The one exception the FTW package raises: its message is meant for the user, naming file and tensor."""
from __future__ import annotations


class FTWError(Exception):
    """A problem with a checkpoint or an FTW package, worded for the person who has to fix it."""
