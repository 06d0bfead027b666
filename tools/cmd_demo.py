"""`agentlog demo`: the online training loop on embedded defaults."""

from __future__ import annotations


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("demo", help="run the online training demo")
    p.set_defaults(func=run)


def run(args) -> int:
    """Placeholder until the online loop lands."""
    print("agentlog demo: the online training loop arrives with the online-loop issue (#7).")
    return 0
