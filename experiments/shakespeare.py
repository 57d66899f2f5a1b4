"""Pretrain GPT-2 on Tiny Shakespeare with raygpt: the embedded, offline default job.

    python experiments/shakespeare.py                 # local Ray; GPT-2 124M in bf16 on every
                                                      # GPU, or a small model on 2 CPU workers
    ray job submit -- python experiments/shakespeare.py   # the same on a running cluster
    python experiments/shakespeare.py -y 1            # resume the run in runs/shakespeare

Every llm.c flag and long option of `raygpt train --help` works here too. Defaults not given
adapt to the machine and the bundled data (1 to 64 GPUs, or CPUs) and the start-up line says
what was chosen. Exit status: 0 finished, 1 failed, 2 bad input (refused before Ray started),
3 stopped early and resumable with -y 1, 130 aborted by a second Ctrl-C.
"""

import sys

from raygpt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
