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

from agentlog.events.errors import AgentlogError
from agentlog.events.schema.turn_delta import TurnContext, TurnDeltaError, common_prefix_tokens
from agentlog.events.schema.turn import turn_version_spans
from agentlog.events.schema.types import TeacherScored, TurnDelta, TurnRecorded

from .teacher import TeacherScores

CLEAN = "clean"
REALIGN = "realign"
FORK = "fork"

#: Why a turn contributes no trainable token.
REASON_ABORT_FINISH = "finish_abort"
REASON_MISSING_LOG_PROBS = "missing_log_probs"
REASON_EMPTY_OUTPUT = "empty_output"
REASON_UNDELIVERED = "undelivered"
REASON_REWRITTEN = "rewritten"


class TrajectoryError(AgentlogError, ValueError):
    """A turn cannot be placed in its session's tree (duplicate turn index,
    malformed messages, an undelivered notice for an unknown turn)."""


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


class Row(msgspec.Struct, frozen=True):
    """One linearised training row, before it becomes a Sample."""

    tokens: bytes  # int32 LE: prompt + response
    response_length: int
    loss_mask: bytes  # uint8 per response token
    rollout_log_probs: bytes  # float32 LE per response token
    turn_indices: tuple[int, ...]
    leaf: int
    truncated: bool  # the leaf's last generated turn finished with "length"
    use_tool: bool
    ill_formed: bool
    policy_version: int  # oldest policy version among the row's trained turns
    cut: bool = False  # shortened to max_context_tokens
    trained_turns: tuple[int, ...] = ()  # turns with mask-1 tokens in this row
    #: Where each trained turn's tokens sit: (response offset, tokens, turn
    #: index, offset in that turn's output), in row order (teacher scores
    #: are aligned through these).
    trained_spans: tuple[tuple[int, int, int, int], ...] = ()
    #: The policy version of each of ``trained_spans``.
    span_versions: tuple[int, ...] = ()
    #: A turn of the row was made by more than one version (a partial rollout).
    partial: bool = False


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


class _Node:
    __slots__ = ("role", "message", "parent", "children", "turn")

    def __init__(self, role: Any, message: Any, parent: "_Node | None") -> None:
        self.role = role
        self.message = message
        self.parent = parent
        self.children: list[_Node] = []
        # The generated turn this node holds; None for routing-only nodes.
        self.turn: _Turn | None = None

    def add(self, child: "_Node") -> "_Node":
        self.children.append(child)
        return child


_zeros = bytes(1 << 16)


def _zero_view(nbytes: int) -> memoryview:
    """A read-only view of ``nbytes`` zero bytes, without allocating them each time."""
    global _zeros
    if nbytes > len(_zeros):
        # A cache of constant zeros, grown on demand: no state that affects outputs.
        _zeros = bytes(max(nbytes, 2 * len(_zeros)))
    return memoryview(_zeros)[:nbytes]


class _RowBuilder:
    """Accumulates one chain of turns into one row's tokens, mask and log-probs.

    After every append the held tokens are exactly the last turn's prompt
    followed by its output: CLEAN appends the prompt's tail to tokens the
    prompt starts with, and REALIGN overwrites from the last response on
    with the prompt, which agrees with the held tokens before that point.
    So the builder keeps them in one buffer, extended in place by a CLEAN
    turn (a delta that repeats all of them costs only its new tokens), and
    mask and log-probs as spans, ``(n_tokens, log_probs or None, policy version,
    turn index, offset in the turn's output)``, one per version of a turn,
    materialised once per emitted row."""

    __slots__ = ("fork_threshold", "held", "spans", "spanned", "last_start", "last_turn", "lead", "turns")

    def __init__(self, fork_threshold: int) -> None:
        self.fork_threshold = fork_threshold
        self.held = bytearray()  # the last turn's prompt + output
        self.spans: list[tuple[int, bytes | memoryview | None, int, int, int]] = []
        self.spanned = 0  # tokens covered by spans (== held tokens)
        self.last_start: int | None = None  # token index where the last response starts
        self.last_turn: _Turn | None = None
        self.lead = 0  # the first turn's prompt length: the row's prompt
        self.turns: list[int] = []

    def prompt_of(self, turn: _Turn, cache: dict[int, bytes]) -> bytes | None:
        """The turn's full prompt, or None when it is a delta on the row's
        last turn that repeats all the held tokens (CLEAN: only its new
        tokens are needed)."""
        body = turn.body
        if type(body) is TurnDelta and turn.base is not None and turn.base is self.last_turn:
            shared = body.shared_tokens * 4
            if shared == len(self.held):
                return None
            if shared < len(self.held):
                return bytes(self.held[:shared]) + body.new_prompt_ids
        return turn.prompt(cache)

    def classify(self, turn: _Turn, prompt: bytes | None) -> str:
        if prompt is None or prompt.startswith(self.held):
            return CLEAN
        agree = common_prefix_tokens(self.held, prompt)
        if self.last_start is not None and agree >= self.last_start and len(turn.body.output_ids) // 4 < self.fork_threshold:
            return REALIGN
        return FORK

    def _span(self, n: int, log_probs: bytes | memoryview | None, version: int = 0, turn: int = -1, offset: int = 0) -> None:
        if n:
            self.spans.append((n, log_probs, version, turn, offset))
            self.spanned += n

    def _output_spans(self, body: TurnRecorded | TurnDelta, train: bool, turn: int) -> None:
        """The turn's output as spans, one per policy version that generated it."""
        n_out = len(body.output_ids) // 4
        lp = body.output_log_probs if train else None
        version_spans = turn_version_spans(body)
        if len(version_spans) == 1:
            self._span(n_out, lp, body.policy_version, turn)
            return
        view = memoryview(lp) if lp is not None else None
        ends = [first for first, _ in version_spans[1:]] + [n_out]
        for (first, version), end in zip(version_spans, ends):
            self._span(end - first, view[first * 4 : end * 4] if view is not None else None, version, turn, first)

    def append(self, turn: _Turn, prompt: bytes | None, kind: str, train: bool) -> None:
        """Add a turn; ``prompt`` None: a delta that repeats all the held tokens (see prompt_of)."""
        body = turn.body
        if prompt is None:
            new = body.new_prompt_ids
            n_prompt = len(self.held) // 4 + len(new) // 4
        else:
            n_prompt = len(prompt) // 4
        if kind == REALIGN:
            # The drifted span carries no signal: overwrite it from the prompt
            # as context (mask 0, log-prob 0); earlier turns stay untouched.
            # last_start is always a span boundary (a response starts there).
            start = self.last_start
            assert start is not None
            while self.spanned > start:
                n = self.spans.pop()[0]
                self.spanned -= n
        self._span(n_prompt - self.spanned, None)
        if self.last_start is None:
            self.lead = n_prompt
        if prompt is None:
            self.held += new
        elif kind == CLEAN:
            self.held += memoryview(prompt)[len(self.held) :]  # the prompt starts with the held tokens
        else:
            self.held = bytearray(prompt)
        self.held += body.output_ids
        self.last_start = n_prompt
        self.last_turn = turn
        self._output_spans(body, train, turn.index)
        self.turns.append(turn.index)

    def to_row(self, leaf: int, truncated: bool, use_tool: bool, ill_formed: bool, max_tokens: int) -> Row | None:
        """The row, or None when it holds no trainable token (after any cut)."""
        n_tok = self.spanned
        cut = bool(max_tokens) and n_tok > max_tokens
        if cut:
            n_tok = max_tokens
        lead = self.lead
        response_length = n_tok - lead
        if response_length < 1:
            return None
        mask_parts: list[bytes | memoryview] = []
        lp_parts: list[bytes | memoryview] = []
        versions: list[int] = []
        trained: list[int] = []
        spans: list[tuple[int, int, int, int]] = []
        pos = 0
        for n, log_probs, version, turn, offset in self.spans:
            lo, hi = max(pos, lead), min(pos + n, n_tok)
            pos += n
            if lo >= hi:
                if pos >= n_tok:
                    break
                continue
            k = hi - lo
            if log_probs is None:
                mask_parts.append(_zero_view(k))
                lp_parts.append(_zero_view(4 * k))
            else:
                mask_parts.append(b"\x01" * k)
                lp_parts.append(log_probs[(lo - pos + n) * 4 : (hi - pos + n) * 4])
                spans.append((lo - lead, k, turn, offset + lo - pos + n))
                versions.append(version)
                if turn not in trained:
                    trained.append(turn)
        if not versions:
            return None  # nothing trainable survives (or ever was)
        return Row(
            tokens=bytes(self.held[: n_tok * 4]) if cut else bytes(self.held),
            response_length=response_length,
            loss_mask=b"".join(mask_parts),
            rollout_log_probs=b"".join(lp_parts),
            turn_indices=tuple(self.turns),
            leaf=leaf,
            truncated=truncated,
            use_tool=use_tool,
            ill_formed=ill_formed,
            policy_version=min(versions),
            cut=cut,
            trained_turns=tuple(trained),
            trained_spans=tuple(spans),
            span_versions=tuple(versions),
            partial=any(offset and turn in trained for _, _, _, turn, offset in self.spans),
        )


class SessionTrajectory:
    """One session's message tree, built turn by turn as events arrive."""

    def __init__(self, session_id: str, fork_threshold: int = 1024) -> None:
        self.session_id = session_id
        self.fork_threshold = fork_threshold
        self._root = _Node(None, None, None)
        self._turns: dict[int, _Turn] = {}
        self._last_generated: _Node | None = None
        # The last routed prompt and the nodes its messages matched or mounted
        # (the routing fast path, see _mount_point).
        self._prev_messages: list[dict[str, Any]] = []
        self._prev_path: list[_Node] = []
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
        if not messages:
            node = self._last_generated or self._root
            turn.decision.routing = "linear"
        else:
            try:
                node, depth, path = self._mount_point(messages)
            except AttributeError:
                node, depth, path = self._root, 0, []  # a non-dict message: reported below
            # Every message is checked before the tree changes, so an error
            # leaves the session's tree as it was.
            for i in range(depth, len(messages)):
                if not isinstance(messages[i], dict):
                    raise TrajectoryError(
                        f"session {self.session_id!r}, lsn {lsn}, turn {body.turn_index}: messages[{i}]:"
                        f" expected a dict with a 'role', found {type(messages[i]).__name__}"
                    )
            node, depth, merged = self._merge_rewrite(node, messages, depth)
            if merged:
                path.append(node)
            rest = messages[depth:]
            for msg in rest:
                node = node.add(_Node(msg.get("role"), msg, node))
                path.append(node)
            self._prev_messages = messages
            self._prev_path = path
            turn.decision.mounted_nodes = len(rest)
            turn.decision.routing = "merged_rewrite" if merged else ("mounted" if rest else "matched")
        leaf = node.add(_Node("assistant", body.response_message, node))
        leaf.turn = turn
        self._last_generated = leaf
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

    def _mount_point(self, messages: list[dict[str, Any]]) -> tuple[_Node, int, list[_Node]]:
        """Walk down matching each message to the first child with its role and
        an equal message; returns the deepest match, how many messages
        matched, and the nodes matched.

        Fast path (exact): when the prompt starts with the previous routed
        prompt (compared in C), the walk over that prefix would end on the
        same nodes. Since that routing the tree only gained children appended
        after existing siblings (never ahead of a matched node) and, by a
        rewrite merge, a new message on a node of that very path, so the
        first match at every level is unchanged."""
        prev = self._prev_messages
        n_prev = len(prev)
        if n_prev and len(messages) >= n_prev and messages[:n_prev] == prev:
            path = list(self._prev_path)
            node = path[-1]
            depth = n_prev
        else:
            path = []
            node = self._root
            depth = 0
        n = len(messages)
        while depth < n:
            msg = messages[depth]
            role = msg.get("role")
            for child in node.children:
                if child.role == role and child.message == msg:
                    node = child
                    path.append(child)
                    depth += 1
                    break
            else:
                break
        return node, depth, path

    def _merge_rewrite(self, node: _Node, messages: list[dict[str, Any]], depth: int) -> tuple[_Node, int, bool]:
        # A client that re-renders its last assistant message would otherwise
        # fork, stranding the original turn as a dead-end leaf that trains on
        # its own. Merge only when unambiguous (one assistant child), cheap to
        # lose (a generated leaf shorter than fork_threshold) and enabled.
        if self.fork_threshold <= 0 or depth >= len(messages) or messages[depth].get("role") != "assistant":
            return node, depth, False
        assistants = [c for c in node.children if c.role == "assistant"]
        if len(assistants) != 1:
            return node, depth, False
        target = assistants[0]
        turn = target.turn
        if target.children or turn is None or len(turn.body.output_ids) // 4 >= self.fork_threshold:
            return node, depth, False
        turn.decision.routing = "rewritten"
        target.turn = None
        target.message = messages[depth]
        if self._last_generated is target:
            self._last_generated = None
        return target, depth + 1, True

    # -------------------------------------------------------- linearisation

    def _generated_chains(self) -> list[tuple[_Node, ...]]:
        """For each leaf (depth-first, insertion order; the bare root is not
        a leaf) the generated nodes on its root path, in one walk."""
        out: list[tuple[_Node, ...]] = []
        stack: list[tuple[_Node, tuple[_Node, ...]]] = [(c, ()) for c in reversed(self._root.children)]
        while stack:
            node, generated = stack.pop()
            if node.turn is not None:
                generated = generated + (node,)
            children = node.children
            if len(children) == 1:
                stack.append((children[0], generated))
            elif children:
                stack.extend([(c, generated) for c in reversed(children)])
            else:
                out.append(generated)
        return out

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
        for leaf_no, generated in enumerate(self._generated_chains()):
            if not generated:
                continue
            truncated = generated[-1].turn.body.finish_reason == "length"  # type: ignore[union-attr]
            use_tool = any(isinstance(n.message, dict) and bool(n.message.get("tool_calls")) for n in generated)
            ill_formed = any(n.turn.body.ill_formed for n in generated)  # type: ignore[union-attr]
            builders: list[_RowBuilder] = []
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
                    builders.append(_RowBuilder(self.fork_threshold))
                    builders[-1].append(turn, prompt, CLEAN, train)
                else:
                    builders[-1].append(turn, prompt, kind, train)
                if first:
                    decision.drift = kind
                    decision.leaf = leaf_no
                    first_seen.append((decision, len(builders) - 1))
            emitted: dict[int, int] = {}
            for b_no, builder in enumerate(builders):
                row = builder.to_row(leaf_no, truncated, use_tool, ill_formed, max_context_tokens)
                if row is not None:
                    emitted[b_no] = len(rows)
                    rows.append(row)
            for decision, b_no in first_seen:
                decision.row = emitted.get(b_no, -1)
                # A later REALIGN or the context cut may have masked it again.
                decision.trained = decision.row >= 0 and decision.turn_index in rows[decision.row].trained_turns
        return Trajectory(rows=tuple(rows), decisions=tuple(decisions[i] for i in sorted(decisions)))
