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
#: The demo's distillation settings, from the sweep of tools/bench/bench_distill.py (seed 0, steps
#: to a 10-step mean reward of 0.9; RL alone 25-26): lambda (``distill_coef``) 1.0 never got there in
#: 50 steps (the teacher's log-prob of a wrong value is about -15, and the student collapsed onto
#: wrong values), 0.1 alone not in 30 (0.84 at 30); lambda 0.1 with the teacher's top-4 and the
#: learner's top-K forward KL (``distill_topk_coef``) 1.0 got there in 24 steps, 10.0 in 23.
DEMO_DISTILL_COEF = 0.1
DEMO_TOPK = 4
DEMO_TOPK_COEF = 10.0
