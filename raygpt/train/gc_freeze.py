"""The garbage collector's freeze (--no-gc-freeze turns it off), owned by one context manager:
after the first step (compiled, warmed up) the live objects move out of the collector's reach
(gc.freeze: a full collection otherwise walks Dynamo's and Inductor's caches and stalls a step
for tens of milliseconds now and then), and they are collectable again once the loop is over."""

from __future__ import annotations

import gc


class GCFreeze:
    """`with GCFreeze(enabled) as freeze:` ... `freeze.after_warmup()` once the first step is
    done; a no-op when not `enabled`. The `with`'s end unfreezes, by a return or an error."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self) -> "GCFreeze":
        return self

    def after_warmup(self) -> None:
        if self.enabled:
            gc.collect()
            gc.freeze()

    def __exit__(self, *exc) -> None:
        if self.enabled:
            gc.unfreeze()  # what the loop froze is collectable again once it is over
