"""Tasks the online loop trains on: the token-level and text-level interfaces, the registry, the built-in lookup task (the demo's; see lookup.py) and the loader of user task modules (loading.py)."""

from .base import Episode, Task, TaskError, ToolResult, Verdict, register_task, select_task, task_names  # noqa: F401
from .text import TextEpisode, TextTask, verdict_of_command, write_files, write_files_command  # noqa: F401
from .lookup import LookupTask  # noqa: F401  (registers "lookup")
from .loading import ENTRY_POINT_GROUP, TaskImportError, load_tasks  # noqa: F401
