"""Bad input fails at once with one line naming the key or the path, before torch loads or a worker starts.

The checks of rl_extension.data.inputs run in this process; the CLI cases run `spmdcall-rl` in a
subprocess each (well under a second apiece: no torch, no worker) and check that the output is one
line, that torch was never imported and that nothing was written to the run dir.

Run: python -m pytest tests/rl/test_bad_input.py -q
"""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_extension.config import PPOConfig, SFTConfig, load_config
from rl_extension.data.inputs import check_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def files(tmp_path):
    """A checkpoint-less directory, a plain file and data files with and without the expected columns."""
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / "broken.parquet").write_text("not parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}]), tmp_path / "good.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"question": "1+1=", "answer": "2"}]), tmp_path / "no_prompt.parquet"
    )
    nested = [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}]
    pq.write_table(pa.Table.from_pylist(nested), tmp_path / "nested.parquet")
    (tmp_path / "nested.jsonl").write_text(json.dumps(nested[0]) + "\n")
    return tmp_path


@pytest.mark.parametrize(
    "cls, preset, overrides, message",
    [
        (PPOConfig, "tiny-cpu", ["model.path=/no/such/model"], "model.path='/no/such/model': no such directory "
         r"\(/no/such/model\), and it is not a Hub name of the form namespace/name"),
        (SFTConfig, "sft-tiny-cpu", ["model.path={tmp}/empty_dir"], "model.path=.*empty_dir.* holds no config.json"),
        (PPOConfig, "tiny-cpu", ["model.tokenizer_path={tmp}/a/b"], r"model.tokenizer_path=.*a/b'.*no such directory"),
        (PPOConfig, "tiny-cpu", ["actor.use_kl_loss=true", "ref.path={tmp}/notes.txt"], "ref.path=.*notes.txt.* is a file"),
        (PPOConfig, "tiny-cpu-ppo", ["critic.path=./nope"], r"critic.path='./nope': no such directory"),
        (PPOConfig, "tiny-cpu", ["reward.model_path={tmp}/empty_dir"], "reward.model_path=.* holds no config.json"),
        (PPOConfig, "tiny-cpu", ["data.train_files=[{tmp}/nope.parquet]"], r"data.train_files\[0\]=.*nope.parquet': no such file"),
        (SFTConfig, "sft-tiny-cpu", ["data.val_files=[{tmp}/good.parquet, {tmp}/empty_dir]"], r"data.val_files\[1\]=.* is a directory"),
        (PPOConfig, "tiny-cpu", ["data.train_files=[{tmp}/notes.txt]"], r"data.train_files\[0\]=.*expected a .parquet or .jsonl"),
        (PPOConfig, "tiny-cpu", ["data.train_files=[{tmp}/broken.parquet]"], "broken.parquet': cannot read it as parquet"),
        (PPOConfig, "tiny-cpu", ["data.train_files=[{tmp}/no_prompt.parquet]"],
         r"no_prompt.parquet' has no column 'prompt' \(data.prompt_key\); its columns: answer, question"),
        (PPOConfig, "tiny-cpu", ["data.train_files=[{tmp}/nested.jsonl]", "data.answer_key=reward_model.answer"],
         r"has no column 'reward_model.answer' \(data.answer_key\)"),
    ],
)  # fmt: skip
def test_a_missing_checkpoint_or_data_file_names_its_key_and_path(files, cls, preset, overrides, message):
    config = load_config(cls, preset, [o.format(tmp=files) for o in overrides])
    with pytest.raises(ValueError, match=message):
        check_inputs(config)


def test_inputs_that_exist_pass(files):
    nested = ["data.answer_key=reward_model.ground_truth"]
    check_inputs(load_config(PPOConfig, "tiny-cpu", [f"data.train_files=[{files}/nested.parquet]", *nested]))
    check_inputs(
        load_config(SFTConfig, "sft-tiny-cpu", [f"data.train_files=[{files}/nested.jsonl]", *nested])
    )
    check_inputs(
        load_config(
            PPOConfig, "tiny-cpu", [f"model.path={files}/model", f"data.val_files=[{files}/good.parquet]"]
        )
    )
    # ref.path is unused without a KL term (validate warns that it is ignored): it is not checked.
    with pytest.warns(UserWarning, match="ref.path ignored"):
        check_inputs(load_config(PPOConfig, "tiny-cpu", ["ref.path=/no/such/ref"]))


def test_a_hub_name_that_is_not_a_directory_fails_at_once_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config(PPOConfig, "tiny-cpu", ["model.path=sft/hf_model"])
    with pytest.raises(ValueError, match=r"model.path='sft/hf_model': no such directory \(.*sft/hf_model\), "
                       "and the Hub model 'sft/hf_model' is not in the local cache \\(HF_HUB_OFFLINE is set\\)"):  # fmt: skip
        check_inputs(config)


def _cli(tmp_path, *args, env=None):
    """Run spmdcall-rl; returns (exit code, output lines, whether torch was imported)."""
    flag = tmp_path / "torch_imported"
    code = (
        "import atexit, sys\n"
        f"atexit.register(lambda: open({str(flag)!r}, 'w').write(str('torch' in sys.modules)))\n"
        "from rl_extension.app.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, (done.stdout + done.stderr).splitlines(), flag.read_text() == "True"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, env, message",
    [
        (["train", "preset=tiny-cpu", "actor.lr=-1e-4"], {}, "config error: actor.lr must be >= 0, got -0.0001"),
        (["train", "preset=tiny-cpu-ppo", "critic.lr=-1"], {}, "config error: critic.lr must be >= 0, got -1.0"),
        (["sft", "preset=sft-tiny-cpu", "lr=-1"], {}, "config error: lr must be >= 0, got -1.0"),
        (["train", "preset=tiny-cpu", "rollout.n=0"], {}, "config error: rollout.n must be >= 1, got 0"),
        (["train", "preset=tiny-cpu", "model.path=/no/such/model"], {}, "error: model.path='/no/such/model': no such directory"),
        (["train", "preset=tiny-cpu", "model.path=sft/hf_model"], {"HF_HUB_OFFLINE": "1"}, "error: model.path='sft/hf_model': no such directory .*HF_HUB_OFFLINE"),
        # No network: the one Hub lookup is refused at once (HF_ENDPOINT points at a closed local port).
        (["train", "preset=tiny-cpu", "model.path=sft/hf_model"], {"HF_ENDPOINT": "http://127.0.0.1:9"},
         r"error: model.path='sft/hf_model': no such directory .*, and the Hub \(http://127.0.0.1:9\) cannot be reached"),
        (["sft", "preset=sft-tiny-cpu", "data.train_files=[nope.jsonl]"], {}, r"error: data.train_files\[0\]='nope.jsonl': no such file"),
        (["train", "preset=tiny-cpu", "imports=[my_estimators]"], {}, r"config error: imports: no module named 'my_estimators' on sys.path \(give a file by its path, e.g. ./my_estimators.py, or set PYTHONPATH\)"),
        (["train", "preset=tiny-cpu", "algorithm.adv_estimator=mine"], {}, r"config error: algorithm.adv_estimator: unknown advantage estimator 'mine'; expected one of \[.*\] \(a name your own code registers needs its module in imports"),
    ],
)  # fmt: skip
def test_cli_reports_bad_input_in_one_line_before_torch_loads(tmp_path, args, env, message):
    import re

    run_dir = tmp_path / "run"
    where = "output_dir" if args[0] == "sft" else "trainer.run_dir"
    code, lines, torch_imported = _cli(tmp_path, *args, f"{where}={run_dir}", env=env)
    assert code == 1 and len(lines) == 1, lines
    assert re.search(f"^spmdcall-rl: {message}", lines[0]), lines[0]
    assert not torch_imported
    assert not run_dir.exists()  # nothing written: no config.yaml, no tiny model, no data


@pytest.mark.timeout(120)
def test_a_problem_met_while_building_the_run_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    """All prompts longer than data.max_prompt_length: found while reading the data, before any worker starts."""
    from rl_extension.app.cli import main

    args = [
        "train",
        "preset=tiny-cpu",
        f"trainer.run_dir={tmp_path / 'run'}",
        "data.max_prompt_length=2",
        "data.synthetic.num_train=20",
        "data.synthetic.num_val=4",
    ]
    with pytest.raises(SystemExit) as exited:
        main(args)
    message = str(exited.value)
    assert "\n" not in message and message.startswith("spmdcall-rl: error: no prompts left in")
    assert "max_prompt_length=2" in message and message.endswith("(--debug shows the traceback)")
    with pytest.raises(ValueError, match="no prompts left"):
        main([*args, "trainer.overwrite=true", "--debug"])


def test_a_worker_that_fails_to_start_is_reported_by_rank_in_one_line():
    import spmdcall as sc
    from rl_extension.app.cli import _one_line_errors

    remote = (
        'Traceback (most recent call last):\n  File "x.py", line 1\nOSError: no model.safetensors in /m\n'
    )
    with pytest.raises(SystemExit) as exited, _one_line_errors(debug=False):
        raise sc.WorkerError(1, "__init__", remote, "OSError")
    assert str(exited.value) == (
        "spmdcall-rl: error: rank 1 raised in __init__(): OSError: no model.safetensors in /m "
        "(--debug shows the traceback)"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["config", "preset=sft-tiny-cpu"], "'sft-tiny-cpu' is an SFT preset: run spmdcall-rl sft preset=sft-tiny-cpu (spmdcall-rl config --sft to print it)"),
        (["train", "preset=sft-tiny-cpu"], "'sft-tiny-cpu' is an SFT preset: run spmdcall-rl sft preset=sft-tiny-cpu"),
        (["sft", "preset=tiny-cpu"], "'tiny-cpu' is a GRPO/PPO preset: run spmdcall-rl train preset=tiny-cpu"),
        (["config", "--sft", "preset=tiny-cpu"], "'tiny-cpu' is a GRPO/PPO preset: run spmdcall-rl train preset=tiny-cpu (spmdcall-rl config without --sft to print it)"),
    ],
)  # fmt: skip
def test_a_preset_given_to_the_wrong_command_says_which_command_takes_it(args, message):
    from rl_extension.app.cli import main

    with pytest.raises(SystemExit) as exited:
        main(args)
    text = str(exited.value)
    assert text.startswith("spmdcall-rl: config error: unknown config key") and text.endswith(message), text


def test_each_demo_task_has_its_own_default_run_directory(monkeypatch):
    import rl_extension.app.cli as cli

    seen = []
    monkeypatch.setattr(cli, "run_demo", lambda out, **kwargs: seen.append(str(out)))
    for args in (
        ["demo"],
        ["demo", "--task", "calc"],
        ["demo", "--task", "calc", "--no-tool", "--seed", "2"],
    ):
        assert cli.main(args) == 0
    assert seen == ["runs/demo-seed0", "runs/demo-calc-seed0", "runs/demo-calc-notool-seed2"]
