"""`agentlog ui SOURCE [--host H] [--port P] [--token T] [--index PATH] [--no-browser] [-q]`:
a read-only local web app over a run, finished or live (:mod:`tools.ui.server`).

SOURCE is what the other reading commands take: a run folder, a log
directory or a ``nats://host:port/stream`` URL. It serves on 127.0.0.1 unless
``--host`` names another address, which needs ``--token`` (every request must
then carry it). The session index is kept on disk (default
``<run>/.agentlog-ui/index.sqlite``; for a nats:// source under the user's
cache directory) and reused by the next start. Prints the URL and serves
until Ctrl-C; it never opens a browser itself (``--no-browser`` is accepted
for scripts that pass it).
"""

from __future__ import annotations

import asyncio
import signal
import sys

from agentlog.tools.cli import EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import add_quiet, tcp_port


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("ui", help="a read-only local web app over a run (finished or live): sessions, tokens, groups, steps")
    p.add_argument("source", metavar="SOURCE", help="a run folder, a log directory or nats://host:port/stream")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; another one needs --token)")
    p.add_argument("--port", type=tcp_port, default=8765, metavar="P", help="port to bind (default 8765; 0: any free port)")
    p.add_argument("--token", default=None, metavar="T", help="require this token on every request (Bearer header or ?token=)")
    p.add_argument("--index", default=None, metavar="PATH", help="the session index file (default <run>/.agentlog-ui/index.sqlite)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser (the default: only the URL is printed)")
    add_quiet(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Serve until interrupted."""
    from agentlog.tools.ui.server import UiServer

    terminated = []

    async def main() -> None:
        # SIGTERM (a service manager, or a parent whose background children ignore SIGINT) stops
        # the server as Ctrl-C does: this task is cancelled and the server closes its index.
        task = asyncio.current_task()
        assert task is not None

        def on_sigterm() -> None:
            terminated.append(True)
            task.cancel()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
        ui = UiServer(args.source, token=args.token, index_path=args.index, host=args.host, quiet=args.quiet)
        try:
            url = await ui.start(args.port)
        except OSError as exc:
            await ui.stop()
            raise CliError(f"ui: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
                           f" (another server there?); give --port P for another port, or --port 0 for any free one",
                           EXIT_USAGE) from None
        shown = f"{url}/?token={args.token}" if args.token else f"{url}/"
        print(f"agentlog ui: serving {args.source} at {shown}  (index {ui.index.path}; Ctrl-C stops)", flush=True)
        try:
            await ui.caught_up(timeout_s=float("inf"))
            ix = ui.index
            how = ("rebuilt: " + ix.rebuilt_why) if ix.rebuilt_why else ("resumed" if ix.resumed else "built")
            print(f"agentlog ui: index {how}: {ix.count()} sessions, built to {ix.built_to}, {ix.records_read} records read"
                  f" in {ix.build_s:.2f} s", file=sys.stderr, flush=True)
            assert ui.follower is not None
            await ui.follower  # runs until cancelled (Ctrl-C, SIGTERM); a crash raises here after /api/run reported it
        finally:
            await ui.stop()

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        if not terminated:
            raise
    return EXIT_OK
