"""Benchmark log partitions: the learner's cost of merging 1, 4 and 16
partitions, rollout throughput with 1, 2 and 4 local workers, and the time
from a group's last terminal event to its gradient step.

* merge cost: batches of lookup-task sessions (groups of 8, 2 turns, some
  aborted) are played once through the real SessionEngine, and the same
  events are copied into 1, 4 and 16 partition logs ``rollout/pNNNN``
  (group ``i`` to partition ``i % k``, as the workers split a batch). The
  timed path is exactly the learner's consumption minus the optimiser step:
  ``events.log.source.follow_sources`` (``events.follow_logs``) feeding
  ``loop.trainer.StepCutter`` over ``reducers.partitioned.PartitionFold``
  (with the learner's ``PartitionWatch``) until every group is released.
  Anchor, in the same run: the same events read from one log with the plain
  ``events.read_log`` and reduced by one ``reducers.pipeline.Reducer`` (what
  a single-log consumer costs). CPU time of this process, min of
  interleaved repeats.
* rollout throughput: the real loop (``loop.run.run_loop``: the learner
  process and N local worker processes, no warm-up, default faults, a fixed
  number of steps) with ``[rollout] workers`` 1, 2 and 4. Sessions/s and
  events/s over the span of the rollout logs (first ``session_opened`` to
  last event); CPU seconds per session of the worker processes (utime +
  stime sampled from ``/proc/<pid>/stat`` every 20 ms while they run).
* release -> step: for every group of every learner record, the record's
  time (its learner-log envelope ``ts_ns``) minus the ``ts_ns`` of the
  group's last terminal event (the members' terminal LSNs the record names,
  read back from their partition). p50 and p99 per worker count.

Usage: ``python tools/bench/bench_partitions.py [--quick] [--events N] [--steps N] [--keep DIR]``
(``--groups-per-step``, ``--group-size``: a smaller loop, for a smoke run);
on a Ray cluster: ``--backend ray --address auto --workers 1,8,32 --keep /shared/dir``
(rates and latencies from the logs; no worker CPU figure for Ray actors).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from agentlog.engine import SessionEngine
from agentlog.engine.tasks.lookup import ANSWER, EOS, LOOKUP, LookupTask, key_token, value_token
from agentlog.events import FileLog, read_log
from agentlog.events.log.api import MemoryLog
from agentlog.events.log.partitions import partition_dir
from agentlog.events.schema.types import SessionOpened, PolicyUpdated
from agentlog.events.log.source import follow_sources, open_source
from agentlog.tools.bench.bench_loop import percentile
from agentlog.loop.run_folder import Run
from agentlog.loop.config import LoopConfig, RolloutConfig
from agentlog.loop.run import run_loop
from agentlog.loop.trainer import PartitionWatch, StepCutter, step_size
from agentlog.reducers.partitioned import PartitionFold
from agentlog.reducers.pipeline import Reducer
from agentlog.tools.bench.goals import goal_line, meets

GROUPS_PER_BATCH = 32
GROUP_SIZE = 8
ABORT_RATE = 0.05
PARTITION_COUNTS = (1, 4, 16)
WORKER_COUNTS = (1, 2, 4)
GOAL_RATIO = 1.2


# ---------------------------------------------------------------- 1. merge cost


async def _play_batch(engine: SessionEngine, task: LookupTask, rng: random.Random, b: int) -> None:
    """One batch: GROUPS_PER_BATCH groups x GROUP_SIZE sessions of the lookup
    task's two turns, all sessions in flight at once (their events interleave
    as they do in a worker), a few aborted after the first turn."""

    async def member(gid: str, ep: Any, i: int, abort: bool, correct: bool) -> None:
        key, value = ep.state["key"], ep.state["table"][ep.state["key"]]
        h = await engine.open_session(f"{gid}-s{i}", group_id=gid, group_size=GROUP_SIZE, sample_index=i,
                                      prompt=ep.messages, prompt_ids=list(ep.prompt_ids), policy_version=0)
        await h.start(harness="bench")
        await asyncio.sleep(0)
        out0 = [LOOKUP, key_token(key), EOS]
        await h.record_turn(messages=ep.messages, prompt_ids=list(ep.prompt_ids), output_ids=out0,
                            output_log_probs=[-0.5] * 3, response_message={"role": "assistant", "content": task.decode(out0)},
                            policy_version=0)
        await asyncio.sleep(0)
        if abort:
            await h.abort("exception:Boom")
            return
        tool = task.tool_step(ep, 0, out0)
        ctx = list(ep.prompt_ids) + out0 + list(tool.ids)
        out1 = [ANSWER, value_token(value if correct else (value + 1) % 16), EOS]
        msgs = ep.messages + [{"role": "assistant", "content": task.decode(out0)}, {"role": "tool", "content": tool.text}]
        await h.record_turn(messages=msgs, prompt_ids=ctx, output_ids=out1, output_log_probs=[-0.5] * 3,
                            response_message={"role": "assistant", "content": task.decode(out1)}, policy_version=0)
        await asyncio.sleep(0)
        await h.finish(reward=1.0 if correct else 0.0)

    jobs = []
    for g in range(GROUPS_PER_BATCH):
        gid = f"b{b:05d}-g{g:02d}"
        ep = task.new_episode(rng)
        for i in range(GROUP_SIZE):
            jobs.append(member(gid, ep, i, rng.random() < ABORT_RATE, rng.random() < 0.5))
    await asyncio.gather(*jobs)


def play_events(target_events: int, seed: int = 0) -> tuple[MemoryLog, int]:
    """Play whole batches through the real SessionEngine (on a MemoryLog)
    until at least ``target_events`` are recorded; the log and its group count."""
    task = LookupTask()
    mem = MemoryLog()

    async def play() -> int:
        engine = await SessionEngine.open(mem)
        rng = random.Random(seed)
        b = 0
        with tqdm(total=target_events, desc="play sessions", unit="ev", leave=False) as bar:
            while mem.next_lsn < target_events:
                before = mem.next_lsn
                await _play_batch(engine, task, rng, b)
                bar.update(mem.next_lsn - before)
                b += 1
        await engine.close()
        return b

    batches = asyncio.run(play())
    return mem, batches * GROUPS_PER_BATCH


def write_partitions(mem: MemoryLog, root: Path, k: int, chunk: int = 1024) -> list[int]:
    """Copy the played events into ``k`` partition logs ``root/pNNNN`` (group
    ``i`` of a batch to partition ``i % k``, in their recorded order); the
    event count of each partition."""
    group_of: dict[str, int] = {}
    per: list[list[tuple]] = [[] for _ in range(k)]
    for env in mem.read(0):
        if isinstance(env.body, SessionOpened):
            group_of[env.session_id] = int(env.body.group_id.rsplit("-g", 1)[1])
        per[group_of[env.session_id] % k].append((env.session_id, env.session_seq, env.body))
    for pid, records in enumerate(per):
        log = FileLog.open(partition_dir(root, pid), fsync="batch", fence=True)
        try:
            for i in range(0, len(records), chunk):
                log.append_batch(records[i:i + chunk])
        finally:
            log.close()
    return [len(r) for r in per]


async def _learner_consume(root: Path, k: int, groups: int, groups_per_step: int) -> tuple[int, int]:
    """The learner's consumption path over ``k`` partitions until ``groups``
    groups are released: events read, groups released."""
    # As LoopLearner.run sets them up for a run of ``k`` workers (default [rollout] otherwise).
    cfg = LoopConfig(groups_per_step=groups_per_step, rollout=RolloutConfig(workers=k))
    sources = {pid: open_source(partition_dir(root, pid), check=False, partitioned=False) for pid in range(k)}
    fold = PartitionFold(cfg.reduce_config(), sources)
    cutter = StepCutter(fold, set(), step_size(cfg))
    watch = PartitionWatch.of_sources(cfg.rollout.lost_after_s, sources)
    idle_s = min(1.0, cfg.rollout.lost_after_s / 4) if cfg.rollout.lost_after_s > 0 else None
    events = released = 0
    stream = follow_sources(sources, {}, poll_s=0.01, idle_s=idle_s)
    try:
        async for pid, env in stream:
            events += pid is not None
            watch.saw(pid, fold.frontier)
            batch = cutter.take() if pid is None else cutter.feed(pid, env)
            if batch is not None:
                cutter.consumed_batch(batch)
                released += len(batch)
            if released + len(cutter.pending) >= groups:
                break
    finally:
        await stream.aclose()
    return events, released + len(cutter.pending)


def learner_consume(root: Path, k: int, groups: int, groups_per_step: int) -> tuple[int, int]:
    """:func:`_learner_consume`, run to completion on a fresh event loop."""
    return asyncio.run(_learner_consume(root, k, groups, groups_per_step))


def single_log_reduce(log_dir: Path) -> tuple[int, int]:
    """The anchor: ``read_log`` + one ``Reducer`` over one log: events, groups released."""
    reducer = Reducer(LoopConfig().reduce_config())
    events = groups = 0
    for env in read_log(log_dir):
        events += 1
        groups += len(reducer.feed(env).groups)
    return events, groups


def _cpu(fn) -> tuple[float, float, Any]:
    """(CPU seconds of this process, wall seconds, result)."""
    gc.collect()
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - w0, out


def merge_cost(work: Path, target_events: int, repeats: int) -> dict[str, Any]:
    """Measure part 1; returns µs/event per layout (CPU and wall) and the anchor."""
    t0 = time.perf_counter()
    mem, groups = play_events(target_events)
    total = mem.next_lsn
    play_s = time.perf_counter() - t0
    roots = {}
    for k in tqdm(PARTITION_COUNTS, desc="write partitions", unit="layout", leave=False):
        roots[k] = work / f"merge-{k}" / "rollout"
        sizes = write_partitions(mem, roots[k], k)
        assert sum(sizes) == total, (sizes, total)
    del mem
    os.sync()
    gps = LoopConfig().groups_per_step
    cpu: dict[Any, list[float]] = {k: [] for k in (*PARTITION_COUNTS, "anchor")}
    wall: dict[Any, list[float]] = {k: [] for k in cpu}
    with tqdm(total=repeats * len(cpu), desc="merge cost", unit="run", leave=False) as bar:
        for _ in range(repeats):
            for k in PARTITION_COUNTS:
                c, w, (n, g) = _cpu(lambda: learner_consume(roots[k], k, groups, gps))
                assert n == total and g == groups, (k, n, total, g, groups)
                cpu[k].append(c)
                wall[k].append(w)
                bar.update()
            c, w, (n, g) = _cpu(lambda: single_log_reduce(partition_dir(roots[1], 0)))
            assert n == total and g == groups, ("anchor", n, total, g, groups)
            cpu["anchor"].append(c)
            wall["anchor"].append(w)
            bar.update()
    return {
        "events": total, "groups": groups, "play_s": play_s,
        "us_cpu": {k: min(v) / total * 1e6 for k, v in cpu.items()},
        "us_wall": {k: min(v) / total * 1e6 for k, v in wall.items()},
    }


# ---------------------------------------------------------------- 2. rollout throughput


_TICK = os.sysconf("SC_CLK_TCK")
_PARTITION_ARG = re.compile(r"--partition\x00(\d+)")


def _children() -> dict[int, tuple[str, int | None, float]]:
    """This process's child processes: pid -> (kind, partition, CPU seconds so far)."""
    me = os.getpid()
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().decode()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) != me:  # ppid
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue  # a child exits between listing and reading
        kind = "worker" if "agentlog.loop.worker" in cmd else "learner" if "agentlog.loop.trainer" in cmd else "other"
        m = _PARTITION_ARG.search(cmd)
        partition = int(m.group(1)) if m else (0 if kind == "worker" else None)
        # utime, stime are fields 14 and 15 of stat; a zombie (exited, not yet reaped) keeps them.
        out[int(entry.name)] = (kind, partition, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


class ChildCpu:
    """Samples the CPU seconds of this process's children every ``every_s``
    while a run goes on: per child, its kind (worker, learner), partition and
    a timeline of (time.time_ns(), CPU seconds), on the clock of the logs'
    ``ts_ns``. A process's last <= ``every_s`` of CPU may be missed."""

    def __init__(self, every_s: float = 0.02) -> None:
        self.every_s = every_s
        self.kind: dict[int, tuple[str, int | None]] = {}
        self.timeline: dict[int, list[tuple[int, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-child-cpu", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                now = time.time_ns()
                for pid, (kind, partition, cpu) in _children().items():
                    # A zombie's cmdline is empty, and a child not yet exec'd shows ours:
                    # keep the first kind that names a loop process.
                    if self.kind.get(pid, ("other", None))[0] == "other":
                        self.kind[pid] = (kind, partition)
                    self.timeline.setdefault(pid, []).append((now, cpu))
                self._stop.wait(self.every_s)
        except BaseException as exc:  # re-raised by __exit__: a sampler must not die silently
            self.error = exc

    def __enter__(self) -> "ChildCpu":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"the /proc CPU sampler failed: {self.error!r}") from self.error

    def pids(self, kind: str) -> dict[int, int | None]:
        """pid -> partition of the children of ``kind``."""
        return {pid: part for pid, (k, part) in self.kind.items() if k == kind}

    def total(self, kind: str) -> float:
        """CPU seconds of the children of ``kind`` over their whole life (start-up included)."""
        return sum(self.timeline[pid][-1][1] for pid in self.pids(kind))

    def between(self, pid: int, t0_ns: int, t1_ns: int) -> float:
        """CPU seconds child ``pid`` used between two instants (nearest samples at or before them)."""
        line = self.timeline[pid]
        times = [t for t, _ in line]

        def at(t: int) -> float:
            i = bisect.bisect_right(times, t) - 1
            return line[max(i, 0)][1]

        return at(t1_ns) - at(t0_ns)


def run_with_workers(run_dir: Path, workers: int, steps: int, backend: str = "local", address: str = "",
                     groups_per_step: int = LoopConfig.groups_per_step, group_size: int = LoopConfig.group_size) -> dict[str, Any]:
    """The real loop with ``workers`` rollout workers (local processes, or Ray
    actors of ``backend`` "ray" on the cluster at ``address``), ``groups_per_step``
    groups of ``group_size`` per step; rates, CPU and latencies."""
    cfg = LoopConfig(steps=steps, warmup_steps=0, stop_reward=0.0, time_budget_s=0.0,
                     groups_per_step=groups_per_step, group_size=group_size,
                     rollout=RolloutConfig(workers=workers, backend=backend, address=address))
    with ChildCpu() as cpu:
        t0 = time.perf_counter()
        res = run_loop(cfg, run_dir, timeout_s=600)
        wall = time.perf_counter() - t0
    sources = Run.open(run_dir, cfg).rollout_logs()
    span_of: dict[int, tuple[int, int]] = {}  # partition -> (first session_opened, last event) ts_ns
    sessions = events = 0
    for pid, path in sources.items():
        first = last = None
        for env in path.read():
            events += 1
            if isinstance(env.body, SessionOpened):
                sessions += 1
                first = env.ts_ns if first is None else first
            last = env.ts_ns
        if first is not None:
            span_of[pid] = (first, last)
    span = (max(e for _, e in span_of.values()) - min(f for f, _ in span_of.values())) / 1e9
    busy_cpu: float | None = None
    if backend == "local":
        workers_seen = cpu.pids("worker")
        if sorted(workers_seen.values()) != sorted(sources):
            raise RuntimeError(f"sampled worker processes of partitions {sorted(workers_seen.values())}, expected {sorted(sources)}")
        # Each worker's CPU while it ran sessions: from its partition's first session_opened to its last event.
        busy_cpu = sum(cpu.between(p, *span_of[part]) for p, part in workers_seen.items() if part in span_of)
    # else Ray actors: not this process's children (nor, on a cluster, on this node); no CPU figure.
    lat = release_to_step(run_dir, sources)
    return {
        "workers": workers, "wall_s": wall, "span_s": span, "sessions": sessions, "events": events,
        "sessions_per_s": sessions / span, "events_per_s": events / span,
        "worker_cpu_s": cpu.total("worker") if backend == "local" else None, "learner_cpu_s": cpu.total("learner"),
        "worker_cpu_per_session_ms": busy_cpu / sessions * 1e3 if busy_cpu is not None else None,
        "steps": sum(1 for r in res.records if r.step > 0), **lat,
    }


# ---------------------------------------------------------------- 3. release -> step


def release_to_step(run_dir: Path, sources: dict[int, Any]) -> dict[str, Any]:
    """Per group of every learner record: the record's envelope time minus the
    time of the group's last terminal event (its members' terminal LSNs, as
    the record names them, looked up in their partition)."""
    records: list[tuple[PolicyUpdated, int]] = [
        (env.body, env.ts_ns) for env in Run.open(run_dir).learner.read()
        if isinstance(env.body, PolicyUpdated) and env.body.step > 0
    ]
    wanted: dict[int, set[int]] = {}
    for rec, _ in records:
        for ref in rec.batch:
            wanted.setdefault(ref.partition, set()).update(m.terminal_lsn for m in ref.members if m.terminal_lsn >= 0)
    ts_of: dict[tuple[int, int], int] = {}
    for pid, lsns in wanted.items():
        for env in sources[pid].read(min(lsns) if lsns else 0):
            if env.lsn in lsns:
                ts_of[(pid, env.lsn)] = env.ts_ns
    lat = []
    for rec, ts in records:
        for ref in rec.batch:
            ends = [ts_of[(ref.partition, m.terminal_lsn)] for m in ref.members if m.terminal_lsn >= 0]
            if ends:
                lat.append((ts - max(ends)) / 1e9)
    return {"lat_p50_s": percentile(lat, 50), "lat_p99_s": percentile(lat, 99), "lat_groups": len(lat)}


# ---------------------------------------------------------------- main


def _num(v: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    """Run every measurement, print the tables and the GOAL line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (under a minute)")
    p.add_argument("--events", type=int, default=None, help="events for the merge cost (default 200,000; quick 30,000)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per loop run (default 20; quick 3)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats of the merge cost (default 3; quick 2)")
    p.add_argument("--skip-loop", action="store_true", help="only the merge cost (parts 2 and 3 need ~1-4 min)")
    p.add_argument("--keep", type=Path, default=None, help="keep the logs and run folders under this directory "
                   "(with --backend ray on a cluster: a directory on the filesystem every node shares)")
    p.add_argument("--workers", default=",".join(map(str, WORKER_COUNTS)), help="worker counts of the loop runs (default 1,2,4)")
    p.add_argument("--backend", choices=("local", "ray"), default="local", help="rollout workers as local processes or Ray actors")
    p.add_argument("--address", default="", help="ray: the cluster to join (e.g. auto); default: a local Ray")
    p.add_argument("--groups-per-step", type=int, default=LoopConfig.groups_per_step,
                   help=f"groups per step of the loop runs (default {LoopConfig.groups_per_step})")
    p.add_argument("--group-size", type=int, default=LoopConfig.group_size,
                   help=f"sessions per group of the loop runs (default {LoopConfig.group_size})")
    args = p.parse_args(argv)
    # structlog is left unconfigured, so the library's loggers stay silent
    # (agentlog._logging): the tables are the output.
    try:
        worker_counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        worker_counts = []
    if not worker_counts or min(worker_counts) < 1:
        p.error(f"--workers: expected worker counts >= 1 separated by commas (e.g. 1,2,4), found {args.workers!r}")
    target = args.events or (30_000 if args.quick else 200_000)
    steps = args.steps or (3 if args.quick else 20)
    repeats = args.repeats or (2 if args.quick else 3)
    work = Path(tempfile.mkdtemp(prefix="bench_partitions_")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    try:
        mc = merge_cost(work, target, repeats)
        runs = []
        if not args.skip_loop:
            for n in tqdm(worker_counts, desc="loop runs", unit="run", leave=False):
                runs.append(run_with_workers(work / f"loop-{n}", n, steps, args.backend, args.address,
                                             args.groups_per_step, args.group_size))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    print(f"learner consumption: {mc['events']:,} events ({mc['groups']:,} groups of {GROUP_SIZE}, lookup task, "
          f"{ABORT_RATE:.0%} aborted) played through the SessionEngine in {mc['play_s']:.1f} s, copied into 1/4/16 partitions; "
          f"CPU time, min of {repeats}")
    print(f"{'consumer':<58} {'µs/event CPU':>13} {'µs/event wall':>14} {'× 1 partition':>14}")
    base = mc["us_cpu"][1]
    for k in PARTITION_COUNTS:
        print(f"{f'follow_logs + StepCutter/PartitionFold, {k} partition(s)':<58} {mc['us_cpu'][k]:>13.2f} {mc['us_wall'][k]:>14.2f} {mc['us_cpu'][k] / base:>13.2f}x")
    print(f"{'anchor: read_log + Reducer, one log':<58} {mc['us_cpu']['anchor']:>13.2f} {mc['us_wall']['anchor']:>14.2f} {mc['us_cpu']['anchor'] / base:>13.2f}x")
    if runs:
        print()
        where = "local worker processes" if args.backend == "local" else f"Ray actors ({args.address or 'a local Ray'})"
        print(f"rollout: the real loop (learner + N {where}), lookup task, {args.groups_per_step} groups x "
              f"{args.group_size} per step, {steps} steps, no warm-up, default faults, {os.cpu_count()} CPUs here")
        print("  span: first session_opened to last rollout event; worker CPU/session: each worker's CPU over its own"
              " partition's span (start-up excluded); CPU s: whole processes, start-up included (local workers only)")
        print(f"{'workers':>7} {'wall s':>7} {'span s':>7} {'sessions':>9} {'sessions/s':>11} {'events/s':>9} "
              f"{'worker CPU ms/session':>22} {'worker CPU s':>13} {'learner CPU s':>14} {'release->step p50 ms':>21} {'p99 ms':>8} {'groups':>7}")
        for r in runs:
            print(f"{r['workers']:>7} {r['wall_s']:>7.1f} {r['span_s']:>7.2f} {r['sessions']:>9} {r['sessions_per_s']:>11.1f} "
                  f"{r['events_per_s']:>9.0f} {_num(r['worker_cpu_per_session_ms'], 22, 2)} {_num(r['worker_cpu_s'], 13, 1)} {r['learner_cpu_s']:>14.1f} "
                  f"{r['lat_p50_s'] * 1e3:>21.0f} {r['lat_p99_s'] * 1e3:>8.0f} {r['lat_groups']:>7}")
        one = runs[0]["sessions_per_s"]
        print(f"sessions/s vs {runs[0]['workers']} worker(s): " + ", ".join(f"{r['workers']} workers {r['sessions_per_s'] / one:.2f}x" for r in runs))
    print()
    ratio = mc["us_cpu"][16] / mc["us_cpu"][1]
    print(goal_line("merge_16_vs_1_partition_cost_per_event", f"{ratio:.2f}x", "<=", f"{GOAL_RATIO}x", meets(ratio, "<=", GOAL_RATIO)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
