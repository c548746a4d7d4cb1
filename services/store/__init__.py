"""The trajectory store, in one place: the service (service.py: intake → grading → hand-out →
report), its in-memory state (state.py), its Redis record (repo.py), the intake checks
(intake.py) and the Parquet archive (archive.py)."""
