"""The refit probe: after a refit the engine must compute what the trainer computes.

Tensor digests (molt.engines.weights) prove that the engine's loader consumed
exactly the exported bytes; they cannot prove that the engine then computes with
them: a reload that leaves a repacked kernel stale, corrupts a MoE layout
(notes/vllm-cpu.md), or maps a tensor to the wrong parameter passes the digests.
The probe checks the function itself, on P fixed tokens x[0..P-1]:

1) at export the trainer scores the probe with its own model at temperature 1
   (raw logprobs, no temperature or other processing):
       lp_train[t] = log_softmax(f(x[:t]))[x[t]],   t = 1..P-1        # [P-1]
   For an FSDP2 model this forward is a collective: every train rank runs it.
   The record carries x (``probe_token_ids``), lp_train (``probe_logprobs``) and
   the tolerance (``probe_atol``).
2) after loading, the engine scores the same tokens (`Engine.prompt_logprobs`,
   the same formula): lp_engine [P-1].
3) match: max_t |lp_engine[t] - lp_train[t]| <= atol.
4) change: lp_engine must differ from the engine's probe before the load (at any
   position, bit for bit), unless the new weights' digests equal those of the
   weights it held before (identical weights give identical logprobs). This
   catches a refit that did not reach the model when the step moved the
   trainer's probe by less than atol.
A failure raises RuntimeError with the version, the largest difference and its
position; the rollout stage then fails and the run stops.

Tolerance (``stages.broadcast.config.probe_atol``; by default from the dtype the
trainer's forward computed in): the fp32 vLLM engine against the fp32 trainer
differs by at most 2e-5 to 6e-5 on the 32 probe tokens here, so fp32 gets 1e-3;
after one step at lr 1e-4 an engine whose tied lm_head stayed stale differed by
0.04. A bf16 trainer forward differs from the fp32 engine by up to 0.6 (mean 0.08),
so bf16 gets 1.0: the match then catches only gross corruption, and step 4 (exact)
is what catches a refit that did not take.

Worked example (x = [5, 7, 9, 11], atol = 1e-3): trainer [-10.20, -9.80, -11.00];
an engine at [-10.2001, -9.7998, -11.0002] after the load matches (max diff 2e-4);
one at [-10.20, -9.70, -11.00] fails: "differ by 0.1 at position 2 (token id 9;
tolerance 0.001)".
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from molt.train.model import PolicyModel

PROBE_SEED = 20240601  # the probe tokens are the same for every version and run
DEFAULT_ATOL = {torch.float32: 1e-3}  # by the trainer forward's compute dtype; others: LOW_PRECISION_ATOL
LOW_PRECISION_ATOL = 1.0


@dataclasses.dataclass(frozen=True)
class Probe:
    """A trainer's probe: token ids [P], its logprobs [P-1] and the accepted difference."""

    token_ids: list[int]
    logprobs: list[float]
    atol: float


def probe_token_ids(vocab_size: int, num_tokens: int = 32) -> list[int]:
    """P pseudo-random token ids in [0, vocab_size), fixed by PROBE_SEED.

    Random ids need no tokenizer and reach rows of the (tied) embedding that
    natural text rarely does. Example: probe_token_ids(49152, 4) gives the same
    4 ids on every call, run and machine.
    """
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


@torch.no_grad()
def policy_probe(model: PolicyModel, token_ids: list[int], atol: float | None = None) -> Probe:
    """The trainer's probe logprobs at temperature 1 (step 1 of the module docstring).

    ``model`` is a molt.train.model.PolicyModel (FSDP2-sharded or not): its forward
    maps ``input_ids, position_ids`` [1, P] to the logprob [P] of each token given
    those before it, at ``model.temperature``, which is set to 1 for this call.
    With FSDP2 this is a collective: every rank must call it, in the same order
    as its other collectives. Runs in eval mode and restores the mode after.
    ``atol`` None picks DEFAULT_ATOL by the dtype the forward computed in.

    On CPU the forward runs on one intra-op thread: P tokens gain little from
    threads, and while other processes (the engine) hold the cores, two spinning
    OpenMP threads took 1-6 s here where one thread took 0.35 s.
    """
    device = next(model.parameters()).device
    input_ids = torch.tensor([token_ids], device=device)  # [1, P]
    position_ids = torch.arange(len(token_ids), device=device)[None]  # [1, P]
    temperature, training = model.temperature, model.training
    dtypes: list[torch.dtype] = []  # what the embedding returns: the forward's compute dtype
    embedding = model.lm.get_input_embeddings()  # type: ignore[operator]
    hook = embedding.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    threads = torch.get_num_threads()
    model.temperature = 1.0
    model.eval()
    torch.set_num_threads(1 if device.type == "cpu" else threads)
    try:
        logprobs = model(input_ids, position_ids)  # [P], 0 at the first token
    finally:
        model.temperature = temperature
        model.train(training)
        hook.remove()
        torch.set_num_threads(threads)
    atol = atol if atol is not None else DEFAULT_ATOL.get(dtypes[0], LOW_PRECISION_ATOL)
    return Probe(list(token_ids), logprobs[1:].float().cpu().tolist(), atol)


def check_probe(version: int, probe: Probe, engine_logprobs: list[float]) -> None:
    """Step 3: the engine's probe logprobs [P-1] must be within ``probe.atol`` of the trainer's.

    Raises:
        RuntimeError: naming the version, the largest difference and its position.
    """
    if len(engine_logprobs) != len(probe.logprobs):
        raise RuntimeError(f"refit to version {version} failed the probe: the engine returned "
                           f"{len(engine_logprobs)} logprobs for {len(probe.logprobs)} probe positions")
    diffs = (torch.tensor(engine_logprobs, dtype=torch.float64)
             - torch.tensor(probe.logprobs, dtype=torch.float64)).abs()  # [P-1]
    diffs = torch.where(diffs.isnan(), torch.inf, diffs)  # a NaN fails too
    if diffs.numel() == 0 or float(diffs.max()) <= probe.atol:
        return
    index = int(diffs.argmax())
    position = index + 1  # position in the probe sequence of the scored token
    raise RuntimeError(
        f"refit to version {version} failed the probe: engine and trainer logprobs differ by "
        f"{float(diffs[index]):.3g} at position {position} (token id {probe.token_ids[position]}; "
        f"tolerance {probe.atol:g}): the engine does not compute what the trainer exported; "
        "hint: a reload that corrupts or skips weights, or a bf16 side (raise "
        "stages.broadcast.config.probe_atol)")


def check_probe_changed(version: int, before: list[float], after: list[float], same_weights: bool) -> None:
    """Step 4: the engine's probe must change across a refit whose weights changed.

    Raises:
        RuntimeError: if ``after`` equals ``before`` bit for bit while ``same_weights`` is false.
    """
    if after == before and not same_weights:
        raise RuntimeError(
            f"refit to version {version} failed the probe: the engine's probe logprobs did not change "
            "although the weights' digests did; the engine still computes with the previous weights")
