"""`agentlog ui`: a read-only local web app over a run (finished or live).

:mod:`.index` keeps an on-disk SQLite index of the sessions (built
progressively and reused), :mod:`.views` builds the JSON of each view with
the project's reducers, :mod:`.server` serves both (aiohttp, SSE) with the
static frontend in ``static/``.
"""
