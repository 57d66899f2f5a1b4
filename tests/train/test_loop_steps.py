"""The loop's per-step decisions, one function at a time, against stand-ins for the run's
components: the agreement collective (what every rank acts on), the update or skip, what the
step's flags lead to, the sampling cadence, the watch metrics, the rewind's choice of target and
escalation, and the deterministic-mode error.

Pure unit tests (no model run, no process group: a stand-in `dist` plays the other rank where a
collective is involved). tests/train/test_loop.py and tests/train/test_training_behaviour.py check the same
functions inside real runs; these pin each decision exactly, in milliseconds, so that
bench/mutants.sh can mutate the loop without running training for every mutant.
"""

import math
import types

import numpy as np
import pytest
import torch

from raygpt.config import ConfigError, SpikeConfig, TrainConfig
from raygpt.train import determinism
from raygpt.train.errors import TrainingStopped
import raygpt.train.loop as loop
import raygpt.train.loop_tasks as loop_tasks
from raygpt.train.optim import random_u32
from raygpt.train.outlier import RewindLedger, Verdict
from raygpt.train.state import TrainState

NS = types.SimpleNamespace


class OtherRank:
    """torch.distributed for rank 0 of 2: all_reduce adds the other rank's vector, broadcast
    from rank 0 leaves the tensor as it is; the calls are recorded."""

    class ReduceOp:
        SUM = "sum"

    def __init__(self, other=None):
        self.other, self.calls = other, []

    def all_reduce(self, t, op):
        assert op == "sum"
        self.calls.append("all_reduce")
        t += self.other

    def broadcast(self, t, src):
        assert src == 0
        self.calls.append(("broadcast", int(t.item())))


def agree_run(*, rank=0, world=1, zero_stage=0, tokens=64, stop=0.0, save=0.0, outside=(False, False),
              preempt=False, clock_due=False, ready=False, report=False):
    return NS(vector=torch.zeros(loop.NUM_SLOTS, dtype=torch.float32),
              zero_stage=zero_stage, tokens_per_step=tokens,
              session=NS(rank=rank, world=world, poll_requests=lambda: outside),
              flags=NS(stop_requested=lambda: stop, take_save_request=lambda: save),
              faults=NS(preempt_now=lambda step: preempt and step == 5), save_clock=NS(due=lambda: clock_due),
              ckpt=NS(ready=lambda: ready), runlog=NS(wants_ray_report=lambda step: report and step == 5))


def test_one_rank_agrees_on_its_own_loss_and_norm():
    a = loop.agree(agree_run(tokens=64), 3, torch.tensor(32.0), torch.tensor(2.25))
    assert (a.loss, a.norm) == (0.5, 1.5)
    assert (a.stop, a.save, a.checkpoint_ready, a.ray_report) == (False, False, False, False)


@pytest.mark.parametrize("norm_sq", [math.nan, -math.inf])
def test_a_non_finite_squared_norm_agrees_on_nan(norm_sq):
    a = loop.agree(agree_run(), 0, torch.tensor(1.0), torch.tensor(norm_sq))
    assert math.isnan(a.norm)


@pytest.mark.parametrize("norm_sq, norm", [(0.0, 0.0), (0.25, 0.5)])
def test_a_zero_or_small_squared_norm_is_its_root(norm_sq, norm):
    assert loop.agree(agree_run(), 0, torch.tensor(1.0), torch.tensor(norm_sq)).norm == norm


def test_an_infinite_squared_norm_is_an_infinite_norm():
    assert loop.agree(agree_run(), 0, torch.tensor(1.0), torch.tensor(math.inf)).norm == math.inf


@pytest.mark.parametrize("kw, flag", [
    (dict(stop=1.0), "stop"), (dict(outside=(True, False)), "stop"),
    (dict(save=1.0), "save"), (dict(outside=(False, True)), "save"), (dict(preempt=True), "save"),
    (dict(clock_due=True), "save"), (dict(ready=True), "checkpoint_ready"),
    (dict(report=True), "ray_report")])
def test_each_source_raises_its_flag_and_only_it(kw, flag):
    a = loop.agree(agree_run(**kw), 5, torch.tensor(1.0), torch.tensor(1.0))
    flags = {f: getattr(a, f) for f in ("stop", "save", "checkpoint_ready", "ray_report")}
    assert flags == {f: f == flag for f in flags}


def two_ranks(monkeypatch, other):
    fake = OtherRank(torch.tensor(other, dtype=torch.float32))
    monkeypatch.setattr(loop, "dist", fake)
    return fake


@pytest.mark.parametrize("zero_stage, norm", [(0, 2.0), (1, 3.0)])
def test_the_norm_counts_rank_0s_full_norm_or_every_zero1_shard(monkeypatch, zero_stage, norm):
    """Without ZeRO every rank holds the full (reduced) gradient: only rank 0's squared norm
    enters the sum. Under ZeRO-1 each rank holds a shard: the squares add up."""
    # the other rank (rank 1) contributes 5.0 to the norm slot only under ZeRO-1; here we are rank 0
    fake = two_ranks(monkeypatch, [16.0, 5.0 if zero_stage else 0.0, 0, 0, 1.0, 0])
    a = loop.agree(agree_run(world=2, zero_stage=zero_stage, tokens=16, ready=True), 0,
                   torch.tensor(16.0), torch.tensor(4.0))
    assert fake.calls == ["all_reduce"]
    assert a.loss == 2.0 and a.norm == norm
    assert a.checkpoint_ready  # both ranks' checkpoints are written


def test_a_rank_beyond_0_adds_no_unsharded_norm_but_its_zero1_shard(monkeypatch):
    two_ranks(monkeypatch, [0.0, 4.0, 0, 0, 0, 0])  # rank 0's full squared norm
    a = loop.agree(agree_run(rank=1, world=2), 0, torch.tensor(0.0), torch.tensor(9.0))
    assert a.norm == 2.0
    two_ranks(monkeypatch, [0.0, 16.0, 0, 0, 0, 0])  # rank 0's shard
    a = loop.agree(agree_run(rank=1, world=2, zero_stage=1), 0, torch.tensor(0.0),
                   torch.tensor(9.0))
    assert a.norm == 5.0


def test_a_checkpoint_is_ready_only_when_every_rank_says_so(monkeypatch):
    two_ranks(monkeypatch, [0, 0, 0, 0, 0.0, 0])  # the other rank is still writing
    a = loop.agree(agree_run(world=2, ready=True), 0, torch.tensor(1.0), torch.tensor(1.0))
    assert not a.checkpoint_ready


def test_one_ranks_stop_or_save_stops_or_saves_all(monkeypatch):
    two_ranks(monkeypatch, [0, 0, 1.0, 1.0, 0, 0])
    a = loop.agree(agree_run(world=2), 0, torch.tensor(1.0), torch.tensor(1.0))
    assert a.stop and a.save and not a.ray_report


def test_all_reduce_sum_is_a_no_op_on_one_rank(monkeypatch):
    fake = two_ranks(monkeypatch, [1.0])
    t = torch.tensor([2.0])
    assert loop.all_reduce_sum(t, 1) is t and fake.calls == [] and t.item() == 2.0
    assert loop.all_reduce_sum(t, 2) is t and fake.calls == ["all_reduce"] and t.item() == 3.0


@pytest.mark.parametrize("step", [None, 0, 7])
def test_broadcast_step_hands_rank_0s_step_including_none_and_zero(monkeypatch, step):
    fake = two_ranks(monkeypatch, [0.0])
    assert loop.broadcast_step(step, 1, torch.device("cpu")) == step and fake.calls == []
    assert loop.broadcast_step(step, 2, torch.device("cpu")) == step
    assert fake.calls == [("broadcast", -1 if step is None else step)]


# ---------------------------------------------------------------------- update / skip

class Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **kw: self.calls.append((name, a, kw))


def update_run(grad_clip=1.0):
    state = TrainState(rng_state=12345, rng_state_last_update=999)
    state.spike_samples = [np.array([[0, 1]])]
    return NS(state=state, cfg=NS(grad_clip=grad_clip), opt=Recorder(), runlog=Recorder())


@pytest.mark.parametrize("norm, grad_scale", [(4.0, 0.25), (1.0, 1.0), (0.5, 1.0)])
def test_an_ok_update_clips_by_the_norm_and_rounds_with_the_next_seed(norm, grad_scale):
    r = update_run(grad_clip=1.0)
    agreed = loop.Agreed(loss=2.0, norm=norm, stop=False, save=False, checkpoint_ready=False,
                         ray_report=False)
    loop.update(r.state, r.opt, r.runlog, 9, Verdict("ok", 0.0, 0.0, ""), 3e-4, agreed,
                [np.array([[1, 2]])], grad_clip=r.cfg.grad_clip)
    seed, new_state = random_u32(12345)
    assert r.opt.calls == [("step", (), dict(lr=3e-4, grad_scale=grad_scale, t=10, seed=seed))]
    assert (r.state.rng_state_last_update, r.state.rng_state) == (12345, new_state)
    assert r.state.spike_samples == [] and r.state.skips == 0 and r.runlog.calls == []


def test_a_skipped_update_counts_keeps_the_rng_and_remembers_its_samples():
    r = update_run()
    agreed = loop.Agreed(loss=2.0, norm=9.0, stop=False, save=False, checkpoint_ready=False,
                         ray_report=False)
    verdict = Verdict("skip", 7.0, 1.0, "loss z")
    samples = [np.array([[1, 2]]), np.array([[1, 3]])]
    r.state.skips = 4
    loop.update(r.state, r.opt, r.runlog, 9, verdict, 3e-4, agreed, samples,
                grad_clip=r.cfg.grad_clip)
    assert r.opt.calls == [] and r.state.skips == 5
    assert (r.state.rng_state, r.state.rng_state_last_update) == (12345, 999)
    assert [s.tolist() for s in r.state.spike_samples] == [[[0, 1]], [[1, 2]], [[1, 3]]]
    assert r.runlog.calls == [("skip", (9, verdict), dict(loss=2.0, norm=9.0))]


# ---------------------------------------------------------------------- act_on

@pytest.mark.parametrize("ready, save, stop", [(True, False, False), (False, True, False),
                                               (False, False, True), (False, False, False)])
def test_act_on_publishes_saves_and_stops_as_agreed(ready, save, stop):
    state, ckpt = TrainState(step=12), Recorder()
    stop_requested = loop.act_on(loop.Agreed(loss=2.5, norm=1.0, stop=stop, save=save,
                                              checkpoint_ready=ready, ray_report=False),
                                 state, ckpt, 3.5)
    published = [("publish_pending", ({"step": 12, "train_loss": 2.5, "val_loss": 3.5},), {})]
    assert ckpt.calls == (published if ready else [])
    assert state.save_requested is (save or stop)
    assert stop_requested is stop


# ---------------------------------------------------------------------- cadence, metrics, errors

def test_only_the_windows_last_backward_reduces_during_itself():
    """forward_backward arms the overlapped reduction (AdamW.reduce_during_backward) once, just
    before the last micro-step's backward: the earlier ones only accumulate."""
    events = []
    w = torch.ones((), requires_grad=True)
    w.register_post_accumulate_grad_hook(lambda p: events.append("backward"))
    batch = (torch.zeros(1, 2), torch.zeros(1, 2))
    m = loop.MicroSteps(
        forward=lambda x, y, z_loss: (w * 2.0, torch.zeros(())),
        loader=NS(next_batch=lambda device: batch, last_global_samples=np.arange(1)),
        opt=NS(flat=NS(zero_grad=lambda: None), reduce_during_backward=lambda: events.append("arm")),
        faults=NS(nan_now=lambda step: False), grad_accum=3, tokens_per_step=1, z_loss=0.0,
        prefetch=False, device=torch.device("cpu"))
    loop.forward_backward(m, step=0)
    assert events == ["backward", "backward", "arm", "backward"]


@pytest.mark.parametrize("every, step, last, expected", [
    (0, 10, False, False), (0, 10, True, False), (5, 0, False, False), (5, 0, True, False),
    (5, 5, False, True), (5, 10, False, True), (5, 6, False, False), (5, 7, True, True),
    (1, 1, False, True)])
def test_sampling_step(every, step, last, expected):
    assert loop_tasks.sampling_step(NS(sample_every=every), step, last) is expected


def test_watch_metrics_are_the_update_to_weight_ratio_per_tensor():
    flat = NS(params=torch.tensor([3.0, 4.0, 0.0, 0.0, 1.0, 99.0]), num_parameters=5,
              tensor_sizes=[2, 2, 1], names=["wte", "lnfw", "lnfb"])
    before = torch.tensor([3.0, 4.0, 0.0, 0.0, 2.0])
    flat.params[0] = 0.0  # wte: delta (-3, 0) against weight norm 5
    flat.params[2] = 1e-9  # lnfw: a weight that was exactly 0 (norm clamped to 1e-12)
    m = loop_tasks.watch_metrics(flat, before, 12.5, 0.25)
    assert m["clipped_frac"] == 0.25 and m["max_logit"] == 12.5
    assert list(m["update_ratio"]) == ["wte", "lnfw", "lnfb"]
    assert m["update_ratio"]["wte"] == pytest.approx(0.6)
    assert m["update_ratio"]["lnfw"] == pytest.approx(1e-9 / 1e-12, rel=1e-3)
    assert m["update_ratio"]["lnfb"] == pytest.approx(0.5)
    assert math.isnan(loop_tasks.watch_metrics(flat, before, None, 0.0)["max_logit"])


@pytest.mark.parametrize("message, op", [
    ("index_add_cuda_ does not have a deterministic implementation, but you set ...",
     "index_add_cuda_"),
    ("scatter_add_cuda_kernel, does not have a deterministic implementation", "scatter_add_cuda_kernel"),
    ("does not have a deterministic implementation", "an op"),
    # a name ending in the letters of a separator keeps them (only a trailing comma goes)
    ("upsample_bilinear2d_backward_out_X, does not have a deterministic implementation",
     "upsample_bilinear2d_backward_out_X")])
def test_the_non_deterministic_op_is_named_from_torchs_message(message, op):
    assert determinism.op_named_in(message) == op
    err = determinism.NonDeterministicOp(op)
    assert isinstance(err, ConfigError) and err.op == op
    assert str(err).startswith(f"--deterministic (the default on GPUs): {op} has no deterministic "
                               f"implementation on this device; run with --no-deterministic")


def test_validating_needs_a_val_set_and_a_cadence():
    for path, every, expected in [("v.bin", 10, True), ("", 10, False), ("v.bin", 0, False),
                                  (None, 10, False)]:
        task = loop_tasks.Validation(NS(input_val_bin=path, val_every=every), None)
        assert task.on is expected and task.due(0, False) is expected


# ---------------------------------------------------------------------- rewind

class RewindCkpt(Recorder):
    def __init__(self, target, rank=0):
        super().__init__()
        self.target, self.rank, self.world = target, rank, 1
        self.flat = NS(params=torch.zeros(1))

    def rewind_target(self, spike_start, safety_steps):
        self.calls.append(("rewind_target", (spike_start, safety_steps), {}))
        return self.target


def rewind_run(target, *, max_rewinds=5):
    cfg = TrainConfig(spike=SpikeConfig(enabled=True, safety_steps=2, max_rewinds=max_rewinds))
    state = TrainState(step=40)
    state.spike_samples = [np.array([[0, 5], [0, 6]])]
    return NS(cfg=cfg, state=state, ckpt=RewindCkpt(target), runlog=Recorder(),
              train_loader="loader", resumed_from=None)


def rewind(r, step, verdict, step_samples):
    """loop.rewind with the stand-in run's parts; the step it returns as the loop keeps it."""
    r.resumed_from = loop.rewind(r.cfg, r.state, r.ckpt, r.runlog, r.train_loader, step, verdict,
                                 step_samples)


def test_a_rewind_goes_to_the_target_before_the_spike_and_skips_its_data():
    r = rewind_run(target=30)
    verdict = Verdict("rewind", 25.0, 1.0, "hard z", spike_start=38)
    rewind(r, 40, verdict, [np.array([[0, 7]])])
    window = [(0, 5, 8)]
    assert r.ckpt.calls[0] == ("wait_and_publish", (), {})  # before choosing: a pending one counts
    assert r.ckpt.calls[1] == ("rewind_target", (38, 2), {})
    assert r.ckpt.calls[2] == ("rewind_to", (30, r.state, "loader", window), {})
    assert r.state.ledger.rewinds == 1 and r.state.ledger.history[0].region_start == 38
    assert r.state.ledger.history[0].skipped_ranges == window
    assert r.runlog.calls[0] == ("rewind", (40, verdict),
                                 dict(target=30, window=window, lr_scale=1.0, rewinds=1))
    assert r.runlog.calls[1] == ("restart_at", (40,), {})  # the stand-in checkpoint moves nothing
    assert r.resumed_from == 40


def test_a_rewind_without_a_spike_start_begins_at_this_step():
    r = rewind_run(target=30)
    rewind(r, 40, Verdict("rewind", 25.0, 1.0, "hard z"), [np.array([[0, 7]])])
    assert r.ckpt.calls[1] == ("rewind_target", (40, 2), {})
    assert r.state.ledger.history[0].region_start == 40


def test_no_checkpoint_to_rewind_to_stops_the_run_saying_why():
    r = rewind_run(target=None)
    with pytest.raises(TrainingStopped) as e:
        rewind(r, 40, Verdict("rewind", 25.0, 1.0, "hard z", spike_start=38), [])
    assert str(e.value) == ("step 40: hard z; stopping: no verified checkpoint at or before step "
                            "36 to rewind to (the spike began at step 38)")
    assert [c[0] for c in r.ckpt.calls] == ["wait_and_publish", "rewind_target"]
    assert r.runlog.calls[0][2]["target"] is None  # the decision is logged before stopping


def test_the_ledgers_escalation_stops_the_run_before_any_rewind():
    r = rewind_run(target=30, max_rewinds=0)
    with pytest.raises(TrainingStopped, match=r"^step 40: hard z; stopping: spike policy: rewind 1"):
        rewind(r, 40, Verdict("rewind", 25.0, 1.0, "hard z", spike_start=38), [])
    assert "rewind_to" not in [c[0] for c in r.ckpt.calls]


def test_an_escalate_verdict_stops_with_its_own_reason():
    r = rewind_run(target=30)
    with pytest.raises(TrainingStopped) as e:
        rewind(r, 40, Verdict("escalate", 25.0, 1.0, "too many", spike_start=38), [])
    assert str(e.value) == "step 40: too many; stopping: too many"
    assert "rewind_to" not in [c[0] for c in r.ckpt.calls]


def test_only_rank_0_chooses_the_target(monkeypatch):
    r = rewind_run(target=30)
    r.ckpt.rank, r.ckpt.world = 1, 2
    fake = two_ranks(monkeypatch, [0.0])
    with pytest.raises(TrainingStopped):  # rank 0 (the stand-in broadcast) sent no step
        rewind(r, 40, Verdict("rewind", 25.0, 1.0, "hard z", spike_start=38), [])
    assert "rewind_target" not in [c[0] for c in r.ckpt.calls]
    assert fake.calls == [("broadcast", -1)]
