"""Ctrl-C in ``spmdcall-rl demo`` and ``train``: one line (what stopped, the last checkpoint, how to go on),
exit status 130, no traceback, and no worker process left behind; ``--debug`` shows the traceback.

The process cases start the real CLI in a fresh interpreter, wait until a stage has begun, and send
SIGINT to it as a terminal's Ctrl-C does: during the demo's SFT, and during training. The demo's other
moments (its set-up, its GRPO) go through the same handler, checked in-process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from procs import with_sigint
from test_demo import SFT

from rl_extension.app.demo import Interrupted

ROOT = Path(__file__).resolve().parents[2]
# test_demo's 2-layer, 64-wide model, and SFT without evaluations or an early stop.
TINY_SFT = [f"sft.{o}" for o in SFT if o.startswith("model.")] + [
    "sft.eval_every=0",
    "sft.stop_at_accuracy=0",
]
TINY_GRPO = [
    "trainer.log_every=1",  # a line per step: the test waits for the first one
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "trainer.save_every=5",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
]


def _interrupt(
    args: list[str], started: str, after_s: float, tmp_path: Path
) -> tuple[int, str, str, list[int]]:
    """Run ``spmdcall-rl ARGS``, wait for ``started`` in its output (then ``after_s``), Ctrl-C it.
    Returns its exit status, output, errors and the pids of the workers it had started."""
    out_file, err_file = tmp_path / "out.txt", tmp_path / "err.txt"
    with out_file.open("w") as out, err_file.open("w") as err:
        proc = subprocess.Popen(
            with_sigint("-m", "rl_extension", *args),  # as from a terminal, however the tests run
            cwd=tmp_path,
            # faulthandler: a child that does not end after Ctrl-C is aborted below, and the
            # tracebacks of its threads land in its errors, which the failure shows
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"},
            stdout=out,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + 150
            while started not in out_file.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, out_file.read_text()[-2000:] + err_file.read_text()[-2000:]
                time.sleep(0.2)
            assert started in out_file.read_text(), f"{started!r} never printed"
            time.sleep(after_s)
            workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)
                proc.wait(timeout=30)
                raise AssertionError(
                    "no exit within 60 s of Ctrl-C; its threads then:\n" + err_file.read_text()[-6000:]
                ) from None
        finally:
            if proc.poll() is None:
                proc.kill()
    return code, out_file.read_text(), err_file.read_text(), workers


def _gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(240)
def test_ctrl_c_in_the_demos_sft_is_one_line_and_leaves_no_worker(tmp_path):
    args = ["demo", "--out", "demo", *TINY_SFT, "sft.total_steps=400", *TINY_GRPO, "trainer.total_steps=400"]
    code, out, err, workers = _interrupt(args, "[demo 2/4]", 4.0, tmp_path)
    assert code == 130, out[-2000:] + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        "spmdcall-rl: interrupted during the demo's SFT, which writes its model only at the end"
    )
    assert line.endswith("go on with: spmdcall-rl demo " + " ".join(args[1:]) + " --resume"), line
    assert workers and _gone(workers), f"workers left running after Ctrl-C: {workers}"


@pytest.mark.parametrize(
    ("raised", "says"),
    [
        (KeyboardInterrupt(), "while the demo was setting up"),
        (
            Interrupted("during the demo's GRPO, at step 7 of 400; last checkpoint x"),
            "during the demo's GRPO, at step 7",
        ),
    ],
)
def test_ctrl_c_at_other_moments_of_the_demo_and_debug(monkeypatch, capsys, raised, says):
    """The demo's other moments (set-up, GRPO) in-process: one line, status 130; --debug re-raises."""
    import rl_extension.app.cli as cli

    def interrupted(out, **kwargs):
        raise raised

    monkeypatch.setattr(cli, "run_demo", interrupted)
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--seed", "1"])
    assert exited.value.code == 130
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"spmdcall-rl: interrupted {says}") and "\n" not in line, line
    assert line.endswith("; go on with: spmdcall-rl demo --seed 1 --resume"), line
    with pytest.raises(KeyboardInterrupt):
        cli.main(["demo", "--seed", "1", "--debug"])


@pytest.mark.timeout(240)
def test_ctrl_c_in_train_names_the_step_and_the_checkpoint_and_leaves_no_worker(tmp_path):
    args = [
        "train",
        "preset=tiny-cpu",
        "model.path=tiny",
        "trainer.run_dir=run",
        "trainer.total_steps=400",
        "trainer.log_every=1",
        "data.synthetic.num_train=200",
        "data.synthetic.num_val=8",
        *TINY_GRPO,
    ]
    code, out, err, workers = _interrupt(args, "step 7 ", 0.0, tmp_path)
    assert code == 130 and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("spmdcall-rl: interrupted at step ") and " of 400; last checkpoint " in line, line
    assert line.endswith(
        f"resume with: spmdcall-rl train preset={tmp_path / 'run' / 'config.yaml'} trainer.resume=true"
    )
    assert "step_000005" in line and _gone(workers)
