"""The trajectory store, in one place:

    service.py   the service: intake → grading → hand-out → report, and the end of a run
    state.py     its in-memory state (one table, a transition map)
    repo.py      its Redis record                  client.py the small client other services call
    intake.py    the intake checks                 roc.py resample-on-correct
    archive.py   the Parquet archive
"""
