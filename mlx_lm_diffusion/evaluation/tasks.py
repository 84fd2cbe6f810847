"""lm-eval's task index for the tasks asked for, and the names it does not know (lm-eval required).

Indexing lm-eval's built-in tasks reads some fifteen thousand YAML files (about ten
seconds); tasks from `--include-path` alone are indexed in milliseconds. So the local
directory is indexed first, and the built-in tasks only when it does not hold every
task asked for. Unknown names are refused before the model is loaded, in one line.
"""

from __future__ import annotations

import re
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
        raise ValueError(
            f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}{where}; "
            "list lm-eval's with `lm-eval ls tasks`, or add a directory of YAML tasks with --include-path"
        )
    return manager


# what in a task YAML makes lm-eval run code or read outside the directory
_FUNCTION = re.compile(r"!function\s+(\S+)")
_INCLUDE = re.compile(r"^\s*include\s*:\s*['\"]?([^'\"\s#]+)", re.M)


def check_task_code(include_path: Optional[str], names: Sequence[str], confirmed: bool) -> None:
    """Refuse (ValueError), unless `confirmed` (--confirm-run-unsafe-code), local task YAML that
    runs Python (`!function module.name`: lm-eval imports the task directory's module) or
    includes a file from outside its directory. Read as text: nothing of it runs here.
    (lm-eval's Jinja templates, `doc_to_text` and friends, render unsandboxed: a task
    directory is code; docs/evaluation.md says so.)"""
    if confirmed:
        return
    files = [Path(n) for n in names if Path(n).is_file()]
    if include_path is not None:
        files += sorted(Path(include_path).rglob("*.yaml")) + sorted(Path(include_path).rglob("*.yml"))
    for path in files:
        text = path.read_text(errors="replace")
        function = _FUNCTION.search(text)
        if function:
            raise ValueError(
                f"{path} runs Python code ({function.group(0)}); pass --confirm-run-unsafe-code to run a task you trust"
            )
        for target in _INCLUDE.findall(text):
            resolved = (path.parent / target).resolve()
            root = Path(include_path).resolve() if include_path is not None else path.parent.resolve()
            if root not in resolved.parents and resolved != root:
                raise ValueError(f"{path} includes {target}, outside {root}; pass --confirm-run-unsafe-code to read it")
