"""The loop's periodic work as tasks (raygpt.train.tasks), in llm.c's order: the validation loss
of -j, each --eval-set's, HellaSwag and the sample (phase "eval"); the checkpoint (phase
"checkpoint"); fault drills at the top of the training section (phase "step"); watch metrics
around the optimizer update (phase "update").
Each task holds what it works with (its loader, its examples, its clock) and reads the loop's
`Run` for the rest (the forward pass, the state, the reporter)."""

from __future__ import annotations

import contextlib

import torch

from raygpt.config import TrainConfig
from raygpt.eval.knobs import EvalConfig
from raygpt.data import tokenizer
from raygpt.eval.validation import build_val_loader, evaluate
from raygpt.train.tasks import every


def loop_tasks(cfg: TrainConfig, session, on_exit: contextlib.ExitStack, cache,
               vocab_size: int) -> list:
    """The eval-phase tasks in llm.c's order: the validation loss of -j, then of each
    --eval-set, HellaSwag, the sample (their loaders closed when the loop exits)."""
    from raygpt.eval import sets
    validating = bool(cfg.input_val_bin) and cfg.val_every > 0
    val_loader = (build_val_loader(cfg, session.rank, session.world, cache, vocab_size)
                  if validating else None)
    if val_loader is not None:
        on_exit.callback(val_loader.close)
    return [Validation(cfg, val_loader),
            *sets.tasks(cfg, session.rank, session.world, cache, vocab_size, on_exit),
            HellaSwag(cfg, hellaswag_share(cfg, session.rank, session.world)),
            Sample(cfg, session.rank)]


class Validation:
    """-j's validation loss every -v steps and at the last step (main.log's `tel:` line)."""

    name, phase = "val", "eval"

    def __init__(self, cfg: TrainConfig, loader):
        self.on = bool(cfg.input_val_bin) and cfg.val_every > 0
        self.val_every, self.loader = cfg.val_every, loader

    def due(self, step: int, last_step: bool) -> bool:
        return self.on and every(self.val_every, step, last_step)

    def run(self, r, step: int) -> None:
        r.val_loss = evaluate(r.forward, self.loader, r.cfg, r.session.device, r.session.world)
        r.runlog.val(step, r.val_loss, skips=r.state.skips, rewinds=r.state.ledger.rewinds)


def hellaswag_share(cfg: TrainConfig, rank: int, world: int) -> list | None:
    """This rank's HellaSwag examples (r, r + world, ...; the file was checked before Ray), or
    None without --hellaswag."""
    if not cfg.hellaswag:
        return None
    from raygpt.eval import hellaswag
    return hellaswag.read_examples(cfg.hellaswag, cfg.storage_endpoint)[rank::world]


def hellaswag_due(cfg: EvalConfig, step: int, last_step: bool) -> bool:
    return bool(cfg.hellaswag) and cfg.hellaswag_every > 0 and (
        step % cfg.hellaswag_every == 0 or last_step)


@torch.no_grad()
def hellaswag_score(model, examples: list, device, world: int) -> tuple[int, int]:
    """(correct, total) HellaSwag acc_norm over every rank's share, llm.c's scoring
    (raygpt.eval.hellaswag), summed over the ranks."""
    from raygpt.eval import hellaswag
    correct, total = hellaswag.score(model, examples, device)
    counts = torch.tensor([correct, total], dtype=torch.float64, device=device)
    if world > 1:
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
    model.train()
    return int(counts[0].item()), int(counts[1].item())


class HellaSwag:
    """--hellaswag's acc_norm every --hellaswag-every steps and at the last step."""

    name, phase = "hellaswag", "eval"

    def __init__(self, cfg: TrainConfig, examples: list | None):
        self.cfg, self.examples = cfg, examples

    def due(self, step: int, last_step: bool) -> bool:
        return hellaswag_due(self.cfg, step, last_step)

    def run(self, r, step: int) -> None:  # uncompiled: its rows vary in length
        r.runlog.hellaswag(step, *hellaswag_score(r.model, self.examples, r.session.device,
                                                  r.session.world))


@torch.no_grad()
def sample_text(model, cfg: TrainConfig, device, step: int) -> str:
    """A text sample from an end-of-text prompt, seeded by the step so it is reproducible."""
    model.eval()
    gen = torch.Generator(device=device).manual_seed(cfg.seed + step)
    idx = torch.full((1, 1), tokenizer.EOT, dtype=torch.long, device=device)
    out = model.generate(idx, cfg.gen_tokens, top_k=40, generator=gen)
    model.train()
    return tokenizer.decode(out[0, 1:].tolist())


def sampling_step(cfg: EvalConfig, step: int, last_step: bool) -> bool:
    return cfg.sample_every > 0 and step > 0 and (step % cfg.sample_every == 0 or last_step)


class Sample:
    """Rank 0's text sample every -s steps (from step 1) and at the last step."""

    name, phase = "sample", "eval"

    def __init__(self, cfg: TrainConfig, rank: int):
        self.cfg, self.rank = cfg, rank

    def due(self, step: int, last_step: bool) -> bool:
        return self.rank == 0 and sampling_step(self.cfg, step, last_step)

    def run(self, r, step: int) -> None:
        r.runlog.sample(step, sample_text(r.model, r.cfg, r.session.device, step))


class Checkpointing:
    """A checkpoint every -n steps and at the last step (the checkpointer's policy), and when
    the ranks agreed to save (SIGUSR1, a preemption notice, --checkpoint-minutes, a stop); the
    last one, and a stop's, written before the loop goes on (blocking)."""

    name, phase = "checkpoint", "checkpoint"

    def __init__(self, ckpt, state, loader, save_clock):
        self.ckpt, self.state, self.loader, self.save_clock = ckpt, state, loader, save_clock

    def due(self, step: int, last_step: bool) -> bool:
        return self.ckpt.due(step, last_step) or self.state.save_requested

    def run(self, r, step: int) -> None:
        self.ckpt.save(self.state, self.loader, blocking=step == r.max_steps or r.stop_requested)
        self.state.save_requested = False
        self.save_clock.saved()


class Drill:
    """--fault's process-level drills (kill, raise, signals, a memory hog) at the top of the
    update, on the ranks they name; it runs at every step of such a rank (the plan counts
    each step's visits)."""

    name, phase = "drill", "step"

    def __init__(self, faults):
        self.faults = faults

    def due(self, step: int, last_step: bool) -> bool:
        return bool(self.faults.faults)

    def run(self, r, step: int) -> None:
        self.faults.before_update(step)


class Watch:
    """Rank 0's watch metrics every --watch-every steps: the weights before the update are
    kept (`run`), and once it is done (`after`) the update/weight ratio per tensor, the largest
    logit and the fraction of clipped steps since the last watch are reported."""

    name, phase = "watch", "update"

    def __init__(self, watch_every: int, rank: int, clipped: int):
        self.watch_every, self.rank = watch_every, rank
        self.clipped_at_last = clipped  # the state's count of clipped steps at the last watch
        self.before = None

    def due(self, step: int, last_step: bool) -> bool:
        return self.rank == 0 and self.watch_every > 0 and (step + 1) % self.watch_every == 0

    def run(self, r, step: int) -> None:
        self.before = r.flat.params[:r.flat.num_parameters].clone()

    def after(self, r, step: int) -> None:
        r.opt.params_ready()  # the update's gather, if overlapped, is still arriving
        clipped = r.state.clipped
        r.runlog.watch(step, watch_metrics(r.flat, self.before,
                                           getattr(r.model, "last_max_logit", None),
                                           (clipped - self.clipped_at_last) / self.watch_every))
        self.clipped_at_last, self.before = clipped, None


@torch.no_grad()
def watch_metrics(flat, before, max_logit, clipped_frac) -> dict:
    """Watch metrics: the fraction of recent steps clipped, the largest output logit, and
    ||update|| / ||param|| per llm.c tensor group (a healthy run keeps these small and steady).
    One host sync, every watch_every steps only."""
    after = flat.params[:flat.num_parameters]
    deltas = torch.split((after.float() - before.float()), flat.tensor_sizes)
    weights = torch.split(before.float(), flat.tensor_sizes)
    ratios = torch.stack([d.norm() / w.norm().clamp_min(1e-12) for d, w in zip(deltas, weights)])
    return {"clipped_frac": clipped_frac,
            "max_logit": float(max_logit) if max_logit is not None else float("nan"),
            "update_ratio": dict(zip(flat.names, ratios.tolist()))}
