"""`poslens study`: from nothing to a report; see study/run.py for the output layout."""

from poslens.study.config import PRESETS, StudyConfig, preset
from poslens.study.run import run_study

__all__ = ["PRESETS", "StudyConfig", "preset", "run_study"]
