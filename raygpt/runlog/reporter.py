"""The run's one reporter: the loop tells `Reporter` each event, and it alone knows which rank
writes and where each event goes:

    event         console (rank 0)    main.log  loss_history  TensorBoard  Ray       W&B/MLflow
    validation    "val loss"          tel       val           val/loss     every     val/loss
    --eval-set    "val loss NAME"     -         eval_set      val/NAME     -         val/NAME
    train step    line per log_every  trl       train         train/*      gated     train/*
    sample        the text            -         samples.jsonl -            -         -
    start         the header line     (resume)  start/resume  -            -         -
    skip          "SKIP" on the line  skip:1    skip event    -            -         -
    source epoch  one line            source_epoch:1  source_epoch  -      -         -
    rewind        "REWIND" line       rewind:1  rewind event  -            -         -
    watch         one line            watch:1   watch event   -            -         -
    end           summary line        -         end           closed       -         closed

Ray gets the train metrics (step, train_loss, lr, grad_norm, tok_per_s) at log steps, at most
once per `session.metrics_interval_s`: `ray.train.report` is a barrier of every rank and Ray
Train's controller takes one report per poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), so a report per
step would hold every step for the poll. Rank 0 decides by its clock (`wants_ray_report`) and the
step's one collective carries the decision, so every rank reports at the same steps.
"""

from __future__ import annotations

import logging
import math
import time

from raygpt.runlog.console import format_step_line, printable, val_text
from raygpt.runlog.eta import Eta, due_steps
from raygpt.runlog.history import RunHistory, read_history
from raygpt.runlog.mainlog import Logger
from raygpt.runlog.mfu import estimate_mfu
from raygpt.runlog.startup import phases as startup_phases, startup_line
from raygpt.runlog.tensorboard import TensorBoardWriter
from raygpt.runlog.tracking import Trackers

log = logging.getLogger(__name__)


class Reporter:
    def __init__(self, cfg, session, *, max_steps: int, resumed_from: int | None, model_config,
                 n_params: int, startup: dict | None = None):
        self.cfg, self.session, self.max_steps = cfg, session, max_steps
        self.rank, self.world = session.rank, session.world
        self.is_main = self.rank == 0
        self.model_config, self.n_params = model_config, n_params
        # this launch's start-up marks until the first step, when they become its "startup"
        # record and line (raygpt.runlog.startup); None once written, or for a restarted group
        self._startup = dict(startup) if startup and "driver" in startup else None
        self.history = RunHistory(session.run_dir, cfg, enabled=self.is_main)
        self.attempt = self.history.begin_attempt(resumed_from, session.failure_note(),
                                                  max_steps=max_steps, startup=startup)
        self.logger = Logger(session.run_dir if self.is_main else None, self.rank,
                             resume=resumed_from is not None or self.attempt > 1,
                             segment_s=cfg.log_segment_s, segment_lines=cfg.log_segment_lines)
        self.tb = TensorBoardWriter(session.run_dir, enabled=self.is_main, purge_step=resumed_from)
        self.trackers = Trackers(cfg, session.run_dir, enabled=self.is_main, attempt=self.attempt,
                                 on_error=self._tracker_failed)
        if self.trackers.active and resumed_from is not None:
            sent = self.trackers.top_up(read_history(session.run_dir), resumed_from,
                                        cfg.log_every, cfg.total_batch_size)
            if sent:
                self.say(f"raygpt | trackers: {sent} earlier log steps they had lost re-sent "
                         f"from loss_history.jsonl")
        self._last_ray_report = -math.inf
        self._compile_started: float | None = None
        self.eta = Eta(max_steps)  # the step line's ETA, the periodic tasks' runs to come counted
        self._closed = False

    def __enter__(self) -> "Reporter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close("FINISHED")
            return
        try:  # the run's own error is the one to see: closing the sinks must not replace it
            self.close("FAILED")
        except Exception as e:  # noqa: BLE001
            log.warning(f"raygpt | WARNING: closing the run's logs after an error failed: "
                        f"{type(e).__name__}: {e}")

    def say(self, line: str) -> None:
        if self.is_main:
            log.info(line)

    # ------------------------------------------------------------------ events

    def start(self, *, world: int, grad_accum: int, tokens_per_step: int,
              resumed_from: int | None, tasks=()) -> None:
        """The run's header line (the start or resume record is written on construction);
        `tasks`, the loop's periodic tasks (raygpt.train.tasks), are scheduled for the ETA."""
        cfg = self.cfg
        if self.is_main:
            for task in tasks:
                self.eta.schedule(task.name, due_steps(task.due, resumed_from or 0,
                                                       self.max_steps))
        self._mark_startup("loop_started")
        self.say(f"raygpt | {cfg.model}: {self.n_params:,} parameters | {world} x "
                 f"{self.session.device_name} | {cfg.precision} | B={cfg.batch_size} "
                 f"T={cfg.seq_len} grad_accum={grad_accum} | {tokens_per_step:,} tokens/step | "
                 f"{self.max_steps} steps | attempt {self.attempt}"
                 + (f" | resumed from step {resumed_from}" if resumed_from is not None else ""))

    def task_ran(self, name: str, seconds: float) -> None:
        """A periodic task (validation, an eval set, HellaSwag, the sample) took `seconds`."""
        self.eta.task_ran(name, seconds)

    def compiling(self) -> None:
        """Before the first forward pass of a compiled model: it takes a while and looks like a
        hang (tens of seconds for GPT-2 124M on a GPU), so say so now and how long it took after."""
        self._compile_started = time.perf_counter()
        self.say("raygpt | torch.compile: compiling the model's graphs during the first "
                 "validation and step (10-25 s on a GPU, once per process)...")

    def val(self, step: int, val_loss: float, *, skips: int, rewinds: int) -> None:
        self.logger.log_val(step, val_loss)
        self.history.val(step, val_loss)
        self._mark_startup("first_val_done")
        self.tb.val(step, val_loss)
        self.say(f"step {step:5d} | val loss {val_loss:.6f}")
        self.session.report_metrics({"step": step, "val_loss": val_loss, "skips": skips,
                                     "rewinds": rewinds})
        self.trackers.log(step, {"val/loss": val_loss})

    def eval_set(self, step: int, name: str, val_loss: float) -> None:
        """An --eval-set's validation loss at `step`: an "eval_set" record with its name in the
        history, `val/NAME` to TensorBoard and the trackers; main.log keeps -j's `tel:` only."""
        self.history.event(step, "eval_set", name=name, val_loss=val_loss)
        self.tb.scalar(step, f"val/{name}", val_loss)
        self.say(f"step {step:5d} | val loss {name} {val_loss:.6f}")
        self.trackers.log(step, {f"val/{name}": val_loss})

    def hellaswag(self, step: int, correct: int, total: int) -> None:
        """HellaSwag's acc_norm at `step`: llm.c's `s:%d eval:%.4f` in main.log, an "eval" record
        in the history, and the same scalar to TensorBoard and the trackers."""
        acc = correct / total
        self.logger.log_eval(step, acc)
        self.history.event(step, "eval", hellaswag=acc, correct=correct, total=total)
        self.tb.scalar(step, "eval/hellaswag", acc)
        self.say(f"step {step:5d} | HellaSwag acc_norm {correct}/{total} = {acc:.4f}")
        self.trackers.log(step, {"eval/hellaswag": acc})

    def sample(self, step: int, text: str) -> None:
        self.history.sample(step, text)
        self.say(f"step {step:5d} | sample:\n" + "\n".join(
            f"  | {line}" for line in printable(text).split("\n")))

    def wants_ray_report(self, step: int) -> bool:
        """Rank 0's vote, for the step's collective: report this step's metrics to Ray? A
        checkpoint's report counts as a report (`Session.last_checkpoint_report`): it shares
        the queue of one, and metrics behind it would wait for the controller's poll. The last
        step always reports: its metrics are the run's result (Ray's `Result.metrics`, Tune's
        last row), and one wait for the poll at the end costs nothing."""
        if not self.is_main or not self._log_step(step):
            return False
        last = max(self._last_ray_report, self.session.last_checkpoint_report)
        return (step == self.max_steps - 1
                or time.monotonic() - last >= self.session.metrics_interval_s)

    def _log_step(self, step: int) -> bool:
        return step % self.cfg.log_every == 0 or step == self.max_steps - 1

    def train(self, step: int, *, loss: float, norm: float, lr: float, dt: float, verdict,
              tokens: int, tokens_per_step: int, report_to_ray: bool, data: dict | None = None,
              **record) -> None:
        """A trained (or skipped) step. `record` goes to the loss history only; `data`, the
        loader's report (a mixture's: tokens per source, the sources that began an epoch)."""
        tok_per_s = tokens_per_step / dt
        if data is not None:
            record["source_tokens"] = data["source_tokens"]
            self.source_epochs(step, data["new_epochs"])
        self.logger.log_train(step, loss, lr, norm)
        self.history.train(step, loss=loss, norm=norm, lr=lr, tokens=tokens, dt=dt,
                           verdict=verdict.kind, world=self.world, **record)
        if self._startup is not None:
            self._mark_startup("first_step_done")
            self.history.event(step, "startup", marks=self._startup,
                               phases=dict(startup_phases(self._startup)))
            self.say(startup_line(self._startup))
            self._startup = None
        self.tb.train(step, loss=loss, lr=lr, norm=norm, tok_per_s=tok_per_s)
        now = time.perf_counter()
        if self._compile_started is not None:
            self.say(f"raygpt | torch.compile: done, first step after "
                     f"{now - self._compile_started:.1f} s")
            self._compile_started = None
        eta = self.eta.step_done(step, now)
        if report_to_ray:  # every rank, at the steps the ranks agreed on
            self._last_ray_report = time.monotonic()
            self.session.report_metrics({"step": step, "train_loss": loss, "lr": lr,
                                         "grad_norm": norm, "tok_per_s": tok_per_s})
        if not (self.is_main and self._log_step(step)):
            return
        self.trackers.log(step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm,
                                 "train/tok_per_s": tok_per_s})
        cfg, mc = self.cfg, self.model_config
        mfu = estimate_mfu(self.n_params, mc.n_layer, mc.n_embd, cfg.seq_len,
                           tokens_per_step / self.world, dt, self.session.device_name,
                           "bf16" if cfg.precision == "bf16" else "tf32")
        self.say(format_step_line(step + 1, self.max_steps, loss, norm, lr, dt * 1000, tok_per_s,
                                  mfu, precision=cfg.precision, eta_s=eta,
                                  note="" if verdict.kind == "ok" else f"SKIP: {verdict.reason}"))

    def source_epochs(self, step: int, begun: list) -> None:
        """Sources of a mixture that drew every sample of an epoch during `step` and began
        the next (in their own llm.c order for that epoch)."""
        for name, epoch in begun:
            self.history.event(step, "source_epoch", source=name, epoch=epoch)
            self.logger.log_event(step, "source_epoch", source=name, epoch=epoch)
            self.say(f"step {step + 1:5d} | -i {name}: every sample of epoch {epoch - 1} drawn; "
                     f"epoch {epoch} begins")

    def _mark_startup(self, name: str) -> None:
        """The first time of `name` in this launch's start-up (raygpt.runlog.startup.CHAIN)."""
        if self._startup is not None:
            self._startup.setdefault(name, time.time())

    def skip(self, step: int, verdict, *, loss: float, norm: float) -> None:
        self.logger.log_event(step, "skip", reason=verdict.reason)
        self.history.event(step, "skip", reason=verdict.reason, loss=loss, norm=norm,
                           loss_z=verdict.loss_z)

    def rewind(self, step: int, verdict, *, target: int | None, window, lr_scale: float,
               rewinds: int) -> None:
        """A rewind decided at `step` (to checkpoint `target`; None: nothing to go back to and
        the run escalates), written before it is carried out."""
        self.history.event(step, "rewind", reason=verdict.reason, to_step=target, window=window,
                           lr_scale=lr_scale, loss_z=verdict.loss_z, rewinds=rewinds)
        self.logger.log_event(step, "rewind", to=target, lr_scale=lr_scale)
        self.say(f"step {step + 1:5d} | REWIND: {verdict.reason}; back to step {target}, "
                 f"skipping {sum(e - s for _, s, e in window)} samples from now on, lr_scale "
                 f"{lr_scale:.3f}")

    def watch(self, step: int, watch: dict) -> None:
        self.history.event(step, "watch", **watch)
        self.logger.log_event(step, "watch", clipped=watch["clipped_frac"],
                              maxlogit=watch["max_logit"])
        self.say(f"step {step + 1:5d} | watch: {watch['clipped_frac']:.0%} of steps clipped | max "
                 f"logit {watch['max_logit']:.2f} | update/param " + " ".join(
                     f"{k} {v:.1e}" for k, v in watch["update_ratio"].items()))

    def restart_at(self, step: int) -> None:
        """After a rewind to `step` (TensorBoard shows the re-done steps once)."""
        self.tb.restart_at(step)
        self.eta.restart()  # the gap to the next step holds the restore, not a step

    def end(self, summary: dict) -> None:
        self.history.end(summary)
        how = "stopped by signal; resume with -y 1" if summary["stopped_early"] else "done"
        self.say(f"raygpt | {how} at step {summary['step']}/{summary['max_steps']} | val loss "
                 f"{val_text(summary['val_loss'])} | {summary['skips']} skipped, "
                 f"{summary['rewinds']} rewinds | {summary['elapsed_s']:.1f} s")
        self.close("KILLED" if summary["stopped_early"] else "FINISHED")

    def close(self, status: str = "FINISHED") -> None:
        """TensorBoard's last upload, the tracker runs' end (FINISHED, KILLED or FAILED), and
        the last lines of main.log and the history stored (an object store's last segments)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.tb.close()
            self.trackers.close(status)
        finally:
            self.logger.close()
            self.history.close()

    def _tracker_failed(self, step: int, name: str, message: str) -> None:
        self.history.event(step, "tracker_error", tracker=name, message=message)
        self.logger.log_event(step, "tracker_error", tracker=name)
