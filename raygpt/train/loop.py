"""The per-worker training loop: llm.c's main loop in PyTorch, with no Ray inside.

`train(cfg, session)` reads top to bottom like the `for (int step = 0; ...)` body of llm.c's
train_gpt2.cu: validation, sample, checkpoint, `if last_step: break`, then the TRAINING SECTION
(the micro-steps, one agreement collective, the outlier verdict, lr, the update) and logging.
Each line of the step is one call to a component that decides its own policy (`build_run`
names them: the reporter, the signal flags, and the periodic tasks of raygpt.train.loop_tasks:
validation, HellaSwag, the sample, the checkpoint, fault drills, watch metrics, each run where
its phase falls), and each helper takes the parts it uses (`MicroSteps` for the forward and
backward passes, `Agreement` for the collective), not the whole `Run`.
Everything Ray-specific (rank, device, reporting a checkpoint, the checkpoint to resume from)
comes through `session` (see `raygpt.train.session`), so the same loop runs under Ray Train and as a
plain single process.

One collective per step carries the loss, the squared grad norm (ZeRO shards) and every flag the
ranks must agree on (signals, preemption, a finished background checkpoint, a non-finite value),
and one host sync reads it back: that is the only synchronisation inside a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from raygpt.artifacts import compile_cache
from raygpt.artifacts.compile_cache import CompileCache
from raygpt.checkpointing.runtime import Checkpointer, ResumeRead, may_restore
from raygpt.config import TrainConfig, mixture as config_mixture
from raygpt.data import mixture
from raygpt.data.loader import DistributedDataLoader, samples_to_ranges
from raygpt.data.sources import ShardCache, is_remote
from raygpt.eval.validation import build_val_loader, evaluate  # noqa: F401 (loop.evaluate)
from raygpt.train import signals
from raygpt.train.determinism import run_switches
# OutOfMemory: -b does not fit the device; TrainingStopped: the spike policy escalates to a human
from raygpt.llmc.model_file import load_model_file
from raygpt.model.gpt import GPT, GPTConfig, kernels_for, num_parameters
from raygpt.model.memory import out_of_memory_line
from raygpt.runlog.reporter import Reporter
from raygpt.train.errors import OutOfMemory, TrainingStopped
from raygpt.train.faults import plan_for
from raygpt.train.gc_freeze import GCFreeze
from raygpt.train.optim import AdamW, FlatParameters, random_u32
from raygpt.train.schedule import learning_rate
from raygpt.train.session import Session
from raygpt.train.state import TrainState
from raygpt.train.loop_tasks import Checkpointing, Drill, Watch, loop_tasks
from raygpt.train.tasks import run_after, run_due

# Slots of the per-step agreement vector (all-reduced with SUM; flags are 0/1 per rank).
LOSS, NORM_SQ, STOP, SAVE, CKPT_READY, RAY_REPORT, NUM_SLOTS = range(7)


def build_model(cfg: TrainConfig, device: torch.device, *, init: bool = True) -> GPT:
    """The run's GPT on `device`: GPT-2's init from the seed (or the llm.c model file -m names);
    with init=False and a depth, no init is drawn (weights a checkpoint is about to set)."""
    if cfg.depth is not None:
        model = (GPT(GPTConfig.from_depth(cfg.depth), init_seed=cfg.seed) if init
                 else GPT.empty(GPTConfig.from_depth(cfg.depth)))
    elif os.path.isdir(cfg.model):  # a Hugging Face GPT-2 folder (raygpt export writes one)
        from raygpt.interop.hf import load_hf
        model = load_hf(cfg.model)
    else:
        model = load_model_file(cfg.model)
    # the performance fields: --loss-impl, --no-ce-kernel, --ce-chunk-rows, --recompute,
    # --sdpa-backend, --embedding-impl (raygpt's deterministic kernels under --deterministic on
    # CUDA: kernels_for)
    model.loss_impl, model.ce_kernel, model.ce_chunk_rows, model.recompute = (
        cfg.loss_impl, cfg.ce_kernel, cfg.ce_chunk_rows, cfg.recompute)
    model.use_kernels(**kernels_for(cfg.deterministic, torch.device(device).type,
                                    sdpa_backend=cfg.sdpa_backend,
                                    embedding_impl=cfg.embedding_impl))
    return model.to(device)


def compile_model(model: GPT, mode: str, scope: str = "model") -> torch.nn.Module:
    """torch.compile with static shapes (validation batches of another size must not make the
    training graph symbolic). scope "model": the whole model, one graph, the fastest step on one
    GPU; its backward is one autograd node, so every gradient lands at its end. "blocks": each
    transformer block on its own (they share their code: Dynamo traces one), the embeddings,
    final norm and loss eager; backward is one node per block, whose gradients land as it
    finishes, so --overlap-comm reduces them while the blocks below compute. (Nested compile
    regions, one graph with the blocks inside, refuse FlatParameters' views: docs/faults.md.)"""
    if scope == "blocks":
        for block in model.transformer.h:
            block.compile(mode=mode, dynamic=False)
        return model
    return torch.compile(model, mode=mode, dynamic=False)


def broadcast_step(step: int | None, world: int, device: torch.device) -> int | None:
    """Rank 0's step (None: no step) on every rank."""
    if world == 1:
        return step
    t = torch.tensor([-1 if step is None else step], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return None if int(t.item()) < 0 else int(t.item())


def all_reduce_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def shard_cache(cfg: TrainConfig) -> ShardCache | None:
    """This node's cache of the shards of an s3:// or gs:// -i/-j/--eval-set (None when all
    are local, which are read in place)."""
    from raygpt.config import eval_sets
    if not any(is_remote(p) for p in (*config_mixture.patterns(cfg.input_bin), cfg.input_val_bin,
                                      *eval_sets.patterns(cfg.eval_set)) if p):
        return None
    return ShardCache(cfg.shard_cache_dir or None, int(cfg.shard_cache_gb * 2**30))


def out_of_memory_reported(cfg: TrainConfig, device: torch.device, step_of):
    """An exit callback for the loop's ExitStack: a torch.OutOfMemoryError leaving the loop
    becomes OutOfMemory, one line with the step (`step_of()`), this shape's estimate against
    the device's memory and -b (raygpt.train.errors: a restart at the same -b would run out again)."""
    def on_exit(exc_type, exc, tb) -> bool:
        if isinstance(exc, torch.OutOfMemoryError):
            if device.type == "cuda":
                where, limit = "on the GPU", torch.cuda.get_device_properties(device).total_memory
            else:
                where = "in host memory"
                limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            raise OutOfMemory(out_of_memory_line(cfg, where, limit, step=step_of())) from exc
        return False
    return on_exit


def train(cfg: TrainConfig, session: Session) -> dict:
    """Train this worker's share of the run and return a summary (rank 0's is the run's)."""
    # rank 0's appends (loss_history.jsonl, main.log) run on a writer thread: a step never
    # waits for an fsync; checkpoint publishes and the end flush them (see RunDir)
    with session.run_dir.background_appends(enabled=session.rank == 0), \
            signals.handlers_restored(), \
            contextlib.ExitStack() as on_exit, \
            run_switches(cfg.deterministic), \
            GCFreeze(cfg.gc_freeze) as gc_freeze:
        # on_exit closes the run log's sinks, on errors too
        return _train(cfg, session, on_exit, gc_freeze)


@dataclasses.dataclass
class Run:
    """What one worker's run is made of (`build_run`), named as the loop names its components:
    the loop's body calls these and each decides its own policy."""

    cfg: TrainConfig
    session: Session
    model: GPT
    forward: object  # the model, or its torch.compile'd wrapper
    compiled: "CompileCache | None"  # where the compiled graphs are cached (when compiling)
    flat: FlatParameters
    opt: AdamW
    train_loader: "DistributedDataLoader | mixture.MixedDataLoader"
    state: TrainState
    ckpt: Checkpointer
    runlog: Reporter
    micro: "MicroSteps"  # what the step's forward and backward passes use
    agreement: "Agreement"  # what the step's one collective reads
    max_steps: int
    # periodic work in llm.c's order (raygpt.train.loop_tasks): validation, the eval sets,
    # HellaSwag, the sample, the checkpoint, fault drills, watch metrics
    tasks: list = dataclasses.field(default_factory=list)
    stop_requested: bool = False
    val_loss: float = float("nan")

    def task(self, name: str):
        """The periodic task named `name` (its loader, its clock: what it holds)."""
        return next(t for t in self.tasks if t.name == name)


def build_run(cfg: TrainConfig, session: Session, on_exit: contextlib.ExitStack) -> Run:
    """The model, optimizer, loaders, the state restored from the newest verified checkpoint
    (llm.c's resume order, inside Checkpointer), and the reporter every event goes to."""
    rank, world, device = session.rank, session.world, session.device
    startup = session.startup_marks()  # the recovery ledger's marks (history.STARTUP_MARKS)
    setup = startup.setdefault("setup", {})  # and this worker's finer ones, as wall times

    def mark(name: str) -> None:
        setup[name] = time.time()

    mark("build_started")
    resuming = may_restore(cfg, session.checkpoint_hint())
    # the resume checkpoint's own files are read and hashed on a thread from here on
    resume_read = ResumeRead(cfg, session.run_dir, rank, world) if resuming else None
    # a run that may resume draws GPT-2's init only if no checkpoint is found (after the restore)
    init_later = cfg.depth is not None and resuming
    # a fresh init is rank 0's alone: the broadcast below gives it to every other rank, which
    # would only draw the same values (seconds of one CPU thread beside rank 0's, on its cores)
    model = build_model(cfg, device, init=not init_later and rank == 0)
    mark("weights_built")
    work_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    flat = FlatParameters(model, device, work_dtype, pad_multiple=world)
    if world > 1 and not init_later:
        dist.broadcast(flat.params, src=0)  # every rank starts from rank 0's weights
    opt = AdamW(flat, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                rank=rank, world=world, zero_stage=cfg.zero_stage, overlap=cfg.overlap_comm)
    mark("model_built")
    cache = shard_cache(cfg)  # shards in a bucket: fetched from here on, beside the restore
    train_loader = mixture.train_loader(cfg.input_bin, cfg.batch_size, cfg.seq_len, rank, world,
                                        shuffle=cfg.shuffle, seed=cfg.seed, cache=cache,
                                        vocab_size=model.config.vocab_size)  # one glob or a mix
    on_exit.callback(train_loader.close)
    # the validation tasks' loaders (-j, --eval-set) beside the training loader
    evals = loop_tasks(cfg, session, on_exit, cache, model.config.vocab_size)
    max_steps = (cfg.max_steps if cfg.max_steps > 0
                 else train_loader.tokens_per_epoch // cfg.total_batch_size)
    mark("loader_built")
    compiled = None
    if cfg.compile:  # seconds of Python, while the resume read hashes beside it
        compile_cache.import_compiler()
        mark("compiler_imported")
        # compiled once per node (local caches, the run's artifacts for a new node); filled
        # before the restore, whose re-derive is the first of raygpt's kernels to launch
        compiled = CompileCache.for_run(cfg, session)
        mark("compile_cache_ready")
    state = TrainState.fresh(cfg)
    ckpt = Checkpointer(cfg, session, flat, opt, model.config, max_steps, marks=setup,
                        resume_read=resume_read)
    restore_started = time.time()
    resumed_from = ckpt.restore_latest(state, train_loader)  # llm.c's resume order inside
    if init_later and resumed_from is None:  # nothing to resume: the init a fresh run draws
        if rank == 0:  # into the flat buffer's views, as FlatParameters copies it
            model.init_gpt2(cfg.seed)
        if world > 1:
            dist.broadcast(flat.params, src=0)
        opt.take_master_from_params()
    if resumed_from is None and device.type == "cuda" and opt.master is not None:
        # The restore's kernel (working weights from master) compiled now, on a fresh start:
        # a worker restarted on this node then finds it in the node's Triton cache instead of
        # compiling it inside its recovery (docs/faults.md's recovery ledger). On fresh weights
        # it is the identity: master holds the bf16 weights exactly, and stochastic rounding
        # of a value bf16 holds exactly returns it (every rank takes this branch together:
        # resumed_from is agreed, and ZeRO's gather inside is one collective).
        opt.rederive_working_weights(cfg.seed)
    startup.update({"restore_started": restore_started, "state_loaded": time.time(),
                    "load_s": ckpt.load_seconds,
                    # where the loaded files came from: this node's local copy or storage
                    "load_from": sorted(set(ckpt.load_sources.values()))})
    # ZeRO-1 with --overlap-comm: each update's gather waited for block by block in the next
    # forward (hooks in place before compiling; the whole-model graph waits for all first)
    opt.gather_during_forward(model, per_block=not cfg.compile or cfg.compile_scope == "blocks")
    forward = compile_model(model, cfg.compile_mode, cfg.compile_scope) if cfg.compile else model
    # every event goes to the reporter once: console, main.log, loss history, TensorBoard, Ray,
    # trackers
    runlog = on_exit.enter_context(Reporter(cfg, session, max_steps=max_steps,
                                            resumed_from=resumed_from, model_config=model.config,
                                            n_params=num_parameters(model), startup=startup))
    faults = plan_for(cfg.fault, rank, session.run_dir)
    save_clock = signals.SaveClock(cfg.checkpoint_minutes if rank == 0 else 0.0)
    micro = MicroSteps(forward=forward, loader=train_loader, opt=opt, faults=faults,
                       grad_accum=cfg.grad_accum_steps(world),
                       tokens_per_step=cfg.total_batch_size, z_loss=cfg.z_loss,
                       prefetch=cfg.prefetch_batches, device=device)
    agreement = Agreement(
        vector=torch.zeros(NUM_SLOTS, dtype=torch.float32, device=device), session=session,
        flags=signals.watch(),  # SIGTERM / SIGUSR1 set flags; the handlers do nothing else
        faults=faults, save_clock=save_clock, ckpt=ckpt, runlog=runlog,
        zero_stage=cfg.zero_stage, tokens_per_step=cfg.total_batch_size)
    tasks = [*evals, Checkpointing(ckpt, state, train_loader, save_clock), Drill(faults),
             Watch(cfg.watch_every, rank, state.clipped)]
    return Run(cfg=cfg, session=session, model=model, forward=forward, compiled=compiled,
               flat=flat, opt=opt, train_loader=train_loader, state=state, ckpt=ckpt,
               runlog=runlog, micro=micro, agreement=agreement, max_steps=max_steps, tasks=tasks)


def _train(cfg: TrainConfig, session: Session, on_exit: contextlib.ExitStack,
           gc_freeze: GCFreeze) -> dict:
    r = build_run(cfg, session, on_exit)
    on_exit.push(out_of_memory_reported(cfg, torch.device(session.device), lambda: r.state.step))
    state, ckpt, runlog = r.state, r.ckpt, r.runlog
    # the ETA counts the runs still to come of the tasks whose steps are known ahead ("eval")
    runlog.start(world=session.world, grad_accum=r.micro.grad_accum,
                 tokens_per_step=r.micro.tokens_per_step, resumed_from=ckpt.loaded_step,
                 tasks=[t for t in r.tasks if getattr(t, "phase", "eval") == "eval"])
    if cfg.compile:
        runlog.compiling()  # the first forward pass compiles: say so before it looks like a hang
    first_step, t_start = state.step, time.perf_counter()

    while True:
        step = state.step  # a rewind moves it back, so the loop reads it rather than counting
        last_step = step == r.max_steps

        # ---------------------------------------------------------- validation and sample
        run_due(r.tasks, r, step, last_step, "eval",  # val loss, eval sets, HellaSwag, sample
                timed=runlog.task_ran)

        # ---------------------------------------------------------- checkpoint
        run_due(r.tasks, r, step, last_step, "checkpoint")  # every -n, at the end, on request
        if last_step or r.stop_requested:
            break

        # ---------------------------------------------------------- TRAINING SECTION
        t0 = time.perf_counter()
        run_due(r.tasks, r, step, last_step, "step")  # fault drills (--fault)
        loss_sum, step_samples = forward_backward(r.micro, step)
        r.opt.reduce_gradients()  # or waits for the buckets the backward pass launched
        agreed = agree(r.agreement, step, loss_sum, r.opt.grad_norm_squared())  # the one sync
        verdict = state.judge(cfg, step, agreed.loss, agreed.norm)
        lr = learning_rate(cfg.scheduler, step, peak_lr=cfg.learning_rate,
                           warmup_steps=cfg.warmup_steps, total_steps=r.max_steps,
                           final_lr_frac=cfg.final_lr_frac) * state.lr_scale
        if verdict.kind in ("rewind", "escalate"):  # back to a checkpoint (ckpt.loaded_step)
            rewind(cfg, state, ckpt, runlog, r.train_loader, step, verdict, step_samples)
            continue
        updating = run_due(r.tasks, r, step, last_step, "update")  # watch: the weights before
        update(state, r.opt, runlog, step, verdict, lr, agreed, step_samples,
               grad_clip=cfg.grad_clip)
        # no sync here: the optimizer kernels overlap the host's logging and the next step's
        # launch (its batch was prefetched during this backward); in steady state dt (start to
        # start, the host waits in the one sync above) is the step time
        dt = time.perf_counter() - t0
        state.advance(r.micro.tokens_per_step, clipped=agreed.norm > cfg.grad_clip)
        if step == first_step:
            after_first_step(r.compiled, session, gc_freeze)  # graphs kept, the collector frozen

        # ---------------------------------------------------------- logging
        runlog.train(step, loss=agreed.loss, norm=agreed.norm, lr=lr, dt=dt, verdict=verdict,
                     tokens=state.tokens_seen, tokens_per_step=r.micro.tokens_per_step,
                     report_to_ray=agreed.ray_report, data=r.train_loader.report(),
                     **({"samples": samples_to_ranges(np.concatenate(step_samples))}
                        if cfg.record_samples else {}))
        run_after(updating, r, step)  # watch metrics: the update against the weights before

        # ---------------------------------------------------------- what the ranks agreed on
        r.stop_requested = act_on(agreed, state, ckpt, r.val_loss) or r.stop_requested

    return finish(state, ckpt, runlog, time.perf_counter() - t_start, max_steps=r.max_steps,
                  val_loss=r.val_loss, device=session.device)


def after_first_step(compiled: CompileCache | None, session: Session,
                     gc_freeze: GCFreeze) -> None:
    """After the first step (compiled, warmed up): rank 0 stores the graphs it compiled beside
    the run (a new node then fills its caches from them), and the live objects move out of the
    garbage collector's reach (raygpt.train.gc_freeze)."""
    if compiled is not None and session.rank == 0:
        compiled.save_if_new(session.run_dir)
    gc_freeze.after_warmup()


@dataclasses.dataclass
class MicroSteps:
    """What a step's forward and backward passes use: the model, the batches, the gradient
    buffers' owner, and the window's shape."""

    forward: object  # the model, or its torch.compile'd wrapper
    loader: DistributedDataLoader
    opt: AdamW
    faults: object  # raygpt.train.faults' plan for this rank (the injected NaN)
    grad_accum: int
    tokens_per_step: int
    z_loss: float
    prefetch: bool
    device: torch.device


def forward_backward(m: MicroSteps, step: int) -> tuple[torch.Tensor, list]:
    """The step's micro-steps: gradients summed over the window (the token-weighted mean over
    the whole window and all ranks, as grads are SUM-reduced); returns this rank's loss sum
    (on the device, no sync) and the global sample indices each micro-batch trained on."""
    m.opt.flat.zero_grad()
    step_samples = []
    loss_acc = torch.zeros((), dtype=torch.float32, device=m.device)
    for micro in range(m.grad_accum):
        x, y = m.loader.next_batch(m.device)
        step_samples.append(m.loader.last_global_samples)
        loss_sum, z_sum = m.forward(x, y, z_loss=m.z_loss)
        if m.faults.nan_now(step):
            loss_sum = loss_sum * float("nan")
        if micro == m.grad_accum - 1:  # the window's last backward reduces as it goes (with
            m.opt.reduce_during_backward()  # --overlap-comm); the earlier ones only accumulate
        ((loss_sum + z_sum) / m.tokens_per_step).backward()
        loss_acc += loss_sum.detach()
        if m.prefetch:  # the next micro-batch's gather and copy, during this backward
            m.loader.prefetch(m.device)
    return loss_acc, step_samples


@dataclasses.dataclass
class Agreed:
    """What every rank agreed on after the step's one collective."""

    loss: float  # mean over the window's tokens on every rank
    norm: float  # the global grad norm (NaN when not finite)
    stop: bool  # SIGTERM, a driver's stop: checkpoint, then exit
    save: bool  # SIGUSR1, preemption, --checkpoint-minutes: checkpoint, go on
    checkpoint_ready: bool  # every rank's background checkpoint is written
    ray_report: bool  # report this step's metrics to Ray (rank 0's clock decided)


@dataclasses.dataclass
class Agreement:
    """What the step's one collective reads: its vector (LOSS ... RAY_REPORT) and everything
    that may ask the ranks to stop, save or report."""

    vector: torch.Tensor
    session: Session  # rank, world, the driver's requests
    flags: object  # SIGTERM / SIGUSR1 as flags (raygpt.train.signals)
    faults: object  # raygpt.train.faults' plan for this rank (an injected preemption)
    save_clock: signals.SaveClock
    ckpt: Checkpointer
    runlog: Reporter
    zero_stage: int
    tokens_per_step: int


def agree(g: Agreement, step: int, loss_sum: torch.Tensor, norm_sq: torch.Tensor) -> Agreed:
    """One collective: the loss, the squared norm, and every flag the ranks must agree on; one
    host sync reads it back."""
    a, session = g.vector, g.session
    a[LOSS] = loss_sum
    a[NORM_SQ] = norm_sq if (g.zero_stage == 1 or session.rank == 0) else 0.0  # ZeRO: shards
    outside_stop, outside_save = session.poll_requests()  # driver signals, preemption
    a[STOP] = max(g.flags.stop_requested(), float(outside_stop))
    a[SAVE] = max(g.flags.take_save_request(), float(outside_save),
                  float(g.faults.preempt_now(step)), float(g.save_clock.due()))
    a[CKPT_READY] = g.ckpt.ready()
    a[RAY_REPORT] = g.runlog.wants_ray_report(step)  # rank 0's clock decides for all ranks
    all_reduce_sum(a, session.world)
    loss_v, norm_sq_v, stop_v, save_v, ready_v, report_v = a.tolist()  # the one host sync
    return Agreed(loss=loss_v / g.tokens_per_step,
                  norm=math.sqrt(norm_sq_v) if norm_sq_v >= 0 else float("nan"),
                  stop=stop_v > 0, save=save_v > 0, checkpoint_ready=ready_v >= session.world,
                  ray_report=report_v > 0)


def update(state: TrainState, opt: AdamW, runlog: Reporter, step: int, verdict, lr: float,
           agreed: Agreed, step_samples: list, *, grad_clip: float) -> None:
    """The optimizer step, with the clip as a scalar (llm.c: the gradients stay untouched), or
    a skipped update: the step (and with it lr and data order) advances all the same."""
    if verdict.kind == "ok":
        grad_scale = grad_clip / agreed.norm if agreed.norm > grad_clip else 1.0
        state.rng_state_last_update = state.rng_state
        sr_seed, state.rng_state = random_u32(state.rng_state)
        opt.step(lr=lr, grad_scale=grad_scale, t=step + 1, seed=sr_seed)
        state.spike_samples = []
    else:  # skip: drop this update only
        state.skips += 1
        state.spike_samples += step_samples
        runlog.skip(step, verdict, loss=agreed.loss, norm=agreed.norm)


def act_on(agreed: Agreed, state: TrainState, ckpt: Checkpointer, val_loss: float) -> bool:
    """After the step: publish a finished background checkpoint, note a save or stop request.
    Returns whether the ranks agreed to stop (SIGTERM: checkpoint, then exit)."""
    if agreed.checkpoint_ready:
        ckpt.publish_pending({"step": state.step, "train_loss": agreed.loss, "val_loss": val_loss})
    if agreed.save:
        state.save_requested = True  # SIGUSR1, preemption, --checkpoint-minutes: save, go on
    if agreed.stop:
        state.save_requested = True  # SIGTERM: checkpoint, then exit
    return agreed.stop


def finish(state: TrainState, ckpt: Checkpointer, runlog: Reporter, elapsed: float, *,
           max_steps: int, val_loss: float, device: torch.device) -> dict:
    """Wait for the last checkpoint, then the run's summary (the end record, the last line)."""
    ckpt.finish()
    summary = {"step": state.step, "max_steps": max_steps, "val_loss": val_loss,
               "stopped_early": state.step < max_steps, "skips": state.skips,
               "rewinds": state.ledger.rewinds, "elapsed_s": elapsed,
               "checkpoint_stall_s": ckpt.stall_seconds, "checkpoint_stalls": ckpt.stalls,
               "checkpoints_written": len(ckpt.write_seconds),
               "checkpoint_write_s": ckpt.write_seconds, "checkpoint_load_s": ckpt.load_seconds,
               "checkpoint_waits": ckpt.waits, "checkpoint_timeline": ckpt.timeline,
               "attempt": runlog.attempt,
               # this rank's high-water mark of tensor memory (ZeRO-1 against unsharded)
               "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                   if device.type == "cuda" else None)}
    runlog.end(summary)
    signals.unwatch()
    return summary


def rewind(cfg: TrainConfig, state: TrainState, ckpt: Checkpointer, runlog: Reporter,
           loader: DistributedDataLoader, step: int, verdict, step_samples: list) -> int:
    """Back to the newest verified checkpoint before the spike began, with the spike's data
    window added to the persisted skip list; escalate (TrainingStopped) past the policy's
    limits. The decision is durable before the run goes on from the checkpoint. Returns the
    step it went back to (the checkpointer's loaded_step: the loop does not write it again)."""
    ckpt.wait_and_publish()  # a checkpoint still being written may be the one to go back to
    window = samples_to_ranges(np.concatenate(state.spike_samples + step_samples))
    spike_start = verdict.spike_start if verdict.spike_start is not None else step
    # every rank must go back to the same checkpoint, and the driver may complete checkpoints
    # at different moments as seen from each rank: rank 0 chooses, the others follow
    target = broadcast_step(ckpt.rewind_target(spike_start, cfg.spike.safety_steps)
                            if ckpt.rank == 0 else None, ckpt.world, ckpt.flat.params.device)
    lr_scale, escalation = state.ledger.record_rewind(spike_start, step, window, cfg.spike)
    if verdict.kind == "escalate" and escalation is None:
        escalation = verdict.reason
    if target is None and escalation is None:
        escalation = (f"no verified checkpoint at or before step {spike_start - cfg.spike.safety_steps}"
                      f" to rewind to (the spike began at step {spike_start})")
    runlog.rewind(step, verdict, target=target, window=window, lr_scale=lr_scale,
                    rewinds=state.ledger.rewinds)
    if escalation is not None:
        raise TrainingStopped(f"step {step}: {verdict.reason}; stopping: {escalation}")
    ckpt.rewind_to(target, state, loader, window)  # the decision is durable first
    runlog.restart_at(state.step)
    return state.step
