"""The event schema: the schema-v1 event types and their validation
(:mod:`.types`), the session lifecycle grammar (:mod:`.lifecycle`) and the
delta encoding of turns (:mod:`.turn_delta`). Pure data: nothing here does
I/O or imports the log."""
