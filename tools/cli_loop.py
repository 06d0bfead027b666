"""What `agentlog demo` and `agentlog train` share: flags from LoopConfig, and the run itself.

Command-line glue only: the loop library (``agentlog.loop``) runs without it,
from a LoopConfig built in Python (see its package docstring).

Every LoopConfig and FaultConfig field becomes a flag (``--group-size``,
``--exception-rate``...) whose help is the field's docstring, so ``--help``
documents every knob; learner settings go through ``--learner KEY=VALUE``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Sequence

from agentlog.events.fs import atomic_path
from agentlog.tools.cli import EXIT_DATA, EXIT_INTERRUPTED, EXIT_USAGE, CliError
from agentlog.tools.cli_common import positive_float

from agentlog.loop.config import ConfigError, FaultConfig, LoopConfig, MetricsConfig, field_help


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, found {text!r}")


def add_config_flags(p, *, defaults: LoopConfig) -> None:
    """One flag per LoopConfig / FaultConfig field (help = the field's docstring)."""
    loop_help = field_help(LoopConfig)
    group = p.add_argument_group("loop settings (LoopConfig)")
    for f in dataclasses.fields(LoopConfig):
        if _is_table(defaults, f.name):
            continue  # tables ([agent], [inference], [metrics], ...): set in the TOML config
        default = getattr(defaults, f.name)
        if isinstance(default, list):
            # A list field (task_modules, task_path): one value per flag, repeatable, added to the config's.
            group.add_argument(_flag(f.name), dest=f.name, action="append", default=None, metavar=f.name.upper().removesuffix("S"),
                               help=f"{loop_help.get(f.name, '')} (repeatable; adds to the config's)".replace("%", "%%"))
            continue
        kind = _parse_bool if isinstance(default, bool) else type(default)
        group.add_argument(_flag(f.name), dest=f.name, type=kind, default=None, metavar=f.name.upper(),
                           help=f"{loop_help.get(f.name, '')} (default {default})".replace("%", "%%"))
    fault_help = field_help(FaultConfig)
    fg = p.add_argument_group("fault injection (FaultConfig; on by default)")
    fg.add_argument("--no-faults", action="store_true", help="inject no faults at all")
    for f in dataclasses.fields(FaultConfig):
        default = getattr(defaults.faults, f.name)
        fg.add_argument(_flag(f.name), dest=f"fault_{f.name}", type=float, default=None, metavar="X",
                        help=f"{fault_help.get(f.name, '')} (default {default})".replace("%", "%%"))
    # --- the [metrics] table
    metrics_help = field_help(MetricsConfig)
    mg = p.add_argument_group("metric sinks (the [metrics] table)")
    for f in dataclasses.fields(MetricsConfig):
        default = getattr(defaults.metrics, f.name)
        kind = _parse_bool if isinstance(default, bool) else type(default)
        mg.add_argument(_flag(f.name), dest=f"metrics_{f.name}", type=kind, default=None, metavar=f.name.upper(),
                        help=f"{metrics_help.get(f.name, '')} (default {default!r})".replace("%", "%%"))
    # --- the [rollout] table's worker count
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help=f"rollout workers, one log partition each ([rollout] workers; default {defaults.rollout.workers}); "
                        "on the local backend they are processes on this machine")
    from agentlog.learner.config import LearnerConfig

    names = ", ".join(f.name for f in dataclasses.fields(LearnerConfig))
    p.add_argument("--learner", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a learner.config.LearnerConfig field (repeatable; JSON values). Fields: {names}. "
                        f"Default overrides: {json.dumps(defaults.learner)}")


def _toml_value(v) -> str:
    """A default as it is written in a TOML file."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    return str(v)


def _table_lines(header: str, cls, values: dict, note: str = "") -> list[str]:
    """``header`` (``[name]``) and one entry per field of dataclass ``cls``: ``key = default`` and the field's docstring."""
    docs = field_help(cls)
    lines = [header + (f"  ({note})" if note else "")]
    for f in dataclasses.fields(cls):
        if f.name not in values:
            key = f.name  # no default: required
        elif values[f.name] is None:
            key = f"{f.name}  (default: unset)"
        else:
            key = f"{f.name} = {_toml_value(values[f.name])}"
        text = " ".join(docs.get(f.name, "").split())
        lines.append(f"  {key}")
        lines.extend(textwrap.wrap(text, 96, initial_indent="      ", subsequent_indent="      "))
    return lines


def config_reference(defaults: LoopConfig) -> str:
    """Every key of a ``train`` config file, generated from the config types
    (LoopConfig's tables, LearnerConfig, the ``[task]`` table, the teachers),
    with its default and docstring: what ``--help`` prints after the flags."""
    from agentlog.learner.config import LearnerConfig
    from agentlog.loop.config import TASK_TABLE_KEYS
    from agentlog.loop.config_sections import TeacherSpec

    top = [f.name for f in dataclasses.fields(LoopConfig) if not _is_table(defaults, f.name) and f.name not in TASK_TABLE_KEYS.values()]
    loop_help = field_help(LoopConfig)
    intro = ("config file (agentlog train --config FILE, TOML; flags override it): its top-level keys are the loop "
             "settings above without the dashes (--group-size is group_size): " + ", ".join(top) + ". Its tables and "
             "their keys, with defaults:")
    lines = [*textwrap.wrap(intro, 100), "", "[task]  (the task and the modules that register it)"]
    for key, field_name in TASK_TABLE_KEYS.items():
        default = getattr(defaults, field_name)
        lines.append(f"  {key} = {_toml_value(default)}")
        lines.extend(textwrap.wrap(" ".join(loop_help.get(field_name, "").split()), 96,
                                   initial_indent="      ", subsequent_indent="      "))
    learner_defaults = {f.name: getattr(LearnerConfig(), f.name) for f in dataclasses.fields(LearnerConfig)}
    learner_defaults.update(defaults.learner)
    lines += _table_lines("[learner]", LearnerConfig, learner_defaults, "learner.config.LearnerConfig; --learner KEY=VALUE")
    for f in dataclasses.fields(LoopConfig):
        value = getattr(defaults, f.name)
        if not dataclasses.is_dataclass(value):
            continue
        lines += _table_lines(f"[{f.name}]", type(value), dataclasses.asdict(value), type(value).__name__)
        if f.name == "distill":
            given = {t.name: t.default for t in dataclasses.fields(TeacherSpec) if t.default is not dataclasses.MISSING}
            lines += _table_lines("[[distill.teachers]]", TeacherSpec, given, "TeacherSpec; one table per teacher")
    return "\n".join(lines)


def _is_table(cfg: LoopConfig, name: str) -> bool:
    """Whether LoopConfig field ``name`` is a TOML table (a nested dataclass or a dict), which gets no flag of its own."""
    value = getattr(cfg, name)
    return name in ("faults", "learner") or dataclasses.is_dataclass(value) or isinstance(value, dict)


def add_output_flags(p) -> None:
    """Where the run goes and how it is shown."""
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="run folder (default runs/<run-id>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-report", action="store_true", help="skip report.html")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="S", help="give up (exit 1) after S seconds (> 0)")


def config_from_args(args, base: LoopConfig, *, task_modules: Sequence[str] = (), import_dirs: Sequence[Path] = ()) -> LoopConfig:
    """``base`` with every flag the user gave applied on top.

    ``task_modules`` (``--import``) are added to the config's; when there are
    any, ``import_dirs`` (the config file's directory) and the current
    directory go at the end of ``task_path``, so that a module beside the
    config or in the directory the command runs from imports like under
    ``python -m``, in the worker and learner processes too."""
    values = base.to_dict()
    for f in dataclasses.fields(LoopConfig):
        if _is_table(base, f.name):
            continue  # faults and learner have --<fault field> and --learner KEY=VALUE; other tables come from --config
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = list(values[f.name]) + v if isinstance(values[f.name], list) else v
    # --- task modules: --import adds to the config's [task] module
    values["task_modules"] = list(values["task_modules"]) + [m for m in task_modules if m not in values["task_modules"]]
    if values["task_modules"]:
        values["task_path"] = list(values["task_path"]) + [str(d) for d in [*import_dirs, Path.cwd()]]
    # Absolute and without repeats: the worker and the learner may run from another directory.
    values["task_path"] = list(dict.fromkeys(os.path.abspath(p) for p in values["task_path"]))
    faults = dict(values["faults"])
    if getattr(args, "no_faults", False):
        faults = dataclasses.asdict(FaultConfig.none())
    for f in dataclasses.fields(FaultConfig):
        v = getattr(args, f"fault_{f.name}", None)
        if v is not None:
            faults[f.name] = v
    values["faults"] = faults
    metrics = dict(values["metrics"])
    for f in dataclasses.fields(MetricsConfig):
        v = getattr(args, f"metrics_{f.name}", None)
        if v is not None:
            metrics[f.name] = v
    values["metrics"] = metrics
    if getattr(args, "workers", None) is not None:
        values["rollout"] = {**values["rollout"], "workers": args.workers}
    learner = dict(values["learner"])
    for item in getattr(args, "learner", []) or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise CliError(f"--learner {item!r}: expected KEY=VALUE", EXIT_USAGE)
        try:
            learner[key.strip()] = json.loads(raw)
        except ValueError:
            learner[key.strip()] = raw
    values["learner"] = learner
    try:
        cfg = LoopConfig.from_dict(values)
        cfg.learner_config()  # validate the learner table now, not in a child process
    except (ConfigError, ValueError) as exc:
        raise CliError(f"configuration: {exc}", EXIT_USAGE) from None
    return cfg


def check_rollout_backend(cfg: LoopConfig) -> None:
    """CliError (exit 2) when ``[rollout] backend = "ray"`` but Ray is not
    installed, saying how to install it (found without importing it: a local
    Ray reads its environment when first imported, in loop/ray_rollout.py),
    or when nothing listens at ``[rollout] address``."""
    import importlib.util

    if cfg.rollout.backend != "ray":
        return
    if importlib.util.find_spec("ray") is None:
        raise CliError("[rollout] backend = \"ray\" needs Ray, which is not installed; install it with: pip install 'agentlog[ray]'",
                       EXIT_USAGE)
    from agentlog.loop.ray_rollout import RayBackendError, probe_address

    try:
        probe_address(cfg.rollout.address)
    except RayBackendError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def check_task(cfg: LoopConfig) -> None:
    """Load the config's task modules, then select its task: CliError (exit 2)
    naming the module that cannot be imported and why, or listing the
    registered tasks when ``cfg.task`` is not one of them."""
    from agentlog.engine.tasks import TaskError, TaskImportError, load_tasks, select_task

    try:
        load_tasks(cfg.task_modules, cfg.task_path)
    except TaskImportError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except TaskError as exc:
        raise CliError(f"[task]: {exc}", EXIT_USAGE) from None
    try:
        select_task(cfg.task)
    except TaskError as exc:
        raise CliError(f"task: {exc}", EXIT_USAGE) from None


def _log_line(run_dir: Path) -> str:
    """Where the run's rollout and learner logs are, for the summary (as the run's config pinned them)."""
    from agentlog.loop.run_folder import Run

    with Run.open(run_dir) as run:
        return run.describe()


def write_report(run_dir: Path) -> str:
    """``report.html`` through the report command; returns a one-line note."""
    try:
        from agentlog.tools import cmd_report  # noqa: F401
    except ImportError:
        return "report.html skipped: the report command (tools/cmd_report.py) is not installed"
    from agentlog.tools.cli import main as cli_main

    out = run_dir / "report.html"
    rc = cli_main(["report", str(run_dir), "-o", str(out), "--quiet"])  # the run folder: learner curves too
    if rc != 0:
        return f"report.html failed (agentlog report exit {rc})"
    return f"report   {out}"


def execute(cfg: LoopConfig, args, *, title: str, prepare=None) -> int:
    """Run the loop on ``cfg`` and do everything after it: summary, chart, report, check.
    ``prepare(cfg, run_dir) -> cfg`` (optional) runs once the new run folder exists, before
    the loop starts, and may hand back a changed config (the demo's teacher is built there)."""
    from agentlog.loop.run import new_run_id
    from agentlog.loop.runlog import configure_process_logging, restore_logging

    run_dir = args.out or Path("runs") / new_run_id(cfg.seed)
    # Everything that can be refused is checked before the run folder exists:
    # a refused run leaves nothing behind that would block the next --out.
    check_task(cfg)
    check_rollout_backend(cfg)
    if run_dir.exists() and not run_dir.is_dir():
        raise CliError(f"--out {run_dir}: is a file, expected a run folder (new or empty)", EXIT_USAGE)
    from agentlog.loop.run_folder import Run

    if Run.has_config(run_dir):
        from agentlog.loop.run_marker import incomplete_reason

        why = incomplete_reason(run_dir)
        state = f"an incomplete run ({why}; runs are not resumed)" if why else "a run"
        raise CliError(f"--out {run_dir}: already holds {state}; choose another --out", EXIT_USAGE)
    inside = next((p for p in run_dir.absolute().parents if Run.has_config(p)), None)
    if inside is not None:  # its logs, checkpoints and folders would mix with this run's
        raise CliError(f"--out {run_dir}: is inside the run folder {inside}; choose a folder outside any run", EXIT_USAGE)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"--out {run_dir}: cannot create the run folder: {exc.strerror or exc}", EXIT_USAGE) from None
    # The demo's own folder is new each time; runs/demo names the latest, as the README's examples use it.
    shown = _link_latest(run_dir, Path("runs") / "demo") if title == "demo" and args.out is None else run_dir
    with restore_logging():
        configure_process_logging(run_dir, "main", console=sys.stderr, console_level="info")
        if prepare is not None:
            cfg = prepare(cfg, run_dir)
        return _execute(cfg, args, run_dir, title, shown)


def _link_latest(run_dir: Path, link: Path) -> Path:
    """Point the symlink ``link`` at ``run_dir`` (replacing an older link, atomically) and return
    ``link``; when ``link`` is something else (a real folder), leave it and return ``run_dir``."""
    if os.path.lexists(link) and not link.is_symlink():
        return run_dir
    try:
        with atomic_path(link, durable=False) as tmp:  # a convenience link: not fsynced
            tmp.symlink_to(run_dir.name if run_dir.parent == link.parent else run_dir.absolute(), target_is_directory=True)
    except OSError as exc:
        print(f"agentlog: note: could not point {link} at {run_dir}: {exc.strerror or exc}", file=sys.stderr)
        return run_dir
    return link


def next_commands(run: Path, zero_reward_session: str) -> list[str]:
    """What to try after a run, on the run folder ``run`` as the user can type it."""
    pairs = [(f"agentlog show {run} {zero_reward_session}", "why this session scored 0")] if zero_reward_session else []
    pairs += [(f"agentlog replay {run} --status aborted", "every aborted session and its reason"),
              (f"agentlog stats {run}", "outcomes, rewards, tokens, groups")]
    width = max(len(cmd) for cmd, _ in pairs)
    return [f"{cmd:<{width}}  # {why}" for cmd, why in pairs]


def _execute(cfg: LoopConfig, args, run_dir: Path, title: str, shown: Path) -> int:
    from agentlog.loop.check import check_run
    from agentlog.loop.run import LoopError, plot_reward, run_loop, summary_table
    from agentlog.loop.run_marker import INCOMPLETE_MARKER
    from agentlog.tools.progress import LoopProgress

    import structlog

    log = structlog.get_logger().bind(component=title)
    log.info(f"{title}.start", run_dir=str(run_dir), steps=cfg.steps, seed=cfg.seed, task=cfg.task,
             groups_per_step=cfg.groups_per_step, group_size=cfg.group_size, warmup_steps=cfg.warmup_steps)
    t0 = time.monotonic()
    try:
        bar = None if args.quiet else (lambda run_cfg, folder: LoopProgress(run_cfg, folder, f"agentlog {title}", sys.stderr))
        res = run_loop(cfg, run_dir, progress=bar, timeout_s=args.timeout)
    except LoopError as exc:
        raise CliError(f"{run_dir}: {exc} (the run folder is marked {INCOMPLETE_MARKER})", EXIT_DATA) from None
    except KeyboardInterrupt:
        raise CliError(f"{run_dir}: interrupted; the run is incomplete and marked so ({run_dir / INCOMPLETE_MARKER}). Its logs "
                       f"hold what ran (agentlog stats {run_dir}); a run cannot be resumed: start a new one with another --out",
                       EXIT_INTERRUPTED) from None
    print(summary_table(res, cfg))
    png = plot_reward(res.records, run_dir / "reward.png")
    note = "report.html skipped (--no-report)" if args.no_report else write_report(run_dir)
    check = check_run(run_dir, cfg)
    print("")
    print(f"run      {run_dir}" + (f" (also {shown})" if shown != run_dir else ""))
    print(f"logs     {_log_line(run_dir)}, {run_dir / 'logs'} (structlog JSON)")
    print(f"chart    {png}")
    print(note)
    verdict = "EQUAL" if check.ok else "DIFFERENT"
    print(f"offline reconstruction of the rollout log vs the learner's online digests: {verdict} "
          f"({check.digests_equal}/{check.steps} steps equal, {check.groups_consumed} groups each consumed once)")
    for line in (check.mismatches + check.duplicates + check.missing + check.unknown)[:10]:
        print(f"  {line}")
    for i, line in enumerate(next_commands(shown, res.zero_reward_session)):
        print(f"{'next' if i == 0 else '':<8} {line}")
    log.info(f"{title}.done", seconds=round(time.monotonic() - t0, 1), digests_equal=check.ok)
    return 0 if check.ok else EXIT_DATA
