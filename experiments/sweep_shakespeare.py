"""Sweep raygpt's Tiny Shakespeare job with Ray Tune: every trial is a full raygpt run.

    # the four LR schedules, ASHA early stopping on validation loss, runs/sweep_shakespeare/
    python experiments/sweep_shakespeare.py -e d2 -x 200
    # peak LR x outlier thresholds (-sl, and the spike monitor's soft z) on 1-GPU trials
    python experiments/sweep_shakespeare.py --num-workers 1 -k wsd \\
        --grid learning_rate=3e-4,6e-4,1e-3 --grid skip_update_lossz=0,3,5 \\
        --spike --grid spike.soft_z=4,6
    # WSD decay branches from one shared stable phase (decays start at int(0.8 * total))
    python experiments/sweep_shakespeare.py -k wsd --wsd-branches 200,250,300 -n 20
    # the driver died: continue the sweep (finished trials are not run again)
    python experiments/sweep_shakespeare.py -o runs/sweep_shakespeare -y 1
    # train the winner on its own (from any directory: the file's paths are absolute)
    raygpt train --config runs/sweep_shakespeare/best_config.json

Every flag of `raygpt train` sets the base config that the trials override; -o is the sweep
directory. Sweep options: --grid/--choice KEY=V1,V2  --uniform/--loguniform KEY=LO,HI
--num-samples N  --early-stop asha|none  --grace-period N  --max-concurrent N
--trial-retries N  --wsd-branches N1,N2  --address ADDR (see raygpt/ray/trials.py). Every trial
config that can be known up front is checked before Ray starts (exit 2, one line naming it).
"""

import sys

from raygpt.ray.sweep_command import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="sweep_shakespeare.py"))
