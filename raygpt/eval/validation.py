"""A validation loss: one rank's loader of a set of shards (-j's, or an --eval-set's) and the
mean loss over every rank's tokens, the same batches each time. The loop's -j validation and the
--eval-set tasks (raygpt.eval.sets) both call it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from raygpt.config import TrainConfig
from raygpt.eval.knobs import EvalConfig
from raygpt.data.loader import DistributedDataLoader, ranks_with_data
from raygpt.data.sources import ShardCache, shard_token_counts


def build_val_loader(cfg: TrainConfig, rank: int, world: int, cache: ShardCache | None = None,
                     vocab_size: int | None = None, *,
                     pattern: str | None = None) -> DistributedDataLoader | None:
    """This rank's validation loader, or None on a rank that sits validation out: a validation
    set smaller than world * val_batch_size samples feeds only the first ranks
    (`data.ranks_with_data`; the config's resolution chose the sizes). `pattern`: the shards
    of another validation set (an --eval-set's), read as -j's are; default -j."""
    pattern = cfg.input_val_bin if pattern is None else pattern
    tokens = [n for _, n in shard_token_counts(pattern)]
    val_world = ranks_with_data(tokens, cfg.val_batch_size, cfg.seq_len, world)
    if rank >= val_world:
        return None
    return DistributedDataLoader(pattern, cfg.val_batch_size, cfg.seq_len, rank,
                                 val_world, shuffle=False, seed=cfg.seed, cache=cache,
                                 vocab_size=vocab_size)


@torch.no_grad()
def evaluate(model, val_loader, cfg: EvalConfig, device, world: int) -> float:
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
    if world > 1:  # every rank takes part, a rank without data adding zeros
        dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    model.train()
    return (acc[0] / acc[1]).item()
