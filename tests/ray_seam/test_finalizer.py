"""The driver's checkpoint finalizer (raygpt.ray.driver.CheckpointFinalizer, FinalizerDrain):
Ray's controller hands it the ranks' reports; it finalizes off the controller's thread, and the
controller's end waits for it."""

from raygpt.checkpointing.protocol import MANIFEST, state_file, step_dir, verify_checkpoint
from raygpt.storage import open_run_dir
from tests.checkpointing.test_protocol import _meta, _upload_without_done


def test_the_finalizer_hands_the_work_off_the_controller_and_the_drain_waits_for_it(
        tmp_path, monkeypatch):
    """Ray's controller calls after_report synchronously: it must return while storage is
    still being written, and FinalizerDrain (the controller's end) must wait for DONE/MANIFEST."""
    import threading

    from raygpt.ray import driver

    rd = open_run_dir(tmp_path / "run")
    hashes = _upload_without_done(rd, 30)
    release, started = threading.Event(), threading.Event()
    real = driver.finalize_checkpoint

    def slow(*a, **kw):  # storage that takes its time
        started.set()
        assert release.wait(30)
        return real(*a, **kw)
    monkeypatch.setattr(driver, "finalize_checkpoint", slow)

    class Ckpt:
        path = str(tmp_path / "run" / step_dir(30))

    fin = driver.CheckpointFinalizer(str(tmp_path / "run"))
    metrics = [{"raygpt_files": {k: v for k, v in hashes.items() if k != state_file(30, 1)},
                "raygpt_manifest": _meta(30, "t")},
               {"raygpt_files": {state_file(30, 1): hashes[state_file(30, 1)]}}]
    fin.after_report(None, metrics, Ckpt())  # returns although the finalization is blocked
    assert started.wait(10) and not rd.exists(f"{step_dir(30)}/{MANIFEST}")
    drain = threading.Thread(target=driver.FinalizerDrain().after_controller_finish, args=(None,))
    drain.start()
    drain.join(0.5)
    assert drain.is_alive()  # the controller's end waits for the pending checkpoint
    release.set()
    drain.join(30)
    assert not drain.is_alive()
    assert verify_checkpoint(rd, 30) == []
    # and the trainer gives the drain to every controller (Ray's own defaults stubbed out)
    base = next(k for k in driver.RaygptTrainer.__mro__[1:] if "_create_default_callbacks" in vars(k))
    monkeypatch.setattr(base, "_create_default_callbacks", lambda self: [])
    callbacks = object.__new__(driver.RaygptTrainer)._create_default_callbacks()
    assert any(isinstance(c, driver.FinalizerDrain) for c in callbacks)
