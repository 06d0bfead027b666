"""Where each turn's output sits in a linearised training row (read-only, for viewers).

A row (:class:`reducers.trajectory.Row`) is built by appending its turns
(``turn_indices``) in order, and after each append the row holds exactly that
turn's prompt followed by its output (the builder's invariant, see
:class:`reducers.trajectory._RowBuilder`). So turn k's output starts at row
position ``prompt_tokens(k)``. A later turn can only change those positions by
a REALIGN, which overwrites them from its own prompt; when the row still holds
the output's exact tokens there, and the next turn's prompt starts at or after
the output's end, the next turn extended the row (CLEAN), so the span is the
turn's own. The context cut (``max_context_tokens``) shortens the last spans.

:func:`turn_output_spans` gives those spans in one linear pass over the row.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence


class OutputSpan(NamedTuple):
    """Tokens of a row that one turn generated."""

    turn: int  #: the turn's index
    start: int  #: first row position (prompt + response positions)
    length: int  #: how many tokens (the cut may have shortened the output)


def turn_output_spans(tokens: bytes, turn_indices: Sequence[int], turns: Mapping[int, tuple[int, bytes]]) -> list[OutputSpan]:
    """The spans of the row ``tokens`` (int32 LE) that the row's turns (``turn_indices``, in
    row order) generated, in row order; ``turns`` maps a turn index to (its prompt token count,
    its ``output_ids`` as int32 LE bytes). A turn missing from ``turns``, or whose output a later
    turn realigned away, contributes no span."""
    n_tokens = len(tokens) // 4
    view = memoryview(tokens)
    spans: list[OutputSpan] = []
    for k, t in enumerate(turn_indices):
        info = turns.get(t)
        if info is None:
            continue
        start, out = info
        n_out = len(out) // 4
        if not n_out or start >= n_tokens:
            continue
        nxt = turns.get(turn_indices[k + 1]) if k + 1 < len(turn_indices) else None
        if nxt is not None and nxt[0] < start + n_out:
            continue  # the next turn's prompt ends inside this output: realigned away
        length = min(n_out, n_tokens - start)
        if view[start * 4 : (start + length) * 4] != out[: length * 4]:
            continue  # realigned: the row holds the next prompt's tokens there
        spans.append(OutputSpan(t, start, length))
    return spans
