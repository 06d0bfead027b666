"""The event schema: the schema-v1 event types and their validation
(:mod:`.types`, with what the checks share in :mod:`.validation` and token
packing in :mod:`.packing`), the session lifecycle grammar (:mod:`.lifecycle`)
and the turn encoding: the two turn bodies and the fields they share
(:mod:`.turn`), and the delta conversion between them (:mod:`.turn_delta`).
Pure data: nothing here does I/O or imports the log."""
