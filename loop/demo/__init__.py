"""Demo-only parts of the online loop: nothing here is needed to train a real task.

* :mod:`.faults`: faults the rollout worker injects on purpose
  (``LoopConfig.faults``), to show that aborted, timed-out, dropped and
  straggling sessions are recorded and handled like real ones;
* :mod:`.warmup`: the supervised warm-up of the built-in GPT on task
  demonstrations (``LoopConfig.warmup_steps``), which teaches the lookup
  task's protocol before RL.

The built-in lookup task itself stays in ``engine/tasks/lookup.py``: the
task registry lives in the engine and registers it there, so every process
(worker, learner, ``agentlog`` commands) can select ``"lookup"`` by name
without importing the loop.
"""
