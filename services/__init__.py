"""The mesh's services, one process each: they wire the layers below and do the I/O.

    rollout.py       TASKS → the agent loop on an engine → TRAJ_RAW
    environment.py   gRPC Reset/Step/Close with sticky sessions
    grader.py        TRAJ_RAW → verify → TRAJ_GRADED
    store/           the trajectory store: intake, grading outcomes, the gate's record, batches, the archive
    learner.py       batches from the store → the recipe and a step → weights v+1
    evaluator.py     weight announcements → held-out evaluation → EVAL records

Imports: everything below (core, envs, graders, rollout, learner); never trajmesh/run/.
"""
