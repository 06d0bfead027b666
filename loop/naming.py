"""The ids a run gives its batches, groups and sessions, and the random stream of each batch.

Batch ``b`` holds ``groups_per_step`` base groups, ``b00012-g07``; a base group's redraws
(dynamic sampling, :mod:`agentlog.loop.dynamic_sampling`) are ``b00012-g07-r1``,
``-r2``...; member ``i`` of a group is ``<group>-s<i>`` (a replacement's ``i`` is past the
group's size). Every draw of a batch comes from a stream seeded by ``(seed, b, purpose)``,
so a restarted worker draws the same batch.
"""

from __future__ import annotations

import random
import re

#: A base group's id, and its batch.
BASE_GROUP_RE = re.compile(r"^b(\d+)-g\d+$")
_REDRAW = re.compile(r"-r(\d+)$")
_GROUP = re.compile(r"^b(\d+)-g(\d+)(?:-r(\d+))?$")
_MEMBER = re.compile(r"-s(\d+)$")


def batch_prefix(batch: int) -> str:
    """What every group id of batch ``batch`` starts with."""
    return f"b{batch:05d}-"


def group_id(batch: int, g: int) -> str:
    """The id of base group ``g`` of batch ``batch``."""
    return f"{batch_prefix(batch)}g{g:02d}"


def member_id(gid: str, i: int) -> str:
    """The id of member ``i`` of the group ``gid``."""
    return f"{gid}-s{i}"


def session_id(batch: int, g: int, i: int) -> str:
    """The id of member ``i`` of base group ``g`` of batch ``batch``."""
    return member_id(group_id(batch, g), i)


def redraw_of(gid: str) -> int:
    """Which redraw of its chain the group ``gid`` is (0: the base group)."""
    m = _REDRAW.search(gid)
    return int(m.group(1)) if m else 0


def parse_group_id(gid: str) -> tuple[int, int, int] | None:
    """``(batch, g, k)`` of a group id :func:`group_id` / :func:`redraw_id` made, None for any other id."""
    m = _GROUP.match(gid)
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def member_index(session_id: str) -> int | None:
    """The member index ``i`` of a session id :func:`member_id` made, None for any other id."""
    m = _MEMBER.search(session_id)
    return None if m is None else int(m.group(1))


def redraw_id(base_group_id: str, k: int) -> str:
    """The id of redraw ``k`` of the chain that starts at ``base_group_id`` (k 0: the base itself)."""
    return base_group_id if k == 0 else f"{base_group_id}-r{k}"


def batch_rng(seed: int, batch: int, stream: str) -> random.Random:
    """An independent, reproducible random stream per (seed, batch, purpose)."""
    return random.Random(f"{seed}:{batch}:{stream}")
