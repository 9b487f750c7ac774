"""Test-only entry point: ``python -m tests.msa_train.faults FAULT -- msa-train args``, the CLI with a
fault patched in (the shipped code has no fault hooks).

FAULT is one of:
  ``sigkill-in-save=STEP``     SIGKILL rank 0 in the middle of step STEP's checkpoint write: every file
                               written and hashed, before the manifest, the marker and the rename;
  ``sigterm-at=STEP:RANK``     that rank sends itself SIGTERM at the end of step STEP;
  ``nan-at=STEP``              the loss of every micro step from step STEP on is NaN.
"""
import os
import signal
import sys


def _patch(fault: str) -> None:
    name, _, value = fault.partition("=")
    if name == "sigkill-in-save":
        from msa_train.checkpoint import CheckpointManager

        publish = CheckpointManager._publish

        def killing_publish(self, tmp, final, step, files):
            if step == int(value):
                os.kill(os.getpid(), signal.SIGKILL)
            publish(self, tmp, final, step, files)

        CheckpointManager._publish = killing_publish
    elif name == "sigterm-at":
        from msa_train.preemption import StopSignals

        at = tuple(int(x) for x in value.split(":"))
        requested = StopSignals.requested

        def signalling_requested(self, step):
            if (step, self.rank) == at:
                os.kill(os.getpid(), signal.SIGTERM)
            return requested(self, step)

        StopSignals.requested = signalling_requested
    elif name == "nan-at":
        from msa_train.trainer import Trainer

        forward = Trainer._forward

        def nan_forward(self, m, **kwargs):
            out = forward(self, m, **kwargs)
            return out * float("nan") if self.module.training and self.step + 1 >= int(value) else out

        Trainer._forward = nan_forward
    else:
        raise SystemExit(f"tests.msa_train.faults: unknown fault {fault!r}")


if __name__ == "__main__":
    split = sys.argv.index("--")
    for fault in sys.argv[1:split]:
        _patch(fault)
    sys.argv[1:] = sys.argv[split + 1:]
    from msa_train.cli import main

    main()
