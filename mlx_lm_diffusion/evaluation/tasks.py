"""lm-eval's task index for the tasks asked for, and the names it does not know (lm-eval required).

Indexing lm-eval's built-in tasks reads some fifteen thousand YAML files (about ten
seconds); tasks from `--include-path` alone are indexed in milliseconds. So the local
directory is indexed first, and the built-in tasks only when it does not hold every
task asked for. Unknown names are refused before the model is loaded, in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from lm_eval.tasks import TaskManager

BUILTIN_TASKS = True  # whether lm-eval's own tasks may be indexed (a test turns it off)


def _unknown(manager: TaskManager, names: Sequence[str]) -> list:
    # (a task may also be given as the path of its YAML file, as lm-eval allows)
    return [n for n in names if not manager.match_tasks([n]) and not Path(n).is_file()]


def task_manager(names: Sequence[str], include_path: Optional[str] = None) -> TaskManager:
    """A TaskManager that knows every name in `names` (task, group or tag names, glob
    patterns, YAML paths); ValueError naming the ones nobody knows."""
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ValueError(f"--include-path {include_path}: no such directory")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if not _unknown(local, names):
            return local
        if not BUILTIN_TASKS:
            return _checked(local, names, f"looked in {include_path}")
    if not BUILTIN_TASKS:
        raise ValueError("no tasks to look in: give --include-path")
    where = "looked in lm-eval's tasks" + (f" and {include_path}" if include_path else "")
    return _checked(TaskManager(include_path=include_path), names, where)


def _checked(manager: TaskManager, names: Sequence[str], where: str) -> TaskManager:
    unknown = _unknown(manager, names)
    if unknown:
        where = f" ({where})"
        raise ValueError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}{where}; "
                         "list lm-eval's with `lm-eval ls tasks`, or add a directory of YAML tasks with --include-path")
    return manager
