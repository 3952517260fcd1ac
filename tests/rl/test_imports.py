"""A user's extensions from the command line: the config's ``imports`` are imported before its names
are checked, in the controller, and their functions reach the workers.

The end-to-end case runs ``spmdcall-rl train`` in a fresh interpreter, as a new user would, with an
estimator and a policy loss from a file of the test's own; each marks where it ran.

Run: python -m pytest tests/rl/test_imports.py -q
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_extension.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rl_extension.algorithms.policy_losses import POLICY_LOSSES
from rl_extension.config import PPOConfig, SFTConfig, load_config
from rl_extension.models import build_tiny_model
from rl_extension.user_code import import_modules

ROOT = Path(__file__).resolve().parents[2]

# An estimator (GRPO's advantages) and a policy loss (REINFORCE) that append the pid of the process
# they ran in to a file of MARKS each: the estimator runs in the controller, the loss in the actor's ranks.
PLUGIN = """
import os

from rl_extension.algorithms.advantages import compute_grpo_outcome_advantage, register_adv_estimator
from rl_extension.algorithms.policy_losses import register_policy_loss

MARKS = {marks!r}


def _mark(what):
    with open(os.path.join(MARKS, what), "a") as f:
        f.write(f"{{os.getpid()}}\\n")


@register_adv_estimator("marked_grpo", inputs=("token_level_rewards", "response_mask", "index"), needs_groups=True)
def marked_grpo(token_level_rewards, response_mask, index):
    _mark("estimator")
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index)


@register_policy_loss("marked_pg", metrics=("marked",))
def marked_pg(old_log_prob, log_prob, advantages, response_mask):
    import torch

    _mark("loss")
    loss = -(advantages * log_prob * response_mask).sum() / response_mask.sum()
    return loss, torch.tensor(1.0)
"""


@pytest.fixture
def plugin(tmp_path):
    """The plugin file, ``tmp_path/plugins/<unique>.py`` (one module name per test), and its marks folder."""
    marks = tmp_path / "marks"
    marks.mkdir()
    path = tmp_path / "plugins" / f"marked_{tmp_path.name.replace('-', '_')}.py"
    path.parent.mkdir()
    path.write_text(PLUGIN.format(marks=str(marks)))
    yield path, marks
    # what the plugin registered goes too: the registries are this process's, and other tests
    # list what they hold
    ADVANTAGE_ESTIMATORS.pop("marked_grpo", None)
    POLICY_LOSSES.pop("marked_pg", None)
    sys.modules.pop(path.stem, None)
    if str(path.parent) in sys.path:
        sys.path.remove(str(path.parent))


def _pids(marks: Path, what: str) -> set[int]:
    file = marks / what
    return set(map(int, file.read_text().split())) if file.exists() else set()


@pytest.mark.timeout(300)
def test_cli_trains_with_an_estimator_and_a_loss_of_a_users_file(tmp_path, plugin):
    path, marks = plugin
    model = build_tiny_model(
        tmp_path / "model", num_layers=1, hidden_size=32, num_heads=1, intermediate_size=64
    )
    args = [
        "train",
        "preset=tiny-cpu",
        f"model.path={model}",
        "trainer.run_dir=run",
        f"imports=[{path.relative_to(tmp_path)}]",  # a path, relative to the current directory
        "algorithm.adv_estimator=marked_grpo",
        "actor.policy_loss=marked_pg",
        "data.synthetic.num_train=40",
        "data.synthetic.num_val=4",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=2",
        "trainer.total_steps=2",
        "trainer.num_workers=1",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "trainer.save_every=0",
        "trainer.loggers=[jsonl]",
        "trainer.progress=none",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "rl_extension", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    estimator, loss = _pids(marks, "estimator"), _pids(marks, "loss")
    assert len(estimator) == 1 and (marks / "estimator").read_text().count("\n") == 2  # once a step
    assert loss and not loss & estimator  # in the actor's rank, which imported the module by itself
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["actor/marked"] for s in steps if "actor/marked" in s] == [1.0, 1.0]
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "imports: [plugins/" in saved and "adv_estimator: marked_grpo" in saved


def test_a_yaml_preset_lists_imports_and_sft_takes_them_too(tmp_path, plugin):
    path, _ = plugin
    preset = tmp_path / "mine.yaml"
    preset.write_text(f"base: tiny-cpu\nimports:\n  - {path}\nalgorithm:\n  adv_estimator: marked_grpo\n")
    config = load_config(PPOConfig, str(preset))
    assert config.imports == [str(path)] and config.algorithm.adv_estimator == "marked_grpo"
    assert sys.modules[path.stem].__file__ == str(path)
    sft = load_config(SFTConfig, "sft-tiny-cpu", [f"imports=[{path}]"])
    assert sft.imports == [str(path)]


def test_imports_by_module_name_and_twice():
    (json_module,) = import_modules(["json"])
    assert json_module is json and import_modules(["json"]) == [json]
    assert load_config(PPOConfig, "tiny-cpu", ["imports=[json, os.path]"]).imports == ["json", "os.path"]


@pytest.mark.parametrize(
    "imports, message",
    [
        ("[no_such_module]", r"imports: no module named 'no_such_module' on sys.path \(give a file by its path, e.g. ./no_such_module.py"),
        ("[json.no_such]", r"imports: no module named 'json.no_such' on sys.path"),
        ("[plugins/missing.py]", r"imports: 'plugins/missing.py' is not a .py file \(.*plugins/missing.py does not exist\)"),
    ],
)  # fmt: skip
def test_a_module_that_is_not_there_is_named(imports, message):
    with pytest.raises(ValueError, match=message):
        load_config(PPOConfig, "tiny-cpu", [f"imports={imports}"])


def test_a_file_that_fails_to_import_or_clashes_is_named(tmp_path):
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("raise RuntimeError('half-written')\n")
    with pytest.raises(
        ValueError, match=r"imports: importing '.*broken_plugin.py' raised RuntimeError: half-written"
    ):
        import_modules([str(broken)])
    clash = tmp_path / "json.py"
    clash.write_text("")
    with pytest.raises(
        ValueError,
        match=r"imports: '.*json.py' would be the module 'json', which is .*json/__init__.py already",
    ):
        import_modules([str(clash)])
    named = tmp_path / "not-a-name.py"
    named.write_text("")
    with pytest.raises(ValueError, match=r"'not-a-name' is not a module name"):
        import_modules([str(named)])


def test_a_name_the_imports_do_not_register_says_where_names_come_from(plugin):
    path, _ = plugin
    with pytest.raises(
        ValueError,
        match=r"actor.policy_loss: unknown policy loss 'marked'; expected one of \[.*'marked_pg'.*\] "
        r"\(a name your own code registers needs its module in imports=\[...\]\)",
    ):
        load_config(PPOConfig, "tiny-cpu", [f"imports=[{path}]", "actor.policy_loss=marked"])
