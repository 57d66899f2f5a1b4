"""The per-worker training loop: llm.c's main loop in PyTorch, with no Ray inside.

`train(cfg, session)` reads top to bottom like llm.c's `for (step ...)` body and seed 001's
pseudocode: validation, sample, checkpoint, `if last_step: break`, then the TRAINING SECTION
(micro-steps, one agreement collective, outlier verdict, lr, grad_scale, update) and logging.
Everything Ray-specific (rank, device, reporting a checkpoint, the checkpoint to resume from)
comes through `session` (see `raygpt.session`), so the same loop runs under Ray Train and as a
plain single process.

One collective per step carries the loss, the squared grad norm (ZeRO shards) and every flag the
ranks must agree on (signals, preemption, a finished background checkpoint, a non-finite value),
and one host sync reads it back: that is the only synchronisation inside a step.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from raygpt import signals, tokenizer
from raygpt.checkpointer import Checkpointer
from raygpt.config import ConfigError, TrainConfig
from raygpt.data import DistributedDataLoader, ranks_with_data, samples_to_ranges, shard_token_counts
from raygpt.errors import TrainingStopped  # the spike policy escalates: the run needs a human
from raygpt.faults import plan_for
from raygpt.model import GPT, GPTConfig, kernels_for, load_model_file, num_parameters
from raygpt.optim import AdamW, FlatParameters, random_u32
from raygpt.runlog import RunLog
from raygpt.schedule import learning_rate
from raygpt.session import Session
from raygpt.state import TrainState

# After the first step (compiled, warmed up) the live objects are moved out of the collector's
# reach (gc.freeze): a full collection otherwise walks Dynamo's and Inductor's caches and
# stalls a step for tens of milliseconds now and then (bench/profile_step.py prints the pauses).
GC_FREEZE_AFTER_FIRST_STEP = True

# The next micro-batch is gathered on the host and copied to the device while the GPU runs the
# backward pass (DistributedDataLoader.prefetch), not after the step's sync. A switch so the
# throughput bench can measure it (its `noprefetch` variant).
PREFETCH_BATCHES = True

# torch.compile's mode for the model (None: Inductor's default). "reduce-overhead" replays the
# forward and backward graphs as CUDA graphs. A switch so the throughput bench can measure it.
COMPILE_MODE = None

# Slots of the per-step agreement vector (all-reduced with SUM; flags are 0/1 per rank).
LOSS, NORM_SQ, STOP, SAVE, CKPT_READY, RAY_REPORT, NUM_SLOTS = range(7)


# How PyTorch words the error an op without a deterministic implementation raises in strict mode
NOT_DETERMINISTIC = "does not have a deterministic implementation"


class NonDeterministicOp(ConfigError):
    """Deterministic mode (the GPU default, or --deterministic) met an op with no deterministic
    implementation: the run cannot keep its promise, and a restart would meet the same op (a
    bad-input error, not a fault to retry)."""

    def __init__(self, op: str):
        super().__init__(f"--deterministic (the default on GPUs): {op} has no deterministic "
                         f"implementation on this device; run with --no-deterministic (resumes "
                         f"are then close, not bit-exact), or avoid the op")
        self.op = op


def _op_named_in(message: str) -> str:
    """The op's name from PyTorch's error ('<op> does not have a deterministic ...')."""
    return message.split(NOT_DETERMINISTIC)[0].strip().rstrip(",") or "an op"


def build_model(cfg: TrainConfig, device: torch.device) -> GPT:
    if cfg.depth is not None:
        model = GPT(GPTConfig.from_depth(cfg.depth), init_seed=cfg.seed)
    else:
        model = load_model_file(cfg.model)
    model.use_kernels(**kernels_for(cfg.deterministic, torch.device(device).type))
    return model.to(device)


# torch.compile's caches (Inductor's FX graphs, AOTAutograd's, Triton's kernels) live on the node's
# local disk under this directory, shared by every worker process the node runs, so a worker that
# Ray restarts on a surviving node finds its graphs compiled (TORCHINDUCTOR_CACHE_DIR /
# TRITON_CACHE_DIR set by the user win). The run's own compiled artifacts
# (torch.compiler.save_cache_artifacts) are stored beside it, COMPILE_ARTIFACTS/<key>.bin, so a
# replacement node fills its local caches from them before its first step instead of compiling.
# Per user, private (0700, owned by this user: compiled code is loaded from it, so a directory
# another user of the node made first is refused), as torch's own /tmp/torchinductor_<user>.
NODE_COMPILE_CACHE = os.path.join(tempfile.gettempdir(), f"raygpt_compile_cache_{os.getuid()}")
COMPILE_ARTIFACTS = "compile_cache"


def use_node_compile_cache(root: str = NODE_COMPILE_CACHE) -> str:
    """Point Inductor's and Triton's on-disk caches at the node-local `root` (unless set)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.stat(root)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{root}: the node's compile cache must be private to user "
                                  f"{os.getuid()} (found owner {st.st_uid}, mode "
                                  f"{oct(st.st_mode & 0o777)}); remove it or set "
                                  f"TORCHINDUCTOR_CACHE_DIR")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", root)
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"],
                                                           "triton_user"))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_artifacts_name(cfg: TrainConfig, device_name: str) -> str:
    """Where the run keeps its compiled artifacts: one file per (config, torch, device model),
    since a graph compiled for another GPU or torch version is of no use (and torch's own keys
    would only miss). The config is its identity plus what a resume may change that changes
    the graphs (--deterministic picks other kernels)."""
    key = hashlib.sha256(json.dumps([cfg.hash(), cfg.deterministic, COMPILE_MODE,
                                     torch.__version__, device_name]).encode())
    return f"{COMPILE_ARTIFACTS}/{key.hexdigest()[:20]}.bin"


def load_compile_artifacts(run_dir, name: str, cache_dir: str) -> bool:
    """Fill this node's caches from the run's artifacts, once per node (a marker in the local
    cache says they are in); True when the run has artifacts. A damaged file only costs a
    compilation: torch checks what it loads, and the loop compiles as if there were none."""
    if not run_dir.exists(name):
        return False
    marker = _artifacts_marker(cache_dir, name)
    if not os.path.exists(marker):
        try:
            torch.compiler.load_cache_artifacts(run_dir.read_bytes(name))
        except Exception as e:  # noqa: BLE001 - a cache: compiling is always a correct fallback
            print(f"raygpt | WARNING: {run_dir.uri(name)}: compiled artifacts not loaded ({e}); "
                  f"compiling", flush=True)
            return True
        _touch(marker)
    return True


def save_compile_artifacts(run_dir, name: str, cache_dir: str) -> None:
    """Store what this process compiled (the first step's graphs, validation's) beside the run;
    this node's cache has them already."""
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is not None:
        run_dir.write_bytes_atomic(name, artifacts[0])
        _touch(_artifacts_marker(cache_dir, name))


def _artifacts_marker(cache_dir: str, name: str) -> str:
    return os.path.join(cache_dir, "raygpt_loaded_" + os.path.basename(name))


def _touch(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").close()


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


def build_val_loader(cfg: TrainConfig, rank: int, world: int) -> DistributedDataLoader | None:
    """This rank's validation loader, or None on a rank that sits validation out: a validation
    set smaller than world * val_batch_size samples feeds only the first ranks
    (`data.ranks_with_data`; the config's resolution chose the sizes)."""
    tokens = [n for _, n in shard_token_counts(cfg.input_val_bin)]
    val_world = ranks_with_data(tokens, cfg.val_batch_size, cfg.seq_len, world)
    if rank >= val_world:
        return None
    return DistributedDataLoader(cfg.input_val_bin, cfg.val_batch_size, cfg.seq_len, rank,
                                 val_world, shuffle=False, seed=cfg.seed)


@torch.no_grad()
def evaluate(model, val_loader, cfg: TrainConfig, device, world: int) -> float:
    """Mean validation loss over cfg.val_batches micro-batches per rank, the same batches every
    time; a rank without a loader (no validation data for it) adds nothing but takes part in
    the all-reduce."""
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, tokens]
    if val_loader is not None:
        val_loader.reset()
        for _ in range(cfg.val_batches):
            x, y = val_loader.next_batch(device)
            loss_sum, _ = model(x, y)
            acc[0] += loss_sum.double()
            acc[1] += y.numel()
    all_reduce_sum(acc, world)
    model.train()
    return (acc[0] / acc[1]).item()


@torch.no_grad()
def sample_text(model, cfg: TrainConfig, device, step: int) -> str:
    """A text sample from an end-of-text prompt, seeded by the step so it is reproducible."""
    model.eval()
    gen = torch.Generator(device=device).manual_seed(cfg.seed + step)
    idx = torch.full((1, 1), tokenizer.EOT, dtype=torch.long, device=device)
    out = model.generate(idx, cfg.gen_tokens, top_k=40, generator=gen)
    model.train()
    return tokenizer.decode(out[0, 1:].tolist())


def train(cfg: TrainConfig, session: Session) -> dict:
    """Train this worker's share of the run and return a summary (rank 0's is the run's)."""
    # rank 0's appends (loss_history.jsonl, main.log) run on a writer thread: a step never
    # waits for an fsync; checkpoint publishes and the end flush them (see RunDir)
    with session.run_dir.background_appends(enabled=session.rank == 0), \
            _torch_settings_restored(), \
            signals.handlers_restored(), \
            contextlib.ExitStack() as on_exit:  # closes the run log's sinks, on errors too
        try:
            return _train(cfg, session, on_exit)
        except RuntimeError as e:
            if cfg.deterministic and NOT_DETERMINISTIC in str(e):
                raise NonDeterministicOp(_op_named_in(str(e))) from e
            raise
        finally:
            if GC_FREEZE_AFTER_FIRST_STEP:
                gc.unfreeze()  # what the loop froze is collectable again once it is over


@contextlib.contextmanager
def _torch_settings_restored():
    """The loop sets process-wide torch switches (deterministic algorithms, TF32); the caller's
    values come back when it returns or raises, so a process that trains and then goes on (a
    test session, a notebook, the bench) is not left computing differently."""
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[3:]


def _train(cfg: TrainConfig, session: Session, on_exit: contextlib.ExitStack) -> dict:
    rank, world, device = session.rank, session.world, session.device
    is_main = rank == 0
    if cfg.deterministic:
        # cuBLAS is deterministic only with a fixed workspace (PyTorch's reproducibility notes);
        # read when the first cuBLAS handle is made, which is after this point in a worker
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # strict: an op without a deterministic implementation raises (see train()), rather than
        # warning and running its non-deterministic kernel (on an H200, with warn_only, cuDNN's
        # attention backward made step 2's loss differ run to run)
        torch.use_deterministic_algorithms(True)
        # ...but not its filling of every torch.empty with NaN (49 fill kernels, 1.5 ms a step
        # at d12 B=64 on an H200): the loop reads no memory it has not written, and the GPU
        # tests' two-run equality would show it if it did
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    # ------------------------------------------------------------------ build the run
    model = build_model(cfg, device)
    work_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    flat = FlatParameters(model, device, work_dtype, pad_multiple=world)
    if world > 1:
        dist.broadcast(flat.params, src=0)  # every rank starts from rank 0's weights
    opt = AdamW(flat, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                rank=rank, world=world, zero_stage=cfg.zero_stage)
    train_loader = DistributedDataLoader(cfg.input_bin, cfg.batch_size, cfg.seq_len, rank, world,
                                         shuffle=cfg.shuffle, seed=cfg.seed)
    validating = bool(cfg.input_val_bin) and cfg.val_every > 0
    val_loader = build_val_loader(cfg, rank, world) if validating else None
    grad_accum = cfg.grad_accum_steps(world)
    tokens_per_step = cfg.total_batch_size
    max_steps = (cfg.max_steps if cfg.max_steps > 0
                 else train_loader.tokens_per_epoch // tokens_per_step)
    # static shapes: validation batches of another size must not make the training graph symbolic
    forward = torch.compile(model, mode=COMPILE_MODE, dynamic=False) if cfg.compile else model
    if cfg.compile:  # compile once per node: local caches, and the run's artifacts for a new node
        artifacts = compile_artifacts_name(cfg, session.device_name)
        compile_cache = use_node_compile_cache()
        have_artifacts = load_compile_artifacts(session.run_dir, artifacts, compile_cache)

    state = TrainState.fresh(cfg)
    ckpt = Checkpointer(cfg, session, flat, opt, model.config, max_steps)
    restore_started = time.time()
    resumed_from = ckpt.restore_latest(state, train_loader)  # seed 000's resume order inside
    startup = {**session.startup_marks(), "restore_started": restore_started,
               "state_loaded": time.time(), "load_s": ckpt.load_seconds}  # the recovery ledger's
    n_params = num_parameters(model)
    # every event goes to runlog once: console, main.log, loss history, TensorBoard, Ray, trackers
    runlog = on_exit.enter_context(RunLog(cfg, session, max_steps=max_steps,
                                          resumed_from=resumed_from, model_config=model.config,
                                          n_params=n_params, startup=startup))
    attempt, history, logger = runlog.attempt, runlog.history, runlog.logger  # (rewind's sinks)
    faults = plan_for(cfg.fault, rank, session.run_dir)
    flags = signals.watch()  # SIGTERM / SIGUSR1 set flags; the handlers do nothing else
    save_clock = signals.SaveClock(cfg.checkpoint_minutes if is_main else 0.0)  # rank 0 decides

    if is_main:
        print(f"raygpt | {cfg.model}: {n_params:,} parameters | {world} x {session.device_name}"
              f" | {cfg.precision} | B={cfg.batch_size} T={cfg.seq_len} grad_accum={grad_accum}"
              f" | {tokens_per_step:,} tokens/step | {max_steps} steps | attempt {attempt}"
              + (f" | resumed from step {resumed_from}" if resumed_from is not None else ""),
              flush=True)
    if cfg.compile:
        runlog.compiling()  # the first forward pass compiles: say so before it looks like a hang

    agree = torch.zeros(NUM_SLOTS, dtype=torch.float32, device=device)
    clipped_at_last_watch = state.clipped
    val_loss = float("nan")
    stop_requested = False
    t_start = time.perf_counter()
    first_step = state.step

    while True:
        step = state.step  # a rewind moves it back, so the loop reads it rather than counting
        last_step = step == max_steps

        # ---------------------------------------------------------- validation and sample
        if validating and (step % cfg.val_every == 0 or last_step):
            val_loss = evaluate(forward, val_loader, cfg, device, world)
            runlog.val(step, val_loss, skips=state.skips, rewinds=state.ledger.rewinds)
        if is_main and cfg.sample_every > 0 and step > 0 and (step % cfg.sample_every == 0 or last_step):
            runlog.sample(step, sample_text(model, cfg, device, step))

        # ---------------------------------------------------------- checkpoint
        if ckpt.due(step, last_step, resumed_from) or state.save_requested:
            ckpt.save(state, train_loader, blocking=last_step or stop_requested)
            state.save_requested = False
            save_clock.saved()
        if last_step or stop_requested:
            break

        # ---------------------------------------------------------- TRAINING SECTION
        t0 = time.perf_counter()
        faults.before_update(step)
        flat.zero_grad()
        step_samples = []
        loss_acc = torch.zeros((), dtype=torch.float32, device=device)
        for _ in range(grad_accum):
            x, y = train_loader.next_batch(device)
            step_samples.append(train_loader.last_global_samples)
            loss_sum, z_sum = forward(x, y, z_loss=cfg.z_loss)
            if faults.nan_now(step):
                loss_sum = loss_sum * float("nan")
            # token-weighted mean over the whole window and all ranks (grads are SUM-reduced)
            ((loss_sum + z_sum) / tokens_per_step).backward()
            loss_acc += loss_sum.detach()
            if PREFETCH_BATCHES:  # the next micro-batch's gather and copy, during this backward
                train_loader.prefetch(device)
        opt.reduce_gradients()
        norm_sq = opt.grad_norm_squared()  # this rank's shard; all of it without ZeRO

        # one collective: the loss, the squared norm, and every flag the ranks must agree on
        agree[LOSS] = loss_acc
        agree[NORM_SQ] = norm_sq if (cfg.zero_stage == 1 or is_main) else 0.0
        outside_stop, outside_save = session.poll_requests()  # driver signals, preemption
        agree[STOP] = max(flags.stop_requested(), float(outside_stop))
        agree[SAVE] = max(flags.take_save_request(), float(outside_save),
                          float(faults.preempt_now(step)), float(save_clock.due()))
        agree[CKPT_READY] = ckpt.ready()
        agree[RAY_REPORT] = runlog.wants_ray_report(step)  # rank 0's clock decides for all ranks
        all_reduce_sum(agree, world)
        loss_v, norm_sq_v, stop_v, save_v, ready_v, report_v = agree.tolist()  # the one host sync
        loss = loss_v / tokens_per_step
        norm = math.sqrt(norm_sq_v) if norm_sq_v >= 0 else float("nan")

        verdict = state.judge(cfg, step, loss, norm)
        lr = learning_rate(cfg.scheduler, step, peak_lr=cfg.learning_rate,
                           warmup_steps=cfg.warmup_steps, total_steps=max_steps,
                           final_lr_frac=cfg.final_lr_frac) * state.lr_scale
        grad_scale = cfg.grad_clip / norm if norm > cfg.grad_clip else 1.0

        if verdict.kind in ("rewind", "escalate"):
            rewind(cfg, state, ckpt, train_loader, history, logger, step, verdict, step_samples)
            runlog.restart_at(state.step)
            resumed_from = state.step  # its checkpoint exists: do not write it again
            continue
        watching = is_main and cfg.watch_every > 0 and (step + 1) % cfg.watch_every == 0
        before = flat.params[:flat.num_parameters].clone() if watching else None
        if verdict.kind == "ok":
            state.rng_state_last_update = state.rng_state
            sr_seed, state.rng_state = random_u32(state.rng_state)
            opt.step(lr=lr, grad_scale=grad_scale, t=step + 1, seed=sr_seed)
            state.spike_samples = []
        else:  # skip: drop this update only; the step (and with it lr and data order) advances
            state.skips += 1
            state.spike_samples += step_samples
            runlog.skip(step, verdict, loss=loss, norm=norm)
        # no sync here: the optimizer kernels overlap the host's logging and the next step's
        # launch (its batch was prefetched during this backward); in steady state dt (start to
        # start, the host waits in the one sync above) is the step time
        dt = time.perf_counter() - t0
        state.step = step + 1
        state.tokens_seen += tokens_per_step
        state.clipped += int(norm > cfg.grad_clip)

        if step == first_step and cfg.compile and is_main and not have_artifacts:
            save_compile_artifacts(session.run_dir, artifacts, compile_cache)
        if step == first_step and GC_FREEZE_AFTER_FIRST_STEP:
            gc.collect()
            gc.freeze()

        # ---------------------------------------------------------- logging
        runlog.train(step, loss=loss, norm=norm, lr=lr, dt=dt, verdict=verdict,
                     tokens=state.tokens_seen, tokens_per_step=tokens_per_step,
                     report_to_ray=report_v > 0,
                     **({"samples": samples_to_ranges(np.concatenate(step_samples))}
                        if cfg.record_samples else {}))
        if watching:
            watch = watch_metrics(flat, before, getattr(model, "last_max_logit", None),
                                  (state.clipped - clipped_at_last_watch) / cfg.watch_every)
            clipped_at_last_watch = state.clipped
            runlog.watch(step, watch)

        # ---------------------------------------------------------- what the ranks agreed on
        if ready_v >= world:
            ckpt.publish_pending({"step": state.step, "train_loss": loss, "val_loss": val_loss})
        if save_v > 0:
            state.save_requested = True  # SIGUSR1, preemption, --checkpoint-minutes: save, go on
        if stop_v > 0:
            state.save_requested = stop_requested = True  # SIGTERM: checkpoint, then exit

    ckpt.finish()
    elapsed = time.perf_counter() - t_start
    summary = {"step": state.step, "max_steps": max_steps, "val_loss": val_loss,
               "stopped_early": state.step < max_steps, "skips": state.skips,
               "rewinds": state.ledger.rewinds, "elapsed_s": elapsed,
               "checkpoint_stall_s": ckpt.stall_seconds, "checkpoint_stalls": ckpt.stalls,
               "checkpoints_written": len(ckpt.write_seconds),
               "checkpoint_write_s": ckpt.write_seconds, "checkpoint_load_s": ckpt.load_seconds,
               "attempt": attempt,
               # this rank's high-water mark of tensor memory (ZeRO-1 against unsharded)
               "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                   if device.type == "cuda" else None)}
    runlog.end(summary)
    signals.unwatch()
    return summary


@torch.no_grad()
def watch_metrics(flat, before, max_logit, clipped_frac) -> dict:
    """Seed 001's watch metrics: the fraction of recent steps clipped, the largest output logit,
    and ||update|| / ||param|| per llm.c tensor group (a healthy run keeps these small and steady).
    One host sync, every watch_every steps only."""
    after = flat.params[:flat.num_parameters]
    deltas = torch.split((after.float() - before.float()), flat.tensor_sizes)
    weights = torch.split(before.float(), flat.tensor_sizes)
    ratios = torch.stack([d.norm() / w.norm().clamp_min(1e-12) for d, w in zip(deltas, weights)])
    return {"clipped_frac": clipped_frac,
            "max_logit": float(max_logit) if max_logit is not None else float("nan"),
            "update_ratio": dict(zip(flat.names, ratios.tolist()))}


def rewind(cfg, state, ckpt, loader, history, logger, step, verdict, step_samples) -> None:
    """Seed 001's rewind: back to the newest verified checkpoint before the spike began, with the
    spike's data window added to the persisted skip list; escalate past the policy's limits."""
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
    history.event(step, "rewind", reason=verdict.reason, to_step=target, window=window,
                  lr_scale=lr_scale, loss_z=verdict.loss_z, rewinds=state.ledger.rewinds)
    logger.log_event(step, "rewind", to=target, lr_scale=lr_scale)
    if history.enabled:
        print(f"step {step + 1:5d} | REWIND: {verdict.reason}; back to step {target}, skipping "
              f"{sum(e - s for _, s, e in window)} samples from now on, lr_scale {lr_scale:.3f}",
              flush=True)
    if escalation is not None:
        raise TrainingStopped(f"step {step}: {verdict.reason}; stopping: {escalation}")
    ckpt.rewind_to(target, state, loader, window)  # the decision is durable before it returns
