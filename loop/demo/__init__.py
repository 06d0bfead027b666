"""Demo-only parts of the online loop: nothing here is needed to train a real task.

* :mod:`.faults`: faults the rollout worker injects on purpose
  (``LoopConfig.faults``), to show that aborted, timed-out, dropped and
  straggling sessions are recorded and handled like real ones;
* :mod:`.warmup`: the supervised warm-up of the built-in GPT on task
  demonstrations (``LoopConfig.warmup_steps``), which teaches the lookup
  task's protocol before RL;
* :mod:`.teacher_model`: the teacher of ``agentlog demo --distill``, a
  bigger built-in GPT trained in code until it solves the task.

The built-in lookup task itself stays in ``engine/tasks/lookup.py``: the
task registry lives in the engine and registers it there, so every process
(worker, learner, ``agentlog`` commands) can select ``"lookup"`` by name
without importing the loop.
"""

#: The name the demo's teacher records with its scores.
TEACHER_NAME = "gpt-teacher"
#: The demo's lambda (``distill_coef``), from the sweep of tools/bench/bench_distill.py.
DEMO_DISTILL_COEF = 1.0
