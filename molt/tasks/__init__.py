"""Tasks: prompts with reference answers, as records the dataset source emits.

A record is ``{"prompt_id", "messages": [{"role", "content"}], "answer", "task",
"split", ...}`` (:mod:`molt.tasks.records`). Tasks: generated arithmetic
(:mod:`molt.tasks.arithmetic`), GSM8K files (:mod:`molt.tasks.gsm8k`), and any
JSONL/Parquet file of such records; select one in YAML with ``task: {type: ...}``
(:mod:`molt.tasks.configs`). :mod:`molt.tasks.cursor` iterates a task resumably.
"""

from molt.tasks.arithmetic import ArithmeticProblems
from molt.tasks.configs import ArithmeticTask, GSM8KTask, JSONLTask, ParquetTask, TaskConfig, preflight_task
from molt.tasks.cursor import PromptNode, prompt_batches
from molt.tasks.gsm8k import final_answer, read_gsm8k
from molt.tasks.records import Record, RecordSet, Task, generic_record, read_jsonl, read_parquet, read_prompts

__all__ = [
    "preflight_task",
    "ArithmeticProblems", "ArithmeticTask", "GSM8KTask", "JSONLTask", "ParquetTask", "PromptNode",
    "Record", "RecordSet", "Task", "TaskConfig", "final_answer", "generic_record", "prompt_batches",
    "read_gsm8k", "read_jsonl", "read_parquet", "read_prompts",
]
