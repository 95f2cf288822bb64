"""Train: one FSDP2 optimizer step of the policy per packed step batch.

Runs as a torchrun group (``world_size: N``): rank 0 receives each step batch and every rank
sees it; each rank trains its rows (``dp_rank``) micro-batch by micro-batch with the loss
selected in YAML (molt.train.step), then steps AdamW. A token older than ``max_staleness``
versions stops the run, naming its sample. After each step it publishes the new version (a
collective, molt.train.publish) on ``weights`` and each further ``publish`` output where
subscribed and due, logs a step line (a warning ending ``COLLAPSE:`` past the bounds of
molt.train.collapse) and metrics, and sends a step record on ``out``. Checkpoint
(molt.train.state): model, AdamW and RNG state of every rank; a resumed trainer publishes the
restored version first.

    train: {class: stages.train.Train, world_size: 2, config: {policy_loss: {type: ppo,
            clip_high: 0.28}, optim: {lr: 1.0e-6}}}  # model, temperature, ...: the policy block
    edges: [{from: train.weights, to: rollout.weights, kind: broadcast, feedback: true}, ...]
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from pydantic import Field

from molt.runtime.edges import Barrier
from molt.runtime.memory import peak_memory_gb
from molt.models import export_path
from molt.policy import LoraConfig, Precision, policy_field
from molt.schema import WEIGHT_VERSION_SCHEMA, batch_from_rows
from molt.runtime.stage import Port, Service, StageConfig
from molt.train.collapse import CollapseConfig, CollapseWatch, row_metrics
from molt.train.model import load_policy, shard_policy
from molt.train.moe import apply_moe_keys
from molt.train.optim import OptimConfig, make_optimizer
from molt.train.publish import PublishConfig, Publisher
from molt.train.state import export_model_folder, load_train_state, save_train_state
from molt.train.step import (SFT_UNREAD, STEP_READS, STEP_SCHEMA, ObjectiveConfig, StepResult,
                             check_objective, check_staleness, lag_sum, train_step)

PACK_READS = (pa.field("step", pa.int32()), pa.field("dp_rank", pa.int32()),
              pa.field("micro_batch", pa.int32()), pa.field("step_loss_tokens", pa.int64()),
              pa.field("step_loss_seqs", pa.int64()))


class Train(Service):
    """Step batches in; a step record out per step; weight records on each weights output."""

    class Config(StageConfig, ObjectiveConfig):
        model: str = policy_field("model", "smollm2-135m-instruct")
        temperature: float = policy_field("temperature", 1.0, gt=0,
                                          description="the rollout's sampling temperature")
        max_staleness: int | None = policy_field("max_staleness", None, ge=0,
                                                 description="refuse older; None = unchecked")
        compute_dtype: Precision = policy_field("precision", "float32", description="FSDP2 compute "
                                                "dtype; master weights and AdamW stay fp32")
        device: str = Field("cpu", description="cpu (gloo) or cuda (nccl; rank r on LOCAL_RANK)")
        chunk_tokens: int = Field(1024, ge=1, description="per chunk of the vocabulary projection")
        freeze_router: bool = Field(False, description="MoE: routers get no gradient")
        lora: LoraConfig | None = policy_field("lora", description="adapters on the frozen policy")
        expert_parallel_size: int = Field(1, ge=1, description="MoE: 1, or the world size to shard "
                                          "the experts over (molt.train.expert_parallel)")
        export_model: str | None = Field(None, description="at the end, write the policy as a HF "
                                         "folder: a name in the model cache, or a path with '/'")
        seed: int | None = Field(None, description="torch.manual_seed; None = the run's")
        optim: OptimConfig = Field(default_factory=OptimConfig)
        collapse: CollapseConfig = Field(default_factory=CollapseConfig)
        weights: PublishConfig = policy_field("weights", default_factory=PublishConfig,
                                              description="how the weights output publishes")
        publish: dict[str, PublishConfig] = Field(default_factory=dict, description="further "
                                                  "outputs of the weights, e.g. for an evaluation")

    config: Config

    @classmethod
    def ports(cls, config: StageConfig) -> tuple[dict[str, Port], dict[str, Port]]:
        assert isinstance(config, cls.Config)
        sft = config.policy_loss.type == "sft"
        reads = tuple(c for c in STEP_READS if not sft or c not in SFT_UNREAD) + PACK_READS \
            + (("ref_logprobs",) * (config.kl is not None)) + (("routed_experts",) * bool(
                config.routing_replay or config.routing_replay_compare))
        if taken := {"out", "weights"} & set(config.publish):
            raise ValueError(f"publish.{taken.pop()}: an output of its own; name the further "
                             "output otherwise")
        weights = Port(schema=WEIGHT_VERSION_SCHEMA, optional=True)
        outputs = {"out": Port(schema=STEP_SCHEMA), "weights": weights}
        return {"in": Port(reads=reads)}, {**outputs, **{port: weights for port in config.publish}}

    def setup(self) -> None:
        from molt.models import resolve_model

        c, key = self.config, f"stages.{self.ctx.stage_id}.config"
        check_objective(c, key)
        torch.manual_seed(self.ctx.seed_for() if c.seed is None else c.seed)
        self.model_dir = resolve_model(c.model)
        model = load_policy(self.model_dir, c.temperature, c.chunk_tokens)
        apply_moe_keys(c, model.lm, key)  # MoE-only keys checked, routers frozen if asked
        if c.lora is not None:
            model.add_lora(c.lora, f"{key}.lora")
        self.model = shard_policy(model, c.compute_dtype, c.device, c.expert_parallel_size)
        self.optimizer = make_optimizer(self.model, c.optim, f"{key}.optim")
        self.version = 0  # optimizer steps taken
        self.lag_sum, self.lag_tokens = 0.0, 0  # over the run: version trained at - generated with
        self.resumed = False
        self.watch = CollapseWatch(c.collapse, key)
        outputs = {"weights": (c.weights, "weights"),
                   **{p: (v, f"publish.{p}") for p, v in c.publish.items()}}
        self.publishers = {port: Publisher(cfg, self.model, self.ctx.rank, f"{key}.{where}")
                           for port, (cfg, where) in outputs.items() if port in self.ctx.subscribed}

    async def run(self) -> None:
        if self.resumed:  # engines get the restored weights before any new rollout
            await self.publish(resumed=True)
        while (item := await self.recv("in")) is not None:
            if isinstance(item, Barrier):
                await self.barrier(item.step)
                continue
            # 1) check and step  2) publish the new version (collectives: every rank)  3) report
            result, lag, seconds = self.step(item)
            self._report(result, lag, seconds, await self.publish())
            await self.send("out", self._record(item.num_rows, result, lag, seconds))
        if self.config.export_model:
            out = export_model_folder(self.model, self.model_dir,
                                      export_path(self.config.export_model))
            self.log.info("exported the policy at version %d to %s", self.version, out)

    def step(self, batch: pa.RecordBatch) -> tuple[StepResult, int, float]:
        """Train one step batch; its result, the largest lag and the seconds taken."""
        start = time.monotonic()
        expected = batch.column("step")[0].as_py()
        if expected != self.version:
            raise ValueError(f"stage {self.ctx.stage_id!r}: column 'step' is {expected} but the "
                             f"trainer is at version {self.version}; hint: one pack stage feeds "
                             "one train stage from step 0")
        lag = check_staleness(batch, self.version, self.config.max_staleness)
        lags, tokens = lag_sum(batch, self.version)
        self.lag_sum, self.lag_tokens = self.lag_sum + lags, self.lag_tokens + tokens
        result = train_step(self.model, self.optimizer, batch, self.config, self.config.optim,
                            self.version)
        result.metrics.update(row_metrics(batch, self.config.collapse.wrong_reward_max))
        if not result.metrics.get("tokens/count"):  # no trained token to take an entropy of
            result.metrics.pop("entropy/mean", None)
        self.version += 1
        return result, lag, time.monotonic() - start

    async def publish(self, resumed: bool = False) -> dict[str, float]:
        """Publish ``self.version`` where due (after a resume: everywhere); seconds taken."""
        start, probe = time.monotonic(), 0.0
        for port, publisher in self.publishers.items():
            if resumed or self.version % publisher.config.every_steps == 0:
                await publisher.publish(self.version, partial(self.send, port))
                probe += publisher.probe_seconds
        return {"export_seconds": time.monotonic() - start, "probe_seconds": probe}

    def _record(self, num_rows: int, result: StepResult, lag: int,
                seconds: float) -> pa.RecordBatch:
        m = result.metrics
        return batch_from_rows([{
            "step": self.version - 1, "policy_version": self.version, "num_rows": num_rows,
            "max_lag": lag, "num_tokens": result.num_tokens,
            "num_loss_tokens": int(m.get("tokens/count", 0)), "loss": result.loss,
            "grad_norm": result.grad_norm, "lr": result.lr, "step_seconds": seconds,
            "reward_mean": m.get("reward/mean", 0.0)}], STEP_SCHEMA)

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "lag_sum": self.lag_sum, "lag_tokens": self.lag_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version, self.lag_sum, self.lag_tokens = (state["version"], state["lag_sum"],
                                                       state["lag_tokens"])

    def save_checkpoint(self, folder: Path) -> None:
        save_train_state(folder / self.ctx.stage_id, self.model, self.optimizer, self.model_dir)
        super().save_checkpoint(folder)

    def load_checkpoint(self, folder: Path) -> None:
        super().load_checkpoint(folder)
        load_train_state(folder / self.ctx.stage_id, self.model, self.optimizer, self.model_dir)
        self.resumed = True
        self.log.info("resumed at version %d from %s", self.version, folder)

    def _report(self, result: StepResult, lag: int, seconds: float,
                published: dict[str, float]) -> None:
        m, memory_gb = result.metrics, peak_memory_gb(self.config.device)
        tok_s = result.num_tokens / max(seconds, 1e-9)
        sampled = self.config.policy_loss.type != "sft"  # SFT: no policy samples to watch
        crossed = self.watch(m) if sampled else []
        if self.ctx.rank == 0:
            (self.log.warning if crossed else self.log.info)(
                "step %d  loss %.4f  reward %.3f  tok/s %.0f  lag %d  grad_norm %.3f  lr %.2e  "
                "clip %.3f  entropy %.3f  time %.1fs  export %.2fs  mem %.2fGB%s",
                self.version - 1, result.loss, m["reward/mean"], tok_s, lag, result.grad_norm,
                result.lr, m.get("clip/high_frac", 0.0) + m.get("clip/low_frac", 0.0),
                m.get("entropy/mean", float("nan")), seconds, published["export_seconds"],
                memory_gb, "  COLLAPSE: " + ", ".join(crossed) if crossed else "")
        self.metrics.count("tokens_trained", result.num_tokens)
        self.metrics.log({**m, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
                          "lag/max": lag, "tokens_per_s": tok_s, "step_seconds": seconds,
                          "lag/mean_run": self.lag_sum / max(self.lag_tokens, 1),
                          "peak_memory_gb": memory_gb, "policy_version": self.version,
                          "collapse/alarms": len(crossed), **published}, step=self.version - 1)

    def close(self) -> None:
        for publisher in getattr(self, "publishers", {}).values():
            publisher.close()
