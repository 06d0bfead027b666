"""A session's turn tree and its linearisation into training rows.

The semantics follow slime's TrajectoryManager (slime/agent/trajectory.py):

* **Routing.** Each turn's prompt messages are matched down a message tree by
  role and message equality (token ids play no part in routing). The
  unmatched rest is mounted as routing-only nodes, and a generated assistant
  leaf holding the turn hangs below. An assistant message the client replays
  but we never generated is routing-only. When the next prompt rewrites the
  mount point's single generated assistant leaf (shorter than
  ``fork_threshold``), the rewrite replaces that leaf's message and the old
  turn becomes routing-only, never trained.
* **Leaves** are taken depth-first in insertion order. A response shared by
  several leaves is trained on the first leaf only and is mask-0 context on
  the others.
* **Token drift** of a turn's ``prompt_ids`` against the tokens a row holds:
  CLEAN (the prompt extends them), REALIGN (divergence inside the last
  response and this output strictly shorter than ``fork_threshold``: that
  span is overwritten from the prompt with mask 0 and log-prob 0), FORK
  (anything else: a new row starts).

**Lineages.** A session whose agent spawns subagents holds several
conversations (:mod:`agentlog.events.schema.lineage`); each turn names its
lineage and each lineage has a tree of its own (:mod:`.turn_tree`). Rows are
built per lineage, in the order the lineages began, and name their lineage:
a subagent's turns never fork its parent's trajectory, and the parent's
trajectory stays one row across them. A turn_delta still expands against the
session's previous turn in log order, whichever lineage that was.

Unlike slime the tree is never consumed: :meth:`SessionTrajectory.linearise`
can run any number of times and gives the same rows. A turn is trainable only
if it finished ``stop`` or ``length``, has one log-prob per output token and
was delivered (no ``turn_undelivered``). Turns that carry no messages (token-
only agents) are chained onto the previous generated turn, so token drift
alone decides their rows.

Token arrays stay packed little-endian bytes throughout: prefix checks are
``bytes.startswith`` and spans are slice assignments, so no per-token Python
runs on the hot path.
"""

from __future__ import annotations

from typing import Any

import msgspec

from msgspec import UNSET

from agentlog.events.schema.lineage import Lineage, turn_lineage
from agentlog.events.schema.turn_delta import TurnContext, TurnDeltaError
from agentlog.events.schema.types import TeacherScored, TurnDelta, TurnRecorded

from .row_builder import CLEAN, FORK, REALIGN, Row, RowBuilder  # noqa: F401 - Row and the drift kinds are public here
from .teacher import TeacherScores
from .turn_tree import MessageTree, TrajectoryError  # noqa: F401 - TrajectoryError is public here


#: Why a turn contributes no trainable token.
REASON_ABORT_FINISH = "finish_abort"
REASON_MISSING_LOG_PROBS = "missing_log_probs"
REASON_EMPTY_OUTPUT = "empty_output"
REASON_UNDELIVERED = "undelivered"
REASON_REWRITTEN = "rewritten"


class TurnDecision(msgspec.Struct):
    """What the reducer decided about one turn; ``agentlog show`` displays it."""

    turn_index: int
    lsn: int
    #: How the prompt was routed: ``matched`` (the whole prompt matched
    #: existing nodes), ``mounted`` (new routing-only nodes were added),
    #: ``merged_rewrite`` (the prompt rewrote the previous short leaf),
    #: ``linear`` (no messages: chained onto the previous turn).
    routing: str = ""
    #: Routing-only nodes this turn's prompt added to the tree.
    mounted_nodes: int = 0
    #: clean / realign / fork; "" while unplaced or for a rewritten turn.
    drift: str = ""
    #: Whether the turn's own tokens can carry loss at all.
    trainable: bool = False
    #: Why not, when not trainable ("" otherwise).
    reason: str = ""
    #: Leaf (depth-first order) on which the turn was first linearised.
    leaf: int = -1
    #: Index among the session's emitted rows where the turn's output is
    #: trained or first appears; -1 when that row was not emitted.
    row: int = -1
    #: Whether its output carries mask 1 in that row (a later REALIGN or the
    #: max_context_tokens cut can mask a trainable turn again).
    trained: bool = False


class Trajectory(msgspec.Struct, frozen=True):
    """A linearised session: its rows and one decision per turn."""

    rows: tuple[Row, ...]
    decisions: tuple[TurnDecision, ...]  # by turn_index


class _Turn:
    """A recorded turn. ``body`` is the stored event: a turn_recorded, or a
    turn_delta whose prompt is ``base``'s (the previous turn in log order)
    prompt + output cut to ``shared_tokens``, then ``new_prompt_ids``. So a
    session's turns hold its new tokens only, O(current context), and
    :meth:`prompt` rebuilds a prompt when linearisation needs it."""

    __slots__ = ("index", "body", "base", "lsn", "undelivered", "decision")

    def __init__(self, body: TurnRecorded | TurnDelta, lsn: int, base: "_Turn | None") -> None:
        self.index = body.turn_index
        self.body = body
        self.base = base if type(body) is TurnDelta else None
        self.lsn = lsn
        self.undelivered: str | None = None
        self.decision = TurnDecision(turn_index=body.turn_index, lsn=lsn)

    def prompt(self, cache: dict[int, bytes]) -> bytes:
        """The full prompt token ids; ``cache`` (turn index -> prompt) holds
        the prompts rebuilt during one linearisation."""
        body = self.body
        if type(body) is not TurnDelta:
            return body.prompt_ids
        if not body.shared_tokens:
            return body.new_prompt_ids
        # Walk back to a turn whose prompt is known, then forward: no recursion.
        chain: list[_Turn] = []
        turn: _Turn = self
        while type(turn.body) is TurnDelta and turn.body.shared_tokens and turn.index not in cache:
            chain.append(turn)
            assert turn.base is not None  # expand() checked the delta against it
            turn = turn.base
        prompt = cache[turn.index] if turn.index in cache else turn.prompt(cache)
        for later in reversed(chain):
            d = later.body
            prompt = (prompt + turn.body.output_ids)[: d.shared_tokens * 4] + d.new_prompt_ids
            cache[later.index] = prompt
            turn = later
        return prompt

    def untrainable_reason(self) -> str:
        body = self.body
        if self.undelivered is not None:
            return REASON_UNDELIVERED
        if body.finish_reason not in ("stop", "length"):
            return REASON_ABORT_FINISH
        if not body.output_ids:
            return REASON_EMPTY_OUTPUT
        if len(body.output_log_probs) != len(body.output_ids):
            return REASON_MISSING_LOG_PROBS
        return ""


class SessionTrajectory:
    """One session's message tree, built turn by turn as events arrive."""

    def __init__(self, session_id: str, fork_threshold: int = 1024) -> None:
        self.session_id = session_id
        self.fork_threshold = fork_threshold
        self._turns: dict[int, _Turn] = {}
        #: One message tree per lineage (conversation thread), in the order they began.
        self._trees: dict[str, MessageTree] = {}
        #: Each lineage's first-turn record (its parent and spawning call), None for a root.
        self.lineages: dict[str, Lineage | None] = {}
        self.output_tokens = 0
        #: Teacher scores of the turns (on-policy distillation), aligned to rows when they are built.
        self.teacher = TeacherScores(session_id)
        # The previous turn's prompt + output and messages + response: what a
        # turn_delta expands against (O(current context)).
        self._context = TurnContext()
        self._prev_turn: _Turn | None = None  # in log order: what the next delta's base is
        self._held_tokens = 0  # the previous turn's prompt + output tokens

    @property
    def n_turns(self) -> int:
        """Turns recorded so far."""
        return len(self._turns)

    def turn_sampling(self, turn_index: int) -> dict[str, Any]:
        """The ``sampling`` dict recorded with a turn (what rows' samples carry)."""
        return self._turns[turn_index].body.sampling

    # -------------------------------------------------------------- routing

    def record_turn(self, body: TurnRecorded | TurnDelta, lsn: int) -> TurnDecision:
        """Route one turn into the tree; returns its (still open) decision. A
        turn_delta is first expanded, against the previous turn, into the
        full turn it stands for: the tree sees the same turn either way."""
        if body.turn_index in self._turns:
            raise TrajectoryError(
                f"session {self.session_id!r}, lsn {lsn}: turn_index {body.turn_index} recorded twice"
                f" (first at lsn {self._turns[body.turn_index].lsn})"
            )
        if type(body) is TurnDelta:
            # Only the messages are expanded here (routing needs them); the
            # prompt tokens are rebuilt when the session is linearised.
            try:
                messages = self._context.expand_messages(body, f"session {self.session_id!r}, lsn {lsn}: ", self._held_tokens)
            except TurnDeltaError as exc:
                raise TrajectoryError(str(exc)) from None
            n_prompt = body.shared_tokens + len(body.new_prompt_ids) // 4
        else:
            messages = body.messages
            n_prompt = len(body.prompt_ids) // 4
        turn = _Turn(body, lsn, self._prev_turn)
        lineage = turn_lineage(body)
        tree = self._trees.get(lineage)
        if tree is None:
            tree = MessageTree(lineage, self.fork_threshold)
        tree.route(turn, messages, f"session {self.session_id!r}, lsn {lsn}")
        if lineage not in self._trees:  # added only once its first turn routed
            self._trees[lineage] = tree
            origin = getattr(body, "lineage", UNSET)
            self.lineages[lineage] = origin if origin is not UNSET and origin.spawned else None
        self._turns[turn.index] = turn
        self._prev_turn = turn
        # What the next delta expands against: these messages + the response,
        # and how many tokens the prompt + output held (the tokens themselves
        # stay in the turns).
        held = list(messages)
        if body.response_message is not None:
            held.append(body.response_message)
        self._context = TurnContext(b"", held)
        self._held_tokens = n_prompt + len(body.output_ids) // 4
        self.output_tokens += len(body.output_ids) // 4
        return turn.decision

    def record_teacher(self, body: TeacherScored, lsn: int) -> None:
        """A teacher's scores of one turn (TeacherScoreError when they cannot belong to it)."""
        turn = self._turns.get(body.turn_index)
        self.teacher.record(body, lsn, None if turn is None else len(turn.body.output_ids) // 4,
                            None if turn is None else turn.body.sampling)

    def mark_undelivered(self, turn_index: int, reason: str, lsn: int) -> None:
        """The turn's response never reached the agent: it is not trained."""
        turn = self._turns.get(turn_index)
        if turn is None:
            raise TrajectoryError(
                f"session {self.session_id!r}, lsn {lsn}: turn_undelivered for turn_index {turn_index},"
                f" but the session recorded only turns {sorted(self._turns)[:20]}"
            )
        turn.undelivered = reason or "undelivered"

    # -------------------------------------------------------- linearisation

    def linearise(self, max_context_tokens: int = 0, allow_repeated_targets: bool = False) -> Trajectory:
        """The session's rows (depth-first leaves, one row per FORK segment) and a decision per
        turn; a turn on several leaves is trained on the first only, or on each with
        ``allow_repeated_targets`` (its decision names the first). Pure: the tree is left as it was."""
        decisions = {i: msgspec.structs.replace(t.decision) for i, t in self._turns.items()}
        for i, t in self._turns.items():
            d = decisions[i]
            reason = t.untrainable_reason()
            d.trainable = not reason
            d.reason = reason
            if d.routing == "rewritten":
                d.trainable = False
                d.reason = REASON_REWRITTEN
        claimed: set[int] = set()
        prompts: dict[int, bytes] = {}  # delta turns' prompts rebuilt off the row's path (branches)
        rows: list[Row] = []
        chains = [(tree.lineage, chain) for tree in self._trees.values() for chain in tree.generated_chains()]
        for leaf_no, (lineage, generated) in enumerate(chains):
            if not generated:
                continue
            truncated = generated[-1].turn.body.finish_reason == "length"  # type: ignore[union-attr]
            use_tool = any(isinstance(n.message, dict) and bool(n.message.get("tool_calls")) for n in generated)
            ill_formed = any(n.turn.body.ill_formed for n in generated)  # type: ignore[union-attr]
            builders: list[RowBuilder] = []
            first_seen: list[tuple[TurnDecision, int]] = []  # (decision, builder index)
            for node in generated:
                turn = node.turn
                assert turn is not None
                first = turn.index not in claimed
                claimed.add(turn.index)
                decision = decisions[turn.index]
                train = (first or allow_repeated_targets) and decision.trainable
                if builders:
                    prompt = builders[-1].prompt_of(turn, prompts)
                    kind = builders[-1].classify(turn, prompt)
                else:
                    prompt, kind = turn.prompt(prompts), CLEAN
                if kind == FORK or not builders:
                    builders.append(RowBuilder(self.fork_threshold))
                    builders[-1].append(turn, prompt, CLEAN, train)
                else:
                    builders[-1].append(turn, prompt, kind, train)
                if first:
                    decision.drift = kind
                    decision.leaf = leaf_no
                    first_seen.append((decision, len(builders) - 1))
            emitted: dict[int, int] = {}
            for b_no, builder in enumerate(builders):
                row = builder.to_row(leaf_no, truncated, use_tool, ill_formed, max_context_tokens, lineage)
                if row is not None:
                    emitted[b_no] = len(rows)
                    rows.append(row)
            for decision, b_no in first_seen:
                decision.row = emitted.get(b_no, -1)
                # A later REALIGN or the context cut may have masked it again.
                decision.trained = decision.row >= 0 and decision.turn_index in rows[decision.row].trained_turns
        return Trajectory(rows=tuple(rows), decisions=tuple(decisions[i] for i in sorted(decisions)))
