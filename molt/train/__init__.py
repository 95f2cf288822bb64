"""The trainer: step planning and packing, the FSDP2 policy, AdamW, the train step, export."""

from molt.train.model import PolicyModel, full_state_dict, load_policy, shard_policy
from molt.train.optim import OptimConfig
from molt.train.packing import StepPlan, pack_sequences, plan_step
from molt.train.step import ObjectiveConfig, StepResult, check_staleness, train_step

__all__ = ["ObjectiveConfig", "OptimConfig", "PolicyModel", "StepPlan", "StepResult",
           "check_staleness", "full_state_dict", "load_policy", "pack_sequences", "plan_step",
           "shard_policy", "train_step"]
