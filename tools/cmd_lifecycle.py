"""`agentlog lifecycle`: print the session lifecycle as a table or Mermaid."""

from __future__ import annotations

from agentlog.events.schema.lifecycle import render_mermaid, render_table


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("lifecycle", help="show the session lifecycle (table or --mermaid)")
    p.add_argument("--mermaid", action="store_true", help="print a Mermaid stateDiagram instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    """Print the lifecycle."""
    print(render_mermaid() if args.mermaid else render_table())
    return 0
