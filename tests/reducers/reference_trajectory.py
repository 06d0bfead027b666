"""A plain reference linearisation (lists, recursion, no fast paths) written
straight from slime's TrajectoryManager description, to check the real one
element by element. Not a test module."""

from __future__ import annotations

from typing import Any

from agentlog.events.schema.types import TurnRecorded


class _N:
    def __init__(self, role: Any, message: Any, parent: "_N | None") -> None:
        self.role, self.message, self.parent = role, message, parent
        self.children: list[_N] = []
        self.turn: TurnRecorded | None = None


def _trainable(body: TurnRecorded, undelivered: set[int]) -> bool:
    return (
        body.turn_index not in undelivered
        and body.finish_reason in ("stop", "length")
        and len(body.output_tokens) > 0
        and len(body.log_probs) == len(body.output_tokens)
    )


def reference_rows(
    turns: list[TurnRecorded], undelivered: set[int], fork_threshold: int, max_tokens: int, repeated: bool = False
) -> list[tuple[list[int], int, list[int], list[float]]]:
    """(tokens, response_length, mask, log-probs) per emitted row; ``repeated``:
    a turn on several leaves is trained on each (else on the first only)."""
    root = _N(None, None, None)
    last_gen: _N | None = None
    for body in turns:
        msgs = body.messages
        if not msgs:
            node = last_gen or root
        else:
            node, depth = root, 0
            while depth < len(msgs):
                nxt = next((c for c in node.children if c.role == msgs[depth].get("role") and c.message == msgs[depth]), None)
                if nxt is None:
                    break
                node, depth = nxt, depth + 1
            if fork_threshold > 0 and depth < len(msgs) and msgs[depth].get("role") == "assistant":
                asst = [c for c in node.children if c.role == "assistant"]
                if len(asst) == 1 and not asst[0].children and asst[0].turn is not None and len(asst[0].turn.output_tokens) < fork_threshold:
                    asst[0].turn = None
                    asst[0].message = msgs[depth]
                    if last_gen is asst[0]:
                        last_gen = None
                    node, depth = asst[0], depth + 1
            for m in msgs[depth:]:
                child = _N(m.get("role"), m, node)
                node.children.append(child)
                node = child
        leaf = _N("assistant", body.response_message, node)
        leaf.turn = body
        node.children.append(leaf)
        last_gen = leaf

    leaves: list[_N] = []

    def walk(n: _N) -> None:
        if not n.children:
            if n.parent is not None:
                leaves.append(n)
            return
        for c in n.children:
            walk(c)

    walk(root)
    claimed: set[int] = set()
    rows = []
    for leaf in leaves:
        chain = []
        n: _N | None = leaf
        while n is not None and n.parent is not None:
            chain.append(n)
            n = n.parent
        generated = [n.turn for n in reversed(chain) if n.turn is not None]
        builders: list[dict] = []
        for body in generated:
            first = body.turn_index not in claimed
            claimed.add(body.turn_index)
            train = (first or repeated) and _trainable(body, undelivered)
            prompt = body.prompt_tokens.tolist()
            out = body.output_tokens.tolist()
            kind = "new"
            if builders:
                b = builders[-1]
                agree = 0
                while agree < min(len(b["tokens"]), len(prompt)) and b["tokens"][agree] == prompt[agree]:
                    agree += 1
                if agree == len(b["tokens"]):
                    kind = "clean"
                elif agree >= b["last"] and len(out) < fork_threshold:
                    kind = "realign"
            if kind == "new":
                b = {"tokens": [], "mask": [], "lps": [], "last": None, "lead": len(prompt)}
                builders.append(b)
                kind = "clean"
            if kind == "clean":
                tail = prompt[len(b["tokens"]):]
            else:
                del b["tokens"][b["last"]:], b["mask"][b["last"]:], b["lps"][b["last"]:]
                tail = prompt[b["last"]:]
            b["tokens"] += tail
            b["mask"] += [0] * len(tail)
            b["lps"] += [0.0] * len(tail)
            b["last"] = len(b["tokens"])
            b["tokens"] += out
            b["mask"] += [1 if train else 0] * len(out)
            b["lps"] += [float(x) for x in body.log_probs] if train else [0.0] * len(out)
        for b in builders:
            tokens, mask, lps = b["tokens"], b["mask"], b["lps"]
            if max_tokens and len(tokens) > max_tokens:
                tokens, mask, lps = tokens[:max_tokens], mask[:max_tokens], lps[:max_tokens]
            lead = b["lead"]
            if len(tokens) - lead < 1 or 1 not in mask[lead:]:
                continue
            rows.append((tokens, len(tokens) - lead, mask[lead:], lps[lead:]))
    return rows
