"""The trajectory store, in one place:

    service.py   the service: intake → grading → hand-out → report, and the end of a run
    state.py     its in-memory state (one table, a transition map)
    repo.py      its Redis record (keys.py: every key name, only here)
    admission.py the transactions over the gate's counters and the record together (admit, refill,
                 finish a group), one Lua script each
    record.py    the run-level facts other services read or write (the run's end, the data cursor,
                 a task's record, the admitted count), behind named calls
    client.py    the learner's side: batches from one store or gathered from every replica
    intake.py    the intake checks                 roc.py resample-on-correct
    archive.py   the Parquet archive
"""
