"""A tiny LLaVA-style multimodal model that real vLLM serves on CPU in a few seconds.

    tiny_model_path()                           # cached folder, built if needed
    python -m epd_dev.vllm.tiny_model           # same, prints the folder
    <serving python> tiny_model.py --out D      # the build itself, in the serving venv

Random weights from a fixed seed, a byte-level BPE tokenizer trained here on a fixed text,
no hub download. The cache key hashes this file (the recipe) and the serving venv it is
built with, so any change here rebuilds it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

SEED = 1234
SERVED_NAME = "tiny-llava"
IMAGE_SIZE, PATCH = 56, 14
# 4x4 patches; "default" drops CLIP's CLS token.
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<image>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['role'] }}:"
    "{% if message['content'] is string %} {{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url'] %}<image>"
    "{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Fixed training text for the tokenizer: enough variety for 512 tokens of merges.
CORPUS = [
    "The quick brown fox jumps over the lazy dog while an encoder primes the image.",
    "Encoder prefill disaggregation sends image embeddings from one engine to another.",
    "user: describe this picture. assistant: a small red square on a white ground.",
    "Colours: red green blue cyan magenta yellow black white grey orange purple.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 512 1024 and punctuation , . ; : ! ? ( ) [ ] { }",
    "Kubernetes operators reconcile custom resources into pods, services and config maps.",
] * 8


def _build(out: Path) -> None:
    """Writes the model folder into `out` (runs inside the serving venv)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(SEED)
    out.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=SPECIAL_TOKENS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: bpe.token_to_id(t) for t in SPECIAL_TOKENS}

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
            projection_dim=64,
        ),
        text_config=LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=ids["<s>"],
            eos_token_id=ids["</s>"],
            pad_token_id=ids["<pad>"],
            tie_word_embeddings=False,
        ),
        image_token_index=ids["<image>"],
        image_seq_length=IMAGE_TOKENS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)

    # vLLM 0.32 maps checkpoint "model.vision_tower.X" to its CLIPVisionModel, whose
    # weights live under "vision_model."; transformers 5 saves them without that level.
    for weights in out.glob("*.safetensors"):
        tensors = load_file(weights)
        renamed = {}
        for key, value in tensors.items():
            head, sep, tail = key.partition("vision_tower.")
            if sep and not tail.startswith("vision_model."):
                key = f"{head}vision_tower.vision_model.{tail}"
            renamed[key] = value
        save_file(renamed, weights, metadata={"format": "pt"})
        # safetensors writes 0600; pods read the model as a non-root uid (from a volume).
        weights.chmod(0o644)

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)


def recipe_key() -> str:
    from . import envs

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(envs.env_dir("serve").name.encode())
    return digest.hexdigest()[:12]


def cached_path() -> Path:
    """Where the model folder is cached, built or not."""
    from . import envs

    return envs.cache_root() / "models" / f"tiny-llava-{recipe_key()}"


def tiny_model_path() -> Path:
    """The cached model folder, built with the serving venv on first use."""
    from . import envs

    final = cached_path()
    if (final / envs.MARKER).is_file():
        return final
    python = envs.serving_python()  # fails loudly with the install command

    def build(tmp: Path) -> dict:
        start = time.monotonic()
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        subprocess.run([str(python), __file__, "--out", str(tmp)], check=True, env=env)
        took = round(time.monotonic() - start, 1)
        print(f"[tiny-model] built {final.name} in {took}s", flush=True)
        return {"recipe_key": final.name, "build_s": took}

    envs.build_atomically(final, build)
    return final


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--out":
        _build(Path(sys.argv[2]))
    else:
        print(tiny_model_path())
