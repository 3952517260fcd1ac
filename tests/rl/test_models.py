"""The tiny model builder and the HF loaders (CPU, fast, no downloads).

Run: python -m pytest tests/rl/test_models.py -q
"""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from rl_extension.data.prompts import make_sorting_dataset
from rl_extension.models import (
    CHAT_TEMPLATE,
    MIN_HEAD_DIM,
    build_tiny_model,
    build_tiny_tokenizer,
    load_causal_lm,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def test_builder_writes_a_standard_hf_checkpoint(tiny_path):
    files = set(os.listdir(tiny_path))
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = model.config
    assert config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads >= MIN_HEAD_DIM
    assert config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.eos_token_id in model.generation_config.eos_token_id
    # Portable: transformers 4.x reads the class name and the chat template from here.
    tokenizer_config = json.loads(open(os.path.join(tiny_path, "tokenizer_config.json")).read())
    assert tokenizer_config["tokenizer_class"] == "Qwen2Tokenizer"
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE


def test_loaded_model_runs_and_generates_with_left_padding(tiny_path):
    model, tokenizer = load_causal_lm(tiny_path), load_tokenizer(tiny_path)
    assert model.dtype == torch.float32
    enc = tokenizer(["1+2=", "123+456="], return_tensors="pt", padding=True)
    assert enc["attention_mask"][0, 0] == 0 and enc["attention_mask"][0, -1] == 1  # left padded
    logits = model(**enc).logits
    assert logits.shape == (2, enc["input_ids"].shape[1], model.config.vocab_size)
    out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 2 and out.shape[1] <= enc["input_ids"].shape[1] + 5


@pytest.mark.parametrize(
    "text",
    [
        "123+456=579",
        "sort: 53 12 87 41 = 12 41 53 87",
        "Natalia sold 48/2 = 24 clips.\n#### 72",
        "a-b*c/(d%e)! ^ [x] {y} <z> 'q' \"r\" ~`|\\@$&?.,;:_\t",
    ],
)
def test_tokenizer_round_trips_task_strings_one_token_per_char(tiny_path, text):
    tokenizer = load_tokenizer(tiny_path)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # character level, no bos added
    assert tokenizer.decode(ids) == text
    # Whichever class loads it (transformers 5 picks Qwen2Tokenizer for a qwen2 checkpoint), the
    # tokenization is the in-memory one's.
    assert build_tiny_tokenizer()(text)["input_ids"] == ids
    assert PreTrainedTokenizerFast.from_pretrained(tiny_path)(text)["input_ids"] == ids


def test_sorting_answers_are_long_enough(tiny_path, tmp_path):
    import pyarrow.parquet as pq

    tokenizer = load_tokenizer(tiny_path)
    rows = pq.read_table(make_sorting_dataset(tmp_path / "s.parquet", n=20)).to_pylist()
    assert min(len(tokenizer(row["answer"])["input_ids"]) for row in rows) >= 32


def test_special_tokens_and_padding_defaults(tiny_path):
    tokenizer = load_tokenizer(tiny_path)
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    ids = tokenizer("7<|endoftext|>")["input_ids"]
    assert ids == [tokenizer.convert_tokens_to_ids("7"), tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "7"
    assert tokenizer.decode(tokenizer("é1")["input_ids"]) == "1"  # non-ASCII is dropped


def test_chat_template(tiny_path):
    tokenizer = load_tokenizer(tiny_path)
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == text
    no_prompt = tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\n1+2=<|im_end|>\n"


def test_builder_is_idempotent_and_rebuilds_on_new_arguments(tmp_path):
    path = build_tiny_model(tmp_path / "m", num_layers=1)
    weights = os.path.join(path, "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    assert build_tiny_model(tmp_path / "m", num_layers=1) == path
    assert os.stat(weights).st_mtime_ns == stamp  # untouched
    build_tiny_model(tmp_path / "m", num_layers=2)
    assert load_causal_lm(path).config.num_hidden_layers == 2
    assert [p for p in os.listdir(tmp_path) if p != "m"] == []  # no temporary directories left


def test_builder_is_deterministic_by_seed(tmp_path):
    a = load_causal_lm(build_tiny_model(tmp_path / "a", num_layers=1, seed=3)).state_dict()
    b = load_causal_lm(build_tiny_model(tmp_path / "b", num_layers=1, seed=3)).state_dict()
    c = load_causal_lm(build_tiny_model(tmp_path / "c", num_layers=1, seed=4)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_builder_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="head dim"):
        build_tiny_model(tmp_path / "x", hidden_size=128, num_heads=8)
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_model(tmp_path / "x", hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path / "x", vocab_size=50)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="does not hold a tiny model"):
        build_tiny_model(tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").exists()


def test_load_tokenizer_uses_eos_when_pad_is_missing(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path, padding_side="right")
    assert loaded.pad_token == loaded.eos_token and loaded.padding_side == "right"


def test_load_causal_lm_dtype(tiny_path):
    assert load_causal_lm(tiny_path, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not a torch dtype"):
        load_causal_lm(tiny_path, dtype="float33")
