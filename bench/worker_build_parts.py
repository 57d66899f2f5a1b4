"""Where a restarted GPU worker's "model + optimizer built" goes (issue 24): the steps of
loop.build_run's model build timed one by one in a fresh process (GPT-2 124M, one GPU), with and
without compile_cache.warm_compiler's thread importing Dynamo and Inductor beside them.

    THREADS=1 python bench/worker_build_parts.py          # without the warm-up thread
    THREADS=1 python bench/worker_build_parts.py warm     # with it (as a compiling worker)

THREADS is torch's intra-op threads (a Ray Train worker gets 1 unless it asks for more CPUs).
"""

import os
import sys
import time
from pathlib import Path

t_import = time.time()
import torch  # noqa: E402  (timed)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    marks = [("import torch", time.time() - t_import)]
    warm = sys.argv[1:] == ["warm"]
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    from raygpt import compile_cache
    from raygpt.config import TrainConfig
    from raygpt.loop import build_model
    from raygpt.model import GPT, GPTConfig
    from raygpt.optim import AdamW, FlatParameters

    t = time.time()

    def lap(name: str) -> None:
        nonlocal t
        torch.cuda.synchronize()
        marks.append((name, time.time() - t))
        t = time.time()

    warming = compile_cache.warm_compiler() if warm else None
    cfg = TrainConfig(model="d12", deterministic=True, device="gpu", output_dir="/tmp/x").resolve(1)
    torch.zeros(1, device="cuda")
    lap("cuda init")
    GPT(GPTConfig.from_depth(12), init_seed=42)
    lap("GPT() with GPT-2 init (CPU)")
    GPT.empty(GPTConfig.from_depth(12))
    lap("GPT.empty (CPU)")
    model = build_model(cfg, torch.device("cuda"))
    lap("loop.build_model (whole)")
    flat = FlatParameters(model, torch.device("cuda"), torch.bfloat16)
    lap("FlatParameters")
    AdamW(flat, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    lap("AdamW")
    if warming is not None:
        warming.join()
        lap("warm-up thread joined")
    print(f"--- build parts ({'with' if warm else 'without'} the compiler warm-up thread), "
          f"threads={torch.get_num_threads()}")
    for name, seconds in marks:
        print(f"  {name:36s} {seconds:6.2f} s")


if __name__ == "__main__":
    main()
