"""Judging records: derived tolerances (`tolerance.py`), one comparator per kind of record
(`comparators.py`) and the Finding each judgement yields (`finding.py`)."""
