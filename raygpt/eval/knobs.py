"""The evaluation component's knobs: validation (-v -m), the other named validation sets
(--eval-set), samples (-s -g), watch metrics and HellaSwag, with their defaults and checks.
Validation's micro-batches are fitted to the validation shards by raygpt.data.fit."""

from __future__ import annotations

import glob
from dataclasses import dataclass

from raygpt.config import eval_sets  # --eval-set's syntax (the task is raygpt.eval.sets)
from raygpt.config.knobs import knob, need
from raygpt.config.paths import _remote, shards_with_endpoint


@dataclass
class EvalConfig:
    """What the run measures besides its training loss, and how often."""

    val_every: int = knob(20, section="eval", short="-v", may_change_on_resume=True,
                          hints=("--eval-interval", "--val-loss-every", "--eval-steps"))
    """Validation loss every N steps (-v); 0 turns it off."""
    val_batches: int | None = knob(None, section="eval", short="-m", may_change_on_resume=True,
                                   hints=("--eval-iters", "--val-max-steps"))
    """Validation micro-batches per rank per evaluation. Default: up to 20, as many as the
    validation shards hold without reading a sample twice (at least 1)."""
    val_batch_size: int | None = knob(None, section="eval", may_change_on_resume=True)
    """Validation micro-batch per rank. Default: the one up to B that covers the most of the
    validation shards in -m batches. Ranks beyond the validation data sit validation out."""
    eval_set: list[str] = knob(section="eval", factory=list, long="--eval-set",
                               metavar="NAME=GLOB", may_change_on_resume=True, from_file=True)
    """Another validation set, repeatable: NAME (letters, digits, _ . -; not 'loss', -j's)
    and a glob of llm.c token shards like -j's (local, s3:// or gs://). Each is evaluated with
    -j's policy: every -v steps and at the last step, -m batches of --val-batch-size per rank
    (the values resolved for -j's shards), ranks beyond the set's data sitting out, the mean
    over every rank's tokens; its loss is reported as val/NAME (history, TensorBoard, trackers,
    raygpt status and plot), not in main.log."""
    sample_every: int | None = knob(None, section="eval", short="-s", may_change_on_resume=True)
    """Generate a text sample every N steps; 0 turns it off. Default: 50."""
    gen_tokens: int = knob(64, section="eval", short="-g", may_change_on_resume=True)
    """Tokens per generated sample (-g)."""
    watch_every: int = knob(50, section="eval", may_change_on_resume=True)
    """Every N steps log watch metrics: clipped fraction, max logit, update/param ratios."""
    hellaswag: str = knob("", section="eval", metavar="FILE", may_change_on_resume=True,
                          from_file=True)
    """HellaSwag's hellaswag_val.jsonl (a path or URI), scored as llm.c scores it (acc_norm,
    llm.c's -h 1) every --hellaswag-every steps, the examples spread over the ranks; '' is off."""
    hellaswag_every: int | None = knob(None, section="eval", may_change_on_resume=True)
    """Score HellaSwag every N steps and at the last. Default: -v (its validation steps)."""


    def resolve_eval(self, *, endpoint: str) -> None:
        """Fill -s and --hellaswag-every where unset; the sets' globs in a bucket carry the run's
        endpoint. (-m and --val-batch-size are fitted to the shards: raygpt.data.fit.)"""
        self.eval_set = eval_sets.with_patterns(
            self.eval_set, lambda name, p: shards_with_endpoint(f"--eval-set {name}", p, endpoint))
        if self.sample_every is None:
            self.sample_every = 50
        if self.hellaswag_every is None:
            self.hellaswag_every = self.val_every if self.hellaswag else 0

    def validate_eval(self, *, validating: bool) -> None:
        """`validating`: -j names validation shards (-m must then be >= 1 while -v is on)."""
        for flag, value in (("-v/--val-every", self.val_every), ("-m/--val-batches", self.val_batches),
                            ("-s/--sample-every", self.sample_every), ("-g/--gen-tokens", self.gen_tokens),
                            ("--watch-every", self.watch_every)):
            need(value >= 0, flag, "an integer >= 0", value)
        need(self.val_batch_size is not None and self.val_batch_size >= 1, "--val-batch-size",
             "an integer >= 1", self.val_batch_size)
        need(self.val_batches >= 1 or not validating or self.val_every == 0,
             "-m/--val-batches", "an integer >= 1 while validation is on (-v > 0)", self.val_batches)
        for name, pattern in eval_sets.parse(self.eval_set):
            need(_remote(pattern) or bool(glob.glob(pattern)), f"--eval-set {name}",
                 "a glob matching at least one llm.c token shard (local, s3:// or gs://)",
                 pattern)
