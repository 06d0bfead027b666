"""A fleet of inference servers behind one gateway: session affinity, failover, weights to every server.

:class:`Fleet` is a :class:`~.backends.Backend` over several member backends
(SGLang or vLLM clients, each behind its own
:class:`~.weight_sync.ReloadGate`, or in-process
:class:`~.torch_backend.TorchBackend` replicas). The gateway sets the turn's
routing key (:data:`~.backends.ROUTING_KEY`: the session id, or the group id
when a group's members share a server) before it generates; the fleet routes
on it, and every answer names its server (``Generation.server``), which the
gateway records with the turn beside that server's ``policy_version``.

**Affinity with bounded load.** Each member owns :data:`VNODES` points of a
hash ring. A new routing key is placed on the first member clockwise from
the key's own point that holds fewer than ``ceil(load_factor * (keys held +
1) / members in routing)`` keys (consistent hashing with bounded loads,
Mirrokni, Thorup and Zadimoghaddam 2018), and keeps that member while it is
in routing: every turn of a session reaches one server, and so its prefix
cache. A server at its share gives way to the next one on the ring for new
keys only. A key unused for ``key_ttl_s`` (its session ended) is forgotten.
``policy="round_robin"`` ignores the key (the benchmark's anchor).

**Out of routing.** A generation that fails on the server was never
recorded, so it is retried on the next member (each at most once): the turn
is neither lost nor recorded twice, and the session's later turns stay on
their new server. So is one still waiting on a member taken out as unhealthy
(no answer, a failed probe, a fatal reason) while it runs: a hung server
keeps its connections open and answers nothing, which would hold the turn
until the client's timeout. A 5xx leaves its member in routing (the fault may be that
request's; the probe decides); a 4xx is the request's fault and is raised.
A member is taken out, with its reason, when:

* a generation gets no answer (the server died or timed out);
* its health probe (:meth:`~.backends.Backend.probe`, every
  ``probe_interval_s``) fails, or its backend reports a fatal reason;
* a weight update fails on it (:meth:`reload_weights`). It then serves the
  version its gate still reports, but no new turn: a member is never left in
  routing on a version that is not the fleet's.

A member whose probe passes again comes back once it serves the fleet's
version: after any update it is updated again to the last version first (a
restarted server starts on its launch weights, whatever its gate says), and
a member out for a failed update comes back when the next update reaches it. With no member left
in routing the fleet's :attr:`fatal_reason` names each member's reason, and
the gateway refuses turns with it (503).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgspec

from agentlog._logging import get_logger
from agentlog.events.schema.validation import is_number

from .backends import ROUTING_KEY, Backend, BackendError, Generation, SamplingParams

_log = get_logger("agentlog.gateway.fleet")

#: Points each member owns on the hash ring: enough that four members'
#: shares of the keys stay within a few percent of a quarter each.
VNODES = 160
ROUTE_POLICIES = ("affinity", "round_robin")


def ring_point(text: str) -> int:
    """A stable 64-bit point on the ring (the same in every process: not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class _TakenOut(BackendError):
    """A generation given up because its member was taken out as unhealthy while it waited
    (no answer, status 0): retried as any unanswered one, the member already out."""


def _retrieve(task: "asyncio.Future[Any]") -> None:
    """Done callback of a generation given up on: its outcome (the cancellation, or an error
    the abort met) is nobody's to raise; the backend logs a failed abort itself."""
    if not task.cancelled():
        task.exception()


@dataclass(eq=False)
class FleetMember:
    """One inference server of a fleet, and whether it is in routing."""

    name: str
    backend: Backend
    #: The server's weight-sync client (``reload(path, version)``, ``close()``:
    #: :class:`~.weight_sync.SGLangWeightSync`, :class:`~.weight_sync.VLLMWeightSync`);
    #: None: the backend loads weights itself (``reload_weights``, in process).
    sync: Any = None
    #: None while in routing; else why the member is out.
    out_reason: str | None = None
    #: What took it out: "answer" (a generation got no answer), "probe", "update", "fatal".
    out_kind: str | None = None
    inflight: int = 0
    #: Routing keys placed on this member (its share of the sessions).
    keys: int = 0
    #: Generations this member answered (counters for ``/health`` and the benchmark).
    served: int = 0
    failures: int = 0
    _since: float = field(default_factory=time.monotonic)
    #: Set while the member is out as unhealthy: the generations waiting on it give up and go elsewhere.
    _unhealthy: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    async def update(self, path: str, version: int) -> None:
        """Load ``version`` from ``path`` on this server."""
        if self.sync is not None:
            await self.sync.reload(path, version)
        else:
            await self.backend.reload_weights(path, version)  # type: ignore[attr-defined]

    def describe(self) -> dict[str, Any]:
        """The member's state, as ``/health`` reports it."""
        return {"name": self.name, "in_routing": self.out_reason is None, "reason": self.out_reason,
                "policy_version": self.backend.policy_version, "inflight": self.inflight, "keys": self.keys, "served": self.served}


class Fleet(Backend):
    """Routes each generation to one member by the turn's routing key (see the module docstring)."""

    name = "fleet"

    def __init__(self, members: Sequence[FleetMember], *, policy: str = "affinity", load_factor: float = 1.25,
                 probe_interval_s: float = 2.0, probe_timeout_s: float = 5.0, key_ttl_s: float = 600.0) -> None:
        if not members:
            raise ValueError("Fleet: expected at least one member server, found none")
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise ValueError(f"Fleet: member names must be unique, found {names}")
        if policy not in ROUTE_POLICIES:
            raise ValueError(f"Fleet: policy: expected one of {ROUTE_POLICIES}, found {policy!r}")
        if not is_number(load_factor, at_least=1.0):
            raise ValueError(f"Fleet: load_factor: expected a number >= 1 (1.25: a server takes up to 25% over its share), "
                             f"found {load_factor!r}")
        for what, v in (("probe_interval_s", probe_interval_s), ("probe_timeout_s", probe_timeout_s), ("key_ttl_s", key_ttl_s)):
            if not is_number(v, above=0):
                raise ValueError(f"Fleet: {what}: expected seconds > 0, found {v!r}")
        self.members = list(members)
        self.policy = policy
        self.load_factor = float(load_factor)
        self.probe_interval_s = float(probe_interval_s)
        self.probe_timeout_s = float(probe_timeout_s)
        self.key_ttl_s = float(key_ttl_s)
        #: Each routing key's member, least recently used first, and when each was last used.
        self._placed: collections.OrderedDict[str, FleetMember] = collections.OrderedDict()
        self._used: dict[str, float] = {}
        self._swept = 0.0
        points = sorted((ring_point(f"{m.name}#{i}"), j) for j, m in enumerate(self.members) for i in range(VNODES))
        self._ring_points = [p for p, _ in points]
        self._ring_members = [j for _, j in points]
        self._next = 0  # round robin's cursor
        #: The version every member in routing serves (the last update that reached one).
        self.version = max(m.backend.policy_version for m in self.members)
        lengths = [m.backend.context_length for m in self.members if m.backend.context_length is not None]
        self.context_length = min(lengths) if lengths else None
        self.update_pauses_s: list[float] = []
        self._prober: asyncio.Task | None = None
        self._prober_failure: str | None = None
        #: The last update that reached a member, ``(path, version)``: what a member that
        #: comes back (perhaps restarted on its launch weights) is brought to first.
        self._last_update: tuple[str, int] | None = None
        #: Updates and re-admissions one at a time: each reads and sets ``version``.
        self._updating = asyncio.Lock()
        for m in self.members:
            if m.backend.policy_version != self.version:
                self._take_out(m, "update", f"serves version {m.backend.policy_version}, the fleet version {self.version}")

    # ------------------------------------------------------------ routing

    @property
    def policy_version(self) -> int:  # type: ignore[override]  # the fleet's version, not settable
        """The version the members in routing serve."""
        return self.version

    def in_routing(self) -> list[FleetMember]:
        """The members new generations may go to."""
        return [m for m in self.members if m.out_reason is None]

    def home(self, key: str) -> FleetMember:
        """The member ``key`` goes to when every member is in routing and none is past its share."""
        i = bisect.bisect(self._ring_points, ring_point(key)) % len(self._ring_points)
        return self.members[self._ring_members[i]]

    def choose(self, key: str | None, skip: frozenset[str] = frozenset()) -> FleetMember:
        """The member for one generation with routing key ``key`` (None: round robin), never one named in ``skip``.

        A key keeps the member it was placed on while that member is in routing (and the
        key was used within ``key_ttl_s``); a new key, or one whose member went out, is
        placed on the first member clockwise from its ring point that holds fewer than
        ``ceil(load_factor * (keys held + 1) / members in routing)`` keys."""
        for m in self.members:
            if m.out_reason is None and m.backend.fatal_reason is not None:
                self._take_out(m, "fatal", f"backend failed: {m.backend.fatal_reason}")
        live = [m for m in self.members if m.out_reason is None and m.name not in skip]
        if not live:
            raise BackendError(self.name, f"no server left in routing ({self._reasons()})", 503)
        if self.policy == "round_robin" or key is None:
            self._next += 1
            return live[self._next % len(live)]
        now = time.monotonic()
        self._expire(now)
        held = self._placed.pop(key, None)
        if held is not None:
            if held.out_reason is None and held.name not in skip:
                self._placed[key] = held  # most recently used last (see _expire)
                self._used[key] = now
                return held
            held.keys -= 1
        cap = math.ceil(self.load_factor * (len(self._placed) + 1) / len(live))
        start = bisect.bisect(self._ring_points, ring_point(key))
        n = len(self._ring_points)
        chosen = min(live, key=lambda m: m.keys)  # replaced below: some member in routing is under the cap
        for step in range(n):
            m = self.members[self._ring_members[(start + step) % n]]
            if m.out_reason is None and m.name not in skip and m.keys < cap:
                chosen = m
                break
        chosen.keys += 1
        self._placed[key] = chosen
        self._used[key] = now
        return chosen

    def _expire(self, now: float) -> None:
        """Forget keys unused for ``key_ttl_s`` (their sessions ended): they no longer count against a member."""
        if now - self._swept < 1.0:
            return
        self._swept = now
        while self._placed:
            key = next(iter(self._placed))
            if now - self._used[key] < self.key_ttl_s:
                break
            self._placed.pop(key).keys -= 1
            del self._used[key]

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Generate on the routing key's member. Nothing is recorded before this returns, so
        a generation that fails on the server is retried on the next member (each member at
        most once): one that got no answer takes its member out; a 5xx leaves it to its probe
        (the fault may be this request's); a 4xx is the request's fault and is raised. One still
        waiting when its member is taken out as unhealthy is given up and retried the same way."""
        self._start_prober()
        key = ROUTING_KEY.get()
        tried: set[str] = set()
        while True:
            m = self.choose(key, frozenset(tried))
            m.inflight += 1
            try:
                gen = await self._generate_on(m, prompt_ids, params)
            except BackendError as exc:
                if 0 < exc.status < 500:
                    raise  # another server would refuse it too
                m.failures += 1
                tried.add(m.name)
                if exc.status == 0 and not isinstance(exc, _TakenOut):
                    self._take_out(m, "answer", f"a generation got no answer: {exc}")
                if all(r.name in tried for r in self.in_routing()):
                    raise  # every member left in routing failed it: their error, not "no server left in routing"
                continue
            finally:
                m.inflight -= 1
            m.served += 1
            return msgspec.structs.replace(gen, server=m.name)

    async def _generate_on(self, m: FleetMember, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """``m``'s generation, given up (raising :class:`_TakenOut`) when ``m`` is taken out as
        unhealthy before it answers: the request is cancelled, which asks the server to abort
        it, without waiting for that (a hung server would not answer the abort either). A
        cancelled call cancels the request and waits for its abort, as the backend's own would."""
        gen = asyncio.ensure_future(m.backend.generate(prompt_ids, params))
        gone = asyncio.ensure_future(m._unhealthy.wait())
        try:
            await asyncio.wait((gen, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            gen.cancel()
            await asyncio.gather(gen, return_exceptions=True)
            raise
        finally:
            gone.cancel()
        if gen.done():
            return gen.result()
        gen.cancel()
        gen.add_done_callback(_retrieve)
        raise _TakenOut(self.name, f"server {m.name} was taken out during the generation: {m.out_reason}")

    def ignored_sampling(self, params: SamplingParams) -> list[str]:
        ignored: set[str] = set()
        for m in self.members:
            ignored.update(m.backend.ignored_sampling(params))
        return sorted(ignored)

    # ------------------------------------------------------------ health

    @property
    def fatal_reason(self) -> str | None:
        """None while a member is in routing; else every member's reason (or the prober's crash)."""
        if self._prober_failure is not None:
            return self._prober_failure
        if any(m.out_reason is None and m.backend.fatal_reason is None for m in self.members):
            return None
        return f"no server left in routing ({self._reasons()})"

    def _reasons(self) -> str:
        return "; ".join(f"{m.name}: {m.out_reason or m.backend.fatal_reason}" for m in self.members)

    def _take_out(self, m: FleetMember, kind: str, reason: str) -> None:
        if m.out_reason is None:
            _log.warning("fleet.server_out", server=m.name, reason=reason, in_routing=len(self.in_routing()) - 1)
            m._since = time.monotonic()
        m.out_reason, m.out_kind = reason, kind
        if kind != "update":  # a failed update leaves it serving the turns it has, on the version its gate reports
            m._unhealthy.set()

    def _bring_back(self, m: FleetMember) -> None:
        _log.info("fleet.server_back", server=m.name, policy_version=m.backend.policy_version, was=m.out_reason,
                  out_s=round(time.monotonic() - m._since, 3))
        m.out_reason = m.out_kind = None
        m._unhealthy.clear()

    async def probe_all(self) -> None:
        """Probe every member once: take out those that fail; bring back those out that
        pass, once they serve the fleet's version. A member that was out may have been
        restarted on its launch weights, whatever its gate says: after any update, it is
        updated again to the last version before it comes back."""
        async def one(m: FleetMember) -> None:
            try:
                reason = await asyncio.wait_for(m.backend.probe(), self.probe_timeout_s)
            except asyncio.TimeoutError:
                reason = f"health probe timed out after {self.probe_timeout_s} s"
            except Exception as exc:  # this member's probe broke, not the prober: it counts as a failed probe
                reason = f"health probe raised {type(exc).__name__}: {exc}"
            if reason is not None:
                if m.out_kind == "update" and reason == m.backend.fatal_reason:
                    return  # only its failed update's own reason (weights unknown): the next update reaches it and is the cure
                self._take_out(m, "probe", f"health probe failed: {reason}")
            elif m.out_reason is not None:
                await self._readmit(m)

        await asyncio.gather(*(one(m) for m in self.members))

    async def _readmit(self, m: FleetMember) -> None:
        """Bring back a member whose probe passed, at the fleet's version."""
        async with self._updating:
            if m.out_reason is None or m.backend.fatal_reason is not None:
                return
            if self._last_update is None:
                if m.backend.policy_version == self.version:  # no update yet: its launch weights are the version
                    self._bring_back(m)
                return
            path, version = self._last_update
            try:
                await m.update(path, version)
            except Exception as exc:  # reported as its reason, and tried again at its next passing probe
                self._take_out(m, "update", f"update to version {version} (coming back) failed: {type(exc).__name__}: {exc}")
                return
            if m.backend.policy_version == version:
                self._bring_back(m)

    def _start_prober(self) -> None:
        if self._prober is None:
            self._prober = asyncio.get_running_loop().create_task(self._probe_forever(), name="fleet-prober")

    async def _probe_forever(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.probe_interval_s)
                await self.probe_all()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a prober that dies would leave dead servers in routing: loud, and in health
            self._prober_failure = f"the fleet's health prober crashed: {type(exc).__name__}: {exc}"
            _log.error("fleet.prober_crashed", error=self._prober_failure)
            raise

    # ------------------------------------------------------------ weights

    async def reload_weights(self, path: Any, policy_version: int) -> None:
        """Load version ``policy_version`` from ``path`` on every member in routing, and on
        those out only for a failed update, at once.

        A member whose update fails is taken out of routing (its gate keeps the version it
        still serves, so no turn it serves is labelled with the new one) and comes back
        after a later update reaches it. Members out for no answer or a failed probe are
        left to the prober, which updates them before they come back. Raises BackendError
        naming every member's error when the update reached none."""
        async with self._updating:
            t0 = time.perf_counter()
            targets = [m for m in self.members if m.out_reason is None or m.out_kind == "update"]

            async def one(m: FleetMember) -> BaseException | None:
                try:
                    await m.update(str(path), policy_version)
                except Exception as exc:  # each member's failure is reported below, never dropped
                    return exc
                return None

            results = await asyncio.gather(*(one(m) for m in targets))
            failed = [(m, exc) for m, exc in zip(targets, results) if exc is not None]
            if len(failed) == len(targets):
                why = ("; ".join(f"{m.name}: {type(e).__name__}: {e}" for m, e in failed)
                       or "every server is out of routing, left to the prober (" + "; ".join(f"{m.name}: {m.out_reason}" for m in self.members) + ")")
                raise BackendError(self.name, f"the update to version {policy_version} from {path} reached no server: {why}")
            self.version = policy_version
            self._last_update = (str(path), policy_version)
            for m, exc in failed:
                self._take_out(m, "update", f"update to version {policy_version} failed: {type(exc).__name__}: {exc}")
            for m in targets:
                if m in (f for f, _ in failed):
                    continue
                if m.backend.policy_version != policy_version:
                    self._take_out(m, "update", f"serves version {m.backend.policy_version} after the update to {policy_version}")
                elif m.out_reason is not None and m.backend.fatal_reason is None:
                    self._bring_back(m)
            self.update_pauses_s.append(time.perf_counter() - t0)
            _log.info("fleet.weights_loaded", policy_version=policy_version, servers=len(targets) - len(failed),
                      failed=[m.name for m, _ in failed], out=[m.name for m in self.members if m not in targets])

    def describe(self) -> list[dict[str, Any]]:
        """Each member's state (for ``/health`` and the benchmark)."""
        return [m.describe() for m in self.members]

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a crash was logged and reported when it happened
                await self._prober
        await asyncio.gather(*(m.backend.close() for m in self.members))
        await asyncio.gather(*(m.sync.close() for m in self.members if m.sync is not None))


__all__ = ["Fleet", "FleetMember", "ROUTE_POLICIES", "VNODES", "ring_point"]
