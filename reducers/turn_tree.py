"""The message tree of one lineage of a session: where each turn's prompt
routes (see :mod:`.trajectory` for the rules, after slime's TrajectoryManager)."""

from __future__ import annotations

from typing import Any

from agentlog.events.errors import AgentlogError


class TrajectoryError(AgentlogError, ValueError):
    """A turn cannot be placed in its session's tree (duplicate turn index,
    malformed messages, an undelivered notice for an unknown turn)."""


class _Node:
    # No parent pointer: the tree only points down, so a session's tree is
    # freed by reference counting the moment the reducer evicts the session,
    # instead of waiting as cyclic garbage for a full collection.
    __slots__ = ("role", "message", "children", "turn")

    def __init__(self, role: Any, message: Any) -> None:
        self.role = role
        self.message = message
        self.children: list[_Node] = []
        # The generated turn this node holds; None for routing-only nodes.
        self.turn: Any = None  # a trajectory._Turn

    def add(self, child: "_Node") -> "_Node":
        self.children.append(child)
        return child



class MessageTree:
    """One lineage's message tree: routing-only nodes for the messages its
    prompts carried and a generated leaf per turn, built turn by turn."""

    __slots__ = ("lineage", "fork_threshold", "root", "last_generated", "_prev_messages", "_prev_path")

    def __init__(self, lineage: str, fork_threshold: int) -> None:
        self.lineage = lineage
        self.fork_threshold = fork_threshold
        self.root = _Node(None, None)
        self.last_generated: _Node | None = None
        # The last routed prompt and the nodes its messages matched or mounted
        # (the routing fast path, see _mount_point).
        self._prev_messages: list[dict[str, Any]] = []
        self._prev_path: list[_Node] = []

    def route(self, turn: Any, messages: list[Any], where: str) -> None:
        """Mount ``turn`` (a trajectory._Turn) under the nodes its prompt
        ``messages`` match, filling its decision's routing fields. Every message
        is checked before the tree changes, so an error (TrajectoryError,
        prefixed with ``where``) leaves the tree as it was."""
        body = turn.body
        if not messages:
            node = self.last_generated or self.root
            turn.decision.routing = "linear"
        else:
            try:
                node, depth, path = self._mount_point(messages)
            except AttributeError:
                node, depth, path = self.root, 0, []  # a non-dict message: reported below
            for i in range(depth, len(messages)):
                if not isinstance(messages[i], dict):
                    raise TrajectoryError(
                        f"{where}, turn {body.turn_index}: messages[{i}]:"
                        f" expected a dict with a 'role', found {type(messages[i]).__name__}"
                    )
            node, depth, merged = self._merge_rewrite(node, messages, depth)
            if merged:
                path.append(node)
            rest = messages[depth:]
            for msg in rest:
                node = node.add(_Node(msg.get("role"), msg))
                path.append(node)
            self._prev_messages = messages
            self._prev_path = path
            turn.decision.mounted_nodes = len(rest)
            turn.decision.routing = "merged_rewrite" if merged else ("mounted" if rest else "matched")
        leaf = node.add(_Node("assistant", body.response_message))
        leaf.turn = turn
        self.last_generated = leaf

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
            node = self.root
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
        if self.last_generated is target:
            self.last_generated = None
        return target, depth + 1, True

    def generated_chains(self) -> list[tuple[_Node, ...]]:
        """For each leaf (depth-first, insertion order; the bare root is not
        a leaf) the generated nodes on its root path, in one walk."""
        out: list[tuple[_Node, ...]] = []
        stack: list[tuple[_Node, tuple[_Node, ...]]] = [(c, ()) for c in reversed(self.root.children)]
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
