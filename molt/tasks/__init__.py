"""Tasks: prompts with reference answers, as the records the dataset source emits (records.py).

Select one in YAML with ``task: {type: ...}`` (configs.py); cursor.py iterates it resumably.
"""

from molt.tasks.arithmetic import ArithmeticProblems
from molt.tasks.configs import ArithmeticTask, GSM8KTask, JSONLTask, ParquetTask, TaskConfig
from molt.tasks.cursor import PromptNode, prompt_batches
from molt.tasks.gsm8k import final_answer, read_gsm8k
from molt.tasks.records import Record, RecordSet, Task, read_prompts

__all__ = [
    "ArithmeticProblems", "ArithmeticTask", "GSM8KTask", "JSONLTask", "ParquetTask", "PromptNode",
    "Record", "RecordSet", "Task", "TaskConfig", "final_answer", "prompt_batches", "read_gsm8k",
    "read_prompts",
]
