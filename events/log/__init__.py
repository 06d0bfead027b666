"""The append-only log: the interface every log honours and the in-memory log
(:mod:`.api`); the file WAL (:mod:`.format` frames and segments, :mod:`.scan`
the one scanner, :mod:`.writer` with :mod:`.commit` group commit,
:mod:`.fence` fence and spare segments and :mod:`.osops` the OS seam,
:mod:`.recovery`, :mod:`.read` readers and followers, :mod:`.verify`,
:mod:`.lock` the one-writer lock); :mod:`.partitions`; and the JetStream
backend (:mod:`.jetstream` the writer, :mod:`.jetstream_append` its append
path, :mod:`.jetstream_read` the read-only run and its logs, read through
:mod:`.jetstream_cursor`; :mod:`.jetstream_msg` records as messages,
:mod:`.jetstream_conn` the connection, :mod:`.jetstream_url` ``nats://``
URLs); :mod:`.source`: the one reader type,
:class:`~.source.LogSource`, for a log wherever it lives, opened by
:func:`~.source.open_source` (implementations in :mod:`.source_file` and
:mod:`.source_nats`)."""
