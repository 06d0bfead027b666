"""engine: the SessionEngine runtime that drives sessions through the lifecycle and appends their events."""
