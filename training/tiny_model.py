"""Build a tiny Qwen2-style causal LM and BPE tokenizer, offline, in seconds.

    rlfleet-tiny-model OUTPUT_DIR        (or: python -m training.tiny_model OUTPUT_DIR)

It knows nothing, which is the point: tests and demos train it with GRPO on a CPU and watch
the reward rise, without downloading a real model.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from training.make_dataset import make_rows

EOS, PAD, IM_START = "<|im_end|>", "<|endoftext|>", "<|im_start|>"

# ChatML, as Qwen uses, so conversational prompts go through the same path as with real models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a is of and to in what answer think so first then sum total result plus minus times "
    "equals number user assistant system question reasoning hello world yes no cat dog sun moon "
    "blue red green apple tree river music happy"
)


def corpus() -> Iterator[str]:
    """Text the tokenizer learns its merges from: arithmetic problems, tags, a few words."""
    for row in make_rows(400, seed=1):
        yield row["question"]
        yield row["answer"]
    for _ in range(20):  # Often enough that every word becomes one token.
        yield f"{_WORDS}. {_WORDS.title()}."
    yield "<think>\nreasoning\n</think>\n<answer>\n42\n</answer>"


def build_tokenizer(vocab_size: int = 512):  # type: ignore[no-untyped-def]
    """A byte-level BPE tokenizer (any text encodes) wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, pad_token=PAD, bos_token=None, unk_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(vocab_size: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """A randomly initialised Qwen2 causal LM with a few hundred thousand parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config)


def save_tiny_model(output_dir: str | Path, seed: int = 0) -> Path:
    """Build the tokenizer and model and save both to output_dir; returns the directory."""
    out = Path(output_dir)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """Console entry point: `rlfleet-tiny-model OUTPUT_DIR`."""
    parser = argparse.ArgumentParser(prog="rlfleet-tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="directory to write the model and tokenizer to")
    parser.add_argument(
        "--seed", type=int, default=0, help="weight initialisation seed (default: 0)"
    )
    args = parser.parse_args(argv)
    out = save_tiny_model(args.output_dir, args.seed)
    config = json.loads((out / "config.json").read_text())
    print(
        f"tiny Qwen2 model (vocab {config['vocab_size']}, "
        f"{config['num_hidden_layers']} layers) saved to {out}"
    )


if __name__ == "__main__":
    main()
