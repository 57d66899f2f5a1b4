"""--eval-set NAME=GLOB: the validation loss of more named corpora, every -v steps.

Each set is a glob of llm.c token shards like -j (local, s3:// or gs://), read as -j is read:
-m/--val-batches micro-batches of --val-batch-size samples per rank (the values resolved for
-j), the same batches each time, ranks beyond the set's data sitting it out, and the mean over
every rank's tokens reduced by one all-reduce (`raygpt.train.loop.evaluate`). Each set is one
task of the loop (`raygpt.train.tasks`), run right after -j's validation, in the order the sets
were given; its loss goes to the reporter as an `eval_set` event under its name (history,
TensorBoard and trackers as `val/NAME`, `raygpt status`, `raygpt plot`). main.log keeps -j's
`tel:` line only.
"""

from __future__ import annotations

from raygpt.config.eval_sets import (EXPECTED, FLAG, MAIN_NAME, NAME, parse,  # noqa: F401
                                     patterns, with_patterns)

class EvalSet:
    """One --eval-set as a loop task: its loss every -v steps and at the last step."""

    phase = "eval"

    def __init__(self, name: str, loader, val_every: int):
        self.name, self.loader, self.val_every = name, loader, val_every

    def due(self, step: int, last_step: bool) -> bool:
        from raygpt.train.tasks import every
        return every(self.val_every, step, last_step)

    def run(self, r, step: int) -> None:
        from raygpt.eval.validation import evaluate
        loss = evaluate(r.forward, self.loader, r.cfg, r.session.device, r.session.world)
        r.runlog.eval_set(step, self.name, loss)


def tasks(cfg, rank: int, world: int, cache, vocab_size: int, on_exit) -> list[EvalSet]:
    """One task per --eval-set (none while -v is 0), each with this rank's loader of its shards
    (None on a rank beyond the set's data), closed when the loop exits."""
    if cfg.val_every <= 0:
        return []
    from raygpt.eval.validation import build_val_loader
    out = []
    for name, pattern in parse(cfg.eval_set):
        loader = build_val_loader(cfg, rank, world, cache, vocab_size, pattern=pattern)
        if loader is not None:
            on_exit.callback(loader.close)
        out.append(EvalSet(name, loader, cfg.val_every))
    return out
